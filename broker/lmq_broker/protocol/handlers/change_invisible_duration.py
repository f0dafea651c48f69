"""ChangeInvisibleDuration: re-lease a message (a nack when short). ``suspend`` keeps the attempt count."""

from __future__ import annotations

from lmq_broker.protocol import convert, status
from lmq_broker.protocol.context import Caller
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb


async def handle(
    edge: Edge, request: spb.ChangeInvisibleDurationRequest, caller: Caller
) -> spb.ChangeInvisibleDurationResponse:
    group = convert.group_name(request.group)
    convert.topic_name(request.topic)
    invisible = convert.invisible_ms(request.invisible_duration)
    handle_ = await edge.dispatcher.change_invisible(
        group, request.receipt_handle, invisible, suspend=request.HasField("suspend") and request.suspend
    )
    return spb.ChangeInvisibleDurationResponse(status=status.ok(), receipt_handle=handle_)
