"""The one table from domain errors to ``apache.rocketmq.v2.Code``.

Handlers raise ``lmq_broker.errors`` values and never pick codes themselves; ``service`` turns whatever
escapes into a response ``status`` through ``code_of``. Invalid-argument errors carry a ``kind`` field
naming what was invalid, because the v2 protocol has a specific code for most fields (and the official
clients map every 400xx code to BadRequestException, so the precise code is for humans and logs).
"""

from __future__ import annotations

from typing import Final, TypeAlias

import grpc

from lmq_broker import errors
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb

Code: TypeAlias = pb.Code.ValueType

BY_KIND: Final[dict[str, Code]] = {
    "topic": pb.ILLEGAL_TOPIC,
    "group": pb.ILLEGAL_CONSUMER_GROUP,
    "tag": pb.ILLEGAL_MESSAGE_TAG,
    "key": pb.ILLEGAL_MESSAGE_KEY,
    "message_group": pb.ILLEGAL_MESSAGE_GROUP,
    "property": pb.ILLEGAL_MESSAGE_PROPERTY_KEY,
    "properties": pb.MESSAGE_PROPERTIES_TOO_LARGE,
    "message_id": pb.ILLEGAL_MESSAGE_ID,
    "filter": pb.ILLEGAL_FILTER_EXPRESSION,
    "invisible_time": pb.ILLEGAL_INVISIBLE_TIME,
    "delivery_time": pb.ILLEGAL_DELIVERY_TIME,
    "message_type": pb.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE,
    "client_type": pb.UNRECOGNIZED_CLIENT_TYPE,
    "client_id": pb.CLIENT_ID_REQUIRED,
    "polling_time": pb.ILLEGAL_POLLING_TIME,
    "offset": pb.ILLEGAL_OFFSET,
    "lite_topic": pb.ILLEGAL_LITE_TOPIC,
    "access_point": pb.ILLEGAL_ACCESS_POINT,
    "permission": pb.FORBIDDEN,
}

# Most specific class first: the first isinstance match wins.
BY_CLASS: Final[tuple[tuple[type[errors.LmqError], Code], ...]] = (
    (errors.InvalidLiteTopic, pb.ILLEGAL_LITE_TOPIC),
    (errors.BodyEmpty, pb.MESSAGE_BODY_EMPTY),
    (errors.BodyTooLarge, pb.MESSAGE_BODY_TOO_LARGE),
    (errors.RecordTooLarge, pb.MESSAGE_BODY_TOO_LARGE),
    (errors.InvalidName, pb.BAD_REQUEST),
    (errors.InvalidArgument, pb.BAD_REQUEST),
    (errors.TopicNotFound, pb.TOPIC_NOT_FOUND),
    (errors.GroupNotFound, pb.CONSUMER_GROUP_NOT_FOUND),
    (errors.NotFound, pb.NOT_FOUND),
    (errors.Conflict, pb.BAD_REQUEST),
    (errors.LiteTopicQuotaExceeded, pb.LITE_TOPIC_QUOTA_EXCEEDED),
    (errors.SubscriptionQuotaExceeded, pb.LITE_SUBSCRIPTION_QUOTA_EXCEEDED),
    (errors.TooManyRequests, pb.TOO_MANY_REQUESTS),
    (errors.InvalidReceiptHandle, pb.INVALID_RECEIPT_HANDLE),
    (errors.Unauthorized, pb.UNAUTHORIZED),
    (errors.Forbidden, pb.FORBIDDEN),
    (errors.Unsupported, pb.UNSUPPORTED),
    (errors.StorageError, pb.INTERNAL_ERROR),
    (errors.BrokerUnavailable, pb.INTERNAL_ERROR),
)


def code_of(exc: BaseException) -> Code:
    """The v2 code for an error; anything that is not a domain error is INTERNAL_ERROR."""
    if not isinstance(exc, errors.LmqError):
        return pb.INTERNAL_ERROR
    kind = exc.fields.get("kind")
    if isinstance(exc, errors.InvalidArgument | errors.Conflict) and isinstance(kind, str) and kind in BY_KIND:
        return BY_KIND[kind]
    for cls, code in BY_CLASS:
        if isinstance(exc, cls):
            return code
    return pb.INTERNAL_ERROR


def status_of(exc: BaseException) -> pb.Status:
    message = exc.message if isinstance(exc, errors.LmqError) else "internal error"
    return pb.Status(code=code_of(exc), message=message)


# The other way, for a peer's answer relayed to a caller that speaks errors (the MQTT listener): the first class
# of each code, a bad request as InvalidArgument, and anything unknown as a broker that could not serve.
_BY_CODE: Final[dict[int, type[errors.LmqError]]] = {
    **{code: cls for cls, code in reversed(BY_CLASS)},
    pb.BAD_REQUEST: errors.InvalidArgument,
    pb.INTERNAL_ERROR: errors.BrokerUnavailable,
}


def error_of(st: pb.Status) -> errors.LmqError:
    """The error a non-OK status stands for (``code_of`` read backwards)."""
    cls = _BY_CODE.get(st.code)
    if cls is None:
        cls = errors.InvalidArgument if int(st.code) // 100 == 400 else errors.BrokerUnavailable
    return cls(st.message or pb.Code.Name(st.code))


def ok(message: str = "OK") -> pb.Status:
    return pb.Status(code=pb.OK, message=message)


def ok_send_reply(entries: int) -> spb.SendMessageResponse:
    """An OK SendMessageResponse with ``entries`` OK entries for the caller to fill in, parsed from a template
    (bytes repeated in C): building each entry with ``entries.add(status=...)`` copies the status message
    through a serialize/parse per entry and cost three times as much."""
    return spb.SendMessageResponse.FromString(_SEND_REPLY_HEAD + _SEND_OK_ENTRY * entries)


def grpc_status_of(code: Code) -> grpc.StatusCode:
    """The gRPC status that ends a stream refused with v2 ``code`` (by the code's HTTP-like class)."""
    family = int(code) // 100
    if family == 404:
        return grpc.StatusCode.NOT_FOUND
    if family in (401,):
        return grpc.StatusCode.UNAUTHENTICATED
    if family == 403:
        return grpc.StatusCode.PERMISSION_DENIED
    if family == 429:
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if family in (400, 409, 413, 431):
        return grpc.StatusCode.INVALID_ARGUMENT
    if family == 501:
        return grpc.StatusCode.UNIMPLEMENTED
    return grpc.StatusCode.INTERNAL


def describe(status: pb.Status) -> str:
    """A refusal as text that names the v2 code, for a gRPC status message."""
    return f"{pb.Code.Name(status.code)} ({status.code}): {status.message}"


_SEND_REPLY_HEAD: Final = spb.SendMessageResponse(status=ok()).SerializeToString()
_SEND_OK_ENTRY: Final = spb.SendMessageResponse(entries=[spb.SendResultEntry(status=ok())]).SerializeToString()
