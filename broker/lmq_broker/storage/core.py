"""What the parts of one open store share: the commit log, the current index with its caches, the write lock
and whether the store may write, read or is being rebuilt.

``store.LmqStore`` composes the parts around one ``Core``: ``appends`` (write rounds), ``reads``,
``retention``, ``recovery`` (at open, and a rebuild while serving) and ``meta.Meta``. A rebuild replaces
``index``, ``states`` and ``segments`` together, under ``write_lock``, and counts it in ``generation``: a
reader that uses them without the lock takes them once and checks the generation afterwards.

Index writes and log writes that others build on go through here once, so a failure stops the store the same
way wherever it happens: a failed index write after a good log write, or a failed fsync, latches ``failed``
(offsets handed out from then on could collide, or durability is unknown); damage found by a write starts a
rebuild instead, and writes resume when it is done. Lock order: ``write_lock``, then the meta store's lock.
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
        self.failed: str | None = None  # why the store stopped accepting writes (latched)
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
        if self.meta.error is not None:
            return f"meta store cannot write: {self.meta.error}"
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
        self.write_index(lambda: batch.write(checkpoint))
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
            # The log holds records the index lacks; offsets handed out from now on could collide. Stop
            # writing: a restart (or an index rebuild) re-indexes from the checkpoint.
            self.failed = f"{INDEX_WRITE_FAILED}: {e}"
            raise errors.StorageError(f"index write failed: {e}") from e

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

    def replace_index(self) -> None:
        """Set the damaged index aside and start an empty one (the caller then replays the log into it)."""
        with contextlib.suppress(Exception):  # a damaged index may fail its final flush
            self.index.close()
        _set_aside(self.index.path)
        deadline = time.monotonic() + INDEX_RELEASE_S
        while True:
            try:
                self.index = self.open_index()
                break
            except errors.StorageError as e:
                # RocksDB frees the old instance (and the LOCK path it holds in this process) only when the
                # last iterator of it is gone: a reader that just hit the damage may still hold one.
                if "lock" not in e.message.lower() or time.monotonic() > deadline:
                    raise
                gc.collect()
                time.sleep(0.05)
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
            try:
                lg.rollback(*start)
            except OSError as again:
                self.failed = f"commit log rollback failed: {again}"
            raise errors.StorageError(f"commit log write failed: {e}", errno=e.errno) from e

    def fsync_failed(self, error: BaseException) -> errors.StorageError:
        """Stop taking writes after a failed fsync: which written bytes reached the disk is unknown, and a
        retried fsync may report success for pages the kernel dropped. A restart re-validates the log (the
        records of the failed round may survive it: their senders were told of a failure, and resend)."""
        self.failed = f"commit log fsync failed: {error}"
        return errors.StorageError(f"commit log fsync failed: {error}", errno=getattr(error, "errno", None))

    def sync_log(self) -> None:
        """fsync the log (``sync`` mode), under the write lock; a failure stops the store taking writes."""
        if self.sync:
            try:
                self.log.sync()
            except OSError as e:
                raise self.fsync_failed(e) from e

    def write_records(self, records: Sequence[bytes]) -> list[int]:
        """Append control records in one log write per touched segment and one fsync (``sync`` mode), under
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
        self.sync_log()
        return [s for s, written in chunks if written]


def _set_aside(path: Path) -> None:
    """Move a damaged index to ``index.damaged`` (one copy kept, for a post-mortem) so a new one can start."""
    aside = path.with_name(path.name + ".damaged")
    shutil.rmtree(aside, ignore_errors=True)
    if path.exists():
        os.rename(path, aside)
