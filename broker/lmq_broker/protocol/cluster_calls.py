"""The v2 calls that look different in a cluster of brokers (``edge.peers`` set): routes and assignments list
every broker, sends and subscription changes go to the owners of their lite topics (``protocol.peers``), and a
LiteSimpleConsumer's receives gather from every broker, its settlements going back where each message came
from (``protocol.gathering``).

With one broker (no ``--peers``) none of this runs and every handler answers as before.
"""

from __future__ import annotations

import dataclasses

from lmq_broker import errors, model
from lmq_broker.dispatch import metadata
from lmq_broker.protocol import convert, gathering
from lmq_broker.protocol.context import Caller
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.handlers import (
    ack_message,
    change_invisible_duration,
    forward_to_dead_letter_queue,
    send_message,
)
from lmq_broker.protocol.handlers import sync_lite_subscription as sync_handler
from lmq_broker.protocol.peers import Peers, forwarded

__all__ = [
    "ack",
    "assignments",
    "change_invisible",
    "dead_letter",
    "forwarded",
    "route",
    "send",
    "sync_lite_subscription",
]


def route(peers: Peers, topic: model.ParentTopic, namespace: str, *, external: bool = False) -> list[pb.MessageQueue]:
    """Every broker's queues of ``topic``, each with that broker's own endpoint (its external address for a
    client on the external listener), in slot order. Leaving brokers (past today's ring) are listed READ:
    consumers drain them, producers skip them."""
    dead_letters = topic.name.startswith(metadata.DLQ_PREFIX)
    queues: list[pb.MessageQueue] = []
    for slot, broker in enumerate(peers.routed(external)):
        permission = pb.READ if dead_letters else peers.permission(slot)
        queues += convert.queues_of(topic, broker, namespace, permission)
    return queues


def assignments(
    peers: Peers, topic: model.ParentTopic, namespace: str, *, external: bool = False
) -> list[pb.Assignment]:
    """One assignment per broker (the same answer from every broker): a push consumer then runs one receive
    loop against each, and each serves the lite topics it holds."""
    brokers = peers.routed(external)
    return [pb.Assignment(message_queue=convert.queues_of(topic, broker, namespace)[0]) for broker in brokers]


async def send(edge: Edge, peers: Peers, request: spb.SendMessageRequest) -> spb.SendMessageResponse:
    if not request.messages:
        raise errors.InvalidArgument("no messages to send")
    if len(request.messages) > send_message.MAX_MESSAGES_PER_REQUEST:
        raise errors.InvalidArgument(f"at most {send_message.MAX_MESSAGES_PER_REQUEST} messages per request")
    return await peers.send(request, lambda part: send_message.store(edge, part))


async def sync_lite_subscription(
    edge: Edge, request: spb.SyncLiteSubscriptionRequest, caller: Caller
) -> spb.SyncLiteSubscriptionResponse:
    """At the access broker: checked here, then split by owner (``Peers.sync_lite``)."""
    peers = edge.peers
    assert peers is not None
    caller.require_client_id()
    if request.action not in (pb.PARTIAL_ADD, pb.PARTIAL_REMOVE, pb.COMPLETE_ADD, pb.COMPLETE_REMOVE):
        raise errors.InvalidArgument(f"unknown lite subscription action {request.action}")
    convert.group_name(request.group)
    names = sync_handler.lite_topics(request, caller)
    if request.action in (pb.PARTIAL_ADD, pb.COMPLETE_ADD):
        for name in names:
            convert.lite_topic_or_pattern(name, edge.config.max_lite_topic_size)
    plain = dataclasses.replace(caller, language="", version="")  # the parts are already read literally

    async def apply_here(part: spb.SyncLiteSubscriptionRequest) -> spb.SyncLiteSubscriptionResponse:
        return await sync_handler.handle(edge, part, plain)

    return await peers.sync_lite(request, names, caller, apply_here)


# --- settling messages a LiteSimpleConsumer received through this broker from others ------------------------
async def ack(edge: Edge, request: spb.AckMessageRequest, caller: Caller) -> spb.AckMessageResponse:
    peers = edge.peers
    if peers is None or not any(e.receipt_handle.startswith(gathering.VIA) for e in request.entries):
        return await ack_message.handle(edge, request, caller)
    return await gathering.ack(edge, peers, request, caller)


async def change_invisible(
    edge: Edge, request: spb.ChangeInvisibleDurationRequest, caller: Caller
) -> spb.ChangeInvisibleDurationResponse:
    reply, via = await gathering.settle(
        edge, request, caller, change_invisible_duration.handle, spb.ChangeInvisibleDurationResponse
    )
    if via and reply.status.code == pb.OK:
        reply.receipt_handle = gathering.wrap(via, reply.receipt_handle)
    return reply


async def dead_letter(
    edge: Edge, request: spb.ForwardMessageToDeadLetterQueueRequest, caller: Caller
) -> spb.ForwardMessageToDeadLetterQueueResponse:
    reply, _ = await gathering.settle(
        edge, request, caller, forward_to_dead_letter_queue.handle, spb.ForwardMessageToDeadLetterQueueResponse
    )
    return reply
