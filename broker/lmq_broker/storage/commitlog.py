"""The commit log: numbered segment files of bounded size, appended only at the end of the last one.

The log is the truth; the index is a cache of it. The store lays records out (it knows each record's
size before writing, so it decides where a segment ends) and calls ``append`` once per segment touched by
a batch, then ``sync`` once per group commit. ``written``/``synced`` are byte counters since open: a
group-commit leader snapshots ``written``, fsyncs, and everything up to that snapshot is durable. A roll
fsyncs the segment it leaves, so only the active segment ever holds unsynced bytes; ``durable_at`` is the
position below which they are known to be on disk.

After a failed fsync the kernel may have marked the unwritten pages clean, or dropped them: a later fsync that
succeeds would vouch for nothing, and the page cache may no longer hold them. So the log keeps its own copy of
the bytes above ``durable_at`` (``_tail``: what one group commit or, in ``async`` mode, one flush interval
wrote; trimmed by every fsync that succeeds), and ``sync_again`` writes them once more from that copy before it
fsyncs, so its success means what it says: an acknowledged but unsynced record survives a failed fsync. Until it
has succeeded, every other fsync of the log (``sync``, ``roll``) fails at once (``fsync_error``): the kernel
reports a writeback error once, so a plain fsync after a failed one, on another thread (the ``async`` flusher
beside the writer's roll) or later, could succeed without the lost pages and trim the copy that must rewrite
them.

Dropped segments (retention) are unlinked at once but their descriptors are closed one retention pass
later, so a reader that looked up an index entry just before the drop still preads valid bytes.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from lmq_broker import errors
from lmq_broker.storage import codec
from lmq_broker.storage import segment as seg_mod

REWRITE_CHUNK_BYTES: Final = 1024 * 1024  # ``sync_again`` rewrites the unsynced tail in pieces of this size


class CommitLog:
    def __init__(self, directory: Path, segment_max_bytes: int) -> None:
        if segment_max_bytes >= 1 << 32:
            raise errors.StorageError("segment_max_bytes must be below 4 GiB (u32 positions)")
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.segment_max_bytes = segment_max_bytes
        seqs = sorted(s for s in (seg_mod.parse_name(n) for n in os.listdir(directory)) if s is not None)
        self._segments: dict[int, seg_mod.Segment] = {s: seg_mod.Segment.open(directory, s) for s in seqs}
        if not self._segments:
            self._segments[0] = seg_mod.Segment.create(directory, 0)
        self.active = self._segments[max(self._segments)]
        # What the last session wrote and did not fsync (a kill -9 before its fsync, or async mode) is still in
        # the page cache, where recovery reads and indexes it: fsync it before anything builds on it, or a
        # power cut after the open could take back records a group has consumed meanwhile. Only the active
        # segment can hold such bytes (a roll fsyncs the segment it leaves).
        self.active.sync()
        seg_mod.fsync_dir(directory)
        self.written = 0
        self.synced = 0
        self.fsyncs = 0
        self.durable_at = (self.active.seq, self.active.size)  # (segment, position): all below is on disk
        self._sync_lock = threading.Lock()
        # the active segment's bytes from ``_tail_at`` to its end, not yet known to be on disk (``sync_again``);
        # its own lock, not the fsync's: an append never waits for an fsync under way
        self._tail = bytearray()
        self._tail_at = self.active.size
        self._tail_lock = threading.Lock()
        self._cuts = 0  # rollbacks so far: an fsync begun before one vouches for nothing it cut (``_trim``)
        self._graveyard: list[seg_mod.Segment] = []
        self.fsync_error: str | None = None  # an fsync failed: only ``sync_again`` can vouch for the log now

    # --- layout --------------------------------------------------------------------------------------

    def seqs(self) -> list[int]:
        return sorted(self._segments)

    def size_of(self, seq: int) -> int:
        s = self._segments.get(seq)
        return -1 if s is None else s.size

    def total_bytes(self) -> int:
        return sum(s.size for s in self._segments.values())

    # --- writing -------------------------------------------------------------------------------------

    def append(self, data: bytes) -> int:
        with self._tail_lock:
            pos = self.active.append(data)
            self._tail += data
        self.written += len(data)
        return pos

    def _trim(self, segment: seg_mod.Segment, below: int, cuts: int) -> bool:
        """The bytes of ``segment`` below ``below`` are on disk, as of an fsync begun after ``cuts`` rollbacks:
        the copy keeps only those above. A rollback since (async mode: the flusher's fsync runs beside the
        writer) may have cut below ``below`` and new bytes may sit there now: nothing is trimmed then (the
        copy keeps more than it must). False then."""
        with self._tail_lock:
            if cuts != self._cuts:
                return False
            if segment is self.active and below > self._tail_at:
                del self._tail[: below - self._tail_at]
                self._tail_at = below
            return True

    def _fsync(self, segment: seg_mod.Segment) -> None:
        """fsync ``segment``, unless an fsync failed since the last good ``sync_again`` (see the module docstring)."""
        if self.fsync_error is not None:
            raise OSError(errno.EIO, f"an earlier fsync of the commit log failed ({self.fsync_error})")
        try:
            segment.sync()
        except OSError as e:
            self.fsync_error = str(e)
            raise

    def roll(self) -> None:
        """Start the next segment; the one left behind is fsynced first (it will never be written again)."""
        self._fsync(self.active)
        self.fsyncs += 1
        nxt = seg_mod.Segment.create(self.directory, self.active.seq + 1)
        self._segments[nxt.seq] = nxt
        with self._tail_lock:
            self.active = nxt
            self._tail, self._tail_at = bytearray(), 0
        self.durable_at = (nxt.seq, 0)

    def sync(self) -> None:
        """fsync every byte written so far (group commit: concurrent callers share one fdatasync)."""
        with self._sync_lock:
            mark = self.written
            if mark <= self.synced:
                return
            with self._tail_lock:
                active = self.active
                below = active.size  # written before the fsync starts: on disk once it returns
                cuts = self._cuts
            self._fsync(active)
            self.fsyncs += 1
            self.synced = mark
            if self._trim(active, below, cuts):
                self.durable_at = max(self.durable_at, (active.seq, below))

    def sync_again(self) -> None:
        """After a failed fsync (under the store's write lock, so nothing appends or cuts meanwhile): write
        what lies above ``durable_at`` in the active segment once more, from the log's own copy of it (the
        page cache may have dropped it), then fsync it and the directory."""
        with self._sync_lock:
            mark = self.written
            with self._tail_lock:
                active = self.active
                end = active.size
                tail, start, cuts = memoryview(bytes(self._tail)), self._tail_at, self._cuts
            if start + len(tail) != end:  # never: the copy always ends where the segment does
                raise OSError(f"commit log: the copy of unsynced bytes ends at {start + len(tail)}, not {end}")
            for at in range(0, len(tail), REWRITE_CHUNK_BYTES):
                piece = tail[at : at + REWRITE_CHUNK_BYTES]
                done = 0
                while done < len(piece):
                    done += os.pwrite(active.fd, piece[done:], start + at + done)
            active.sync()
            seg_mod.fsync_dir(self.directory)
            self.fsync_error = None
            self.fsyncs += 1
            self.synced = max(self.synced, mark)
            self.durable_at = (active.seq, end)
            self._trim(active, end, cuts)

    def rollback(self, seq: int, position: int, *, sync: bool = True) -> None:
        """Undo a failed append: cut the log back to (seq, position), removing segments created after it; with
        ``sync`` False the cut is not fsynced (``sync_again`` does it: the disk may be failing its fsyncs)."""
        for s in [s for s in self._segments if s > seq]:
            dead = self._segments.pop(s)
            os.unlink(dead.path)
            self._graveyard.append(dead)  # an ``async`` flusher's fsync may hold it: closed at the next ``reap``
        target = self._segments[seq]
        with self._tail_lock:
            # the cut, the copy and the segment's size change together: an ``async`` flusher's fsync that reads
            # the size between them would take the bytes cut off for synced, with the count of cuts already
            # raised, and trim new bytes written there from the copy (``sync_again`` then found the copy
            # ending past the segment, and the store stayed paused)
            self._cuts += 1
            if target is not self.active or position < self._tail_at:  # below the copy: nothing unsynced there
                self._tail, self._tail_at = bytearray(), position
            else:
                del self._tail[position - self._tail_at :]
            self.active = target
            target.truncate(position, sync=False)
            self.durable_at = min(self.durable_at, (seq, position))
        if sync:
            target.sync()
            seg_mod.fsync_dir(self.directory)

    # --- reading -------------------------------------------------------------------------------------

    def read(self, seq: int, position: int, size: int, *, exact: bool = True) -> bytes | None:
        """A record's bytes, or None when its segment was dropped by retention; with ``exact`` False, what
        there is of them (a damaged tail)."""
        s = self._segments.get(seq)
        if s is None:
            return None
        return s.read(position, size) if exact else os.pread(s.fd, size, position)

    def resync(self, seq: int, position: int) -> int | None:
        """After a bad record at (seq, position): where the next valid record of the segment starts, or None."""
        s = self._segments[seq]
        if s.size <= position:
            return None
        mm = mmap.mmap(s.fd, s.size, access=mmap.ACCESS_READ)
        try:
            return codec.resync(mm, position, s.size)
        finally:
            mm.close()

    def read_entries(self, entries: list[tuple[int, int, int, int, int]]) -> list[bytes | None]:
        """The records of index entries ``(offset, segment, position, size, store_ms)``: one pread each; None
        for a record whose segment is gone."""
        segments = self._segments
        pread = os.pread
        out: list[bytes | None] = []
        for _, seq, position, size, _ in entries:
            s = segments.get(seq)
            if s is None:
                out.append(None)
                continue
            data = pread(s.fd, size, position)
            out.append(data)  # short (the segment lost its end): the caller's decode finds it truncated
        return out

    def scan(self, seq: int, position: int) -> Iterator[tuple[int, codec.Frame]]:
        """(segment, frame) for every record from (seq, position) to the end of the log.

        Raises CorruptRecord with ``segment`` and ``position`` fields at the first record that does not
        check; UnsupportedVersion for a well-formed record of a version this build does not know.
        """
        for s in self.seqs():
            if s < seq:
                continue
            start = position if s == seq else 0
            yield from ((s, f) for f in self._scan_segment(s, start))

    def first_bad(self, seq: int, start: int, end: int) -> int | None:
        """Where the first record of [start, end) of a segment that does not check starts (one that runs past
        ``end`` included), or None when they all do and the last ends at ``end``."""
        s = self._segments[seq]
        if end > s.size:
            return min(start, s.size)
        if start >= end:
            return None
        mm = mmap.mmap(s.fd, end, access=mmap.ACCESS_READ)
        view = memoryview(mm)
        try:
            for _ in codec.scan(view, start, end):
                pass
        except errors.CorruptRecord as e:
            position = e.fields.get("position")
            return position if isinstance(position, int) else start
        finally:
            view.release()
            mm.close()
        return None

    def scan_segment(self, seq: int, start: int = 0) -> Iterator[codec.Frame]:
        """Every record of one segment from ``start`` (retention reads which queues a segment holds)."""
        return self._scan_segment(seq, start)

    def _scan_segment(self, seq: int, start: int) -> Iterator[codec.Frame]:
        s = self._segments[seq]
        if s.size <= start:
            return
        mm = mmap.mmap(s.fd, s.size, access=mmap.ACCESS_READ)
        view = memoryview(mm)
        try:
            try:
                yield from codec.scan(view, start, s.size)
            except errors.CorruptRecord as e:
                raise errors.CorruptRecord(e.message, segment=seq, **e.fields) from None
            except errors.UnsupportedVersion as e:
                raise errors.UnsupportedVersion(e.message, segment=seq, **e.fields) from None
        finally:
            view.release()
            mm.close()

    # --- retention -----------------------------------------------------------------------------------

    def drop(self, seq: int) -> int:
        """Unlink a non-active segment; returns its size. Its descriptor stays open until ``reap``."""
        if seq == self.active.seq:
            raise errors.StorageError("cannot drop the active segment", segment=seq)
        s = self._segments.pop(seq)
        os.unlink(s.path)
        self._graveyard.append(s)
        return s.size

    def reap(self) -> None:
        for s in self._graveyard:
            s.close()
        self._graveyard.clear()

    def close(self) -> None:
        self.reap()
        for s in self._segments.values():
            s.close()
        self._segments.clear()
