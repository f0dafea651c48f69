"""The grpc.aio server both services share (v2 MessagingService and lmq admin), on one port.

Each service is guarded with its own key pair: the v2 service by ``auth.AuthInterceptor`` with the client
pair when one is configured (the official clients sign every call), the admin service always by
``auth.AdminGuard`` with the admin pair (``admin.service.register``; our admin client signs the same way,
``protocol.auth.sign_metadata``), unless the broker runs with ``--admin-anonymous``. So no caller without
the admin pair can administer the broker, even with client auth off. The probes are HTTP (``/healthz``,
``/readyz``), off this port, so they need no credentials.

Every call is admitted by one ``admission.Admission`` shared by both services (``--max-concurrent-calls``).
For that, grpc core's own backlog limit is raised (``PENDING_CALLS_MAX``): its default refuses calls the
Python server has not yet taken, past 1,000 of them, as a bare CANCELLED that nothing here sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import grpc

from lmq_broker.config import BrokerConfig
from lmq_broker.protocol import auth, guard
from lmq_broker.protocol.admission import Admission
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.service import MessagingService

if TYPE_CHECKING:
    Interceptor: TypeAlias = grpc.aio.ServerInterceptor[Any, Any]

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
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.so_reuseport", int(shared_port)),  # else a second broker on the same port must fail, not share it
        ("grpc.server.max_pending_requests", PENDING_CALLS_MAX),
        ("grpc.server.max_pending_requests_hard_limit", PENDING_CALLS_MAX),
        *KEEPALIVE_OPTIONS,
    ]


def create(config: BrokerConfig, *, shared_port: bool = False) -> grpc.aio.Server:
    interceptors: Sequence[Interceptor] = ()
    if config.access_key:
        interceptors = (
            auth.AuthInterceptor(config.access_key, config.secret_key, max_skew_s=config.auth_max_skew_ms / 1000),
        )
    return grpc.aio.server(interceptors=interceptors, options=options(config, shared_port=shared_port))


def admission(config: BrokerConfig, edge: Edge) -> Admission:
    """The broker's one admission (both services share it), counting refusals in ``edge.metrics``."""
    return Admission(config.max_concurrent_calls, edge.metrics.refused)


def add_messaging_service(server: grpc.aio.Server, edge: Edge, admitting: Admission | None = None) -> MessagingService:
    service = MessagingService(edge)
    server.add_generic_rpc_handlers((guard.generic_handler(service, admitting),))
    return service


def bind(server: grpc.aio.Server, config: BrokerConfig, port: int | None = None) -> int:
    """Listen on ``config.host:config.port`` (or ``port``; TLS when a certificate is configured); returns the
    bound port."""
    port = config.port if port is None else port
    address = f"[{config.host}]:{port}" if ":" in config.host else f"{config.host}:{port}"
    if config.tls_cert is not None and config.tls_key is not None:
        credentials = grpc.ssl_server_credentials([(config.tls_key.read_bytes(), config.tls_cert.read_bytes())])
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return port
