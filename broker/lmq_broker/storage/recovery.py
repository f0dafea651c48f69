"""Recovery: bring the index up to the commit log, at open and when a read finds the index damaged.

Scan the log from the checkpoint, re-index what follows it (offsets come from the records), truncate a torn
tail in the last segment, quarantine a bad record with good ones after it. A missing index or a checkpoint
past the log's end rebuilds every derived key from the log. Unless the last close was clean (its marker in
meta), queues are reconciled with the groups' committed offsets: in async mode a power cut can cut the log
cleanly while meta kept later commits. Offsets the log lost are recorded (``H`` ranges): they are the only
holes a reader is shown; anything else it cannot vouch for is an error (try later), never a hole.

While serving, the first read that finds a damaged index block starts a rebuild on a thread (``Rebuilder``):
meanwhile reads raise "index rebuilding", writes fail fast, commits go to meta only and readiness says why.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, NamedTuple

from lmq_broker import errors
from lmq_broker.storage import codec, keys, truncation
from lmq_broker.storage import core as core_mod
from lmq_broker.storage import index as index_mod

log = logging.getLogger(__name__)

REPLAY_BATCH_RECORDS: Final = 4096
QUARANTINE_COPY_BYTES: Final = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    rebuilt: bool  # the whole derived index was recreated from the log
    records_reindexed: int
    truncated_bytes: int  # torn tail cut from the last segment
    duration_ms: float
    quarantined_records: int = 0  # bad records with good ones after them: skipped, copied to quarantine/
    lost_entries: int = 0  # index entries whose segment file is missing
    queues_reconciled: int = 0  # queues whose next offset was raised to a group's committed/acked offsets


class Pass(NamedTuple):
    """What one ``recover`` did."""

    rebuilt: bool
    reindexed: int
    truncated: int  # bytes
    reconciled: int  # queues


def at_open(
    core: core_mod.Core, started: float, on_corruption: Callable[[errors.IndexCorrupt], None]
) -> RecoveryReport:
    """Recover before the store serves (a damaged index found meanwhile is rebuilt at once), then start the
    session: ``started`` is the ``time.perf_counter()`` of the open."""
    damaged = ""
    try:
        core.meta.adopt(core.index)
        core.segments = core.index.segment_table()
        done = recover(core)
    except errors.IndexCorrupt as e:  # found while recovering: rebuild now, before serving
        damaged = e.message  # (outside this block: the error's frames hold iterators of the old index)
    if damaged:
        log.error("the index is damaged (%s); it is a cache of the commit log: rebuilding it", damaged)
        core.replace_index()
        done = recover(core)
    core.index.on_corruption = on_corruption
    core.meta.begin_session(core.sync)
    return RecoveryReport(
        done.rebuilt,
        done.reindexed,
        done.truncated,
        (time.perf_counter() - started) * 1000,
        core.damage.total("quarantined"),
        core.damage.total("lost"),
        done.reconciled,
    )


class Rebuilder:
    """Rebuilds a damaged index from the log on a thread, once at a time, while the store serves."""

    def __init__(self, core: core_mod.Core) -> None:
        self._core = core
        self._thread: threading.Thread | None = None

    def index_corrupt(self, error: errors.IndexCorrupt) -> None:
        """A read found a damaged index block (the index's ``on_corruption``)."""
        core = self._core
        with core.status_lock:
            if core.rebuilding is not None or core.closed:
                return
            core.rebuilding = error.message
        log.error("index read failed: %s; rebuilding the index from the commit log", error.message)
        self._thread = threading.Thread(target=self._rebuild, name="lmq-index-rebuild", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a running rebuild (tests); True when none is running."""
        t = self._thread
        if t is not None:
            t.join(timeout)
        return self._core.rebuilding is None

    def _rebuild(self) -> None:
        core = self._core
        try:
            with core.write_lock:
                if core.closed:
                    return
                core.replace_index()
                done = recover(core)
                core.index.on_corruption = self.index_corrupt
                core.index_error = None  # the whole log is indexed again, in a new instance
            log.warning(
                "index rebuilt from the commit log: %d records re-indexed (full: %s)", done.reindexed, done.rebuilt
            )
        except Exception as e:
            log.exception("index rebuild failed; the store stops taking writes (restart to retry)")
            core.failed = f"index rebuild failed: {e}"
            core.unreadable = core.failed  # the new index is partial: a read could report live offsets as gone
        finally:
            core.rebuilding = None


def recover(core: core_mod.Core) -> Pass:
    """Bring the index up to the log (under the write lock, or before the store serves).

    Missing segment files are reported (with the index entries they take with them) and forgotten; a bad
    record with good ones after it is quarantined; only a bad tail of the last segment is cut. Afterwards,
    if the log lost anything, queues are reconciled with what groups have committed or acked, so that no
    offset at or below one of those is ever handed out again."""
    seqs = core.log.seqs()
    lost = _check_continuity(core, seqs)
    cp = core.index.checkpoint()
    past = cp is None or cp[0] not in seqs or cp[1] > core.log.size_of(cp[0])
    if past and cp is not None:
        log.warning("index checkpoint %s is past the commit log; rebuilding the index", cp)
    rebuild = past or (not (core.meta.closed_cleanly or core.meta.synced_before) and _lost_below(core, cp))
    if rebuild:
        core.index.clear_derived()
        core.segments = {}
        start = (seqs[0], 0)
    else:
        assert cp is not None
        start = cp
    quarantined = core.damage.total("quarantined")
    count, truncated = replay(core, start, seqs[-1], rebuild)
    if rebuild:
        _restore_consume_times(core)
    # In async mode log, index and meta reach the disk separately: after a power cut meta may hold offsets
    # past a log that lost its unsynced end at a clean record boundary (nothing torn, nothing to see). Only
    # a clean close (its marker, synced after the log and the index) vouches that nothing was lost, or a
    # session that ran in sync mode throughout (its index, hence every delivery, followed the fsync).
    damaged = truncated or lost or core.damage.total("quarantined") > quarantined
    reconciled = 0
    if rebuild or damaged or not (core.meta.closed_cleanly or core.meta.synced_before):
        reconciled = reconcile_offsets(core)
    return Pass(rebuild, count, truncated, reconciled)


def _lost_below(core: core_mod.Core, cp: tuple[int, int] | None) -> bool:
    """After a crash of an ``async`` session: whether the log lost records the index holds. A power cut keeps
    the index (its WAL) and may lose log bytes above the last fsync; the file may keep its length, its end
    read back as zeros (or stale blocks). The bytes between the durable point the index recorded with its
    checkpoint and the checkpoint are checked record by record (the whole segment, when no point was
    recorded); when one does not check, every derived key is rebuilt from the log."""
    if cp is None:
        return True
    seq, end = cp
    durable = core.index.durable()
    start = durable[1] if durable is not None and durable[0] == seq else 0
    bad = core.log.first_bad(seq, start, end)
    if bad is None:
        return False
    log.error(
        "commit log segment %d lost records below the index checkpoint (from position %d; a power cut in async "
        "mode): rebuilding the index from the log",
        seq,
        bad,
    )
    return True


def _check_continuity(core: core_mod.Core, seqs: list[int]) -> int:
    """Segments the index knows of (or between the first and the last file) whose file is gone: report
    the index entries lost with them, drop those entries, return how many. Retention removes a segment
    from the index before it unlinks it, so a known segment without its file was lost, not retired."""
    present = set(seqs)
    missing = sorted((set(range(seqs[0], seqs[-1] + 1)) | set(core.segments)) - present)
    if not missing:
        return 0
    gone = set(missing)
    lost: dict[bytes, int] = {}
    wb = core.index.batch()
    for key, value in core.index.prefix_items(keys.ENTRY):
        seg, _ = keys.RUN_HEAD.unpack_from(value)
        if seg in gone:
            qkey = key[len(keys.ENTRY) : -8]
            n = keys.run_length(value)
            lost[qkey] = lost.get(qkey, 0) + n
            wb.delete(key)
            first = keys.U64BE.unpack_from(key, len(key) - 8)[0]
            wb.put(keys.hole_key(qkey, first), keys.U64.pack(first + n))  # readers pass over these
    for seg in missing:
        wb.delete(keys.segment_key(seg))
        core.segments.pop(seg, None)
    core.write_index(lambda: core.index.write(wb))
    total = sum(lost.values())
    worst = sorted(lost.items(), key=lambda kv: -kv[1])[:10]
    log.error(
        "commit log segment(s) %s missing: %d indexed messages of %d queues are lost (most: %s); the "
        "rest of each queue is delivered",
        missing,
        total,
        len(lost),
        ", ".join(f"{keys.split_qkey(q)[0]}={n}" for q, n in worst) or "none indexed",
    )
    core.damage.report("lost", f"segments {missing} missing: {total} messages of {len(lost)} queues", total)
    return total or len(missing)


def replay(core: core_mod.Core, start: tuple[int, int], last_seq: int, rebuilding: bool) -> tuple[int, int]:
    """Re-index every record from ``start``; batches of REPLAY_BATCH_RECORDS, each with its checkpoint."""
    batch = core.batch()
    end = start
    count = 0
    pack_entry = keys.RUN_ENTRY.pack
    at = start
    while True:
        try:
            for seq, f in core.log.scan(*at):
                try:  # every name first: a record is indexed whole or not at all (the except writes the batch)
                    names = [core.resolve(topic, qid) for topic, qid in f.queues]
                except errors.InvalidArgument as e:
                    raise errors.CorruptRecord(
                        f"record names an invalid queue: {e.message}", segment=seq, position=f.position
                    ) from e
                if f.kind == codec.KIND_TOMBSTONE:
                    core.write_batch(batch, end)  # what precedes the deletion, then the deletion alone
                    batch = core.batch()
                    _replay_tombstone(core, batch, f, seq, rebuilding)
                elif f.kind == codec.KIND_TRUNCATION:
                    core.write_batch(batch, end)  # what precedes the cut, then the cut alone
                    batch = core.batch()
                    if not rebuilding:  # a crash came before the cut was applied (in a rebuild, meta saw it)
                        core.meta.clamp_consumer_state(names[0], f.offsets[0])
                    truncation.apply(core, names[0], f.offsets[0], (seq, f.position + f.size))
                else:
                    entry = pack_entry(f.position, f.size)
                    for name, off in zip(names, f.offsets, strict=True):
                        batch.replayed(name, seq, f.store_ms, off).replay(off, seq, f.store_ms, entry)
                batch.touch_segment(seq, f.store_ms)
                end = (seq, f.position + f.size)
                count += 1
                if count % REPLAY_BATCH_RECORDS == 0 or f.kind != codec.KIND_MESSAGE:
                    core.write_batch(batch, end)
                    batch = core.batch()
            core.write_batch(batch, end)
            return count, 0
        except errors.CorruptRecord as e:
            bad_seq, bad_pos = e.fields.get("segment"), e.fields.get("position")
            if not isinstance(bad_seq, int) or not isinstance(bad_pos, int):
                raise
            core.write_batch(batch, end)
            batch = core.batch()
            resume = core.log.resync(bad_seq, bad_pos)
            if resume is None and bad_seq == last_seq:  # nothing good follows: a torn tail
                truncated = core.log.size_of(bad_seq) - bad_pos
                _quarantine(core, bad_seq, bad_pos, truncated, f"torn tail: {e.message}", kind="")
                log.warning(
                    "recovery: torn record at segment %d position %d, %d bytes cut", bad_seq, bad_pos, truncated
                )
                core.log.rollback(bad_seq, bad_pos)
                core.write_batch(batch, (bad_seq, bad_pos))
                return count, truncated
            stop = core.log.size_of(bad_seq) if resume is None else resume
            _quarantine(core, bad_seq, bad_pos, stop - bad_pos, e.message, kind="quarantined")
            # Good records follow (or the segment is not the last): skip the bad bytes, keep the rest.
            if resume is not None:
                at = end = (bad_seq, resume)
            else:  # the rest of a closed segment: go on with the next one, and checkpoint there, so the
                # bad end is not quarantined (and counted) again at every open
                later = [s for s in core.log.seqs() if s > bad_seq]
                at = (later[0], 0) if later else (bad_seq + 1, 0)
                if later:
                    end = at


def _quarantine(core: core_mod.Core, seq: int, position: int, size: int, why: str, *, kind: str) -> None:
    """Copy skipped or cut bytes of the log to ``quarantine/`` (at most QUARANTINE_COPY_BYTES each) and,
    for ``kind``, report them as damage."""
    directory = core.cfg.data_dir / "quarantine"
    name = f"{seq:010d}-{position:010d}.bin"
    try:
        directory.mkdir(exist_ok=True)
        data = core.log.read(seq, position, min(size, QUARANTINE_COPY_BYTES), exact=False)
        (directory / name).write_bytes(data or b"")
    except OSError as e:
        log.warning("could not copy %d bytes at segment %d position %d to quarantine: %s", size, seq, position, e)
    if kind:
        core.damage.report(
            kind,
            f"segment {seq} position {position}: {size} bytes skipped ({why}); a copy is in "
            f"{directory / name}; the records after it are kept",
        )


def reconcile_offsets(core: core_mod.Core) -> int:
    """After the log lost records: raise each queue's next offset above every offset a group committed or
    acked, so a new message never takes an offset a group has already passed (it would never be
    delivered). Returns how many queues moved."""
    moved: set[bytes] = set()  # a queue can move in both walks (O, then A)
    batch = core.batch()
    now = core.clock()
    get = core.index.get
    for qkey, floor in core.meta.consumed_floors():
        pd = batch.pending.get(qkey)
        if pd is None:
            # The usual case, kept cheap (every queue with a committed offset passes here at an unclean
            # open): one index get, no name validated or state built. The index is current (a batch is
            # written before its states are published).
            state_key = keys.state_key_of(qkey)
            value = None if state_key is None else get(state_key)
            if state_key is not None and value is not None and keys.next_of_state(state_key, value) >= floor:
                continue
        try:
            name = core.resolve(*keys.split_qkey(qkey))
        except errors.InvalidArgument:
            continue
        if pd is None:
            st = core.state(name)
            if st is not None and st.next >= floor:
                continue
            pd = batch.replayed(name, 0, now, floor)
        elif pd.next >= floor:
            continue
        if pd.st.min >= pd.next:
            pd.st.min = floor  # an empty queue stays empty: its min follows its next
        else:
            pd.holes.append((pd.next, floor))  # readers of other groups pass over the lost offsets
        pd.next = max(pd.next, floor)
        moved.add(qkey)
        log.warning(
            "recovery: %s queue %d next offset raised to %d (groups have consumed up to there; the log lost "
            "the records)", name.topic, name.queue, floor,
        )  # fmt: skip
        if len(batch) >= REPLAY_BATCH_RECORDS:
            core.write_batch(batch, (core.log.active.seq, core.log.active.size))
            batch = core.batch()
    core.write_batch(batch, (core.log.active.seq, core.log.active.size))
    return len(moved)


def _replay_tombstone(core: core_mod.Core, batch: index_mod.Batch, f: codec.Frame, seq: int, rebuilding: bool) -> None:
    topic, qid = f.queues[0]
    name = core.resolve(topic, qid)
    if core.state(name) is not None:
        if not rebuilding:
            # A crash came between the tombstone and the index batch. In a rebuild, the meta store already
            # saw the deletion, and offsets of a later topic of the same name must stay.
            core.meta.drop_consumer_state([name])
        batch.delete_queue(name)
        if name.parent is not None:
            batch.count(name.parent, -1)


def _restore_consume_times(core: core_mod.Core) -> None:
    """After a rebuild: the lite topics' last consume times come back from the meta store."""
    wb = core.index.batch()
    lo = keys.CONSUMED
    for key, value in core.meta.items(lo, keys.successor(lo)):
        topic, qid = keys.split_qkey(key[len(lo) :])
        try:
            name = core.resolve(topic, qid)
        except errors.InvalidArgument:
            continue
        st = core.state(name)
        if st is None or name.parent is None:
            continue
        st.last_consume = keys.U64.unpack(value)[0]
        wb.put(name.state_key, st.value())
        if len(wb) >= REPLAY_BATCH_RECORDS:
            core.index.write(wb)
            wb = core.index.batch()
    core.index.write(wb)
