"""What the parts of one open store share: the commit log, the current index with its caches, the write lock
and whether the store may write, read or is being rebuilt.

``store.LmqStore`` composes the parts around one ``Core``: ``appends`` (write rounds), ``reads``,
``retention``, ``recovery`` (at open, and a rebuild while serving) and ``meta.Meta``. A rebuild replaces
``index``, ``states`` and ``segments`` together, under ``write_lock``, and counts it in ``generation``: a
reader that uses them without the lock takes them once and checks the generation afterwards.

Index writes and log writes that others build on go through here once, so a failure stops the store the same
way wherever it happens. Faults that can heal pause writes until they do (``healing`` retries them): a failed
index write (a full disk: RocksDB then refuses every write until it is reopened) sets ``index_error``, a
failed fsync sets ``undurable``; the writer that met the fault cuts its records off the log first
(``undo_round``), so its caller's error means "not stored". Damage found by a write starts a rebuild, and
writes resume when it is done. What cannot heal without a restart latches ``failed`` (``fatal``: the
liveness probe fails). Lock order: ``write_lock``, then the meta store's lock.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from lmq_broker import config, errors
from lmq_broker.storage import api, commitlog, damage, keys, meta, rocks
from lmq_broker.storage import index as index_mod

log = logging.getLogger(__name__)

NAME_CACHE_ENTRIES: Final = 16_384  # ~600 B each: a miss re-validates a name (a few us)
INDEX_WRITE_FAILED: Final = "index write failed"
NOT_DURABLE: Final = "commit log cannot be made durable"
INDEX_RELEASE_S: Final = 30.0  # how long a rebuild waits for readers to let go of the damaged index


class Core:
    """The handles and status of one open store (see the module docstring)."""

    def __init__(
        self,
        cfg: config.StoreConfig,
        clock: api.Clock,
        log: commitlog.CommitLog,
        meta_store: meta.Meta,
        state_cache_entries: int,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.sync = cfg.flush_mode == config.FlushMode.SYNC
        self.log = log
        self.meta = meta_store
        self.names = keys.NameCache(NAME_CACHE_ENTRIES)
        self.resolve = self.names.queue
        self.write_lock = threading.Lock()
        self.status_lock = threading.Lock()  # a rebuild starts once (``rebuilding`` set under it)
        self.damage = damage.Skips()
        self.generation = 0  # index rebuilds so far (at open or while serving)
        self.closed = False
        self.failed: str | None = None  # why the store stopped accepting writes (latched: restart to recover)
        self.index_error: str | None = None  # an index write failed (a full disk): paused until it is reopened
        self.undurable: str | None = None  # an fsync failed: paused until one succeeds
        self.fsync_failures = 0
        self.index_reopens = 0
        self.refused: dict[str, int] = {"index_unwritable": 0, "not_durable": 0}  # writes refused meanwhile
        self.on_fault: Callable[[], None] = _nothing  # the store starts its healer here
        self.rebuilding: str | None = None  # why the index is being rebuilt (reads find nothing meanwhile)
        self.unreadable: str | None = None  # a rebuild failed: the index is partial, reads fail until a restart
        self._state_cache_entries = state_cache_entries
        self.index = self.open_index()
        self.states = index_mod.StateCache(self.index, state_cache_entries)
        self.segments: dict[int, list[int]] = {}  # seq -> [first_store_ms, last_store_ms]

    # --- status --------------------------------------------------------------------------------------

    def health(self) -> str | None:
        if self.closed:
            return "store is closed"
        if self.rebuilding is not None:
            return f"index rebuilding from the commit log: {self.rebuilding}"
        if self.failed is not None:
            return f"store stopped accepting writes: {self.failed}"
        if self.unreadable is not None:
            return f"index unusable: {self.unreadable}"
        if self.undurable is not None:
            return f"{NOT_DURABLE}: {self.undurable}"
        if self.index_error is not None:
            return f"index cannot write: {self.index_error}"
        if self.meta.error is not None:
            return f"meta store cannot write: {self.meta.error}"
        return None

    def fatal(self) -> str | None:
        """Why the store cannot recover without a restart (the liveness probe), or None."""
        if self.closed:
            return None
        if self.failed is not None:
            return f"store stopped accepting writes: {self.failed}"
        if self.unreadable is not None:
            return f"index unusable: {self.unreadable}"
        return None

    def check_open(self) -> None:
        if self.closed:
            raise errors.StorageError("store is closed")

    def check_writable(self) -> None:
        if self.closed:
            raise errors.StorageError("store is closed")
        if self.failed is not None:
            raise errors.StorageError(f"store stopped accepting writes: {self.failed}")
        self.check_not_rebuilding()
        if self.undurable is not None:
            self.refused["not_durable"] += 1
            raise errors.StorageError(f"store refuses writes: {NOT_DURABLE} ({self.undurable}); retry later")
        if self.index_error is not None:
            self.refused["index_unwritable"] += 1
            raise errors.StorageError(f"store refuses writes: index cannot write ({self.index_error}); retry later")

    def check_not_rebuilding(self) -> None:
        """Writes fail fast while the index is rebuilt (the rebuild holds the write lock for its duration)."""
        if self.rebuilding is not None:
            raise errors.StorageError(f"index rebuilding from the commit log: {self.rebuilding}")

    def check_readable(self) -> None:
        if self.rebuilding is not None:
            raise errors.StorageError(f"index rebuilding from the commit log: {self.rebuilding}")
        if self.unreadable is not None:
            raise errors.StorageError(f"index unusable: {self.unreadable}")

    def check_same_index(self, generation: int) -> None:
        """After a read: the index it used is still the one serving, and no rebuild has begun."""
        if self.generation != generation:
            raise errors.StorageError("index rebuilding from the commit log: replaced during the read")
        self.check_readable()

    # --- index ---------------------------------------------------------------------------------------

    def state(self, name: keys.QueueName) -> index_mod.QueueState | None:
        return self.states.get(name)

    def batch(self) -> index_mod.Batch:
        return index_mod.Batch(self.index, self.states, self.segments)

    def write_batch(self, batch: index_mod.Batch, checkpoint: tuple[int, int]) -> None:
        self.write_index(lambda: batch.write(checkpoint, self.log.durable_at))
        batch.publish()

    def write_index(self, write: Callable[[], None]) -> None:
        try:
            write()
        except Exception as e:
            if isinstance(e, errors.IndexCorrupt) or rocks.is_corruption(e):
                # Damage (found by a read inside the batch, or by the write): the rebuild that ``failed``
                # starts re-indexes the whole log, records of this round included. Writes fail meanwhile;
                # nothing is latched, so they resume when the rebuild is done.
                raise self.index.failed(e) from e
            # RocksDB refuses every write from now on (a background error) until it is reopened; the log may
            # hold records the index lacks. Pause writes: the healer reopens the index and replays the log
            # beyond its checkpoint (the writer of an append round first cuts its records off the log).
            if self.index_error is None:  # (the text: a log record holding ``e`` would keep its frames alive,
                # an iterator among them, and so the index instance and its LOCK)
                log.error("%s: %s; writes pause until the index is reopened", INDEX_WRITE_FAILED, str(e))
            self.index_error = str(e)
            self.on_fault()
            raise errors.StorageError(f"{INDEX_WRITE_FAILED}: {e}") from e

    def open_index(self) -> index_mod.Index:
        """Open the index; a damaged one (CURRENT, MANIFEST, a table file) is set aside and rebuilt."""
        path = self.cfg.data_dir / "index"
        try:
            index = index_mod.Index(path, self.cfg.index_cache_bytes)
        except errors.IndexCorrupt as e:
            log.error("the index is damaged (%s); it is a cache of the commit log: rebuilding it", e.message)
            _set_aside(path)
            self.generation += 1
            index = index_mod.Index(path, self.cfg.index_cache_bytes)
        return index

    def reopen_index(self) -> None:
        """Close the index and open it again (under the write lock): RocksDB clears a write error (a full
        disk) only so. If it cannot be opened for writing, it is opened read-only, so reads go on, and the
        error is raised. The caller then replays the log beyond the checkpoint (``recovery.recover``)."""
        self.index.on_corruption = None  # a reader still on this instance: no rebuild of the one after it
        with contextlib.suppress(Exception):
            self.index.close(flush=False)  # a flush would fail as its writes did; the WAL holds what they wrote
        try:
            self.index = self._open_retrying(self.open_index)
        except errors.StorageError:
            path, cache = self.cfg.data_dir / "index", self.cfg.index_cache_bytes
            self.index = self._open_retrying(lambda: index_mod.Index(path, cache, read_only=True))
            raise
        finally:
            self.generation += 1
            self.index_reopens += 1
            self.states = index_mod.StateCache(self.index, self._state_cache_entries)
        self.segments = self.index.segment_table()

    @staticmethod
    def _open_retrying(opener: Callable[[], index_mod.Index]) -> index_mod.Index:
        """Open the index, waiting for readers to let go of its previous instance (they hold its LOCK)."""
        deadline = time.monotonic() + INDEX_RELEASE_S
        while True:
            try:
                return opener()
            except errors.StorageError as e:
                # RocksDB frees the old instance (and the LOCK path it holds in this process) only when the
                # last iterator of it is gone: a reader that just hit the damage may still hold one.
                if "lock" not in e.message.lower() or time.monotonic() > deadline:
                    raise
                gc.collect()
                time.sleep(0.05)

    def replace_index(self) -> None:
        """Set the damaged index aside and start an empty one (the caller then replays the log into it). A reader
        still on the damaged instance that meets its damage later fails as before, but starts no rebuild: the
        instance it read is no longer the index (it rebuilt the new one a second time)."""
        self.index.on_corruption = None
        with contextlib.suppress(Exception):  # a damaged index may fail its final flush
            self.index.close()
        _set_aside(self.index.path)
        self.index = self._open_retrying(self.open_index)
        self.generation += 1
        self.states = index_mod.StateCache(self.index, self._state_cache_entries)
        self.segments = {}

    # --- log -----------------------------------------------------------------------------------------

    def log_end(self) -> tuple[int, int]:
        """Where the log ends: the checkpoint of an index batch written after it."""
        return self.log.active.seq, self.log.active.size

    def write_chunks(self, chunks: list[tuple[int, list[bytes]]], start: tuple[int, int]) -> None:
        lg = self.log
        try:
            for seg, parts in chunks:
                if seg != lg.active.seq:
                    lg.roll()
                if parts:
                    lg.append(b"".join(parts))
        except OSError as e:
            self.undo_round(start)
            raise errors.StorageError(f"commit log write failed: {e}", errno=e.errno) from e

    def fsync_failed(self, error: BaseException) -> errors.StorageError:
        """Pause writes after a failed fsync (either mode): which written bytes reached the disk is unknown
        until an fsync succeeds. The healer retries with ``CommitLog.sync_again``, which writes the unsynced
        bytes once more first: a plain retry may report success for pages the kernel dropped."""
        self.fsync_failures += 1
        if self.undurable is None:
            log.error("commit log fsync failed: %s; writes pause until an fsync succeeds", str(error))
        self.undurable = f"fsync failed: {error}"
        self.on_fault()
        return errors.StorageError(f"commit log fsync failed: {error}", errno=getattr(error, "errno", None))

    def undo_round(self, start: tuple[int, int]) -> None:
        """Cut the log back to ``start`` (under the write lock) after its records failed their write, fsync or
        index write: they were never indexed, and their writers are told "not stored", which is now true (a
        replay would have indexed them). The cut is fsynced at once, or else by the healer before writes
        resume. A cut that fails leaves records no caller owns: that latches ``failed``."""
        try:
            self.log.rollback(*start, sync=False)
        except OSError as e:
            self.failed = f"commit log rollback failed: {e}"
            log.error("could not cut records of a failed write off the commit log: %s; restart the broker", str(e))
            return
        for seq in [s for s in self.segments if s > start[0]]:
            del self.segments[seq]  # a segment the round rolled to is gone again
        if self.undurable is None:
            try:
                self.log.sync_again()
            except OSError as e:
                self.fsync_failed(e)

    def sync_log(self, start: tuple[int, int]) -> None:
        """fsync the log, in either flush mode, under the write lock; after a failure, what was written since
        ``start`` is cut off again and writes pause until an fsync succeeds. Control records (tombstones,
        truncations) are followed by writes to ``meta/`` that only they can undo or redo at the next open: in
        ``async`` mode too they must be on disk first (a power cut could otherwise keep the meta write, a
        group's offsets dropped, and lose the record, its lite topic coming back with its messages)."""
        try:
            self.log.sync()
        except OSError as e:
            error = self.fsync_failed(e)
            self.undo_round(start)
            raise error from e

    def write_records(self, records: Sequence[bytes]) -> list[int]:
        """Append control records in one log write per touched segment and one fsync (either mode), under
        the write lock; returns the segments written to."""
        lg = self.log
        start = (lg.active.seq, lg.active.size)
        seg, pos = start
        seg_max = lg.segment_max_bytes
        chunks: list[tuple[int, list[bytes]]] = []
        parts: list[bytes] = []
        for record in records:
            if pos + len(record) > seg_max:
                chunks.append((seg, parts))
                parts = []
                seg += 1
                pos = 0
            parts.append(record)
            pos += len(record)
        chunks.append((seg, parts))
        self.write_chunks(chunks, start)
        self.sync_log(start)
        return [s for s, written in chunks if written]


def _nothing() -> None:
    pass


def _set_aside(path: Path) -> None:
    """Move a damaged index to ``index.damaged`` (one copy kept, for a post-mortem) so a new one can start."""
    aside = path.with_name(path.name + ".damaged")
    shutil.rmtree(aside, ignore_errors=True)
    if path.exists():
        os.rename(path, aside)
