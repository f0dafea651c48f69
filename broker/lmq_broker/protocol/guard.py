"""The v2 service's method handlers, registered by hand so undecodable requests get a v2 answer.

grpc-python answers a request whose bytes do not parse as the method's message with status UNKNOWN and a
Python exception text. Here each method's deserializer catches the decode error, and its behaviour answers
such a request the v2 way: a response whose ``status`` is BAD_REQUEST (unary and server-streaming methods,
what the official clients read), or gRPC INVALID_ARGUMENT for the client-streaming Telemetry. This is done
when the handlers are built, not in an interceptor: an interceptor would run Python code on every call
before the handler is even found, and the send path is where every microsecond counts.

The same wrappers admit calls (``admission``): a call beyond the broker's cap is answered here, before its
handler runs, with the v2 status TOO_MANY_REQUESTS where the response has a status, else gRPC
RESOURCE_EXHAUSTED. Under ``--acl`` they also check the call's signature (``authenticate``, an
``auth.Verifier`` over the users' key pairs) and answer a call that is not signed by a user as
``auth.AuthInterceptor`` does (UNAUTHORIZED in the v2 status; Telemetry: gRPC UNAUTHENTICATED), here rather
than in a server interceptor, which would cost every call one more coroutine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import grpc
from google.protobuf import message as pb_message
from google.protobuf import message_factory

from lmq_broker.protocol.admission import Admission
from lmq_broker.protocol.context import read_metadata
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2

if TYPE_CHECKING:
    Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]

SERVICE: Final = "apache.rocketmq.v2.MessagingService"
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


def generic_handler(
    servicer: object, admission: Admission | None = None, authenticate: Authenticate | None = None
) -> grpc.GenericRpcHandler[Any, Any]:
    """Every MessagingService method of ``servicer`` (async methods named as in the proto), admitted by
    ``admission`` (none: no cap), and signed as ``authenticate`` wants (none: unchecked here)."""
    admission = admission or Admission(0)
    service = service_pb2.DESCRIPTOR.services_by_name["MessagingService"]
    handlers: dict[str, Any] = {}
    for method in service.methods:
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        behaviour = getattr(servicer, method.name)
        decode = _tolerant(method.name, request.FromString)
        encode = response.SerializeToString
        has_status = "status" in method.output_type.fields_by_name
        if method.client_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                _bidi(behaviour, method.name, admission, authenticate),
                request_deserializer=decode,
                response_serializer=encode,
            )
        elif method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _streamed(behaviour, response if has_status else None, method.name, admission, authenticate),
                request_deserializer=decode,
                response_serializer=encode,
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary(behaviour, response, method.name, admission, authenticate),
                request_deserializer=decode,
                response_serializer=encode,
            )
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


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
    authenticate: Authenticate | None,
) -> Any:
    refusal = _too_many_requests(response, admission)  # built once: only ever serialized

    async def unary(request: Any, context: Context) -> Any:
        if not admission.enter():
            admission.refuse(name)
            return refusal
        try:
            if isinstance(request, _Undecodable):
                return _bad_request(response, request.why)
            if authenticate is not None and (why := authenticate(read_metadata(context))) is not None:
                return _unauthorized(response, why)
            return await behaviour(request, context)
        finally:
            admission.leave()

    return unary


def _streamed(
    behaviour: Any,
    response: type[pb_message.Message] | None,
    name: str,
    admission: Admission,
    authenticate: Authenticate | None,
) -> Any:
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
        if authenticate is not None and (why := authenticate(read_metadata(context))) is not None:
            if response is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"unauthorized: {why}")
            else:
                yield _unauthorized(response, why)
            return
        async for frame in behaviour(request, context):
            yield frame

    return streamed


def _bidi(behaviour: Any, name: str, admission: Admission, authenticate: Authenticate | None) -> Any:
    # Telemetry lives as long as its client: refused at its start when the broker is full, then holds no slot.
    async def bidi(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
        if admission.full:
            admission.refuse(name)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, admission.message)
        if authenticate is not None and (why := authenticate(read_metadata(context))) is not None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"unauthorized: {why}")

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
