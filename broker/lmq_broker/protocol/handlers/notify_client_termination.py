"""NotifyClientTermination: the client is gone; drop every subscription it held (RocketMQ: COMPLETE_REMOVE)."""

from __future__ import annotations

from lmq_broker.protocol import status
from lmq_broker.protocol.context import Caller
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb


async def handle(
    edge: Edge, request: spb.NotifyClientTerminationRequest, caller: Caller
) -> spb.NotifyClientTerminationResponse:
    edge.dispatcher.client_gone(caller.require_client_id())
    return spb.NotifyClientTerminationResponse(status=status.ok())
