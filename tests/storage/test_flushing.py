"""Flush modes and group commit of LmqStore: sync appends return durable and share fsyncs; async flushes later."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from lmq_broker import errors, model
from lmq_broker.storage import commitlog
from lmq_broker.storage import store as store_mod

Msg = Callable[..., model.NewMessage]
OpenLmq = Callable[..., store_mod.LmqStore]


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        time.sleep(0.001)


def test_sync_append_returns_only_once_fsynced(open_lmq: OpenLmq, msg: Msg) -> None:
    s = open_lmq(flush_mode="sync")
    log: commitlog.CommitLog = s._log
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
            wait_until(lambda: len(s._queue) == n_threads - 1)
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
    log: commitlog.CommitLog = s._log
    s.append([msg() for _ in range(10)])
    wait_until(lambda: log.synced == log.written)
    assert s.fsync_count >= 1


def test_flush_makes_async_appends_durable_now(open_lmq: OpenLmq, msg: Msg) -> None:
    s = open_lmq(flush_mode="async", flush_interval_ms=3_600_000)
    log: commitlog.CommitLog = s._log
    s.append([msg()])
    assert log.synced < log.written
    s.flush()
    assert log.synced == log.written


def test_a_failed_log_write_is_rolled_back_and_reported(
    open_lmq: OpenLmq, msg: Msg, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = open_lmq(segment_max_bytes=4096)
    s.append([msg(body=b"x" * 1000)])
    size_before = s._log.active.size
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
    assert s._log.active.size == size_before and len(s._log.seqs()) == 1
    assert s.queue_offsets(model.QueueId.lmq("P", "a")) == (0, 1)
    assert s.append([msg()])[0].offsets[model.QueueId.lmq("P", "a")] == 1


def test_try_append_refuses_at_once_while_another_writer_syncs(
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
        assert s.try_append([msg(message_id="refused")]) is None
        assert time.monotonic() - started < 1.0  # refused at once, not after the other writer's fsync
    finally:
        release.set()
        writer.join()
    assert [m.message_id for m in s.read(model.QueueId.lmq("P", "a"), 0, 10)] == ["first"]  # nothing of it written
    results = s.try_append([msg(message_id="second")])
    assert results is not None
    assert results[0].offsets == {model.QueueId("P", 0): 1, model.QueueId.lmq("P", "a"): 1}
    assert s._log.synced == s._log.written  # sync mode: a try_append returns once fsynced too


def test_try_append_leaves_the_requests_queued_by_other_writers_to_them(
    open_lmq: OpenLmq, msg: Msg, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = open_lmq(flush_mode="sync")
    rounds: list[tuple[int, list[str]]] = []  # (thread, message ids) of every write round
    real_round = store_mod.LmqStore._round

    def recording_round(self: store_mod.LmqStore, reqs: list[store_mod._Request]) -> None:
        rounds.append((threading.get_ident(), [m.message_id for r in reqs for m in r.messages]))
        real_round(self, reqs)

    monkeypatch.setattr(store_mod.LmqStore, "_round", recording_round)
    big = [msg(message_id=f"big-{i}") for i in range(100)]
    s._write_lock.acquire()  # another writer holds the store while a thread queues a large append behind it
    waiter = threading.Thread(target=s.append, args=(big,))
    waiter.start()
    try:
        wait_until(lambda: len(s._queue) == 1)
    finally:
        s._write_lock.release()
    mine: list[model.AppendResult] | None = None
    while mine is None:  # whoever gets the lock first: the caller's own request only, never the queued one
        mine = s.try_append([msg(message_id="mine")])
    waiter.join()
    me = threading.get_ident()
    assert [ids for thread, ids in rounds if thread == me] == [["mine"]]
    assert [ids for thread, ids in rounds if thread != me] == [[m.message_id for m in big]]
    stored = [m.message_id for m in s.read(model.QueueId.lmq("P", "a"), 0, 200)]
    assert sorted(stored) == sorted(["mine", *(m.message_id for m in big)])  # each stored once
