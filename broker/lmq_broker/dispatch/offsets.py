"""Where a group starts in a lite topic (OffsetOption on subscribe) and where given-up messages go.

Both are store writes the dispatcher runs on its thread pool; kept here as plain functions over the
store so the rules read in one place.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from lmq_broker import errors, model
from lmq_broker.dispatch import metadata
from lmq_broker.storage.api import Store

ORIGIN_TOPIC: Final = "__ORIGIN_TOPIC"
ORIGIN_LITE_TOPIC: Final = "__ORIGIN_LITE_TOPIC"


class OffsetPolicy(enum.Enum):
    LAST = "last"  # keep the group's offset
    MIN = "min"
    MAX = "max"
    OFFSET = "offset"
    TAIL_N = "tail_n"  # only moves an offset the group already has (RocketMQ)
    TIMESTAMP = "timestamp"  # accepted and ignored, as RocketMQ 5.5.0 does


@dataclass(frozen=True, slots=True)
class OffsetReset:
    policy: OffsetPolicy
    value: int = 0

    def __post_init__(self) -> None:
        if self.policy in (OffsetPolicy.OFFSET, OffsetPolicy.TAIL_N) and self.value < 0:
            raise errors.InvalidArgument(f"{self.policy.value} must be >= 0", kind="offset")

    @property
    def moves(self) -> bool:
        return self.policy not in (OffsetPolicy.LAST, OffsetPolicy.TIMESTAMP)


def reset(
    store: Store, lmqs: Iterable[str], group: str, option: OffsetReset, ends: Sequence[int] | None = None
) -> None:
    """Blocking: commit the group's new start in each LMQ, clamped to what the queue holds. ``ends`` (with
    ``MAX``): each LMQ's end as read earlier, the start instead of its end now (what was stored since stays
    to be delivered: an MQTT subscription starts where its broker read the ends, not later)."""
    for i, lmq in enumerate(lmqs):
        queue = model.QueueId(lmq)
        lo, hi = store.queue_offsets(queue)
        if ends is not None and option.policy is OffsetPolicy.MAX:
            hi = min(hi, ends[i])
        if option.policy is OffsetPolicy.MIN:
            target = lo
        elif option.policy is OffsetPolicy.MAX:
            target = hi
        elif option.policy is OffsetPolicy.OFFSET:
            target = option.value
        elif option.policy is OffsetPolicy.TAIL_N and store.get_offset(queue, group) is not None:
            target = hi - option.value
        else:
            continue
        store.commit_offset(queue, group, min(max(target, lo), hi))


def dlq_topic(group: str) -> str:
    return f"{metadata.DLQ_PREFIX}{group}"


def dead_letter(group: str, message: model.StoredMessage) -> model.NewMessage:
    """The copy of ``message`` stored in ``%DLQ%<group>`` (a NORMAL topic), with where it came from."""
    topic = dlq_topic(group)
    properties = dict(message.user_properties)
    properties.setdefault(ORIGIN_TOPIC, message.topic)
    if message.lite_topic:
        properties.setdefault(ORIGIN_LITE_TOPIC, message.lite_topic)
    return model.NewMessage(
        message_id=message.message_id,
        topic=topic,
        body=message.body,
        queues=(model.QueueId(topic, 0),),
        message_type=model.MessageType.NORMAL,
        born_timestamp_ms=message.born_timestamp_ms,
        born_host=message.born_host,
        tag=message.tag,
        keys=message.keys,
        user_properties=properties,
    )
