"""QueryAssignment: push consumers run one receive loop per assignment; one assignment (this broker) each.

The queue id in it is only echoed back by ReceiveMessage: a receive is served from all of the topic's
queues (normal topics) or from the client's ready set (lite topics), never from one queue.
"""

from __future__ import annotations

from lmq_broker import model
from lmq_broker.protocol import convert, status
from lmq_broker.protocol.context import Caller
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb


async def handle(edge: Edge, request: spb.QueryAssignmentRequest, caller: Caller) -> spb.QueryAssignmentResponse:
    name = convert.topic_name(request.topic)
    group = convert.group_name(request.group)
    snap = await edge.dispatcher.metadata()
    topic = snap.topic(name)
    if topic.message_type == model.MessageType.LITE:
        snap.lite_group(group, name)
    else:
        snap.normal_group(group, name)
    if caller.client_id:
        edge.dispatcher.client_seen(caller.client_id, group=group)
    # One assignment per broker (the same answer from every broker of a cluster): a push consumer then runs one
    # receive loop against each, and each serves the lite topics it holds.
    requested = request.endpoints if request.HasField("endpoints") else None
    found = [
        pb.Assignment(message_queue=convert.queues_of(topic, broker, request.topic.resource_namespace)[0])
        for broker, _ in edge.brokers(requested, external=caller.external)
    ]
    return spb.QueryAssignmentResponse(status=status.ok(), assignments=found)
