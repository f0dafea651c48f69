"""Wildcard lite groups on the dispatcher, over both stores: every lite topic of the parent, no per-topic
subscriptions, backlog found on registration, order and acks as for any lite group."""

from __future__ import annotations

import asyncio

import pytest

from lmq_broker import errors, model
from lmq_broker.dispatch.dispatcher import Delivery
from lmq_broker.dispatch.testing import GROUP, PARENT, Lite, background_done

pytestmark = pytest.mark.asyncio
WILD = "wild-group"


async def wildcard(lite: Lite, capacity: int = 100) -> None:
    lite.put_group(model.LiteGroup(WILD, PARENT, wildcard=True, ready_capacity=capacity))


async def receive(lite: Lite, client: str, group: str = WILD, batch: int = 32) -> list[Delivery]:
    return await lite.dispatcher.receive_lite(client, group, PARENT, batch=batch, invisible_ms=10_000, poll_ms=0)


async def receive_until(lite: Lite, client: str, count: int, *, ack: bool = True, batch: int = 32) -> list[Delivery]:
    """Receive (and ack) until ``count`` deliveries arrived; the registration's catch-up runs as a task."""
    got: list[Delivery] = []
    for _ in range(500):
        received = await receive(lite, client, batch=batch)
        got += received
        for d in received if ack else ():
            await lite.dispatcher.ack(WILD, d.receipt_handle)
        if len(got) >= count:
            return got
        await asyncio.sleep(0.005)  # between tries, as Lite.drain: the loop runs the catch-up task
        lite.clock.advance(lite.dispatcher.ready.catchup_delay_ms)  # a full ready set resumes on the timer
        lite.dispatcher.tick()
    raise AssertionError(f"{len(got)} of {count} deliveries")


async def test_a_wildcard_client_gets_every_new_lite_topic_without_subscribing_to_any(lite: Lite) -> None:
    await wildcard(lite)
    added, removed = await lite.dispatcher.replace_lite("w", WILD, PARENT, [])
    assert (added, removed) == ([], [])
    await lite.dispatcher.add_lite("plain", GROUP, PARENT, ["t0"])
    for name in ("t0", "t1", "t2"):
        await lite.send(name, name.encode())
    got = await receive_until(lite, "w", 3)
    assert sorted(d.message.lite_topic or "" for d in got) == ["t0", "t1", "t2"]
    assert [d.message.lite_topic for d in await lite.receive("plain")] == ["t0"]  # its own group, its own topic
    assert lite.dispatcher.subscription_count() == 1  # the wildcard client holds no per-topic subscription


async def test_per_topic_subscriptions_to_a_wildcard_group_are_refused(lite: Lite) -> None:
    await wildcard(lite)
    with pytest.raises(errors.Conflict) as refused:
        await lite.dispatcher.add_lite("w", WILD, PARENT, ["t1"])
    assert refused.value.fields.get("kind") == "group" and "subscribeLiteAll" in refused.value.message


async def test_registration_finds_the_backlog_of_every_topic(lite: Lite) -> None:
    await wildcard(lite, capacity=10)  # fewer ready slots than backlogged topics: the catch-up resumes
    names = [f"b{i:03d}" for i in range(40)]
    for name in names:
        await lite.send(name)
    await lite.dispatcher.replace_lite("w", WILD, PARENT, ["ignored"])
    got = await receive_until(lite, "w", len(names))
    assert sorted(d.message.lite_topic or "" for d in got) == names


async def test_an_overflow_behind_where_a_wildcard_catchup_stopped_is_found(lite: Lite) -> None:
    """A pass stopped by a full ready queue resumes after the last topic that fitted, goes to the end of the
    parent, then round from its start: a topic before the resume point may have overflowed since."""
    await wildcard(lite, capacity=2)
    await lite.send("a0")
    await lite.dispatcher.replace_lite("w", WILD, PARENT, [])
    await background_done(lite.dispatcher)
    (first,) = await receive(lite, "w")
    await lite.dispatcher.ack(WILD, first.receipt_handle)
    for name in ("a1", "a2", "a3", "a4"):
        await lite.send(name)  # a1 and a2 are queued, a3 and a4 overflow
    await asyncio.sleep(0)
    lite.clock.advance(lite.dispatcher.ready.catchup_delay_ms)
    lite.dispatcher.tick()
    await background_done(lite.dispatcher)  # the pass walks a0 (nothing to do) and stops at a3 (still full)
    await lite.send("a0")  # behind where the pass stopped, and the queue is full
    got = await receive_until(lite, "w", 5)
    assert sorted(d.message.lite_topic or "" for d in got) == ["a0", "a1", "a2", "a3", "a4"]


async def test_order_per_topic_holds_for_a_wildcard_group(lite: Lite) -> None:
    await wildcard(lite)
    await lite.dispatcher.replace_lite("w", WILD, PARENT, [])
    await lite.send("t1", b"a")
    await lite.send("t1", b"b")
    (first,) = await receive_until(lite, "w", 1, ack=False, batch=1)
    assert first.message.body == b"a"
    assert await receive(lite, "w") == []  # b waits while a is leased
    await lite.dispatcher.ack(WILD, first.receipt_handle)
    (second,) = await receive_until(lite, "w", 1, batch=1)
    assert second.message.body == b"b" and lite.committed("t1", WILD) == 2


async def test_unregistering_stops_deliveries(lite: Lite) -> None:
    await wildcard(lite)
    await lite.dispatcher.replace_lite("w", WILD, PARENT, [])
    await lite.dispatcher.remove_all_lite("w", WILD, PARENT)
    await lite.dispatcher.add_lite("plain", GROUP, PARENT, ["t1", "t2"])
    await lite.send("t1")
    assert [d.message.lite_topic for d in await lite.receive("plain")] == ["t1"]  # barrier: t1 was dispatched
    await background_done(lite.dispatcher)
    assert await receive(lite, "w") == []
    await lite.dispatcher.replace_lite("w", WILD, PARENT, [])  # back: the message is still there
    (got,) = await receive_until(lite, "w", 1)
    assert got.message.lite_topic == "t1"
    lite.dispatcher.client_gone("w")
    await lite.send("t2")
    assert [d.message.lite_topic for d in await lite.receive("plain")] == ["t2"]
    await background_done(lite.dispatcher)
    assert await receive(lite, "w") == []


async def test_two_clients_of_a_wildcard_group_share_its_topics(lite: Lite) -> None:
    await wildcard(lite)
    await lite.dispatcher.replace_lite("w1", WILD, PARENT, [])
    await lite.dispatcher.replace_lite("w2", WILD, PARENT, [])
    for i in range(10):
        await lite.send(f"s{i}")
    await background_done(lite.dispatcher)
    first, second = await receive(lite, "w1"), await receive(lite, "w2")
    names = sorted(d.message.lite_topic or "" for d in first + second)
    assert names == sorted(f"s{i}" for i in range(10))  # each topic offered to exactly one of them
