"""SendMessage: validate every message, append the whole request in one store call, answer per message.

A request is all or nothing: one invalid message rejects the request and nothing is stored (the status
carries that message's code). Several messages per request share one append and so one fsync.

The reply of an n-message request is parsed from a template of n OK entries (``status.ok_send_reply``) and
then filled in.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from operator import attrgetter

from lmq_broker import errors, model
from lmq_broker.protocol import convert, status
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb

MAX_MESSAGES_PER_REQUEST = 10_000
_type_of = attrgetter("message_type")


async def handle(edge: Edge, request: spb.SendMessageRequest) -> spb.SendMessageResponse:
    refuse_internal_properties(request.messages)
    return await store(edge, request.messages)


def refuse_internal_properties(sent: Sequence[pb.Message]) -> None:
    """``model.EMPTY_BODY_PROPERTY`` marks an empty MQTT publish, stored on this broker or sent on by a peer with
    its peer header; a client's message that carries it is refused (so a client cannot store an empty body)."""
    marker = model.EMPTY_BODY_PROPERTY
    for m in sent:
        if marker in m.user_properties:
            raise errors.InvalidArgument(f"user property {marker} is reserved for the broker", kind="property")


async def store(edge: Edge, sent: Sequence[pb.Message]) -> spb.SendMessageResponse:
    """``handle`` of a request's messages (a cluster stores its part of a request without copying it out)."""
    if not sent:
        raise errors.InvalidArgument("no messages to send")
    if len(sent) > MAX_MESSAGES_PER_REQUEST:
        raise errors.InvalidArgument(f"at most {MAX_MESSAGES_PER_REQUEST} messages per request")
    dispatcher = edge.dispatcher
    snap = await dispatcher.metadata()
    reader = convert.MessageReader(
        snap, edge.config, dispatcher.wall_clock(), dispatcher.next_round_robin(), edge.send_cache
    )
    messages = reader.read_all(sent)
    results = await dispatcher.send(messages)
    kinds = set(map(_type_of, messages))  # counted in C, not per message in Python
    if len(kinds) == 1:
        edge.metrics.stored(kinds.pop().name, len(messages))
    else:
        for kind, n in Counter(map(_type_of, messages)).items():
            edge.metrics.stored(kind.name, n)
    return reply(results)


def reply(results: list[model.AppendResult]) -> spb.SendMessageResponse:
    """OK, and per message: OK, its id and its offset (in its last queue: the LMQ of a LITE message)."""
    out = status.ok_send_reply(len(results))
    for entry, result in zip(out.entries, results, strict=True):
        entry.message_id = result.message_id
        entry.offset = result.queue_offsets[-1]
    return out
