"""Telemetry: the client's settings in, the server's settings and notices out; the stream's life is the client's.

Python clients ignore a settings reply without ``status.code == OK``, and copy some fields
unconditionally (a missing ``lite_subscription_quota`` or ``max_body_size`` reads as 0 and makes every
subscribe or send fail locally), so the reply always carries every field the client type reads. When the
last stream of a client closes, the client is removed with all its subscriptions (the proxy does the
same with COMPLETE_REMOVE).

A stream holds no admission slot (it lives as long as its client), so streams have caps of their own
(``protocol.parking``): per client id and per connection, and the bytes of replies queued for clients that
have not read them, over all streams (``--telemetry-buffer-bytes``).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator
from typing import Final

from lmq_broker import errors, model
from lmq_broker.dispatch import metadata
from lmq_broker.protocol import auth, authorizing, convert, status
from lmq_broker.protocol.context import Caller
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb

log = logging.getLogger(__name__)

PRODUCER_MAX_ATTEMPTS: Final = 3  # proxy grpcClientProducerMaxAttempts, backoff 10 ms -> 1 s x2
PRODUCER_BACKOFF_INITIAL_MS: Final = 10
PRODUCER_BACKOFF_MAX_MS: Final = 1000
LITE_TYPES: Final = (pb.LITE_PUSH_CONSUMER, pb.LITE_SIMPLE_CONSUMER)
# Replies not yet written to the client are held for it up to --telemetry-stream-buffer-bytes, each charged at
# least REPLY_MIN_CHARGE_BYTES (so tiny notices are bounded in number too); a client that sends but never reads
# reaches that, and its stream is refused. Its frames are still read (and dropped) after that: a stream that
# stopped reading would leave grpc core to buffer them, unread, up to the flow-control window, which its
# bandwidth probe grows to megabytes per stream (measured: ~8.6 MiB per never-reading stream).
REPLY_MIN_CHARGE_BYTES: Final = 256
REASON_UNREAD: Final = "unread"  # lmq_calls_refused_total's reason: --telemetry-stream-buffer-bytes unread
REASON_BUFFER: Final = "telemetry_buffer"  # lmq_calls_refused_total's reason: --telemetry-buffer-bytes were full


class SettingsRefused(Exception):
    """The client's settings were refused, or the stream itself (beyond a cap of streams or of Telemetry
    buffering: TOO_MANY_REQUESTS); the status frame is sent, then the stream ends with a gRPC error
    (RESOURCE_EXHAUSTED for TOO_MANY_REQUESTS, ``status.grpc_status_of``).

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
    refused = _owned(edge, client_id) or _admit(edge, client_id, caller.peer)
    if refused is not None:
        yield spb.TelemetryCommand(status=refused)
        raise SettingsRefused(refused)
    try:
        async for frame in _serve(edge, requests, caller, client_id):
            yield frame
    finally:
        edge.streams.leave(client_id, caller.peer)


def _owned(edge: Edge, client_id: str) -> pb.Status | None:
    """Under ``--acl``, FORBIDDEN when the client id's lite subscriptions are another user's: its stream would
    carry that client's notices, and its end would end what ends with the client's stream."""
    if not edge.access.enabled:
        return None
    try:
        authorizing.owned(edge.access, edge.dispatcher.subscriber(client_id), client_id, auth.USER.get())
    except errors.Forbidden as exc:
        log.info("Telemetry stream of client %s refused: %s", client_id, exc.message)
        return status.status_of(exc)
    return None


def _admit(edge: Edge, client_id: str, peer: str) -> pb.Status | None:
    """Open one stream of ``client_id`` on ``peer``; or, beyond a cap of streams or while the broker's
    Telemetry replies waiting to be read fill ``--telemetry-buffer-bytes``, the refusal (counted)."""
    buffered = edge.telemetry_buffer
    if buffered.full:
        reason, message = REASON_BUFFER, _buffer_full(buffered.limit)
    else:
        found = edge.streams.admit(client_id, peer)
        if found is None:
            return None
        reason, message = found, edge.streams.refusal(found, client_id)
    edge.metrics.refused("Telemetry", reason)
    log.info("Telemetry stream of client %s on %s refused: %s", client_id, peer, message)
    return pb.Status(code=pb.TOO_MANY_REQUESTS, message=message)


def _buffer_full(limit: int) -> str:
    return f"Telemetry replies not yet read by their clients fill this broker's buffer ({limit} bytes); retry later"


async def _serve(
    edge: Edge, requests: AsyncIterator[spb.TelemetryCommand], caller: Caller, client_id: str
) -> AsyncIterator[spb.TelemetryCommand]:
    notices = edge.dispatcher.stream_opened(client_id)
    edge.connections.opened(client_id, caller.peer)
    out = _Replies(edge)

    async def answer() -> None:
        try:
            async for command in requests:
                if out.refused is not None:
                    continue  # drained, unanswered, so that grpc core does not buffer them (module notes)
                if command.WhichOneof("command") == "settings":
                    reply = await settings_reply(edge, command.settings, caller)
                    out.put(reply)
                    if reply.status.code != pb.OK:
                        raise SettingsRefused(reply.status)
                # thread_stack_trace / verify_message_result answer commands we never send: ignored.
        finally:
            out.close()

    async def relay() -> None:
        while out.refused is None:
            lite = await notices.get()
            out.put(
                spb.TelemetryCommand(notify_unsubscribe_lite_command=spb.NotifyUnsubscribeLiteCommand(lite_topic=lite))
            )

    answering = asyncio.create_task(answer())
    relaying = asyncio.create_task(relay())
    try:
        while (frame := await out.get()) is not None:
            yield frame
        if out.refused is not None:
            raise SettingsRefused(out.refused)
        await answering  # re-raise what ended the client's side, if anything did
    finally:  # what must happen first, with no await before it: a cancel arriving meanwhile cannot skip it
        for task in (answering, relaying):
            task.cancel()
        out.release()
        edge.connections.closed(client_id, caller.peer)
        edge.dispatcher.stream_closed(client_id)
        await asyncio.gather(answering, relaying, return_exceptions=True)


class _Replies:
    """One stream's replies not yet written, their bytes held from ``put`` until written, against the stream's
    cap (``--telemetry-stream-buffer-bytes``) and the broker's (``--telemetry-buffer-bytes``). A reply beyond
    either refuses the stream, counted: it is dropped, as are all later ones, and the stream ends with
    RESOURCE_EXHAUSTED (TOO_MANY_REQUESTS) once its writer is free. A client that reads nothing keeps the
    writer waiting on flow control (grpc.aio can neither cancel a server call nor send a status behind unsent
    data); the stream then lingers, still counted against the caps, holding what it held, until the client
    goes, and its frames are read and dropped meanwhile."""

    def __init__(self, edge: Edge) -> None:
        self._queue: asyncio.Queue[tuple[spb.TelemetryCommand, int] | None] = asyncio.Queue()  # bounded by bytes
        self._edge = edge
        self._limit = edge.config.telemetry_stream_buffer_bytes or sys.maxsize
        self._held = 0
        self._writing = 0
        self.refused: pb.Status | None = None

    def put(self, reply: spb.TelemetryCommand) -> None:
        """Queue ``reply``, unless the stream was refused or this refuses it (then ``refused`` is set)."""
        if self.refused is not None:
            return
        size = max(reply.ByteSize(), REPLY_MIN_CHARGE_BYTES)
        budget = self._edge.telemetry_buffer
        if self._held + size > self._limit:
            self._refuse(REASON_UNREAD, f"the client has not read {self._held} bytes of replies; at most "
                         f"{self._limit} are kept for a stream")  # fmt: skip
        elif not budget.take(size):
            self._refuse(REASON_BUFFER, _buffer_full(budget.limit))
        else:
            self._held += size
            self._queue.put_nowait((reply, size))

    def _refuse(self, reason: str, message: str) -> None:
        self.refused = pb.Status(code=pb.TOO_MANY_REQUESTS, message=message)
        self._edge.metrics.refused("Telemetry", reason)
        log.info("Telemetry stream refused: %s", message)
        self._queue.put_nowait(None)  # a writer waiting for the next reply ends the stream at once

    def close(self) -> None:
        self._queue.put_nowait(None)

    async def get(self) -> spb.TelemetryCommand | None:
        """The next reply to write (the previous one was written), None once the stream ends."""
        self._release(self._writing)
        self._writing = 0
        if self.refused is not None:
            return None
        item = await self._queue.get()
        if item is None or self.refused is not None:
            return None
        reply, self._writing = item
        return reply

    def release(self) -> None:
        """The stream ended: what it held is given back, and its replies dropped here rather than left to the
        garbage collector (the exception that ended a stream can tie its frames, and this, into a reference
        cycle that only a full collection frees)."""
        while not self._queue.empty():
            self._queue.get_nowait()
        self._release(self._held)

    def _release(self, size: int) -> None:
        self._held -= size
        self._edge.telemetry_buffer.give(size)


async def settings_reply(edge: Edge, settings: pb.Settings, caller: Caller) -> spb.TelemetryCommand:
    try:
        if edge.access.enabled:
            authorizing.settings(edge.access, auth.USER.get(), caller.peer, settings)
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
