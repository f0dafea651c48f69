"""Telemetry: the client's settings in, the server's settings and notices out; the stream's life is the client's.

Python clients ignore a settings reply without ``status.code == OK``, and copy some fields
unconditionally (a missing ``lite_subscription_quota`` or ``max_body_size`` reads as 0 and makes every
subscribe or send fail locally), so the reply always carries every field the client type reads. When the
last stream of a client closes, the client is removed with all its subscriptions (the proxy does the
same with COMPLETE_REMOVE).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Final

from lmq_broker import errors, model
from lmq_broker.dispatch import metadata
from lmq_broker.protocol import convert, status
from lmq_broker.protocol.context import Caller
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb

log = logging.getLogger(__name__)

PRODUCER_MAX_ATTEMPTS: Final = 3  # proxy grpcClientProducerMaxAttempts, backoff 10 ms -> 1 s x2
PRODUCER_BACKOFF_INITIAL_MS: Final = 10
PRODUCER_BACKOFF_MAX_MS: Final = 1000
LITE_TYPES: Final = (pb.LITE_PUSH_CONSUMER, pb.LITE_SIMPLE_CONSUMER)
# Replies not yet written to the client. A client that sends but never reads fills it; the stream then stops
# reading the client's frames, and HTTP/2 flow control holds the client back: memory stays bounded.
REPLY_BACKLOG: Final = 8


class SettingsRefused(Exception):
    """The client's settings were refused (status frame sent); the stream then ends with a gRPC error.

    Clients read a refusal differently: Node reports the status frame; Java ignores a frame without
    settings but fails its start on a stream error, whose message names the v2 code."""

    def __init__(self, status: pb.Status) -> None:
        super().__init__(status.message)
        self.status = status


async def handle(
    edge: Edge, requests: AsyncIterator[spb.TelemetryCommand], caller: Caller
) -> AsyncIterator[spb.TelemetryCommand]:
    """Two sources feed the stream: replies to the client's commands, and server notices (a lite topic an
    exclusive group gave to another client: NotifyUnsubscribeLiteCommand)."""
    client_id = caller.require_client_id()
    notices = edge.dispatcher.stream_opened(client_id)
    edge.connections.opened(client_id, caller.peer)
    out: asyncio.Queue[spb.TelemetryCommand | None] = asyncio.Queue(maxsize=REPLY_BACKLOG)

    async def answer() -> None:
        try:
            async for command in requests:
                if command.WhichOneof("command") == "settings":
                    reply = await settings_reply(edge, command.settings, caller)
                    await out.put(reply)
                    if reply.status.code != pb.OK:
                        raise SettingsRefused(reply.status)
                # thread_stack_trace / verify_message_result answer commands we never send: ignored.
        finally:
            await out.put(None)

    async def relay() -> None:
        while True:
            lite = await notices.get()
            await out.put(
                spb.TelemetryCommand(notify_unsubscribe_lite_command=spb.NotifyUnsubscribeLiteCommand(lite_topic=lite))
            )

    answering = asyncio.create_task(answer())
    relaying = asyncio.create_task(relay())
    try:
        while (frame := await out.get()) is not None:
            yield frame
        await answering  # re-raise what ended the client's side, if anything did
    finally:
        for task in (answering, relaying):
            task.cancel()
        await asyncio.gather(answering, relaying, return_exceptions=True)
        edge.connections.closed(client_id, caller.peer)
        edge.dispatcher.stream_closed(client_id)


async def settings_reply(edge: Edge, settings: pb.Settings, caller: Caller) -> spb.TelemetryCommand:
    try:
        merged = await _merge(edge, settings, caller)
    except errors.LmqError as exc:
        log.info("settings of client %s refused: %s", caller.client_id, exc.message)
        return spb.TelemetryCommand(status=status.status_of(exc))
    return spb.TelemetryCommand(status=status.ok(), settings=merged)


def _lite_group_of(snap: metadata.Metadata, group: str, topic: str, caller: Caller) -> model.LiteGroup:
    """The lite group a consumer's settings name. An unknown group is refused with CONSUMER_GROUP_NOT_FOUND,
    which fails the start of every client that can report a failed start; a client that cannot
    (``Caller.hides_failed_start``) gets the default settings instead and the same status from its
    SyncLiteSubscription, QueryAssignment and ReceiveMessage calls."""
    try:
        return snap.lite_group(group, topic)
    except errors.GroupNotFound:
        if not caller.hides_failed_start:
            raise
        log.info(
            "lite group %s of client %s does not exist; its first subscription will say so", group, caller.client_id
        )
        return model.LiteGroup(group, topic)


async def _merge(edge: Edge, settings: pb.Settings, caller: Caller) -> pb.Settings:
    kind = convert.client_type(settings.client_type)
    config = edge.config
    reply = pb.Settings()
    reply.CopyFrom(settings)
    dispatcher = edge.dispatcher
    if kind == pb.PRODUCER:
        if settings.WhichOneof("pub_sub") == "subscription":
            raise errors.InvalidArgument("a producer sends publishing settings", kind="client_type")
        reply.publishing.max_body_size = config.max_body_bytes
        reply.publishing.validate_message_type = True
        policy = reply.backoff_policy
        policy.max_attempts = PRODUCER_MAX_ATTEMPTS
        policy.exponential_backoff.initial.CopyFrom(convert.duration_of(PRODUCER_BACKOFF_INITIAL_MS))
        policy.exponential_backoff.max.CopyFrom(convert.duration_of(PRODUCER_BACKOFF_MAX_MS))
        policy.exponential_backoff.multiplier = 2.0
        dispatcher.client_seen(caller.client_id, client_type=kind, language=caller.language, version=caller.version)
        return reply
    if settings.WhichOneof("pub_sub") != "subscription":
        raise errors.InvalidArgument("a consumer sends subscription settings", kind="client_type")
    sub = settings.subscription
    group = convert.group_name(sub.group)
    topics = [convert.topic_name(entry.topic) for entry in sub.subscriptions]
    snap = await dispatcher.metadata()
    if kind in LITE_TYPES:
        if len(topics) != 1:
            raise errors.InvalidArgument("a lite consumer subscribes exactly one bind topic", kind="topic")
        found = _lite_group_of(snap, group, topics[0], caller)
        quota = snap.advertised_client_quota(found, topics[0], caller.namespace)
        dispatcher.client_seen(
            caller.client_id, client_type=kind, group=group, bind_topic=topics[0],
            language=caller.language, version=caller.version,
        )  # fmt: skip
    else:
        found = model.LiteGroup(name=group, bind_topic="", fifo=False)
        for topic in topics:
            found = snap.normal_group(group, topic)
        quota = 0
        dispatcher.client_seen(
            caller.client_id, client_type=kind, group=group, topics=topics,
            language=caller.language, version=caller.version,
        )  # fmt: skip
    rs = reply.subscription
    rs.fifo = found.fifo
    rs.receive_batch_size = config.receive_batch_size
    if kind not in (pb.SIMPLE_CONSUMER, pb.LITE_SIMPLE_CONSUMER) or not sub.HasField("long_polling_timeout"):
        rs.long_polling_timeout.CopyFrom(convert.duration_of(config.long_polling_timeout_ms))
    if kind in LITE_TYPES:
        rs.lite_subscription_quota = quota
        rs.max_lite_topic_size = config.max_lite_topic_size
    _consumer_backoff(reply.backoff_policy, found.retry, settings.user_agent.language)
    return reply


def _consumer_backoff(policy: pb.RetryPolicy, retry: model.RetryPolicy, language: int) -> None:
    """The group's retry schedule as RocketMQ's proxy sends it: a customized backoff (Python reads only
    that one). The Node client (1.0.8) reads only an exponential backoff and, without one, gives up after
    the first failed consumption (straight to the DLQ), so it gets the schedule's exponential envelope:
    its first and last delay, doubling in between."""
    policy.Clear()
    policy.max_attempts = retry.max_attempts
    if language == pb.NODE_JS:
        policy.exponential_backoff.initial.CopyFrom(convert.duration_of(retry.backoff_ms[0]))
        policy.exponential_backoff.max.CopyFrom(convert.duration_of(retry.backoff_ms[-1]))
        policy.exponential_backoff.multiplier = 2.0
        return
    policy.customized_backoff.next.extend(convert.duration_of(ms) for ms in retry.backoff_ms)
