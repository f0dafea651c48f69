"""Settlement (``dispatch.settlement``): where offset writes run, acks whose write failed (kept dirty, never
silently dropped), persisted runs, and the store's index replaced while serving."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import pytest_asyncio
from waiting import eventually_async

from lmq_broker import errors, model
from lmq_broker.dispatch import dispatcher as dispatcher_module
from lmq_broker.dispatch import leases, runtime, settlement
from lmq_broker.dispatch.leases import LeaseKey
from lmq_broker.dispatch.subscriptions import lmq_name
from lmq_broker.dispatch.testing import GROUP, PARENT, Lite, config_for, lite_message, until
from lmq_broker.storage import keys, memory, ranges
from lmq_broker.storage.api import Store
from lmq_broker.storage.testing import another_writer

pytestmark = pytest.mark.asyncio


# --- settlement on its own, the delivery side a recorder -----------------------------------------------------


class Told:
    """The delivery side as settlement sees it (``settlement.Deliveries``): records what it is told."""

    def __init__(self) -> None:
        self.ready: list[tuple[LeaseKey, str]] = []
        self.busy: set[LeaseKey] = set()  # keys a delivery is using

    def delivering(self, key: LeaseKey) -> bool:
        return key in self.busy

    def ready_again(self, key: LeaseKey, *, prefer: str = "") -> None:
        self.ready.append((key, prefer))


@dataclass
class Alone:
    settling: settlement.Settlement
    told: Told
    table: leases.LeaseTable
    store: Store
    dead: list[tuple[str, list[model.StoredMessage]]]
    clock: memory.ManualClock
    key: ClassVar[LeaseKey] = LeaseKey(lmq_name(PARENT, "t1"), 0, GROUP)

    async def leased(self, messages: int, out: int) -> tuple[leases.QueueLeases, list[str]]:
        """``messages`` stored in t1 and the first ``out`` of them leased to c1, as a receive does; the handles."""
        self.store.append([lite_message("t1", message_id=f"m{i}") for i in range(messages)])
        state = await self.settling.state_of(self.key, ordered=True)
        handles = []
        for pick in state.picks(0, out):
            lease_id = self.table.new_lease_id()
            state.lease(pick, self.clock(), 1_000, lease_id, "c1")
            handles.append(self.table.receipt(self.key, pick.offset, lease_id))
        return state, handles


@pytest_asyncio.fixture
async def alone(store: Store, clock: memory.ManualClock, tmp_path: Path) -> AsyncIterator[Alone]:
    rt = runtime.Runtime(store, config_for(tmp_path / "unused"), clock=clock)
    await rt.start()
    dead: list[tuple[str, list[model.StoredMessage]]] = []

    async def dead_letter(group: str, messages: Sequence[model.StoredMessage]) -> None:
        dead.append((group, list(messages)))

    table = leases.LeaseTable("inc")
    settling, told = settlement.Settlement(rt, table, dead_letter, lambda: None), Told()
    settling.deliveries = told
    yield Alone(settling, told, table, store, dead, clock)
    await rt.close_executor()


async def test_an_ack_that_leaves_more_behind_tells_delivery_which_client_acked(alone: Alone) -> None:
    _, (handle,) = await alone.leased(messages=2, out=1)
    await alone.settling.ack(GROUP, handle, client_id="c1")
    assert alone.store.get_offset(alone.key.queue_id, GROUP) == 1
    assert alone.told.ready == [(alone.key, "c1")]  # the next message: offered to the acker first


async def test_lease_state_is_kept_while_a_delivery_uses_it_and_dropped_once_idle(alone: Alone) -> None:
    _, (handle,) = await alone.leased(messages=1, out=1)
    alone.told.busy.add(alone.key)
    await alone.settling.ack(GROUP, handle)
    assert alone.table.get(alone.key) is not None and alone.told.ready == []
    alone.told.busy.clear()
    alone.settling.release(alone.key)
    assert alone.table.get(alone.key) is None
    assert alone.store.get_offset(alone.key.queue_id, GROUP) == 1


async def test_messages_past_their_last_attempt_go_out_through_the_door_and_are_settled(alone: Alone) -> None:
    state, _ = await alone.leased(messages=1, out=0)
    (message,) = alone.store.read(alone.key.queue_id, 0, 1)
    (pick,) = state.picks(0, 1)
    await alone.settling.settle_dead(alone.key, state, [(pick, message)])
    assert alone.dead == [(GROUP, [message])]
    assert state.committed == 1 and alone.store.get_offset(alone.key.queue_id, GROUP) == 1


async def test_a_refused_commit_copy_is_counted_once_per_ack_it_refused_and_never_for_a_hand_out_write(
    alone: Alone,
) -> None:
    """With replication an ack waits for its commit point's copy; a refused copy (the fence closed) refuses
    the acks waiting on it and is counted once for each of them, not for a hand-out write nobody waited on."""
    state, (first, second) = await alone.leased(messages=2, out=2)
    copies: list[asyncio.Future[None]] = []
    told: list[BaseException] = []

    def committed(
        _queue: model.QueueId, _group: str, _offset: int, _acked: Sequence[int], _handouts: model.Handouts
    ) -> asyncio.Future[None]:
        copies.append(asyncio.get_running_loop().create_future())
        return copies[-1]

    alone.settling.committed, alone.settling.copy_refused = committed, told.append
    await alone.settling.persist(alone.key, state)  # the hand-outs' background write: a copy nobody awaits
    assert len(copies) == 1
    copies[0].set_exception(errors.Fenced("this broker does not hold the lease of slot 0 now"))
    acking = asyncio.create_task(alone.settling.ack(GROUP, first))
    await eventually_async(lambda: len(copies) == 2, "the ack's commit copy under way")
    assert told == []  # the hand-out write refused no client
    copies[1].set_exception(errors.Fenced("this broker does not hold the lease of slot 0 now"))
    with pytest.raises(errors.Fenced):
        await acking
    assert [type(e) for e in told] == [errors.Fenced]
    acked = asyncio.create_task(alone.settling.ack(GROUP, second))
    await eventually_async(lambda: len(copies) == 3, "the next ack's commit copy under way")
    copies[2].set_result(None)
    await acked  # a copy that was stored: nothing told
    assert len(told) == 1


async def test_an_ack_sent_again_while_its_commit_copy_is_under_way_waits_for_that_copy(alone: Alone) -> None:
    """A client that sends an ack again (its first call timed out while the commit copy waited for a slow
    follower) is answered as the first one is: once the copy is stored, refused when it is. Answered OK at once
    (nothing new to write), a kill -9 of the owner before the copy landed let the follower that took over
    deliver the message again although an AckMessage had been answered OK."""
    _, (handle,) = await alone.leased(messages=2, out=1)
    copies: list[asyncio.Future[None]] = []

    def committed(
        _queue: model.QueueId, _group: str, _offset: int, _acked: Sequence[int], _handouts: model.Handouts
    ) -> asyncio.Future[None]:
        copies.append(asyncio.get_running_loop().create_future())
        return copies[-1]

    alone.settling.committed = committed
    first = asyncio.create_task(alone.settling.ack(GROUP, handle))
    await eventually_async(lambda: len(copies) == 1, "the ack's commit copy under way")
    again = asyncio.create_task(alone.settling.ack(GROUP, handle))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not again.done(), "the ack sent again was answered before its commit point's copy was stored"
    copies[0].set_exception(errors.NotEnoughReplicas("not enough in-sync replicas of slot 0 stored the ack"))
    for acking in (first, again):
        with pytest.raises(errors.NotEnoughReplicas):
            await acking
    third = asyncio.create_task(alone.settling.ack(GROUP, handle))  # the client's next retry writes it again
    await eventually_async(lambda: len(copies) == 2, "the retry's commit copy under way")
    copies[1].set_result(None)
    await third
    assert alone.store.get_offset(alone.key.queue_id, GROUP) == 1


async def test_an_ack_whose_slot_was_lost_while_its_write_waited_is_refused_not_answered_uncopied(
    alone: Alone,
) -> None:
    """The fence let the ack in, then its offset write waited (another writer held the store) while the slot's
    lease was lost: replication makes no commit copy for a slot it no longer holds (``owning.Slots.committed``
    answers None). Answered OK, the ack was on no follower: the new holder delivered the message again."""
    _, (handle,) = await alone.leased(messages=2, out=1)
    held = [True]

    def fence(_queue: model.QueueId) -> None:
        if not held[0]:
            raise errors.Fenced("this broker does not hold the lease of slot 0 now")

    def committed(
        _queue: model.QueueId, _group: str, _offset: int, _acked: Sequence[int], _handouts: model.Handouts
    ) -> asyncio.Future[None] | None:
        assert not held[0]
        return None  # as ``owning.Slots.committed`` for a slot this broker does not hold

    alone.settling.fence, alone.settling.committed = fence, committed
    with another_writer(alone.store):
        acking = asyncio.create_task(alone.settling.ack(GROUP, handle))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not acking.done()  # past the fence, its write waiting for the store
        held[0] = False  # the lease lost meanwhile
    with pytest.raises(errors.Fenced):
        await asyncio.wait_for(acking, 10)


async def test_a_commit_point_copied_in_from_the_slots_holder_is_what_the_key_is_served_from_next(
    alone: Alone,
) -> None:
    """This broker held the slot (its commit point 1 remembered, a message out), lost it, and the holder's point
    3 was copied into its store: should it hold the slot again, the key is served from 3, not from memory. The
    handle of the message that was out is refused while nothing here says it was settled (an OK that settled
    nothing delivered it again), answered OK once it is."""
    state, (first, second) = await alone.leased(messages=4, out=2)
    await alone.settling.ack(GROUP, first)  # the point 1 remembered; offset 1 still out: the state is kept
    assert alone.table.get(alone.key) is state
    alone.store.commit_offset(alone.key.queue_id, GROUP, 3)  # as replication stores the holder's copy
    alone.settling.copied_in(alone.key.queue_id, GROUP)
    assert alone.table.get(alone.key) is None and state.gone  # whoever still holds it writes nothing of it
    with pytest.raises(errors.InvalidReceiptHandle, match="moved to another broker"):
        await alone.settling.ack(GROUP, second)  # no state says whether it was acked: refused, not an empty OK
    assert (await alone.settling.state_of(alone.key, ordered=True)).committed == 3
    await alone.settling.ack(GROUP, second)  # its message settled by the copied point: answered OK
    alone.store.commit_offset(alone.key.queue_id, GROUP, 1)  # a point below it (another state, the same rule)
    alone.settling.copied_in(alone.key.queue_id, GROUP)
    await alone.settling.state_of(alone.key, ordered=True)
    with pytest.raises(errors.InvalidReceiptHandle, match="moved to another broker"):
        await alone.settling.ack(GROUP, second)


# --- where offset writes run -----------------------------------------------------------------------------------


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


async def test_an_ack_while_another_writer_holds_the_store_commits_once_it_is_free(
    lite: Lite, monkeypatch: pytest.MonkeyPatch
) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1", b"a")
    await lite.send("t1", b"b")
    first, second = await lite.receive("c1", batch=32)
    pooled: list[object] = []
    run = lite.dispatcher.runtime.run

    async def recorded(*args: Any, **kwargs: Any) -> Any:
        pooled.append(args)
        return await run(*args, **kwargs)

    monkeypatch.setattr(lite.dispatcher.runtime, "run", recorded)
    with another_writer(lite.store):
        acking = asyncio.create_task(lite.dispatcher.ack(GROUP, first.receipt_handle))
        later = asyncio.create_task(lite.dispatcher.ack(GROUP, second.receipt_handle))
        await eventually_async(lambda: len(pooled) >= 1, "a commit handed to the pool")
        assert await lite.receive("c1") == []  # the loop runs on meanwhile: a receive is answered
        assert not acking.done() and not later.done()  # the commits wait on the pool; the loop runs on
    await asyncio.wait_for(asyncio.gather(acking, later), 10)
    assert lite.committed("t1") == 2


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
    await until(lambda: failing.refused > refused and not lite.dispatcher.settlement.retrying)
    assert lite.committed("t1") is None  # still refused: still dirty, tried again later
    failing.failing = False
    lite.clock.advance(dispatcher_module.HOUSEKEEPING_INTERVAL_MS)
    lite.dispatcher.tick()
    await until(lambda: lite.committed("t1") == 2 and not lite.dispatcher.settlement.retrying)
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
    await until(lambda: lite.committed("t1") == 1)


async def test_a_two_million_offset_hole_is_persisted_as_one_run(lite: Lite) -> None:
    """The hole is kept and stored as one [start, end) run, not two million offsets (what makes its commit cheap;
    bench_settlement-style timing belongs in bench/, not here)."""
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1", b"a")
    (got,) = await lite.receive("c1")
    key = LeaseKey(lmq_name(PARENT, "t1"), 0, GROUP)
    state = lite.dispatcher.leases.get(key)
    assert state is not None
    assert lite.dispatcher.settlement.settle_gone(key, state, 1, 2_000_001, [])  # as a read over a lost segment
    await lite.dispatcher.settlement.commit(key, state)
    queue = model.QueueId.lmq(PARENT, "t1")
    acked = lite.store.get_acked(queue, GROUP)
    assert isinstance(acked, ranges.OffsetRanges) and acked.runs == ((1, 2_000_001),)
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
