"""Undecodable requests get a v2 answer instead of gRPC's bare UNKNOWN.

grpc-python answers a request whose bytes do not parse as the method's message with status UNKNOWN and a
Python exception text. This interceptor swaps each v2 method's deserializer for one that catches the
decode error, and its handler for one that answers such a request the v2 way: a response whose
``status`` is BAD_REQUEST (unary and server-streaming methods, what the official clients read), or gRPC
INVALID_ARGUMENT for the client-streaming Telemetry.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import grpc
from google.protobuf import message as pb_message
from google.protobuf import message_factory

from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2

if TYPE_CHECKING:
    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]
    _Interceptor: TypeAlias = grpc.aio.ServerInterceptor[Any, Any]
    Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]
else:
    _Interceptor = grpc.aio.ServerInterceptor

SERVICE: Final = "/apache.rocketmq.v2.MessagingService/"


class _Undecodable:
    def __init__(self, why: str) -> None:
        self.why = why


def _responses() -> dict[str, type[pb_message.Message]]:
    service = service_pb2.DESCRIPTOR.services_by_name["MessagingService"]
    return {
        f"{SERVICE}{m.name}": message_factory.GetMessageClass(m.output_type)
        for m in service.methods
        if "status" in m.output_type.fields_by_name
    }


class DecodeGuard(_Interceptor):
    def __init__(self) -> None:
        self._responses = _responses()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler: Any = await continuation(handler_call_details)  # grpc's stubs type the aio handlers as sync
        method = handler_call_details.method
        if handler is None or not method.startswith(SERVICE) or handler.request_deserializer is None:
            return handler  # type: ignore[no-any-return]
        decode = handler.request_deserializer

        def tolerant(data: bytes) -> Any:
            try:
                return decode(data)
            except pb_message.DecodeError as exc:
                return _Undecodable(f"request is not a valid {method.rsplit('/', 1)[1]} message: {exc}")

        response = self._responses.get(method)
        encode = handler.response_serializer
        if handler.unary_unary is not None and response is not None:
            inner_uu = handler.unary_unary

            async def unary(request: Any, context: Context) -> Any:
                if isinstance(request, _Undecodable):
                    return response(status=pb.Status(code=pb.BAD_REQUEST, message=request.why))
                return await inner_uu(request, context)

            return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=tolerant, response_serializer=encode)
        if handler.unary_stream is not None and response is not None:
            inner_us = handler.unary_stream

            async def streamed(request: Any, context: Context) -> AsyncIterator[Any]:
                if isinstance(request, _Undecodable):
                    yield response(status=pb.Status(code=pb.BAD_REQUEST, message=request.why))
                    return
                async for frame in inner_us(request, context):
                    yield frame

            return grpc.unary_stream_rpc_method_handler(
                streamed, request_deserializer=tolerant, response_serializer=encode
            )
        if handler.stream_stream is not None:
            inner_ss = handler.stream_stream

            async def bidi(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
                async def checked() -> AsyncIterator[Any]:
                    async for request in requests:
                        if isinstance(request, _Undecodable):
                            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
                        yield request

                async for frame in inner_ss(checked(), context):
                    yield frame

            return grpc.stream_stream_rpc_method_handler(
                bidi, request_deserializer=tolerant, response_serializer=encode
            )
        return handler  # type: ignore[no-any-return]
