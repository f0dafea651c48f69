"""Parent topics, lite groups and quotas: validated, idempotent upserts over the store.

Blocking; the service runs each call in a worker thread. Writes take one lock so that check-then-write
rules (a group's bind topic must exist and never changes; a topic's message type never changes and its
queue count never shrinks) hold against concurrent admin calls. Callers
learn whether anything changed, so the dispatcher's caches are dropped only when they are stale.

Reclaim-run records follow their parent under the same lock: one is kept only while the parent exists
(deleting the parent drops it first, so a crash in between leaves a parent without a record, never a
record without a parent), and a record never gives way to a run that started earlier — a slow run that
finishes late must not hide a newer one.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from lmq_broker import errors, model
from lmq_broker.admin import validation
from lmq_broker.config import BrokerConfig
from lmq_broker.storage.api import Store

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Upsert(Generic[T]):
    value: T  # what is stored now
    created: bool
    changed: bool


@dataclass(frozen=True, slots=True)
class ParentDeletion:
    deleted: bool  # the topic existed and is gone
    purge_needed: bool  # lite topics remain that the caller asked to purge


@dataclass(frozen=True, slots=True)
class ParentInfo:
    topic: model.ParentTopic
    lite_topic_count: int
    last_reclaim: model.ReclaimRun | None


@dataclass(frozen=True, slots=True)
class Recording:
    """Where each run of a RecordReclaimRuns call went, by parent name."""

    recorded: tuple[str, ...]
    unknown_parents: tuple[str, ...]  # no such parent topic here: nothing stored
    superseded: tuple[str, ...]  # the record of a run that started later is kept


class Catalog:
    def __init__(self, store: Store, config: BrokerConfig) -> None:
        self._store = store
        self._config = config
        self._lock = threading.Lock()

    # --- parent topics ----------------------------------------------------------------------------------
    def put_parent_topic(self, topic: model.ParentTopic) -> Upsert[model.ParentTopic]:
        topic = validation.parent_topic(topic)
        with self._lock:
            existing = self._store.get_parent_topic(topic.name)
            if existing is not None and existing.message_type is not topic.message_type:
                # As RocketMQ's message.type: stored messages and bound groups were made for the old type.
                raise errors.Conflict(
                    f"topic.message_type is immutable: topic {topic.name!r} is {existing.message_type.name}, "
                    f"not {topic.message_type.name}; delete it first",
                    topic=topic.name,
                    message_type=existing.message_type.name,
                )
            if existing is not None and topic.queue_count < existing.queue_count:
                # Receivers only read queues below the count, so messages in the dropped queues would be stranded.
                raise errors.Conflict(
                    f"topic.queue_count can only grow: topic {topic.name!r} has {existing.queue_count} queues, "
                    f"asked for {topic.queue_count}",
                    topic=topic.name,
                    queue_count=existing.queue_count,
                )
            if existing == topic:
                return Upsert(topic, created=False, changed=False)
            self._store.put_parent_topic(topic)
            return Upsert(topic, created=existing is None, changed=True)

    def get_parent_topic(self, name: str) -> ParentInfo:
        topic = self._store.get_parent_topic(validation.name("name", name))
        if topic is None:
            raise errors.TopicNotFound(f"parent topic {name!r} not found", topic=name)
        return ParentInfo(topic, self._store.lite_topic_count(name), self._store.get_reclaim_run(name))

    def list_parent_topics(self) -> list[ParentInfo]:
        runs = {r.parent: r for r in self._store.list_reclaim_runs()}  # one prefix read, not one get per topic
        return [
            ParentInfo(t, self._store.lite_topic_count(t.name), runs.get(t.name))
            for t in self._store.list_parent_topics()
        ]

    def delete_parent_topic(self, name: str, *, purge: bool) -> ParentDeletion:
        """Without ``purge``, a parent that still has lite topics is kept (delete-only-if-empty)."""
        validation.name("name", name)
        with self._lock:
            remaining = self._store.lite_topic_count(name)
            exists = self._store.get_parent_topic(name) is not None
            if exists and remaining and not purge:
                raise errors.Conflict(
                    f"parent topic {name!r} still has {remaining} lite topics; delete them or set purge_lite_topics",
                    topic=name,
                    lite_topics=remaining,
                )
            self._store.delete_reclaim_run(name)
            deleted = self._store.delete_parent_topic(name) if exists else False
            # A purge is also re-run for an already deleted parent: an interrupted purge completes.
            return ParentDeletion(deleted=deleted, purge_needed=purge and remaining > 0)

    # --- reclaim runs -----------------------------------------------------------------------------------
    def record_reclaim_runs(self, runs: Sequence[model.ReclaimRun]) -> Recording:
        """Store each run as its parent's record, unless the parent is unknown or holds a later run's."""
        checked = [validation.reclaim_run(f"runs[{i}]", run) for i, run in enumerate(runs)]
        parents = [run.parent for run in checked]
        twice = sorted(p for p, n in Counter(parents).items() if n > 1)
        if twice:
            raise errors.InvalidArgument(f"runs: parent {twice[0]!r} is listed more than once", field="runs")
        recorded: list[str] = []
        unknown: list[str] = []
        superseded: list[str] = []
        with self._lock:
            for run in checked:
                if self._store.get_parent_topic(run.parent) is None:
                    unknown.append(run.parent)
                    continue
                kept = self._store.get_reclaim_run(run.parent)
                if kept is not None and kept.start_ms > run.start_ms:
                    superseded.append(run.parent)
                    continue
                self._store.put_reclaim_run(run)
                recorded.append(run.parent)
        return Recording(tuple(recorded), tuple(unknown), tuple(superseded))

    # --- lite groups ------------------------------------------------------------------------------------
    def put_group(self, group: model.LiteGroup) -> Upsert[model.LiteGroup]:
        group = validation.lite_group(group, self._config)
        with self._lock:
            bind = self._store.get_parent_topic(group.bind_topic)
            if bind is None:
                raise errors.TopicNotFound(
                    f"group.bind_topic: parent topic {group.bind_topic!r} not found", topic=group.bind_topic
                )
            if bind.message_type is not model.MessageType.LITE:
                raise errors.Conflict(
                    f"group.bind_topic: topic {bind.name!r} is {bind.message_type.name}, not LITE", topic=bind.name
                )
            existing = self._store.get_group(group.name)
            if existing is not None and existing.bind_topic != group.bind_topic:
                raise errors.Conflict(
                    f"group.bind_topic is immutable: group {group.name!r} is bound to {existing.bind_topic!r}",
                    group=group.name,
                    bind_topic=existing.bind_topic,
                )
            if existing == group:
                return Upsert(group, created=False, changed=False)
            self._store.put_group(group)
            return Upsert(group, created=existing is None, changed=True)

    def get_group(self, name: str) -> model.LiteGroup:
        group = self._store.get_group(validation.name("name", name))
        if group is None:
            raise errors.GroupNotFound(f"lite group {name!r} not found", group=name)
        return group

    def list_groups(self) -> list[model.LiteGroup]:
        return self._store.list_groups()

    def delete_group(self, name: str) -> bool:
        with self._lock:
            return self._store.delete_group(validation.name("name", name))

    # --- quotas -----------------------------------------------------------------------------------------
    def put_quota(self, quota: model.Quota) -> Upsert[model.Quota]:
        quota = validation.quota(quota)
        with self._lock:
            existing = self._store.get_quota(quota.scope)
            if existing == quota:
                return Upsert(quota, created=False, changed=False)
            self._store.put_quota(quota)
            return Upsert(quota, created=existing is None, changed=True)

    def delete_quota(self, scope: str) -> bool:
        with self._lock:
            return self._store.delete_quota(validation.scope(scope))

    def list_quotas(self) -> list[model.Quota]:
        return self._store.list_quotas()
