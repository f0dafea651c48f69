"""LmqStore: the commit log (truth) + the RocksDB index (cache) + the meta store, behind ``api.Store``.

Opening composes the parts around one ``core.Core`` and recovers before anything is served: ``appends``
(the write rounds: group commit, fsync, index), ``reads`` (what a reader is shown), ``meta`` (consumer
offsets and control-plane records, in their own RocksDB), ``retention`` and ``recovery`` (at open, and a
rebuild of a damaged index while serving). What stays here is what spans the parts: committing an offset
(meta, and an LMQ's last consume time in the index) and deleting lite topics (a tombstone in the log, their
consumer state in meta, their keys in the index), and the order of a close.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Final

from lmq_broker import config, errors, model
from lmq_broker.storage import (
    api,
    appends,
    codec,
    commitlog,
    healing,
    keys,
    meta,
    reads,
    recovery,
    retention,
    snapshots,
    truncation,
)
from lmq_broker.storage import core as core_mod
from lmq_broker.storage import index as index_mod
from lmq_broker.storage.markers import RESTORE_MARKER, RESTORED_ID

log = logging.getLogger(__name__)

STATE_CACHE_ENTRIES: Final = 16_384  # ~250 B each: hot queues only, a miss is one RocksDB get
SCAN_LIMIT_MAX: Final = 100_000


class LmqStore:
    """The store of one broker: see the module docstring; implements ``api.Store``."""

    def __init__(
        self,
        cfg: config.StoreConfig,
        clock: api.Clock = api.wall_clock_ms,
        state_cache_entries: int = STATE_CACHE_ENTRIES,
    ) -> None:
        started = time.perf_counter()
        check_restored(cfg.data_dir)
        self._data_dir = cfg.data_dir
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        log_ = commitlog.CommitLog(cfg.data_dir / "commitlog", cfg.segment_max_bytes)
        try:
            # Two RocksDB instances: ``index`` holds only what the log can recreate (a cache: delete it and it is
            # rebuilt); ``meta`` holds what only the broker knows (consumer offsets, topics, groups, quotas).
            self._meta = meta.Meta(cfg.data_dir / "meta", clock)
            try:
                self._core = core = core_mod.Core(cfg, clock, log_, self._meta, state_cache_entries)
            except BaseException:
                self._meta.close()
                raise
        except BaseException:
            log_.close()
            raise
        self._rebuilder = recovery.Rebuilder(core)
        try:
            self.recovery = recovery.at_open(core, started, self._rebuilder.index_corrupt)
        except BaseException:
            with contextlib.suppress(Exception):
                core.index.close()
            self._meta.close()
            log_.close()
            raise
        self.damage = core.damage
        self._healer = healing.Healer(core, self._rebuilder.index_corrupt)
        core.on_fault = self._healer.start
        self._retention = retention.Retention(core)
        self._appender = appends.Appender(core)

    # --- introspection (tests, benchmarks) -----------------------------------------------------------

    @property
    def fsync_count(self) -> int:
        return self._core.log.fsyncs

    @property
    def cached_states(self) -> int:
        return len(self._core.states)

    @property
    def index_rebuilds(self) -> int:
        return self._core.generation - self._core.index_reopens  # a reopen replaces the handle, not the content

    def index_generation(self) -> int:
        return self._core.generation

    def health(self) -> str | None:
        """None while the store serves reads and writes; else why not (the broker's readiness probe). Cheap and
        without side effects: it may be called on an event loop."""
        return self._core.health()

    def fatal(self) -> str | None:
        """Why the store cannot recover without a restart (the broker's liveness probe), or None; cheap."""
        return self._core.fatal()

    def faults(self) -> api.FaultStats:
        """Storage faults so far and whether the log can be made durable now (the metrics)."""
        core = self._core
        return api.FaultStats(
            fsync_failures=core.fsync_failures,
            durable=core.undurable is None,
            index_writable=core.index_error is None,
            index_reopens=core.index_reopens,
            refused=dict(core.refused),
        )

    def wait_rebuilt(self, timeout: float | None = None) -> bool:
        """Wait for a running index rebuild (tests); True when none is running."""
        return self._rebuilder.wait(timeout)

    def drop_caches(self) -> None:
        """Forget every cached queue state and name (they are reloaded from the index on demand)."""
        core = self._core
        with core.write_lock:
            core.states.clear()
            core.names.clear()

    # --- messages ------------------------------------------------------------------------------------

    def append(self, messages: Sequence[model.NewMessage]) -> list[model.AppendResult]:
        return self._appender.append(messages)

    def try_begin(self, requests: Sequence[Sequence[model.NewMessage]]) -> api.PendingAppend | None:
        return self._appender.try_begin(requests)

    def read(self, queue: model.QueueId, offset: int, max_count: int) -> list[model.StoredMessage]:
        return reads.read_span(self._core, queue, offset, max_count)[0]

    def read_span(self, queue: model.QueueId, offset: int, max_count: int) -> tuple[list[model.StoredMessage], int]:
        return reads.read_span(self._core, queue, offset, max_count)

    def queue_offsets(self, queue: model.QueueId) -> tuple[int, int]:
        core = self._core
        core.check_open()
        st = core.state(core.resolve(queue.topic, queue.queue))
        return (0, 0) if st is None else (st.min, st.next)

    def truncate_queue(self, queue: model.QueueId, end: int) -> int:
        core = self._core
        core.check_open()
        return truncation.truncate(core, self._meta, core.resolve(queue.topic, queue.queue), end)

    # --- consumer offsets ----------------------------------------------------------------------------

    def commit_offset(
        self,
        queue: model.QueueId,
        group: str,
        offset: int,
        acked: Sequence[int] = (),
        handouts: model.Handouts = model.NO_HANDOUTS,
    ) -> None:
        self._commit_offset(queue, group, offset, acked, handouts, wait=True)

    def commit_offsets(
        self, rows: Sequence[tuple[model.QueueId, str, int]], *, capped: bool = False
    ) -> list[tuple[model.QueueId, str, int]]:
        core = self._core
        core.check_open()
        names = [core.resolve(queue.topic, queue.queue) for queue, _, _ in rows]
        for _, group, offset in rows:
            api.check_group(group)
            if offset < 0:
                raise errors.InvalidArgument("offset must be >= 0", offset=offset)
        if core.rebuilding is not None or core.unreadable is not None:  # meta/ only: as ``commit_offset`` does
            written = [(q, g, min(o, self.queue_offsets(q)[1]) if capped else o) for q, g, o in rows]
            for queue, group, offset in written:
                self.commit_offset(queue, group, offset)
            return written
        with core.write_lock:
            core.check_open()
            now = core.clock()
            commits: list[tuple[bytes, str, int]] = []
            states: list[tuple[keys.QueueName, index_mod.QueueState]] = []
            written = []
            for name, (queue, group, asked) in zip(names, rows, strict=True):
                st = core.state(name) if name.is_lmq or capped else None
                if name.is_lmq and st is None:
                    continue  # the lite topic is gone (reclaimed): its offsets must not come back
                offset = (0 if st is None else min(asked, st.next)) if capped else asked
                commits.append((name.qkey, group, offset))
                written.append((queue, group, offset))
                if st is not None and name.is_lmq:
                    states.append((name, st))
            self._meta.write_offsets(commits, [keys.consumed_key(name.qkey) for name, _ in states], now)
            self._note_consumed(states, now)
        return written

    def _note_consumed(self, states: Sequence[tuple[keys.QueueName, index_mod.QueueState]], now: int) -> None:
        """(Under the write lock.) The last consume time of lite topics, in the index (one write)."""
        core = self._core
        if not states or core.failed is not None or core.index_error is not None:
            return
        batch = core.index.batch()
        for name, st in states:
            batch.put(name.state_key, st.value(last_consume=now))
        try:
            core.index.write(batch)
        except Exception as e:  # the commits are in meta/; a rebuild restores the times from there
            log.warning("could not record the last consume time of %d lite topics in the index: %s", len(states), e)
            return
        for _, st in states:
            st.last_consume = now

    def try_commit_offset(
        self,
        queue: model.QueueId,
        group: str,
        offset: int,
        acked: Sequence[int] = (),
        handouts: model.Handouts = model.NO_HANDOUTS,
    ) -> bool:
        return self._commit_offset(queue, group, offset, acked, handouts, wait=False)

    def _commit_offset(
        self,
        queue: model.QueueId,
        group: str,
        offset: int,
        acked: Sequence[int],
        handouts: model.Handouts,
        *,
        wait: bool,
    ) -> bool:
        """False (nothing written) only when ``wait`` is False and another writer holds the write lock."""
        core = self._core
        core.check_open()
        name = core.resolve(queue.topic, queue.queue)
        api.check_group(group)
        if offset < 0:
            raise errors.InvalidArgument("offset must be >= 0", offset=offset)
        if acked and acked[0] <= offset:  # ascending (an OffsetRanges: min() would walk every offset)
            raise errors.InvalidArgument("acked offsets lie above the committed offset", offset=offset)
        handouts = keys.checked_handouts(offset, handouts)
        wb, note = self._meta.offsets_batch(name.qkey, group, offset, acked, handouts)
        if core.rebuilding is not None or core.unreadable is not None:
            # Only meta/ is written: an ack must not wait for (or fail on) a rebuild of the index, which holds
            # the write lock for its duration. The lite topic's state cannot be read meanwhile, so its last
            # consume time goes to meta/ only (the rebuild copies it into the index when it ends).
            if name.is_lmq:
                wb.put(keys.consumed_key(name.qkey), keys.U64.pack(core.clock()))
            return self._meta.write(wb, note=note, wait=wait)
        if not core.write_lock.acquire(blocking=wait):
            return False
        try:
            core.check_open()
            if not name.is_lmq:
                return self._meta.write(wb, note=note)
            st = core.state(name)
            if st is None:
                return True  # the lite topic is gone (reclaimed): a late ack must not resurrect its offsets
            now = core.clock()
            wb.put(keys.consumed_key(name.qkey), keys.U64.pack(now))  # survives a rebuilt index
            self._meta.write(wb, note=note)
            if core.failed is None and core.index_error is None:
                index = core.index
                state = index.batch()
                state.put(name.state_key, st.value(last_consume=now))
                try:
                    index.write(state)
                except Exception as e:  # the commit is in meta/; a rebuild restores the time from there
                    log.warning("could not record the last consume time of %s in the index: %s", name.topic, e)
                    return True
                st.last_consume = now
            return True
        finally:
            core.write_lock.release()

    def get_offset(self, queue: model.QueueId, group: str) -> int | None:
        self._core.check_open()
        return self._meta.offset(self._core.resolve(queue.topic, queue.queue).qkey, group)

    def get_acked(self, queue: model.QueueId, group: str) -> Sequence[int]:
        self._core.check_open()
        return self._meta.acked(self._core.resolve(queue.topic, queue.queue).qkey, group)

    def get_handouts(self, queue: model.QueueId, group: str) -> model.Handouts:
        self._core.check_open()
        return self._meta.handouts(self._core.resolve(queue.topic, queue.queue).qkey, group)

    def commit_points(self, queue: model.QueueId) -> dict[str, int]:
        core = self._core
        core.check_open()
        return self._meta.commit_points(core.resolve(queue.topic, queue.queue).qkey)

    # --- queues that are not lite topics ---------------------------------------------------------------

    def normal_queues(self, start_after: model.QueueId | None = None, limit: int = 1000) -> list[model.QueueId]:
        core = self._core
        core.check_open()
        lo = keys.STATE if start_after is None else keys.successor(core.resolve(*start_after).state_key)
        found = core.index.items(lo, keys.successor(keys.STATE), max(0, limit))
        return [keys.queue_of_qkey(key[1:]) for key, _ in found]

    def relocated(self, queue: model.QueueId) -> int:
        core = self._core
        core.check_open()
        value = self._meta.get(keys.RELOCATED + core.resolve(queue.topic, queue.queue).qkey)
        return 0 if value is None else int(keys.U64.unpack(value)[0])

    def put_relocated(self, queue: model.QueueId, end: int) -> None:
        core = self._core
        core.check_open()
        self._meta.put_u64(keys.RELOCATED + core.resolve(queue.topic, queue.queue).qkey, end)

    def store_id(self) -> str:
        self._core.check_open()
        known = self._meta.text(keys.STORE_ID_KEY)
        if known is None:
            known = uuid.uuid4().hex
            self._meta.put_text(keys.STORE_ID_KEY, known)
        restored = self._data_dir / RESTORED_ID
        if restored.exists():  # restored from a backup: its offsets may be numbered again (``markers``)
            known += "." + restored.read_text().strip()
        return known

    def relocated_from(self, source: str, queue: model.QueueId) -> int:
        self._core.check_open()
        value = self._meta.get(keys.relocated_from(source, queue))
        return 0 if value is None else int(keys.U64.unpack(value)[0])

    def put_relocated_from(self, source: str, queue: model.QueueId, end: int) -> None:
        self._core.check_open()
        self._meta.put_u64(keys.relocated_from(source, queue), end)

    # --- lite topics ---------------------------------------------------------------------------------

    def lite_topic(self, parent: str, lite: str) -> model.LiteTopicMeta | None:
        core = self._core
        core.check_open()
        st = core.state(core.resolve(keys.lmq_topic(parent, lite), 0))
        return None if st is None else st.meta()

    def lite_topic_count(self, parent: str | None = None) -> int:
        self._core.check_open()
        return self._core.index.get_u64(keys.count_key(parent)) or 0

    def scan_lite_topics(
        self,
        parent: str | None = None,
        start_after: str = "",
        end_before: str = "",
        limit: int = 1000,
        idle_since_before_ms: int = 0,
    ) -> list[model.LiteTopicMeta]:
        self._core.check_open()
        prefix = keys.lite_prefix(parent)
        lo = prefix + _scan_bound(start_after, parent)
        hi = prefix + _scan_bound(end_before, parent) if end_before else keys.successor(prefix)
        limit = max(0, min(limit, SCAN_LIMIT_MAX))
        if limit == 0:
            return []
        return self._core.index.lite_topics(lo, hi, limit, idle_since_before_ms)

    def lite_names(self, parent: str, start_after: str = "", limit: int = 1000) -> list[str]:
        self._core.check_open()
        prefix = keys.lite_prefix(parent)
        limit = max(0, min(limit, SCAN_LIMIT_MAX))
        if limit == 0:
            return []
        return self._core.index.lite_names(prefix, prefix + start_after.encode(), limit)

    def lite_names_held(self, parent: str, names: Sequence[str]) -> list[bool]:
        self._core.check_open()
        prefix = keys.lite_prefix(parent)
        return self._core.index.held([prefix + name.encode() for name in names])

    def delete_lite_topic(self, parent: str, lite: str, expected: model.LiteTopicMeta | None = None) -> bool:
        return self.delete_lite_topics([(parent, lite, expected)])[0]

    def delete_lite_topics(
        self,
        rows: Sequence[tuple[str, str, model.LiteTopicMeta | None]],
        keep: Callable[[], Collection[str]] | None = None,
    ) -> list[bool]:
        core = self._core
        core.check_open()
        # Parsed without the name cache: a reclaim names each of its (cold) topics once, and caching them would
        # only evict the hot names of live traffic. Their few parents are memoized there.
        parse, lmq_topic, valid_parent = keys.parse_queue, keys.lmq_topic, core.names.valid_parent
        names = [parse(lmq_topic(parent, lite), 0, valid_parent) for parent, lite, _ in rows]  # raise before writing
        done = [False] * len(rows)
        if not rows:
            return done
        # In key order, each seek below lands next to the previous one, in data blocks RocksDB has just read.
        order = sorted(range(len(rows)), key=[name.qkey for name in names].__getitem__)
        with core.write_lock:
            core.check_writable()
            kept = keep() if keep is not None else ()
            now = core.clock()
            victims: list[tuple[int, keys.QueueName, str]] = []
            records: list[bytes] = []
            seen: set[bytes] = set()
            # States come from the index through one iterator, not a get per topic (in key order a seek costs
            # less than a get on a large index). Under the write lock the index holds every published state.
            cursor = core.index.raw_iter(keys.LITE, keys.successor(keys.LITE))
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
            segments = core.write_records(records)
            self._meta.drop_consumer_state([name for _, name, _ in victims])
            batch = core.batch()
            for i, name, parent in victims:
                batch.delete_queue(name)
                batch.count(parent, -1)
                done[i] = True
            for seg in segments:
                batch.touch_segment(seg, now)
            core.write_batch(batch, core.log_end())
        return done

    # --- control-plane metadata (the meta store) -----------------------------------------------------

    def put_parent_topic(self, topic: model.ParentTopic) -> None:
        self._meta.put_record(meta.PARENT_TOPICS, topic)

    def get_parent_topic(self, name: str) -> model.ParentTopic | None:
        return self._meta.record(meta.PARENT_TOPICS, name)

    def delete_parent_topic(self, name: str) -> bool:
        return self._meta.delete_record(meta.PARENT_TOPICS, name)

    def list_parent_topics(self) -> list[model.ParentTopic]:
        return self._meta.records(meta.PARENT_TOPICS)

    def put_group(self, group: model.LiteGroup) -> None:
        self._meta.put_record(meta.GROUPS, group)

    def get_group(self, name: str) -> model.LiteGroup | None:
        return self._meta.record(meta.GROUPS, name)

    def delete_group(self, name: str) -> bool:
        return self._meta.delete_record(meta.GROUPS, name)

    def list_groups(self) -> list[model.LiteGroup]:
        return self._meta.records(meta.GROUPS)

    def put_quota(self, quota: model.Quota) -> None:
        self._meta.put_record(meta.QUOTAS, quota)

    def get_quota(self, scope: str) -> model.Quota | None:
        return self._meta.record(meta.QUOTAS, scope)

    def delete_quota(self, scope: str) -> bool:
        return self._meta.delete_record(meta.QUOTAS, scope)

    def list_quotas(self) -> list[model.Quota]:
        return self._meta.records(meta.QUOTAS)

    def put_reclaim_run(self, run: model.ReclaimRun) -> None:
        self._meta.put_record(meta.RECLAIM_RUNS, run)

    def get_reclaim_run(self, parent: str) -> model.ReclaimRun | None:
        return self._meta.record(meta.RECLAIM_RUNS, parent)

    def delete_reclaim_run(self, parent: str) -> bool:
        return self._meta.delete_record(meta.RECLAIM_RUNS, parent)

    def list_reclaim_runs(self) -> list[model.ReclaimRun]:
        return self._meta.records(meta.RECLAIM_RUNS)

    def put_membership(self, text: str) -> None:
        self._meta.put_text(keys.MEMBERSHIP_KEY, text)

    def get_membership(self) -> str | None:
        return self._meta.text(keys.MEMBERSHIP_KEY)

    def put_access(self, text: str) -> None:
        self._meta.put_text(keys.ACCESS_KEY, text)

    def get_access(self) -> str | None:
        return self._meta.text(keys.ACCESS_KEY)

    # --- maintenance ---------------------------------------------------------------------------------

    def apply_retention(self, stop: Callable[[], bool] | None = None) -> api.RetentionReport:
        return self._retention.apply(stop)

    def snapshot(self, staging: Path) -> snapshots.Snapshot:
        """Link and checkpoint the store into ``staging`` for a backup (``snapshots.take``)."""
        return snapshots.take(self._core, staging)

    def flush(self) -> None:
        core = self._core
        core.check_open()
        try:
            core.log.sync()
        except OSError as e:
            raise core.fsync_failed(e) from e  # writes pause until the healer's fsync succeeds
        core.index.flush()

    def close(self) -> None:
        core = self._core
        with core.write_lock:
            if core.closed:
                return
            core.closed = True
        self._appender.stop()
        self._healer.stop()
        self._meta.stop()
        with core.write_lock:
            clean = core.failed is None and core.unreadable is None and core.rebuilding is None
            clean = clean and core.index_error is None and core.undurable is None
            try:
                core.log.sync()
            except OSError:
                clean = False
            try:
                core.index.close()  # flushes its memtables: what it holds is on disk
            except Exception:
                clean = False
                log.exception("closing the index failed; the next open reconciles offsets")
            self._meta.close(clean=clean)  # the log and the index are on disk: nothing to reconcile next time
            core.log.close()
            core.states.clear()


def check_restored(data_dir: Path) -> None:
    """StorageError when ``data_dir`` holds a restore cut off midway (``RESTORE_MARKER``)."""
    if (data_dir / RESTORE_MARKER).exists():
        raise errors.StorageError(
            f"{data_dir} holds part of a restore that did not finish ({RESTORE_MARKER}): run the same "
            "`lmq-admin restore ... --force` again before starting the broker on it"
        )


def open_store(cfg: config.StoreConfig, clock: api.Clock = api.wall_clock_ms) -> LmqStore:
    """Open (creating, recovering or rebuilding as needed) the store under ``cfg.data_dir``."""
    return LmqStore(cfg, clock)


def iter_records(cfg: config.StoreConfig) -> Iterator[tuple[int, codec.Frame]]:
    """Every record header of the log under ``cfg.data_dir`` (a debugging aid; the store must be closed)."""
    lg = commitlog.CommitLog(cfg.data_dir / "commitlog", cfg.segment_max_bytes)
    try:
        yield from lg.scan(lg.seqs()[0], 0)
    finally:
        lg.close()


def _scan_bound(bound: str, parent: str | None) -> bytes:
    """A scan bound as key bytes: a lite name within ``parent``, or ``parent$lite`` across parents."""
    return bound.encode() if parent is not None else bound.replace(model.LMQ_SEPARATOR, "\x00").encode()
