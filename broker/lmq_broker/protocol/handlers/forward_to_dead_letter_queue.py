"""ForwardMessageToDeadLetterQueue: the client gave up (FIFO consumption past max attempts)."""

from __future__ import annotations

from lmq_broker.protocol import convert, status
from lmq_broker.protocol.context import Caller
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb


async def handle(
    edge: Edge, request: spb.ForwardMessageToDeadLetterQueueRequest, caller: Caller
) -> spb.ForwardMessageToDeadLetterQueueResponse:
    group = convert.group_name(request.group)
    convert.topic_name(request.topic)
    await edge.dispatcher.dead_letter(group, request.receipt_handle)
    edge.metrics.dead_letters.inc()
    return spb.ForwardMessageToDeadLetterQueueResponse(status=status.ok())
