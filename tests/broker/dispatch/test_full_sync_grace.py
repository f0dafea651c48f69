"""A full sync (COMPLETE_ADD) built before a subscribe's answer reached the client does not undo that subscribe.

rocketmq-client-nodejs 1.0.8 sends its first full sync (the empty set) at start without waiting for it; a
``subscribeLite`` made right after start overtakes it, and the broker, taking the full sync as sent, dropped
the topic until the client's next full sync 30 s later (the Node quick start received its message after
30.0 s, against a 30 s timeout: the flake of tests/clients/test_examples.py[node]). A partial change answered
after the full sync arrived, or less than ``full_sync_grace_ms`` before, stays made; the client's next full
sync, built after the answer, is taken as sent. The real client's case: tests/clients/test_examples.py[node].
"""

from __future__ import annotations

import asyncio

import pytest

from lmq_broker import model
from lmq_broker.dispatch import subscriptions
from lmq_broker.dispatch.testing import GROUP, PARENT, Lite

pytestmark = pytest.mark.asyncio


def held(lite: Lite, client: str = "c") -> set[str]:
    """The client's lite topics (names) and patterns at the broker."""
    state = lite.dispatcher.registry.get(client)
    if state is None:
        return set()
    return {name.rsplit("$", 1)[1] for name in state.lite_topics} | set(state.patterns)


def grace(lite: Lite) -> int:
    return lite.dispatcher.config.full_sync_grace_ms


async def test_a_full_sync_sent_beside_a_subscribe_leaves_it_made(lite: Lite) -> None:
    # as the Node client's start: the subscribe arrives first, the full sync of the empty set while it is made
    add = asyncio.ensure_future(lite.dispatcher.add_lite("c", GROUP, PARENT, ["session-1"]))
    await asyncio.sleep(0)
    await asyncio.gather(add, lite.dispatcher.replace_lite("c", GROUP, PARENT, []))
    assert held(lite) == {"session-1"}
    await lite.send("session-1")
    assert await lite.drain("c", 1) == ["session-1"]


async def test_a_full_sync_arriving_within_the_grace_keeps_a_subscribe_and_a_later_one_replaces(lite: Lite) -> None:
    assert grace(lite) == 3_000  # the default: the official clients' request timeout
    await lite.dispatcher.add_lite("c", GROUP, PARENT, ["a", "b"])
    lite.clock.advance(grace(lite))
    await lite.dispatcher.replace_lite("c", GROUP, PARENT, ["a"])  # built before the answer: "b" stays
    assert held(lite) == {"a", "b"}
    lite.clock.advance(1)
    await lite.dispatcher.replace_lite("c", GROUP, PARENT, ["a"])  # built after it: as sent
    assert held(lite) == {"a"}


async def test_a_full_sync_within_the_grace_does_not_bring_back_an_unsubscribed_topic(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c", GROUP, PARENT, ["a", "b"])
    lite.clock.advance(grace(lite) + 1)
    await lite.dispatcher.remove_lite("c", GROUP, PARENT, ["b"])
    await lite.dispatcher.replace_lite("c", GROUP, PARENT, ["a", "b", "c"])  # built before the unsubscribe's answer
    assert held(lite) == {"a", "c"}
    await lite.send("b")
    await lite.send("c")
    assert await lite.drain("c", 1) == ["c"]
    lite.clock.advance(grace(lite) + 1)
    await lite.dispatcher.replace_lite("c", GROUP, PARENT, ["a", "b"])  # the client subscribed it again since
    assert held(lite) == {"a", "b"}


async def test_the_last_change_of_a_name_counts_and_patterns_are_kept_alike(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c", GROUP, PARENT, ["x", "s-*"])
    await lite.dispatcher.remove_lite("c", GROUP, PARENT, ["x"])
    await lite.dispatcher.add_lite("c", GROUP, PARENT, ["x"])
    await lite.dispatcher.replace_lite("c", GROUP, PARENT, [])
    assert held(lite) == {"x", "s-*"}
    await lite.send("s-1")
    assert await lite.drain("c", 1) == ["s-1"]


async def test_a_full_sync_that_the_kept_names_would_take_past_the_quota_is_taken_as_sent(lite: Lite) -> None:
    lite.put_group(model.LiteGroup(GROUP, PARENT, client_quota=2))
    await lite.dispatcher.add_lite("c", GROUP, PARENT, ["a"])
    await lite.dispatcher.replace_lite("c", GROUP, PARENT, ["b", "c"])  # with "a": 3 > 2; the client's own set fits
    assert held(lite) == {"b", "c"}


async def test_a_complete_remove_or_a_gone_client_forgets_the_recent_changes(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c", GROUP, PARENT, ["a"])
    await lite.dispatcher.remove_all_lite("c", GROUP, PARENT)
    await lite.dispatcher.replace_lite("c", GROUP, PARENT, [])
    assert held(lite) == set()
    await lite.dispatcher.add_lite("d", GROUP, PARENT, ["a"])
    lite.dispatcher.client_gone("d")
    await lite.dispatcher.replace_lite("d", GROUP, PARENT, [])  # the id again: a new client
    assert held(lite, "d") == set()


async def test_recent_changes_are_capped_per_client(lite: Lite) -> None:
    cap = subscriptions.RECENT_PER_CLIENT
    for start in range(0, cap + 500, 250):
        await lite.dispatcher.add_lite("c", GROUP, PARENT, [f"t{n}" for n in range(start, start + 250)])
    recent = lite.dispatcher.subscriptions._recent["c"]  # the bound is the point
    assert len(recent) == cap
    await lite.dispatcher.replace_lite("c", GROUP, PARENT, [])  # the newest are kept; older ones go
    names = held(lite)
    assert len(names) == cap and f"t{cap + 499}" in names and "t0" not in names


async def test_a_topic_taken_by_an_exclusive_peer_is_not_taken_back_by_a_full_sync_within_the_grace(lite: Lite) -> None:
    lite.put_group(model.LiteGroup(GROUP, PARENT, model=model.SubscriptionModel.EXCLUSIVE))
    await lite.dispatcher.add_lite("a", GROUP, PARENT, ["x"])
    await lite.dispatcher.add_lite("b", GROUP, PARENT, ["x"])  # the newest subscriber takes it
    await lite.dispatcher.replace_lite("a", GROUP, PARENT, [])  # a's, built before its own subscribe's answer
    assert (held(lite, "a"), held(lite, "b")) == (set(), {"x"})
    await lite.send("x")
    assert await lite.drain("b", 1) == ["x"]
