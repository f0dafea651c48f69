"""The grpc.aio server both services share (v2 MessagingService and lmq admin), on one port; or, with
``--admin-port``, a second server for admin alone, so that the network can tell the two apart (a Kubernetes
NetworkPolicy admits by port: clients to one, the operator and the reclaim job to the other). With
``--external-port`` one more server carries the v2 service alone for clients outside the cluster (never admin);
its routes name the brokers' external addresses (``cluster.links``).

Each service is guarded with its own key pair: the v2 service by ``auth.AuthInterceptor`` with the client
pair when one is configured (the official clients sign every call), the admin service always by
``auth.AdminGuard`` with the admin pair (``admin.service.register``; our admin client signs the same way,
``protocol.auth.sign_metadata``), unless the broker runs with ``--admin-anonymous``. So no caller without
the admin pair can administer the broker, even with client auth off. The probes are HTTP (``/healthz``,
``/readyz``), off this port, so they need no credentials.

With ``--tls-cert/--tls-key`` both listeners serve TLS, and follow the two files: a handshake after they
changed (cert-manager renewed the Secret, the kubelet swapped the mounted files) gets the new certificate, with
no restart; a pair that does not load (a key that does not match, a file half written) is logged once and the
last good one kept.

Every call is admitted by one ``admission.Admission`` shared by both services (``--max-concurrent-calls``).
For that, grpc core's own backlog limit is raised (``PENDING_CALLS_MAX``): its default refuses calls the
Python server has not yet taken, past 1,000 of them, as a bare CANCELLED that nothing here sees.
"""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeAlias, cast

import grpc

from lmq_broker.config import BrokerConfig, EdgeKind, SendPath
from lmq_broker.protocol import auth, guard, native
from lmq_broker.protocol.admission import Admission
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.service import MessagingService

if TYPE_CHECKING:  # grpc's classes are generic only in the type stubs
    Interceptor: TypeAlias = grpc.aio.ServerInterceptor[Any, Any]
    _GenericHandler: TypeAlias = grpc.GenericRpcHandler[Any, Any]
else:
    _GenericHandler = grpc.GenericRpcHandler

log = logging.getLogger(__name__)
Server: TypeAlias = "grpc.aio.Server | native.NativeServer"  # the client port's (``create_client_port``)

MIN_MESSAGE_BYTES: Final = 64 * 1024 * 1024  # batched sends carry many bodies per request
KEEPALIVE_OPTIONS: Final = (
    ("grpc.keepalive_time_ms", 60_000),  # find half-open client connections (telemetry streams live for days)
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
)
# Calls that reached the server but that the Python server has not taken yet (it takes one at a time, on the
# event loop). grpc core refuses such calls with a bare CANCELLED, at random past its soft limit (default
# 1,000) and all past its hard limit (3,000), before any of our code sees them. Here the limit is raised so
# far that a call is refused, if at all, by admission (TOO_MANY_REQUESTS, counted and logged), yet not lifted:
# a waiting call costs about 15 KiB in core (measured: 20,000 waiting calls of 200 B added ~310 MB RSS), and
# 20,000 is several seconds of intake, longer than the official clients' 3 s request timeout. Beyond it,
# grpc core's CANCELLED remains (docs/protocol.md, Limits: overload).
PENDING_CALLS_MAX: Final = 20_000


def options(config: BrokerConfig, *, shared_port: bool = False) -> list[tuple[str, Any]]:
    """``shared_port``: the access port of ``--processes``, where every broker process of a pod listens at once."""
    limit = max(MIN_MESSAGE_BYTES, 4 * config.max_body_bytes)
    streams = config.max_streams_per_connection  # none: grpc core's default, no cap
    connections = config.max_connections  # grpc core's connection quota: no cap per address (no accept hook)
    return [
        *([("grpc.max_concurrent_streams", streams)] if streams else []),
        *([("grpc.max_allowed_incoming_connections", connections)] if connections else []),
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.so_reuseport", int(shared_port)),  # else a second broker on the same port must fail, not share it
        ("grpc.server.max_pending_requests", PENDING_CALLS_MAX),
        ("grpc.server.max_pending_requests_hard_limit", PENDING_CALLS_MAX),
        *KEEPALIVE_OPTIONS,
    ]


def _interceptors(config: BrokerConfig) -> Sequence[Interceptor]:
    if config.access_key and not config.acl:
        return (auth.AuthInterceptor(config.access_key, config.secret_key, max_skew_s=config.auth_max_skew_ms / 1000),)
    return ()


class _WriteToAGoneClient(logging.Filter):
    """grpcio's server logs an ERROR with a stack trace (``ExecuteBatchError raised in core by servicer method``)
    when a handler writes a reply to a call its client has reset or left: the client's doing, not a failure, and a
    client resetting its streams mid-reply would fill the log. Such records are dropped; the call ends as
    cancelled, as on the native edge (which logs nothing either)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and type(record.exc_info[1]).__name__ == "ExecuteBatchError")


_GRPC_SERVER_LOG: Final = logging.getLogger("grpc._cython.cygrpc")
_WRITES_TO_GONE_CLIENTS: Final = _WriteToAGoneClient()


def create(config: BrokerConfig, *, shared_port: bool = False) -> grpc.aio.Server:
    """Under ``--acl`` the v2 calls' signatures are checked by the service's handlers (``add_messaging_service``),
    by the users' key pairs; else by ``auth.AuthInterceptor`` with the client pair, when one is configured."""
    _GRPC_SERVER_LOG.addFilter(_WRITES_TO_GONE_CLIENTS)  # once: a filter already added is not added again
    return grpc.aio.server(interceptors=_interceptors(config), options=options(config, shared_port=shared_port))


def create_client_port(config: BrokerConfig) -> Server:
    """The server of the client port (``--port``): grpcio's, or the native edge with ``--edge native``."""
    if config.edge is EdgeKind.NATIVE:
        limit = max(MIN_MESSAGE_BYTES, 4 * config.max_body_bytes)
        server = native.NativeServer(limit, config.max_unread_requests, _interceptors(config))
        server.limit_streams(config.max_streams_per_connection)
        server.limit_connections(config.max_connections, config.max_connections_per_address)
        server.limit_request_buffers(config.max_request_buffer_bytes, config.max_request_buffer_bytes_per_connection)
        if config.tls_cert is not None and config.tls_key is not None:
            server.serve_tls(config.tls_cert, config.tls_key)  # every listener; reloaded as grpcio's (tls.rs)
        return server
    return create(config)


def admission(config: BrokerConfig, edge: Edge) -> Admission:
    """The broker's one admission (both services share it), counting refusals in ``edge.metrics``."""
    return Admission(config.max_concurrent_calls, edge.metrics.refused)


def add_messaging_service(
    server: Server, edge: Edge, admitting: Admission | None = None, *, external: bool = False
) -> MessagingService:
    service = MessagingService(edge, external=external)
    access = edge.access
    authenticate = None
    if access.enabled:  # --acl: signed by a user (or the admin pair, the super user)
        config = edge.config
        authenticate = auth.Verifier(
            access.secret_of, config.auth_max_skew_ms / 1000, version=lambda: access.generation
        )
    raw_send = edge.config.send_path is SendPath.RAW
    server.add_generic_rpc_handlers((guard.generic_handler(service, admitting, authenticate, raw_send=raw_send),))
    return service


def create_admin(config: BrokerConfig) -> grpc.aio.Server:
    """The admin listener's own server (``--admin-port``): admin calls are signed with the admin pair
    (``auth.AdminGuard``), so the v2 client-auth interceptor has no business here."""
    return grpc.aio.server(options=options(config))


ADMIN_SERVICE: Final = "/lmq.admin.v1.LmqAdmin/"


class AdminElsewhere(_GenericHandler):
    """On the client port of a broker with ``--admin-port``: an admin call is answered UNIMPLEMENTED with the
    port that serves it, rather than gRPC's bare "Method not found". On the external listener (``admin_port``
    None) it is never served, and the port that serves it is not told."""

    def __init__(self, admin_port: Callable[[], int] | None) -> None:
        self._admin_port = admin_port

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        if not handler_call_details.method.startswith(ADMIN_SERVICE):
            return None
        if self._admin_port is None:
            message = "the admin service is not served on the external listener"
        else:
            message = f"the admin service is not served on this port: it is on port {self._admin_port()} (--admin-port)"

        async def refuse(_request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, message)
            raise AssertionError("unreachable: abort raises")

        return grpc.unary_unary_rpc_method_handler(refuse)


def bind(server: Server, config: BrokerConfig, port: int | None = None, *, shared_port: bool = False) -> int:
    """Listen on ``config.host:port`` (default ``config.port``; TLS when a certificate is configured); returns
    the bound port. ``shared_port``: the native edge's access port of ``--processes`` (SO_REUSEPORT); grpcio's
    server takes it from its options (``create``)."""
    port = config.port if port is None else port
    if isinstance(server, native.NativeServer):  # TLS set up by create_client_port
        return server.listen(config.host, port, shared=shared_port)
    address = f"[{config.host}]:{port}" if ":" in config.host else f"{config.host}:{port}"
    if config.tls_cert is not None and config.tls_key is not None:
        files = CertificateFiles(config.tls_cert, config.tls_key)
        # grpc calls the fetcher for a replacement or None (its stubs leave None out)
        fetcher = cast("Callable[[], grpc.ServerCertificateConfiguration]", files)
        credentials = grpc.dynamic_ssl_server_credentials(files.load(), fetcher)
        bound = server.add_secure_port(address, credentials)
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {address}")
    return bound


class CertificateFiles:
    """grpc's certificate fetcher, called at every TLS handshake: the pair in the two files once they changed
    and load together, else None (grpc keeps serving the current one). Two ``stat`` calls per handshake."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.cert, self.key = cert, key
        self._stamp: tuple[int, ...] = ()  # of the pair served
        self._refused: tuple[int, ...] = ()  # of a pair that did not load: not tried again
        self._complaint = ""  # the last warning, not repeated at every handshake

    def _stat(self) -> tuple[int, ...]:
        c, k = os.stat(self.cert), os.stat(self.key)  # follows the kubelet's ..data symlinks
        return c.st_ino, c.st_mtime_ns, c.st_size, k.st_ino, k.st_mtime_ns, k.st_size

    def load(self) -> grpc.ServerCertificateConfiguration:
        """The pair as it is now; OSError or ssl.SSLError when the files are not a certificate and its key."""
        stamp = self._stat()
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.cert, self.key)
        pair = (self.key.read_bytes(), self.cert.read_bytes())
        self._stamp = stamp
        return grpc.ssl_server_certificate_configuration([pair])

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            stamp = self._stat()
            if stamp in (self._stamp, self._refused):
                return None
            loaded = self.load()
        except (OSError, ssl.SSLError) as exc:
            with contextlib.suppress(OSError):
                self._refused = self._stat()
            if str(exc) != self._complaint:
                self._complaint = str(exc)
                log.warning("TLS certificate %s not reloaded, the one served stays: %s", self.cert, exc)
            return None
        self._complaint = ""
        log.info("TLS certificate %s changed: new connections get the new one", self.cert)
        return loaded
