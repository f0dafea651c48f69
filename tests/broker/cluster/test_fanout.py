"""The intents an access broker keeps of its clients' subscriptions (cluster.fanout): changes that run at the
same time and end in any order, as a client's periodic full sync crossing a subscribe that waits for a down
broker. The whole path with real brokers and the official clients: tests/e2e/test_cluster_faults.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lmq_broker.cluster import fanout as fanout_module
from lmq_broker.cluster.fanout import Fanout
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb

pytestmark = pytest.mark.unit
KEY = ("client-1", "group", "P")


def fanout(grace_ms: int = 0) -> Any:
    config = SimpleNamespace(max_subscriptions_per_broker=100, full_sync_grace_ms=grace_ms)
    links = SimpleNamespace(config=config, size=2)
    return Fanout(links, owners=None, subscribers=lambda *_: [], known=lambda _: True)  # type: ignore[arg-type]


def at(n: int, ms: int | None = None) -> tuple[int, int]:
    """A change's beginning or end: its number, and its clock (ms; by default far apart, so no grace applies)."""
    return n, n * 1_000_000 if ms is None else ms


def held(f: Any) -> tuple[set[str], set[str]]:
    intent = f._intents.get(KEY)
    return (set(intent.lites), set(intent.patterns)) if intent else (set(), set())


def test_a_full_sync_that_began_before_a_subscribe_ended_keeps_what_the_subscribe_added() -> None:
    f = fanout()
    f._remember(*KEY, pb.COMPLETE_ADD, ["a"], at(1), at(2))
    # the subscribe of "x" begins (3), the client's full sync begins (4) without "x", the subscribe ends (5),
    # then the full sync (6)
    f._remember(*KEY, pb.PARTIAL_ADD, ["x"], at(3), at(5))
    f._remember(*KEY, pb.COMPLETE_ADD, ["a", "s-*"], at(4), at(6))
    assert held(f) == ({"a", "x"}, {"s-*"})
    f._remember(*KEY, pb.COMPLETE_ADD, ["a"], at(7), at(8))  # begun after the subscribe ended: the client's whole set
    assert held(f) == ({"a"}, set())
    assert f.intents == 1


def test_a_removal_takes_away_only_what_was_added_before_it_began() -> None:
    f = fanout()
    f._remember(*KEY, pb.PARTIAL_ADD, ["x"], at(2), at(5))
    f._remember(*KEY, pb.PARTIAL_REMOVE, ["x"], at(4), at(6))  # begun before the add ended: the add wins
    assert held(f) == ({"x"}, set())
    f._remember(*KEY, pb.PARTIAL_REMOVE, ["x"], at(7), at(8))
    assert held(f) == (set(), set()) and f.intents == 0
    f._remember(*KEY, pb.PARTIAL_ADD, ["y"], at(9), at(11))
    f._remember(*KEY, pb.COMPLETE_REMOVE, [], at(10), at(12))
    assert held(f) == ({"y"}, set())


def test_a_full_sync_arriving_soon_after_a_subscribe_ended_keeps_it() -> None:
    """Node 1.0.8 sends its first full sync (empty) unawaited at start: it can arrive after a subscribe sent
    after it was answered. Within --full-sync-grace-ms the subscribe stays in the intent (so a restarted owner
    gets it again), as the owner keeps it (dispatch.subscriptions); an unsubscribe so answered stays made."""
    f = fanout(grace_ms=3_000)
    f._remember(*KEY, pb.PARTIAL_ADD, ["x", "y"], at(1, 10_000), at(2, 10_050))
    f._remember(*KEY, pb.PARTIAL_REMOVE, ["y"], at(3, 10_100), at(4, 10_150))
    f._remember(*KEY, pb.COMPLETE_ADD, ["y", "a"], at(5, 12_000), at(6, 12_010))  # built before both answers
    assert held(f) == ({"x", "a"}, set())
    f._remember(*KEY, pb.COMPLETE_ADD, ["a", "y"], at(7, 20_000), at(8, 20_010))  # past the grace: as sent
    assert held(f) == ({"a", "y"}, set())
    assert f.intents == 2


def test_with_no_grace_a_full_sync_after_a_subscribe_ended_is_taken_as_sent() -> None:
    f = fanout(grace_ms=0)
    f._remember(*KEY, pb.PARTIAL_ADD, ["x"], at(1, 10_000), at(2, 10_050))
    f._remember(*KEY, pb.PARTIAL_REMOVE, ["a"], at(3, 10_060), at(4, 10_070))
    f._remember(*KEY, pb.COMPLETE_ADD, ["a"], at(5, 10_100), at(6, 10_110))
    assert held(f) == ({"a"}, set())


def test_removals_remembered_per_intent_are_capped() -> None:
    f = fanout(grace_ms=3_000)
    names = [f"n{i}" for i in range(fanout_module.RECENT_REMOVALS + 500)]
    f._remember(*KEY, pb.PARTIAL_REMOVE, names, at(1, 10_000), at(2, 10_001))
    assert len(f._intents[KEY].removed) == fanout_module.RECENT_REMOVALS
    f._remember(*KEY, pb.PARTIAL_ADD, ["z"], at(3, 30_000), at(4, 30_001))  # later than the kept window
    assert f._intents[KEY].removed == {} and held(f) == ({"z"}, set())
