"""The grpc.aio server both services share (v2 MessagingService and lmq admin), on one port.

Each service is guarded with its own key pair: the v2 service by ``auth.AuthInterceptor`` with the client
pair when one is configured (the official clients sign every call), the admin service always by
``auth.AdminGuard`` with the admin pair (``admin.service.register``; our admin client signs the same way,
``protocol.auth.sign_metadata``), unless the broker runs with ``--admin-anonymous``. So no caller without
the admin pair can administer the broker, even with client auth off. The probes are HTTP (``/healthz``,
``/readyz``), off this port, so they need no credentials.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import grpc

from lmq_broker.config import BrokerConfig
from lmq_broker.protocol import auth, guard
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


def options(config: BrokerConfig) -> list[tuple[str, Any]]:
    limit = max(MIN_MESSAGE_BYTES, 4 * config.max_body_bytes)
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.so_reuseport", 0),  # a second broker on the same port must fail, not share it
        *KEEPALIVE_OPTIONS,
    ]


def create(config: BrokerConfig) -> grpc.aio.Server:
    interceptors: Sequence[Interceptor] = ()
    if config.access_key:
        interceptors = (
            auth.AuthInterceptor(config.access_key, config.secret_key, max_skew_s=config.auth_max_skew_ms / 1000),
        )
    return grpc.aio.server(interceptors=interceptors, options=options(config))


def add_messaging_service(server: grpc.aio.Server, edge: Edge) -> MessagingService:
    service = MessagingService(edge)
    server.add_generic_rpc_handlers((guard.generic_handler(service),))
    return service


def bind(server: grpc.aio.Server, config: BrokerConfig) -> int:
    """Listen on ``config.host:config.port`` (TLS when a certificate is configured); returns the bound port."""
    address = f"[{config.host}]:{config.port}" if ":" in config.host else f"{config.host}:{config.port}"
    if config.tls_cert is not None and config.tls_key is not None:
        credentials = grpc.ssl_server_credentials([(config.tls_key.read_bytes(), config.tls_cert.read_bytes())])
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return port
