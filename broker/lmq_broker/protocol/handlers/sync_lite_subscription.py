"""SyncLiteSubscription: PARTIAL_ADD / PARTIAL_REMOVE / COMPLETE_ADD / COMPLETE_REMOVE of lite topics.

rocketmq-python-client 5.1.2 sends ``subscribe_lite("session-1")`` as one entry per character (it extends
the repeated field with the string). Left alone, the subscription would only take effect with the
client's next COMPLETE_ADD, up to 30 s later. For exactly that client (x-mq-language PYTHON and
x-mq-client-version 5.1.2), a PARTIAL_ADD whose entries are all single characters is read as one name:
their concatenation, in order. Any other client, action or entry shape is taken literally.

The names are checked in slices of ``SLICE`` that yield to the event loop in between: a COMPLETE_ADD of
100,000 names keeps no other client's call waiting (the dispatcher makes the change in slices too).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Final

from lmq_broker import errors
from lmq_broker.protocol import convert, status
from lmq_broker.protocol.context import Caller
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb

SLICE: Final = 500  # names checked per step of the event loop (1-2 ms)


async def lite_topics(request: spb.SyncLiteSubscriptionRequest, caller: Caller, max_chars: int) -> list[str]:
    """The request's names, read in slices; for an add, each checked to be a lite topic or a pattern of them
    (``errors.InvalidLiteTopic`` for the first that is not)."""
    entries: Sequence[str] = request.lite_topic_set
    adds = request.action in (pb.PARTIAL_ADD, pb.COMPLETE_ADD)
    if (
        request.action == pb.PARTIAL_ADD
        and caller.splits_lite_topics
        and len(entries) > 1
        and all(len(name) == 1 for name in entries)
    ):
        entries = ["".join(entries)]
    names: list[str] = []
    for start in range(0, len(entries), SLICE):
        if start:
            await asyncio.sleep(0)
        part = entries[start : start + SLICE]
        if adds:
            for name in part:
                convert.lite_topic_or_pattern(name, max_chars)
        names += part
    return names


async def handle(
    edge: Edge, request: spb.SyncLiteSubscriptionRequest, caller: Caller
) -> spb.SyncLiteSubscriptionResponse:
    client_id = caller.require_client_id()
    action = request.action
    if action not in (pb.PARTIAL_ADD, pb.PARTIAL_REMOVE, pb.COMPLETE_ADD, pb.COMPLETE_REMOVE):
        raise errors.InvalidArgument(f"unknown lite subscription action {action}")
    parent = convert.topic_name(request.topic)
    group = convert.group_name(request.group)
    names = await lite_topics(request, caller, edge.config.max_lite_topic_size)
    dispatcher = edge.dispatcher
    if action == pb.PARTIAL_ADD:
        offset = convert.offset_reset(request.offset_option) if request.HasField("offset_option") else None
        await dispatcher.add_lite(client_id, group, parent, names, namespace=caller.namespace, offset=offset)
    elif action == pb.PARTIAL_REMOVE:
        await dispatcher.remove_lite(client_id, group, parent, names)
    elif action == pb.COMPLETE_ADD:
        await dispatcher.replace_lite(client_id, group, parent, names, namespace=caller.namespace)
    else:
        await dispatcher.remove_all_lite(client_id, group, parent)
    return spb.SyncLiteSubscriptionResponse(status=status.ok())
