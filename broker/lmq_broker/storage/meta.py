"""The meta store: what only the broker knows, in its own RocksDB beside the index (``<data_dir>/meta``).

Consumer offsets (``O``) and the acked offsets and hand-outs above them (``A``), lite topics' last consume
times (``C``), parent topics, groups, quotas and reclaim runs (``T G U R``), the cluster membership set over
the admin service (``X membership``), users and access policies (``X access``) and two session markers
(``X clean``, ``X sync``); ``keys`` documents
every key and value. No log can recreate these, so damage stops the broker
with a repair path (``repair_meta``) where a damaged index is rebuilt.

A failed write (a full disk) sets ``error`` (the readiness probe reports it) and later writes fail fast,
never blocking on a reopen (a caller may be the event loop): a thread reopens the store, which RocksDB needs
to clear a write error, and probes it every META_RETRY_S; writes resume once space is back. One lock
serialises reads, writes, the swap of the handle and the in-memory set of ``A`` keys (which spares the usual
ack a RocksDB read); it comes after the store's write lock.

The markers decide whether an open must reconcile queues with committed offsets (``recovery``): ``clean``
is written (synced) by a close that synced the log and the index first, and removed at the next open before
anything is written; ``sync`` says the session that wrote last indexed only fsynced records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Final, Generic, TypeVar

import rocksdict

from lmq_broker import errors, model
from lmq_broker.storage import api, keys, ranges, rocks

log = logging.getLogger(__name__)

META_CACHE_BYTES: Final = 8 * 1024 * 1024  # offsets are read on a consumer's first receive, then cached above
META_RETRY_S: Final = 1.0  # after a failed meta write, reopen and retry at most this often

AckedContent = tuple[tuple[ranges.Run, ...], model.Handouts]  # what an ``A`` value holds: acked runs, hand-outs
Note = tuple[bytes, AckedContent | None]  # an ``A`` key and what it holds after a write (None: deleted)
R = TypeVar("R")  # a control-plane record (``Table``)


@dataclasses.dataclass(frozen=True)
class Table(Generic[R]):
    """One kind of named control-plane record: each under ``prefix + names(record)[0]`` (``keys.name_key``), its
    value what ``encode`` makes of it. Every name a record carries passes ``check`` before anything is written."""

    prefix: bytes
    names: Callable[[R], tuple[str, ...]]  # its own name (the key) first, then names it refers to
    encode: Callable[[R], bytes]
    decode: Callable[[bytes], R]
    check: Callable[[str], None] = api.check_name


PARENT_TOPICS: Final = Table(keys.PARENT, lambda t: (t.name,), keys.encode_parent_topic, keys.decode_parent_topic)
GROUPS: Final = Table(keys.GROUP, lambda g: (g.name, g.bind_topic), keys.encode_group, keys.decode_group)
QUOTAS: Final = Table(keys.QUOTA, lambda q: (q.scope,), keys.encode_quota, keys.decode_quota, api.check_scope)
RECLAIM_RUNS: Final = Table(keys.RECLAIM, lambda r: (r.parent,), keys.encode_reclaim_run, keys.decode_reclaim_run)


class Meta:
    """The meta store of one broker (see the module docstring)."""

    def __init__(self, path: Path, clock: api.Clock) -> None:
        self.path = path
        self._clock = clock
        self._db = _open(path)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._retrier: threading.Thread | None = None
        self.error: str | None = None  # the last write failed (a full disk): retried, then reopened
        try:
            # Every ``A`` key, with what it holds when this process wrote it (None: not read back, written before).
            self._acked_keys: dict[bytes, AckedContent | None] = {
                key: None for key, _ in self._db.prefix_items(keys.ACKED)
            }
            self.closed_cleanly = self._db.get(keys.CLEAN_KEY) is not None  # until ``begin_session``
            # In sync mode the index never points past the durable log, so no group can have consumed past it:
            # after a crash of such a session there is nothing to reconcile unless recovery finds damage.
            self.synced_before = self._db.get(keys.SYNC_SESSION_KEY) is not None
        except BaseException:
            self._db.close()
            raise

    # --- session -------------------------------------------------------------------------------------

    def begin_session(self, sync: bool) -> None:
        """Before anything is written: the clean marker goes (a crash from here on must be recovered from),
        and the sync-session marker says whether this session's crash could leave offsets past the log."""
        marks = self._db.batch()
        if self.closed_cleanly:
            marks.delete(keys.CLEAN_KEY)
        if sync:
            marks.put(keys.SYNC_SESSION_KEY, b"")
        elif self.synced_before:
            marks.delete(keys.SYNC_SESSION_KEY)
        if self.closed_cleanly or sync != self.synced_before:
            self._db.write_synced(marks)
        self.closed_cleanly = False

    def stop(self) -> None:
        """The first step of a close: no retry from now on, and the retrier thread is gone when it returns."""
        self._stop.set()
        if self._retrier is not None:
            self._retrier.join()

    def close(self, *, clean: bool = False) -> None:
        """``clean``: the log and the index are on disk, so the next open has nothing to reconcile."""
        self._stop.set()
        with self._lock:
            if clean and self.error is None:
                try:
                    marker = self._db.batch()
                    marker.put(keys.CLEAN_KEY, keys.U64.pack(self._clock()))
                    self._db.write_synced(marker)
                except Exception:
                    log.exception("could not mark the close as clean; the next open reconciles offsets")
            with contextlib.suppress(Exception):
                self._db.close()

    def copy_to(self, path: Path) -> None:
        """A consistent copy of the meta store in ``path`` (``snapshots``; under the store's write lock)."""
        with self._lock:
            self._check_open()
            self._db.copy_to(path)

    def adopt(self, index: rocks.Rocks) -> None:
        """An index written before ``meta`` existed holds offsets and control metadata: move them, once."""
        moved = 0
        for prefix in keys.PRIMARY_PREFIXES:
            wb = self._db.batch()
            for key, value in index.prefix_items(prefix):
                wb.put(key, value)
                moved += 1
            if len(wb):
                self._db.write(wb)
                gone = index.batch()
                gone.delete_range(prefix, keys.successor(prefix))
                index.write(gone)
        if moved:
            log.info("moved %d offset and metadata keys from the index to the meta store", moved)

    # --- reads and writes ----------------------------------------------------------------------------

    @staticmethod
    def batch() -> rocksdict.WriteBatch:
        return rocks.Rocks.batch()

    def get(self, key: bytes) -> bytes | None:
        with self._lock:  # the handle may be reopened (after a failed write) by another thread
            self._check_open()
            return self._db.get(key)

    def items(self, lo: bytes, hi: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Keys in [lo, hi) (recovery: nothing else runs yet, or the store's write lock is held)."""
        return self._db.items(lo, hi)

    def write(self, wb: rocksdict.WriteBatch, *, note: Note | None = None, wait: bool = True) -> bool:
        """Write ``wb``; with ``note``, then record what that ``A`` key holds (or its removal). False only when
        ``wait`` is False and another thread holds the lock."""
        if not self._lock.acquire(blocking=wait):
            return False
        try:
            self._write(wb, note)
            return True
        finally:
            self._lock.release()

    def _write(self, wb: rocksdict.WriteBatch, note: Note | None = None, *, synced: bool = False) -> None:
        """(Under the lock.)"""
        if self.error is not None:
            raise errors.StorageError(f"meta store cannot write: {self.error}")
        try:
            if synced:
                self._db.write_synced(wb)
            else:
                self._db.write(wb)
        except Exception as e:  # rocksdict raises bare Exception with RocksDB's status text
            log.error("meta store write failed: %s; acks and metadata changes fail until it can write", e)
            self.error = str(e)
            self._start_retrier()
            raise errors.StorageError(f"meta store write failed: {e}") from e
        if note is not None:
            if note[1] is not None:
                self._acked_keys[note[0]] = note[1]
            else:
                self._acked_keys.pop(note[0], None)

    def _check_open(self) -> None:
        if self._stop.is_set():
            raise errors.StorageError("store is closed")

    def _start_retrier(self) -> None:
        """(Under the lock.) Start the thread that brings the meta store back, unless it runs."""
        if self._retrier is None or not self._retrier.is_alive():
            self._retrier = threading.Thread(target=self._retry, name="lmq-meta-retry", daemon=True)
            self._retrier.start()

    def _retry(self) -> None:
        """Every META_RETRY_S until the meta store writes again: reopen it (read-write; read-only if that
        fails, so offsets and metadata stay readable) and write a probe key."""
        while not self._stop.wait(META_RETRY_S):
            with self._lock:
                if self._stop.is_set():
                    return
                with contextlib.suppress(Exception):  # closing flushes, which fails the same way
                    self._db.close()
                try:
                    self._db = _open(self.path)
                except errors.StorageError as e:
                    self.error = e.message
                    try:
                        self._db = rocks.Rocks(self.path, META_CACHE_BYTES, read_only=True)
                    except errors.StorageError:
                        log.exception("meta store cannot be opened, even read-only")
                    continue
                try:
                    wb = self._db.batch()
                    wb.put(keys.META_PROBE_KEY, keys.U64.pack(self._clock()))
                    self._db.write(wb)
                except Exception as e:
                    self.error = str(e)
                    continue
                log.warning("meta store writes again (after: %s)", self.error)
                self.error = None
                return

    # --- consumer offsets ----------------------------------------------------------------------------

    def offset(self, qkey: bytes, group: str) -> int | None:
        with self._lock:
            self._check_open()
            return self._db.get_u64(keys.offset_key(qkey, group))

    def commit_points(self, qkey: bytes) -> dict[str, int]:
        """Every group's committed offset in the queue ``qkey``."""
        prefix = keys.offset_key(qkey, "")
        with self._lock:
            self._check_open()
            return {k[len(prefix) :].decode(): int(keys.U64.unpack(v)[0]) for k, v in self._db.prefix_items(prefix)}

    def acked(self, qkey: bytes, group: str) -> Sequence[int]:
        key = keys.acked_key(qkey, group)
        if key not in self._acked_keys:  # the usual answer, without a RocksDB read
            return ()
        value = self.get(key)
        return () if value is None else keys.decode_acked(value)[1]

    def handouts(self, qkey: bytes, group: str) -> model.Handouts:
        key = keys.acked_key(qkey, group)
        if key not in self._acked_keys:  # the usual answer, without a RocksDB read
            return model.NO_HANDOUTS
        value = self.get(key)
        return model.NO_HANDOUTS if value is None else keys.decode_progress(value)[2]

    def offsets_batch(
        self, qkey: bytes, group: str, offset: int, acked: Sequence[int], handouts: model.Handouts
    ) -> tuple[rocksdict.WriteBatch, Note]:
        """A commit's batch (its offset, its acked offsets and hand-outs above it or their removal) and the
        ``note`` to write it with.

        An ``A`` value that would hold the acks and hand-outs it holds already is not written again: both are
        absolute offsets, so only its head's commit point would change, and readers take the commit point from
        ``O``. So a commit that only moves the commit point (in-order acks while later messages are out, the
        usual case) writes ``O`` alone."""
        akey = keys.acked_key(qkey, group)
        wb = self._db.batch()
        wb.put(keys.offset_key(qkey, group), keys.U64.pack(offset))
        runs = ranges.OffsetRanges.of(acked).runs
        content = (runs, handouts) if runs or handouts.mark > offset else None
        if content is None:
            if akey in self._acked_keys:
                wb.delete(akey)
        elif self._acked_keys.get(akey) != content:
            wb.put(akey, keys.encode_acked(offset, acked, handouts))
        return wb, (akey, content)

    def write_offsets(self, commits: Sequence[tuple[bytes, str, int]], consumed: Sequence[bytes], now: int) -> None:
        """Commit points (queue key, group, offset) with nothing acked or handed out above them, and ``now`` as
        the last consume time under the ``consumed`` keys, in one write; their ``A`` keys go."""
        stamp = keys.U64.pack(now)
        with self._lock:
            wb = self._db.batch()
            gone = []
            for qkey, group, offset in commits:
                wb.put(keys.offset_key(qkey, group), keys.U64.pack(offset))
                akey = keys.acked_key(qkey, group)
                if akey in self._acked_keys:
                    wb.delete(akey)
                    gone.append(akey)
            for key in consumed:
                wb.put(key, stamp)
            self._write(wb)
            for akey in gone:
                self._acked_keys.pop(akey, None)

    def drop_consumer_state(self, names: Sequence[keys.QueueName]) -> None:
        """Delete the offsets, acked sets and consume times of deleted queues, before the index forgets the
        queues: a crash in between replays the tombstone, which drops them again (idempotent). The acked-key
        set changes only once the write has succeeded."""
        wb = self._db.batch()
        gone: list[bytes] = []
        with self._lock:
            cursor = self._db.raw_iter(keys.ACKED, keys.successor(keys.OFFSET))  # A < C < O: one iterator
            it = cursor.it
            for name in names:
                cursor.delete_prefixed(wb, name.offset_prefix)
                wb.delete(keys.consumed_key(name.qkey))
                if self._acked_keys:
                    prefix = keys.ACKED + name.qkey
                    it.seek(prefix)
                    while it.valid():
                        key = bytes(it.key())
                        if not key.startswith(prefix):
                            break
                        wb.delete(key)
                        gone.append(key)
                        it.next()
                    cursor.check()
            del it, cursor  # an open iterator keeps its RocksDB instance (and its LOCK) alive, even past an error
        self.write(wb)
        with self._lock:
            for key in gone:
                self._acked_keys.pop(key, None)

    def clamp_consumer_state(self, name: keys.QueueName, end: int) -> int:
        """A queue cut back to ``end`` (``truncation``): no group's commit point may stay past it (the offsets
        above will hold other messages), and acked offsets or hand-outs at or above it go too (a group whose set
        reaches there loses the whole set: those messages may come again, never be skipped). Idempotent;
        returns how many groups changed."""
        wb = self._db.batch()
        gone: list[bytes] = []
        with self._lock:
            for key, value in list(self._db.prefix_items(name.offset_prefix)):
                if keys.U64.unpack_from(value)[0] > end:
                    wb.put(key, keys.U64.pack(end))
                    gone.append(keys.ACKED + key[1:])
            for key, value in list(self._db.prefix_items(keys.ACKED + name.qkey)):
                committed, acked, handouts = keys.decode_progress(value)
                if key not in gone and ((acked and acked[-1] >= end) or handouts.mark > end or committed > end):
                    gone.append(key)
            for key in gone:
                wb.delete(key)
        if not gone:
            return 0
        self.write(wb)
        with self._lock:
            for key in gone:
                self._acked_keys.pop(key, None)
        return len(gone)

    def consumed_floors(self) -> Iterator[tuple[bytes, int]]:
        """(qkey, the lowest offset no group has passed) per queue with committed, acked or handed out offsets:
        one walk of the ``O`` keys, then of the ``A`` keys (both in qkey order, so nothing per queue is held)."""
        for prefix in (keys.OFFSET, keys.ACKED):
            current, floor = b"", 0
            for key, value in self._db.prefix_items(prefix):
                qkey, _ = keys.split_group_key(key)
                if prefix == keys.OFFSET:
                    at = keys.U64.unpack_from(value)[0]
                else:  # a message handed out (``mark``) was seen too: its offset is never another message's
                    committed, acked, handouts = keys.decode_progress(value)
                    at = max((acked[-1] if acked else committed) + 1, handouts.mark)  # ascending ranges: no walk
                if qkey != current:
                    if current:
                        yield current, floor
                    current, floor = qkey, at
                elif at > floor:
                    floor = at
            if current:
                yield current, floor

    # --- control-plane records -----------------------------------------------------------------------

    def put_record(self, table: Table[R], record: R) -> None:
        names = table.names(record)
        for name in names:
            table.check(name)
        self._put(keys.name_key(table.prefix, names[0]), table.encode(record))

    def record(self, table: Table[R], name: str) -> R | None:
        value = self.get(keys.name_key(table.prefix, name))
        return None if value is None else table.decode(value)

    def delete_record(self, table: Table[R], name: str) -> bool:
        return self._delete(keys.name_key(table.prefix, name))

    def records(self, table: Table[R]) -> list[R]:
        """Every record of ``table``, in name order."""
        return [table.decode(v) for v in self._list(table.prefix)]

    def put_text(self, key: bytes, text: str) -> None:
        """Synced: a membership change (``MEMBERSHIP_KEY``) must survive a power cut like the data placed by it,
        a revoked right (``ACCESS_KEY``) must stay revoked."""
        self._put(key, text.encode(), synced=True)

    def put_u64(self, key: bytes, value: int) -> None:
        """Synced, as ``put_text``."""
        self._put(key, keys.U64.pack(value), synced=True)

    def text(self, key: bytes) -> str | None:
        value = self.get(key)
        return None if value is None else bytes(value).decode()

    def _put(self, key: bytes, value: bytes, *, synced: bool = False) -> None:
        wb = self._db.batch()
        wb.put(key, value)
        with self._lock:
            self._check_open()
            self._write(wb, synced=synced)

    def _delete(self, key: bytes) -> bool:
        with self._lock:  # looked up and deleted under one hold: two deletes of one key answer True once
            self._check_open()
            if self._db.get(key) is None:
                return False
            wb = self._db.batch()
            wb.delete(key)
            self._write(wb)
            return True

    def _list(self, prefix: bytes) -> list[bytes]:
        with self._lock:
            self._check_open()
            return [v for _, v in self._db.prefix_items(prefix)]


def _open(path: Path) -> rocks.Rocks:
    """Damage to the meta store stops the broker with a repair path: no log can recreate what it holds."""
    try:
        return rocks.Rocks(path, META_CACHE_BYTES)
    except errors.IndexCorrupt as e:
        raise errors.StorageError(
            f"the meta store (consumer offsets, topics, groups) is damaged: {e.message}. Back up {path}, then "
            f"run `python -m lmq_broker repair-meta --data-dir {path.parent}` (RocksDB repair: keeps what can "
            "be read) and start again",
            path=str(path),
        ) from e


def repair_meta(data_dir: Path) -> None:
    """RocksDB's repair of ``<data_dir>/meta`` (the broker stopped): rebuilds its manifest from the table and
    log files, keeping every key that can still be read. The store refuses to open a damaged meta store and
    names this as the way out."""
    path = data_dir / "meta"
    if not path.is_dir():
        raise errors.StorageError(f"no meta store at {path}", path=str(path))
    try:
        rocksdict.Rdict.repair(str(path), rocksdict.Options(raw_mode=True))
    except Exception as e:  # rocksdict raises bare Exception with RocksDB's status text
        raise errors.StorageError(f"repair of {path} failed: {e}", path=str(path)) from e
