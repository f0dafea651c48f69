"""Values shared by every layer of the broker.

Names follow RocketMQ: a *parent topic* is a normal topic whose message type is LITE; a *lite topic* is a
runtime string under it, stored as the Light Message Queue ``%LMQ%$<parent>$<lite>`` (always queue 0).
Everything here is a frozen value; behaviour lives in the layers above.

The two values built once per message sent or read (``NewMessage``, ``StoredMessage``) are ``@value`` classes:
frozen to the type checker, plain slotted dataclasses at run time. A frozen dataclass ``__init__`` pays one
``object.__setattr__`` per field (2-5 us for a ``NewMessage`` on the 2-core development machine); a slotted
one stores its fields directly (about 0.5 us called with positional arguments, about 1 us more with
keywords). mypy strict still refuses any assignment to them.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field, fields
from typing import Final, NamedTuple, TypeVar, dataclass_transform

LMQ_PREFIX: Final = "%LMQ%"
LMQ_SEPARATOR: Final = "$"
MAX_LITE_TOPIC_BYTES: Final = 64  # RocketMQ proxy maxLiteTopicSize
MAX_RESOURCE_NAME_BYTES: Final = 127
DEFAULT_MAX_BODY_BYTES: Final = 4 * 1024 * 1024  # RocketMQ proxy maxMessageSize

UNLIMITED: Final = -1  # a limit or quota that is not set
# An MQTT publish may be empty (MQTT 3.1.1 / 5.0 section 3.3.3); a RocketMQ message may not (MESSAGE_BODY_EMPTY):
# the store keeps an empty body only for a message carrying this property as "1" (the MQTT listener sets it).
EMPTY_BODY_PROPERTY: Final = "MQTT_EMPTY"

_T = TypeVar("_T")

_LITE_TOPIC_RE: Final = re.compile(r"^[A-Za-z0-9_-]+$")
_RESOURCE_RE: Final = re.compile(r"^[%A-Za-z0-9_-]+$")


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def value(cls: type[_T]) -> type[_T]:
    """A frozen value for the type checker, built at the cost of a mutable one (see the module docstring).

    Not frozen at run time: nothing but mypy stops an assignment, and the class has no ``__hash__``.
    """
    return dataclass(slots=True)(cls)


class MessageType(enum.IntEnum):
    """Same numbers as ``apache.rocketmq.v2.MessageType``."""

    NORMAL = 1
    FIFO = 2
    DELAY = 3
    TRANSACTION = 4
    LITE = 5
    PRIORITY = 6


class SubscriptionModel(enum.StrEnum):
    SHARED = "Shared"
    EXCLUSIVE = "Exclusive"


def is_valid_lite_topic(name: str) -> bool:
    return bool(name) and len(name.encode()) <= MAX_LITE_TOPIC_BYTES and bool(_LITE_TOPIC_RE.match(name))


def is_valid_resource_name(name: str) -> bool:
    return (
        bool(name)
        and len(name.encode()) <= MAX_RESOURCE_NAME_BYTES
        and bool(_RESOURCE_RE.match(name))
        and LMQ_SEPARATOR not in name
    )


class QueueId(NamedTuple):
    """A queue of the store: ``(topic, queue id)``. An LMQ is queue 0 of its ``%LMQ%$parent$lite`` name.

    A named tuple rather than a dataclass: queue ids key the dicts of every append result and of the
    dispatcher, and a tuple hashes and compares in C (a dataclass ``__hash__`` is a Python call per lookup).
    """

    topic: str
    queue: int = 0

    @staticmethod
    def lmq(parent: str, lite: str) -> QueueId:
        return QueueId(f"{LMQ_PREFIX}{LMQ_SEPARATOR}{parent}{LMQ_SEPARATOR}{lite}", 0)

    @property
    def is_lmq(self) -> bool:
        return self.topic.startswith(LMQ_PREFIX + LMQ_SEPARATOR)

    def lite_parts(self) -> tuple[str, str]:
        """(parent, lite) of an LMQ name; ValueError otherwise."""
        parts = self.topic.split(LMQ_SEPARATOR)
        if len(parts) != 3 or parts[0] != LMQ_PREFIX:
            raise ValueError(f"not an LMQ name: {self.topic!r}")
        return parts[1], parts[2]


@value
class NewMessage:
    """A message as accepted at the edge, before it is stored.

    ``queues`` are the queues the record is indexed into (multi-dispatch): for a LITE message the parent's
    queue and the LMQ; each extra queue costs one index entry, never a second copy of the body.
    """

    message_id: str
    topic: str
    body: bytes
    queues: tuple[QueueId, ...]
    lite_topic: str | None = None
    message_type: MessageType = MessageType.NORMAL
    born_timestamp_ms: int = 0
    born_host: str = ""
    tag: str | None = None
    keys: tuple[str, ...] = ()
    message_group: str | None = None
    user_properties: dict[str, str] = field(default_factory=dict)
    epoch: int = 0  # the replication epoch its slot's owner stored it in (0: the first, or no replication)
    # the ring slot its lite topic was placed on, recorded by its slot's owner (-1: not recorded, --replicas 1);
    # a topic's slot is read from its last record (``replication.owning``), not computed from today's ring
    slot: int = -1


@value
class StoredMessage:
    """A message read back from one queue, at one offset of that queue."""

    queue: QueueId
    offset: int
    message_id: str
    topic: str
    body: bytes
    store_timestamp_ms: int
    born_timestamp_ms: int
    lite_topic: str | None = None
    message_type: MessageType = MessageType.NORMAL
    born_host: str = ""
    tag: str | None = None
    keys: tuple[str, ...] = ()
    message_group: str | None = None
    user_properties: dict[str, str] = field(default_factory=dict)
    epoch: int = 0  # as ``NewMessage.epoch``
    slot: int = -1  # as ``NewMessage.slot``

    @staticmethod
    def of(
        message: NewMessage,
        queue: QueueId,
        offset: int,
        store_ms: int,
        user_properties: dict[str, str] | None = None,
    ) -> StoredMessage:
        """``message`` as stored at ``offset`` of ``queue`` (its user properties, unless given others)."""
        return StoredMessage(
            queue=queue,
            offset=offset,
            message_id=message.message_id,
            topic=message.topic,
            body=message.body,
            store_timestamp_ms=store_ms,
            born_timestamp_ms=message.born_timestamp_ms,
            lite_topic=message.lite_topic,
            message_type=message.message_type,
            born_host=message.born_host,
            tag=message.tag,
            keys=message.keys,
            message_group=message.message_group,
            user_properties=message.user_properties if user_properties is None else user_properties,
            epoch=message.epoch,
            slot=message.slot,
        )


class AppendResult(NamedTuple):
    """Where one appended message landed: its offset in each queue it was dispatched to, in the order of the
    message's ``queues`` (two tuples rather than a dict: a fan-out to many queues pays no hashing for it). A
    named tuple: the store builds one per message, and a tuple is the cheapest object to build."""

    message_id: str
    queues: tuple[QueueId, ...]
    queue_offsets: tuple[int, ...]
    store_timestamp_ms: int

    @property
    def offsets(self) -> dict[QueueId, int]:
        return dict(zip(self.queues, self.queue_offsets, strict=True))


@dataclass(frozen=True, slots=True)
class LiteTopicMeta:
    """Per lite topic bookkeeping, kept in the index (never all in memory)."""

    parent: str
    lite: str
    created_ms: int
    last_store_ms: int
    last_consume_ms: int
    min_offset: int
    max_offset: int  # next offset to be written; the queue is empty when min_offset == max_offset


class Handouts(NamedTuple):
    """What a group has handed out of one queue, kept with its commit point so that delivery attempts survive a
    restart. Every offset from the commit point up to ``mark`` that is neither acknowledged nor settled was
    delivered at least once; ``counts`` lists, by ascending offset, those whose number of attempts counted so far
    is not 1: more than one, or 0 (its only hand-out was suspended, so the next one repeats attempt 1). The next
    hand-out of an offset below ``mark`` has attempt ``counted + 1``.

    A named tuple, as ``QueueId``: one is built and compared with what was persisted on every ack, in C."""

    mark: int = 0
    counts: tuple[tuple[int, int], ...] = ()  # (offset, attempts counted), ascending offsets


NO_HANDOUTS: Final = Handouts()


@dataclass(frozen=True, slots=True)
class ParentTopic:
    name: str
    message_type: MessageType = MessageType.LITE
    expiration_minutes: int = -1  # -1 never; RocketMQ range -1..43200
    max_lite_topics: int = UNLIMITED
    queue_count: int = 1


@dataclass(frozen=True, slots=True)
class ReclaimRun:
    """What one reclaim run did to one parent's lite topics on this broker (this broker's share, not the
    run's total). The broker keeps the newest per parent, for the operator to show on ParentTopic status."""

    parent: str
    run_id: str
    start_ms: int
    finish_ms: int
    scanned: int = 0
    expired: int = 0
    reclaimed: int = 0  # deleted, or would have been in a dry run
    kept_changed: int = 0
    kept_subscribed: int = 0
    not_found: int = 0
    errors: int = 0
    dry_run: bool = False


RECLAIM_COUNTS: Final = ("scanned", "expired", "reclaimed", "kept_changed", "kept_subscribed", "not_found", "errors")
RECLAIM_RUN_FIELDS: Final = tuple(f.name for f in fields(ReclaimRun))  # also the admin proto's and meta JSON's names


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int = 17  # RocketMQ retryMaxTimes 16 + 1
    backoff_ms: tuple[int, ...] = (
        1000, 5000, 10000, 30000, 60000, 120000, 180000, 240000, 300000,
        360000, 420000, 480000, 540000, 600000, 1200000, 1800000, 3600000, 7200000,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class LiteGroup:
    name: str
    bind_topic: str
    model: SubscriptionModel = SubscriptionModel.SHARED
    client_quota: int = 2000  # lite.sub.client.quota
    ready_capacity: int = 100  # maxClientEventCount
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    fifo: bool = True
    consume_enabled: bool = True
    wildcard: bool = False  # lite.sub.wildcard: the group receives every lite topic of its bind topic
    lite_patterns: tuple[str, ...] = ()  # a wildcard group receives only the lite topics these match, if any


@dataclass(frozen=True, slots=True)
class Quota:
    """Limits for a scope: ``parent:<topic>``, ``namespace:<ns>`` or ``broker``; each UNLIMITED unless set."""

    scope: str
    max_lite_topics: int = UNLIMITED
    max_subscriptions_per_client: int = UNLIMITED
    max_send_rate: int = UNLIMITED  # messages per second
