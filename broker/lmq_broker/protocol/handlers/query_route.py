"""QueryRoute: one broker (id 0, this one) holding the topic's queues, READ_WRITE (dead-letter topics READ).

On the external listener the broker is named by its external address (``--external-addresses`` or the template,
else the address the client dialled), never by ``--advertised-host``, which is the in-cluster name."""

from __future__ import annotations

from lmq_broker.dispatch import metadata
from lmq_broker.protocol import cluster_calls, convert, status
from lmq_broker.protocol.context import Caller
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb


async def handle(edge: Edge, request: spb.QueryRouteRequest, caller: Caller) -> spb.QueryRouteResponse:
    name = convert.topic_name(request.topic)
    topic = (await edge.dispatcher.metadata()).topic(name)
    permission = pb.READ if name.startswith(metadata.DLQ_PREFIX) else pb.READ_WRITE
    if edge.peers is not None:  # several brokers: every one's queues (protocol.cluster_calls)
        queues = cluster_calls.route(edge.peers, topic, request.topic.resource_namespace, external=caller.external)
        return spb.QueryRouteResponse(status=status.ok(), message_queues=queues)
    broker = edge.broker(request.endpoints if request.HasField("endpoints") else None, external=caller.external)
    queues = convert.queues_of(topic, broker, request.topic.resource_namespace, permission)
    return spb.QueryRouteResponse(status=status.ok(), message_queues=queues)
