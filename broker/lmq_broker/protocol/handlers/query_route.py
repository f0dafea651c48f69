"""QueryRoute: the topic's queues on every broker (``Edge.brokers``: this one alone, id 0, or each broker of a
cluster, the one asked first and the others in slot order, leaving ones READ), READ_WRITE; dead-letter topics READ.

On the external listener the broker is named by its external address (``--external-addresses`` or the template,
else the address the client dialled), never by ``--advertised-host``, which is the in-cluster name."""

from __future__ import annotations

from lmq_broker import model
from lmq_broker.dispatch import metadata
from lmq_broker.protocol import convert, status
from lmq_broker.protocol.context import Caller
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb


async def handle(edge: Edge, request: spb.QueryRouteRequest, caller: Caller) -> spb.QueryRouteResponse:
    name = convert.topic_name(request.topic)
    topic = (await edge.dispatcher.metadata()).topic(name)
    dead_letters = name.startswith(metadata.DLQ_PREFIX)
    requested = request.endpoints if request.HasField("endpoints") else None
    queues: list[pb.MessageQueue] = []
    lite = topic.message_type == model.MessageType.LITE
    for broker, permission in edge.brokers(requested, external=caller.external, lite_route=lite):
        queues += convert.queues_of(
            topic, broker, request.topic.resource_namespace, pb.READ if dead_letters else permission
        )
    return spb.QueryRouteResponse(status=status.ok(), message_queues=queues)
