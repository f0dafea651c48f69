"""Async flush mode: log, index and meta reach the disk separately, so a power cut can leave meta ahead of a
log that lost its end at a clean record boundary (nothing torn, nothing for recovery to notice). Opening must
still never hand out an offset a group has committed past."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest

from lmq_broker import config, model
from lmq_broker.storage import core as core_mod
from lmq_broker.storage import keys, recovery, segment
from lmq_broker.storage import store as store_mod

Q = model.QueueId("T", 0)

# The second session: it writes and commits, then the process dies without closing (as in a power cut).
CRASHING_SESSION = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from lmq_broker import config, model
    from lmq_broker.storage import store
    cfg = config.StoreConfig(data_dir=Path(sys.argv[1]), flush_mode=config.FlushMode.ASYNC)
    q = model.QueueId("T", 0)
    s = store.open_store(cfg)
    s.append([model.NewMessage(message_id=f"m{i}", topic="T", body=b"b", queues=(q,)) for i in range(5, 10)])
    s.commit_offset(q, "G", 10)
    os._exit(0)
    """
)
CRASHING_SYNC_SESSION = CRASHING_SESSION.replace("FlushMode.ASYNC", "FlushMode.SYNC")


def crash(session: str, cfg: config.StoreConfig) -> None:
    argv = [sys.executable, "-c", session, str(cfg.data_dir)]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def messages(lo: int, hi: int) -> list[model.NewMessage]:
    return [model.NewMessage(message_id=f"m{i}", topic="T", body=b"b", queues=(Q,)) for i in range(lo, hi)]


@pytest.mark.parametrize("before", ["async", "sync"])
def test_a_power_cut_that_loses_the_log_end_cleanly_never_reuses_a_committed_offset(
    store_config: Callable[..., config.StoreConfig], before: str
) -> None:
    """The crashing session runs async; the one before it (closed cleanly) either mode: a sync session's
    marker must not vouch for the async one after it."""
    cfg = store_config(flush_mode="async")
    d = cfg.data_dir
    s = store_mod.open_store(store_config(flush_mode=before))
    s.append(messages(0, 5))
    s.close()
    [seg] = (d / "commitlog").glob("*.log")
    size5 = seg.stat().st_size
    shutil.copytree(d / "index", d / "index.before")
    crash(CRASHING_SESSION, cfg)
    # The power cut: the log's unsynced last batch and the index's unsynced writes are lost at a record
    # boundary; meta kept its commit.
    shutil.rmtree(d / "index")
    os.rename(d / "index.before", d / "index")
    os.truncate(seg, size5)

    s = store_mod.open_store(cfg)
    try:
        assert s.recovery.queues_reconciled == 1
        assert s.get_offset(Q, "G") == 10
        assert s.queue_offsets(Q) == (0, 10)
        [res] = s.append(messages(100, 101))
        assert res.offsets[Q] == 10
        # The offsets the log lost are a recorded loss: a group behind them passes over them.
        got, end = s.read_span(Q, 0, 32)
        assert [m.offset for m in got] == [0, 1, 2, 3, 4, 10] and end == 11
    finally:
        s.close()


def test_a_clean_close_leaves_a_marker_that_the_next_open_consumes(
    store_config: Callable[..., config.StoreConfig],
) -> None:
    cfg = store_config()
    s = store_mod.open_store(cfg)
    s.append(messages(0, 3))
    s.commit_offset(Q, "G", 3)
    s.close()
    s = store_mod.open_store(cfg)
    try:
        assert s.recovery.queues_reconciled == 0
        assert s._meta.get(keys.CLEAN_KEY) is None  # removed at open: a crash from now on reconciles
    finally:
        s.close()


def test_after_a_crash_of_a_sync_session_offsets_are_not_reconciled(
    store_config: Callable[..., config.StoreConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sync mode indexes (so delivers) a record only after its fsync: no group can have passed the durable
    log, so an unclean open skips the walk over every committed offset (seconds for a million of them)."""
    cfg = store_config(flush_mode="sync")
    s = store_mod.open_store(cfg)
    s.append(messages(0, 5))
    s.close()
    crash(CRASHING_SYNC_SESSION, cfg)
    walks: list[int] = []
    real = recovery.reconcile_offsets

    def counted(core: core_mod.Core) -> int:
        walks.append(1)
        return real(core)

    monkeypatch.setattr(recovery, "reconcile_offsets", counted)
    s = store_mod.open_store(cfg)
    try:
        assert walks == []
        assert s.get_offset(Q, "G") == 10 and s.queue_offsets(Q) == (0, 10)
    finally:
        s.close()
    # The same crash with the session in async mode is walked.
    crash(CRASHING_SESSION, cfg)
    s = store_mod.open_store(cfg)
    try:
        assert walks == [1]
    finally:
        s.close()


# An async session that flushed m0-m4, then appended m5-m9 and committed past them, and died before the next
# background fsync: the index (its WAL was written) and meta kept everything, the log's last batch sits in the
# page cache only.
UNFLUSHED_SESSION = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from lmq_broker import config, model
    from lmq_broker.storage import store
    cfg = config.StoreConfig(data_dir=Path(sys.argv[1]), flush_mode=config.FlushMode.ASYNC, flush_interval_ms=600_000)
    q = model.QueueId("T", 0)
    s = store.open_store(cfg)
    s.append([model.NewMessage(message_id=f"m{i}", topic="T", body=b"b" * 100, queues=(q,)) for i in range(5)])
    s.flush()
    print(s._core.log.active.size)
    s.append([model.NewMessage(message_id=f"m{i}", topic="T", body=b"b" * 100, queues=(q,)) for i in range(5, 10)])
    s.commit_offset(q, "G", 7)
    os._exit(0)
    """
)


@pytest.mark.parametrize("tail", ["zeros", "stale"])
def test_a_power_cut_that_zeroes_indexed_records_rebuilds_rather_than_serving_them_as_damage(
    store_config: Callable[..., config.StoreConfig], tail: str
) -> None:
    """The file kept its length but its unsynced end reads back as zeros (or as stale blocks) while the index
    points into it: the open must notice (its checkpoint lies above bytes that do not check), cut the log and
    record the loss, not keep index entries that fail at every read and count as fresh damage each time."""
    cfg = store_config(flush_mode="async")
    argv = [sys.executable, "-c", UNFLUSHED_SESSION, str(cfg.data_dir)]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)
    assert proc.returncode == 0, proc.stderr
    durable = int(proc.stdout)
    [seg] = (cfg.data_dir / "commitlog").glob("*.log")
    size = seg.stat().st_size
    with seg.open("r+b") as f:  # the power cut
        f.seek(durable)
        f.write(bytes(size - durable) if tail == "zeros" else os.urandom(size - durable))
    s = store_mod.open_store(cfg)
    try:
        assert s.recovery.rebuilt and s.recovery.truncated_bytes == size - durable
        assert s.queue_offsets(Q) == (0, 7)  # raised to the commit point: 5 and 6 a recorded loss
        got, end = s.read_span(Q, 0, 32)
        assert [m.message_id for m in got] == [f"m{i}" for i in range(5)] and end == 7
        [res] = s.append(messages(100, 101))
        assert res.offsets[Q] == 7
        assert [m.offset for m in s.read_span(Q, 0, 32)[0]] == [0, 1, 2, 3, 4, 7]
        assert s.damage.total("corrupt_read") == 0
    finally:
        s.close()


def test_an_open_fsyncs_what_the_crashed_session_left_unsynced_before_indexing_it(
    store_config: Callable[..., config.StoreConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a kill -9 the unsynced end of the log is still in the page cache, and the open indexes it (so
    serves it): fsynced first, or a power cut soon after could take back records groups have consumed, and
    a sync session's crash is not reconciled."""
    cfg = store_config(flush_mode="sync")
    crash(CRASHING_SESSION, cfg)  # async: its batch was never fsynced
    events: list[str] = []
    real_sync, real_replay = segment.Segment.sync, recovery.replay

    def sync(self: segment.Segment) -> None:
        events.append(f"fsync {self.seq}")
        real_sync(self)

    def replay(core: core_mod.Core, start: tuple[int, int], last_seq: int, rebuilding: bool) -> tuple[int, int]:
        events.append("index")
        return real_replay(core, start, last_seq, rebuilding)

    monkeypatch.setattr(segment.Segment, "sync", sync)
    monkeypatch.setattr(recovery, "replay", replay)
    s = store_mod.open_store(cfg)
    try:
        assert events[:2] == ["fsync 0", "index"]
        assert s.queue_offsets(Q) == (0, 10)
    finally:
        s.close()
