"""One RocksDB instance as the store uses it, twice: ``index`` (a cache of the log) and ``meta`` (what no log
holds). Options, the layout-version check and error mapping live here once, so both get the same bounded
memory and the same answer to damage.

Memory is bounded: one block cache of ``cache_bytes`` that also holds index and filter blocks, and small
memtables; nothing here keeps per-key state in Python. Every read checks RocksDB's status: an iterator that
meets a damaged block stops silently otherwise. Damage comes out as ``errors.IndexCorrupt`` (and is told to
``on_corruption`` first), any other failure as ``errors.StorageError``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final, NamedTuple, cast

import rocksdict

from lmq_broker import errors
from lmq_broker.storage import keys

WRITE_BUFFER_BYTES: Final = 16 * 1024 * 1024
MAX_WRITE_BUFFERS: Final = 2
BLOOM_BITS_PER_KEY: Final = 10


class Cursor(NamedTuple):
    """An iterator with the read options and bound it was made from. The iterator does not keep them alive:
    with both gone (a helper's locals), seeks found nothing in a store test. Hold the cursor, use ``it``.

    A RocksDB iterator that meets a corrupt block just stops (``valid()`` turns False): whoever walks one to
    its end calls ``check`` before trusting that the end was the end."""

    it: rocksdict.RdictIter
    keep: tuple[object, ...]
    owner: Rocks

    def check(self) -> None:
        try:
            self.it.status()
        except Exception as e:  # rocksdict raises bare Exception carrying RocksDB's status text
            raise self.owner.failed(e) from e

    def delete_prefixed(self, wb: rocksdict.WriteBatch, prefix: bytes) -> None:
        """Add a point delete of every key starting with ``prefix`` to ``wb`` (re-seeks this cursor). Point
        deletes, not delete_range: range tombstones pile up and slow every later read (``Batch.delete_queue``)."""
        it = self.it
        key_of = cast("Callable[[], bytes]", it.key)  # raw mode: keys are bytes
        it.seek(prefix)
        while it.valid():
            key = key_of()
            if not key.startswith(prefix):
                break
            wb.delete(key)
            it.next()
        self.check()


def is_corruption(error: BaseException) -> bool:
    """Does a RocksDB error say its files are damaged (rather than busy, closed or out of space)? A manifest
    that CURRENT names but that is gone counts: the database cannot be opened from what is there."""
    text = str(error)
    if "Corruption" in text or "checksum mismatch" in text:
        return True
    return "No such file" in text and ("MANIFEST" in text or "CURRENT" in text)


class _Closed:
    """Stands in for a RocksDB handle dropped without a flush: whoever still holds the ``Rocks`` object (a
    reader that took the index before a reopen) gets a StorageError, as from any failed read."""

    def __getattr__(self, name: str) -> object:
        raise errors.StorageError("index closed (reopened after a write error): retry")


_CLOSED: Final = cast("rocksdict.Rdict", _Closed())


class Rocks:
    """One RocksDB instance. ``on_corruption`` (set by the store) hears of the first read that finds a damaged
    block; every read error comes out as ``errors.StorageError`` (``errors.IndexCorrupt`` for damage)."""

    def __init__(self, path: Path, cache_bytes: int, *, read_only: bool = False) -> None:
        path.mkdir(parents=True, exist_ok=True)
        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.set_write_buffer_size(WRITE_BUFFER_BYTES)
        opts.set_max_write_buffer_number(MAX_WRITE_BUFFERS)
        opts.set_max_background_jobs(2)
        opts.set_keep_log_file_num(2)
        opts.set_max_total_wal_size(4 * WRITE_BUFFER_BYTES)
        opts.set_compression_type(rocksdict.DBCompressionType.lz4())
        table = rocksdict.BlockBasedOptions()
        if cache_bytes > 0:
            table.set_block_cache(rocksdict.Cache(cache_bytes))
        else:
            table.disable_cache()
        table.set_bloom_filter(BLOOM_BITS_PER_KEY, False)
        # Index and filter blocks live in the (bounded) block cache, partitioned into small blocks: one
        # whole-file filter of a million-topic SST is megabytes, larger than a cache shard, so it would be
        # re-read and re-parsed on every lookup (~150 us a get). Only the small top level stays pinned.
        table.set_index_type(rocksdict.BlockBasedIndexType.two_level_index_search())
        table.set_partition_filters(True)
        table.set_metadata_block_size(4096)
        table.set_cache_index_and_filter_blocks(True)
        table.set_pin_top_level_index_and_filter(True)
        table.set_pin_l0_filter_and_index_blocks_in_cache(True)
        opts.set_block_based_table_factory(table)
        self.path = path
        self.read_only = read_only
        self.on_corruption: Callable[[errors.IndexCorrupt], None] | None = None
        try:
            access = rocksdict.AccessType.read_only() if read_only else rocksdict.AccessType.read_write()
            self._db = rocksdict.Rdict(str(path), opts, access_type=access)
        except Exception as e:  # rocksdict raises bare Exception (a held LOCK, a damaged MANIFEST, ...)
            if is_corruption(e):
                raise errors.IndexCorrupt(f"cannot open {path}: {e}", path=str(path)) from e
            raise errors.StorageError(f"cannot open {path}: {e}", path=str(path)) from e
        self._write_opts = rocksdict.WriteOptions()
        self._write_opts.sync = False
        try:
            layout = self._get(keys.LAYOUT_KEY)  # the first read: a damaged table can show up here
        except errors.StorageError:
            self._db.close()  # the LOCK goes with the handle, so the caller can set the directory aside
            raise
        if layout is None:
            if not read_only:
                self._db.put(keys.LAYOUT_KEY, keys.U32.pack(keys.LAYOUT_VERSION))
        elif keys.U32.unpack(layout)[0] != keys.LAYOUT_VERSION:
            version = keys.U32.unpack(layout)[0]
            self._db.close()
            raise errors.UnsupportedVersion(f"index layout {version} not supported", version=version)

    # --- plumbing ------------------------------------------------------------------------------------

    @staticmethod
    def batch() -> rocksdict.WriteBatch:
        return rocksdict.WriteBatch(raw_mode=True)

    def write(self, wb: rocksdict.WriteBatch) -> None:
        self._db.write(wb, self._write_opts)

    def write_synced(self, wb: rocksdict.WriteBatch) -> None:
        """A write that is on disk (with every earlier write of this instance) when it returns."""
        opts = rocksdict.WriteOptions()
        opts.sync = True
        self._db.write(wb, opts)

    def failed(self, error: BaseException) -> errors.StorageError:
        """The error to raise for a failed read (``on_corruption`` hears of damage first)."""
        if isinstance(error, errors.StorageError):
            return error
        if is_corruption(error):
            corrupt = errors.IndexCorrupt(f"{self.path}: {error}", path=str(self.path))
            if self.on_corruption is not None:
                self.on_corruption(corrupt)
            return corrupt
        return errors.StorageError(f"{self.path}: {error}", path=str(self.path))

    def _get(self, key: bytes) -> bytes | None:
        try:
            return cast("bytes | None", self._db.get(key))
        except Exception as e:
            raise self.failed(e) from e

    def held(self, keys_: list[bytes]) -> list[bool]:
        """Which of ``keys_`` are present: one multi-get (~1 µs a key here, a ``get`` each ~8)."""
        try:
            asked: list[str | int | float | bytes | bool] = list(keys_)  # rocksdict's key union (list is invariant)
            values = cast("list[bytes | None]", self._db.get(asked))
        except Exception as e:
            raise self.failed(e) from e
        return [value is not None for value in values]

    def get(self, key: bytes) -> bytes | None:
        value = self._get(key)
        return None if value is None else bytes(value)

    def get_u64(self, key: bytes) -> int | None:
        value = self._get(key)
        return None if value is None else int(keys.U64.unpack(value)[0])

    def flush(self) -> None:
        self._db.flush_wal(True)

    def copy_to(self, path: Path) -> None:
        """A consistent copy of this instance in ``path`` (a new directory on the same file system: table files
        are hard-linked, the memtable flushed first)."""
        try:
            rocksdict.Checkpoint(self._db).create_checkpoint(str(path))
        except Exception as e:  # rocksdict raises bare Exception
            raise errors.StorageError(f"cannot checkpoint {self.path}: {e}", path=str(self.path)) from e

    def close(self, *, flush: bool = True) -> None:
        """``flush`` False: after a write error, when a flush would fail too (after a second of retries): the
        handle is dropped, and the next open replays the WAL instead. Calls on this object fail from then on."""
        if not flush:
            self._db.cancel_all_background(False)
            self._db = _CLOSED  # the last reference goes (``Rdict.close`` is a flush, then this)
            return
        try:
            if not self.read_only:  # (a read-only handle has nothing to flush, and RocksDB refuses to)
                self._db.flush(True)  # memtables to SST: the next open replays no WAL
        finally:
            self._db.close()  # even after a failed flush (a full disk): the LOCK must go with the handle

    def items(self, lo: bytes, hi: bytes, limit: int = -1) -> Iterator[tuple[bytes, bytes]]:
        """Keys in [lo, hi) in order."""
        ro = rocksdict.ReadOptions()
        ro.set_iterate_upper_bound(hi)
        it = self._db.iter(ro)
        it.seek(lo)
        n = 0
        while it.valid() and n != limit:
            yield bytes(it.key()), bytes(it.value())
            n += 1
            it.next()
        if n != limit:
            Cursor(it, (ro, hi), self).check()

    def raw_iter(self, lo: bytes, hi: bytes) -> Cursor:
        """A RocksDB iterator positioned at ``lo``, bounded by ``hi``: for hot loops that want to skip rows
        without the per-row generator and copies of ``items``."""
        ro = rocksdict.ReadOptions()
        ro.set_iterate_upper_bound(hi)
        it = self._db.iter(ro)
        it.seek(lo)
        return Cursor(it, (ro, hi), self)

    def prefix_items(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        return self.items(prefix, keys.successor(prefix))
