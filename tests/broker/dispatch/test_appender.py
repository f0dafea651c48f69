"""The appender: small requests of one loop pass are appended on the loop as one group; large ones, and
all of them while the store is busy or slow, go to its thread, where requests that queue up while it is
busy go to the store as one append; a failing request fails alone on either path."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from waiting import eventually_async

from lmq_broker import errors, model
from lmq_broker.config import FlushMode, StoreConfig
from lmq_broker.dispatch import appender as appender_mod
from lmq_broker.dispatch.appender import Appender
from lmq_broker.dispatch.testing import lite_message
from lmq_broker.storage import store as lmq_store
from lmq_broker.storage.api import PendingAppend, Store

pytestmark = pytest.mark.asyncio


class GatedStore:
    """Holds the first append until released, and records the size of every append call."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls: list[int] = []

    def append(self, messages: Sequence[model.NewMessage]) -> list[model.AppendResult]:
        self.calls.append(len(messages))
        self.entered.set()
        self.gate.wait(10)
        return self.inner.append(messages)


async def test_queued_requests_share_one_append_and_errors_stay_with_their_request(store: Store) -> None:
    store.put_parent_topic(model.ParentTopic("P"))
    gated = GatedStore(store)
    appender = Appender(gated, asyncio.get_running_loop(), inline_max_messages=0)  # type: ignore[arg-type]
    try:
        first = asyncio.ensure_future(appender.append([lite_message("a", message_id="1")]))
        await asyncio.to_thread(gated.entered.wait, 10)  # the thread is inside the first append
        good = asyncio.ensure_future(
            appender.append([lite_message("b", message_id="2"), lite_message("c", message_id="3")])
        )
        bad = asyncio.ensure_future(appender.append([lite_message("d", b"", message_id="4")]))
        also_good = asyncio.ensure_future(appender.append([lite_message("e", message_id="5")]))
        await asyncio.sleep(0)  # one loop turn: each task runs up to its queue.put
        gated.gate.set()
        assert [r.message_id for r in await first] == ["1"]
        assert [r.message_id for r in await good] == ["2", "3"]
        with pytest.raises(errors.BodyEmpty):
            await bad
        assert [r.message_id for r in await also_good] == ["5"]
        assert gated.calls[:2] == [1, 4]  # the first alone, then the three queued requests together
        assert gated.calls[2:] == [2, 1, 1]  # the combined append failed: each retried alone
        assert store.lite_topic(model.ParentTopic("P").name, "d") is None
        assert store.queue_offsets(model.QueueId.lmq("P", "e")) == (0, 1)
    finally:
        gated.gate.set()
        await appender.aclose()


class FakeTimer:
    """A perf_counter that only moves when a store call says so: "slow disk" costs no real time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class RecordingStore:
    """Passes appends through, recording (path, thread, message ids) of each; can refuse them, or make each
    take ``cost_s`` on a fake timer (a slow disk's fsync)."""

    def __init__(self, inner: Store, timer: FakeTimer | None = None) -> None:
        self.inner = inner
        self.timer = timer or FakeTimer()
        self.calls: list[tuple[str, int, list[str]]] = []
        self.refuse = 0  # refuse this many try_begin calls (another writer holds the store)
        self.sync_threads: list[int] = []
        self.sync_error: OSError | None = None  # the next inline fsync fails with it
        self.finish_error: Exception | None = None  # the next finish raises it (a bug in the store)
        self.cost_s = 0.0
        self.gate = threading.Event()  # the thread path waits for it: lets a test fill the queue first
        self.gate.set()

    def append(self, messages: Sequence[model.NewMessage]) -> list[model.AppendResult]:
        self.gate.wait(10)
        self.calls.append(("thread", threading.get_ident(), [m.message_id for m in messages]))
        self.timer.now += self.cost_s
        return self.inner.append(messages)

    def try_begin(self, requests: Sequence[Sequence[model.NewMessage]]) -> PendingAppend | None:
        if self.refuse:
            self.refuse -= 1
            return None
        self.calls.append(("inline", threading.get_ident(), [m.message_id for r in requests for m in r]))
        self.timer.now += self.cost_s
        pending = self.inner.try_begin(requests)
        return None if pending is None else HeldSync(pending, self)

    def paths(self) -> list[tuple[str, bool, list[str]]]:
        """(path, ran on the caller's thread, message ids) of each call."""
        me = threading.get_ident()
        return [(path, thread == me, ids) for path, thread, ids in self.calls]


class HeldSync:
    """A pending append whose fsync records its thread, waits for the recording store's gate, and can fail."""

    def __init__(self, inner: PendingAppend, recording: RecordingStore) -> None:
        self.inner = inner
        self.recording = recording

    @property
    def needs_sync(self) -> bool:
        return self.inner.needs_sync

    def sync(self) -> None:
        rec = self.recording
        rec.sync_threads.append(threading.get_ident())
        if rec.sync_error is not None:
            error, rec.sync_error = rec.sync_error, None
            raise error
        self.inner.sync()

    def finish(self, sync_error: BaseException | None = None) -> list[list[model.AppendResult] | BaseException]:
        outcomes = self.inner.finish(sync_error)
        if self.recording.finish_error is not None:
            error, self.recording.finish_error = self.recording.finish_error, None
            raise error
        return outcomes


@dataclass
class Rig:
    store: Store
    recording: RecordingStore
    appender: Appender
    timer: FakeTimer


@contextlib.asynccontextmanager
async def rigged(store: Store) -> AsyncIterator[Rig]:
    """An appender on a recording store (fake timer) over ``store``, parent topic P in place."""
    store.put_parent_topic(model.ParentTopic("P"))
    timer = FakeTimer()
    recording = RecordingStore(store, timer)
    appender = Appender(recording, asyncio.get_running_loop(), timer=timer)  # type: ignore[arg-type]
    try:
        yield Rig(store, recording, appender, timer)
    finally:
        await appender.aclose()


@pytest_asyncio.fixture
async def rig(store: Store) -> AsyncIterator[Rig]:
    """``rigged`` over either store."""
    async with rigged(store) as made:
        yield made


def start(appender: Appender, *requests: list[model.NewMessage]) -> list[asyncio.Future[list[model.AppendResult]]]:
    """Start the requests in this order, all in the same loop pass."""
    return [asyncio.ensure_future(appender.append(r)) for r in requests]


def one(lite: str, message_id: str) -> list[model.NewMessage]:
    return [lite_message(lite, message_id=message_id)]


def ids(results: list[model.AppendResult]) -> list[str]:
    return [r.message_id for r in results]


async def test_small_requests_of_one_loop_pass_are_one_append_on_the_loop(rig: Rig) -> None:
    store, recording, appender = rig.store, rig.recording, rig.appender
    good = start(appender, one("a", "0"), one("b", "1"), one("c", "2"))
    bad = asyncio.ensure_future(appender.append([lite_message("d", b"", message_id="bad")]))
    assert [ids(await f) for f in good] == [["0"], ["1"], ["2"]]
    with pytest.raises(errors.BodyEmpty):
        await bad
    # one group, on the loop's thread: the store keeps its requests apart, so the bad one fails alone
    assert recording.paths() == [("inline", True, ["0", "1", "2", "bad"])]
    assert appender.stats[:2] == (1, 0)
    assert store.queue_offsets(model.QueueId.lmq("P", "c")) == (0, 1)
    assert store.lite_topic("P", "d") is None


async def test_a_large_request_goes_to_the_thread_and_takes_the_earlier_small_ones_along(rig: Rig) -> None:
    store, recording, appender = rig.store, rig.recording, rig.appender
    large = [lite_message("a", message_id=f"L{i}") for i in range(appender_mod.INLINE_MAX_MESSAGES + 1)]
    small, big, after = start(appender, one("a", "s1"), large, one("a", "s2"))
    assert ids(await small) == ["s1"] and len(await big) == len(large) and ids(await after) == ["s2"]
    stored = [m.message_id for m in store.read(model.QueueId.lmq("P", "a"), 0, 100)]
    assert stored == ["s1", *(m.message_id for m in large), "s2"]  # the order they reached append
    assert all(path == "thread" and not on_loop for path, on_loop, _ in recording.paths())
    assert appender.stats[:2] == (0, len(recording.calls))


async def test_a_refused_group_goes_to_the_thread_in_its_order(rig: Rig) -> None:
    store, recording, appender = rig.store, rig.recording, rig.appender
    recording.refuse = 1
    recording.gate.clear()  # the thread waits until the whole refused group is on its queue
    requests = start(appender, one("a", "0"), one("a", "1"), one("a", "2"))
    for _ in range(10):  # a few loop passes: the tasks queue their requests, then the inline commit runs
        await asyncio.sleep(0)
    assert recording.refuse == 0  # refused at once, nothing written on the loop
    recording.gate.set()
    assert [ids(await f) for f in requests] == [["0"], ["1"], ["2"]]
    assert [m.message_id for m in store.read(model.QueueId.lmq("P", "a"), 0, 10)] == ["0", "1", "2"]
    assert recording.paths() == [("thread", False, ["0", "1", "2"])]  # one append on the thread
    assert appender.stats[:2] == (0, 1)


async def test_an_inline_group_is_bounded_by_moving_it_to_the_thread(rig: Rig) -> None:
    store, recording, appender = rig.store, rig.recording, rig.appender
    per_request = appender_mod.INLINE_MAX_MESSAGES
    n = appender_mod.INLINE_GROUP_MAX_MESSAGES // per_request + 1
    requests = [[lite_message("a", message_id=f"{r}-{i}") for i in range(per_request)] for r in range(n)]
    for f in start(appender, *requests):
        assert len(await f) == per_request
    # The request that would overflow the group goes to the thread and takes the group along (order).
    assert {path for path, _, _ in recording.paths()} == {"thread"}
    stored = [m.message_id for m in store.read(model.QueueId.lmq("P", "a"), 0, n * per_request)]
    assert stored == [m.message_id for r in requests for m in r]
    assert appender.stats.loop_commits == 0


async def test_slow_appends_move_small_requests_to_the_thread_and_a_quick_probe_brings_them_back(rig: Rig) -> None:
    store, recording, appender, timer = rig.store, rig.recording, rig.appender, rig.timer
    recording.cost_s = appender_mod.INLINE_MAX_BLOCK_S * 5  # every append now takes 10 ms
    sent = 0
    while appender.stats.thread_commits == 0:  # slow inline appends raise the average until the thread takes over
        assert sent < 50, "slow appends never moved off the loop"
        await appender.append(one("a", str(sent)))
        sent += 1
    assert appender.stats.inline_seconds > appender_mod.INLINE_MAX_BLOCK_S
    recording.cost_s = 0.0  # the disk is quick again
    loop_commits = appender.stats.loop_commits
    for _ in range(3):  # no probe yet: the thread keeps them
        await appender.append(one("a", str(sent)))
        sent += 1
    assert appender.stats.loop_commits == loop_commits
    timer.now += appender_mod.PROBE_INTERVAL_S
    for _ in range(3):  # the first is a probe, quick: the slow spell is over
        await appender.append(one("a", str(sent)))
        sent += 1
    assert appender.stats.loop_commits == loop_commits + 3
    assert appender.stats.inline_seconds <= appender_mod.INLINE_MAX_BLOCK_S
    stored = [m.message_id for m in store.read(model.QueueId.lmq("P", "a"), 0, 100)]
    assert stored == [str(i) for i in range(sent)]


async def test_appends_after_close_still_complete_on_the_loop(store: Store) -> None:
    store.put_parent_topic(model.ParentTopic("P"))
    recording = RecordingStore(store)
    appender = Appender(recording, asyncio.get_running_loop())  # type: ignore[arg-type]
    await appender.aclose()
    large = [lite_message("a", message_id=f"L{i}") for i in range(appender_mod.INLINE_MAX_MESSAGES + 1)]
    recording.refuse = 1  # even a busy store: at shutdown the loop waits for it
    small, big = start(appender, one("a", "s"), large)
    assert ids(await small) == ["s"] and len(await big) == len(large)
    assert [path for path, on_loop, _ in recording.paths() if on_loop] == ["thread"]  # store.append, on the loop


@pytest_asyncio.fixture
async def sync_rig(tmp_path: Path) -> AsyncIterator[Rig]:
    """``rig`` over an LmqStore in ``sync`` flush mode: inline groups have an fsync to run."""
    store = lmq_store.open_store(StoreConfig(data_dir=tmp_path / "data", flush_mode=FlushMode.SYNC))
    try:
        async with rigged(store) as made:
            yield made
    finally:
        store.close()


async def test_a_failed_inline_fsync_fails_its_group_and_the_store_takes_no_more_until_one_succeeds(
    sync_rig: Rig,
) -> None:
    store, recording, appender = sync_rig.store, sync_rig.recording, sync_rig.appender
    recording.sync_error = OSError(5, "Input/output error")
    failed = start(appender, one("a", "0"), one("b", "1"))
    for f in failed:
        with pytest.raises(errors.StorageError, match="fsync failed"):
            await f
    recording.sync_error = None
    with pytest.raises(errors.StorageError, match="cannot be made durable"):
        await appender.append(one("a", "2"))
    assert store.queue_offsets(model.QueueId.lmq("P", "a")) == (0, 0)
    await eventually_async(lambda: store.health() is None, "the store healed")
    assert ids(await appender.append(one("a", "3"))) == ["3"]
    assert store.queue_offsets(model.QueueId.lmq("P", "a")) == (0, 1)  # "0" and "2" were never stored


async def test_a_store_bug_in_finish_still_answers_every_caller(sync_rig: Rig) -> None:
    recording, appender = sync_rig.recording, sync_rig.appender
    recording.finish_error = RuntimeError("bug")
    for f in start(appender, one("a", "0"), one("b", "1")):
        with pytest.raises(RuntimeError, match="bug"):
            await f
    assert ids(await appender.append(one("a", "2"))) == ["2"]  # the next group goes through


async def test_an_inline_group_is_fsynced_on_the_loop_before_its_callers_hear_of_it(sync_rig: Rig) -> None:
    store, recording, appender = sync_rig.store, sync_rig.recording, sync_rig.appender
    results = [ids(await f) for f in start(appender, one("a", "0"), one("b", "1"))]
    assert results == [["0"], ["1"]]
    assert recording.sync_threads == [threading.get_ident()]  # one fsync for the group, on the loop's thread
    assert recording.paths() == [("inline", True, ["0", "1"])]
    assert store.queue_offsets(model.QueueId.lmq("P", "b")) == (0, 1)
