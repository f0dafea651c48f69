"""Flush modes and group commit of LmqStore: sync appends return durable and share fsyncs; async flushes later."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from waiting import eventually

from lmq_broker import errors, model
from lmq_broker.storage import appends, commitlog
from lmq_broker.storage import segment as segment_mod
from lmq_broker.storage import store as store_mod
from lmq_broker.storage.testing import append_if_free

Msg = Callable[..., model.NewMessage]
OpenLmq = Callable[..., store_mod.LmqStore]


def test_sync_append_returns_only_once_fsynced(open_lmq: OpenLmq, msg: Msg) -> None:
    s = open_lmq(flush_mode="sync")
    log: commitlog.CommitLog = s._core.log
    for _ in range(5):
        s.append([msg(), msg()])
        assert log.synced == log.written  # every byte of the returned append is on disk


def test_concurrent_sync_appends_share_one_fsync(open_lmq: OpenLmq, msg: Msg, monkeypatch: pytest.MonkeyPatch) -> None:
    s = open_lmq(flush_mode="sync")
    n_threads = 8
    first_sync = threading.Event()
    real_sync = commitlog.CommitLog.sync

    def slow_first_sync(self: commitlog.CommitLog) -> None:
        if not first_sync.is_set():
            first_sync.set()
            # hold the first fsync until every other writer has queued its request behind it
            eventually(
                lambda: len(s._appender._queue) == n_threads - 1,
                "len(s._appender._queue) == n_threads - 1",
                interval_s=0.001,
            )
        real_sync(self)

    monkeypatch.setattr(commitlog.CommitLog, "sync", slow_first_sync)
    before = s.fsync_count
    threads = [threading.Thread(target=s.append, args=([msg()],)) for _ in range(n_threads)]
    threads[0].start()
    first_sync.wait(10)
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join()
    assert s.fsync_count - before == 2  # the first writer's, then one for the seven that queued meanwhile
    assert s.queue_offsets(model.QueueId.lmq("P", "a")) == (0, n_threads)


def test_async_append_returns_before_fsync_and_the_flusher_catches_up(open_lmq: OpenLmq, msg: Msg) -> None:
    s = open_lmq(flush_mode="async", flush_interval_ms=20)
    log: commitlog.CommitLog = s._core.log
    s.append([msg() for _ in range(10)])
    eventually(lambda: log.synced == log.written, "log.synced == log.written", interval_s=0.001)
    assert s.fsync_count >= 1


def test_flush_makes_async_appends_durable_now(open_lmq: OpenLmq, msg: Msg) -> None:
    s = open_lmq(flush_mode="async", flush_interval_ms=3_600_000)
    log: commitlog.CommitLog = s._core.log
    s.append([msg()])
    assert log.synced < log.written
    s.flush()
    assert log.synced == log.written


def test_a_failed_log_write_is_rolled_back_and_reported(
    open_lmq: OpenLmq, msg: Msg, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = open_lmq(segment_max_bytes=4096)
    s.append([msg(body=b"x" * 1000)])
    size_before = s._core.log.active.size
    real_append = commitlog.CommitLog.append
    calls = {"n": 0}

    def fail_second_chunk(self: commitlog.CommitLog, data: bytes) -> int:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real_append(self, data)

    monkeypatch.setattr(commitlog.CommitLog, "append", fail_second_chunk)
    with pytest.raises(errors.StorageError):
        s.append([msg(body=b"y" * 1000) for _ in range(6)])  # spans a roll: two chunks
    monkeypatch.undo()
    assert s._core.log.active.size == size_before and len(s._core.log.seqs()) == 1
    assert s.queue_offsets(model.QueueId.lmq("P", "a")) == (0, 1)
    assert s.append([msg()])[0].offsets[model.QueueId.lmq("P", "a")] == 1


def test_append_if_free_refuses_at_once_while_another_writer_syncs(
    open_lmq: OpenLmq, msg: Msg, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = open_lmq(flush_mode="sync")
    in_sync = threading.Event()
    release = threading.Event()
    real_sync = commitlog.CommitLog.sync

    def held_sync(self: commitlog.CommitLog) -> None:
        if not release.is_set():
            in_sync.set()
            release.wait(10)
        real_sync(self)

    monkeypatch.setattr(commitlog.CommitLog, "sync", held_sync)
    writer = threading.Thread(target=s.append, args=([msg(message_id="first")],))
    writer.start()
    try:
        assert in_sync.wait(10)
        started = time.monotonic()
        assert append_if_free(s, [msg(message_id="refused")]) is None
        assert time.monotonic() - started < 1.0  # refused at once, not after the other writer's fsync
    finally:
        release.set()
        writer.join()
    assert [m.message_id for m in s.read(model.QueueId.lmq("P", "a"), 0, 10)] == ["first"]  # nothing of it written
    results = append_if_free(s, [msg(message_id="second")])
    assert results is not None
    assert results[0].offsets == {model.QueueId("P", 0): 1, model.QueueId.lmq("P", "a"): 1}
    assert s._core.log.synced == s._core.log.written  # sync mode: it returns once fsynced too


def test_try_begin_leaves_the_requests_queued_by_other_writers_to_them(
    open_lmq: OpenLmq, msg: Msg, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = open_lmq(flush_mode="sync")
    rounds: list[tuple[int, list[str]]] = []  # (thread, message ids) of every write round
    real_stage = appends.Appender._stage

    def recording_stage(self: appends.Appender, reqs: list[appends._Request]) -> appends._Staged | None:
        rounds.append((threading.get_ident(), [m.message_id for r in reqs for m in r.messages]))
        return real_stage(self, reqs)

    monkeypatch.setattr(appends.Appender, "_stage", recording_stage)
    big = [msg(message_id=f"big-{i}") for i in range(100)]
    s._core.write_lock.acquire()  # another writer holds the store while a thread queues a large append behind it
    waiter = threading.Thread(target=s.append, args=(big,))
    waiter.start()
    try:
        eventually(lambda: len(s._appender._queue) == 1, "len(s._appender._queue) == 1", interval_s=0.001)
    finally:
        s._core.write_lock.release()
    mine: list[model.AppendResult] | None = None
    while mine is None:  # whoever gets the lock first: the caller's own request only, never the queued one
        mine = append_if_free(s, [msg(message_id="mine")])
    waiter.join()
    me = threading.get_ident()
    assert [ids for thread, ids in rounds if thread == me] == [["mine"]]
    assert [ids for thread, ids in rounds if thread != me] == [[m.message_id for m in big]]
    stored = [m.message_id for m in s.read(model.QueueId.lmq("P", "a"), 0, 200)]
    assert sorted(stored) == sorted(["mine", *(m.message_id for m in big)])  # each stored once


class _Announcing:
    """The store's write lock, telling (``waiting``) when a blocking acquire finds it held: a writer waits."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock, self.waiting = lock, threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self.lock.acquire(blocking=False):
            return True
        if not blocking:
            return False
        self.waiting.set()
        return self.lock.acquire(timeout=timeout)

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def test_try_begin_writes_without_showing_anything_until_finish_and_holds_the_write_path(
    open_lmq: OpenLmq, msg: Msg, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = open_lmq(flush_mode="sync")
    pending = s.try_begin([[msg(message_id="1"), msg(message_id="2")], [msg(message_id="bad", body=b"")]])
    assert pending is not None and pending.needs_sync
    assert s._core.log.written > s._core.log.synced  # on the log, not yet fsynced
    assert s.queue_offsets(model.QueueId.lmq("P", "a")) == (0, 0)  # nor indexed: nobody reads it yet
    lock = _Announcing(s._core.write_lock)
    monkeypatch.setattr(s._core, "write_lock", lock)
    other = threading.Thread(target=s.append, args=([msg(message_id="3")],))
    other.start()
    assert lock.waiting.wait(10) and other.is_alive()  # another writer waits for the pending append
    assert append_if_free(s, [msg(message_id="refused")]) is None
    pending.sync()
    assert s._core.log.synced == s._core.log.written
    good, bad = pending.finish()
    other.join(10)
    assert not other.is_alive()
    assert isinstance(good, list) and [r.message_id for r in good] == ["1", "2"]
    assert isinstance(bad, errors.BodyEmpty)  # fails alone: nothing of it written
    assert [m.message_id for m in s.read(model.QueueId.lmq("P", "a"), 0, 10)] == ["1", "2", "3"]
    with pytest.raises(RuntimeError):
        pending.finish()


def test_try_begin_in_async_mode_needs_no_sync(open_lmq: OpenLmq, msg: Msg) -> None:
    s = open_lmq(flush_mode="async")
    pending = s.try_begin([[msg(message_id="1")]])
    assert pending is not None and not pending.needs_sync
    (results,) = pending.finish()
    assert isinstance(results, list) and results[0].message_id == "1"


def test_a_failed_fsync_cuts_its_appends_off_the_log_and_pauses_writes_until_one_succeeds(
    open_lmq: OpenLmq, msg: Msg
) -> None:
    s = open_lmq(flush_mode="sync")
    s.append([msg(message_id="before")])
    size = s._core.log.active.size
    pending = s.try_begin([[msg(message_id="lost")]])
    assert pending is not None
    (outcome,) = pending.finish(OSError(5, "Input/output error"))
    assert isinstance(outcome, errors.StorageError) and "not stored" in str(outcome) and "fsync failed" in str(outcome)
    assert s._core.log.active.size == size  # cut off: no replay can index it later
    assert [m.message_id for m in s.read(model.QueueId.lmq("P", "a"), 0, 10)] == ["before"]  # never indexed
    assert s.faults().fsync_failures == 1 and not s.faults().durable
    assert "cannot be made durable" in (s.health() or "")
    assert s.fatal() is None  # it heals: no restart needed
    with pytest.raises(errors.StorageError, match="cannot be made durable"):
        s.append([msg(message_id="refused")])
    with pytest.raises(errors.StorageError, match="cannot be made durable"):
        append_if_free(s, [msg(message_id="refused")])
    assert s.faults().refused["not_durable"] == 2
    eventually(
        lambda: s.health() is None, "s.health() is None", interval_s=0.001
    )  # the healer's fsync succeeds (the disk is fine)
    assert s.faults().durable
    s.append([msg(message_id="after")])
    assert [m.message_id for m in s.read(model.QueueId.lmq("P", "a"), 0, 10)] == ["before", "after"]


def test_try_begin_of_empty_requests_writes_nothing(open_lmq: OpenLmq) -> None:
    s = open_lmq(flush_mode="sync")
    written = s._core.log.written
    pending = s.try_begin([[], []])
    assert pending is not None and not pending.needs_sync
    assert pending.finish() == [[], []]
    assert s._core.log.written == written


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("record", ["tombstone", "truncation"])
def test_a_failed_fsync_of_tombstones_pauses_writes_too(
    open_lmq: OpenLmq, msg: Msg, monkeypatch: pytest.MonkeyPatch, mode: str, record: str
) -> None:
    """In either flush mode: a control record is followed by meta/ writes only it can redo at the next open,
    so it is fsynced before them, and a failed fsync cuts it off the log again ("not done" is true)."""
    s = open_lmq(flush_mode=mode, flush_interval_ms=600_000)  # no background fsync meanwhile
    s.append([msg(message_id="1")])
    s.flush()
    size = s._core.log.active.size

    def failing_sync(self: commitlog.CommitLog) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(commitlog.CommitLog, "sync", failing_sync)
    with pytest.raises(errors.StorageError, match="fsync failed"):
        if record == "tombstone":
            s.delete_lite_topics([("P", "a", None)])
        else:
            s.truncate_queue(model.QueueId.lmq("P", "a"), 0)
    monkeypatch.undo()
    assert s.queue_offsets(model.QueueId.lmq("P", "a")) == (0, 1)  # not cut either
    assert s._core.log.active.size == size  # the tombstone is cut off: no later replay deletes the topic
    assert s.lite_topic("P", "a") is not None  # not deleted: the index was never told
    with pytest.raises(errors.StorageError, match="cannot be made durable"):
        s.append([msg(message_id="2")])
    eventually(lambda: s.health() is None, "s.health() is None", interval_s=0.001)
    assert s.delete_lite_topics([("P", "a", None)]) == [True]


def test_a_roll_whose_new_segment_cannot_be_made_durable_fails_alone_and_later_rolls_work(
    open_lmq: OpenLmq, msg: Msg, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory fsync after creating the next segment fails (EIO): that append is refused and cut off,
    and the half-made file must not stay behind, or every later roll would fail on it (O_EXCL) for good."""
    s = open_lmq(flush_mode="sync", segment_max_bytes=4096)
    s.append([msg(message_id="0", body=b"x" * 3000)])
    real = segment_mod.fsync_dir
    calls: list[int] = []

    def failing_once(path: Path) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")
        real(path)

    monkeypatch.setattr(segment_mod, "fsync_dir", failing_once)
    with pytest.raises(errors.StorageError, match="write failed"):
        s.append([msg(message_id="1", body=b"x" * 3000)])  # does not fit: rolls
    monkeypatch.undo()
    eventually(lambda: s.health() is None, "s.health() is None", interval_s=0.001)
    [res] = s.append([msg(message_id="2", body=b"x" * 3000)])
    assert res.offsets[model.QueueId.lmq("P", "a")] == 1
    assert [m.message_id for m in s.read(model.QueueId.lmq("P", "a"), 0, 10)] == ["0", "2"]
    assert s._core.log.seqs() == [0, 1]
