"""Operator settings, read once from the environment (the chart sets them; tests set them too).

Two ways to find brokers, because tests run brokers as local processes while a cluster runs a StatefulSet:
a static ``host:port`` list, or the EndpointSlices of the brokers' headless Service.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from lmq_broker import errors
from lmq_broker.admin.tls import ClientTls, client_tls
from lmq_operator import leadership

DEFAULT_ADMIN_PORT: Final = 8081
DEFAULT_METRICS_PORT: Final = 9101
DEFAULT_LIVENESS: Final = "http://0.0.0.0:8080/healthz"
DEFAULT_RESYNC_S: Final = 60.0
DEFAULT_DISCOVERY_TTL_S: Final = 5.0
DEFAULT_ADMIN_TIMEOUT_S: Final = 5.0
DEFAULT_RETRY_DELAY_S: Final = 5.0
DEFAULT_SCALING_S: Final = 5.0
# Reconciles at once (each: admin calls to every broker); others wait their turn. Unbounded, a GitOps sync of
# 10,000 resources opened admin calls for thousands of them at once.
DEFAULT_WORKERS: Final = 100


class SettingsError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Settings:
    namespace: str | None = None  # None: every namespace
    brokers: tuple[str, ...] = ()  # static host:port list; wins over the Service when both are set
    broker_service: str | None = None
    broker_namespace: str | None = None
    broker_statefulset: str | None = None
    admin_port: int = DEFAULT_ADMIN_PORT
    metrics_port: int = DEFAULT_METRICS_PORT  # -1: no metrics server
    liveness_endpoint: str | None = DEFAULT_LIVENESS
    resync_s: float = DEFAULT_RESYNC_S
    discovery_ttl_s: float = DEFAULT_DISCOVERY_TTL_S
    admin_timeout_s: float = DEFAULT_ADMIN_TIMEOUT_S
    retry_delay_s: float = DEFAULT_RETRY_DELAY_S
    admin_keys: tuple[str, str] | None = None  # signs admin calls for brokers started with access keys
    tls: ClientTls | None = None  # LMQ_TLS_CA / LMQ_TLS_SERVER_NAME: brokers serve TLS
    lease: leadership.LeaseConfig | None = None  # None: no leader election (one replica only)
    identity: str = ""  # this process in Lease holders and Events (the pod name in a cluster)
    processes: int = 1  # broker processes per pod (the chart's broker.processes): one ring slot each
    # Replication (docs/replication.md): copies of every ring slot (the chart's broker.replication.replicas) and
    # the prefix of the slots' Leases (<prefix>-slot-<slot>, in the broker namespace), which the operator reads.
    replication: int = 1
    slot_lease_prefix: str = "lmq"
    # The membership of the broker StatefulSet (docs/operator.md, Scaling): the operator's ConfigMap, and each
    # pod's advertised endpoint, a template with {pod} or one host:port per ordinal. Empty: not managed.
    membership_configmap: str | None = None
    broker_addresses: tuple[str, ...] = ()
    scaling_s: float = DEFAULT_SCALING_S
    workers: int = DEFAULT_WORKERS  # 0: unbounded (kopf's default)

    @property
    def manages_membership(self) -> bool:
        return self.membership_configmap is not None

    @property
    def needs_kubernetes_client(self) -> bool:
        return self.broker_service is not None or self.broker_statefulset is not None


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a number") from None
    if value <= 0:
        raise SettingsError(f"{name} must be positive, got {raw}")
    return value


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not an integer") from None


def _endpoint(item: str, name: str = "LMQ_OPERATOR_BROKERS") -> str:
    host, sep, port = item.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise SettingsError(f"{name} entry {item!r} is not host:port")
    return item


def _lease(env: Mapping[str, str], identity: str) -> leadership.LeaseConfig | None:
    name = env.get("LMQ_OPERATOR_LEASE_NAME", "").strip()
    if not name:
        return None
    namespace = env.get("LMQ_OPERATOR_LEASE_NAMESPACE", "").strip()
    if not namespace:
        raise SettingsError("LMQ_OPERATOR_LEASE_NAMESPACE is required with LMQ_OPERATOR_LEASE_NAME")
    conf = leadership.LeaseConfig(
        name,
        namespace,
        identity,
        duration_s=_float(env, "LMQ_OPERATOR_LEASE_DURATION_SECONDS", leadership.DEFAULT_LEASE_DURATION_S),
        renew_deadline_s=_float(env, "LMQ_OPERATOR_LEASE_RENEW_DEADLINE_SECONDS", leadership.DEFAULT_RENEW_DEADLINE_S),
        retry_s=_float(env, "LMQ_OPERATOR_LEASE_RETRY_SECONDS", leadership.DEFAULT_RETRY_S),
    )
    # A leader must give up before its Lease can run out under it, and try more than once before that.
    if not conf.retry_s < conf.renew_deadline_s < conf.duration_s:
        raise SettingsError(
            "lease timings must satisfy retry < renew deadline < lease duration, got "
            f"{conf.retry_s:g} < {conf.renew_deadline_s:g} < {conf.duration_s:g}"
        )
    return conf


def from_env(env: Mapping[str, str]) -> Settings:
    brokers = tuple(_endpoint(b.strip()) for b in env.get("LMQ_OPERATOR_BROKERS", "").split(",") if b.strip())
    service = env.get("LMQ_OPERATOR_BROKER_SERVICE", "").strip() or None
    statefulset = env.get("LMQ_OPERATOR_BROKER_STATEFULSET", "").strip() or None
    broker_ns = env.get("LMQ_OPERATOR_BROKER_NAMESPACE", "").strip() or None
    if not brokers and service is None:
        raise SettingsError("set LMQ_OPERATOR_BROKERS (host:port,...) or LMQ_OPERATOR_BROKER_SERVICE")
    if (service or statefulset) and broker_ns is None:
        raise SettingsError("LMQ_OPERATOR_BROKER_NAMESPACE is required with a broker Service or StatefulSet")
    liveness = env.get("LMQ_OPERATOR_LIVENESS_ENDPOINT", DEFAULT_LIVENESS).strip() or None
    access_key = env.get("LMQ_OPERATOR_ACCESS_KEY", "").strip()
    secret_key = env.get("LMQ_OPERATOR_SECRET_KEY", "").strip()
    if bool(access_key) != bool(secret_key):
        raise SettingsError("set both LMQ_OPERATOR_ACCESS_KEY and LMQ_OPERATOR_SECRET_KEY, or neither")
    try:
        secured = client_tls(environ=env)
    except errors.InvalidArgument as exc:
        raise SettingsError(exc.message) from None
    membership = env.get("LMQ_OPERATOR_BROKER_MEMBERSHIP", "").strip() or None
    addresses = tuple(a.strip() for a in env.get("LMQ_OPERATOR_BROKER_ADDRESS", "").split(",") if a.strip())
    if membership is not None and (service is None or statefulset is None or not addresses):
        raise SettingsError(
            "LMQ_OPERATOR_BROKER_MEMBERSHIP needs LMQ_OPERATOR_BROKER_SERVICE, LMQ_OPERATOR_BROKER_STATEFULSET and "
            "LMQ_OPERATOR_BROKER_ADDRESS"
        )
    for address in addresses:
        if "{pod}" not in address:
            _endpoint(address, "LMQ_OPERATOR_BROKER_ADDRESS")
    processes = _int(env, "LMQ_OPERATOR_BROKER_PROCESSES", 1)
    if not 1 <= processes <= 256:
        raise SettingsError(f"LMQ_OPERATOR_BROKER_PROCESSES must lie within 1..256, got {processes}")
    replication = _int(env, "LMQ_OPERATOR_BROKER_REPLICATION", 1)
    if not 1 <= replication <= 5:
        raise SettingsError(f"LMQ_OPERATOR_BROKER_REPLICATION must lie within 1..5, got {replication}")
    workers = _int(env, "LMQ_OPERATOR_WORKERS", DEFAULT_WORKERS)
    if workers < 0:
        raise SettingsError(f"LMQ_OPERATOR_WORKERS must be 0 (unbounded) or more, got {workers}")
    # Unique even when two processes share a host name (tests, or a pod restarted in place).
    identity = env.get("LMQ_OPERATOR_POD_NAME", "").strip() or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
    return Settings(
        namespace=env.get("LMQ_OPERATOR_NAMESPACE", "").strip() or None,
        brokers=brokers,
        broker_service=service,
        broker_namespace=broker_ns,
        broker_statefulset=statefulset,
        admin_port=_int(env, "LMQ_OPERATOR_BROKER_PORT", DEFAULT_ADMIN_PORT),
        metrics_port=_int(env, "LMQ_OPERATOR_METRICS_PORT", DEFAULT_METRICS_PORT),
        liveness_endpoint=liveness,
        resync_s=_float(env, "LMQ_OPERATOR_RESYNC_SECONDS", DEFAULT_RESYNC_S),
        discovery_ttl_s=_float(env, "LMQ_OPERATOR_DISCOVERY_SECONDS", DEFAULT_DISCOVERY_TTL_S),
        admin_timeout_s=_float(env, "LMQ_OPERATOR_ADMIN_TIMEOUT_SECONDS", DEFAULT_ADMIN_TIMEOUT_S),
        retry_delay_s=_float(env, "LMQ_OPERATOR_RETRY_SECONDS", DEFAULT_RETRY_DELAY_S),
        admin_keys=(access_key, secret_key) if access_key else None,
        tls=secured,
        lease=_lease(env, identity),
        identity=identity,
        processes=processes,
        replication=replication,
        slot_lease_prefix=env.get("LMQ_OPERATOR_SLOT_LEASE_PREFIX", "").strip() or "lmq",
        membership_configmap=membership,
        broker_addresses=addresses,
        scaling_s=_float(env, "LMQ_OPERATOR_SCALING_SECONDS", DEFAULT_SCALING_S),
        workers=workers,
    )
