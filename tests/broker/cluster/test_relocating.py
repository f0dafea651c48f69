"""What a leaving broker copies of its queues that are not lite topics (``cluster.relocating``), over a real
RocksDB store: NORMAL topics and dead letters from the lowest commit point, never a LITE parent's own queue nor
a deleted topic's, in batches bounded by messages and bytes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from lmq_broker import errors, model
from lmq_broker.cluster import relocating
from lmq_broker.config import StoreConfig
from lmq_broker.dispatch import metadata
from lmq_broker.dispatch.testing import config_for
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as admin_pb
from lmq_broker.storage.api import Store
from lmq_broker.storage.store import open_store

N0, N1 = model.QueueId("orders", 0), model.QueueId("orders", 1)
DLQ = model.QueueId("%DLQ%billing", 0)


def normal(topic: str, queue: int, n: int, body: bytes = b"x") -> list[model.NewMessage]:
    return [model.NewMessage(f"{topic}-{queue}-{i}", topic, body, (model.QueueId(topic, queue),)) for i in range(n)]


def test_only_normal_topics_and_dead_letters_are_copied_from_the_lowest_commit_point(tmp_path: Path) -> None:
    store = open_store(StoreConfig(data_dir=tmp_path))
    try:
        store.put_parent_topic(model.ParentTopic("orders", model.MessageType.NORMAL, queue_count=2))
        store.put_parent_topic(model.ParentTopic("chat", model.MessageType.LITE))
        lite = model.NewMessage(
            "l0", "chat", b"x", (model.QueueId("chat", 0), model.QueueId.lmq("chat", "a")), "a", model.MessageType.LITE
        )  # indexed into the LITE parent's queue too (--index-parent-queue)
        store.append([*normal("orders", 0, 5), *normal("orders", 1, 3), *normal("%DLQ%billing", 0, 2), lite])
        store.append(normal("gone", 0, 4))  # a topic deleted since: no parent topic here
        store.commit_offset(N0, "g1", 3)
        store.commit_offset(N0, "g2", 2)
        store.commit_offset(N1, "g1", 3)  # consumed to its end
        store.commit_offset(N1, "g2", 3)
        assert relocating.pending(store) == [relocating.Pending(DLQ, 0, 2), relocating.Pending(N0, 2, 5)]
        assert relocating.undrained(store) == 5
        store.put_relocated(N0, 4)
        assert relocating.pending(store) == [relocating.Pending(DLQ, 0, 2), relocating.Pending(N0, 4, 5)]
    finally:
        store.close()


def test_a_group_that_consumed_another_queue_of_the_topic_here_keeps_what_it_has_not_consumed_of_this_one(
    tmp_path: Path,
) -> None:
    """A group with no commit point in a queue starts at its first message (``settlement``): g2 consumed queue 0
    here but never queue 1 (its consumers were down while queue 1 filled), so queue 1 is all to copy, even though
    g1 consumed it to its end. Before, only the groups with a point in that very queue counted: g1's end, and g2's
    three messages were left on the removed broker (found in a red-team review of the scale-down copy)."""
    store = open_store(StoreConfig(data_dir=tmp_path))
    try:
        store.put_parent_topic(model.ParentTopic("orders", model.MessageType.NORMAL, queue_count=2))
        store.append([*normal("orders", 0, 5), *normal("orders", 1, 3)])
        store.commit_offset(N0, "g1", 5)
        store.commit_offset(N0, "g2", 5)
        store.commit_offset(N1, "g1", 3)
        assert relocating.pending(store) == [relocating.Pending(N1, 0, 3)]
        store.commit_offset(N1, "g2", 1)
        assert relocating.pending(store) == [relocating.Pending(N1, 1, 3)]
        # a group whose consumers said they consume the topic (Telemetry) but that has no point here at all
        assert relocating.pending(store, {"orders": {"g3"}}) == [
            relocating.Pending(N0, 0, 5), relocating.Pending(N1, 0, 3)
        ]  # fmt: skip
        assert relocating.undrained(store, {"orders": {"g3"}, "other": {"g4"}}) == 8
    finally:
        store.close()


def test_a_batch_is_bounded_by_messages_and_bytes_and_holds_at_least_one(tmp_path: Path) -> None:
    store = open_store(StoreConfig(data_dir=tmp_path))
    try:
        store.append(normal("orders", 0, 600, b"y" * 100))
        job = relocating.Pending(N0, 10, 600)
        messages, after = relocating.batch(store, job, 1 << 20)
        assert (len(messages), messages[0].offset, after) == (relocating.BATCH_MESSAGES, 10, 510)
        messages, after = relocating.batch(store, job, 250)  # two bodies fit
        assert ([m.offset for m in messages], after) == ([10, 11], 12)
        messages, after = relocating.batch(store, job, 10)  # one, bigger than the bound
        assert ([m.offset for m in messages], after) == ([10], 11)
    finally:
        store.close()


def test_each_queue_goes_to_one_remaining_slot_and_then_the_next() -> None:
    first = [relocating.destination(model.QueueId("t", q), 3, 0) for q in range(50)]
    assert set(first) == {0, 1, 2}  # spread over today's ring
    assert [relocating.destination(model.QueueId("t", q), 3, 1) for q in range(50)] == [(s + 1) % 3 for s in first]


def relocator(
    store: Store, sent: list[tuple[int, list[str]]], answers: list[relocating.Consumers | None]
) -> relocating.Relocator:
    """A Relocator over ``store`` whose sends land in ``sent`` and whose remaining brokers answer ``answers``."""

    async def send(slot: int, messages: Sequence[model.StoredMessage]) -> None:
        sent.append((slot, [m.message_id for m in messages]))

    async def committed(topics: Collection[str]) -> relocating.Consumers | None:
        assert list(topics) == ["orders"]  # asked once a pass, for the topics with anything not copied
        return answers.pop(0)

    return relocating.Relocator(store, send, 1 << 20, CollectorRegistry(), committed=committed)


def test_the_groups_with_a_point_at_a_remaining_broker_count_from_each_queue_s_first_offset(tmp_path: Path) -> None:
    """g1 consumed all five here. g2 never consumed here and its consumers are down, but it holds a commit point
    for the topic at a remaining broker: it will start here at the first message when it comes back, so all five
    are copied for it, and counted until then. Before, the copy went from g1's end: g2 lost the five (residual
    of a red-team review). A remaining broker that does not answer: any group may, so the same (conservative);
    and an answer naming no group leaves g1's end."""
    store = open_store(StoreConfig(data_dir=tmp_path))
    try:
        store.put_parent_topic(model.ParentTopic("orders", model.MessageType.NORMAL))
        store.append(normal("orders", 0, 5))
        store.commit_offset(N0, "g1", 5)
        for answer, copied in (({}, 0), (None, 5), ({"orders": {"g2"}}, 5)):
            sent: list[tuple[int, list[str]]] = []
            moving = relocator(store, sent, [answer])
            assert relocating.undrained(store, moving.groups()) == 5  # nothing asked yet: any group may
            assert asyncio.run(moving.relocate(2)) == copied, answer
            assert sum(len(ids) for _, ids in sent) == copied
            store.put_relocated(N0, 0)  # as before the pass: the count uses the groups the copy did
            assert relocating.undrained(store, moving.groups()) == copied
    finally:
        store.close()


def test_a_batch_a_remaining_broker_did_not_answer_in_time_goes_to_it_again_not_to_the_next(tmp_path: Path) -> None:
    """A timeout (``Unanswered``: it may have stored the batch, and will not store it twice) is asked of the same
    broker again, up to ``SAME_SLOT_TRIES``, and then the pass gives up on the queue (the next pass asks it
    again); a refused connection moves on to the next slot at once. Before, a timeout moved on: the batch could
    end up at two brokers (twice, and a FIFO queue split)."""
    store = open_store(StoreConfig(data_dir=tmp_path))
    try:
        store.put_parent_topic(model.ParentTopic("orders", model.MessageType.NORMAL))
        store.append(normal("orders", 0, 3))
        first = relocating.destination(N0, 3, 0)
        tried: list[int] = []

        def sender(failures: list[errors.LmqError]) -> relocating.Send:
            async def send(slot: int, messages: Sequence[model.StoredMessage]) -> None:
                tried.append(slot)
                if failures:
                    raise failures.pop(0)

            return send

        late: list[errors.LmqError] = [relocating.Unanswered("timed out"), relocating.Unanswered("timed out")]
        moving = relocating.Relocator(store, sender(late), 1 << 20, CollectorRegistry())
        assert asyncio.run(moving.relocate(3)) == 3
        assert tried == [first] * 3
        store.put_relocated(N0, 0)
        tried.clear()
        never: list[errors.LmqError] = [relocating.Unanswered("timed out")] * relocating.SAME_SLOT_TRIES
        moving = relocating.Relocator(store, sender(never), 1 << 20, CollectorRegistry())
        with pytest.raises(errors.BrokerUnavailable, match="no remaining broker stored it"):
            asyncio.run(moving.relocate(3))
        assert tried == [first] * relocating.SAME_SLOT_TRIES
        assert store.relocated(N0) == 0
        tried.clear()
        refused: list[errors.LmqError] = [errors.BrokerUnavailable("connection refused")]
        moving = relocating.Relocator(store, sender(refused), 1 << 20, CollectorRegistry())
        assert asyncio.run(moving.relocate(3)) == 3
        assert tried == [first, relocating.destination(N0, 3, 1)]
    finally:
        store.close()


def test_a_remaining_broker_stores_only_the_part_of_a_retried_batch_it_does_not_hold(tmp_path: Path) -> None:
    """What leaving broker ``source`` stored here is recorded per its queue (``relocated_from``, meta store,
    synced): a batch again is nothing new, a batch overlapping its end is its tail, another source or queue is
    its own."""
    store = open_store(StoreConfig(data_dir=tmp_path))
    try:

        def wire(first: int, count: int, queue: int = 0) -> list[admin_pb.RelocatedMessage]:
            return [
                admin_pb.RelocatedMessage(topic="orders", queue=queue, message_id=f"m{i}", source_offset=i)
                for i in range(first, first + count)
            ]

        def offsets(found: tuple[list[admin_pb.RelocatedMessage], int]) -> tuple[list[int], int]:
            return [m.source_offset for m in found[0]], found[1]

        assert offsets(relocating.new_tail(store, "a:1", wire(0, 3))) == ([0, 1, 2], 3)
        store.put_relocated_from("a:1", N0, 3)
        assert offsets(relocating.new_tail(store, "a:1", wire(0, 3))) == ([], 3)
        assert offsets(relocating.new_tail(store, "a:1", wire(2, 3))) == ([3, 4], 5)
        assert offsets(relocating.new_tail(store, "b:1", wire(0, 3))) == ([0, 1, 2], 3)
        assert offsets(relocating.new_tail(store, "a:1", wire(0, 2, queue=1))) == ([0, 1], 2)
        assert offsets(relocating.new_tail(store, "", wire(0, 3))) == ([0, 1, 2], 0)  # no source: no record
        with pytest.raises(errors.InvalidArgument):
            relocating.new_tail(store, "a:1", [*wire(5, 1), *wire(6, 1, queue=1)])
    finally:
        store.close()
    store = open_store(StoreConfig(data_dir=tmp_path))  # durable
    try:
        assert store.relocated_from("a:1", N0) == 3
    finally:
        store.close()


def test_a_store_keeps_its_id_and_a_new_one_gets_another(tmp_path: Path) -> None:
    """A leaving broker's offsets are of its data directory: one made anew (a new volume under the same endpoint)
    starts at 0 again, so what a receiver recorded of the old one must not pass its messages over."""
    ids = []
    for directory in ("a", "a", "b"):
        store = open_store(StoreConfig(data_dir=tmp_path / directory))
        try:
            ids.append(store.store_id())
        finally:
            store.close()
    assert ids[0] == ids[1] != ids[2]


def test_a_store_relocated_call_cancelled_at_its_deadline_still_records_what_its_append_stored(
    tmp_path: Path,
) -> None:
    """gRPC cancels a StoreRelocated handler whose deadline passed (the leaving broker's 30 s), but the append it
    queued is made all the same (the appender's thread, a replica's copy). The record of how far that source's
    queue got must follow it, and the leaving broker's retry must wait for both: it then stores nothing again.
    Before, the cancelled call left the batch unrecorded and released the queue's lock at once, so the retry
    (the very case the record is for) stored the batch a second time (red-team review)."""
    store = open_store(StoreConfig(data_dir=tmp_path))
    try:
        orders = model.ParentTopic("orders", model.MessageType.NORMAL, queue_count=2)
        store.put_parent_topic(orders)
        snap = metadata.Metadata(config_for(tmp_path), {"orders": orders})
        queued: list[tuple[list[model.NewMessage], asyncio.Future[None]]] = []

        async def append(messages: list[model.NewMessage]) -> None:  # as the appender: the write is its thread's
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            queued.append((messages, done))
            await done

        async def run(fn: Callable[..., object], *args: object) -> object:
            return fn(*args)

        async def snapshot() -> metadata.Metadata:
            return snap

        wire = [
            admin_pb.RelocatedMessage(
                topic="orders", queue=0, message_id=f"m{i}", body=b"x", message_type=1, source_offset=i
            )
            for i in range(3)
        ]

        async def scenario() -> list[int]:
            receiver = relocating.Receiver(store, run, append, snapshot)
            first = asyncio.ensure_future(receiver.receive(wire, "a:1/s"))
            await eventually_async(lambda: len(queued) == 1)
            first.cancel()  # the deadline: the handler is cancelled, its append stays queued
            with contextlib.suppress(asyncio.CancelledError):
                await first
            retry = asyncio.ensure_future(receiver.receive(wire, "a:1/s"))
            for _ in range(20):  # the retry may queue its own append meanwhile (it must not)
                await asyncio.sleep(0)
            while queued:  # the appender thread writes what was queued
                messages, done = queued.pop(0)
                store.append(messages)
                if not done.done():  # its caller may have been cancelled: the write is made all the same
                    done.set_result(None)
                for _ in range(20):
                    await asyncio.sleep(0)
            stored_again = await retry
            assert receiver.busy == 0  # no lock is kept per (source, topic, queue) once idle
            return [stored_again, store.relocated_from("a:1/s", N0)]

        assert asyncio.run(scenario()) == [0, 3]
        assert [m.message_id for m in store.read(N0, 0, 10)] == ["m0", "m1", "m2"]
    finally:
        store.close()


async def eventually_async(condition: Callable[[], bool], tries: int = 1000) -> None:
    for _ in range(tries):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not met")
