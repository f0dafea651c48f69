"""NotifyClientTermination: the client is gone; drop every subscription it held (RocketMQ: COMPLETE_REMOVE).

Only the client itself may say so: while the id has a Telemetry stream open, the call must come over the
same connection (``protocol.connections``); from any other it is FORBIDDEN and ends nothing.
"""

from __future__ import annotations

import logging

from lmq_broker import errors
from lmq_broker.protocol import status
from lmq_broker.protocol.context import Caller
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb

log = logging.getLogger(__name__)


async def handle(
    edge: Edge, request: spb.NotifyClientTerminationRequest, caller: Caller
) -> spb.NotifyClientTerminationResponse:
    client_id = caller.require_client_id()
    if not edge.connections.owns(client_id, caller.peer):
        log.warning("termination of client %s refused: asked from %s, not its connection", client_id, caller.peer)
        raise errors.Forbidden(f"client {client_id} runs on another connection: only the client itself may end it")
    edge.dispatcher.client_gone(client_id)
    return spb.NotifyClientTerminationResponse(status=status.ok())
