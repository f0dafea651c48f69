"""The RocksDB index: typed reads over the key layout of ``keys``; writes go through one WriteBatch per call.

Writes use ``sync=False`` with the WAL on: the commit log is the truth and carries every queue offset, so
whatever the index loses in a crash is re-indexed from the checkpoint (kept in the same batch as the
entries it covers). Memory is bounded: one block cache of ``index_cache_bytes`` that also holds index and
filter blocks, and small memtables; nothing here keeps per-topic state in Python.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Final

import rocksdict

from lmq_broker import errors, model
from lmq_broker.storage import keys

WRITE_BUFFER_BYTES: Final = 16 * 1024 * 1024
MAX_WRITE_BUFFERS: Final = 2
BLOOM_BITS_PER_KEY: Final = 10


class QueueState:
    """min/next of one queue (plus lite-topic times for an LMQ), as in the index. Cached, bounded (LRU)."""

    __slots__ = ("created", "last_consume", "last_store", "min", "name", "next")

    def __init__(
        self, name: keys.QueueName, *, created: int, last_store: int, last_consume: int, min_: int, next_: int
    ) -> None:
        self.name = name
        self.created = created
        self.last_store = last_store
        self.last_consume = last_consume
        self.min = min_
        self.next = next_

    def value(self, *, min_: int, next_: int, created: int, last_store: int, last_consume: int) -> bytes:
        if self.name.is_lmq:
            return keys.LITE_VALUE.pack(created, last_store, last_consume, min_, next_)
        return keys.STATE_VALUE.pack(min_, next_)

    def current_value(self) -> bytes:
        return self.value(
            min_=self.min,
            next_=self.next,
            created=self.created,
            last_store=self.last_store,
            last_consume=self.last_consume,
        )

    def meta(self) -> model.LiteTopicMeta:
        assert self.name.parent is not None and self.name.lite is not None
        return model.LiteTopicMeta(
            self.name.parent, self.name.lite, self.created, self.last_store, self.last_consume, self.min, self.next
        )


Entry = tuple[int, int, int, int, int]  # offset, segment, position, size, store_ms


class Index:
    def __init__(self, path: Path, cache_bytes: int) -> None:
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
        table.set_cache_index_and_filter_blocks(True)
        table.set_pin_l0_filter_and_index_blocks_in_cache(True)
        opts.set_block_based_table_factory(table)
        self.path = path
        try:
            self._db = rocksdict.Rdict(str(path), opts)
        except Exception as e:  # rocksdict raises bare Exception (a held LOCK, a damaged MANIFEST, ...)
            raise errors.StorageError(f"cannot open the index at {path}: {e}", path=str(path)) from e
        self._write_opts = rocksdict.WriteOptions()
        self._write_opts.sync = False
        layout = self._db.get(keys.LAYOUT_KEY)
        if layout is None:
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

    def get(self, key: bytes) -> bytes | None:
        value = self._db.get(key)
        return None if value is None else bytes(value)

    def get_u64(self, key: bytes) -> int | None:
        value = self._db.get(key)
        return None if value is None else int(keys.U64.unpack(value)[0])

    def flush(self) -> None:
        self._db.flush_wal(True)

    def close(self) -> None:
        self._db.flush(True)  # memtables to SST: the next open replays no WAL
        self._db.close()

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

    def prefix_items(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        return self.items(prefix, keys.successor(prefix))

    # --- queues --------------------------------------------------------------------------------------

    def load_state(self, name: keys.QueueName) -> QueueState | None:
        value = self._db.get(name.state_key)
        if value is None:
            return None
        if name.is_lmq:
            created, last_store, last_consume, min_, next_ = keys.LITE_VALUE.unpack(value)
            return QueueState(
                name, created=created, last_store=last_store, last_consume=last_consume, min_=min_, next_=next_
            )
        min_, next_ = keys.STATE_VALUE.unpack(value)
        return QueueState(name, created=0, last_store=0, last_consume=0, min_=min_, next_=next_)

    def entries(self, name: keys.QueueName, start: int, count: int) -> list[Entry]:
        """Index entries of one queue for offsets [start, start + count): a seek into this queue's runs only."""
        prefix = name.entry_prefix
        ro = rocksdict.ReadOptions()
        ro.set_iterate_upper_bound(keys.successor(prefix))
        seek = prefix + keys.U64BE.pack(start)
        it = self._db.iter(ro)
        it.seek_for_prev(seek)  # the run holding ``start`` begins at or before it
        if it.valid():
            found = it.key()
            if found.startswith(prefix):
                seek = found
        end = start + count
        out: list[Entry] = []
        unpack_first = keys.U64BE.unpack_from
        unpack_head = keys.RUN_HEAD.unpack_from
        unpack_entry = keys.RUN_ENTRY.unpack_from
        head, step, tail = keys.RUN_HEAD.size, keys.RUN_ENTRY.size, len(prefix)
        single = head + step
        unpack_single = keys.RUN_SINGLE.unpack
        for key, value in self._db.items(from_key=seek, read_opt=ro):
            first = unpack_first(key, tail)[0]  # type: ignore[arg-type]  # raw mode: keys are bytes
            if first >= end:
                break
            if len(value) == single:  # a run of one entry: the common case of a lite topic
                seg, store_ms, pos, size = unpack_single(value)
                if first >= start:
                    out.append((first, seg, pos, size, store_ms))
                continue
            seg, store_ms = unpack_head(value)
            n = (len(value) - head) // step
            for i in range(max(0, start - first), min(n, end - first)):
                pos, size = unpack_entry(value, head + i * step)
                out.append((first + i, seg, pos, size, store_ms))
            if first + n >= end:
                break
        return out

    def runs(self, name: keys.QueueName) -> Iterator[tuple[int, int, int]]:
        """(first offset, segment, length) of every run of a queue, in offset order."""
        for key, value in self.prefix_items(name.entry_prefix):
            seg, _ = keys.RUN_HEAD.unpack_from(value)
            yield keys.U64BE.unpack_from(key, len(key) - 8)[0], seg, keys.run_length(value)

    # --- recovery ------------------------------------------------------------------------------------

    def checkpoint(self) -> tuple[int, int] | None:
        value = self._db.get(keys.CHECKPOINT_KEY)
        if value is None:
            return None
        seg, pos = keys.CHECKPOINT_VALUE.unpack(value)
        return int(seg), int(pos)

    def clear_derived(self) -> None:
        """Drop every key that the log can recreate (before a rebuild); offsets and control metadata stay."""
        wb = self.batch()
        for prefix in keys.DERIVED_PREFIXES:
            wb.delete_range(prefix, keys.successor(prefix))
        wb.delete(keys.CHECKPOINT_KEY)
        self.write(wb)

    def segment_table(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for key, value in self.prefix_items(keys.SEGMENT):
            first, last = keys.SEGMENT_VALUE.unpack(value)
            out[keys.U32BE.unpack_from(key, 1)[0]] = [first, last]
        return out
