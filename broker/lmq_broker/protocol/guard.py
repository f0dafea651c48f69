"""The v2 service's method handlers, registered by hand so undecodable requests get a v2 answer.

grpc-python answers a request whose bytes do not parse as the method's message with status UNKNOWN and a
Python exception text. Here each method's deserializer catches the decode error, and its behaviour answers
such a request the v2 way: a response whose ``status`` is BAD_REQUEST (unary and server-streaming methods,
what the official clients read), or gRPC INVALID_ARGUMENT for the client-streaming Telemetry. With ``--send-path raw``
SendMessage has no deserializer: its wrapper decodes the bytes itself, with the same catch, and hands on both
(``wire.Sent``), so that a cluster forwards parts of what the client sent. This is done
when the handlers are built, not in an interceptor: an interceptor would run Python code on every call
before the handler is even found, and the send path is where every microsecond counts.

The same wrappers admit calls (``admission``): a call beyond the broker's cap is answered here, before its
handler runs, with the v2 status TOO_MANY_REQUESTS where the response has a status, else gRPC
RESOURCE_EXHAUSTED. Under ``--acl`` the handler finder (``Messaging``) checks the call's signature
(``authenticate``, an ``auth.Verifier`` over the users' key pairs) on the headers grpc read to find the handler,
and answers a call that is not signed by a user as ``auth.AuthInterceptor`` does (UNAUTHORIZED in the v2
status; Telemetry: gRPC UNAUTHENTICATED), with a handler of its own: not in a server interceptor, which costs
every call one more coroutine, nor with a second read of the headers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import grpc
from google.protobuf import message as pb_message
from google.protobuf import message_factory

from lmq_broker.protocol import wire
from lmq_broker.protocol.admission import Admission
from lmq_broker.protocol.context import METADATA
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2

if TYPE_CHECKING:  # grpc's classes are generic only in the type stubs
    Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]
    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]
    _GenericHandler: TypeAlias = grpc.GenericRpcHandler[Any, Any]
else:
    _GenericHandler = grpc.GenericRpcHandler

SERVICE: Final = "apache.rocketmq.v2.MessagingService"
_NO_FRAMES: Final[tuple[Any, ...]] = ()
Authenticate: TypeAlias = Callable[[Iterable[tuple[str, str | bytes]] | None], str | None]  # -> why not, or None


class _Undecodable:
    def __init__(self, why: str) -> None:
        self.why = why


def _tolerant(method: str, decode: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def tolerant(data: bytes) -> Any:
        try:
            return decode(data)
        except pb_message.DecodeError as exc:
            return _Undecodable(f"request is not a valid {method} message: {exc}")

    return tolerant


_decode_send: Final = _tolerant("SendMessage", wire.sent)


def decode_send(data: bytes) -> wire.Sent | str:
    """A client's SendMessage bytes decoded as the client port decodes them, or why they do not decode (the
    BAD_REQUEST message it answers): for a send a sibling's native edge forwarded (``cluster.native_forward``)."""
    sent = _decode_send(data)
    return sent.why if isinstance(sent, _Undecodable) else sent


def generic_handler(
    servicer: object,
    admission: Admission | None = None,
    authenticate: Authenticate | None = None,
    *,
    raw_send: bool = False,
) -> grpc.GenericRpcHandler[Any, Any]:
    """Every MessagingService method of ``servicer`` (async methods named as in the proto), admitted by
    ``admission`` (none: no cap), and signed as ``authenticate`` wants (none: unchecked here). ``raw_send``:
    SendMessage takes the request's bytes (no deserializer) and hands its behaviour a ``wire.Sent``, the request
    decoded here with those bytes (``--send-path raw``); a request that does not decode is answered alike."""
    admission = admission or Admission(0)
    service = service_pb2.DESCRIPTOR.services_by_name["MessagingService"]
    handlers: dict[str, Handler] = {}
    for method in service.methods:
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        behaviour = getattr(servicer, method.name)
        decode = _tolerant(method.name, request.FromString)
        encode = response.SerializeToString
        has_status = "status" in method.output_type.fields_by_name
        path = f"/{SERVICE}/{method.name}"
        if method.client_streaming:
            handlers[path] = grpc.stream_stream_rpc_method_handler(
                _bidi(behaviour, method.name, admission), request_deserializer=decode, response_serializer=encode
            )
        elif method.server_streaming:
            handlers[path] = grpc.unary_stream_rpc_method_handler(
                _streamed(behaviour, response if has_status else None, method.name, admission),
                request_deserializer=decode,
                response_serializer=encode,
            )
        elif raw_send and method.name == "SendMessage":
            handlers[path] = grpc.unary_unary_rpc_method_handler(
                _unary(behaviour, response, method.name, admission, _tolerant(method.name, wire.sent)),
                response_serializer=encode,
            )
        else:
            handlers[path] = grpc.unary_unary_rpc_method_handler(
                _unary(behaviour, response, method.name, admission),
                request_deserializer=decode,
                response_serializer=encode,
            )
    return Messaging(handlers, authenticate)


class Messaging(_GenericHandler):
    """The v2 methods' handlers by method path, and where each call's headers are read and its signature checked.

    grpc has read the call's headers already, to find its handler (``HandlerCallDetails``); reading them again
    (``context.invocation_metadata()``) would build them anew, a tuple of tuples of ``str`` per call. So they are
    taken here, left in ``context.METADATA`` for the service (the headers of unsigned calls too), and under
    ``--acl`` checked here: ``authenticate`` leaves the call's user in ``auth.USER``. grpc asks ``service`` in the
    task the call then runs in, so what it sets is the call's own."""

    def __init__(self, handlers: Mapping[str, Handler], authenticate: Authenticate | None = None) -> None:
        self._handlers = dict(handlers)
        self._authenticate = authenticate

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        handler = self._handlers.get(handler_call_details.method)
        if handler is None:
            return None
        metadata = handler_call_details.invocation_metadata
        METADATA.set(metadata)
        authenticate = self._authenticate
        if authenticate is None or (why := authenticate(metadata)) is None:
            return handler
        return _unauthorized_handler(handler_call_details.method, handler, why)


def _unauthorized_handler(path: str, handler: Handler, why: str) -> Handler:
    """A handler of ``handler``'s shape answering as ``auth.AuthInterceptor`` does: UNAUTHORIZED in the v2 status
    where the response has one, else gRPC UNAUTHENTICATED (Telemetry)."""
    method = service_pb2.DESCRIPTOR.services_by_name["MessagingService"].methods_by_name[path.rpartition("/")[2]]
    serializer = handler.response_serializer
    if method.client_streaming or "status" not in method.output_type.fields_by_name:

        async def abort(requests: Any, context: Context) -> AsyncIterator[Any]:
            for frame in _NO_FRAMES:  # a generator, as the method's own handler: both edges iterate it
                yield frame
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"unauthorized: {why}")

        return grpc.stream_stream_rpc_method_handler(abort, response_serializer=serializer)
    answer = _unauthorized(message_factory.GetMessageClass(method.output_type), why)
    if method.server_streaming:

        async def streamed(request: Any, context: Context) -> AsyncIterator[Any]:
            yield answer

        return grpc.unary_stream_rpc_method_handler(streamed, response_serializer=serializer)

    async def unary(request: Any, context: Context) -> Any:
        return answer

    return grpc.unary_unary_rpc_method_handler(unary, response_serializer=serializer)


def _bad_request(response: type[pb_message.Message], why: str) -> Any:
    return response(status=pb.Status(code=pb.BAD_REQUEST, message=why))


def _too_many_requests(response: type[pb_message.Message], admission: Admission) -> Any:
    return response(status=pb.Status(code=pb.TOO_MANY_REQUESTS, message=admission.message))


def _unauthorized(response: type[pb_message.Message], why: str) -> Any:
    return response(status=pb.Status(code=pb.UNAUTHORIZED, message=f"unauthorized: {why}"))


def _unary(
    behaviour: Any,
    response: type[pb_message.Message],
    name: str,
    admission: Admission,
    decode: Callable[[bytes], Any] | None = None,
) -> Any:
    """``decode``: the request arrives as bytes (no deserializer) and is decoded here, once admitted."""
    refusal = _too_many_requests(response, admission)  # built once: only ever serialized

    async def unary(request: Any, context: Context) -> Any:
        if not admission.enter():
            admission.refuse(name)
            return refusal
        try:
            if decode is not None:
                request = decode(request)
            if isinstance(request, _Undecodable):
                return _bad_request(response, request.why)
            return await behaviour(request, context)
        finally:
            admission.leave()

    return unary


def _streamed(behaviour: Any, response: type[pb_message.Message] | None, name: str, admission: Admission) -> Any:
    # A long poll (ReceiveMessage) is refused when the broker is full but holds no slot while it waits.
    refusal = None if response is None else _too_many_requests(response, admission)

    async def streamed(request: Any, context: Context) -> AsyncIterator[Any]:
        if admission.full:
            admission.refuse(name)
            if refusal is None:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, admission.message)
            else:
                yield refusal
            return
        if isinstance(request, _Undecodable):
            if response is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
            else:
                yield _bad_request(response, request.why)
            return
        async for frame in behaviour(request, context):
            yield frame

    return streamed


def _bidi(behaviour: Any, name: str, admission: Admission) -> Any:
    # Telemetry lives as long as its client: refused at its start when the broker is full, then holds no slot.
    async def bidi(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
        if admission.full:
            admission.refuse(name)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, admission.message)

        async def checked() -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
                yield request

        async for frame in behaviour(checked(), context):
            yield frame

    return bidi


def strict_generic_handler(
    service: Any, servicer: object, admission: Admission | None = None, *, waits: frozenset[str] = frozenset()
) -> grpc.GenericRpcHandler[Any, Any]:
    """Every unary or server-streaming method of ``service`` (a service descriptor) on ``servicer``, where
    a request that does not decode is refused with gRPC INVALID_ARGUMENT (our own services, such as the
    admin service, answer errors with gRPC status codes rather than a v2 ``status``), and a call beyond
    ``admission``'s cap with RESOURCE_EXHAUSTED (every call, streams included, holds a slot while it runs;
    the unary methods named in ``waits`` spend their life waiting, as long polls: refused when the broker is
    full, they hold no slot once admitted, and their own caps bound them)."""
    admission = admission or Admission(0)
    handlers: dict[str, Any] = {}
    for method in service.methods:
        if method.client_streaming:
            raise ValueError(f"{service.full_name}.{method.name}: client streaming is not supported here")
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        behaviour = getattr(servicer, method.name)
        decode = _tolerant(method.name, request.FromString)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        wrap = _strict_waiting if method.name in waits else _strict_unary
        if method.server_streaming:
            wrap = _strict_streamed
        handlers[method.name] = make(
            wrap(behaviour, method.name, admission),
            request_deserializer=decode,
            response_serializer=response.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def _strict_unary(behaviour: Any, name: str, admission: Admission) -> Any:
    async def unary(request: Any, context: Context) -> Any:
        if not admission.enter():
            admission.refuse(name)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, admission.message)
        try:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
            return await behaviour(request, context)
        finally:
            admission.leave()

    return unary


def _strict_waiting(behaviour: Any, name: str, admission: Admission) -> Any:
    async def unary(request: Any, context: Context) -> Any:
        if admission.full:
            admission.refuse(name)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, admission.message)
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
        return await behaviour(request, context)

    return unary


def _strict_streamed(behaviour: Any, name: str, admission: Admission) -> Any:
    async def streamed(request: Any, context: Context) -> AsyncIterator[Any]:
        if not admission.enter():
            admission.refuse(name)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, admission.message)
        try:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
            async for frame in behaviour(request, context):
                yield frame
        finally:
            admission.leave()

    return streamed
