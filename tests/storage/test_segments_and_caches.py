"""LmqStore specifics: bounded segment files, bounded in-memory caches, reads that touch one queue only."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from lmq_broker import errors, model
from lmq_broker.storage import commitlog, keys
from lmq_broker.storage import index as index_mod
from lmq_broker.storage import segment as segment_mod
from lmq_broker.storage import store as store_mod
from lmq_broker.storage.memory import ManualClock

Msg = Callable[..., model.NewMessage]
OpenLmq = Callable[..., store_mod.LmqStore]
LMQ_A = model.QueueId.lmq("P", "a")


def test_segments_never_exceed_their_bound_and_records_never_span_two(open_lmq: OpenLmq, msg: Msg) -> None:
    s = open_lmq(segment_max_bytes=8192)
    for i in range(30):
        s.append([msg(body=bytes([i]) * (500 + 37 * i % 700)) for _ in range(3)])
    sizes = [s._core.log.size_of(seq) for seq in s._core.log.seqs()]
    assert len(sizes) > 5 and max(sizes) <= 8192
    assert [m.body[0] for m in s.read(LMQ_A, 0, 1000)] == [i for i in range(30) for _ in range(3)]


def test_segment_file_names() -> None:
    assert segment_mod.file_name(12) == "0000000012.log"
    assert segment_mod.parse_name("0000000012.log") == 12
    assert segment_mod.parse_name("12.log") is None
    assert segment_mod.parse_name("0000000012.tmp") is None


def test_a_record_larger_than_a_segment_is_refused(open_lmq: OpenLmq, msg: Msg) -> None:
    s = open_lmq(segment_max_bytes=4096, max_record_bytes=1 << 20)
    with pytest.raises(errors.RecordTooLarge):
        s.append([msg(body=b"x" * 4096)])


def test_queue_state_cache_is_bounded_and_evictions_reload_from_the_index(open_lmq: OpenLmq, msg: Msg) -> None:
    s = open_lmq(state_cache_entries=50)
    for i in range(10):
        s.append([msg(lite=f"t{j}", parent_queue=False) for j in range(i * 100, (i + 1) * 100)])
    assert s.cached_states <= 50
    assert s.lite_topic_count() == 1000
    # t0 was evicted long ago: its next offset comes back from the index
    assert s.append([msg(lite="t0", parent_queue=False)])[0].offsets == {model.QueueId.lmq("P", "t0"): 1}
    assert [m.offset for m in s.read(model.QueueId.lmq("P", "t0"), 0, 10)] == [0, 1]


def test_reads_seek_into_one_queue_only(open_lmq: OpenLmq, msg: Msg, monkeypatch: pytest.MonkeyPatch) -> None:
    s = open_lmq()
    for i in range(50):
        s.append([msg(lite=f"t{j}", body=f"{i}".encode()) for j in range(20)])
    seen: list[bytes] = []
    real_entries = index_mod.Index.entries

    def spy(self: index_mod.Index, name: keys.QueueName, start: int, end: int, limit: int) -> list[index_mod.Entry]:
        seen.append(name.qkey)
        return real_entries(self, name, start, end, limit)

    monkeypatch.setattr(index_mod.Index, "entries", spy)
    read = s.read(model.QueueId.lmq("P", "t7"), 10, 32)
    assert [m.body for m in read] == [f"{i}".encode() for i in range(10, 42)]
    assert seen == [keys.parse_queue("%LMQ%$P$t7", 0).qkey]


def test_entries_are_runs_one_key_per_queue_per_append(open_lmq: OpenLmq, msg: Msg) -> None:
    s = open_lmq()
    s.append([msg() for _ in range(100)])
    s.append([msg() for _ in range(100)])
    runs = list(s._core.index.runs(keys.parse_queue(LMQ_A.topic, 0)))
    assert [(first, n) for first, _, n in runs] == [(0, 100), (100, 100)]
    assert [m.offset for m in s.read(LMQ_A, 95, 10)] == list(range(95, 105))


def test_dropped_segment_descriptors_close_one_retention_pass_later(
    open_lmq: OpenLmq, msg: Msg, clock: ManualClock
) -> None:
    s = open_lmq(segment_max_bytes=4096, retention_max_age_ms=10)
    for _ in range(10):
        s.append([msg(body=b"x" * 1000)])
    clock.advance(100)
    s.append([msg()])
    log: commitlog.CommitLog = s._core.log
    assert s.apply_retention().segments_deleted > 0
    assert log._graveyard  # still open for a reader that looked its entry up just before the drop
    s.apply_retention()
    assert not log._graveyard


def test_retention_passes_over_a_bad_record_and_retires_the_queues_named_after_it(
    open_lmq: OpenLmq, msg: Msg, clock: ManualClock
) -> None:
    """A retired segment whose first record went bad: the queues of the records after it lose their entries
    in it and their min moves too, as for any retired segment (they used to keep entries into a deleted
    file, and a min below them, for good)."""
    s = open_lmq(segment_max_bytes=4096, retention_max_age_ms=10)
    s.append([msg(lite="a", body=b"a" * 500, parent_queue=False)])
    for _ in range(10):
        s.append([msg(lite="b", body=b"b" * 500, parent_queue=False)])
    clock.advance(100)
    s.append([msg(lite="b", body=b"fresh", parent_queue=False)])
    [first] = s._core.log.seqs()[:1]
    with open(s._core.log._segments[first].path, "r+b") as f:  # a flipped byte in the first record's body
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x5A]))
    assert s.apply_retention().segments_deleted > 0
    lmq_b = model.QueueId.lmq("P", "b")
    lo, hi = s.queue_offsets(lmq_b)
    assert 0 < lo < hi == 11
    gone = set(range(first, s._core.log.seqs()[0]))
    name = s._core.resolve(lmq_b.topic, 0)
    assert [seg for _, seg, _ in s._core.index.runs(name) if seg in gone] == []
    assert [m.body for m in s.read(lmq_b, 0, 100)][-1] == b"fresh"


def test_index_tables_have_partitioned_index_and_filter_blocks(open_lmq: OpenLmq, msg: Msg) -> None:
    """A million topics make multi-megabyte index/filter blocks; whole, they would not fit a block-cache shard
    and every lookup would re-read them. The tables must be written partitioned (small, cacheable blocks)."""
    s = open_lmq()
    s.append([msg(lite=f"t{i}") for i in range(2000)])
    s.close()  # flushes the memtable into a table file
    idx = index_mod.Index(s._core.cfg.data_dir / "index", 1 << 20)
    try:
        props = idx._db.property_value("rocksdb.aggregated-table-properties") or ""
    finally:
        idx.close()
    assert "# index partitions=" in props
    assert "filter block size=0;" not in props


def log_with_unsynced_tail(directory: Path) -> tuple[commitlog.CommitLog, bytes, int]:
    """A log holding b"synced." (fsynced) and then unsynced bytes: (log, those bytes, where they start)."""
    log = commitlog.CommitLog(directory, 1 << 20)
    log.append(b"synced.")
    log.sync()
    unsynced = b"acked-but-unsynced" * 100
    return log, unsynced, log.append(unsynced)


def test_sync_again_writes_the_unsynced_tail_from_the_logs_own_copy(tmp_path: Path) -> None:
    """A failed fsync may leave the kernel without the unsynced pages (dropped, or read back as what the disk
    holds): ``sync_again`` rewrites them from the log's own copy, so an acknowledged async write survives it.
    The pages are lost here by overwriting the unsynced range through another descriptor; a rewrite read back
    from the page cache would write that loss to disk. Rolls, cuts and good fsyncs keep the copy exact."""
    log, unsynced, at = log_with_unsynced_tail(tmp_path)
    path = log.active.path

    def drop_pages() -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\0" * len(unsynced), at)
        finally:
            os.close(fd)

    drop_pages()
    log.sync_again()
    assert path.read_bytes() == b"synced." + unsynced
    cut_at = log.append(b"never acknowledged")
    log.rollback(log.active.seq, cut_at, sync=False)  # a failed round's cut leaves the copy as it was
    more = log.append(b"after the cut")
    log.roll()
    tail = log.append(b"in the next segment")
    fd = os.open(log.active.path, os.O_WRONLY)
    os.pwrite(fd, b"\0" * 19, tail)
    os.close(fd)
    log.sync_again()
    assert log.active.path.read_bytes() == b"in the next segment"
    assert path.read_bytes() == b"synced." + unsynced + b"after the cut" and more == cut_at


@pytest.mark.parametrize("next_fsync", ["sync", "roll"])
def test_after_a_failed_fsync_no_plain_fsync_vouches_for_the_log_until_sync_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, next_fsync: str
) -> None:
    """The kernel reports a writeback error once: after the async flusher's fsync failed, a later plain fsync
    (the writer's roll beside it, a control record's fsync) could succeed without the lost pages. It used to
    trim the log's copy of them (a roll dropped it), so ``sync_again`` had nothing left to rewrite and the
    acknowledged records stayed lost. Every fsync but ``sync_again``'s now fails until that has succeeded."""
    log, unsynced, at = log_with_unsynced_tail(tmp_path)
    path = log.active.path
    real = segment_mod.Segment.sync

    def eio(self: segment_mod.Segment) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(segment_mod.Segment, "sync", eio)
    with pytest.raises(OSError):
        log.sync()  # the flusher's fsync: the pages' writeback failed, the kernel may have dropped them
    fd = os.open(path, os.O_WRONLY)
    os.pwrite(fd, b"\0" * len(unsynced), at)  # dropped: the disk holds something else
    os.close(fd)
    monkeypatch.setattr(segment_mod.Segment, "sync", real)  # the error was reported: fsyncs succeed again
    with pytest.raises(OSError, match="earlier fsync"):
        log.sync() if next_fsync == "sync" else log.roll()
    assert log.seqs() == [0] and log.durable_at == (0, at)
    log.sync_again()
    assert path.read_bytes() == b"synced." + unsynced
    log.sync()
    log.roll()
    assert log.seqs() == [0, 1]


def test_an_fsync_under_way_while_the_writer_cuts_and_writes_again_trims_nothing_it_did_not_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``async`` mode: the flusher's fsync runs beside the writer, which may cut a failed round and write new
    records at the same place meanwhile. That fsync vouches for neither: the copy still holds the new bytes,
    and ``sync_again`` (which checks the copy ends where the segment does) writes them."""
    log = commitlog.CommitLog(tmp_path, 1 << 20)
    log.append(b"synced.")
    log.sync()
    cut_at = log.append(b"a round whose index write failed")
    segment = log.active
    fsync = segment_mod.Segment.sync

    def writer_meanwhile(self: segment_mod.Segment) -> None:
        monkeypatch.setattr(segment_mod.Segment, "sync", fsync)
        log.rollback(segment.seq, cut_at, sync=False)
        log.append(b"written after the cut")
        fsync(self)

    monkeypatch.setattr(segment_mod.Segment, "sync", writer_meanwhile)
    log.sync()
    fd = os.open(segment.path, os.O_WRONLY)
    os.pwrite(fd, b"\0" * 21, cut_at)  # the new bytes' pages lost
    os.close(fd)
    log.sync_again()
    assert segment.path.read_bytes() == b"synced.written after the cut"


@pytest.mark.parametrize("across_a_roll", [False, True])
def test_a_flusher_fsync_beside_a_cut_sees_the_segment_before_or_after_it_never_half_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, across_a_roll: bool
) -> None:
    """``async`` mode: the flusher's fsync reads the active segment's size while the writer cuts a failed
    round. The cut used to count itself and trim the copy before truncating the file: a flusher reading in
    between took the size before the cut for synced, with the new count, then trimmed the bytes written at the
    cut's place from the copy. ``sync_again`` then found the copy ending past the segment and failed, and the
    store stayed paused (a fresh clone's full-disk test). Across a roll, it fsynced a descriptor the cut had
    closed. The flusher here runs on its own thread exactly in that window; it now waits for the whole cut."""
    log = commitlog.CommitLog(tmp_path, 64 if across_a_roll else 1 << 20)
    log.append(b"synced.")
    log.sync()
    cut_at = log.append(b"a round whose index write failed")
    if across_a_roll:
        log.roll()
        log.append(b"its part in the next segment")
    segment = log._segments[0]
    real_truncate = segment_mod.Segment.truncate
    flushed: list[BaseException | None] = []

    def flush() -> None:
        try:
            log.sync()
            flushed.append(None)
        except BaseException as e:  # reported below
            flushed.append(e)

    flusher = threading.Thread(target=flush)

    def truncate_while_the_flusher_runs(self: segment_mod.Segment, size: int, *, sync: bool = True) -> None:
        flusher.start()
        flusher.join(0.5)  # finishes inside the window unless the cut holds the copy's lock throughout
        real_truncate(self, size, sync=sync)

    monkeypatch.setattr(segment_mod.Segment, "truncate", truncate_while_the_flusher_runs)
    log.rollback(0, cut_at, sync=False)
    monkeypatch.setattr(segment_mod.Segment, "truncate", real_truncate)
    flusher.join(10)
    assert flushed == [None]
    written = log.append(b"written after the cut")
    assert written == cut_at and log.seqs() == [0]
    fd = os.open(segment.path, os.O_WRONLY)
    os.pwrite(fd, b"\0" * 21, cut_at)  # the new bytes' pages lost
    os.close(fd)
    log.sync_again()
    assert segment.path.read_bytes() == b"synced.written after the cut"
    log.reap()
