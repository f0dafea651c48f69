"""Request signing of the RocketMQ v2 clients (``MQv2-HMAC-SHA1``), checked before any handler runs.

Every official client signs every call: ``authorization: MQv2-HMAC-SHA1 Credential=<ak>,
SignedHeaders=x-mq-date-time, Signature=<hex HMAC-SHA1(sk, x-mq-date-time)>``. The interceptor verifies
that header and, on failure, never calls the service's handler, so an unauthorized request can store
nothing.

How a rejection is delivered, per method kind (read from rocketmq-python-client 5.1.2):

* unary v2 methods whose response has a ``status`` (SendMessage, QueryRoute, AckMessage, ...) and the
  server-streaming ReceiveMessage/PullMessage get a normal response with ``status.code = UNAUTHORIZED``
  (40100). The client's ``MessagingResultChecker`` turns that into ``UnauthorizedException`` carrying our
  message. A gRPC ``UNAUTHENTICATED`` status would instead reach the application as a raw
  ``grpc.aio.AioRpcError``, which the client neither recognises nor maps.
* everything else (Telemetry, whose client ignores status-only frames, and the lmq admin service) is
  aborted with gRPC ``UNAUTHENTICATED``; our admin client maps that to ``errors.Unauthorized``.

``x-mq-date-time`` must lie within ``max_skew_s`` (``--auth-max-skew-ms``, 15 min by default) of the
broker's UTC clock, so a captured header stops working after that window (within it, replay is prevented
only by TLS keeping the header secret; docs/security.md). RocketMQ's clients stamp UTC, except that
rocketmq-python-client 5.1.2 stamps its *local* time followed by a literal ``Z``: such a client needs
``TZ=UTC`` (the default in containers) or a wider window.

Health checks (``/grpc.health.v1.Health/``) are exempt so kubelet probes need no credentials.

Under ``--acl`` (users and policies, ``lmq_broker.access``) the v2 calls are signed by users: the service's
handler finder (``guard.Messaging``) checks them, on the headers grpc read to find the handler, with a
``Verifier`` over the users' key pairs (the admin pair among them, as the super user), which remembers each
signature for the second it covers and leaves the call's user in ``USER`` for the access checks
(``authorizing``); ``AuthInterceptor`` is not installed then.

The admin service (``lmq.admin.v1``) has a key pair of its own, checked (``AdminGuard``) whether or not the
v2 clients have one: client credentials are handed to every application, and must not let one tenant
delete another's topics. The same scheme and date-time window apply; only ``--admin-anonymous``
(development) opens it. ``AuthInterceptor`` checks v2 calls only, so the client pair never opens admin.

The v2 descriptors are loaded lazily, in ``AuthInterceptor()``: ``sign_metadata`` is also used by the
admin client, which may share an interpreter with the official client and its own copy of them.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeAlias

import grpc
from google.protobuf import message as pb_message
from google.protobuf import message_factory

_NO_FRAMES: Final[tuple[Any, ...]] = ()  # a streaming handler's frames when it only aborts
ALGORITHM: Final = "MQv2-HMAC-SHA1"
AUTHORIZATION: Final = "authorization"
DATE_TIME: Final = "x-mq-date-time"
DATE_TIME_FORMAT: Final = "%Y%m%dT%H%M%SZ"
V2_SERVICE: Final = "apache.rocketmq.v2.MessagingService"
V2_PREFIX: Final = f"/{V2_SERVICE}/"
ADMIN_HINT: Final = (
    "admin calls must be signed with the broker's admin key pair (not a client's): its --admin-access-key/"
    "--admin-secret-key, or admin-credentials.json in its data directory, which lmq-admin reads with --data-dir "
    "(see docs/security.md)"
)
UNAUTHORIZED_CODE: Final = 40100  # apache.rocketmq.v2.Code.UNAUTHORIZED
EXEMPT_PREFIXES: Final = ("/grpc.health.v1.Health/",)
DEFAULT_MAX_SKEW_S: Final = 15 * 60.0


def utc_now() -> datetime:
    """What signing clients stamp: the broker checks the date-time against its UTC clock."""
    return datetime.now(UTC)


def signature(secret_key: str, date_time: str) -> str:
    return hmac.new(secret_key.encode(), date_time.encode(), hashlib.sha1).hexdigest()


def sign_metadata(access_key: str, secret_key: str, now: datetime) -> tuple[tuple[str, str], ...]:
    """The two headers a signed call carries, stamped with ``now``."""
    date_time = now.strftime(DATE_TIME_FORMAT)
    header = (
        f"{ALGORITHM} Credential={access_key}, SignedHeaders={DATE_TIME}, Signature={signature(secret_key, date_time)}"
    )
    return ((DATE_TIME, date_time), (AUTHORIZATION, header))


def credential_of(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The access key a call is signed with (its user, once the signature was checked); "" when unsigned."""
    for key, value in metadata or ():
        if key == AUTHORIZATION and isinstance(value, str):
            start = value.find("Credential=")
            if start < 0:
                return ""
            start += len("Credential=")
            end = value.find(",", start)
            return (value[start:] if end < 0 else value[start:end]).strip()
    return ""


def check(
    metadata: Sequence[tuple[str, str | bytes]] | None,
    access_key: str,
    secret_key: str,
    *,
    now: datetime | None = None,
    max_skew_s: float = 0.0,
) -> str | None:
    """None when the call is signed with our key pair; otherwise why not (safe to show the caller).
    With ``max_skew_s`` > 0 the signed date-time must also lie within that many seconds of ``now``."""

    def secret_of(credential: str) -> str | None:
        return secret_key if hmac.compare_digest(credential.encode(), access_key.encode()) else None

    return check_signed(metadata, secret_of, now=now, max_skew_s=max_skew_s)


def check_signed(  # noqa: PLR0911 (a return per signature check, in order)
    metadata: Sequence[tuple[str, str | bytes]] | None,
    secret_of: Callable[[str], str | None],
    *,
    now: datetime | None = None,
    max_skew_s: float = 0.0,
) -> str | None:
    """As ``check``, for a table of key pairs: ``secret_of`` gives the secret of an access key (None: unknown)."""
    headers: dict[str, str] = {}
    for key, value in metadata or ():
        if isinstance(value, str):
            headers[key.lower()] = value
    header = headers.get(AUTHORIZATION)
    if not header:
        return "missing authorization header"
    date_time = headers.get(DATE_TIME)
    if not date_time:
        return f"missing {DATE_TIME} header"
    algorithm, _, rest = header.strip().partition(" ")
    if algorithm != ALGORITHM:
        return f"unsupported authorization algorithm {algorithm!r}, expected {ALGORITHM}"
    fields: dict[str, str] = {}
    for part in rest.split(","):
        name, sep, value = part.strip().partition("=")
        if sep:
            fields[name.strip()] = value.strip()
    missing = [name for name in ("Credential", "SignedHeaders", "Signature") if name not in fields]
    if missing:
        return f"malformed authorization header: no {', '.join(missing)}"
    if fields["SignedHeaders"].lower() != DATE_TIME:
        return f"SignedHeaders must be {DATE_TIME}"
    secret_key = secret_of(fields["Credential"])
    if secret_key is None:
        return "unknown access key"
    if not hmac.compare_digest(fields["Signature"].lower().encode(), signature(secret_key, date_time).encode()):
        return "signature does not match"
    if max_skew_s > 0:
        try:
            signed_at = datetime.strptime(date_time, DATE_TIME_FORMAT).replace(tzinfo=UTC)
        except ValueError:
            return f"{DATE_TIME} is not a date-time like 20260102T030405Z"
        skew = abs(((now or datetime.now(UTC)) - signed_at).total_seconds())
        if skew > max_skew_s:
            return f"{DATE_TIME} {date_time} is {skew:.0f} s from the broker's UTC clock (at most {max_skew_s:.0f} s)"
    return None


# The user a v2 call is signed by, once ``Verifier`` accepted it ("" before, or when it refused): grpc.aio runs
# every call in a task of its own, so each call sees its own user, and the handlers need not parse it again.
USER: Final[contextvars.ContextVar[str]] = contextvars.ContextVar("lmq_user", default="")
VERIFIED_ENTRIES: Final = 4096  # signatures a Verifier remembers (each is reused for the second it covers)


class Verifier:
    """``check_signed`` for the v2 service under ``--acl``, with memory: a client signs the date-time only, to
    the second, so one signature comes again on every call of that second; its check (parse, lookup, HMAC) is
    done once and remembered, and only the date-time window is checked per call. ``version`` changes when the
    key pairs do (a user deleted, disabled or given a new secret): everything remembered is dropped then."""

    def __init__(
        self,
        secret_of: Callable[[str], str | None],
        max_skew_s: float = DEFAULT_MAX_SKEW_S,
        clock: Callable[[], float] = time.time,
        version: Callable[[], int] = lambda: 0,
    ) -> None:
        """``clock``: the UTC time in seconds since the epoch."""
        self._secret_of = secret_of
        self._max_skew_s = max_skew_s
        self._clock = clock
        self._version = version
        self._seen_version = version()
        self._verified: dict[tuple[str, str], tuple[str | None, float | None, str]] = {}

    def __call__(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """None when the call is signed by a known key pair within the window (and ``USER`` is its user);
        else why not."""
        header = date_time = ""
        for key, value in metadata or ():
            if key == AUTHORIZATION and isinstance(value, str):
                header = value
            elif key == DATE_TIME and isinstance(value, str):
                date_time = value
        version = self._version()
        if version != self._seen_version:
            self._verified.clear()
            self._seen_version = version
        found = self._verified.get((header, date_time))
        if found is None:
            problem = check_signed(((AUTHORIZATION, header), (DATE_TIME, date_time)), self._secret_of)
            signed_at = None
            with contextlib.suppress(ValueError):
                signed_at = datetime.strptime(date_time, DATE_TIME_FORMAT).replace(tzinfo=UTC).timestamp()
            if len(self._verified) >= VERIFIED_ENTRIES:
                self._verified.clear()
            user = credential_of(((AUTHORIZATION, header),)) if problem is None else ""
            found = self._verified[(header, date_time)] = (problem, signed_at, user)
        problem, signed_at, user = found
        if problem is not None:
            USER.set("")
            return problem
        if self._max_skew_s <= 0:
            USER.set(user)
            return None
        if signed_at is None:
            USER.set("")
            return f"{DATE_TIME} is not a date-time like 20260102T030405Z"
        skew = abs(self._clock() - signed_at)
        if skew > self._max_skew_s:
            limit = self._max_skew_s
            USER.set("")
            return f"{DATE_TIME} {date_time} is {skew:.0f} s from the broker's UTC clock (at most {limit:.0f} s)"
        USER.set(user)
        return None


@dataclass(frozen=True, slots=True)
class _StatusReply:
    response: type[pb_message.Message]
    status: type[pb_message.Message]


def _status_replies() -> Mapping[str, _StatusReply]:
    """Method path → how to say UNAUTHORIZED in a response, for the v2 methods that can."""
    from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2  # noqa: PLC0415 (see module doc)

    service = service_pb2.DESCRIPTOR.services_by_name["MessagingService"]
    replies: dict[str, _StatusReply] = {}
    for method in service.methods:
        status_field = method.output_type.fields_by_name.get("status")
        if method.client_streaming or status_field is None or status_field.message_type is None:
            continue
        replies[f"/{service.full_name}/{method.name}"] = _StatusReply(
            message_factory.GetMessageClass(method.output_type),
            message_factory.GetMessageClass(status_field.message_type),
        )
    return replies


if TYPE_CHECKING:  # grpc's classes are generic only in the type stubs
    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]
    GenericHandler: TypeAlias = grpc.GenericRpcHandler[Any, Any]
    _Interceptor: TypeAlias = grpc.aio.ServerInterceptor[Any, Any]
    _GenericHandler: TypeAlias = grpc.GenericRpcHandler[Any, Any]
else:
    _Interceptor = grpc.aio.ServerInterceptor
    _GenericHandler = grpc.GenericRpcHandler


class AuthInterceptor(_Interceptor):
    """Rejects v2 calls not signed with the client pair ``access_key``/``secret_key``; wire it only when client
    auth is configured (without ``--acl``, whose users' signatures the v2 handler finder, ``guard.Messaging``,
    checks with a ``Verifier``). Other services pass: health checks are open, the admin service has ``AdminGuard``."""

    def __init__(
        self,
        access_key: str,
        secret_key: str,
        max_skew_s: float = DEFAULT_MAX_SKEW_S,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        if not access_key or not secret_key:
            raise ValueError("AuthInterceptor needs a non-empty access key and secret key")
        self._access_key = access_key
        self._secret_key = secret_key
        self._max_skew_s = max_skew_s
        self._clock = clock
        self._replies = _status_replies()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        method = handler_call_details.method
        if not method.startswith(V2_PREFIX):
            return await continuation(handler_call_details)
        problem = check(
            handler_call_details.invocation_metadata,
            self._access_key,
            self._secret_key,
            now=self._clock(),
            max_skew_s=self._max_skew_s,
        )
        handler = await continuation(handler_call_details)
        if problem is None or handler is None:
            return handler
        return self._rejection(method, handler, f"unauthorized: {problem}")

    def _rejection(self, method: str, handler: Handler, message: str) -> Handler:
        reply = self._replies.get(method)
        serializer = handler.response_serializer
        if reply is not None and not handler.request_streaming:
            response = reply.response(status=reply.status(code=UNAUTHORIZED_CODE, message=message))
            if handler.response_streaming:

                async def stream_reply(request: object, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                    yield response

                return grpc.unary_stream_rpc_method_handler(stream_reply, response_serializer=serializer)

            async def unary_reply(request: object, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                return response

            return grpc.unary_unary_rpc_method_handler(unary_reply, response_serializer=serializer)
        return _aborting(handler, message)


def _aborting(handler: Handler, message: str) -> Handler:
    """A handler of the same shape that ends the call with gRPC UNAUTHENTICATED and ``message``. A streaming reply's
    is a generator, as the method's own: the native edge iterates it (a coroutine there was a TypeError, the call
    UNKNOWN and a stack trace logged for each unsigned Telemetry stream or admin scan; grpcio takes either)."""
    serializer = handler.response_serializer

    async def abort(request: object, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def abort_streaming(request: object, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        for frame in _NO_FRAMES:
            yield frame
        await abort(request, context)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort_streaming, response_serializer=serializer)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort, response_serializer=serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort_streaming, response_serializer=serializer)
    return grpc.unary_unary_rpc_method_handler(abort, response_serializer=serializer)


class UserCalls(Protocol):
    """Admin calls signed by a user rather than the admin pair (``--acl``): its secret, and the handler that
    checks what that user may do (``admin.permissions``)."""

    def secret_of(self, name: str) -> str | None: ...

    def handler(self, method: str, user: str, handler: Handler) -> Handler: ...


class AdminGuard(_GenericHandler):
    """The admin service's handler, answering only calls signed with the admin pair.

    A generic handler, not a server interceptor: gRPC asks it only for the methods of the service it wraps,
    so the v2 calls, the hot path, pay nothing for it (a server-wide interceptor costs every call a
    coroutine, and made bursts of a few thousand concurrent calls end CANCELLED). The check itself is
    ``check``, as for clients; a refusal is gRPC UNAUTHENTICATED naming where the admin pair is."""

    def __init__(
        self,
        inner: GenericHandler,
        access_key: str,
        secret_key: str,
        max_skew_s: float = DEFAULT_MAX_SKEW_S,
        clock: Callable[[], datetime] = utc_now,
        *,
        users: UserCalls | None = None,
    ) -> None:
        if not access_key or not secret_key:
            raise ValueError("AdminGuard needs a non-empty admin access key and secret key")
        self._users = users
        self._inner = inner
        self._access_key = access_key
        self._secret_key = secret_key
        self._max_skew_s = max_skew_s
        self._clock = clock

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        metadata = handler_call_details.invocation_metadata
        problem = check(metadata, self._access_key, self._secret_key, now=self._clock(), max_skew_s=self._max_skew_s)
        if problem is None:
            return handler
        users = self._users
        if users is not None and credential_of(metadata) != self._access_key:
            signed = check_signed(metadata, users.secret_of, now=self._clock(), max_skew_s=self._max_skew_s)
            if signed is None:  # a user's call: what it may do is checked per method and request
                return users.handler(handler_call_details.method, credential_of(metadata), handler)
        return _aborting(handler, f"unauthorized: {problem}; {ADMIN_HINT}")
