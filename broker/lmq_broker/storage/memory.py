"""MemoryStore: the in-memory twin of LmqStore behind the same ``api.Store`` contract.

For the layers above in tests (fast, no files) and as the executable statement of the contract: the same
suite (tests/storage/test_contract.py) runs against both. Validation is shared (``codec.prepare``) so
both refuse exactly the same input. Retention drops whole records where LmqStore drops whole segments;
the contract only promises that min offsets advance past expired messages and never past live ones.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from lmq_broker import config, errors, model
from lmq_broker.storage import api, codec, keys, ranges


class ManualClock:
    """A ``Clock`` (milliseconds) that moves only when told: deterministic time for tests of any layer."""

    def __init__(self, now_ms: int = 1_700_000_000_000) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, ms: int) -> None:
        self.now_ms += ms


@dataclass(slots=True, eq=False)
class _Queue:
    name: keys.QueueName
    created: int
    last_store: int = 0
    last_consume: int = 0
    min: int = 0
    next: int = 0
    messages: dict[int, model.StoredMessage] = field(default_factory=dict)

    def meta(self) -> model.LiteTopicMeta:
        assert self.name.parent is not None and self.name.lite is not None
        return model.LiteTopicMeta(
            self.name.parent, self.name.lite, self.created, self.last_store, self.last_consume, self.min, self.next
        )


@dataclass(slots=True)
class _Record:
    store_ms: int
    size: int
    placed: list[tuple[_Queue, int]]


class _Done:
    """``MemoryStore.try_begin``'s answer: the appends are done already (memory needs no fsync)."""

    def __init__(self, outcomes: list[list[model.AppendResult] | BaseException]) -> None:
        self._outcomes = outcomes

    @property
    def needs_sync(self) -> bool:
        return False

    def sync(self) -> None:
        return None

    def finish(self, sync_error: BaseException | None = None) -> list[list[model.AppendResult] | BaseException]:
        return self._outcomes


class MemoryStore:
    def __init__(self, cfg: config.StoreConfig | None = None, clock: api.Clock = api.wall_clock_ms) -> None:
        self._cfg = cfg or config.StoreConfig()
        self._clock = clock
        self._max_record = min(self._cfg.max_record_bytes, self._cfg.segment_max_bytes)
        self._lock = threading.RLock()
        self._queues: dict[bytes, _Queue] = {}
        self._offsets: dict[bytes, dict[str, int]] = {}
        self._acked: dict[bytes, dict[str, ranges.OffsetRanges]] = {}
        self._handouts: dict[bytes, dict[str, model.Handouts]] = {}
        self._counts: dict[str, int] = {}
        self._parents: dict[str, model.ParentTopic] = {}
        self._groups: dict[str, model.LiteGroup] = {}
        self._quotas: dict[str, model.Quota] = {}
        self._reclaims: dict[str, model.ReclaimRun] = {}
        self._membership: str | None = None
        self._access: str | None = None
        self._relocated: dict[bytes, int] = {}
        self._relocated_from: dict[bytes, int] = {}
        self._store_id = uuid.uuid4().hex
        self._records: deque[_Record] = deque()
        self._bytes = 0
        self._names = keys.NameCache()
        self._closed = False

    # --- messages ------------------------------------------------------------------------------------

    def try_begin(self, requests: Sequence[Sequence[model.NewMessage]]) -> api.PendingAppend | None:
        self._check_open()
        now = self._clock()
        prepared: list[list[codec.Prepared] | BaseException] = []
        for messages in requests:
            try:
                prepared.append([codec.prepare(m, self._names, self._max_record, now) for m in messages])
            except errors.LmqError as e:
                prepared.append(e)
        if not self._lock.acquire(blocking=False):
            return None
        try:  # nothing to fsync: everything is done here, and ``finish`` hands it over
            return _Done([p if isinstance(p, BaseException) else self._place(p, now) for p in prepared])
        finally:
            self._lock.release()

    def append(self, messages: Sequence[model.NewMessage]) -> list[model.AppendResult]:
        self._check_open()
        now = self._clock()
        prepared = [codec.prepare(m, self._names, self._max_record, now) for m in messages]
        with self._lock:
            return self._place(prepared, now)

    def _place(self, prepared: list[codec.Prepared], now: int) -> list[model.AppendResult]:
        """Give each prepared message its offsets and keep it (the caller holds the lock)."""
        results: list[model.AppendResult] = []
        for p in prepared:
            m = p.message
            offsets: list[int] = []
            placed: list[tuple[_Queue, int]] = []
            for qid, name in zip(m.queues, p.queues, strict=True):
                q = self._queues.get(name.qkey)
                if q is None:
                    q = self._queues[name.qkey] = _Queue(name, created=now)
                    if name.parent is not None:
                        self._counts[name.parent] = self._counts.get(name.parent, 0) + 1
                off = q.next
                q.next += 1
                q.last_store = now
                q.messages[off] = model.StoredMessage.of(m, qid, off, now, dict(m.user_properties))
                offsets.append(off)
                placed.append((q, off))
            self._records.append(_Record(now, p.size, placed))
            self._bytes += p.size
            results.append(model.AppendResult(m.message_id, m.queues, tuple(offsets), now))
        return results

    def read(self, queue: model.QueueId, offset: int, max_count: int) -> list[model.StoredMessage]:
        return self.read_span(queue, offset, max_count)[0]

    def read_span(self, queue: model.QueueId, offset: int, max_count: int) -> tuple[list[model.StoredMessage], int]:
        self._check_open()
        name = keys.parse_queue(queue.topic, queue.queue)
        with self._lock:
            q = self._queues.get(name.qkey)
            if q is None or max_count <= 0:
                return [], offset
            out: list[model.StoredMessage] = []
            at = max(offset, q.min)
            while at < q.next and len(out) < max_count:
                m = q.messages.get(at)
                if m is not None:
                    out.append(m)
                at += 1
            return out, at

    def health(self) -> str | None:
        return "store is closed" if self._closed else None

    def fatal(self) -> str | None:
        return None  # nothing to break

    def index_generation(self) -> int:
        return 0  # nothing to rebuild

    def queue_offsets(self, queue: model.QueueId) -> tuple[int, int]:
        self._check_open()
        name = keys.parse_queue(queue.topic, queue.queue)
        with self._lock:
            q = self._queues.get(name.qkey)
            return (0, 0) if q is None else (q.min, q.next)

    def truncate_queue(self, queue: model.QueueId, end: int) -> int:
        self._check_open()
        if end < 0:
            raise errors.InvalidArgument("a queue is cut back to an offset >= 0", offset=end)
        name = keys.parse_queue(queue.topic, queue.queue)
        with self._lock:
            q = self._queues.get(name.qkey)
            if q is None or q.next <= end:
                return 0
            cut = q.next - max(end, q.min)
            for off in [o for o in q.messages if o >= end]:
                del q.messages[off]
            for record in self._records:  # retention must not take the offsets' next messages with these
                record.placed[:] = [(rq, off) for rq, off in record.placed if rq is not q or off < end]
            q.next, q.min = end, min(q.min, end)
            offsets = self._offsets.get(name.qkey, {})
            for group, at in list(offsets.items()):
                if at > end:
                    offsets[group] = end
                    self._acked.get(name.qkey, {}).pop(group, None)
                    self._handouts.get(name.qkey, {}).pop(group, None)
            for group, acked in list(self._acked.get(name.qkey, {}).items()):
                if acked and acked[-1] >= end:
                    del self._acked[name.qkey][group]
                    self._handouts.get(name.qkey, {}).pop(group, None)
            for group, handouts in list(self._handouts.get(name.qkey, {}).items()):
                if handouts.mark > end:
                    del self._handouts[name.qkey][group]
                    self._acked.get(name.qkey, {}).pop(group, None)
            return cut

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
        for _, group, offset in rows:  # a bad row: none written
            api.check_group(group)
            if offset < 0:
                raise errors.InvalidArgument("offset must be >= 0", offset=offset)
        written = []
        for queue, group, offset in rows:
            name = keys.parse_queue(queue.topic, queue.queue)
            with self._lock:
                gone = name.is_lmq and name.qkey not in self._queues
            if gone:
                continue  # the lite topic is gone (reclaimed): its offsets must not come back
            at = min(offset, self.queue_offsets(queue)[1]) if capped else offset
            self.commit_offset(queue, group, at)
            written.append((queue, group, at))
        return written

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
        self._check_open()
        name = keys.parse_queue(queue.topic, queue.queue)
        api.check_group(group)
        if offset < 0:
            raise errors.InvalidArgument("offset must be >= 0", offset=offset)
        acked = ranges.OffsetRanges.of(acked)  # as the store keeps them: runs, whatever their span
        if acked and acked[0] <= offset:
            raise errors.InvalidArgument("acked offsets lie above the committed offset", offset=offset)
        handouts = keys.checked_handouts(offset, handouts)
        if not self._lock.acquire(blocking=wait):
            return False
        try:
            if name.is_lmq:
                q = self._queues.get(name.qkey)
                if q is None:
                    return True
                q.last_consume = self._clock()
            self._offsets.setdefault(name.qkey, {})[group] = offset
            if acked:
                self._acked.setdefault(name.qkey, {})[group] = acked
            else:
                self._acked.get(name.qkey, {}).pop(group, None)
            if handouts.mark > offset:
                self._handouts.setdefault(name.qkey, {})[group] = handouts
            else:
                self._handouts.get(name.qkey, {}).pop(group, None)
            return True
        finally:
            self._lock.release()

    def get_offset(self, queue: model.QueueId, group: str) -> int | None:
        self._check_open()
        name = keys.parse_queue(queue.topic, queue.queue)
        with self._lock:
            return self._offsets.get(name.qkey, {}).get(group)

    def get_acked(self, queue: model.QueueId, group: str) -> Sequence[int]:
        self._check_open()
        name = keys.parse_queue(queue.topic, queue.queue)
        with self._lock:
            return self._acked.get(name.qkey, {}).get(group, ranges.EMPTY)

    def get_handouts(self, queue: model.QueueId, group: str) -> model.Handouts:
        self._check_open()
        name = keys.parse_queue(queue.topic, queue.queue)
        with self._lock:
            return self._handouts.get(name.qkey, {}).get(group, model.NO_HANDOUTS)

    # --- lite topics ---------------------------------------------------------------------------------

    def lite_topic(self, parent: str, lite: str) -> model.LiteTopicMeta | None:
        self._check_open()
        name = keys.parse_queue(keys.lmq_topic(parent, lite), 0)
        with self._lock:
            q = self._queues.get(name.qkey)
            return None if q is None else q.meta()

    def lite_topic_count(self, parent: str | None = None) -> int:
        self._check_open()
        with self._lock:
            return sum(self._counts.values()) if parent is None else self._counts.get(parent, 0)

    def scan_lite_topics(
        self,
        parent: str | None = None,
        start_after: str = "",
        end_before: str = "",
        limit: int = 1000,
        idle_since_before_ms: int = 0,
    ) -> list[model.LiteTopicMeta]:
        self._check_open()
        before = idle_since_before_ms
        with self._lock:
            metas = [q.meta() for q in self._queues.values() if q.name.is_lmq]
        if before > 0:
            metas = [m for m in metas if max(m.created_ms, m.last_store_ms, m.last_consume_ms) < before]
        sep = model.LMQ_SEPARATOR
        if parent is not None:
            rows = sorted(((m.lite, m) for m in metas if m.parent == parent), key=lambda r: r[0])
        else:
            rows = sorted(((f"{m.parent}{sep}{m.lite}", m) for m in metas), key=lambda r: r[0])
        out = [m for k, m in rows if k > start_after and (not end_before or k < end_before)]
        return out[: max(0, limit)]

    def lite_names(self, parent: str, start_after: str = "", limit: int = 1000) -> list[str]:
        return [m.lite for m in self.scan_lite_topics(parent, start_after, "", limit)]

    def lite_names_held(self, parent: str, names: Sequence[str]) -> list[bool]:
        held = set(self.lite_names(parent, "", len(self._queues) + 1))
        return [name in held for name in names]

    def delete_lite_topic(self, parent: str, lite: str, expected: model.LiteTopicMeta | None = None) -> bool:
        return self.delete_lite_topics([(parent, lite, expected)])[0]

    def _delete_locked(self, parent: str, lite: str, expected: model.LiteTopicMeta | None) -> bool:
        name = keys.parse_queue(keys.lmq_topic(parent, lite), 0)
        q = self._queues.get(name.qkey)
        if q is None:
            return False
        if expected is not None and (expected.max_offset, expected.last_store_ms, expected.last_consume_ms) != (
            q.next,
            q.last_store,
            q.last_consume,
        ):
            return False
        del self._queues[name.qkey]
        self._offsets.pop(name.qkey, None)
        self._acked.pop(name.qkey, None)
        self._handouts.pop(name.qkey, None)
        self._counts[parent] = self._counts.get(parent, 1) - 1
        if not self._counts[parent]:
            del self._counts[parent]
        return True

    def delete_lite_topics(
        self,
        rows: Sequence[tuple[str, str, model.LiteTopicMeta | None]],
        keep: Callable[[], Collection[str]] | None = None,
    ) -> list[bool]:
        self._check_open()
        for parent, lite, _ in rows:
            keys.parse_queue(keys.lmq_topic(parent, lite), 0)  # every name valid before anything is deleted
        if not rows:
            return []
        with self._lock:  # the whole call under the lock: readers see all of the batch or none of it
            kept = keep() if keep is not None else ()
            return [
                not (kept and keys.lmq_topic(parent, lite) in kept) and self._delete_locked(parent, lite, expected)
                for parent, lite, expected in rows
            ]

    # --- control-plane metadata ----------------------------------------------------------------------

    def put_parent_topic(self, topic: model.ParentTopic) -> None:
        self._check_open()
        api.check_name(topic.name)
        with self._lock:
            self._parents[topic.name] = topic

    def get_parent_topic(self, name: str) -> model.ParentTopic | None:
        self._check_open()
        with self._lock:
            return self._parents.get(name)

    def delete_parent_topic(self, name: str) -> bool:
        self._check_open()
        with self._lock:
            return self._parents.pop(name, None) is not None

    def list_parent_topics(self) -> list[model.ParentTopic]:
        self._check_open()
        with self._lock:
            return [self._parents[k] for k in sorted(self._parents)]

    def put_group(self, group: model.LiteGroup) -> None:
        self._check_open()
        api.check_name(group.name)
        api.check_name(group.bind_topic)
        with self._lock:
            self._groups[group.name] = group

    def get_group(self, name: str) -> model.LiteGroup | None:
        self._check_open()
        with self._lock:
            return self._groups.get(name)

    def delete_group(self, name: str) -> bool:
        self._check_open()
        with self._lock:
            return self._groups.pop(name, None) is not None

    def list_groups(self) -> list[model.LiteGroup]:
        self._check_open()
        with self._lock:
            return [self._groups[k] for k in sorted(self._groups)]

    def put_quota(self, quota: model.Quota) -> None:
        self._check_open()
        api.check_scope(quota.scope)
        with self._lock:
            self._quotas[quota.scope] = quota

    def get_quota(self, scope: str) -> model.Quota | None:
        self._check_open()
        with self._lock:
            return self._quotas.get(scope)

    def delete_quota(self, scope: str) -> bool:
        self._check_open()
        with self._lock:
            return self._quotas.pop(scope, None) is not None

    def list_quotas(self) -> list[model.Quota]:
        self._check_open()
        with self._lock:
            return [self._quotas[k] for k in sorted(self._quotas)]

    def commit_points(self, queue: model.QueueId) -> dict[str, int]:
        self._check_open()
        name = keys.parse_queue(queue.topic, queue.queue)
        with self._lock:
            return dict(self._offsets.get(name.qkey, {}))

    def normal_queues(self, start_after: model.QueueId | None = None, limit: int = 1000) -> list[model.QueueId]:
        self._check_open()
        after = b"" if start_after is None else keys.parse_queue(*start_after).qkey
        with self._lock:
            found = sorted(k for k, q in self._queues.items() if not q.name.is_lmq and k > after)
        return [keys.queue_of_qkey(k) for k in found[: max(0, limit)]]

    def relocated(self, queue: model.QueueId) -> int:
        self._check_open()
        with self._lock:
            return self._relocated.get(keys.parse_queue(queue.topic, queue.queue).qkey, 0)

    def put_relocated(self, queue: model.QueueId, end: int) -> None:
        self._check_open()
        with self._lock:
            self._relocated[keys.parse_queue(queue.topic, queue.queue).qkey] = end

    def store_id(self) -> str:
        self._check_open()
        return self._store_id

    def relocated_from(self, source: str, queue: model.QueueId) -> int:
        self._check_open()
        with self._lock:
            return self._relocated_from.get(keys.relocated_from(source, queue), 0)

    def put_relocated_from(self, source: str, queue: model.QueueId, end: int) -> None:
        self._check_open()
        with self._lock:
            self._relocated_from[keys.relocated_from(source, queue)] = end

    def put_membership(self, text: str) -> None:
        self._check_open()
        with self._lock:
            self._membership = text

    def get_membership(self) -> str | None:
        self._check_open()
        with self._lock:
            return self._membership

    def put_access(self, text: str) -> None:
        self._check_open()
        with self._lock:
            self._access = text

    def get_access(self) -> str | None:
        self._check_open()
        with self._lock:
            return self._access

    def put_reclaim_run(self, run: model.ReclaimRun) -> None:
        self._check_open()
        api.check_name(run.parent)
        with self._lock:
            self._reclaims[run.parent] = run

    def get_reclaim_run(self, parent: str) -> model.ReclaimRun | None:
        self._check_open()
        with self._lock:
            return self._reclaims.get(parent)

    def delete_reclaim_run(self, parent: str) -> bool:
        self._check_open()
        with self._lock:
            return self._reclaims.pop(parent, None) is not None

    def list_reclaim_runs(self) -> list[model.ReclaimRun]:
        self._check_open()
        with self._lock:
            return [self._reclaims[k] for k in sorted(self._reclaims)]

    # --- maintenance ---------------------------------------------------------------------------------

    def apply_retention(self, stop: Callable[[], bool] | None = None) -> api.RetentionReport:
        self._check_open()
        max_age = self._cfg.retention_max_age_ms
        max_bytes = self._cfg.retention_max_bytes
        with self._lock:
            now = self._clock()
            dropped = deleted = 0
            advanced: set[int] = set()
            while len(self._records) > 1:  # like LmqStore's active segment, the newest record stays
                if stop is not None and stop():
                    break
                head = self._records[0]
                too_old = max_age >= 0 and head.store_ms + max_age < now
                too_big = max_bytes >= 0 and self._bytes > max_bytes
                if not (too_old or too_big):
                    break
                self._records.popleft()
                self._bytes -= head.size
                dropped += 1
                deleted += head.size
                for q, off in head.placed:
                    q.messages.pop(off, None)
                    if q.min <= off and self._queues.get(q.name.qkey) is q:
                        q.min = off + 1
                        advanced.add(id(q))
            return api.RetentionReport(dropped, deleted, len(advanced))

    def flush(self) -> None:
        self._check_open()

    def close(self) -> None:
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise errors.StorageError("store is closed")
