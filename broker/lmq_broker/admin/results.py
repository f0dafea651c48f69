"""What admin calls return besides model values: plain frozen values, so callers never hold a proto.

They live apart from the client so that ``convert``, which fills them from replies, and the client, which
returns them, both import them without importing each other.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from lmq_broker import model
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as pb

T = TypeVar("T")


class DeleteOutcome(enum.IntEnum):
    """What compare-and-delete did with one row; same numbers as ``lmq.admin.v1.DeleteOutcome``."""

    DELETED = pb.DELETED
    KEPT_CHANGED = pb.KEPT_CHANGED  # received a message or a consume after the scan
    KEPT_SUBSCRIBED = pb.KEPT_SUBSCRIBED  # require_no_subscribers, and a subscriber beyond those expected
    NOT_FOUND = pb.NOT_FOUND  # already gone (an idempotent re-run)
    WOULD_DELETE = pb.WOULD_DELETE  # dry run


@dataclass(frozen=True, slots=True)
class Applied(Generic[T]):
    value: T  # as stored by the broker, defaults filled in
    created: bool


@dataclass(frozen=True, slots=True)
class ParentTopicInfo:
    topic: model.ParentTopic
    lite_topic_count: int
    last_reclaim: model.ReclaimRun | None = None  # the newest reclaim run recorded on this broker, if any


@dataclass(frozen=True, slots=True)
class ParentTopicDeletion:
    deleted: bool  # False: there was no such parent topic
    lite_topics_deleted: int


@dataclass(frozen=True, slots=True)
class ReclaimRecording:
    """Where each run of ``record_reclaim_runs`` went, by parent name."""

    recorded: tuple[str, ...]
    unknown_parents: tuple[str, ...]  # the broker holds no such parent topic
    superseded: tuple[str, ...]  # the broker keeps the record of a run that started later


@dataclass(frozen=True, slots=True)
class GroupInfo:
    group: model.LiteGroup
    subscription_count: int
    client_count: int
    lag: int  # messages the group has still to consume, summed over its lite topics


@dataclass(frozen=True, slots=True)
class LiteTopicInfo:
    meta: model.LiteTopicMeta
    subscriber_count: int


@dataclass(frozen=True, slots=True)
class LiteTopicDescription:
    meta: model.LiteTopicMeta
    group_offsets: Mapping[str, int]  # group -> committed offset (next to consume)
    subscribed_clients: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LiteTopicPage:
    topics: tuple[LiteTopicInfo, ...]
    next_start_after: str  # "" on the last page


@dataclass(frozen=True, slots=True)
class ClientInfo:
    client_id: str
    group: str
    topic: str
    client_type: int  # apache.rocketmq.v2.ClientType number
    subscription_count: int
    last_seen_ms: int
    ready_events: int


@dataclass(frozen=True, slots=True)
class BrokerInfo:
    broker_name: str
    version: str
    lite_topic_count: int
    subscription_count: int
    client_count: int
    stored_bytes: int
    undrained_messages: int  # -1 when not computed (with_undrained=False)
    parent_topic_count: int
    group_count: int


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    members: tuple[str, ...]  # ring slots' endpoints, in slot order
    ring_sizes: tuple[int, ...]  # oldest first; the last is today's ring (members past it are leaving)
    slot: int  # this broker's; -1: no member
    leaving: bool
    undrained_messages: int  # -1 when not computed
    drained: bool
    source: str  # "flags" or "admin"
    admin_port: int = 0  # every member's admin port at its host (--admin-port); 0: on the member's endpoint
    epoch: int = 0  # the membership's epoch (only grows; docs/scale-out.md)
    ring_fixed: str = ""  # why the broker refuses a grown ring now ("": it takes one; docs/replication.md)


@dataclass(frozen=True, slots=True)
class LiteClientInfo:
    client: ClientInfo
    lite_topics: tuple[str, ...]  # lite names within client.topic, sorted


@dataclass(frozen=True, slots=True)
class LiteTopicLag:
    lite: str
    lag: int
    committed_offset: int  # -1: none yet
    max_offset: int
    latency_ms: int  # age of the oldest unconsumed message; 0 without lag


@dataclass(frozen=True, slots=True)
class GroupLag:
    group: str
    bind_topic: str
    lag: int
    latency_ms: int  # the largest over the group's lite topics
    lagging_topics: int
    top: tuple[LiteTopicLag, ...]  # largest lag first
    # waiting in lite topics of the bind topic the group neither consumed nor subscribes (not lag)
    unclaimed_messages: int = 0
    unclaimed_topics: int = 0


@dataclass(frozen=True, slots=True)
class UserInfo:
    """A user as the broker shows it: never its secret."""

    name: str
    super_user: bool
    enabled: bool
    acl_entries: int = 0


@dataclass(frozen=True, slots=True)
class UserPut:
    name: str
    super_user: bool
    enabled: bool
    created: bool
    secret: str = ""  # only when lmq-admin generated it: shown this once, never again


@dataclass(frozen=True, slots=True)
class UserDeletion:
    deleted: bool
    acl_entries_deleted: int


@dataclass(frozen=True, slots=True)
class AclEntry:
    user: str
    resource: str
    actions: tuple[str, ...]
    decision: str = "Allow"
    sources: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class AclPut:
    created: int
    entries: tuple[AclEntry, ...]
