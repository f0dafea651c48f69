"""A follower's reconciling is tried again on its own (``lmq_broker.replication.reconciling``): after a failure,
with a capped exponential backoff with jitter, and at once when the slot falls out of sync. The loop runs for
real on the event loop; the follower and its leases are stand-ins (the whole path, with broker processes and
the real apiserver: test_replication_failover.py,
test_a_follower_whose_reconcile_failed_is_in_sync_again_on_its_own_and_takes_over)."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from waiting import eventually_async

from lmq_broker import errors, model
from lmq_broker.config import StoreConfig
from lmq_broker.replication import copies, following, reconciling, sources, wire
from lmq_broker.storage import store as lmq_store


def test_the_backoff_doubles_up_to_its_cap_and_draws_from_the_upper_half() -> None:
    highest = reconciling.Backoff(0.1, 1.0, lambda: 1.0)
    assert [round(highest.next(), 3) for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    lowest = reconciling.Backoff(0.1, 1.0, lambda: 0.0)
    assert [round(lowest.next(), 3) for _ in range(5)] == [0.05, 0.1, 0.2, 0.4, 0.5]
    assert reconciling.Backoff(0.1, 0.01, lambda: 1.0).next() == 0.1  # a cap below the first wait: the first


class _Leases:
    me, mine, holders = 1, [0], {0: "slot-0/x"}

    def __init__(self) -> None:
        self.epochs = {0: 1}

    def holds(self, slot: int) -> bool:
        return False


class _Follower:
    def __init__(self) -> None:
        self.reconciled: dict[int, int] = {}
        self.on_out_of_sync: Any = lambda slot: None

    def in_sync(self, slot: int, epoch: int) -> bool:
        return self.reconciled.get(slot) == epoch

    def out_of_sync(self, slot: int) -> None:
        self.reconciled.pop(slot, None)
        self.on_out_of_sync(slot)


@pytest.mark.asyncio
async def test_a_failed_reconcile_is_tried_again_and_falling_out_of_sync_wakes_the_loop_at_once() -> None:
    leases, follower, registry = _Leases(), _Follower(), CollectorRegistry()
    attempts: list[float] = []

    async def attempt(slot: int) -> bool:
        attempts.append(time.monotonic())
        if len(attempts) <= 3:
            raise errors.BrokerUnavailable("timed out")
        follower.reconciled[slot] = 1
        return True

    cap_s = 30.0  # a turn of the loop every 30 s at the latest: only the backoff and the wake-up come sooner
    loop: Any = reconciling.Reconciler(leases, follower, attempt, registry, cap_s)  # type: ignore[arg-type]
    stopping = asyncio.Event()
    task = asyncio.create_task(loop.run(stopping))

    def count(result: str) -> float:
        return registry.get_sample_value("lmq_replication_reconciles_total", {"result": result}) or 0

    try:
        await eventually_async(lambda: follower.in_sync(0, 1), "in sync after three failures", 5)
        assert count("failed") == 3 and count("ok") == 1
        waits = [b - a for a, b in itertools.pairwise(attempts)]
        assert 0.05 <= waits[0] < waits[2] < 1.0  # 0.05-0.1, 0.1-0.2, 0.2-0.4 s (and a little scheduling)
        fell = time.monotonic()
        follower.out_of_sync(0)  # a copy found it behind
        await eventually_async(lambda: follower.in_sync(0, 1), "in sync again", 5)
        assert attempts[-1] - fell < 1.0 and count("ok") == 2  # at once, not at the next 30 s turn
    finally:
        stopping.set()
        await asyncio.wait_for(task, 5)


def test_a_fetch_is_a_page_of_at_most_fetch_bytes_of_bodies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reconcile's Fetch answers 1,000 messages at most, and stops early past ``FETCH_BYTES`` of bodies (a
    message larger than that still comes, alone): each call a bounded amount of work within its deadline."""
    monkeypatch.setattr(sources, "FETCH_BYTES", 2_500)
    queue = model.QueueId.lmq("P", "a")
    store = lmq_store.LmqStore(StoreConfig(data_dir=tmp_path))
    try:
        sizes = [1_000, 1_000, 1_000, 4_000, 10]
        messages = [model.NewMessage(f"m{n}", "P", b"x" * size, (queue,)) for n, size in enumerate(sizes)]
        store.append(messages)
        pages, start = [], 0
        while start < len(sizes):
            copy = wire.decode(sources.fetch(store, 0, 1, queue.topic, start))
            pages.append([m.message_id for m in copy.messages])
            start += len(copy.messages)
    finally:
        store.close()
    assert pages == [["m0", "m1"], ["m2"], ["m3"], ["m4"]]


@pytest.mark.asyncio
async def test_a_reconcile_over_pages_brings_the_commit_points_whose_acks_lie_past_the_first_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group's point with offsets acked above it that lie past the first Fetch page: each page carries the
    point with only the acks within it (the follower answers a point acking records it lacks as not stored,
    which failed the reconcile at every page but the last), and the last page the whole of it."""
    monkeypatch.setattr(sources, "FETCH_MAX", 2)
    holder = lmq_store.LmqStore(StoreConfig(data_dir=tmp_path / "holder"))
    mine = lmq_store.LmqStore(StoreConfig(data_dir=tmp_path / "follower"))
    try:
        holder.put_parent_topic(model.ParentTopic("P", model.MessageType.LITE))
        holder.put_group(model.LiteGroup("G", "P"))
        holder.append([model.NewMessage(f"m{n}", "P", b"x", (LITE_A,)) for n in range(5)])
        holder.commit_offset(LITE_A, "G", 0, (1, 2, 3, 4))

        async def ends(at: int, slot: int, cursor: str) -> tuple[dict[str, int], str | None]:
            return sources.ends_page(holder, slot, lambda topic: 0, cursor, sources.SCAN_PAGE)

        async def fetch(at: int, slot: int, topic: str, start: int) -> bytes:
            return sources.fetch(holder, slot, 1, topic, start, binary=True)

        follower = _follower_of(mine)
        assert await follower.reconcile(0, ends, fetch)
        assert len(_held(mine)) == 5
        assert (mine.get_offset(LITE_A, "G"), list(mine.get_acked(LITE_A, "G"))) == (0, [1, 2, 3, 4])
    finally:
        holder.close()
        mine.close()


class _Leader(_Leases):
    """The lease as a follower of slot 0 sees it: slot 0's broker holds it at epoch 1."""

    def serving(self, slot: int) -> int:
        return 0


def _follower_of(mine: lmq_store.LmqStore) -> following.Follower:
    """A follower of slot 0 storing into ``mine`` (the lease a stand-in)."""

    async def append(messages: Any) -> list[model.AppendResult]:
        return mine.append(messages)

    async def stored_id(q: model.QueueId, offset: int) -> str | None:
        found = mine.read(q, offset, 1)
        return found[0].message_id if found and found[0].offset == offset else None

    async def commit(point: wire.Commit) -> None:
        mine.commit_offset(point.queue, point.group, point.offset, point.acked, point.handouts)

    leases: Any = _Leader()
    counters = copies.Counters(CollectorRegistry())
    return following.Follower(leases, append, lambda q: mine.queue_offsets(q)[1], stored_id, commit, counters)


LITE_A = model.QueueId.lmq("P", "a")


def _held(mine: lmq_store.LmqStore) -> dict[int, str]:
    held = {m.offset: m.message_id for m in mine.read(LITE_A, 0, 100)}
    assert all(message_id == f"m{offset}" for offset, message_id in held.items()), held
    return held


@pytest.mark.asyncio
async def test_a_catch_up_over_a_record_the_holder_lost_never_stores_a_message_at_another_offset(
    tmp_path: Path,
) -> None:
    """The holder's read skips a record that fails its CRC (reported there as damage), so a fetch answers the
    messages after it with their own offsets: 0-3, then 5-9. Appended as they came, message 5 took offset 4 at
    the follower, and a second fetch from 9 stored 9 again: the follower said it was in sync with other messages
    at the holder's offsets (its copied commit points then skip or repeat messages after a take-over). Now the
    copy is refused: the follower holds each message at the holder's offset, and is not in sync."""
    holder = lmq_store.LmqStore(StoreConfig(data_dir=tmp_path / "holder"))
    holder.append([model.NewMessage(f"m{n}", "P", b"body-%03d" % n, (LITE_A,)) for n in range(10)])
    holder.close()
    (segment,) = (tmp_path / "holder" / "commitlog").glob("*.log")
    data = bytearray(segment.read_bytes())
    data[data.index(b"body-004") + 6] ^= 0x5A
    segment.write_bytes(data)
    holder = lmq_store.LmqStore(StoreConfig(data_dir=tmp_path / "holder"))
    mine = lmq_store.LmqStore(StoreConfig(data_dir=tmp_path / "follower"))
    try:
        assert [m.offset for m in holder.read(LITE_A, 0, 100)] == [0, 1, 2, 3, 5, 6, 7, 8, 9]

        async def ends(at: int, slot: int, cursor: str) -> tuple[dict[str, int], str | None]:
            return sources.ends_page(holder, slot, lambda topic: 0, cursor, sources.SCAN_PAGE)

        async def fetch(at: int, slot: int, topic: str, start: int) -> bytes:
            return sources.fetch(holder, slot, 1, topic, start, binary=True)

        follower = _follower_of(mine)
        with pytest.raises(errors.Conflict, match="the holder lacks the records between"):
            await follower.reconcile(0, ends, fetch)
        _held(mine)
        assert not follower.in_sync(0, 1)
    finally:
        holder.close()
        mine.close()


@pytest.mark.asyncio
async def test_a_copy_with_a_gap_between_its_batches_is_refused_not_stored_at_other_offsets(tmp_path: Path) -> None:
    """An owner whose queue to a follower was full dropped a batch (offsets 2-3) and ships the batches around it
    in one copy (0-1 and 4-5): its first offset is the follower's end, so only the gap tells. Refused (the owner
    counts the copy lost, the follower catches up), never 4-5 stored at 2-3."""
    messages = [model.NewMessage(f"m{n}", "P", b"x", (LITE_A,), slot=0, epoch=1) for n in range(6)]
    kept = [0, 1, 4, 5]
    results = [model.AppendResult(f"m{n}", (LITE_A,), (n,), 1) for n in kept]
    copy = wire.encode(0, 1, [messages[n] for n in kept], results, [])
    mine = lmq_store.LmqStore(StoreConfig(data_dir=tmp_path))
    try:
        follower = _follower_of(mine)
        with pytest.raises(errors.Conflict, match="the holder lacks the records between"):
            await follower.accept(copy)
        assert _held(mine) == {}
    finally:
        mine.close()


def test_a_probe_names_a_topic_whose_last_record_the_holder_lost(tmp_path: Path) -> None:
    """A probe sends the last message of each lite topic: a follower behind there answers its end and is caught
    up. A topic whose last record fails its CRC at the holder (its read passes over it) was left out of the probe,
    so a follower lacking the whole topic counted as holding everything. Its last message that reads is sent."""
    other = model.QueueId.lmq("P", "b")
    holder = lmq_store.LmqStore(StoreConfig(data_dir=tmp_path))
    holder.append([model.NewMessage(f"m{n}", "P", b"body-%03d" % n, (LITE_A,)) for n in range(5)])
    holder.append([model.NewMessage("b0", "P", b"other", (other,))])
    holder.close()
    (segment,) = (tmp_path / "commitlog").glob("*.log")
    data = bytearray(segment.read_bytes())
    data[data.index(b"body-004") + 6] ^= 0x5A
    segment.write_bytes(data)
    holder = lmq_store.LmqStore(StoreConfig(data_dir=tmp_path))
    try:
        tails = {m.queue.topic: m.message_id for m in sources.tails(holder, 0, lambda topic: 0)}
    finally:
        holder.close()
    assert tails == {LITE_A.topic: "m3", other.topic: "b0"}
