"""``python -m lmq_broker serve``: flags and ``LMQ_*`` variables become one BrokerConfig, then the broker runs
until SIGTERM/SIGINT, when it drains calls and flushes the store.

Every field of BrokerConfig and StoreConfig is a flag (``data_dir`` -> ``--data-dir``) and an environment
variable (``LMQ_DATA_DIR``); a flag wins over the variable, the variable over the default. The flags are
generated from the config models so none can be forgotten. Once listening, the process prints one line
``lmq-broker ready grpc=<host:port> metrics=<port> admin=<port>`` (and `` mqtt=<port>`` with ``--mqtt-port``,
`` external=<port>`` with ``--external-port``, and `` listen=<host>`` when it listens on every interface) on
stdout (port 0 picks free ports; tools and tests read that line; ``grpc=`` is where a local client connects).
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import faulthandler
import logging
import os
import signal
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import pydantic

from lmq_broker import app, errors, heap, preflight, supervisor
from lmq_broker.cluster import links, membership, setup
from lmq_broker.config import ENV_PREFIX, BrokerConfig, EdgeKind, StoreConfig
from lmq_broker.protocol import native as native_edge
from lmq_broker.replication import setup as replication_setup
from lmq_broker.storage import meta as storage_meta
from lmq_broker.storage import store as storage_store

READY_LINE: Final = "lmq-broker ready"
SWITCH_INTERVAL_S: Final = 0.0005
# glibc's default is 8 per core, one per thread that ever allocated concurrently; a broker's threads (gRPC,
# store workers, RocksDB) then spread its heap over many arenas that each keep their own free pages.
MALLOC_ARENAS: Final = 2

HELP: Final[dict[str, str]] = {
    "data_dir": "directory of the commit log and index (created if missing)",
    "flush_mode": "sync: a send is answered after fsync; async: fsync every --flush-interval-ms",
    "host": "address to listen on (gRPC and metrics)",
    "port": "gRPC port of the v2 MessagingService, and of the lmq admin service unless --admin-port (0: any free port)",
    "admin_port": "serve the lmq admin service on this port only, not on --port (0: any free port; -1: on --port)",
    "metrics_port": "HTTP port of /metrics, /healthz and /readyz (0: any free port, -1: off)",
    "mqtt_port": "MQTT 5.0/3.1.1 port: any topic, <parent>/<lite topic> or in --mqtt-default-parent, over the same "
    "store (0: any free port, -1: off)",
    "lite_level_index": "find the lite topics of filters without a literal prefix (MQTT '+/x', patterns) in a trie "
    "of each parent's lite-name levels, built when a match on the store's key order would read too much or such "
    "matches add up, then kept (--no-lite-level-index: walk the parent)",
    "mqtt_default_parent": "LITE parent topic (created at start when MQTT is on) holding every MQTT topic whose "
    'first level names no parent, escaped level by level (docs/mqtt.md "Topic mapping")',
    "mqtt_max_connections": "MQTT sockets open at once; beyond it a CONNECT is refused (5.0: 0x97 quota exceeded, "
    "3.1.1: 0x03 server unavailable)",
    "mqtt_max_connections_per_address": "MQTT sockets open at once from one client IP address; beyond it a CONNECT "
    "is refused as with --mqtt-max-connections",
    "mqtt_max_will_bytes": "largest MQTT will payload; a CONNECT with a larger one is refused (5.0: 0x95 packet too "
    "large, 3.1.1: 0x05 not authorized)",
    "mqtt_max_read_bytes": "bytes of MQTT packets over 64 KiB all connections may be reading at once; a packet "
    "beyond it ends its connection (5.0: DISCONNECT 0x97 quota exceeded)",
    "mqtt_max_qos2_inflight": "MQTT 3.1.1: QoS 2 publishes one client may leave awaiting their PUBREL; a new one "
    "beyond closes the connection (5.0 clients are bounded by the broker's Receive Maximum, 256)",
    "mqtt_max_keep_alive_s": "longest MQTT keep alive a client may ask; 5.0 clients asking more or none (0) are told "
    "Server Keep Alive with it, 3.1.1 clients asking more are refused (0x02), asking none are held to it",
    "mqtt_max_will_delay_s": "longest MQTT 5 will delay; a CONNECT asking more is refused (0x97 quota exceeded)",
    "mqtt_max_shares_per_client": "MQTT shared subscriptions ($share/...) one session may hold; beyond it the filter "
    "is refused in the SUBACK (5.0: 0x97 quota exceeded, 3.1.1: 0x80)",
    "mqtt_max_share_members": "sessions one MQTT shared subscription may have as members on this broker; beyond it "
    "the filter is refused in the SUBACK (5.0: 0x97 quota exceeded, 3.1.1: 0x80)",
    "mqtt_max_sessions": "MQTT persistent sessions this broker holds (connected or not); a CONNECT that would make "
    "one more is refused (5.0: 0x97 quota exceeded, 3.1.1: 0x03 server unavailable); resuming one never is",
    "mqtt_max_session_expiry_s": "longest an MQTT persistent session outlives its connection: a 5.0 client asking "
    "more (or never) is told this in its CONNACK, a 3.1.1 persistent session expires after it (4294967295: never)",
    "mqtt_max_read_bytes_per_address": "bytes of --mqtt-max-read-bytes the connections of one client IP address may "
    "hold; a packet beyond it ends its connection (5.0: DISCONNECT 0x97 quota exceeded)",
    "mqtt_min_read_rate": "bytes per second an MQTT packet over 64 KiB must arrive at, on average from its first byte "
    "(at most 64 KiB behind); a slower one ends its connection (5.0: DISCONNECT 0x97 quota exceeded; 0: no pace)",
    "broker_name": "broker name put in routes",
    "advertised_host": "host put in routes (default: the address the client used to reach the broker)",
    "bootstrap": "on a fresh data dir, create parent topic AGENT_TASK_NS (LITE) and lite group executor-group",
    "access_key": "require every v2 client call to be signed with this access key (MQv2-HMAC-SHA1)",
    "admin_access_key": "access key admin calls (lmq.admin.v1) must be signed with (default: generated into "
    "<data-dir>/admin-credentials.json on first start)",
    "admin_secret_key": "secret key matching --admin-access-key",
    "admin_anonymous": "DEVELOPMENT ONLY: serve admin calls to anyone, unsigned",
    "acl": "access control: v2 calls must be signed by a user (lmq-admin user put) and MQTT CONNECTs name one; "
    "each call is checked against the policies (lmq-admin acl put), default deny; refusals are FORBIDDEN (40300) "
    "/ MQTT 0x87",
    "acl_cache_entries": "access decisions remembered per broker, by user, action, resource (and address where a "
    "policy names networks); emptied when full, and on every user or policy change (0: none)",
    "cluster_secret": "secret the brokers of a cluster sign their calls to each other with, the same on every broker "
    "(default: derived from the admin secret key; serve --processes N alone generates one)",
    "auth_max_skew_ms": "signed calls: how far x-mq-date-time may be from the broker's UTC clock (0: unchecked)",
    "secret_key": "secret key matching --access-key",
    "tls_cert": "PEM certificate: serve gRPC over TLS (with --tls-key)",
    "tls_key": "PEM private key of --tls-cert",
    "tls_ca": "PEM CA that signed the brokers' certificates: calls to peers check them against it (default: "
    "--tls-cert itself, for a self-signed certificate)",
    "tls_server_name": "the name peers' certificates are checked against (default: the host dialled)",
    "max_concurrent_calls": "calls running at once; beyond it a call is answered TOO_MANY_REQUESTS (0: no cap)",
    "max_polls_per_client": "ReceiveMessage long polls one client id may have parked at once; beyond it a poll is "
    "answered TOO_MANY_REQUESTS (0: no cap)",
    "max_polls_per_connection": "ReceiveMessage long polls parked at once on one connection, whatever the client ids "
    "(0: no cap)",
    "max_polls": "ReceiveMessage long polls parked at once in all, whatever the client ids and connections; beyond it "
    "a poll is answered TOO_MANY_REQUESTS (0: no cap)",
    "max_connections": "client connections open at once on the client port; beyond it a new one is closed at its "
    "accept (grpcio's edge: refused by grpc core's connection quota) (0: no cap)",
    "max_connections_per_address": "native edge: client connections open at once from one client IP address; beyond "
    "it a new one is closed at its accept (0: no cap)",
    "max_request_buffer_bytes": "native edge: request bytes held at once in messages not yet whole, over every "
    "connection (one client IP address's connections: a quarter of it); a call whose next bytes would pass it ends "
    "RESOURCE_EXHAUSTED (0: no cap; each at least one message of the largest size)",
    "max_request_buffer_bytes_per_connection": "native edge: request bytes one connection's calls hold at once in "
    "messages not yet whole; a call whose next bytes would pass it ends RESOURCE_EXHAUSTED (0: no cap; at least one "
    "message of the largest size)",
    "max_telemetry_streams_per_client": "Telemetry streams one client id may have open; beyond it a stream is ended "
    "RESOURCE_EXHAUSTED (0: no cap)",
    "max_telemetry_streams_per_connection": "Telemetry streams open on one connection, whatever the client ids (0: no "
    "cap)",
    "max_streams_per_connection": "HTTP/2 streams (calls) open at once on one client connection, any method; a "
    "client's streams beyond it wait (refused REFUSED_STREAM, which gRPC clients retry) (0: no cap)",
    "telemetry_stream_buffer_bytes": "Telemetry replies one stream's client has not read yet, in bytes (each counted "
    "as at least 256); beyond it the stream is ended (0: no cap)",
    "telemetry_buffer_bytes": "Telemetry replies queued but not yet read by their clients, in bytes, over all streams; "
    "beyond it new streams are refused RESOURCE_EXHAUSTED (0: no cap)",
    "client_expiry_ms": "forget clients (and their subscriptions) silent for this long",
    "full_sync_grace_ms": "a lite subscribe or unsubscribe answered less than this long before a client's full sync "
    "(COMPLETE_ADD) arrived stays made: the client built that set before it heard the answer (0: the full sync "
    "replaces the set as sent)",
    "subscriptions_save_interval_ms": "write changed lite subscriptions to the data dir at most this often, so a "
    "crashed broker restores them (0: only at shutdown)",
    "retention_max_age_ms": "drop closed log segments whose newest message is older than this (-1: keep)",
    "retention_max_bytes": "drop the oldest closed log segments while the log is larger than this (-1: no limit)",
    "retention_interval_ms": "how often the broker applies --retention-max-age-ms and --retention-max-bytes",
    "heap_trim_interval_ms": "how often freed C-heap memory is handed back to the OS (glibc malloc_trim; 0: never)",
    "lease_renew_slice_ms": "push consumers (auto_renew): lease length, renewed while the client lives",
    "lease_renew_max_ms": "push consumers: stop renewing a lease this long after delivery (0: never renew)",
    "max_suspend_ms": "dead-letter a message once it was suspended (ChangeInvisibleDuration suspend) this long "
    "in all (-1: no cap)",
    "lite_ttl_interval_ms": "expire lite topics idle past their parent's expiration in the broker, a pass this "
    "often (0: off; the reclaim job is the bulk path either way)",
    "lite_ttl_batch": "lite-topic expiry: index rows read per step of a pass (on a worker thread)",
    "lite_ttl_step_pause_ms": "lite-topic expiry: pause between two steps of a pass",
    "lite_ttl_cpu_share": "lite-topic expiry: at most this share of one core on average over a pass (longer pauses "
    "between steps; 0.0025 = a quarter of a percent; 0: only --lite-ttl-step-pause-ms)",
    "lite_ttl_min_age_ms": "lite-topic expiry: never expire a topic idle for less than this, and start the first pass "
    "this long after the broker (RocketMQ minLiteTTl)",
    "peers": "scale-out: host:port of every broker (ring slot) in slot order, comma-separated; with --processes, "
    "of every pod (docs/scale-out.md)",
    "replicas": "replication: copies of every ring slot (owner + followers on other pods); 1: no replication",
    "min_insync_replicas": "replication: copies durable before a send is acknowledged (0: all --replicas; 1: "
    "asynchronous); fewer in the slot's in-sync set: the send fails, retriable",
    "replica_queue_messages": "replication: messages queued per follower, not shipped yet; past it the follower "
    "leaves the in-sync set and catches up later",
    "replica_lag_max_ms": "replication: a member of the in-sync set that has not stored a send this long after "
    "--min-insync-replicas others did leaves the set (Kafka's replica.lag.time.max.ms; never below "
    "--min-insync-replicas: then the send waits, and is refused after 3 s); 0: only a failed copy removes one",
    "replica_port": "replication: the copy socket, where this broker takes its slots' owners' copies over framed TCP "
    "(cheaper than the gRPC stream; docs/replication.md); 0: a port the OS picks, told to owners that ask; -1: none. "
    "Not opened with --tls-cert (copies stay on the TLS channels)",
    "lease_namespace": "replication: namespace of the per-slot Kubernetes Leases (needed for --replicas > 1)",
    "lease_prefix": "replication: the Leases are named <prefix>-slot-<slot>",
    "lease_duration_ms": "replication: a slot's Lease duration; its owner stops acknowledging before it ends",
    "kube_api_server": "replication: the Kubernetes API server URL (empty: in-cluster)",
    "kube_token_file": "replication: bearer token file for the API server (default: the service account's)",
    "kube_ca_file": "replication: CA bundle of the API server (default: the service account's)",
    "ring_history": "scale-out: earlier ring sizes in slots, oldest first, comma-separated (one per scale-up)",
    "ordinal": "scale-out: this broker's place in --peers (-1: where --advertised-address is)",
    "advertised_address": "scale-out: this broker's host:port as written in --peers",
    "processes": "run this many broker processes (one per core), each a ring slot with its own data dir "
    "(<data-dir>/p<i>) and port (--port + 1 + i), all sharing --port",
    "access_port": "also serve on this port, shared with other processes (SO_REUSEPORT; set by --processes)",
    "external_port": "serve the v2 MessagingService for clients outside the cluster on this port too: its routes "
    "name every broker by its external address (0: any free port, -1: off; docs/scale-out.md)",
    "external_addresses": "external host:port of every broker (ring slot) in slot order, comma-separated; with "
    "--processes, of every pod (process i at its port + 1 + i)",
    "external_address_template": "external host:port of pod {ordinal} (also {ordinal*K+N}), for the brokers past "
    "--external-addresses, e.g. lmq-{ordinal}.example.com:9094",
    "external_access_port": "also serve the external listener on this port, shared with other processes (set by "
    "--processes)",
    "pod_mqtt": "another process of this pod serves MQTT (set by --processes with --mqtt-port): this one creates the "
    "MQTT default parent topic as well",
    "pod_processes": "broker processes per pod, for --external-address-template and replicas' pods (set by "
    "--processes)",
    "local_hop": "how a send reaches the process of this pod that owns its lite topic: socket (a Unix socket in "
    "the pod's data dir) or grpc (as between pods)",
    "local_hop_dir": "the directory of this pod's local hop sockets (set by --processes)",
    "send_path": "raw (SendMessage keeps the request's bytes and forwards parts of them as they came) or decoded "
    "(forwarded parts are encoded again; the plain twin)",
    "native_forward": "on: the native edge writes a client's send owned by a process of this pod to its local hop "
    "socket itself, without this process's Python, while placement is plain (one ring size, no leaving slot, "
    "--replicas 1, no client auth); off: every call reaches Python (docs/scale-out.md)",
    "max_body_bytes": "largest message body a send may carry, bytes (beyond it: MESSAGE_BODY_TOO_LARGE)",
    "long_polling_timeout_ms": "longest a receive waits for a message, ms (also the clients' long-poll setting "
    "sent over Telemetry)",
    "receive_batch_size": "messages per receive batch offered to clients over Telemetry (and per MQTT fetch)",
    "max_lite_topic_size": "longest lite topic name, characters (RocketMQ maxLiteTopicSize)",
    "default_client_quota": "a lite group's subscriptions per client when its LiteGroup sets none",
    "default_ready_capacity": "a lite group's ready lite topics queued per client when its LiteGroup sets none",
    "max_subscriptions_per_broker": "lite subscriptions on this broker in all; beyond it 42902 (RocketMQ "
    "maxLiteSubscriptionCount)",
    "max_lite_topics_per_broker": "lite topics on this broker in all; beyond it a send creating one is refused "
    "(-1: no cap)",
    "index_parent_queue": "also index LITE messages in their parent's queue 0 (no reader needs it; halves the append "
    "rate)",
    "flush_interval_ms": "--flush-mode async: fsync the commit log and index this often, ms",
    "segment_max_bytes": "commit-log segment size, bytes (below 4 GiB); retention drops whole closed segments",
    "max_record_bytes": "largest stored record (a message with its properties), bytes",
    "index_cache_bytes": "RocksDB block cache of the index, bytes",
    "edge": "server of the client port: native (lmq_edge, HTTP/2 in Rust, built by `make native`, "
    "docs/design/native-edge.md) or grpcio (grpcio's asyncio server); not given and lmq_edge not built: grpcio, "
    "logged",
    "max_unread_requests": "native edge: a call's request messages read ahead of its handler; past it the call's "
    "stream waits (HTTP/2 flow control stops the client)",
}

# ``serve --help`` in sections; a flag named in none goes by its prefix (``mqtt_``: MQTT, ``lite_ttl_``: lite-topic
# expiry, ``max_``/``default_``: limits), else into "other" (tests/broker/cli/test_cli.py keeps that one empty).
SECTIONS: Final[dict[str, tuple[str, ...]]] = {
    "listening": ("host", "port", "edge", "admin_port", "metrics_port", "advertised_host", "broker_name"),
    "storage": (
        "data_dir",
        "flush_mode",
        "flush_interval_ms",
        "segment_max_bytes",
        "max_record_bytes",
        "index_cache_bytes",
        "index_parent_queue",
        "retention_max_age_ms",
        "retention_max_bytes",
        "retention_interval_ms",
        "bootstrap",
        "subscriptions_save_interval_ms",
    ),
    "delivery": (
        "long_polling_timeout_ms",
        "receive_batch_size",
        "client_expiry_ms",
        "full_sync_grace_ms",
        "lease_renew_slice_ms",
        "lease_renew_max_ms",
        "max_suspend_ms",
        "default_ready_capacity",
        "lite_level_index",
    ),
    "limits": (
        "max_body_bytes",
        "max_lite_topic_size",
        "default_client_quota",
        "max_concurrent_calls",
        "max_unread_requests",
        "max_polls",
        "max_connections",
        "max_connections_per_address",
        "max_request_buffer_bytes",
        "max_request_buffer_bytes_per_connection",
        "telemetry_stream_buffer_bytes",
        "telemetry_buffer_bytes",
    ),
    "lite-topic expiry": (),
    "cluster (docs/scale-out.md)": (
        "peers",
        "ring_history",
        "ordinal",
        "advertised_address",
        "processes",
        "access_port",
        "external_port",
        "external_addresses",
        "external_address_template",
        "external_access_port",
        "pod_processes",
        "pod_mqtt",
        "local_hop",
        "local_hop_dir",
        "send_path",
        "native_forward",
        "cluster_secret",
    ),
    "replication (docs/replication.md)": (
        "replicas",
        "min_insync_replicas",
        "replica_queue_messages",
        "replica_lag_max_ms",
        "replica_port",
        "lease_namespace",
        "lease_prefix",
        "lease_duration_ms",
        "kube_api_server",
        "kube_token_file",
        "kube_ca_file",
    ),
    "security (docs/security.md)": (
        "access_key",
        "secret_key",
        "admin_access_key",
        "admin_secret_key",
        "admin_anonymous",
        "acl",
        "acl_cache_entries",
        "auth_max_skew_ms",
        "tls_cert",
        "tls_key",
        "tls_ca",
        "tls_server_name",
    ),
    "MQTT (docs/mqtt.md)": ("mqtt_port", "mqtt_default_parent"),
    "memory": ("heap_trim_interval_ms",),
}
OTHER_SECTION: Final = "other"


def section_of(name: str) -> str:
    for title, names in SECTIONS.items():
        if name in names:
            return title
    prefixes = (("mqtt_", "MQTT (docs/mqtt.md)"), ("lite_ttl_", "lite-topic expiry"), ("max_", "limits"))
    for prefix, title in (*prefixes, ("default_", "limits")):
        if name.startswith(prefix):
            return title
    return OTHER_SECTION


def _env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def _parser_of(annotation: Any) -> Callable[[str], Any]:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if annotation is bool:
        return _boolean
    if annotation is int:
        return int
    if annotation is float:
        return float
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return annotation
    if annotation is Path:
        return Path
    return str


def _boolean(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _fields() -> list[tuple[str, pydantic.fields.FieldInfo, bool]]:
    """(name, field, belongs to StoreConfig) for every configurable field."""
    out = [(name, f, False) for name, f in BrokerConfig.model_fields.items() if name != "store"]
    out += [(name, f, True) for name, f in StoreConfig.model_fields.items()]
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lmq_broker", description="lmq broker (RocketMQ v2 LiteTopics)")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        usage="python -m lmq_broker serve [--data-dir DIR] [--port PORT] [flags of the sections below]",
        help="run a broker",
        description="Run a broker. Every flag can also be set as an environment variable LMQ_<FLAG> "
        "(e.g. LMQ_DATA_DIR, LMQ_PORT, LMQ_BOOTSTRAP=false); a flag wins over its variable.",
    )
    groups = {title: serve.add_argument_group(title) for title in (*SECTIONS, OTHER_SECTION)}
    for name, field, _ in _fields():
        flag = "--" + name.replace("_", "-")
        text = f"{HELP.get(name, name.replace('_', ' '))} [env {_env_name(name)}]"
        default = field.default
        group = groups[section_of(name)]
        if field.annotation is bool:
            group.add_argument(
                flag,
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{text} (default: {default})",
            )
        else:
            shown = default.value if isinstance(default, enum.Enum) else default
            group.add_argument(
                flag, dest=name, type=_parser_of(field.annotation), default=None, help=f"{text} (default: {shown})"
            )
    serve.add_argument("--log-level", default=os.environ.get(ENV_PREFIX + "LOG_LEVEL", "INFO"), help="log level")
    repair = commands.add_parser(
        "repair-meta",
        help="repair a damaged meta store (the broker stopped)",
        description="Run RocksDB's repair on <data-dir>/meta (consumer offsets, topics, groups, quotas), keeping "
        "every key that can still be read. Back the directory up first. The broker refuses to start on a "
        "damaged meta store and names this command.",
    )
    repair.add_argument("--data-dir", type=Path, required=True, help="the broker's data directory")
    return parser


def config_from(args: argparse.Namespace, environ: Mapping[str, str]) -> BrokerConfig:
    broker: dict[str, Any] = {}
    store: dict[str, Any] = {}
    for name, field, in_store in _fields():
        value = getattr(args, name, None)
        if value is None and _env_name(name) in environ:
            raw = environ[_env_name(name)]
            try:
                value = _parser_of(field.annotation)(raw)
            except ValueError as exc:
                raise SystemExit(f"{_env_name(name)}={raw!r}: {exc}") from None
        if value is not None:
            (store if in_store else broker)[name] = value
    try:
        return BrokerConfig(store=StoreConfig(**store), **broker)
    except pydantic.ValidationError as exc:
        raise SystemExit(f"invalid configuration:\n{exc}") from None


async def serve(config: BrokerConfig) -> None:
    # Store calls run on worker threads; with the default 5 ms GIL switch interval a hand-back to the
    # event loop can wait up to 5 ms behind a busy thread.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    broker = app.Broker(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await broker.start()
    except Exception as exc:
        line = preflight.describe_start_failure(config, exc)
        await broker.stop()  # what started before the failure ends cleanly: no event-loop noise after it
        if line is None:
            raise
        raise SystemExit(line) from None
    app.tune_gc()
    mqtt = f" mqtt={broker.mqtt_port}" if config.mqtt_port >= 0 else ""
    external = f" external={broker.external_port}" if config.external_port >= 0 else ""
    # grpc= is where a client on this host connects; listen= says where the broker listens when that differs
    listen = f" listen={config.host}" if config.host in ("0.0.0.0", "::", "") else ""
    supervisor.say(  # in one write: a log line written meanwhile does not run on from its last port
        f"{READY_LINE} grpc={broker.endpoint} metrics={broker.metrics_port} admin={broker.admin_port}{mqtt}{external}"
        f"{listen}"
    )
    await stop.wait()
    logging.getLogger("lmq_broker").info("shutting down")
    await broker.stop()


def edge_of(config: BrokerConfig) -> BrokerConfig:
    """``config`` with the edge that will serve it: the native edge asked for (``--edge native``, ``LMQ_EDGE``)
    and not servable refuses the start; left at its default, the broker falls back to grpcio's edge and logs
    why, so that ``make run`` works on a machine without Rust (docs/design/native-edge.md)."""
    if config.edge is not EdgeKind.NATIVE or (problem := native_edge.unavailable(config)) is None:
        return config
    if "edge" in config.model_fields_set:
        raise SystemExit(problem)
    why = native_edge.FALLBACK if problem == native_edge.MISSING else f"{problem}: served by grpcio's edge instead"
    logging.getLogger("lmq_broker").warning(why)
    return config.model_copy(update={"edge": EdgeKind.GRPCIO})


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "repair-meta":
        try:
            storage_meta.repair_meta(args.data_dir)
        except errors.StorageError as e:
            raise SystemExit(e.message) from None
        print(f"repaired {args.data_dir / 'meta'}")
        return 0
    config = config_from(args, os.environ)
    logging.basicConfig(
        level=str(args.log_level).upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    if config.access_key and not config.secret_key:
        raise SystemExit("--access-key needs --secret-key")
    if bool(config.admin_access_key) != bool(config.admin_secret_key):
        raise SystemExit("--admin-access-key and --admin-secret-key go together")
    if config.admin_anonymous and config.admin_access_key:
        raise SystemExit("--admin-anonymous and --admin-access-key exclude each other")
    if config.acl and config.admin_anonymous:
        # The admin pair is the super user that manages users, and brokers of a cluster sign their calls with it.
        raise SystemExit("--acl needs the admin key pair: it excludes --admin-anonymous")
    if config.admin_port > 0 and config.admin_port == config.port:
        raise SystemExit("--admin-port must differ from --port (-1 serves admin on --port)")
    if config.admin_port >= 0 and config.processes > 1:
        raise SystemExit("--admin-port does not work with --processes yet: its processes would need one each")
    if (config.tls_cert is None) != (config.tls_key is None):
        raise SystemExit("--tls-cert and --tls-key go together")
    config = edge_of(config)
    try:
        if config.processes == 1:  # with --processes, peers are pods but the ring history counts slots: each
            setup.membership_of(config)  # process checks the ring of slots it is given
            links.external_of(config)
        elif config.replicas > 1:  # a slot's followers are the same process of the next pods, never its own pod's
            pods = len(membership.Membership.parse(config.peers).members) if config.peers else 1
            replication_setup.followers_of(0, pods * config.processes, config.processes, config.replicas)
    except errors.InvalidArgument as exc:
        raise SystemExit(f"invalid cluster configuration: {exc.message}") from None
    if config.external_port >= 0 and config.external_port in (config.port, config.admin_port):
        raise SystemExit("--external-port must differ from --port and --admin-port")
    try:
        storage_store.check_restored(config.store.data_dir)
    except errors.StorageError as exc:
        raise SystemExit(exc.message) from None
    preflight.check_ports(config)
    if config.processes > 1:
        return supervisor.run(list(sys.argv[1:] if argv is None else argv), config)
    heap.limit_arenas(MALLOC_ARENAS)  # before any thread starts
    # a native crash (a fatal signal: SIGSEGV, SIGABRT from a failed check in grpc's core...) dumps every thread's
    # Python stack to stderr first, so the log says where it happened (the supervisor quotes its end)
    faulthandler.enable()
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
