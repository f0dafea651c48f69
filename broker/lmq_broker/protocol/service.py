"""The apache.rocketmq.v2 MessagingService: routing each call to its handler, errors to status codes.

This wrapper is the edge: a handler raises ``lmq_broker.errors`` values; whatever escapes becomes the
response's ``status`` through ``status.code_of`` (unexpected exceptions: INTERNAL_ERROR, logged), so no
request can crash the server or leave the client without a status. RPCs this broker does not serve
answer NOT_IMPLEMENTED in their status.

In a cluster (``Edge.cluster`` set, ``protocol.calls``) the calls that reach other brokers go to the cluster's
implementation; this module is the one place that chooses.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar, cast

import grpc
from google.protobuf import message as pb_message
from typing_extensions import override

from lmq_broker import errors
from lmq_broker.protocol import authorizing, revoking, status, wire
from lmq_broker.protocol.context import Caller, metadata_of
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc
from lmq_broker.protocol.handlers import (
    ack_message,
    change_invisible_duration,
    forward_to_dead_letter_queue,
    heartbeat,
    notify_client_termination,
    query_assignment,
    query_route,
    receive_message,
    send_message,
    sync_lite_subscription,
    telemetry,
)
from lmq_broker.protocol.refusals import RefusalLog

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # generic only in grpc's type stubs
    Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]


class _Reply(Protocol):
    @property
    def status(self) -> pb.Status: ...


Req = TypeVar("Req", bound=pb_message.Message)
Resp = TypeVar("Resp", bound=pb_message.Message)
Check = Callable[[authorizing.Peer], object]  # (how to read the call's peer) -> None or an awaitable; raises: refused


async def _after(checking: Awaitable[object], answer: Callable[[], Awaitable[Resp]]) -> Resp:
    """``answer()`` once ``checking`` passed: the handler's coroutine is not even made for a refused call."""
    await checking
    return await answer()


async def _raising(exc: Exception) -> Any:
    raise exc


def _waits(request: spb.ReceiveMessageRequest) -> bool:
    """Whether a receive may park: all do but those that ask not to wait (a cluster peer's gathering calls)."""
    timeout = request.long_polling_timeout
    return not request.HasField("long_polling_timeout") or timeout.seconds > 0 or timeout.nanos > 0


class MessagingService(service_pb2_grpc.MessagingServiceServicer):
    """``external``: the service of the external listener (``--external-port``), whose routes and assignments
    name the brokers by their external addresses; every other call is served exactly as on the internal one."""

    def __init__(self, edge: Edge, *, external: bool = False) -> None:
        self.edge = edge
        self.external = external
        self.refusals = RefusalLog()
        self.gate = authorizing.Gate(
            edge.access, revoking.Revoker(edge, edge.access), edge.dispatcher.subscriber, self._wildcard_reach
        )

    async def _wildcard_reach(self, group: str, parent: str) -> tuple[str, ...] | None:
        """What a client of ``group`` receives when it is a wildcard group of ``parent``: its lite patterns, or
        ``*`` (every lite topic); None for any other group (or none: the handler answers that)."""
        snap = await self.edge.dispatcher.metadata()
        try:
            found = snap.lite_group(group, parent)
        except errors.LmqError:
            return None
        return (found.lite_patterns or ("*",)) if found.wildcard else None

    def _guard(self, context: Context, check: Check, answer: Callable[[], Awaitable[Resp]]) -> Awaitable[Resp]:
        """``answer()``, after ``check`` when access control is on (``--acl``); a refusal, as an awaitable that
        raises it, for ``_answer`` to turn into the response's status."""
        if not self.gate.enabled:
            return answer()
        try:
            checking = check(context.peer)
        except errors.LmqError as exc:
            return cast("Awaitable[Resp]", _raising(exc))
        if checking is None:  # the consumer and producer checks are plain calls: no isawaitable (an ABC check)
            return answer()
        if inspect.isawaitable(checking):
            return _after(checking, answer)
        return answer()

    async def _unary(
        self,
        method: str,
        handler: Callable[[Edge, Req, Caller], Awaitable[Resp]],
        request: Req,
        context: Context,
        response: type[Resp],
        *,
        check: Check | None = None,
    ) -> Resp:
        caller = Caller.of(metadata_of(context), external=self.external)
        if check is not None:
            return await self._answer(
                method, self._guard(context, check, lambda: handler(self.edge, request, caller)), response
            )
        return await self._answer(method, handler(self.edge, request, caller), response)

    async def _answer(self, method: str, answering: Awaitable[Resp], response: type[Resp]) -> Resp:
        started = time.perf_counter()
        try:
            reply = await answering
        except Exception as exc:
            if status.code_of(exc) == pb.INTERNAL_ERROR and not isinstance(exc, errors.BrokerUnavailable):
                log.exception("%s failed", method)  # a peer that does not answer is counted, not logged per call
            reply = response(status=status.status_of(exc))
            refused = cast("_Reply", reply).status
            if refused.code != pb.INTERNAL_ERROR and not isinstance(exc, errors.BrokerUnavailable):
                self.refusals.note(method, refused.code, refused.message)
        self.edge.metrics.observe(method, cast("_Reply", reply).status.code, time.perf_counter() - started)
        return reply

    async def _not_implemented(self, method: str, response: type[Resp]) -> Resp:
        self.edge.metrics.observe(method, pb.NOT_IMPLEMENTED, 0.0)
        return response(status=pb.Status(code=pb.NOT_IMPLEMENTED, message=f"{method} is not implemented by lmq"))

    # --- served -----------------------------------------------------------------------------------------
    @override
    async def QueryRoute(self, request: spb.QueryRouteRequest, context: Context) -> spb.QueryRouteResponse:
        gate = self.gate
        return await self._unary(
            "QueryRoute",
            query_route.handle,
            request,
            context,
            spb.QueryRouteResponse,
            check=lambda peer: gate.route(peer, request),
        )

    @override
    async def Heartbeat(self, request: spb.HeartbeatRequest, context: Context) -> spb.HeartbeatResponse:
        gate = self.gate  # another user's client id is not kept alive (nor its type or group changed) by this one
        return await self._unary(
            "Heartbeat",
            heartbeat.handle,
            request,
            context,
            spb.HeartbeatResponse,
            check=lambda peer: gate.owned(Caller.of(metadata_of(context))),
        )

    @override
    async def SendMessage(
        self, request: spb.SendMessageRequest | wire.Sent, context: Context
    ) -> spb.SendMessageResponse:
        # Who sends does not matter to a send alone: auth, when configured, has checked the signature already (under
        # --acl in the handler finder, ``guard.Messaging``, which left the call's user in ``auth.USER``), and
        # ``Gate.send`` looks the user up with the message's topic: the send path's one check, no closure.
        # ``--send-path raw``: the request comes with its wire bytes, for the cluster to forward parts of.
        data = None
        if isinstance(request, wire.Sent):
            data = request.data
            request = request.request
        cluster = self.edge.cluster
        if self.gate.enabled:
            try:
                self.gate.send(context.peer, request)
            except errors.LmqError as exc:
                return await self._answer("SendMessage", _raising(exc), spb.SendMessageResponse)
        if cluster is not None:
            return await self._answer(
                "SendMessage", cluster.send(request, context.invocation_metadata, data), spb.SendMessageResponse
            )
        return await self._answer("SendMessage", send_message.handle(self.edge, request), spb.SendMessageResponse)

    @override
    async def QueryAssignment(
        self, request: spb.QueryAssignmentRequest, context: Context
    ) -> spb.QueryAssignmentResponse:
        gate = self.gate
        return await self._unary(
            "QueryAssignment",
            query_assignment.handle,
            request,
            context,
            spb.QueryAssignmentResponse,
            check=lambda peer: gate.consume(peer, request.group.name, request.topic.name),
        )

    @override
    async def ReceiveMessage(
        self, request: spb.ReceiveMessageRequest, context: Context
    ) -> AsyncIterator[spb.ReceiveMessageResponse]:
        started: float | None = time.perf_counter()
        code: int = pb.OK
        parked: tuple[str, str] | None = None
        frames: AsyncIterator[spb.ReceiveMessageResponse] | None = None
        try:
            metadata = metadata_of(context)
            caller = Caller.of(metadata)
            if self.gate.enabled:
                topic = request.message_queue.topic.name
                self.gate.consume(context.peer, request.group.name, topic)
                caller = self.gate.acting(caller, metadata)
                self.gate.owned(caller)  # deliveries follow the client id: another user's is not this one's
            if caller.client_id and _waits(request):
                parked = (caller.client_id, context.peer())
                refused = self._park_poll(*parked)
                if refused is not None:  # counted in lmq_calls_refused_total, not as a call served
                    parked, started = None, None
                    yield spb.ReceiveMessageResponse(status=refused)
                    return
            cluster = self.edge.cluster
            if cluster is not None:
                frames = cluster.receive(request, caller, context.invocation_metadata, context.time_remaining())
            else:
                frames = receive_message.handle(self.edge, request, caller, context.time_remaining())
            async for frame in frames:
                if frame.HasField("status"):
                    code = frame.status.code
                yield frame
        except Exception as exc:
            code = status.code_of(exc)
            if code == pb.INTERNAL_ERROR:
                log.exception("ReceiveMessage failed")
            refused = status.status_of(exc)
            if code != pb.INTERNAL_ERROR and not isinstance(exc, errors.BrokerUnavailable):
                self.refusals.note("ReceiveMessage", refused.code, refused.message)
            yield spb.ReceiveMessageResponse(status=refused)
        finally:
            if frames is not None:  # ended at a frame (the call went): the receive gives back what it did not write
                await cast("AsyncGenerator[spb.ReceiveMessageResponse, None]", frames).aclose()
            if parked is not None:
                self.edge.polls.leave(*parked)
            if started is not None:
                self.edge.metrics.observe("ReceiveMessage", code, time.perf_counter() - started)

    def _park_poll(self, client_id: str, peer: str) -> pb.Status | None:
        """Count one long poll of ``client_id`` on ``peer`` as parked; or, beyond a cap, the TOO_MANY_REQUESTS
        status it is answered with (as the official clients read a throttled receive: TooManyRequestsException,
        then a retry after their backoff), counted."""
        polls = self.edge.polls
        reason = polls.admit(client_id, peer)
        if reason is None:
            return None
        self.edge.metrics.refused("ReceiveMessage", reason)
        return pb.Status(code=pb.TOO_MANY_REQUESTS, message=polls.refusal(reason, client_id))

    @override
    async def AckMessage(self, request: spb.AckMessageRequest, context: Context) -> spb.AckMessageResponse:
        cluster, gate = self.edge.cluster, self.gate

        def check(peer: authorizing.Peer) -> None:
            gate.ack(peer, request)

        if cluster is not None:
            caller = Caller.of(metadata_of(context), external=self.external)
            acking = self._guard(context, check, lambda: cluster.ack(request, caller))
            return await self._answer("AckMessage", acking, spb.AckMessageResponse)
        return await self._unary(
            "AckMessage", ack_message.handle, request, context, spb.AckMessageResponse, check=check
        )

    @override
    async def ForwardMessageToDeadLetterQueue(
        self, request: spb.ForwardMessageToDeadLetterQueueRequest, context: Context
    ) -> spb.ForwardMessageToDeadLetterQueueResponse:
        cluster, gate = self.edge.cluster, self.gate

        def check(peer: authorizing.Peer) -> None:
            gate.consume(peer, request.group.name, request.topic.name, request.lite_topic)

        if cluster is not None:
            caller = Caller.of(metadata_of(context), external=self.external)
            return await self._answer(
                "ForwardMessageToDeadLetterQueue",
                self._guard(context, check, lambda: cluster.dead_letter(request, caller)),
                spb.ForwardMessageToDeadLetterQueueResponse,
            )
        return await self._unary(
            "ForwardMessageToDeadLetterQueue",
            forward_to_dead_letter_queue.handle,
            request,
            context,
            spb.ForwardMessageToDeadLetterQueueResponse,
            check=check,
        )

    @override
    async def Telemetry(
        self, request_iterator: AsyncIterator[spb.TelemetryCommand], context: Context
    ) -> AsyncIterator[spb.TelemetryCommand]:
        caller = Caller.of(metadata_of(context), context.peer())
        try:
            async for frame in telemetry.handle(self.edge, request_iterator, caller):
                yield frame
        except telemetry.SettingsRefused as refused:
            # The status is set and the handler returns, rather than ``context.abort``: grpc keeps the exception
            # abort raises on the call, tied in a reference cycle with every frame of the stream and what they
            # hold, until a full garbage collection.
            context.set_code(status.grpc_status_of(refused.status.code))
            context.set_details(status.describe(refused.status))
        except grpc.aio.AbortError:
            raise  # the call's status is set (a frame that is not a TelemetryCommand: INVALID_ARGUMENT), not a failure
        except Exception as exc:
            if status.code_of(exc) == pb.INTERNAL_ERROR:
                log.exception("Telemetry failed")
            yield spb.TelemetryCommand(status=status.status_of(exc))

    @override
    async def NotifyClientTermination(
        self, request: spb.NotifyClientTerminationRequest, context: Context
    ) -> spb.NotifyClientTerminationResponse:
        metadata = metadata_of(context)
        caller = Caller.of(metadata, context.peer())  # only the client's own connection
        gate = self.gate
        if gate.enabled:  # nor another user's client id (whose stream may not be open)
            caller = gate.acting(caller, metadata)
        return await self._answer(
            "NotifyClientTermination",
            self._guard(
                context,
                lambda peer: gate.owned(caller),
                lambda: notify_client_termination.handle(self.edge, request, caller),
            ),
            spb.NotifyClientTerminationResponse,
        )

    @override
    async def ChangeInvisibleDuration(
        self, request: spb.ChangeInvisibleDurationRequest, context: Context
    ) -> spb.ChangeInvisibleDurationResponse:
        cluster, gate = self.edge.cluster, self.gate

        def check(peer: authorizing.Peer) -> None:
            gate.consume(peer, request.group.name, request.topic.name, request.lite_topic)

        if cluster is not None:
            caller = Caller.of(metadata_of(context), external=self.external)
            return await self._answer(
                "ChangeInvisibleDuration",
                self._guard(context, check, lambda: cluster.change_invisible(request, caller)),
                spb.ChangeInvisibleDurationResponse,
            )
        return await self._unary(
            "ChangeInvisibleDuration",
            change_invisible_duration.handle,
            request,
            context,
            spb.ChangeInvisibleDurationResponse,
            check=check,
        )

    @override
    async def SyncLiteSubscription(
        self, request: spb.SyncLiteSubscriptionRequest, context: Context
    ) -> spb.SyncLiteSubscriptionResponse:
        cluster, gate = self.edge.cluster, self.gate
        metadata = metadata_of(context)
        caller = Caller.of(metadata, external=self.external)
        if gate.enabled:
            caller = gate.acting(caller, metadata, context.peer)  # named to the parts' owners (``cluster.links``)
        max_chars = self.edge.config.max_lite_topic_size

        def check(peer: authorizing.Peer) -> Awaitable[None]:
            return gate.sync_lite(peer, request, caller, max_chars)

        if cluster is not None:
            return await self._answer(
                "SyncLiteSubscription",
                self._guard(context, check, lambda: cluster.sync_lite(request, caller, context.invocation_metadata)),
                spb.SyncLiteSubscriptionResponse,
            )
        return await self._unary(
            "SyncLiteSubscription",
            sync_lite_subscription.handle,
            request,
            context,
            spb.SyncLiteSubscriptionResponse,
            check=check,
        )

    # --- not served -------------------------------------------------------------------------------------
    @override
    async def PullMessage(
        self, request: spb.PullMessageRequest, context: Context
    ) -> AsyncIterator[spb.PullMessageResponse]:
        yield await self._not_implemented("PullMessage", spb.PullMessageResponse)

    @override
    async def UpdateOffset(self, request: spb.UpdateOffsetRequest, context: Context) -> spb.UpdateOffsetResponse:
        return await self._not_implemented("UpdateOffset", spb.UpdateOffsetResponse)

    @override
    async def GetOffset(self, request: spb.GetOffsetRequest, context: Context) -> spb.GetOffsetResponse:
        return await self._not_implemented("GetOffset", spb.GetOffsetResponse)

    @override
    async def QueryOffset(self, request: spb.QueryOffsetRequest, context: Context) -> spb.QueryOffsetResponse:
        return await self._not_implemented("QueryOffset", spb.QueryOffsetResponse)

    @override
    async def EndTransaction(self, request: spb.EndTransactionRequest, context: Context) -> spb.EndTransactionResponse:
        return await self._not_implemented("EndTransaction", spb.EndTransactionResponse)

    @override
    async def RecallMessage(self, request: spb.RecallMessageRequest, context: Context) -> spb.RecallMessageResponse:
        return await self._not_implemented("RecallMessage", spb.RecallMessageResponse)
