"""Subscription registry: both directions agree, quotas are all-or-nothing, clients expire by time."""

from __future__ import annotations

import pytest

from lmq_broker import errors
from lmq_broker.dispatch.registry import Registry
from lmq_broker.model import UNLIMITED


def test_add_links_both_directions_and_counts_pairs() -> None:
    reg = Registry()
    assert reg.add("c1", ["a", "b"], UNLIMITED, now_ms=0) == ["a", "b"]
    assert reg.add("c2", ["b"], UNLIMITED, now_ms=0) == ["b"]
    assert reg.subscribers("a") == ("c1",)
    assert sorted(reg.subscribers("b")) == ["c1", "c2"]
    assert reg.subscriber_count("b") == 2
    assert reg.pair_count() == 3
    state = reg.get("c1")
    assert state is not None and state.lite_topics == {"a", "b"}


def test_re_adding_is_idempotent() -> None:
    reg = Registry()
    reg.add("c1", ["a"], UNLIMITED, 0)
    assert reg.add("c1", ["a", "a"], UNLIMITED, 0) == []
    assert reg.pair_count() == 1


def test_remove_unlinks_and_collapses_reverse_sets() -> None:
    reg = Registry()
    reg.add("c1", ["a"], UNLIMITED, 0)
    reg.add("c2", ["a"], UNLIMITED, 0)
    assert reg.remove("c1", ["a", "zzz"], 0) == ["a"]
    assert reg.subscribers("a") == ("c2",)
    reg.remove("c2", ["a"], 0)
    assert reg.subscribers("a") == ()
    assert reg.pair_count() == 0


def test_client_quota_rejects_the_whole_request() -> None:
    reg = Registry()
    reg.add("c1", ["a", "b"], 3, 0)
    with pytest.raises(errors.SubscriptionQuotaExceeded):
        reg.add("c1", ["c", "d"], 3, 0)
    state = reg.get("c1")
    assert state is not None and state.lite_topics == {"a", "b"}
    assert reg.subscribers("c") == ()


def test_broker_wide_pair_limit() -> None:
    reg = Registry(max_pairs=2)
    reg.add("c1", ["a", "b"], UNLIMITED, 0)
    with pytest.raises(errors.SubscriptionQuotaExceeded):
        reg.add("c2", ["a"], UNLIMITED, 0)
    reg.remove("c1", ["a"], 0)
    assert reg.add("c2", ["a"], UNLIMITED, 0) == ["a"]


def test_replace_diffs_the_set() -> None:
    reg = Registry()
    reg.add("c1", ["a", "b"], UNLIMITED, 0)
    added, removed = reg.replace("c1", ["b", "c"], UNLIMITED, 0)
    assert (added, removed) == (["c"], ["a"])
    assert reg.subscribers("a") == ()
    assert reg.subscribers("c") == ("c1",)
    assert reg.pair_count() == 2


def test_replace_respects_quota_on_the_final_size() -> None:
    reg = Registry()
    reg.add("c1", ["a", "b"], UNLIMITED, 0)
    added, removed = reg.replace("c1", ["c", "d"], 2, 0)
    assert (added, sorted(removed)) == (["c", "d"], ["a", "b"])
    with pytest.raises(errors.SubscriptionQuotaExceeded):
        reg.replace("c1", ["c", "d", "e"], 2, 0)


def test_drop_removes_every_subscription() -> None:
    reg = Registry()
    reg.add("c1", ["a", "b"], UNLIMITED, 0)
    reg.add("c2", ["b"], UNLIMITED, 0)
    dropped = reg.drop("c1")
    assert dropped is not None and dropped.lite_topics == {"a", "b"}
    assert reg.subscribers("a") == ()
    assert reg.subscribers("b") == ("c2",)
    assert reg.pair_count() == 1
    assert reg.get("c1") is None
    assert reg.drop("c1") is None


def test_forget_lmq_drops_it_from_every_holder() -> None:
    reg = Registry()
    reg.add("c1", ["a", "b"], UNLIMITED, 0)
    reg.add("c2", ["a"], UNLIMITED, 0)
    assert sorted(reg.forget_lmq("a")) == ["c1", "c2"]
    assert reg.subscribers("a") == ()
    c1 = reg.get("c1")
    assert c1 is not None and c1.lite_topics == {"b"}
    assert reg.pair_count() == 1


def test_idle_clients_by_last_seen() -> None:
    reg = Registry()
    reg.touch("old", now_ms=1_000)
    reg.touch("fresh", now_ms=5_000)
    assert reg.idle_since(4_000) == ["old"]
    reg.add("old", ["a"], UNLIMITED, now_ms=6_000)  # subscribing refreshes
    assert reg.idle_since(4_000) == []


def test_a_client_keeps_its_group() -> None:
    reg = Registry()
    reg.touch("c1", 0, group="g1")
    reg.touch("c1", 0, group="g1")
    with pytest.raises(errors.Conflict):
        reg.touch("c1", 0, group="g2")
