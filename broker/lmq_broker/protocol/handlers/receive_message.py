"""ReceiveMessage: a long poll answered as a stream: one status frame, the messages, a delivery timestamp.

The poll ends before the call's deadline (the Python client's deadline is polling time + request
timeout), so a quiet poll is answered MESSAGE_NOT_FOUND rather than cut off by the client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Final

from lmq_broker import errors, model
from lmq_broker.dispatch import filters
from lmq_broker.protocol import convert, status
from lmq_broker.protocol.context import Caller
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb

DEADLINE_MARGIN_MS: Final = 500  # answer this long before the client gives up on the call
MAX_BATCH: Final = 1024


async def handle(
    edge: Edge, request: spb.ReceiveMessageRequest, caller: Caller, time_remaining_s: float | None
) -> AsyncIterator[spb.ReceiveMessageResponse]:
    client_id = caller.require_client_id()
    group = convert.group_name(request.group)
    name = convert.topic_name(request.message_queue.topic)
    if request.batch_size <= 0 or request.batch_size > MAX_BATCH:
        raise errors.InvalidArgument(f"batch_size must be within 1..{MAX_BATCH}")
    batch = min(request.batch_size, edge.config.receive_batch_size)
    tags = convert.tag_filter(request.filter_expression) if request.HasField("filter_expression") else filters.ALL
    if request.auto_renew:  # the broker renews the lease while the client lives (invisible_duration unused)
        invisible = edge.config.lease_renew_slice_ms
    elif request.HasField("invisible_duration"):
        invisible = convert.invisible_ms(request.invisible_duration, convert.MIN_RECEIVE_INVISIBLE_MS)
    else:
        raise errors.InvalidArgument("invisible_duration is required unless auto_renew", kind="invisible_time")
    poll = edge.config.long_polling_timeout_ms
    if request.HasField("long_polling_timeout"):
        requested = convert.duration_ms(request.long_polling_timeout)
        if request.long_polling_timeout.seconds < 0 or request.long_polling_timeout.nanos < 0:
            raise errors.InvalidArgument("long_polling_timeout must not be negative", kind="polling_time")
        poll = min(poll, requested)
    if time_remaining_s is not None:
        poll = max(0, min(poll, int(time_remaining_s * 1000) - DEADLINE_MARGIN_MS))
    snap = await edge.dispatcher.metadata()
    topic = snap.topic(name)
    if topic.message_type == model.MessageType.LITE:
        deliveries = await edge.dispatcher.receive_lite(
            client_id, group, name, batch=batch, invisible_ms=invisible, poll_ms=poll, auto_renew=request.auto_renew,
            tags=tags,
        )  # fmt: skip
    else:
        deliveries = await edge.dispatcher.receive_normal(
            client_id, group, name, batch=batch, invisible_ms=invisible, poll_ms=poll, auto_renew=request.auto_renew,
            tags=tags,
        )  # fmt: skip
    if not deliveries:
        yield spb.ReceiveMessageResponse(status=pb.Status(code=pb.MESSAGE_NOT_FOUND, message="no new message"))
        return
    namespace = request.message_queue.topic.resource_namespace
    host = edge.store_host
    redelivered = written = 0
    try:
        yield spb.ReceiveMessageResponse(status=status.ok())
        for delivery in deliveries:
            yield spb.ReceiveMessageResponse(message=convert.message_to_pb(delivery, host, namespace))
            written += 1
            redelivered += delivery.attempt > 1
    finally:
        # The call ended before these were written (the client reset its stream or went, a reader too slow for
        # its deadline): they are visible again now, not hidden for their invisible time (renewed, when
        # auto_renew, for as long as the client lives) from a client that never saw them.
        edge.dispatcher.give_back(group, [d.receipt_handle for d in deliveries[written:]])
        edge.metrics.messages_out.inc(written)
        edge.metrics.redeliveries.inc(redelivered)
    yield spb.ReceiveMessageResponse(delivery_timestamp=convert.timestamp_of(edge.dispatcher.wall_clock()))
