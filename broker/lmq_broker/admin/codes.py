"""The one table between broker errors and gRPC status codes on the admin plane, read both ways.

The server names the error class in trailing metadata (``lmq-error``), so our client raises exactly what
the service raised (``GroupNotFound``, not just ``NotFound``); a caller that is not ours still gets a
meaningful status code. Rows are ordered: for a status code the first row is the class a client falls
back to; for an error the row of its most specific class wins.
"""

from __future__ import annotations

from typing import Final

import grpc

from lmq_broker import errors

ERROR_CLASS_KEY: Final = "lmq-error"

_C = grpc.StatusCode
_TABLE: Final[tuple[tuple[type[errors.LmqError], grpc.StatusCode], ...]] = (
    (errors.InvalidArgument, _C.INVALID_ARGUMENT),
    (errors.InvalidReceiptHandle, _C.INVALID_ARGUMENT),
    (errors.NotFound, _C.NOT_FOUND),
    (errors.Conflict, _C.FAILED_PRECONDITION),
    (errors.Conflict, _C.ALREADY_EXISTS),  # not sent by us; a client may meet it from other servers
    (errors.TooManyRequests, _C.RESOURCE_EXHAUSTED),
    (errors.LiteTopicQuotaExceeded, _C.RESOURCE_EXHAUSTED),
    (errors.SubscriptionQuotaExceeded, _C.RESOURCE_EXHAUSTED),
    (errors.Unauthorized, _C.UNAUTHENTICATED),
    (errors.Unauthorized, _C.PERMISSION_DENIED),
    (errors.Forbidden, _C.PERMISSION_DENIED),
    (errors.BrokerUnavailable, _C.UNAVAILABLE),
    (errors.BrokerUnavailable, _C.DEADLINE_EXCEEDED),
    (errors.LmqError, _C.INTERNAL),  # any other failure of ours, or a bug
    (errors.StorageError, _C.INTERNAL),
    (errors.Unsupported, _C.UNIMPLEMENTED),
)

# Failures that a later try of the same call may not meet: the broker was away, late, overloaded or failed
# inside. Anything else (invalid, conflict, unauthorized...) needs a different request, not a retry.
_TRANSIENT: Final = frozenset(
    c.name for c in (_C.UNAVAILABLE, _C.DEADLINE_EXCEEDED, _C.CANCELLED, _C.RESOURCE_EXHAUSTED, _C.INTERNAL, _C.UNKNOWN)
)

_CLASSES: Final = {
    cls.__name__: cls for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, errors.LmqError)
}


def status_for(error: errors.LmqError) -> grpc.StatusCode:
    """The status a server replies with for one of our errors."""
    for cls in type(error).__mro__:
        for row_cls, code in _TABLE:
            if row_cls is cls:
                return code
    return _C.UNKNOWN


def trailers(error: errors.LmqError) -> tuple[tuple[str, str], ...]:
    return ((ERROR_CLASS_KEY, type(error).__name__),)


def error_for(code: grpc.StatusCode, message: str, class_name: str = "", **fields: object) -> errors.LmqError:
    """The error a client raises for a failed call."""
    named = _CLASSES.get(class_name)
    if named is not None and status_for(named(message)) == code:
        return named(message, code=code.name, **fields)
    for row_cls, row_code in _TABLE:
        if row_code == code:
            return row_cls(message, code=code.name, **fields)
    return errors.LmqError(message, code=code.name, **fields)


def transient(error: errors.LmqError) -> bool:
    """Whether retrying the failed call later may succeed (by its status code; False when no call failed)."""
    return isinstance(error, errors.BrokerUnavailable) or error.fields.get("code") in _TRANSIENT
