"""Subscriptions (``dispatch.subscriptions``) through the dispatcher: catch-up passes, clients coming and going,
quotas and models of lite groups, and compare-and-delete marks against subscriptions made meanwhile."""

from __future__ import annotations

import asyncio
import threading

import pytest

from lmq_broker import errors, model
from lmq_broker.admin import reclaiming
from lmq_broker.dispatch import reclaims
from lmq_broker.dispatch.dispatcher import OffsetPolicy, OffsetReset
from lmq_broker.dispatch.subscriptions import lmq_name
from lmq_broker.dispatch.testing import GROUP, PARENT, Lite, background_done, until
from lmq_broker.storage.api import Store
from lmq_broker.storage.testing import another_writer

pytestmark = pytest.mark.asyncio


async def test_overflow_schedules_a_catchup_that_finds_the_rest(lite: Lite) -> None:
    lite.put_group(model.LiteGroup(GROUP, PARENT, ready_capacity=2))
    topics = [f"t{i}" for i in range(6)]
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, topics)
    for t in topics:
        await lite.send(t)
    assert lite.dispatcher.ready.size("c1") == 2
    assert lite.dispatcher.ready.catchup_pending("c1")
    seen: set[str] = set()
    for _ in range(10):
        for d in await lite.receive("c1"):
            assert d.message.lite_topic is not None
            seen.add(d.message.lite_topic)
            await lite.dispatcher.ack(GROUP, d.receipt_handle)
        if seen == set(topics):
            break
        lite.clock.advance(lite.dispatcher.ready.catchup_delay_ms)
        lite.dispatcher.tick()
        await background_done(lite.dispatcher)
    assert seen == set(topics)


async def consume_rounds(lite: Lite, client: str, rounds: int) -> set[str]:
    """Receive and ack, then let the catch-up delay pass, ``rounds`` times; the lite topics seen."""
    seen: set[str] = set()
    for _ in range(rounds):
        for d in await lite.receive(client):
            assert d.message.lite_topic is not None
            seen.add(d.message.lite_topic)
            await lite.dispatcher.ack(GROUP, d.receipt_handle)
        lite.clock.advance(lite.dispatcher.ready.catchup_delay_ms)
        lite.dispatcher.tick()
        await background_done(lite.dispatcher)
    return seen


def walk_order(lite: Lite, client: str) -> list[str]:
    """The client's lite topics in the order a catch-up pass walks them."""
    state = lite.dispatcher.registry.get(client)
    assert state is not None
    return [model.QueueId(lmq).lite_parts()[1] for lmq in state.lite_topics]


async def test_an_overflow_behind_where_a_catchup_stopped_is_found(lite: Lite) -> None:
    """A pass stopped by a full ready queue resumes there; a topic it had walked already, which overflowed
    since, is walked again too (it used to wait for its next message)."""
    lite.put_group(model.LiteGroup(GROUP, PARENT, ready_capacity=2))
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, [f"t{i}" for i in range(6)])
    order = walk_order(lite, "c1")
    for t in order[1:5]:
        await lite.send(t)  # the first two are queued, the next two overflow
    await asyncio.sleep(0)
    lite.clock.advance(lite.dispatcher.ready.catchup_delay_ms)
    lite.dispatcher.tick()
    await background_done(lite.dispatcher)  # walks order[0] (nothing yet), stops at order[3] (still full)
    await lite.send(order[0])  # behind where the pass stopped, and the queue is full
    await asyncio.sleep(0)
    assert await consume_rounds(lite, "c1", 6) == set(order[:5])


async def test_a_catchup_due_while_one_runs_is_not_dropped(lite: Lite, monkeypatch: pytest.MonkeyPatch) -> None:
    lite.put_group(model.LiteGroup(GROUP, PARENT, ready_capacity=2))
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, [f"t{i}" for i in range(6)])
    order = walk_order(lite, "c1")
    probed, release = asyncio.Event(), asyncio.Event()
    probe = lite.dispatcher.deliverer.pending_among

    async def slow_probe(lmqs: list[str], group: str) -> list[str]:
        found = await probe(lmqs, group)
        probed.set()
        await release.wait()  # the pass is still running when the next one comes due
        return found

    monkeypatch.setattr(lite.dispatcher.deliverer, "pending_among", slow_probe)
    lite.dispatcher.resync()  # a pass over the topics, which are all empty
    await probed.wait()
    for t in order[:3]:
        await lite.send(t)  # the third overflows: a catch-up is asked for
    await asyncio.sleep(0)
    lite.clock.advance(lite.dispatcher.ready.catchup_delay_ms)
    lite.dispatcher.tick()  # it is due while the first pass runs
    release.set()
    await background_done(lite.dispatcher)
    assert await consume_rounds(lite, "c1", 4) == set(order[:3])


async def test_a_gone_client_hands_its_pending_topics_to_its_peers(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1")
    await asyncio.sleep(0)
    await lite.dispatcher.add_lite("c2", GROUP, PARENT, ["t1"])
    holder = "c1" if lite.dispatcher.ready.size("c1") else "c2"
    other = "c2" if holder == "c1" else "c1"
    lite.dispatcher.client_gone(holder)
    assert lite.dispatcher.registry.get(holder) is None
    (d,) = await lite.receive(other)
    assert d.message.lite_topic == "t1"


async def test_silent_clients_expire_with_their_subscriptions(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1", "t2"])
    assert lite.dispatcher.subscription_count() == 2
    lite.clock.advance(lite.dispatcher.config.client_expiry_ms + 10_001)
    lite.dispatcher.tick()
    assert lite.dispatcher.client_count() == 0
    assert lite.dispatcher.subscription_count() == 0


async def test_subscription_quota_of_the_group(lite: Lite) -> None:
    lite.put_group(model.LiteGroup(GROUP, PARENT, client_quota=2))
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["a", "b"])
    with pytest.raises(errors.SubscriptionQuotaExceeded):
        await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["c"])
    lite.store.put_quota(model.Quota("broker", max_subscriptions_per_client=1))
    lite.dispatcher.metadata_changed()
    with pytest.raises(errors.SubscriptionQuotaExceeded):
        await lite.dispatcher.add_lite("c2", GROUP, PARENT, ["a", "b"])


async def test_unknown_group_or_wrong_binding_is_refused(lite: Lite) -> None:
    with pytest.raises(errors.GroupNotFound):
        await lite.dispatcher.add_lite("c1", "nope", PARENT, ["t"])
    lite.store.put_parent_topic(model.ParentTopic("Q"))
    lite.dispatcher.metadata_changed()
    with pytest.raises(errors.Conflict):
        await lite.dispatcher.add_lite("c1", GROUP, "Q", ["t"])
    with pytest.raises(errors.TopicNotFound):
        await lite.dispatcher.add_lite("c1", GROUP, "missing", ["t"])


@pytest.mark.parametrize(
    ("reset", "expected"),
    [
        (OffsetReset(OffsetPolicy.MIN), b"0"),
        (OffsetReset(OffsetPolicy.MAX), None),
        (OffsetReset(OffsetPolicy.OFFSET, 2), b"2"),
        (OffsetReset(OffsetPolicy.TIMESTAMP, 1), b"0"),
    ],
)
async def test_offset_option_on_subscribe(lite: Lite, reset: OffsetReset, expected: bytes | None) -> None:
    for i in range(3):
        await lite.send("t1", str(i).encode())
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"], offset=reset)
    got = await lite.receive("c1", batch=1)
    assert (got[0].message.body if got else None) == expected


async def test_a_new_group_starts_at_the_min_offset_and_commits_nothing_on_subscribe(lite: Lite) -> None:
    """The start of a group with no offset (docs/protocol.md, "Where a new group starts"): every message the
    lite topic retains, including those stored before the subscription (RocketMQ 5.5.0 starts there too
    while offset 0 is in memory, else at the last message); no offset is written until an ack."""
    for i in range(3):
        await lite.send("t1", str(i).encode())
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    for d in await lite.receive("c1"):
        await lite.dispatcher.ack(GROUP, d.receipt_handle)
    lite.put_group(model.LiteGroup("late", PARENT))  # a group created after the messages were stored
    await lite.dispatcher.add_lite("c2", "late", PARENT, ["t1"])
    queue = model.QueueId.lmq(PARENT, "t1")
    assert lite.store.get_offset(queue, "late") is None
    got = await lite.dispatcher.receive_lite("c2", "late", PARENT, batch=32, invisible_ms=10_000, poll_ms=0)
    assert [d.message.body for d in got] == [b"0", b"1", b"2"]
    for d in got:
        await lite.dispatcher.ack("late", d.receipt_handle)
    assert lite.store.get_offset(queue, "late") == 3


async def test_trigger_dispatch_offers_pending_topics_to_the_group_now(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1", "t2"])
    await lite.send("t1", b"x")
    await asyncio.sleep(0)
    lite.dispatcher.ready.discard_many("c1", [lmq_name(PARENT, "t1")])  # an offer lost: nothing tells c1 now
    assert await lite.receive("c1") == []
    assert await lite.dispatcher.trigger_dispatch(GROUP, PARENT, ["t3"]) == []  # no subscriber: not offered
    assert await lite.dispatcher.trigger_dispatch(GROUP, PARENT, []) == ["t1"]  # t2 has no work
    assert [d.message.body for d in await lite.receive("c1")] == [b"x"]
    assert lite.dispatcher.lite_topics_of("c1") == ["t1", "t2"]
    assert lite.dispatcher.lite_topics_of("nobody") is None


async def test_tail_n_moves_an_existing_offset_back(lite: Lite) -> None:
    for i in range(5):
        await lite.send("t1", str(i).encode())
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"], offset=OffsetReset(OffsetPolicy.MAX))
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"], offset=OffsetReset(OffsetPolicy.TAIL_N, 2))
    got = await lite.receive("c1")
    assert [d.message.body for d in got] == [b"3", b"4"]


async def test_forget_lite_topic_drops_subscriptions_and_events(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1")
    await asyncio.sleep(0)
    lmq = model.QueueId.lmq(PARENT, "t1")
    assert lite.dispatcher.subscribers(lmq) == ["c1"]
    lite.dispatcher.forget_lite_topic(lmq)
    assert lite.dispatcher.subscriber_count(lmq) == 0
    assert lite.dispatcher.ready.size("c1") == 0


async def test_client_views_for_the_admin_service(lite: Lite) -> None:
    lite.dispatcher.client_seen("c1", client_type=5, group=GROUP, bind_topic=PARENT)
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["a", "b"])
    (view,) = lite.dispatcher.clients(GROUP)
    assert (view.client_id, view.topic, view.subscription_count, view.client_type) == ("c1", PARENT, 2, 5)
    assert lite.dispatcher.clients("other") == []


async def test_exclusive_group_gives_a_topic_to_its_newest_subscriber(lite: Lite) -> None:
    lite.put_group(model.LiteGroup(GROUP, PARENT, model=model.SubscriptionModel.EXCLUSIVE))
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1", "t2"])
    await lite.dispatcher.add_lite("c2", GROUP, PARENT, ["t1"])
    assert lite.dispatcher.subscribers(model.QueueId.lmq(PARENT, "t1")) == ["c2"]
    assert lite.dispatcher.subscribers(model.QueueId.lmq(PARENT, "t2")) == ["c1"]
    await lite.send("t1")
    assert await lite.receive("c1") == []
    assert len(await lite.receive("c2")) == 1


async def test_a_group_with_consumption_disabled_refuses_subscribe_and_receive(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    lite.put_group(model.LiteGroup(GROUP, PARENT, consume_enabled=False))
    with pytest.raises(errors.Conflict):
        await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t2"])
    with pytest.raises(errors.Conflict):
        await lite.receive("c1")


# --- a compare-and-delete against subscriptions made meanwhile ---------------------------------------------------
def _scanned(store: Store, lites: list[str], subscribers: list[int] | None = None) -> reclaiming.Rows:
    """The reclaimer's rows for ``lites`` as a scan sees them now (it scans parents whose topics expire: a parent
    that never expires keeps them at the delete too)."""
    store.put_parent_topic(model.ParentTopic(PARENT, expiration_minutes=0))
    metas = [store.lite_topic(PARENT, lite) for lite in lites]
    assert all(m is not None for m in metas)
    return reclaiming.Rows(
        [PARENT] * len(lites),
        list(lites),
        [m.max_offset for m in metas if m is not None],
        [m.last_store_ms for m in metas if m is not None],
        [m.last_consume_ms for m in metas if m is not None],
        subscribers or [],
    )


async def test_a_subscription_made_while_the_delete_waits_for_the_store_keeps_the_topic(lite: Lite) -> None:
    await lite.send("t1")
    await lite.send("t2")
    rows = _scanned(lite.store, ["t1", "t2"])
    t1 = model.QueueId.lmq(PARENT, "t1")
    with another_writer(lite.store):  # the delete is sent to a store thread and waits there for the write lock
        deleting = asyncio.create_task(
            reclaiming.compare_and_delete(lite.store, lite.dispatcher, rows, require_no_subscribers=True, dry_run=False)
        )
        await asyncio.sleep(0)  # its first step: the subscriber check and the marks, then off to the store thread
        assert lite.dispatcher.reclaims_in_flight() == 2
        subscribing = asyncio.create_task(lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"]))
        await until(lambda: lite.dispatcher.subscriber_count(t1) == 1)  # registered during the delete call
        assert not deleting.done()
    outcomes = await asyncio.wait_for(deleting, 10)
    await asyncio.wait_for(subscribing, 10)

    assert outcomes == [reclaiming.Outcome.KEPT_SUBSCRIBED, reclaiming.Outcome.DELETED]
    assert lite.store.lite_topic(PARENT, "t1") is not None
    assert lite.store.lite_topic(PARENT, "t2") is None
    assert lite.dispatcher.subscribers(t1) == ["c1"]
    assert lite.dispatcher.reclaims_in_flight() == 0
    (got,) = await lite.receive("c1")  # the subscription is live: the message stored before the scan comes
    assert got.message.lite_topic == "t1"


@pytest.mark.parametrize("require_no_subscribers", [True, False])
async def test_a_subscription_made_once_the_delete_is_under_way_waits_for_it_and_survives(
    lite: Lite, monkeypatch: pytest.MonkeyPatch, require_no_subscribers: bool
) -> None:
    await lite.send("t1")
    rows = _scanned(lite.store, ["t1"])
    t1 = model.QueueId.lmq(PARENT, "t1")
    closed, go_on = threading.Event(), threading.Event()
    close = reclaims.Mark.close

    def close_and_hold(mark: reclaims.Mark) -> frozenset[str]:  # runs under the store's write lock
        kept = close(mark)
        closed.set()
        go_on.wait(10)
        return kept

    monkeypatch.setattr(reclaims.Mark, "close", close_and_hold)
    deleting = asyncio.create_task(
        reclaiming.compare_and_delete(
            lite.store, lite.dispatcher, rows, require_no_subscribers=require_no_subscribers, dry_run=False
        )
    )
    assert await asyncio.to_thread(closed.wait, 10)
    subscribing = asyncio.create_task(lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"]))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not subscribing.done() and lite.dispatcher.subscriber_count(t1) == 0  # waiting for the delete
    go_on.set()

    assert await asyncio.wait_for(deleting, 10) == [reclaiming.Outcome.DELETED]
    assert await asyncio.wait_for(subscribing, 10) == [lmq_name(PARENT, "t1")]
    assert lite.store.lite_topic(PARENT, "t1") is None
    assert lite.dispatcher.subscribers(t1) == ["c1"]  # registered after the delete, not dropped by it
    await lite.send("t1", b"again")  # a producer re-creates the topic: the subscriber gets it
    (got,) = await lite.receive("c1")
    assert got.message.body == b"again"


async def test_only_subscribers_beyond_those_the_scan_saw_keep_a_topic(lite: Lite) -> None:
    for lite_topic in ("seen", "grew", "none", "new"):
        await lite.send(lite_topic)
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["seen", "grew"])
    rows = _scanned(lite.store, ["seen", "grew", "none", "new"], subscribers=[1, 1, 0, 0])
    await lite.dispatcher.add_lite("c2", GROUP, PARENT, ["grew", "new"])  # after the scan

    outcomes = await reclaiming.compare_and_delete(
        lite.store, lite.dispatcher, rows, require_no_subscribers=True, dry_run=False
    )

    kept, deleted = reclaiming.Outcome.KEPT_SUBSCRIBED, reclaiming.Outcome.DELETED
    assert outcomes == [deleted, kept, deleted, kept]
    assert sorted(lite.dispatcher.subscribers(model.QueueId.lmq(PARENT, "grew"))) == ["c1", "c2"]
    assert lite.dispatcher.subscribers(model.QueueId.lmq(PARENT, "seen")) == []  # deleted as the scan judged it
    assert lite.dispatcher.reclaims_in_flight() == 0
