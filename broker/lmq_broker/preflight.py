"""Checks ``serve`` makes before it creates anything, so a newcomer's mistake ends in one line that names the
cause and the flag (exit code 2), with no data dir created and no traceback.

* A port another program (or a second ``make run``) listens on: each port the broker binds alone (``--port``,
  ``--admin-port``, ``--metrics-port``, ``--mqtt-port``, ``--external-port``; 0 means "any free port" and is
  never busy; the ports shared by ``--processes`` are bound with SO_REUSEPORT and not checked).
* A data dir another broker process holds (RocksDB's lock on ``meta/LOCK``), told apart from other store
  errors when the store opens (``describe_start_failure``).
"""

from __future__ import annotations

import errno
import socket

from lmq_broker import errors
from lmq_broker.config import ENV_PREFIX, BrokerConfig


def _listening_ports(config: BrokerConfig) -> list[tuple[str, int]]:
    ports = [("port", config.port)]
    if config.admin_port > 0:
        ports.append(("admin_port", config.admin_port))
    ports += [(f, getattr(config, f)) for f in ("metrics_port", "mqtt_port", "external_port")]
    return [(flag, port) for flag, port in ports if port > 0]


def _busy(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no clash
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def _flag(field: str) -> str:
    return f"--{field.replace('_', '-')} (or {ENV_PREFIX}{field.upper()})"


def check_ports(config: BrokerConfig) -> None:
    """Raise ``SystemExit`` naming the first port in use and its flag."""
    host = config.host or "0.0.0.0"
    for field, port in _listening_ports(config):
        if _busy(host, port):
            raise SystemExit(
                f"lmq-broker: port {port} on {host} is already in use (another broker, or another program, "
                f"listens there): stop it or choose another port with {_flag(field)}"
            )


def describe_start_failure(config: BrokerConfig, exc: BaseException) -> str | None:
    """One line for a start failure a user causes (a data dir in use, a port taken between the check and the
    bind); None for anything else (a bug: its traceback is wanted)."""
    if isinstance(exc, errors.StorageError) and "LOCK" in exc.message:
        return (
            f"lmq-broker: data dir {config.store.data_dir} is in use by another broker process (it holds "
            f"{config.store.data_dir}/meta/LOCK): stop that broker or choose another {_flag('data_dir')}"
        )
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return f"lmq-broker: a port is already in use ({exc.strerror}): check {_flag('port')} and the other ports"
    if isinstance(exc, RuntimeError) and "Failed to bind" in str(exc):
        return f"lmq-broker: {str(exc).split(';')[0]}: the port is in use; choose another with {_flag('port')}"
    return None
