"""LmqStore: the commit log (truth) + the RocksDB index (cache), behind ``api.Store``.

Write path, one *round* at a time under the write lock: callers queue their request and whoever gets the
lock first takes every queued request (leader/follower group commit), validates each (a bad request fails
alone, nothing of it written), assigns offsets, encodes, writes each touched segment with one write,
fsyncs once (``sync`` mode), then writes one WriteBatch with every index run, queue state, lite-topic
record, counter, segment-table row and the checkpoint. Followers find their request done when they get
the lock. Index after fsync means the index never points past the durable log in ``sync`` mode.
``try_begin`` runs the same round in steps for an event loop: validate and write (lock taken without
waiting), then the caller's ``sync``, then index and publish (``finish``, lock freed).

Per-queue state (min/next and lite-topic times) lives in the index; a bounded LRU keeps the hot ones.
Only the write path fills the LRU (under the lock), so a reader can never put a stale state in it.

Recovery: scan the log from the checkpoint, re-index what follows it (offsets come from the records),
truncate a torn tail in the last segment, quarantine a bad record with good ones after it. A missing index
or a checkpoint past the log's end rebuilds every derived key from the log. Unless the last close was clean
(its marker in meta), queues are reconciled with the groups' committed offsets: in async mode a power cut can
cut the log cleanly while meta kept later commits. Offsets the log lost are recorded (``H`` ranges): they are
the only holes a reader is shown; anything else it cannot vouch for is an error (try later), never a hole.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import operator
import os
import shutil
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import Final, NamedTuple, cast

import rocksdict

from lmq_broker import config, errors, model
from lmq_broker.storage import api, codec, commitlog, damage, keys
from lmq_broker.storage import index as index_mod

log = logging.getLogger(__name__)

Clock = Callable[[], int]

STATE_CACHE_ENTRIES: Final = 16_384  # ~250 B each: hot queues only, a miss is one RocksDB get
NAME_CACHE_ENTRIES: Final = 16_384  # ~600 B each: a miss re-validates a name (a few us)
REPLAY_BATCH_RECORDS: Final = 4096
RETENTION_BATCH_QUEUES: Final = 10_000
SCAN_LIMIT_MAX: Final = 100_000
META_CACHE_BYTES: Final = 8 * 1024 * 1024  # offsets are read on a consumer's first receive, then cached above
QUARANTINE_COPY_BYTES: Final = 64 * 1024 * 1024
META_RETRY_S: Final = 1.0  # after a failed meta write, reopen and retry at most this often
INDEX_WRITE_FAILED: Final = "index write failed"
INDEX_RELEASE_S: Final = 30.0  # how long a rebuild waits for readers to let go of the damaged index


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


_new_result = tuple.__new__  # AppendResult's own __new__ is a Python-level function: skip it per message


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    rebuilt: bool  # the whole derived index was recreated from the log
    records_reindexed: int
    truncated_bytes: int  # torn tail cut from the last segment
    duration_ms: float
    quarantined_records: int = 0  # bad records with good ones after them: skipped, copied to quarantine/
    lost_entries: int = 0  # index entries whose segment file is missing
    queues_reconciled: int = 0  # queues whose next offset was raised to a group's committed/acked offsets


class _Request:
    __slots__ = ("done", "error", "messages", "prepared", "results")

    def __init__(self, messages: Sequence[model.NewMessage]) -> None:
        self.messages = messages
        self.prepared: list[codec.Prepared] = []
        self.results: list[model.AppendResult] = []
        self.error: BaseException | None = None
        self.done = False


class _Staged(NamedTuple):
    """Requests of one round written to the log, neither fsynced nor indexed yet (under the write lock)."""

    live: list[_Request]
    batch: index_mod.Batch
    chunks: list[tuple[int, list[bytes]]]
    store_ms: int


class _Pending:
    """``LmqStore.try_begin``'s answer: holds the store's write lock from ``try_begin`` until ``finish``."""

    __slots__ = ("_finished", "_reqs", "_staged", "_store")

    def __init__(self, store: LmqStore, reqs: list[_Request], staged: _Staged | None) -> None:
        self._store = store
        self._reqs = reqs
        self._staged = staged
        self._finished = False

    @property
    def needs_sync(self) -> bool:
        return self._staged is not None and self._store._sync

    def sync(self) -> None:
        self._store._log.sync()

    def finish(self, sync_error: BaseException | None = None) -> list[list[model.AppendResult] | BaseException]:
        if self._finished:
            raise RuntimeError("a pending append is finished once")
        self._finished = True
        try:
            if self._staged is not None:
                self._store._index_staged(self._staged, sync_error)
        finally:
            for r in self._reqs:
                r.done = True
            self._store._write_lock.release()
        return [r.results if r.error is None else r.error for r in self._reqs]


class LmqStore:
    """The store of one broker: see the module docstring; implements ``api.Store``."""

    def __init__(
        self, cfg: config.StoreConfig, clock: Clock = wall_clock_ms, state_cache_entries: int = STATE_CACHE_ENTRIES
    ) -> None:
        self._cfg = cfg
        self._clock = clock
        self._sync = cfg.flush_mode == config.FlushMode.SYNC
        self._max_record = min(cfg.max_record_bytes, cfg.segment_max_bytes)
        self._names = keys.NameCache(NAME_CACHE_ENTRIES)
        self._resolve = self._names.queue
        self._write_lock = threading.Lock()
        self._queue_lock = threading.Lock()
        self._retention_lock = threading.Lock()  # one retention pass at a time (it runs mostly unlocked)
        self._queue: list[_Request] = []
        self._closed = False
        self._failed: str | None = None
        self._rebuilding: str | None = None  # why the index is being rebuilt (reads find nothing meanwhile)
        self._rebuilder: threading.Thread | None = None
        self._unreadable: str | None = None  # a rebuild failed: the index is partial, reads fail until a restart
        self._meta_lock = threading.Lock()  # meta writes, the meta handle and ``_acked_keys`` (after the write lock)
        self._meta_retrier: threading.Thread | None = None
        self._clean_open = False  # the last close was clean (the marker was there): nothing to reconcile
        self._meta_error: str | None = None  # the last meta write failed (a full disk): retried, then reopened
        self._stop = threading.Event()
        self._state_cache_entries = state_cache_entries
        self.damage = damage.Skips()
        self.index_rebuilds = 0
        started = time.perf_counter()
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        self._log = commitlog.CommitLog(cfg.data_dir / "commitlog", cfg.segment_max_bytes)
        try:
            # Two RocksDB instances: ``index`` holds only what the log can recreate (a cache: delete it and it is
            # rebuilt); ``meta`` holds what only the broker knows (consumer offsets, topics, groups, quotas).
            self._meta = _open_meta(cfg.data_dir / "meta")
            try:
                self._index = self._open_index()
            except BaseException:
                self._meta.close()
                raise
        except BaseException:
            self._log.close()
            raise
        self._states = index_mod.StateCache(self._index, state_cache_entries)
        self._reconciled = 0
        try:
            self._acked_keys = {key for key, _ in self._meta.prefix_items(keys.ACKED)}
            self._clean_open = self._meta.get(keys.CLEAN_KEY) is not None
            # In sync mode the index never points past the durable log, so no group can have consumed past it:
            # after a crash of such a session there is nothing to reconcile unless recovery finds damage.
            self._synced_before = self._meta.get(keys.SYNC_SESSION_KEY) is not None
            damaged = ""
            try:
                self._move_primary_keys()
                self._segtab = self._index.segment_table()
                rebuilt, reindexed, truncated = self._recover()
            except errors.IndexCorrupt as e:  # found while recovering: rebuild now, before serving
                damaged = e.message  # (outside this block: the error's frames hold iterators of the old index)
            if damaged:
                log.error("the index is damaged (%s); it is a cache of the commit log: rebuilding it", damaged)
                self._replace_index()
                rebuilt, reindexed, truncated = self._recover()
            self._index.on_corruption = self._index_corrupt
            # Before anything is written: the clean marker goes (a crash from here on must be recovered from),
            # and the sync-session marker says whether this session's crash could leave offsets past the log.
            marks = self._meta.batch()
            if self._clean_open:
                marks.delete(keys.CLEAN_KEY)
            if self._sync:
                marks.put(keys.SYNC_SESSION_KEY, b"")
            elif self._synced_before:
                marks.delete(keys.SYNC_SESSION_KEY)
            if self._clean_open or self._sync != self._synced_before:
                self._meta.write_synced(marks)
            self._clean_open = False
        except BaseException:
            with contextlib.suppress(Exception):
                self._index.close()
            self._meta.close()
            self._log.close()
            raise
        self.recovery = RecoveryReport(
            rebuilt,
            reindexed,
            truncated,
            (time.perf_counter() - started) * 1000,
            self.damage.total("quarantined"),
            self.damage.total("lost"),
            self._reconciled,
        )
        self._flusher: threading.Thread | None = None
        if not self._sync:
            self._flusher = threading.Thread(target=self._flush_loop, name="lmq-store-flusher", daemon=True)
            self._flusher.start()

    # --- introspection (tests, benchmarks) -----------------------------------------------------------

    @property
    def fsync_count(self) -> int:
        return self._log.fsyncs

    @property
    def cached_states(self) -> int:
        return len(self._states)

    def index_generation(self) -> int:
        return self.index_rebuilds

    def health(self) -> str | None:
        """None while the store serves reads and writes; else why not (the broker's readiness probe). Cheap and
        without side effects: it may be called on an event loop."""
        if self._closed:
            return "store is closed"
        if self._rebuilding is not None:
            return f"index rebuilding from the commit log: {self._rebuilding}"
        if self._failed is not None:
            return f"store stopped accepting writes: {self._failed}"
        if self._unreadable is not None:
            return f"index unusable: {self._unreadable}"
        if self._meta_error is not None:
            return f"meta store cannot write: {self._meta_error}"
        return None

    def wait_rebuilt(self, timeout: float | None = None) -> bool:
        """Wait for a running index rebuild (tests); True when none is running."""
        t = self._rebuilder
        if t is not None:
            t.join(timeout)
        return self._rebuilding is None

    def drop_caches(self) -> None:
        """Forget every cached queue state and name (they are reloaded from the index on demand)."""
        with self._write_lock:
            self._states.clear()
            self._names.clear()

    # --- messages ------------------------------------------------------------------------------------

    def append(self, messages: Sequence[model.NewMessage]) -> list[model.AppendResult]:
        self._check_open()
        self._check_not_rebuilding()
        if not messages:
            return []
        req = _Request(messages)
        with self._queue_lock:
            self._queue.append(req)
        with self._write_lock:
            if not req.done:
                with self._queue_lock:
                    reqs, self._queue = self._queue, []
                self._round(reqs)
        if req.error is not None:
            raise req.error
        return req.results

    def try_begin(self, requests: Sequence[Sequence[model.NewMessage]]) -> api.PendingAppend | None:
        self._check_open()
        # Never queued: a request queued and then withdrawn could already have been taken by another leader,
        # and would be stored twice when the caller hands it to its thread. Nor does it take the queued
        # requests of others along (as a leader would): one may be a large batch its thread is waiting to
        # write, which must not run on the caller's event loop. Each waiter writes its own once it has the lock.
        if not self._write_lock.acquire(blocking=False):
            return None
        reqs = [_Request(messages) for messages in requests]
        try:
            staged = self._stage(reqs)
        except BaseException:
            self._write_lock.release()
            raise
        return _Pending(self, reqs, staged)

    def read(self, queue: model.QueueId, offset: int, max_count: int) -> list[model.StoredMessage]:
        return self.read_span(queue, offset, max_count)[0]

    def read_span(self, queue: model.QueueId, offset: int, max_count: int) -> tuple[list[model.StoredMessage], int]:
        """The messages from ``offset`` and the end of the span covered. An offset in the span without a message
        is one the store can vouch is gone (below the queue's min, a known-lost ``H`` range, a record that
        fails its CRC, a segment retention dropped): the dispatcher settles it. Anything else raises (the
        caller tries later) or ends the span before it: never a false hole.

        The index, its states and its generation are taken once: a rebuild that swaps the index meanwhile
        (the new one partly replayed) makes the answer an error, not a span of holes."""
        self._check_open()
        name = self._resolve(queue.topic, queue.queue)
        generation = self.index_rebuilds
        self._check_readable()
        index, states = self._index, self._states
        if max_count <= 0:
            return [], offset
        try:
            st = states.get(name)
            if st is None:
                self._check_same_index(generation)
                return [], offset
            lo, hi = st.min, st.next  # one state, read once (the write path replaces its fields in place)
            start = max(offset, lo)
            if start >= hi:
                self._check_same_index(generation)
                return [], start
            entries = index.entries(name, start, hi, max_count)
            end = entries[-1][0] + 1 if len(entries) >= max_count else hi
            end = self._vouched_end(index=index, states=states, name=name, start=start, end=end, entries=entries)
        except Exception as e:
            self._check_same_index(generation)  # a swapped (closed) index fails its readers: say why
            if isinstance(e, errors.StorageError):
                raise
            raise errors.StorageError(f"index read failed: {e}") from e
        if entries and entries[-1][0] >= end:
            entries = [e for e in entries if e[0] < end]
        bufs = self._log.read_entries(entries)
        self._check_same_index(generation)
        decode = codec.decode_message
        out: list[model.StoredMessage] = []
        for entry, buf in zip(entries, bufs, strict=True):
            if buf is None:  # the segment is gone: dropped by retention after the lookup
                if self._log.seqs()[0] <= entry[1]:
                    end = entry[0]  # not a segment retention dropped: do not vouch for the rest
                    break
                continue
            try:
                out.append(decode(buf, queue, entry[0]))
            except errors.StorageError as e:
                self.damage.report(
                    "corrupt_read",
                    f"{queue.topic} queue {queue.queue} offset {entry[0]}: {e.message} "
                    f"(segment {entry[1]} position {entry[2]}); the message is skipped",
                )
        return out, end

    def _vouched_end(
        self,
        *,
        index: index_mod.Index,
        states: index_mod.StateCache,
        name: keys.QueueName,
        start: int,
        end: int,
        entries: list[index_mod.Entry],
    ) -> int:
        """``end``, or the first offset of [start, end) that has no entry and is not in a known-lost range.
        Raises when that is ``start`` itself (nothing to answer but a hole the store cannot vouch for)."""
        n = len(entries)
        if n and entries[0][0] == start and entries[-1][0] == start + n - 1 == end - 1:
            return end  # the usual answer: dense (entries are in offset order, distinct), no extra read
        expected = start
        gaps: list[tuple[int, int]] = []
        for entry in entries:
            if entry[0] > expected:
                gaps.append((expected, entry[0]))
            expected = entry[0] + 1
        if end > expected:
            gaps.append((expected, end))
        if not gaps:
            return end  # the usual answer: dense, no extra read
        holes = index.holes(name, gaps[0][0], end)
        now = states.get(name)
        floor = 0 if now is None else now.min  # retention may have advanced it since (its runs deleted first)
        for first, last in gaps:
            at = max(first, floor)
            for h_first, h_end in holes:
                if h_first <= at < h_end:
                    at = h_end
            if at < last:  # an offset without an entry that no recorded loss explains
                log.error(
                    "%s queue %d: no index entry for offset %d and no record of its loss; not reported as gone",
                    name.topic, name.queue, at,
                )  # fmt: skip
                if at == start:
                    raise errors.StorageError(
                        f"{name.topic} queue {name.queue}: no index entry for offset {at}", offset=at
                    )
                return at
        return end

    def _check_readable(self) -> None:
        if self._rebuilding is not None:
            raise errors.StorageError(f"index rebuilding from the commit log: {self._rebuilding}")
        if self._unreadable is not None:
            raise errors.StorageError(f"index unusable: {self._unreadable}")

    def _check_same_index(self, generation: int) -> None:
        """After a read: the index it used is still the one serving, and no rebuild has begun."""
        if self.index_rebuilds != generation:
            raise errors.StorageError("index rebuilding from the commit log: replaced during the read")
        self._check_readable()

    def queue_offsets(self, queue: model.QueueId) -> tuple[int, int]:
        self._check_open()
        st = self._state(self._resolve(queue.topic, queue.queue))
        return (0, 0) if st is None else (st.min, st.next)

    # --- consumer offsets ----------------------------------------------------------------------------

    def commit_offset(self, queue: model.QueueId, group: str, offset: int, acked: Sequence[int] = ()) -> None:
        self._commit_offset(queue, group, offset, acked, wait=True)

    def try_commit_offset(self, queue: model.QueueId, group: str, offset: int, acked: Sequence[int] = ()) -> bool:
        return self._commit_offset(queue, group, offset, acked, wait=False)

    def _commit_offset(
        self, queue: model.QueueId, group: str, offset: int, acked: Sequence[int], *, wait: bool
    ) -> bool:
        """False (nothing written) only when ``wait`` is False and another writer holds the write lock."""
        self._check_open()
        name = self._resolve(queue.topic, queue.queue)
        _check_group(group)
        if offset < 0:
            raise errors.InvalidArgument("offset must be >= 0", offset=offset)
        if acked and acked[0] <= offset:  # ascending (an OffsetRanges: min() would walk every offset)
            raise errors.InvalidArgument("acked offsets lie above the committed offset", offset=offset)
        akey = keys.acked_key(name.qkey, group)
        meta = self._meta.batch()
        meta.put(keys.offset_key(name.qkey, group), keys.U64.pack(offset))
        if acked:
            meta.put(akey, keys.encode_acked(offset, acked))
        elif akey in self._acked_keys:
            meta.delete(akey)
        if self._rebuilding is not None or self._unreadable is not None:
            # Only meta/ is written: an ack must not wait for (or fail on) a rebuild of the index, which holds
            # the write lock for its duration. The lite topic's state cannot be read meanwhile, so its last
            # consume time goes to meta/ only (the rebuild copies it into the index when it ends).
            if name.is_lmq:
                meta.put(keys.consumed_key(name.qkey), keys.U64.pack(self._clock()))
            return self._write_meta(meta, note=(akey, bool(acked)), wait=wait)
        if not self._write_lock.acquire(blocking=wait):
            return False
        try:
            self._check_open()
            if not name.is_lmq:
                return self._write_meta(meta, note=(akey, bool(acked)))
            st = self._state(name)
            if st is None:
                return True  # the lite topic is gone (reclaimed): a late ack must not resurrect its offsets
            now = self._clock()
            meta.put(keys.consumed_key(name.qkey), keys.U64.pack(now))  # survives a rebuilt index
            self._write_meta(meta, note=(akey, bool(acked)))
            if self._failed is None:
                wb = self._index.batch()
                wb.put(name.state_key, _value(st, last_consume=now))
                try:
                    self._index.write(wb)
                except Exception as e:  # the commit is in meta/; a rebuild restores the time from there
                    log.warning("could not record the last consume time of %s in the index: %s", name.topic, e)
                    return True
                st.last_consume = now
            return True
        finally:
            self._write_lock.release()

    def get_offset(self, queue: model.QueueId, group: str) -> int | None:
        self._check_open()
        name = self._resolve(queue.topic, queue.queue)
        with self._meta_lock:  # the handle may be reopened (after a failed write) by another thread
            return self._meta.get_u64(keys.offset_key(name.qkey, group))

    def get_acked(self, queue: model.QueueId, group: str) -> Sequence[int]:
        self._check_open()
        key = keys.acked_key(self._resolve(queue.topic, queue.queue).qkey, group)
        if key not in self._acked_keys:  # the usual answer, without a RocksDB read
            return ()
        with self._meta_lock:
            value = self._meta.get(key)
        return () if value is None else keys.decode_acked(value)[1]

    # --- lite topics ---------------------------------------------------------------------------------

    def lite_topic(self, parent: str, lite: str) -> model.LiteTopicMeta | None:
        self._check_open()
        st = self._state(self._resolve(keys.lmq_topic(parent, lite), 0))
        return None if st is None else st.meta()

    def lite_topic_count(self, parent: str | None = None) -> int:
        self._check_open()
        return self._index.get_u64(keys.count_key(parent)) or 0

    def scan_lite_topics(
        self,
        parent: str | None = None,
        start_after: str = "",
        end_before: str = "",
        limit: int = 1000,
        idle_since_before_ms: int = 0,
    ) -> list[model.LiteTopicMeta]:
        self._check_open()
        prefix = keys.lite_prefix(parent)
        lo = prefix + _scan_bound(start_after, parent)
        hi = prefix + _scan_bound(end_before, parent) if end_before else keys.successor(prefix)
        out: list[model.LiteTopicMeta] = []
        limit = max(0, min(limit, SCAN_LIMIT_MAX))
        if limit == 0:
            return out
        cursor = self._index.raw_iter(lo, hi)
        it = cursor.it
        # The reclaim scan walks millions of rows of which most are skipped: bound methods in locals, the
        # value unpacked once and tested before the key is split or decoded or any object is built.
        valid, advance = it.valid, it.next
        key_of = cast("Callable[[], bytes]", it.key)  # raw mode: keys and values are bytes
        value_of = cast("Callable[[], bytes]", it.value)
        if valid() and key_of() == lo:
            advance()  # start_after is exclusive
        unpack = keys.LITE_VALUE.unpack
        meta = model.LiteTopicMeta
        append = out.append
        before = idle_since_before_ms
        while valid():
            created, last_store, last_consume, min_offset, max_offset = unpack(value_of())
            if before > 0 and (created >= before or last_store >= before or last_consume >= before):
                advance()
                continue
            p, _, lt = key_of()[1:].partition(b"\x00")
            append(meta(p.decode(), lt.decode(), created, last_store, last_consume, min_offset, max_offset))
            if len(out) >= limit:
                break
            advance()
        return out

    def delete_lite_topic(self, parent: str, lite: str, expected: model.LiteTopicMeta | None = None) -> bool:
        return self.delete_lite_topics([(parent, lite, expected)])[0]

    def delete_lite_topics(
        self,
        rows: Sequence[tuple[str, str, model.LiteTopicMeta | None]],
        keep: Callable[[], Collection[str]] | None = None,
    ) -> list[bool]:
        self._check_open()
        # Parsed without the name cache: a reclaim names each of its (cold) topics once, and caching them would
        # only evict the hot names of live traffic.
        parse, lmq_topic = keys.parse_queue, keys.lmq_topic
        names = [parse(lmq_topic(parent, lite), 0) for parent, lite, _ in rows]  # raise before writing
        done = [False] * len(rows)
        if not rows:
            return done
        # In key order, each seek below lands next to the previous one, in data blocks RocksDB has just read.
        order = sorted(range(len(rows)), key=[name.qkey for name in names].__getitem__)
        with self._write_lock:
            self._check_writable()
            kept = keep() if keep is not None else ()
            now = self._clock()
            victims: list[tuple[int, keys.QueueName, str]] = []
            records: list[bytes] = []
            seen: set[bytes] = set()
            # States come from the index through one iterator, not a get per topic (in key order a seek costs
            # less than a get on a large index). Under the write lock the index holds every published state.
            cursor = self._index.raw_iter(keys.LITE, keys.successor(keys.LITE))
            it = cursor.it
            unpack = keys.LITE_VALUE.unpack
            for i in order:
                name = names[i]
                if name.qkey in seen or (kept and name.topic in kept):
                    continue  # the same topic twice in one call: the first row deletes it; or one to keep
                it.seek(name.state_key)
                if not it.valid() or it.key() != name.state_key:
                    continue
                _, last_store, last_consume, _, next_offset = unpack(it.value())
                parent, _, expected = rows[i]
                if expected is not None and (
                    expected.max_offset,
                    expected.last_store_ms,
                    expected.last_consume_ms,
                ) != (next_offset, last_store, last_consume):
                    continue
                seen.add(name.qkey)
                victims.append((i, name, parent))
                records.append(codec.encode_tombstone(name, next_offset, now))
            del it, cursor
            if not victims:
                return done
            segments = self._write_records(records)
            self._drop_consumer_state([name for _, name, _ in victims])
            batch = self._batch()
            for i, name, parent in victims:
                batch.delete_queue(name)
                batch.count(parent, -1)
                done[i] = True
            for seg in segments:
                batch.touch_segment(seg, now)
            self._write_batch(batch, (self._log.active.seq, self._log.active.size))
        return done

    # --- control-plane metadata ----------------------------------------------------------------------

    def put_parent_topic(self, topic: model.ParentTopic) -> None:
        _check_resource(topic.name)
        self._put_meta(keys.name_key(keys.PARENT, topic.name), keys.encode_parent_topic(topic))

    def get_parent_topic(self, name: str) -> model.ParentTopic | None:
        value = self._get_meta(keys.name_key(keys.PARENT, name))
        return None if value is None else keys.decode_parent_topic(value)

    def delete_parent_topic(self, name: str) -> bool:
        return self._delete_meta(keys.name_key(keys.PARENT, name))

    def list_parent_topics(self) -> list[model.ParentTopic]:
        return [keys.decode_parent_topic(v) for v in self._list_meta(keys.PARENT)]

    def put_group(self, group: model.LiteGroup) -> None:
        _check_resource(group.name)
        _check_resource(group.bind_topic)
        self._put_meta(keys.name_key(keys.GROUP, group.name), keys.encode_group(group))

    def get_group(self, name: str) -> model.LiteGroup | None:
        value = self._get_meta(keys.name_key(keys.GROUP, name))
        return None if value is None else keys.decode_group(value)

    def delete_group(self, name: str) -> bool:
        return self._delete_meta(keys.name_key(keys.GROUP, name))

    def list_groups(self) -> list[model.LiteGroup]:
        return [keys.decode_group(v) for v in self._list_meta(keys.GROUP)]

    def put_quota(self, quota: model.Quota) -> None:
        _check_scope(quota.scope)
        self._put_meta(keys.name_key(keys.QUOTA, quota.scope), keys.encode_quota(quota))

    def get_quota(self, scope: str) -> model.Quota | None:
        value = self._get_meta(keys.name_key(keys.QUOTA, scope))
        return None if value is None else keys.decode_quota(value)

    def delete_quota(self, scope: str) -> bool:
        return self._delete_meta(keys.name_key(keys.QUOTA, scope))

    def list_quotas(self) -> list[model.Quota]:
        return [keys.decode_quota(v) for v in self._list_meta(keys.QUOTA)]

    def put_reclaim_run(self, run: model.ReclaimRun) -> None:
        _check_resource(run.parent)
        self._put_meta(keys.name_key(keys.RECLAIM, run.parent), keys.encode_reclaim_run(run))

    def get_reclaim_run(self, parent: str) -> model.ReclaimRun | None:
        value = self._get_meta(keys.name_key(keys.RECLAIM, parent))
        return None if value is None else keys.decode_reclaim_run(value)

    def delete_reclaim_run(self, parent: str) -> bool:
        return self._delete_meta(keys.name_key(keys.RECLAIM, parent))

    def list_reclaim_runs(self) -> list[model.ReclaimRun]:
        return [keys.decode_reclaim_run(v) for v in self._list_meta(keys.RECLAIM)]

    def put_membership(self, text: str) -> None:
        self._check_open()
        with self._write_lock, self._meta_lock:
            if self._meta_error is not None:
                raise errors.StorageError(f"meta store cannot write: {self._meta_error}")
            wb = self._meta.batch()
            wb.put(keys.MEMBERSHIP_KEY, text.encode())
            try:
                self._meta.write_synced(wb)
            except Exception as e:  # rocksdict raises bare Exception with RocksDB's status text
                raise errors.StorageError(f"meta store write failed: {e}") from e

    def get_membership(self) -> str | None:
        value = self._get_meta(keys.MEMBERSHIP_KEY)
        return None if value is None else bytes(value).decode()

    # --- maintenance ---------------------------------------------------------------------------------

    def apply_retention(self, stop: Callable[[], bool] | None = None) -> api.RetentionReport:
        self._check_open()
        with self._retention_lock:
            return self._apply_retention(stop)

    def _apply_retention(self, stop: Callable[[], bool] | None) -> api.RetentionReport:
        with self._write_lock:
            self._check_writable()
            self._log.reap()  # descriptors of segments dropped by the previous pass
            victims = self._retention_victims(self._clock())
        segments = deleted = 0
        advanced: set[bytes] = set()
        for seq in victims:
            if stop is not None and stop():
                break
            advanced |= self._drop_segment(seq)
            with self._write_lock:
                wb = self._index.batch()
                wb.delete(keys.segment_key(seq))
                # Synced: after a power cut between this and the unlink, the index must not still know the
                # segment (its file gone, it would be reported lost).
                self._write_index(lambda: self._index.write_synced(wb))  # noqa: B023 - called at once
                self._segtab.pop(seq, None)
                deleted += self._log.drop(seq)
            segments += 1
        return api.RetentionReport(segments, deleted, len(advanced))

    def flush(self) -> None:
        self._check_open()
        self._log.sync()
        self._index.flush()

    def close(self) -> None:
        with self._write_lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._flusher is not None:
            self._flusher.join()
        if self._meta_retrier is not None:
            self._meta_retrier.join()
        with self._write_lock:
            clean = self._failed is None and self._unreadable is None and self._rebuilding is None
            try:
                self._log.sync()
            except OSError:
                clean = False
            try:
                self._index.close()  # flushes its memtables: what it holds is on disk
            except Exception:
                clean = False
                log.exception("closing the index failed; the next open reconciles offsets")
            with self._meta_lock:
                if clean and self._meta_error is None:
                    try:  # log and index are on disk: the next open has nothing to reconcile
                        marker = self._meta.batch()
                        marker.put(keys.CLEAN_KEY, keys.U64.pack(self._clock()))
                        self._meta.write_synced(marker)
                    except Exception:
                        log.exception("could not mark the close as clean; the next open reconciles offsets")
                with contextlib.suppress(Exception):
                    self._meta.close()
            self._log.close()
            self._states.clear()

    # --- write path internals ------------------------------------------------------------------------

    def _round(self, reqs: list[_Request]) -> None:
        try:
            staged = self._stage(reqs)
            if staged is not None:
                error: Exception | None = None
                if self._sync:
                    try:
                        self._log.sync()
                    except Exception as e:
                        error = e
                self._index_staged(staged, error)
        finally:
            for r in reqs:
                r.done = True

    def _stage(self, reqs: list[_Request]) -> _Staged | None:
        """Validate the requests and write the valid ones to the log, neither fsynced nor indexed yet (the
        caller holds the write lock until ``_index_staged``). A failure lands on its requests; None when
        nothing was written."""
        try:
            self._check_writable()
            store_ms = self._clock()
            prepare, names, max_record = codec.prepare, self._names, self._max_record
            live: list[_Request] = []
            for r in reqs:
                try:
                    r.prepared = [prepare(m, names, max_record, store_ms) for m in r.messages]
                    live.append(r)
                except errors.LmqError as e:
                    r.error = e
            if not any(r.prepared for r in live):  # nothing valid to write (or only empty requests)
                return None
            return self._write_log(live, store_ms)
        except Exception as e:
            for r in reqs:
                if r.error is None:
                    r.error = e
                    r.results = []
            return None

    def _index_staged(self, staged: _Staged, sync_error: BaseException | None) -> None:
        """After the fsync (``sync`` mode): index the staged records and publish their queues' new states."""
        try:
            if sync_error is not None:
                raise self._fsync_failed(sync_error)
            batch = staged.batch
            for s, written in staged.chunks:
                if written:
                    batch.touch_segment(s, staged.store_ms)
            lg = self._log
            self._write_batch(batch, (lg.active.seq, lg.active.size))
        except Exception as e:
            for r in staged.live:
                r.error = e
                r.results = []

    def _write_log(self, reqs: list[_Request], store_ms: int) -> _Staged:
        lg = self._log
        seg = lg.active.seq
        pos = lg.active.size
        start = (seg, pos)
        seg_max = lg.segment_max_bytes
        batch = self._batch()
        pend = batch.pending
        chunks: list[tuple[int, list[bytes]]] = []
        parts: list[bytes] = []
        frame = codec.frame
        pack_entry = keys.RUN_ENTRY.pack
        new_result, result_type = _new_result, model.AppendResult
        fans = batch.fans
        add = operator.add
        for r in reqs:
            results: list[model.AppendResult] = []
            for p in r.prepared:
                size = p.size
                if pos + size > seg_max:  # the record goes to the next segment: runs cannot span two
                    chunks.append((seg, parts))
                    parts = []
                    seg += 1
                    pos = 0
                    batch.cut(seg, store_ms)
                entry = pack_entry(pos, size)
                names = p.queues
                if len(names) > 2:
                    # Fan-out: prepare hands every message with the same queue list the same tuple.
                    fan = fans.get(id(names))
                    if fan is None or not fan.is_open:
                        fan = batch.fan(names, seg, store_ms)
                    count = fan.count  # the fan's next offsets and its shared run (see index.Fan)
                    fan.count = count + 1
                    fan.ents.append(entry)
                    offsets = tuple(map(add, fan.base, repeat(count)))
                else:  # one or two queues, unrolled: the path of nearly every message
                    q = pend.get(names[0].qkey)
                    if q is None:
                        q = batch.queue(names[0], seg, store_ms)
                    elif q.fan is not None:
                        q.fan.close()
                    off = q.next
                    q.next = off + 1
                    q.ents.append(entry)
                    if len(names) == 1:
                        offsets = (off,)
                    else:
                        q = pend.get(names[1].qkey)
                        if q is None:
                            q = batch.queue(names[1], seg, store_ms)
                        elif q.fan is not None:
                            q.fan.close()
                        off2 = q.next
                        q.next = off2 + 1
                        q.ents.append(entry)
                        offsets = (off, off2)
                m = p.message
                prefix, head = frame(p, offsets)
                parts.append(prefix)
                parts.append(head)
                parts.append(m.body)
                pos += size
                results.append(new_result(result_type, (m.message_id, m.queues, offsets, store_ms)))
            r.results = results
        chunks.append((seg, parts))
        self._write_chunks(chunks, start)
        return _Staged(reqs, batch, chunks, store_ms)

    def _batch(self) -> index_mod.Batch:
        return index_mod.Batch(self._index, self._states, self._segtab)

    def _write_chunks(self, chunks: list[tuple[int, list[bytes]]], start: tuple[int, int]) -> None:
        lg = self._log
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
                self._failed = f"commit log rollback failed: {again}"
            raise errors.StorageError(f"commit log write failed: {e}", errno=e.errno) from e

    def _fsync_failed(self, error: BaseException) -> errors.StorageError:
        """Stop taking writes after a failed fsync: which written bytes reached the disk is unknown, and a
        retried fsync may report success for pages the kernel dropped. A restart re-validates the log (the
        records of the failed round may survive it: their senders were told of a failure, and resend)."""
        self._failed = f"commit log fsync failed: {error}"
        return errors.StorageError(f"commit log fsync failed: {error}", errno=getattr(error, "errno", None))

    def _sync_log(self) -> None:
        """fsync the log (``sync`` mode), under the write lock; a failure stops the store taking writes."""
        if self._sync:
            try:
                self._log.sync()
            except OSError as e:
                raise self._fsync_failed(e) from e

    def _write_record(self, record: bytes) -> tuple[int, int]:
        """Append one control record (its own round, under the write lock); (segment, end position)."""
        lg = self._log
        start = (lg.active.seq, lg.active.size)
        seg = start[0] + 1 if start[1] + len(record) > lg.segment_max_bytes else start[0]
        self._write_chunks([(seg, [record])], start)
        self._sync_log()
        return lg.active.seq, lg.active.size

    def _write_records(self, records: Sequence[bytes]) -> list[int]:
        """Append control records in one log write per touched segment and one fsync (``sync`` mode), under
        the write lock; returns the segments written to."""
        lg = self._log
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
        self._write_chunks(chunks, start)
        self._sync_log()
        return [s for s, written in chunks if written]

    def _write_batch(self, batch: index_mod.Batch, checkpoint: tuple[int, int]) -> None:
        self._write_index(lambda: batch.write(checkpoint))
        batch.publish()

    def _write_index(self, write: Callable[[], None]) -> None:
        try:
            write()
        except Exception as e:
            if isinstance(e, errors.IndexCorrupt) or index_mod.is_corruption(e):
                # Damage (found by a read inside the batch, or by the write): the rebuild that ``failed``
                # starts re-indexes the whole log, records of this round included. Writes fail meanwhile;
                # nothing is latched, so they resume when the rebuild is done.
                raise self._index.failed(e) from e
            # The log holds records the index lacks; offsets handed out from now on could collide. Stop
            # writing: a restart (or an index rebuild) re-indexes from the checkpoint.
            self._failed = f"{INDEX_WRITE_FAILED}: {e}"
            raise errors.StorageError(f"index write failed: {e}") from e

    def _flush_loop(self) -> None:
        interval = self._cfg.flush_interval_ms / 1000
        while not self._stop.wait(interval):
            try:
                self._log.sync()
            except OSError:
                log.exception("background fsync failed")

    # --- read helpers --------------------------------------------------------------------------------

    def _state(self, name: keys.QueueName) -> index_mod.QueueState | None:
        return self._states.get(name)

    def _check_open(self) -> None:
        if self._closed:
            raise errors.StorageError("store is closed")

    def _check_writable(self) -> None:
        if self._closed:
            raise errors.StorageError("store is closed")
        if self._failed is not None:
            raise errors.StorageError(f"store stopped accepting writes: {self._failed}")
        self._check_not_rebuilding()

    def _check_not_rebuilding(self) -> None:
        """Writes fail fast while the index is rebuilt (the rebuild holds the write lock for its duration)."""
        if self._rebuilding is not None:
            raise errors.StorageError(f"index rebuilding from the commit log: {self._rebuilding}")

    # --- control metadata ----------------------------------------------------------------------------

    def _put_meta(self, key: bytes, value: bytes) -> None:
        self._check_open()
        with self._write_lock:
            wb = self._meta.batch()
            wb.put(key, value)
            self._write_meta(wb)

    def _get_meta(self, key: bytes) -> bytes | None:
        self._check_open()
        with self._meta_lock:
            return self._meta.get(key)

    def _delete_meta(self, key: bytes) -> bool:
        self._check_open()
        with self._write_lock:
            if self._get_meta(key) is None:
                return False
            wb = self._meta.batch()
            wb.delete(key)
            self._write_meta(wb)
            return True

    def _list_meta(self, prefix: bytes) -> list[bytes]:
        self._check_open()
        with self._meta_lock:
            return [v for _, v in self._meta.prefix_items(prefix)]

    def _drop_consumer_state(self, names: Sequence[keys.QueueName]) -> None:
        """Delete the offsets, acked sets and consume times of deleted queues, before the index forgets the
        queues: a crash in between replays the tombstone, which drops them again (idempotent). The acked-key
        set changes only once the write has succeeded."""
        wb = self._meta.batch()
        gone: list[bytes] = []
        with self._meta_lock:
            cursor = self._meta.raw_iter(keys.ACKED, keys.successor(keys.OFFSET))  # A < C < O: one iterator
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
        self._write_meta(wb)
        with self._meta_lock:
            self._acked_keys.difference_update(gone)

    def _write_meta(
        self, wb: rocksdict.WriteBatch, *, note: tuple[bytes, bool] | None = None, wait: bool = True
    ) -> bool:
        """Write to the meta store; with ``note``, then add or remove that acked key in the set. False only when
        ``wait`` is False and another thread holds the meta lock. After a failure (a full disk) ``health``
        reports it and writes fail fast, never blocking on a reopen (a caller may be the event loop): the
        meta retrier thread reopens the meta store, which RocksDB needs to clear a write error, and probes it
        every META_RETRY_S; writes resume once space is back."""
        if not self._meta_lock.acquire(blocking=wait):
            return False
        try:
            if self._meta_error is not None:
                raise errors.StorageError(f"meta store cannot write: {self._meta_error}")
            try:
                self._meta.write(wb)
            except Exception as e:  # rocksdict raises bare Exception with RocksDB's status text
                log.error("meta store write failed: %s; acks and metadata changes fail until it can write", e)
                self._meta_error = str(e)
                self._start_meta_retrier()
                raise errors.StorageError(f"meta store write failed: {e}") from e
            if note is not None:
                if note[1]:
                    self._acked_keys.add(note[0])
                else:
                    self._acked_keys.discard(note[0])
            return True
        finally:
            self._meta_lock.release()

    def _start_meta_retrier(self) -> None:
        """(Under the meta lock.) Start the thread that brings the meta store back, unless it runs."""
        if self._meta_retrier is None or not self._meta_retrier.is_alive():
            self._meta_retrier = threading.Thread(target=self._retry_meta, name="lmq-meta-retry", daemon=True)
            self._meta_retrier.start()

    def _retry_meta(self) -> None:
        """Every META_RETRY_S until the meta store writes again: reopen it (read-write; read-only if that
        fails, so offsets and metadata stay readable) and write a probe key."""
        path = self._cfg.data_dir / "meta"
        while not self._stop.wait(META_RETRY_S):
            with self._meta_lock:
                if self._closed:
                    return
                with contextlib.suppress(Exception):  # closing flushes, which fails the same way
                    self._meta.close()
                try:
                    self._meta = _open_meta(path)
                except errors.StorageError as e:
                    self._meta_error = e.message
                    try:
                        self._meta = index_mod.Index(path, META_CACHE_BYTES, read_only=True)
                    except errors.StorageError:
                        log.exception("meta store cannot be opened, even read-only")
                    continue
                try:
                    wb = self._meta.batch()
                    wb.put(keys.META_PROBE_KEY, keys.U64.pack(self._clock()))
                    self._meta.write(wb)
                except Exception as e:
                    self._meta_error = str(e)
                    continue
                log.warning("meta store writes again (after: %s)", self._meta_error)
                self._meta_error = None
                return

    def _move_primary_keys(self) -> None:
        """An index written before ``meta`` existed holds offsets and control metadata: move them, once."""
        moved = 0
        for prefix in keys.PRIMARY_PREFIXES:
            wb = self._meta.batch()
            for key, value in self._index.prefix_items(prefix):
                wb.put(key, value)
                moved += 1
            if len(wb):
                self._meta.write(wb)
                gone = self._index.batch()
                gone.delete_range(prefix, keys.successor(prefix))
                self._index.write(gone)
        if moved:
            log.info("moved %d offset and metadata keys from the index to the meta store", moved)

    # --- retention -----------------------------------------------------------------------------------

    def _retention_victims(self, now: int) -> list[int]:
        """Oldest closed segments past the age or size limit; always a prefix of the log, never the active one."""
        max_age = self._cfg.retention_max_age_ms
        max_bytes = self._cfg.retention_max_bytes
        total = self._log.total_bytes()
        victims: list[int] = []
        for seq in self._log.seqs():
            if seq == self._log.active.seq:
                break
            last_store = self._segtab.get(seq, [0, 0])[1]
            too_old = max_age >= 0 and last_store + max_age < now
            too_big = max_bytes >= 0 and total > max_bytes
            if not (too_old or too_big):
                break
            victims.append(seq)
            total -= self._log.size_of(seq)
        return victims

    def _drop_segment(self, seq: int) -> set[bytes]:
        """Advance the min offset of every queue with entries in ``seq``; returns those that advanced."""
        queues: set[tuple[str, int]] = set()
        try:
            for frame in self._log.scan_segment(seq):
                if frame.kind == codec.KIND_MESSAGE:
                    queues.update(frame.queues)
        except errors.CorruptRecord:
            log.exception("retention: corrupt record in segment %d; queues after it keep stale entries", seq)
        advanced: set[bytes] = set()
        todo = sorted(queues)
        for i in range(0, len(todo), RETENTION_BATCH_QUEUES):
            with self._write_lock:
                self._check_writable()
                wb = self._index.batch()
                updates: list[tuple[index_mod.QueueState, int]] = []
                for topic, qid in todo[i : i + RETENTION_BATCH_QUEUES]:
                    try:
                        name = self._resolve(topic, qid)
                    except errors.InvalidArgument:
                        continue
                    st = self._state(name)
                    if st is None:
                        continue  # deleted since (a reclaimed lite topic)
                    new_min = st.next
                    for first, rseg, _ in self._index.runs(name):
                        if rseg > seq:
                            new_min = first
                            break
                        # point deletes, not a range: range tombstones pile up and slow every later read
                        wb.delete(keys.entry_key(name.qkey, first))
                    new_min = max(new_min, st.min)
                    if new_min > st.min:
                        wb.put(name.state_key, _value(st, min_=new_min))
                        updates.append((st, new_min))
                self._write_index(lambda: self._index.write(wb))  # noqa: B023 - called at once
                for st, new_min in updates:
                    st.min = new_min
                    advanced.add(st.name.qkey)
        return advanced

    # --- index damage ------------------------------------------------------------------------------

    def _open_index(self) -> index_mod.Index:
        """Open the index; a damaged one (CURRENT, MANIFEST, a table file) is set aside and rebuilt."""
        path = self._cfg.data_dir / "index"
        try:
            index = index_mod.Index(path, self._cfg.index_cache_bytes)
        except errors.IndexCorrupt as e:
            log.error("the index is damaged (%s); it is a cache of the commit log: rebuilding it", e.message)
            _set_aside(path)
            self.index_rebuilds += 1
            index = index_mod.Index(path, self._cfg.index_cache_bytes)
        return index

    def _replace_index(self) -> None:
        """Set the damaged index aside and start an empty one (the caller then replays the log into it)."""
        with contextlib.suppress(Exception):  # a damaged index may fail its final flush
            self._index.close()
        _set_aside(self._index.path)
        deadline = time.monotonic() + INDEX_RELEASE_S
        while True:
            try:
                self._index = self._open_index()
                break
            except errors.StorageError as e:
                # RocksDB frees the old instance (and the LOCK path it holds in this process) only when the
                # last iterator of it is gone: a reader that just hit the damage may still hold one.
                if "lock" not in e.message.lower() or time.monotonic() > deadline:
                    raise
                gc.collect()
                time.sleep(0.05)
        self.index_rebuilds += 1
        self._states = index_mod.StateCache(self._index, self._state_cache_entries)
        self._segtab = {}

    def _index_corrupt(self, error: errors.IndexCorrupt) -> None:
        """A read found a damaged index block: rebuild the index from the log in the background. Meanwhile
        reads find nothing, writes are refused and ``health`` (readiness) says why."""
        with self._queue_lock:
            if self._rebuilding is not None or self._closed:
                return
            self._rebuilding = error.message
        log.error("index read failed: %s; rebuilding the index from the commit log", error.message)
        self._rebuilder = threading.Thread(target=self._rebuild_index, name="lmq-index-rebuild", daemon=True)
        self._rebuilder.start()

    def _rebuild_index(self) -> None:
        try:
            with self._write_lock:
                if self._closed:
                    return
                self._replace_index()
                rebuilt, count, _ = self._recover()
                self._index.on_corruption = self._index_corrupt
                if self._failed is not None and self._failed.startswith(INDEX_WRITE_FAILED):
                    self._failed = None  # the whole log is indexed again: offsets cannot collide
            log.warning("index rebuilt from the commit log: %d records re-indexed (full: %s)", count, rebuilt)
        except Exception as e:
            log.exception("index rebuild failed; the store stops taking writes (restart to retry)")
            self._failed = f"index rebuild failed: {e}"
            self._unreadable = self._failed  # the new index is partial: a read could report live offsets as gone
        finally:
            self._rebuilding = None

    # --- recovery ------------------------------------------------------------------------------------

    def _recover(self) -> tuple[bool, int, int]:
        """Bring the index up to the log. Returns (rebuilt, records re-indexed, torn bytes truncated).

        Missing segment files are reported (with the index entries they take with them) and forgotten; a bad
        record with good ones after it is quarantined; only a bad tail of the last segment is cut. Afterwards,
        if the log lost anything, queues are reconciled with what groups have committed or acked, so that no
        offset at or below one of those is ever handed out again."""
        seqs = self._log.seqs()
        self._reconciled = 0
        lost = self._check_continuity(seqs)
        cp = self._index.checkpoint()
        rebuild = cp is None or cp[0] not in seqs or cp[1] > self._log.size_of(cp[0])
        if rebuild:
            if cp is not None:
                log.warning("index checkpoint %s is past the commit log; rebuilding the index", cp)
            self._index.clear_derived()
            self._segtab = {}
            start = (seqs[0], 0)
        else:
            assert cp is not None
            start = cp
        quarantined = self.damage.total("quarantined")
        count, truncated = self._replay(start, seqs[-1], rebuild)
        if rebuild:
            self._restore_consume_times()
        # In async mode log, index and meta reach the disk separately: after a power cut meta may hold offsets
        # past a log that lost its unsynced end at a clean record boundary (nothing torn, nothing to see). Only
        # a clean close (its marker, synced after the log and the index) vouches that nothing was lost, or a
        # session that ran in sync mode throughout (its index, hence every delivery, followed the fsync).
        damaged = truncated or lost or self.damage.total("quarantined") > quarantined
        if rebuild or damaged or not (self._clean_open or self._synced_before):
            self._reconciled = self._reconcile_offsets()
        return rebuild, count, truncated

    def _check_continuity(self, seqs: list[int]) -> int:
        """Segments the index knows of (or between the first and the last file) whose file is gone: report
        the index entries lost with them, drop those entries, return how many. Retention removes a segment
        from the index before it unlinks it, so a known segment without its file was lost, not retired."""
        present = set(seqs)
        missing = sorted((set(range(seqs[0], seqs[-1] + 1)) | set(self._segtab)) - present)
        if not missing:
            return 0
        gone = set(missing)
        lost: dict[bytes, int] = {}
        wb = self._index.batch()
        for key, value in self._index.prefix_items(keys.ENTRY):
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
            self._segtab.pop(seg, None)
        self._write_index(lambda: self._index.write(wb))
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
        self.damage.report("lost", f"segments {missing} missing: {total} messages of {len(lost)} queues", total)
        return total or len(missing)

    def _replay(self, start: tuple[int, int], last_seq: int, rebuilding: bool) -> tuple[int, int]:
        """Re-index every record from ``start``; batches of REPLAY_BATCH_RECORDS, each with its checkpoint."""
        batch = self._batch()
        end = start
        count = 0
        pack_entry = keys.RUN_ENTRY.pack
        at = start
        while True:
            try:
                for seq, f in self._log.scan(*at):
                    try:  # every name first: a record is indexed whole or not at all (the except writes the batch)
                        names = [self._resolve(topic, qid) for topic, qid in f.queues]
                    except errors.InvalidArgument as e:
                        raise errors.CorruptRecord(
                            f"record names an invalid queue: {e.message}", segment=seq, position=f.position
                        ) from e
                    if f.kind == codec.KIND_TOMBSTONE:
                        self._write_batch(batch, end)  # what precedes the deletion, then the deletion alone
                        batch = self._batch()
                        self._replay_tombstone(batch, f, seq, rebuilding)
                    else:
                        entry = pack_entry(f.position, f.size)
                        for name, off in zip(names, f.offsets, strict=True):
                            batch.replayed(name, seq, f.store_ms, off).replay(off, seq, f.store_ms, entry)
                    batch.touch_segment(seq, f.store_ms)
                    end = (seq, f.position + f.size)
                    count += 1
                    if count % REPLAY_BATCH_RECORDS == 0 or f.kind == codec.KIND_TOMBSTONE:
                        self._write_batch(batch, end)
                        batch = self._batch()
                self._write_batch(batch, end)
                return count, 0
            except errors.CorruptRecord as e:
                bad_seq, bad_pos = e.fields.get("segment"), e.fields.get("position")
                if not isinstance(bad_seq, int) or not isinstance(bad_pos, int):
                    raise
                self._write_batch(batch, end)
                batch = self._batch()
                resume = self._log.resync(bad_seq, bad_pos)
                if resume is None and bad_seq == last_seq:  # nothing good follows: a torn tail
                    truncated = self._log.size_of(bad_seq) - bad_pos
                    self._quarantine(bad_seq, bad_pos, truncated, f"torn tail: {e.message}", kind="")
                    log.warning(
                        "recovery: torn record at segment %d position %d, %d bytes cut", bad_seq, bad_pos, truncated
                    )
                    self._log.rollback(bad_seq, bad_pos)
                    self._write_batch(batch, (bad_seq, bad_pos))
                    return count, truncated
                stop = self._log.size_of(bad_seq) if resume is None else resume
                self._quarantine(bad_seq, bad_pos, stop - bad_pos, e.message, kind="quarantined")
                # Good records follow (or the segment is not the last): skip the bad bytes, keep the rest.
                if resume is not None:
                    at = end = (bad_seq, resume)
                else:  # the rest of a closed segment: go on with the next one, and checkpoint there, so the
                    # bad end is not quarantined (and counted) again at every open
                    later = [s for s in self._log.seqs() if s > bad_seq]
                    at = (later[0], 0) if later else (bad_seq + 1, 0)
                    if later:
                        end = at

    def _quarantine(self, seq: int, position: int, size: int, why: str, *, kind: str) -> None:
        """Copy skipped or cut bytes of the log to ``quarantine/`` (at most QUARANTINE_COPY_BYTES each) and,
        for ``kind``, report them as damage."""
        directory = self._cfg.data_dir / "quarantine"
        name = f"{seq:010d}-{position:010d}.bin"
        try:
            directory.mkdir(exist_ok=True)
            data = self._log.read(seq, position, min(size, QUARANTINE_COPY_BYTES), exact=False)
            (directory / name).write_bytes(data or b"")
        except OSError as e:
            log.warning("could not copy %d bytes at segment %d position %d to quarantine: %s", size, seq, position, e)
        if kind:
            self.damage.report(
                kind,
                f"segment {seq} position {position}: {size} bytes skipped ({why}); a copy is in "
                f"{directory / name}; the records after it are kept",
            )

    def _reconcile_offsets(self) -> int:
        """After the log lost records: raise each queue's next offset above every offset a group committed or
        acked, so a new message never takes an offset a group has already passed (it would never be
        delivered). Returns how many queues moved."""
        moved: set[bytes] = set()  # a queue can move in both walks (O, then A)
        batch = self._batch()
        now = self._clock()
        get = self._index.get
        for qkey, floor in self._consumed_floors():
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
                name = self._resolve(*keys.split_qkey(qkey))
            except errors.InvalidArgument:
                continue
            if pd is None:
                st = self._state(name)
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
                self._write_batch(batch, (self._log.active.seq, self._log.active.size))
                batch = self._batch()
        self._write_batch(batch, (self._log.active.seq, self._log.active.size))
        return len(moved)

    def _consumed_floors(self) -> Iterator[tuple[bytes, int]]:
        """(qkey, the lowest offset no group has passed) per queue with committed or acked offsets: one walk of
        the ``O`` keys, then of the ``A`` keys (both in qkey order, so nothing per queue is held)."""
        for prefix in (keys.OFFSET, keys.ACKED):
            current, floor = b"", 0
            for key, value in self._meta.prefix_items(prefix):
                qkey, _ = keys.split_group_key(key)
                if prefix == keys.OFFSET:
                    at = keys.U64.unpack_from(value)[0]
                else:
                    committed, acked = keys.decode_acked(value)
                    at = (acked[-1] if acked else committed) + 1  # ascending ranges: no walk
                if qkey != current:
                    if current:
                        yield current, floor
                    current, floor = qkey, at
                elif at > floor:
                    floor = at
            if current:
                yield current, floor

    def _replay_tombstone(self, batch: index_mod.Batch, f: codec.Frame, seq: int, rebuilding: bool) -> None:
        topic, qid = f.queues[0]
        name = self._resolve(topic, qid)
        if self._state(name) is not None:
            if not rebuilding:
                # A crash came between the tombstone and the index batch. In a rebuild, the meta store already
                # saw the deletion, and offsets of a later topic of the same name must stay.
                self._drop_consumer_state([name])
            batch.delete_queue(name)
            if name.parent is not None:
                batch.count(name.parent, -1)

    def _restore_consume_times(self) -> None:
        """After a rebuild: the lite topics' last consume times come back from the meta store."""
        wb = self._index.batch()
        lo = keys.CONSUMED
        for key, value in self._meta.items(lo, keys.successor(lo)):
            topic, qid = keys.split_qkey(key[len(lo) :])
            try:
                name = self._resolve(topic, qid)
            except errors.InvalidArgument:
                continue
            st = self._state(name)
            if st is None or name.parent is None:
                continue
            st.last_consume = keys.U64.unpack(value)[0]
            wb.put(name.state_key, _value(st))
            if len(wb) >= REPLAY_BATCH_RECORDS:
                self._index.write(wb)
                wb = self._index.batch()
        self._index.write(wb)


def _set_aside(path: Path) -> None:
    """Move a damaged index to ``index.damaged`` (one copy kept, for a post-mortem) so a new one can start."""
    aside = path.with_name(path.name + ".damaged")
    shutil.rmtree(aside, ignore_errors=True)
    if path.exists():
        os.rename(path, aside)


def _open_meta(path: Path) -> index_mod.Index:
    """The meta store holds what no log can recreate: damage to it stops the broker with a repair path."""
    try:
        return index_mod.Index(path, META_CACHE_BYTES)
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


def open_store(cfg: config.StoreConfig, clock: Clock = wall_clock_ms) -> LmqStore:
    """Open (creating, recovering or rebuilding as needed) the store under ``cfg.data_dir``."""
    return LmqStore(cfg, clock)


# --- helpers -----------------------------------------------------------------------------------------


def _value(st: index_mod.QueueState, *, min_: int | None = None, last_consume: int | None = None) -> bytes:
    return st.value(
        min_=st.min if min_ is None else min_,
        next_=st.next,
        created=st.created,
        last_store=st.last_store,
        last_consume=st.last_consume if last_consume is None else last_consume,
    )


def _scan_bound(bound: str, parent: str | None) -> bytes:
    """A scan bound as key bytes: a lite name within ``parent``, or ``parent$lite`` across parents."""
    return bound.encode() if parent is not None else bound.replace(model.LMQ_SEPARATOR, "\x00").encode()


def _check_group(group: str) -> None:
    if not model.is_valid_resource_name(group):
        raise errors.InvalidName(f"invalid group name {group!r}", group=group)


def _check_resource(name: str) -> None:
    if not model.is_valid_resource_name(name):
        raise errors.InvalidName(f"invalid name {name!r}", name=name)


def _check_scope(scope: str) -> None:
    if not scope or len(scope.encode()) > model.MAX_RESOURCE_NAME_BYTES * 2 or "\x00" in scope:
        raise errors.InvalidName(f"invalid quota scope {scope!r}", scope=scope)


def iter_records(cfg: config.StoreConfig) -> Iterator[tuple[int, codec.Frame]]:
    """Every record header of the log under ``cfg.data_dir`` (a debugging aid; the store must be closed)."""
    lg = commitlog.CommitLog(cfg.data_dir / "commitlog", cfg.segment_max_bytes)
    try:
        yield from lg.scan(lg.seqs()[0], 0)
    finally:
        lg.close()
