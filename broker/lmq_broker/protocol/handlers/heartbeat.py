"""Heartbeat: keeps the client (and its subscriptions) from expiring."""

from __future__ import annotations

from lmq_broker.protocol import convert, status
from lmq_broker.protocol.context import Caller
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb


async def handle(edge: Edge, request: spb.HeartbeatRequest, caller: Caller) -> spb.HeartbeatResponse:
    client_id = caller.require_client_id()
    kind = convert.client_type(request.client_type)
    group = convert.group_name(request.group) if request.HasField("group") and request.group.name else None
    edge.dispatcher.client_seen(
        client_id, client_type=kind, group=group, language=caller.language, version=caller.version
    )
    return spb.HeartbeatResponse(status=status.ok())
