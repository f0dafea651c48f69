"""The dispatcher on a fake clock, over both stores: ordering, leases, redelivery, DLQ, catch-up, expiry."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from lmq_broker import errors, model
from lmq_broker.admin import reclaiming
from lmq_broker.dispatch import dispatcher as dispatcher_module
from lmq_broker.dispatch import reclaims
from lmq_broker.dispatch.delivery import STORE_RETRY_MS
from lmq_broker.dispatch.dispatcher import Delivery, Dispatcher, OffsetPolicy, OffsetReset
from lmq_broker.dispatch.leases import LeaseKey
from lmq_broker.dispatch.subscriptions import lmq_name
from lmq_broker.dispatch.testing import GROUP, PARENT, Lite, config_for, lite_message
from lmq_broker.storage import keys, memory
from lmq_broker.storage.api import Store
from lmq_broker.storage.testing import another_writer

pytestmark = pytest.mark.asyncio


async def test_subscribed_client_receives_and_ack_commits(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1", b"hello")
    (got,) = await lite.receive("c1")
    assert got.message.body == b"hello" and got.attempt == 1 and got.message.lite_topic == "t1"
    await lite.dispatcher.ack(GROUP, got.receipt_handle)
    assert lite.committed("t1") == 1


async def test_an_ack_commits_on_the_loop_when_no_writer_holds_the_store(
    lite: Lite, monkeypatch: pytest.MonkeyPatch
) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1", b"a")
    await lite.send("t1", b"b")
    first, second = await lite.receive("c1", batch=32)

    async def no_pool(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"went to the thread pool: {args}")

    monkeypatch.setattr(lite.dispatcher.runtime, "run", no_pool)
    await lite.dispatcher.ack(GROUP, first.receipt_handle)
    assert lite.committed("t1") == 1
    await lite.dispatcher.ack(GROUP, second.receipt_handle)
    assert lite.committed("t1") == 2


async def test_an_ack_while_another_writer_holds_the_store_commits_once_it_is_free(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1", b"a")
    await lite.send("t1", b"b")
    first, second = await lite.receive("c1", batch=32)
    with another_writer(lite.store):
        acking = asyncio.create_task(lite.dispatcher.ack(GROUP, first.receipt_handle))
        later = asyncio.create_task(lite.dispatcher.ack(GROUP, second.receipt_handle))
        await asyncio.sleep(0.2)
        assert not acking.done() and not later.done()  # the commits wait on the pool; the loop runs on
    await asyncio.wait_for(asyncio.gather(acking, later), 10)
    assert lite.committed("t1") == 2


async def test_nothing_is_handed_out_while_an_earlier_message_of_the_topic_is_leased(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1", b"a")
    (first,) = await lite.receive("c1")
    await lite.send("t1", b"b")
    assert await lite.receive("c1") == []
    await lite.dispatcher.ack(GROUP, first.receipt_handle)  # the ack re-offers the topic
    (second,) = await lite.receive("c1")
    assert second.message.body == b"b"


async def test_one_receive_takes_consecutive_messages_of_several_topics(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1", "t2"])
    for body in (b"1", b"2", b"3"):
        await lite.send("t1", body)
    await lite.send("t2", b"x")
    got = await lite.receive("c1", batch=32)
    assert sorted((d.message.lite_topic, d.message.body) for d in got) == [
        ("t1", b"1"), ("t1", b"2"), ("t1", b"3"), ("t2", b"x"),
    ]  # fmt: skip


async def test_a_waiting_receive_wakes_on_arrival(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    started = time.monotonic()
    waiting = asyncio.create_task(lite.receive("c1", poll_ms=10_000))
    await asyncio.sleep(0)  # let the receive park on its event
    assert not waiting.done()
    await lite.send("t1")
    got = await asyncio.wait_for(waiting, 5)
    assert len(got) == 1 and time.monotonic() - started < 5


async def test_expired_lease_is_redelivered_with_the_next_attempt(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1")
    (first,) = await lite.receive("c1", invisible_ms=5_000)
    lite.clock.advance(4_999)
    lite.dispatcher.tick()
    assert await lite.receive("c1") == []
    lite.clock.advance(1)
    lite.dispatcher.tick()
    (again,) = await lite.receive("c1")
    assert again.message.message_id == first.message.message_id and again.attempt == 2
    await lite.dispatcher.ack(GROUP, first.receipt_handle)  # late ack of the first lease still settles it
    assert lite.committed("t1") == 1


async def auto_renewed(lite: Lite) -> Delivery:
    """c1 subscribes to t1 and receives its one message as a push consumer does (auto_renew, one slice)."""
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1")
    (first,) = await lite.receive("c1", invisible_ms=lite.dispatcher.config.lease_renew_slice_ms, auto_renew=True)
    return first


async def test_an_auto_renew_lease_is_renewed_while_its_client_lives(lite: Lite) -> None:
    slice_ms = lite.dispatcher.config.lease_renew_slice_ms
    first = await auto_renewed(lite)
    await lite.dispatcher.add_lite("c2", GROUP, PARENT, ["t1"])  # after: the first offer goes to c1 alone
    for _ in range(5):  # a listener that runs for five slices: no redelivery meanwhile
        lite.clock.advance(slice_ms // 2)
        lite.dispatcher.tick()
        lite.dispatcher.registry.touch("c1", lite.clock())  # the client heartbeats
        assert await lite.receive("c2") == [] and await lite.receive("c1") == []
    await lite.dispatcher.ack(GROUP, first.receipt_handle)  # the handle of the first delivery still acks
    assert lite.committed("t1") == 1


async def test_an_auto_renew_lease_of_a_client_that_is_gone_expires_after_its_slice(lite: Lite) -> None:
    slice_ms = lite.dispatcher.config.lease_renew_slice_ms
    first = await auto_renewed(lite)
    await lite.dispatcher.add_lite("c2", GROUP, PARENT, ["t1"])  # after: the first offer goes to c1 alone
    lite.dispatcher.client_gone("c1")
    lite.clock.advance(slice_ms - 1)
    lite.dispatcher.tick()
    assert await lite.receive("c2") == []
    lite.clock.advance(1)
    lite.dispatcher.tick()
    (again,) = await lite.receive("c2")
    assert again.message.message_id == first.message.message_id and again.attempt == 2


async def test_an_auto_renew_lease_is_not_renewed_once_its_client_unsubscribed(lite: Lite) -> None:
    slice_ms = lite.dispatcher.config.lease_renew_slice_ms
    first = await auto_renewed(lite)
    await lite.dispatcher.remove_lite("c1", GROUP, PARENT, ["t1"])
    await lite.dispatcher.add_lite("c2", GROUP, PARENT, ["t1"])
    lite.clock.advance(slice_ms)
    lite.dispatcher.tick()
    (again,) = await lite.receive("c2")  # the new owner gets it once the old lease ends
    assert again.message.message_id == first.message.message_id and again.attempt == 2


async def test_an_auto_renew_lease_is_renewed_up_to_its_limit_only(
    store: Store, clock: memory.ManualClock, tmp_path: Path
) -> None:
    slice_ms, max_ms = 2_000, 7_000
    cfg = config_for(tmp_path / "unused", lease_renew_slice_ms=slice_ms, lease_renew_max_ms=max_ms)
    lite = await Lite.start(store, clock, cfg)
    try:
        first = await auto_renewed(lite)
        step = 500
        for _ in range(max_ms // step - 1):
            lite.clock.advance(step)
            lite.dispatcher.tick()
            lite.dispatcher.registry.touch("c1", lite.clock())
            assert await lite.receive("c1") == []
        lite.clock.advance(step)  # max_ms after the delivery: renewed no further
        lite.dispatcher.tick()
        (again,) = await lite.receive("c1", invisible_ms=slice_ms, auto_renew=True)
        assert again.message.message_id == first.message.message_id and again.attempt == 2
    finally:
        await lite.dispatcher.close()


async def test_a_nack_ends_auto_renewal(lite: Lite) -> None:
    first = await auto_renewed(lite)
    await lite.dispatcher.change_invisible(GROUP, first.receipt_handle, 1_000)
    lite.clock.advance(1_000)
    lite.dispatcher.tick()
    (again,) = await lite.receive("c1")
    assert again.attempt == 2


async def test_nack_redelivers_with_attempt_plus_one_and_suspend_does_not_count(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1")
    (d1,) = await lite.receive("c1", invisible_ms=60_000)
    await lite.dispatcher.change_invisible(GROUP, d1.receipt_handle, 1_000)
    lite.clock.advance(1_000)
    lite.dispatcher.tick()
    (d2,) = await lite.receive("c1")
    assert d2.attempt == 2
    await lite.dispatcher.change_invisible(GROUP, d2.receipt_handle, 200, suspend=True)
    lite.clock.advance(200)
    lite.dispatcher.tick()
    (d3,) = await lite.receive("c1")
    assert d3.attempt == 2


async def test_stale_receipt_cannot_change_visibility(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1")
    (d1,) = await lite.receive("c1")
    await lite.dispatcher.change_invisible(GROUP, d1.receipt_handle, 0)
    with pytest.raises(errors.InvalidReceiptHandle):
        await lite.dispatcher.change_invisible(GROUP, d1.receipt_handle, 0)


async def test_past_max_attempts_the_message_goes_to_the_dlq_and_is_committed(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1", b"poison")
    for attempt in (1, 2, 3):  # group G allows 3 attempts
        (d,) = await lite.receive("c1", invisible_ms=1_000)
        assert d.attempt == attempt
        lite.clock.advance(1_000)
        lite.dispatcher.tick()
    assert await lite.receive("c1") == []
    assert lite.committed("t1") == 1
    (dead,) = lite.store.read(model.QueueId(f"%DLQ%{GROUP}", 0), 0, 10)
    assert dead.body == b"poison" and dead.user_properties["__ORIGIN_LITE_TOPIC"] == "t1"


async def test_forward_to_dead_letter_queue_on_request(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1", b"give-up")
    await lite.send("t1", b"next")
    (d,) = await lite.receive("c1", batch=1)
    await lite.dispatcher.dead_letter(GROUP, d.receipt_handle)
    assert lite.committed("t1") == 1
    assert [m.body for m in lite.store.read(model.QueueId(f"%DLQ%{GROUP}", 0), 0, 10)] == [b"give-up"]
    (n,) = await lite.receive("c1")
    assert n.message.body == b"next"


async def test_subscribing_to_a_topic_with_backlog_offers_it_at_once(lite: Lite) -> None:
    await lite.send("t1", b"before")
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    (d,) = await lite.receive("c1")
    assert d.message.body == b"before"


async def test_unsubscribed_topics_are_not_delivered(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.dispatcher.remove_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1")
    assert await lite.receive("c1") == []


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
        await drain_background(lite.dispatcher)
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
        await drain_background(lite.dispatcher)
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
    await drain_background(lite.dispatcher)  # walks order[0] (nothing yet), stops at order[3] (still full)
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
    await drain_background(lite.dispatcher)
    assert await consume_rounds(lite, "c1", 4) == set(order[:3])


async def drain_background(dispatcher: Dispatcher) -> None:
    deadline = time.monotonic() + 5
    while dispatcher.runtime.tasks and time.monotonic() < deadline:
        await asyncio.sleep(0.001)


async def test_shared_group_offers_each_arrival_to_one_client(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.dispatcher.add_lite("c2", GROUP, PARENT, ["t1"])
    await lite.send("t1")
    await asyncio.sleep(0)  # the coalesced arrival flush runs on the next loop iteration
    sizes = sorted([lite.dispatcher.ready.size("c1"), lite.dispatcher.ready.size("c2")])
    assert sizes == [0, 1]


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


async def test_lite_topic_quota_per_parent_counts_only_new_topics(lite: Lite) -> None:
    lite.store.put_parent_topic(model.ParentTopic(PARENT, max_lite_topics=2))
    lite.dispatcher.metadata_changed()
    await lite.send("a")
    await lite.send("b")
    with pytest.raises(errors.LiteTopicQuotaExceeded):
        await lite.send("c")
    await lite.send("a")  # existing topics still take messages
    assert lite.store.lite_topic(PARENT, "c") is None


async def test_lite_topic_quota_per_broker(lite: Lite) -> None:
    lite.store.put_quota(model.Quota("broker", max_lite_topics=1))
    lite.dispatcher.metadata_changed()
    await lite.send("a")
    with pytest.raises(errors.LiteTopicQuotaExceeded):
        await lite.send("b")


async def test_send_rate_quota(lite: Lite) -> None:
    lite.store.put_quota(model.Quota(f"parent:{PARENT}", max_send_rate=2))
    lite.dispatcher.metadata_changed()
    await lite.send("a")
    await lite.send("a")
    with pytest.raises(errors.TooManyRequests):
        await lite.send("a")
    lite.clock.advance(1000)
    await lite.send("a")


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


class CountingStore:
    """Counts calls into a store, to prove arrivals never walk subscriptions or topics."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.inner, name)
        if not callable(target):
            return target

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            return target(*args, **kwargs)

        return counted


async def test_arrival_costs_the_same_with_10k_idle_subscriptions(tmp_path: Path, clock: memory.ManualClock) -> None:
    inner = memory.MemoryStore()
    inner.put_parent_topic(model.ParentTopic(PARENT))
    inner.put_group(model.LiteGroup(GROUP, PARENT, client_quota=-1))
    counting = CountingStore(inner)
    dispatcher = Dispatcher(counting, config_for(tmp_path), clock=clock)
    await dispatcher.start()
    try:
        await dispatcher.add_lite("c1", GROUP, PARENT, [f"idle-{i}" for i in range(10_000)] + ["hot"])
        counting.calls.clear()
        await dispatcher.send([lite_message("hot")])
        (d,) = await dispatcher.receive_lite("c1", GROUP, PARENT, batch=32, invisible_ms=1000, poll_ms=0)
        await dispatcher.ack(GROUP, d.receipt_handle)
        calls = {name: n for name, n in counting.calls.items() if name != "index_generation"}  # an int read
        assert sum(calls.values()) <= 8, counting.calls
        assert "read" not in counting.calls  # the message that just arrived is handed out from memory
        assert lmq_name(PARENT, "hot") == d.message.queue.topic
    finally:
        await dispatcher.close()


async def test_restart_resumes_after_the_last_ack(tmp_path: Path, clock: memory.ManualClock) -> None:
    from lmq_broker.storage import store as lmq_store  # noqa: PLC0415 (real store reopened below)

    cfg = config_for(tmp_path / "data")

    async def session(body: Callable[[Dispatcher], Any]) -> Any:
        store = lmq_store.open_store(cfg.store)
        d = Dispatcher(store, cfg, clock=clock)
        await d.start()
        try:
            return await body(d)
        finally:
            await d.close()
            store.close()

    async def first(d: Dispatcher) -> None:
        d.store.put_parent_topic(model.ParentTopic(PARENT))
        d.store.put_group(model.LiteGroup(GROUP, PARENT))
        d.metadata_changed()
        await d.add_lite("c1", GROUP, PARENT, ["t1"])
        for i in range(4):
            await d.send([lite_message("t1", str(i).encode(), message_id=f"m{i}")])
        got = await d.receive_lite("c1", GROUP, PARENT, batch=2, invisible_ms=1000, poll_ms=0)
        for delivery in got:
            await d.ack(GROUP, delivery.receipt_handle)

    async def second(d: Dispatcher) -> list[bytes]:
        await d.add_lite("c2", GROUP, PARENT, ["t1"])
        got = await d.receive_lite("c2", GROUP, PARENT, batch=32, invisible_ms=1000, poll_ms=0)
        return [x.message.body for x in got]

    await session(first)
    assert await session(second) == [b"2", b"3"]


async def test_acks_after_an_unacked_message_are_not_delivered_again_after_a_restart(
    tmp_path: Path, clock: memory.ManualClock
) -> None:
    from lmq_broker.storage import store as lmq_store  # noqa: PLC0415 (real store reopened below)

    cfg = config_for(tmp_path / "data")

    async def session(body: Callable[[Dispatcher], Any]) -> Any:
        store = lmq_store.open_store(cfg.store)
        d = Dispatcher(store, cfg, clock=clock)
        await d.start()
        try:
            return await body(d)
        finally:
            await d.close()
            store.close()

    async def first(d: Dispatcher) -> None:
        d.store.put_parent_topic(model.ParentTopic(PARENT))
        d.store.put_group(model.LiteGroup(GROUP, PARENT))
        d.metadata_changed()
        await d.add_lite("c1", GROUP, PARENT, ["t1"])
        await d.send([lite_message("t1", str(i).encode(), message_id=f"m{i}") for i in range(10)])
        got = await d.receive_lite("c1", GROUP, PARENT, batch=32, invisible_ms=60_000, poll_ms=0)
        assert [x.message.body for x in got] == [str(i).encode() for i in range(10)]
        for delivery in got[:3] + got[4:]:  # all but the fourth
            await d.ack(GROUP, delivery.receipt_handle)
        assert d.store.get_offset(model.QueueId.lmq(PARENT, "t1"), GROUP) == 3

    async def second(d: Dispatcher) -> list[bytes]:
        await d.add_lite("c2", GROUP, PARENT, ["t1"])
        got = await d.receive_lite("c2", GROUP, PARENT, batch=32, invisible_ms=1000, poll_ms=0)
        for delivery in got:
            await d.ack(GROUP, delivery.receipt_handle)
        await d.send([lite_message("t1", b"new", message_id="m-new")])
        got += await d.receive_lite("c2", GROUP, PARENT, batch=32, invisible_ms=1000, poll_ms=0)
        assert d.store.get_acked(model.QueueId.lmq(PARENT, "t1"), GROUP) == ()
        return [x.message.body for x in got]

    await session(first)
    assert await session(second) == [b"3", b"new"]  # the nine acked ones stay settled


async def test_a_record_gone_from_the_store_is_passed_over_and_committed(
    tmp_path: Path, clock: memory.ManualClock
) -> None:
    from lmq_broker.storage import codec  # noqa: PLC0415
    from lmq_broker.storage import store as lmq_store  # noqa: PLC0415

    cfg = config_for(tmp_path / "data")
    store = lmq_store.open_store(cfg.store)
    lite = await Lite.start(store, clock, cfg)
    try:
        await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
        for i in range(5):
            await lite.send("t1", b"body-%d" % i)
        store.flush()
        segment = next((cfg.store.data_dir / "commitlog").glob("*.log"))
        records = [f for _, f in lmq_store.iter_records(cfg.store) if f.kind == codec.KIND_MESSAGE]
        victim = records[1]
        with segment.open("r+b") as fh:  # the body of offset 1 rots on disk under the running broker
            fh.seek(victim.position + victim.size - 2)
            fh.write(b"\xff\xff")
        lite.dispatcher.recent.forget((lmq_name(PARENT, "t1"), 0))  # make the dispatcher read from disk
        got = await lite.receive("c1")
        assert [d.message.body for d in got] == [b"body-0", b"body-2", b"body-3", b"body-4"]
        for d in got:
            await lite.dispatcher.ack(GROUP, d.receipt_handle)
        assert lite.committed("t1") == 5  # the commit point passed the damaged record
        assert store.damage.total("corrupt_read") == 1
    finally:
        await lite.dispatcher.close()
        store.close()


async def test_broker_lite_topic_quota_counts_new_topics_across_parents(lite: Lite) -> None:
    lite.store.put_parent_topic(model.ParentTopic("Q"))
    lite.store.put_quota(model.Quota("broker", max_lite_topics=3))
    lite.dispatcher.metadata_changed()
    await lite.send("a")
    batch = [lite_message("b", message_id="x1"), lite_message("c", parent="Q", message_id="x2")]
    await lite.dispatcher.send(batch)  # 3 topics: at the limit
    over = [lite_message("a", message_id="x3"), lite_message("d", parent="Q", message_id="x4")]
    with pytest.raises(errors.LiteTopicQuotaExceeded):
        await lite.dispatcher.send(over)
    assert lite.store.lite_topic_count(None) == 3


async def test_a_drain_ends_waiting_polls_at_once(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    waiting = asyncio.create_task(lite.receive("c1", poll_ms=60_000))
    await asyncio.sleep(0)
    lite.dispatcher.begin_drain()
    assert await asyncio.wait_for(waiting, 5) == []


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
    """The reclaimer's rows for ``lites`` as a scan sees them now."""
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


async def _until(condition: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        await asyncio.sleep(0.01)


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
        await _until(lambda: lite.dispatcher.subscriber_count(t1) == 1)  # registered during the delete call
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


# --- commits that fail: the ack is kept dirty and persisted later, never silently dropped ---------------


class _FailingCommits:
    """Makes the store refuse offset commits (an index rebuild, meta ENOSPC) while ``failing``."""

    def __init__(self, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
        self.failing = True
        self.refused = 0
        for name in ("commit_offset", "try_commit_offset"):
            real = getattr(store, name)
            monkeypatch.setattr(store, name, self._wrap(real))

    def _wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.failing:
                self.refused += 1
                raise errors.StorageError("the index is being rebuilt")
            return real(*args, **kwargs)

        return call


async def test_an_ack_whose_commit_failed_reports_it_and_its_retry_persists(
    lite: Lite, monkeypatch: pytest.MonkeyPatch
) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    for body in (b"a", b"b", b"c"):
        await lite.send("t1", body)
    got = await lite.receive("c1")
    failing = _FailingCommits(lite.store, monkeypatch)
    for d in got:
        with pytest.raises(errors.StorageError):
            await lite.dispatcher.ack(GROUP, d.receipt_handle)  # the client learns it did not stick
    assert lite.committed("t1") is None
    failing.failing = False
    await lite.dispatcher.ack(GROUP, got[0].receipt_handle)  # the client's retry: now it commits
    assert lite.committed("t1") == 3
    assert await lite.receive("c1") == []


async def test_a_failed_commit_is_retried_by_housekeeping_and_acked_messages_never_come_back(
    lite: Lite, monkeypatch: pytest.MonkeyPatch
) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1", b"a")
    await lite.send("t1", b"b")
    got = await lite.receive("c1")
    failing = _FailingCommits(lite.store, monkeypatch)
    for d in got:
        with pytest.raises(errors.StorageError):
            await lite.dispatcher.ack(GROUP, d.receipt_handle)
    assert await lite.receive("c1") == []  # the dirty state is kept: nothing acked is handed out again
    refused = failing.refused
    lite.clock.advance(dispatcher_module.HOUSEKEEPING_INTERVAL_MS)
    lite.dispatcher.tick()
    await _until(lambda: failing.refused > refused and not lite.dispatcher.settlement.retrying)
    assert lite.committed("t1") is None  # still refused: still dirty, tried again later
    failing.failing = False
    lite.clock.advance(dispatcher_module.HOUSEKEEPING_INTERVAL_MS)
    lite.dispatcher.tick()
    await _until(lambda: lite.committed("t1") == 2 and not lite.dispatcher.settlement.retrying)
    assert lite.dispatcher.leases.get(LeaseKey(lmq_name(PARENT, "t1"), 0, GROUP)) is None  # released once persisted
    await lite.send("t1", b"c")
    assert [d.message.body for d in await lite.receive("c1")] == [b"c"]


async def test_resync_retries_failed_commits(lite: Lite, monkeypatch: pytest.MonkeyPatch) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1", b"a")
    (got,) = await lite.receive("c1")
    failing = _FailingCommits(lite.store, monkeypatch)
    with pytest.raises(errors.StorageError):
        await lite.dispatcher.ack(GROUP, got.receipt_handle)
    failing.failing = False
    lite.dispatcher.resync()  # the store serves again
    await _until(lambda: lite.committed("t1") == 1)


async def test_a_two_million_offset_hole_is_persisted_as_one_run_and_commits_fast(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1", b"a")
    (got,) = await lite.receive("c1")
    key = LeaseKey(lmq_name(PARENT, "t1"), 0, GROUP)
    state = lite.dispatcher.leases.get(key)
    assert state is not None
    assert lite.dispatcher.settlement.settle_gone(key, state, 1, 2_000_001, [])  # as a read over a lost segment
    start = time.perf_counter()
    await lite.dispatcher.settlement.commit(key, state)
    assert time.perf_counter() - start < 0.05
    queue = model.QueueId.lmq(PARENT, "t1")
    acked = lite.store.get_acked(queue, GROUP)
    assert (lite.committed("t1"), len(acked), acked[0], acked[-1]) == (0, 2_000_000, 1, 2_000_000)
    await lite.dispatcher.ack(GROUP, got.receipt_handle)
    assert lite.committed("t1") == 2_000_001 and lite.store.get_acked(queue, GROUP) == ()


async def test_acks_beyond_the_persisted_runs_cap_are_refused_until_the_runs_merge(
    lite: Lite, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keys, "ACKED_MAX_RUNS", 1)
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    for body in (b"a", b"b", b"c", b"d"):
        await lite.send("t1", body)
    d0, d1, d2, d3 = await lite.receive("c1")
    queue = model.QueueId.lmq(PARENT, "t1")
    await lite.dispatcher.ack(GROUP, d1.receipt_handle)
    with pytest.raises(errors.TooManyRequests):
        await lite.dispatcher.ack(GROUP, d3.receipt_handle)  # a second run: not persisted, so not answered OK
    assert tuple(lite.store.get_acked(queue, GROUP)) == (1,)
    await lite.dispatcher.ack(GROUP, d0.receipt_handle)  # 0..1 settled: one run left, persisted
    assert lite.committed("t1") == 2 and tuple(lite.store.get_acked(queue, GROUP)) == (3,)
    await lite.dispatcher.ack(GROUP, d3.receipt_handle)  # the client's retry: now it is in
    await lite.dispatcher.ack(GROUP, d2.receipt_handle)
    assert lite.committed("t1") == 4


# --- the store's index replaced while serving (a background rebuild) -------------------------------------


class _Rebuilds:
    """A memory store whose index 'rebuilds' on demand: the generation moves and the log's tail from
    ``keep_below`` on is lost, so new messages take those offsets again (what a rebuild after a torn log
    tail does; the store keeps every queue's end above the persisted commit points)."""

    def __init__(self, store: memory.MemoryStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.store = store
        self.generation = 0
        monkeypatch.setattr(store, "index_generation", lambda: self.generation)

    def lose_tail(self, lite: str, keep_below: int) -> None:
        q = self.store._queues[keys.parse_queue(lmq_name(PARENT, lite), 0).qkey]
        for offset in range(keep_below, q.next):
            q.messages.pop(offset, None)
        q.next = keep_below
        self.generation += 1


@pytest_asyncio.fixture
async def mem_lite(clock: memory.ManualClock, tmp_path: Path) -> AsyncIterator[Lite]:
    store = memory.MemoryStore(config_for(tmp_path / "data").store)
    harness = await Lite.start(store, clock, config_for(tmp_path / "unused"))
    yield harness
    await harness.dispatcher.close()
    store.close()


async def test_after_a_rebuild_reused_offsets_are_delivered_and_old_handles_cannot_ack_them(
    mem_lite: Lite, monkeypatch: pytest.MonkeyPatch
) -> None:
    lite = mem_lite
    assert isinstance(lite.store, memory.MemoryStore)
    rebuilds = _Rebuilds(lite.store, monkeypatch)
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    for body in (b"m0", b"m1", b"m2"):
        await lite.send("t1", body)
    d0, d1, d2 = await lite.receive("c1")
    await lite.dispatcher.ack(GROUP, d0.receipt_handle)
    assert lite.committed("t1") == 1
    rebuilds.lose_tail("t1", 1)  # m1 and m2 (delivered, not acked) are gone with the log's tail
    await lite.send("t1", b"n1")  # offset 1 again
    await lite.send("t1", b"n2")
    with pytest.raises(errors.InvalidReceiptHandle):
        await lite.dispatcher.ack(GROUP, d1.receipt_handle)  # names lost m1, not n1
    got = await lite.receive("c1")
    assert [(d.message.offset, d.message.body) for d in got] == [(1, b"n1"), (2, b"n2")]
    with pytest.raises(errors.InvalidReceiptHandle):
        await lite.dispatcher.ack(GROUP, d2.receipt_handle)  # n2 is leased now: still not m2's handle
    for d in got:
        await lite.dispatcher.ack(GROUP, d.receipt_handle)
    assert lite.committed("t1") == 3


async def test_after_a_rebuild_cached_commit_points_and_messages_are_read_again(
    mem_lite: Lite, monkeypatch: pytest.MonkeyPatch
) -> None:
    lite = mem_lite
    assert isinstance(lite.store, memory.MemoryStore)
    rebuilds = _Rebuilds(lite.store, monkeypatch)
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    for body in (b"m0", b"m1", b"m2"):
        await lite.send("t1", body)
    for d in await lite.receive("c1"):
        await lite.dispatcher.ack(GROUP, d.receipt_handle)
    assert lite.dispatcher.leases.get(LeaseKey(lmq_name(PARENT, "t1"), 0, GROUP)) is None  # idle: only caches remain
    # the rebuilt store holds the group at offset 1 and lost the tail after it (e.g. meta repaired from a
    # backup): the dispatcher must believe the store, not its cache of 3
    lite.store.commit_offset(model.QueueId.lmq(PARENT, "t1"), GROUP, 1)
    rebuilds.lose_tail("t1", 1)
    await lite.send("t1", b"n1")
    got = await lite.receive("c1")
    assert [(d.message.offset, d.message.body) for d in got] == [(1, b"n1")]


async def test_a_rebuild_seen_only_through_the_generation_triggers_a_catch_up(
    mem_lite: Lite, monkeypatch: pytest.MonkeyPatch
) -> None:
    lite = mem_lite
    assert isinstance(lite.store, memory.MemoryStore)
    rebuilds = _Rebuilds(lite.store, monkeypatch)
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1", b"m0")
    caught_up: list[str] = []
    monkeypatch.setattr(lite.dispatcher.subscriptions, "start_catchup", caught_up.append)
    rebuilds.generation += 1  # started and ended between two polls of the health watcher
    (got,) = await lite.receive("c1")
    assert got.message.body == b"m0" and caught_up == ["c1"]


# --- reads refused while the store rebuilds its index ---------------------------------------------------


async def test_a_receive_while_the_store_refuses_reads_returns_empty_settles_nothing_and_retries(
    lite: Lite, monkeypatch: pytest.MonkeyPatch
) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1", b"a")
    await lite.send("t1", b"b")
    lite.dispatcher.recent.forget((lmq_name(PARENT, "t1"), 0))  # make it read the store
    real = lite.store.read_span

    def refusing(*args: Any) -> Any:
        raise errors.StorageError("the index is being rebuilt")

    monkeypatch.setattr(lite.store, "read_span", refusing)
    assert await lite.receive("c1") == []  # no INTERNAL_ERROR
    state = lite.dispatcher.leases.get(LeaseKey(lmq_name(PARENT, "t1"), 0, GROUP))
    assert state is None or (state.committed == 0 and state.acked_above() == () and not state.entries)
    assert lite.committed("t1") is None
    monkeypatch.setattr(lite.store, "read_span", real)
    lite.clock.advance(STORE_RETRY_MS)
    lite.dispatcher.tick()  # the retry: a catch-up pass offers the topic again
    assert [d.message.body for d in await lite.receive("c1", poll_ms=5000)] == [b"a", b"b"]


async def test_a_receive_while_the_store_refuses_offset_reads_returns_empty(
    lite: Lite, monkeypatch: pytest.MonkeyPatch
) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1", b"a")

    def refusing(*args: Any) -> Any:
        raise errors.StorageError("the index is being rebuilt")

    monkeypatch.setattr(lite.store, "get_offset", refusing)
    assert await lite.receive("c1") == []
    monkeypatch.undo()
    lite.clock.advance(STORE_RETRY_MS)
    lite.dispatcher.tick()
    assert [d.message.body for d in await lite.receive("c1", poll_ms=5000)] == [b"a"]


async def test_after_a_rebuild_acks_the_store_refused_are_forgotten_and_the_message_comes_again(
    mem_lite: Lite, monkeypatch: pytest.MonkeyPatch
) -> None:
    lite = mem_lite
    assert isinstance(lite.store, memory.MemoryStore)
    rebuilds = _Rebuilds(lite.store, monkeypatch)
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1", b"m0")
    await lite.send("t1", b"m1")
    d0, d1 = await lite.receive("c1")
    failing = _FailingCommits(lite.store, monkeypatch)
    with pytest.raises(errors.StorageError):
        await lite.dispatcher.ack(GROUP, d0.receipt_handle)  # answered with the error: not acked
    rebuilds.generation += 1  # the index is replaced before the ack could be written
    failing.failing = False
    with pytest.raises(errors.InvalidReceiptHandle):
        await lite.dispatcher.ack(GROUP, d0.receipt_handle)  # its offset may name another message now
    (again,) = await lite.receive("c1")
    assert again.message.body == b"m0"
    await lite.dispatcher.ack(GROUP, again.receipt_handle)
    await lite.dispatcher.ack(GROUP, d1.receipt_handle)  # still the message at its offset: accepted
    assert lite.committed("t1") == 2
