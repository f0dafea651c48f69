"""Where given-up messages go: a copy in ``%DLQ%<group>``, a NORMAL topic, that says where it came from.

Settlement decides that a message is given up (too many attempts, suspended too long, or a client's
ForwardMessageToDeadLetterQueue); this part builds the copies and appends them through ingest's one door, so
that a dead letter is an arrival like any other and wakes the readers of the dead-letter topic.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Final

from lmq_broker import model
from lmq_broker.dispatch import metadata

ORIGIN_TOPIC: Final = "__ORIGIN_TOPIC"
ORIGIN_LITE_TOPIC: Final = "__ORIGIN_LITE_TOPIC"

Append = Callable[[Sequence[model.NewMessage]], Awaitable[list[model.AppendResult]]]


def dlq_topic(group: str) -> str:
    return f"{metadata.DLQ_PREFIX}{group}"


def copy(group: str, message: model.StoredMessage) -> model.NewMessage:
    """The copy of ``message`` stored in ``%DLQ%<group>``, with where it came from."""
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


class DeadLetters:
    """The dispatcher's dead-letter part: ``append`` is ingest's door for what the broker writes itself."""

    def __init__(self, append: Append) -> None:
        self._append = append

    async def store(self, group: str, messages: Sequence[model.StoredMessage]) -> None:
        """Store copies of ``messages`` in ``%DLQ%<group>``: no quota applies, and its readers wake."""
        await self._append([copy(group, m) for m in messages])
