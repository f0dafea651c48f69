"""The dispatcher end to end on a fake clock, over both stores: ordering, leases, redelivery, DLQ, restarts.

What one part owns is tested beside it: test_ingest.py, test_subscriptions.py, test_settlement.py."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from lmq_broker import errors, model
from lmq_broker.dispatch.delivery import STORE_RETRY_MS
from lmq_broker.dispatch.dispatcher import Delivery, Dispatcher
from lmq_broker.dispatch.leases import LeaseKey
from lmq_broker.dispatch.subscriptions import lmq_name
from lmq_broker.dispatch.testing import GROUP, PARENT, Lite, config_for, lite_message, until
from lmq_broker.storage import memory
from lmq_broker.storage.api import Store

pytestmark = pytest.mark.asyncio


async def test_subscribed_client_receives_and_ack_commits(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1", b"hello")
    (got,) = await lite.receive("c1")
    assert got.message.body == b"hello" and got.attempt == 1 and got.message.lite_topic == "t1"
    await lite.dispatcher.ack(GROUP, got.receipt_handle)
    assert lite.committed("t1") == 1


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


async def test_a_late_consumer_settles_nothing_of_the_delivery_after_its_own(lite: Lite) -> None:
    """c1's invisible time runs out and c2 receives the message again: c1's ack, nack and dead letter with its
    handle are refused (INVALID_RECEIPT_HANDLE) and leave c2's delivery out; c2's ack settles it, once. Before
    2026-11-30 c1's late ack settled c2's delivery."""
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1")
    (first,) = await lite.receive("c1", invisible_ms=5_000)
    await lite.dispatcher.remove_lite("c1", GROUP, PARENT, ["t1"])  # so the redelivery is c2's
    await lite.dispatcher.add_lite("c2", GROUP, PARENT, ["t1"])
    lite.clock.advance(5_000)
    lite.dispatcher.tick()
    (again,) = await lite.receive("c2", invisible_ms=5_000)
    assert again.message.message_id == first.message.message_id
    late: list[Callable[[], Awaitable[object]]] = [
        lambda: lite.dispatcher.ack(GROUP, first.receipt_handle),
        lambda: lite.dispatcher.change_invisible(GROUP, first.receipt_handle, 0),
        lambda: lite.dispatcher.dead_letter(GROUP, first.receipt_handle),
    ]
    for settle in late:
        with pytest.raises(errors.InvalidReceiptHandle, match="no longer the current lease"):
            await settle()
    assert not lite.committed("t1") and await lite.receive("c1") == [] and await lite.receive("c2") == []
    assert lite.store.read(model.QueueId(f"%DLQ%{GROUP}", 0), 0, 10) == []
    await lite.dispatcher.ack(GROUP, again.receipt_handle)
    assert lite.committed("t1") == 1


async def test_an_expired_handle_is_refused_and_its_message_comes_again(lite: Lite) -> None:
    """Its invisible time ran out, the message not received again yet: the ack is refused all the same (as
    RocketMQ's proxy refuses an expired handle) and the message is delivered again, not lost."""
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1")
    (first,) = await lite.receive("c1", invisible_ms=5_000)
    lite.clock.advance(5_000)
    with pytest.raises(errors.InvalidReceiptHandle, match="expired"):
        await lite.dispatcher.ack(GROUP, first.receipt_handle)
    lite.dispatcher.tick()
    (again,) = await lite.receive("c1")
    assert again.message.message_id == first.message.message_id and again.attempt == 2
    await lite.dispatcher.ack(GROUP, again.receipt_handle)
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


async def test_a_dead_letter_forward_whose_invisible_time_runs_out_while_its_copy_is_stored_settles_it(
    lite: Lite,
) -> None:
    """The handle is current when the forward starts; the message's invisible time runs out while its copy is
    appended to the DLQ (a slow store, followers' copies). The message, in the DLQ now, is settled all the same:
    not delivered again beside its dead letter, and the forward answered OK. Before, the ack after the append
    checked the handle again and refused it as expired: the copy was stored, the message came again, and the
    client was told INVALID_RECEIPT_HANDLE, against docs/protocol.md (red-team review)."""
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1", b"give-up")
    (d,) = await lite.receive("c1", invisible_ms=5_000)
    settlement = lite.dispatcher.settlement
    store_dead = settlement._append_dead

    async def slow(group: str, messages: Sequence[model.StoredMessage]) -> None:
        lite.clock.advance(5_000)  # the append took what was left of the invisible time
        await store_dead(group, messages)

    settlement._append_dead = slow
    await lite.dispatcher.dead_letter(GROUP, d.receipt_handle)
    lite.dispatcher.tick()
    assert await lite.receive("c1") == []
    assert lite.committed("t1") == 1
    assert [m.body for m in lite.store.read(model.QueueId(f"%DLQ%{GROUP}", 0), 0, 10)] == [b"give-up"]


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


async def test_shared_group_offers_each_arrival_to_one_client(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.dispatcher.add_lite("c2", GROUP, PARENT, ["t1"])
    await lite.send("t1")
    await asyncio.sleep(0)  # the coalesced arrival flush runs on the next loop iteration
    sizes = sorted([lite.dispatcher.ready.size("c1"), lite.dispatcher.ready.size("c2")])
    assert sizes == [0, 1]


async def test_a_topic_offered_while_another_client_reads_it_goes_out_when_that_read_ends(
    lite: Lite, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two clients of one group take t1. c1 pops t1 from an offer that outlived its message (c2 took it) and reads
    the store; the next message is stored after that read began, and offered to c2, whose receive finds t1 being
    read by c1 and leaves it to c1. c1's read saw nothing new and leased nothing: t1 is offered again when that
    read ends. It was lost before: no lease, so no ack or expiry offered it again, and no client held it ready (a
    member of an MQTT share waited for the next message of its topic)."""
    lmq = lmq_name(PARENT, "t1")
    await lite.send("t1", b"first")
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])  # a backlog: offered to each at once
    await lite.dispatcher.add_lite("c2", GROUP, PARENT, ["t1"])
    (first,) = await lite.receive("c2")
    await lite.dispatcher.ack(GROUP, first.receipt_handle)
    assert lite.dispatcher.ready.size("c1") == 1  # its offer outlived the message
    lite.dispatcher.recent.forget((lmq, 0))  # c1's receive reads the store
    real, reading, go_on = lite.store.read_span, threading.Event(), threading.Event()

    def read_then_wait(*args: Any) -> Any:
        out = real(*args)  # before "second" is stored
        reading.set()
        go_on.wait(10)
        return out

    monkeypatch.setattr(lite.store, "read_span", read_then_wait)
    c1 = asyncio.create_task(lite.receive("c1"))
    try:
        await until(reading.is_set)
        monkeypatch.setattr(lite.store, "read_span", real)
        order = lite.dispatcher.subscribers(model.QueueId(lmq, 0))
        monkeypatch.setattr(lite.dispatcher.runtime.rng, "randrange", lambda _: order.index("c2"))  # to c2
        await lite.send("t1", b"second")
        assert await lite.receive("c2") == []  # t1 was being read by c1
    finally:
        go_on.set()
    assert await c1 == []  # its read came before "second"
    assert [d.message.body for d in await lite.receive("c2")] == [b"second"]


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
    tmp_path: Path, clock: memory.ManualClock, caplog: pytest.LogCaptureFixture
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
        passed_over = [r.getMessage() for r in caplog.records if "passed over" in r.getMessage()]
        assert passed_over and all(m.endswith("passed over: offset 1") for m in passed_over), passed_over
    finally:
        await lite.dispatcher.close()
        store.close()


async def test_a_drain_ends_waiting_polls_at_once(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    waiting = asyncio.create_task(lite.receive("c1", poll_ms=60_000))
    await asyncio.sleep(0)
    lite.dispatcher.begin_drain()
    assert await asyncio.wait_for(waiting, 5) == []


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
