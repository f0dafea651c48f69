"""The store heals the faults that pause its writes (``healing``), in-process with faults injected at the fsync
and the index write; tests/storage/test_full_disk.py does the same with real full filesystems and real
failing fsyncs in a broker process."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest
from waiting import eventually

from lmq_broker import errors, model
from lmq_broker.storage import index as index_mod
from lmq_broker.storage import segment
from lmq_broker.storage import store as store_mod

Msg = Callable[..., model.NewMessage]
OpenLmq = Callable[..., store_mod.LmqStore]
LMQ_A = model.QueueId.lmq("P", "a")


def test_a_failed_background_fsync_pauses_writes_until_the_healer_syncs_again(
    open_lmq: OpenLmq, msg: Msg, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = open_lmq(flush_mode="async", flush_interval_ms=5)
    s.append([msg(message_id="1")])
    failing = threading.Event()
    failing.set()
    real_sync = segment.Segment.sync
    rewritten: list[tuple[int, int]] = []
    real_pwrite = os.pwrite

    def flaky_sync(self: segment.Segment) -> None:
        if failing.is_set():
            raise OSError(5, "Input/output error")
        real_sync(self)

    def recording_pwrite(fd: int, data: bytes, position: int) -> int:
        rewritten.append((position, len(data)))
        written: int = real_pwrite(fd, data, position)
        return written

    monkeypatch.setattr(segment.Segment, "sync", flaky_sync)
    s.append([msg(message_id="2")])  # acked (async): its bytes wait for the next fsync, which fails
    eventually(lambda: not s.faults().durable, "not s.faults().durable", interval_s=0.005)
    assert "commit log cannot be made durable" in (s.health() or "") and s.fatal() is None
    with pytest.raises(errors.StorageError, match="cannot be made durable"):
        s.append([msg(message_id="refused")])
    failures = s.faults().fsync_failures
    eventually(
        lambda: s.faults().fsync_failures >= failures + 2, "s.faults().fsync_failures >= failures + 2", interval_s=0.005
    )  # the healer retries, and fails
    log = s._core.log
    durable_before = log.durable_at
    monkeypatch.setattr(os, "pwrite", recording_pwrite)
    failing.clear()
    eventually(lambda: s.health() is None, "s.health() is None", interval_s=0.005)
    monkeypatch.undo()
    # The healer wrote the unsynced bytes again before its fsync: after a failed writeback a bare fsync
    # could succeed without them.
    assert durable_before[1] < log.active.size
    assert rewritten and rewritten[0][0] == durable_before[1]
    assert log.durable_at == (log.active.seq, log.active.size)
    s.append([msg(message_id="3")])
    assert [m.message_id for m in s.read(LMQ_A, 0, 10)] == ["1", "2", "3"]
    assert s.faults().refused["not_durable"] == 1


def test_a_fault_that_is_not_a_full_disk_and_does_not_heal_latches_and_fails_liveness(
    open_lmq: OpenLmq, msg: Msg, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = open_lmq()
    s.append([msg(message_id="1")])
    s._healer.give_up_s = 0.2
    before = s.faults().index_reopens

    def broken(self: index_mod.Index, wb: object) -> None:
        raise OSError("simulated: the index cannot write (not a full disk)")

    monkeypatch.setattr(index_mod.Index, "write", broken)
    with pytest.raises(errors.StorageError, match="not stored"):
        s.append([msg(message_id="2")])
    assert s.fatal() is None  # not yet: it may heal
    eventually(lambda: s.fatal() is not None, "s.fatal() is not None", interval_s=0.005)
    assert "could not recover from a storage fault" in (s.fatal() or "")
    assert s.faults().index_reopens > before and not s.faults().index_writable
    monkeypatch.undo()
    with pytest.raises(errors.StorageError, match="stopped accepting writes"):
        s.append([msg(message_id="3")])
    assert [m.message_id for m in s.read(LMQ_A, 0, 10)] == ["1"]


def test_a_full_disk_is_waited_out_however_long(open_lmq: OpenLmq, msg: Msg, monkeypatch: pytest.MonkeyPatch) -> None:
    s = open_lmq()
    s._healer.give_up_s = 0.0

    def full(self: index_mod.Index, wb: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(index_mod.Index, "write", full)
    with pytest.raises(errors.StorageError, match="No space left"):
        s.append([msg(message_id="1")])
    reopens = s.faults().index_reopens
    eventually(
        lambda: s.faults().index_reopens >= reopens + 3, "s.faults().index_reopens >= reopens + 3", interval_s=0.005
    )
    assert s.fatal() is None and "index cannot write" in (s.health() or "")
    monkeypatch.undo()
    eventually(lambda: s.health() is None, "s.health() is None", interval_s=0.005)
    s.append([msg(message_id="2")])
    assert [m.message_id for m in s.read(LMQ_A, 0, 10)] == ["2"]
