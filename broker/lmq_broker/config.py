"""Broker configuration: one pydantic model, filled from flags and ``LMQ_*`` environment variables.

Defaults follow RocketMQ 5.5.0 where it has one (proxy port 8081, 4 MiB bodies, 20 s long polling,
2000 subscriptions per client, 100 ready events per client, 64-byte lite topic names).
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Final

from pydantic import BaseModel, ConfigDict, Field

ENV_PREFIX: Final = "LMQ_"


class EdgeKind(enum.StrEnum):
    GRPCIO = "grpcio"  # grpcio's asyncio server (`serve` falls back to it when lmq_edge is not built)
    NATIVE = "native"  # the native HTTP/2 edge, lmq_edge (the default; docs/design/native-edge.md, `make native`)


class LocalHop(enum.StrEnum):
    SOCKET = "socket"  # sends forwarded to a process of this pod go over a Unix socket (cluster.local_hop)
    GRPC = "grpc"  # over gRPC, as to other pods (the plain twin)


class SendPath(enum.StrEnum):
    RAW = "raw"  # SendMessage keeps the request's bytes: what is forwarded is cut out of them (protocol.wire)
    DECODED = "decoded"  # grpcio decodes the request, forwarded parts are encoded again (the plain twin)


class NativeForward(enum.StrEnum):
    ON = "on"  # the native edge forwards a client's send owned by a sibling itself (cluster.native_forward)
    OFF = "off"  # every call reaches Python, which forwards (the plain twin)


class FlushMode(enum.StrEnum):
    SYNC = "sync"  # an append returns only after fsync: an acknowledged message is never lost
    ASYNC = "async"  # fsync every flush_interval_ms


class StoreConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    data_dir: Path = Path("./data")
    flush_mode: FlushMode = FlushMode.SYNC
    flush_interval_ms: int = Field(default=200, ge=1)
    segment_max_bytes: int = Field(default=256 * 1024 * 1024, ge=4096)
    max_record_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    retention_max_age_ms: int = Field(default=72 * 3600 * 1000, ge=-1)  # -1 keeps forever
    retention_max_bytes: int = Field(default=-1, ge=-1)  # -1 unlimited
    retention_interval_ms: int = Field(default=60_000, ge=100)  # how often a serving broker applies retention
    index_cache_bytes: int = Field(default=32 * 1024 * 1024, ge=0)


class BrokerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    store: StoreConfig = StoreConfig()
    host: str = "0.0.0.0"
    port: int = Field(default=8081, ge=0, le=65535)
    # lmq.admin.v1 on its own listener (same host, same TLS), and then not on ``port``, so a network policy can
    # open the client port to everyone and the admin port to the control plane only. -1: served on ``port``.
    admin_port: int = Field(default=-1, ge=-1, le=65535)
    advertised_host: str = ""  # address put in routes; empty → the local IP the client reached
    metrics_port: int = Field(default=9100, ge=-1, le=65535)  # -1 disables the HTTP endpoint
    mqtt_port: int = Field(default=-1, ge=-1, le=65535)  # MQTT 3.1.1 listener (docs/mqtt.md); -1: off
    # LITE parent of the MQTT topics whose first level names no parent (docs/mqtt.md "Topic mapping")
    mqtt_default_parent: str = Field(default="mqtt-default", pattern=r"^[A-Za-z0-9_-]{1,127}$")
    # MQTT resource caps (docs/security.md "Resource caps"): sockets open at once, in all and per client address
    # (beyond: CONNACK 0x97 / 3.1.1 0x03, or closed unanswered when even the refusals are too many); a will's
    # payload and its delay (5.0), beyond which the CONNECT is refused (0x95 / 0x97; 3.1.1: 0x05).
    mqtt_max_connections: int = Field(default=10_000, ge=1)
    mqtt_max_connections_per_address: int = Field(default=1000, ge=1)
    mqtt_max_will_bytes: int = Field(default=64 * 1024, ge=0)
    mqtt_max_will_delay_s: int = Field(default=7 * 24 * 3600, ge=0)
    # Longest keep alive a client may ask: a 5.0 client asking more (or none, 0) is told Server Keep Alive with
    # this; a 3.1.1 client asking more is refused (0x02), one asking none is held to it (docs/mqtt.md)
    mqtt_max_keep_alive_s: int = Field(default=65_535, ge=1, le=65_535)
    # Bytes of large packets (over 64 KiB) all MQTT connections are reading at once; one that does not fit ends
    # its connection (5.0: DISCONNECT 0x97)
    mqtt_max_read_bytes: int = Field(default=256 * 1024 * 1024, ge=0)
    # 3.1.1: QoS 2 publishes a client may leave awaiting their PUBREL (5.0: bounded by our Receive Maximum);
    # a new one beyond closes the connection (3.1.1 has no other refusal)
    mqtt_max_qos2_inflight: int = Field(default=256, ge=1, le=65535)
    # Shared subscriptions (docs/mqtt.md): shares one session may be a member of, members one share may have on
    # this broker; beyond them the filter is refused in the SUBACK (5.0: 0x97, 3.1.1: 0x80)
    mqtt_max_shares_per_client: int = Field(default=100, ge=0)
    mqtt_max_share_members: int = Field(default=1000, ge=1)
    # Persistent sessions (session rows in mqtt.sqlite3) this broker holds: a CONNECT that would make one more is
    # refused (5.0: 0x97, 3.1.1: 0x03); resuming or replacing one never is. And how long one outlives its
    # connection at most: a 5.0 client asking more (or never, 0xFFFFFFFF) is told this in its CONNACK, a 3.1.1
    # persistent session (no expiry in 3.1.1) gets it; 4294967295: never expires
    mqtt_max_sessions: int = Field(default=100_000, ge=1)
    mqtt_max_session_expiry_s: int = Field(default=7 * 24 * 3600, ge=1, le=0xFFFFFFFF)
    # A begun MQTT packet over 64 KiB: what of --mqtt-max-read-bytes one client address may hold (the rest is the
    # others'), and the rate, averaged since its first byte, it must arrive at (at most 64 KiB behind; 0: none)
    mqtt_max_read_bytes_per_address: int = Field(default=64 * 1024 * 1024, ge=0)
    mqtt_min_read_rate: int = Field(default=4096, ge=0)
    broker_name: str = "broker-0"
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1)
    long_polling_timeout_ms: int = Field(default=20_000, ge=1000)
    receive_batch_size: int = Field(default=32, ge=1, le=1024)
    # Filters without a literal prefix find their lite topics in a per-parent trie of lite-name levels (built
    # when first needed, then kept); False: page through the whole parent (the plain twin, for comparison)
    lite_level_index: bool = True
    max_lite_topic_size: int = Field(default=64, ge=1, le=64)
    default_client_quota: int = Field(default=2000, ge=1)
    default_ready_capacity: int = Field(default=100, ge=10)
    max_subscriptions_per_broker: int = Field(default=100_000, ge=1)  # maxLiteSubscriptionCount
    max_lite_topics_per_broker: int = Field(default=-1, ge=-1)
    # Calls running at once (unary calls and admin streams; long polls and telemetry streams are only
    # refused at their start, docs/protocol.md); beyond it a call is answered TOO_MANY_REQUESTS. 0: no cap.
    max_concurrent_calls: int = Field(default=1000, ge=0)
    # Calls that wait hold no such slot, so they have caps of their own (docs/security.md, "Resource caps"):
    # ReceiveMessage long polls parked at once per client id and per connection, Telemetry streams open per client
    # id and per connection, and the bytes of Telemetry replies queued, not yet read, per stream (beyond it the
    # stream is ended) and in all streams (beyond it new streams are refused). 0: no cap.
    max_polls_per_client: int = Field(default=64, ge=0)
    max_polls_per_connection: int = Field(default=1024, ge=0)
    max_polls: int = Field(default=16_384, ge=0)  # parked at once in all, every client id and connection
    max_telemetry_streams_per_client: int = Field(default=8, ge=0)
    max_telemetry_streams_per_connection: int = Field(default=1024, ge=0)
    # HTTP/2 streams one connection may have open at once, whatever they are (SETTINGS_MAX_CONCURRENT_STREAMS on
    # both edges): a stream opened and never sent on holds ~10-20 KiB until its client goes, so without it one
    # connection could hold any amount. Far above the polls' and Telemetry streams' caps together: a broker's
    # connection to a peer carries its AwaitLiteReady waits, one per waiting LiteSimpleConsumer poll, and its
    # other calls queue behind them at the cap. 0: no cap.
    max_streams_per_connection: int = Field(default=16_384, ge=0)
    # Client connections open at once on the client port, in all and from one peer IP address (the native edge
    # closes one past either at its accept; grpcio's edge caps the total alone, grpc core's connection quota). An
    # official client process keeps one connection per broker (Python: every client of the process; Java: one
    # per client), so a fleet of thousands fits; a NAT or proxy in front of many clients may need more per address.
    max_connections: int = Field(default=10_000, ge=0)
    max_connections_per_address: int = Field(default=1_000, ge=0)
    # Request bytes held in messages not yet whole (a stream's message as its client sends it), in all and per
    # connection (the native edge; each at least one message of the largest size; one client IP address's
    # connections a quarter of the total, at least as much): a call whose next bytes would pass any ends
    # RESOURCE_EXHAUSTED. 0: no cap.
    max_request_buffer_bytes: int = Field(default=256 * 1024 * 1024, ge=0)
    max_request_buffer_bytes_per_connection: int = Field(default=64 * 1024 * 1024, ge=0)
    telemetry_stream_buffer_bytes: int = Field(default=256 * 1024, ge=0)  # one stream's replies unread
    telemetry_buffer_bytes: int = Field(default=64 * 1024 * 1024, ge=0)
    client_expiry_ms: int = Field(default=180_000, ge=1000)  # liteSubscriptionCheckTimeoutMills
    # A partial subscription change answered this long before a client's full sync arrived (or after) is newer
    # than the set the client built (dispatch/subscriptions.py); 0: a full sync replaces the set as sent.
    full_sync_grace_ms: int = Field(default=3_000, ge=0)
    # Lite subscriptions written to the data dir while the broker runs (dispatch/saved_subscriptions.py), so a
    # SIGKILL loses at most this long of changes; 0: only at shutdown.
    subscriptions_save_interval_ms: int = Field(default=1000, ge=0)
    # Auto-renew receives (push consumers): leased a slice at a time, renewed while the client lives
    lease_renew_slice_ms: int = Field(default=30_000, ge=1000)
    lease_renew_max_ms: int = Field(default=3 * 3600 * 1000, ge=0)  # 0: never renewed (one slice)
    # Total time one message may spend suspended (ChangeInvisibleDuration with suspend, which counts no
    # attempt) before it is dead-lettered; -1: no cap. RocketMQ has no such cap (nor a default for one).
    max_suspend_ms: int = Field(default=24 * 3600 * 1000, ge=-1)
    # In-broker expiry of lite topics idle past their parent's expiration (docs/reclaim.md): a pass every
    # interval (RocketMQ liteTtlCheckInterval; 0: off), lite_ttl_batch index rows per step on a worker thread,
    # lite_ttl_step_pause_ms between steps; never a topic idle for less than lite_ttl_min_age_ms (minLiteTTl),
    # and the first pass only that long after start.
    lite_ttl_interval_ms: int = Field(default=120_000, ge=0)
    lite_ttl_batch: int = Field(default=1000, ge=1, le=100_000)
    lite_ttl_step_pause_ms: int = Field(default=20, ge=0)
    lite_ttl_min_age_ms: int = Field(default=15 * 60 * 1000, ge=0)
    lite_ttl_cpu_share: float = Field(default=0.0025, ge=0, le=1)  # of one core, a pass's average; 0: unpaced
    bootstrap: bool = True  # create AGENT_TASK_NS + executor-group on first start
    index_parent_queue: bool = False  # also index LITE messages in the parent's queue 0 (no reader; halves append rate)
    access_key: str = ""
    secret_key: str = ""
    # lmq.admin.v1 has its own key pair, required whether or not client auth is on (docs/security.md). Empty:
    # generated once into <data_dir>/admin-credentials.json. admin_anonymous opens admin to anyone (development).
    admin_access_key: str = ""
    admin_secret_key: str = ""
    admin_anonymous: bool = False
    # Users and access policies (lmq_broker.access; docs/security.md): every v2 call is signed by a user and
    # checked against the policies, MQTT CONNECTs name a user; default deny. Off: any caller may do anything.
    acl: bool = False
    acl_cache_entries: int = Field(default=65_536, ge=0)  # decisions remembered (emptied when full); 0: none
    # Brokers of a cluster sign their calls to each other with this (lmq_broker.cluster.trust); empty: derived
    # from admin_secret_key, which every broker of a cluster shares.
    cluster_secret: str = ""
    auth_max_skew_ms: int = Field(default=15 * 60 * 1000, ge=0)  # signed x-mq-date-time vs UTC; 0: unchecked
    # How often freed C-heap memory is handed back to the OS (glibc malloc_trim, lmq_broker.heap); 0: never
    heap_trim_interval_ms: int = Field(default=60_000, ge=0)
    # Which server carries the client port (--port): the native edge (docs/design/native-edge.md), or grpcio's.
    # Left at its default, `serve` without the module lmq_edge falls back to grpcio's and logs why (__main__).
    edge: EdgeKind = EdgeKind.NATIVE
    # Native edge: a call's request messages read ahead of its handler; past it the call's stream is not read
    # (HTTP/2 flow control stops the client). grpcio's edge reads one as the handler asks (its own bound).
    max_unread_requests: int = Field(default=8, ge=1)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # What this broker's calls to its peers trust (scale-out): the CA that signed the brokers' certificates, and
    # the name to check them against (empty: the host dialled). No CA: the peers' certificate is --tls-cert itself
    # (self-signed). LMQ_TLS_CA and LMQ_TLS_SERVER_NAME are also what lmq-admin reads (admin.tls); without
    # --tls-cert both are unused.
    tls_ca: Path | None = None
    tls_server_name: str = ""
    # Scale-out (docs/scale-out.md): the ring slots of the cluster, in slot order, as host:port each; empty:
    # this broker alone. With --processes N every peer is a pod and stands for N slots (its port + 1 + i).
    peers: str = ""
    ring_history: str = ""  # earlier ring sizes in slots, oldest first (one per scale-up)
    ordinal: int = Field(default=-1, ge=-1)  # this broker's place in peers; -1: where advertised_address is
    advertised_address: str = ""  # host:port of this broker in peers
    processes: int = Field(default=1, ge=1, le=256)  # serve: broker processes in this pod, one ring slot each
    access_port: int = Field(default=-1, ge=-1, le=65535)  # also listen here, shared (SO_REUSEPORT); -1: no
    # Clients outside the cluster (docs/scale-out.md, "Clients outside the cluster"): a second v2 listener whose
    # routes name every slot by its external address (lmq_broker.cluster.external). -1: no such listener.
    external_port: int = Field(default=-1, ge=-1, le=65535)
    external_addresses: str = ""  # slot order, host:port each (with --processes: one per pod, as peers)
    external_address_template: str = ""  # one pod's address, "{ordinal}" replaced: for slots past the list
    external_access_port: int = Field(default=-1, ge=-1, le=65535)  # set by --processes: the pod's shared one
    pod_processes: int = Field(default=1, ge=1, le=256)  # set by --processes: slots per pod, for the template
    pod_mqtt: bool = False  # set by --processes: the pod's first process serves MQTT, this one its parents too
    # How a send reaches a sibling process of this pod (cluster.local_hop): a Unix socket in local_hop_dir (set by
    # --processes), or gRPC as between pods.
    local_hop: LocalHop = LocalHop.SOCKET
    local_hop_dir: Path | None = None
    # How a send's request reaches the forwarder: with its wire bytes, forwarded parts cut out of them (raw), or
    # decoded by grpcio and forwarded parts encoded again (decoded, the plain twin; protocol.wire).
    send_path: SendPath = SendPath.RAW
    # Whether the native edge forwards a client's send owned by a sibling process itself, while placement is plain
    # (cluster.native_forward), or hands every call to Python (off, the plain twin).
    native_forward: NativeForward = NativeForward.ON
    # Replication (docs/replication.md): copies per ring slot (1: none, today's broker), how many must be durable
    # before a send is acknowledged (0: all of them), and the Kubernetes Leases that say who owns each slot.
    replicas: int = Field(default=1, ge=1, le=5)
    min_insync_replicas: int = Field(default=0, ge=0, le=5)
    replica_queue_messages: int = Field(default=10_000, ge=1)  # per follower, not shipped yet; past it: dropped
    replica_lag_max_ms: int = Field(default=1_000, ge=0)  # a member holding a send back longer leaves (0: never)
    replica_port: int = Field(default=0, ge=-1, le=65535)  # copies from owners over framed TCP; 0: any port, -1: off
    lease_namespace: str = ""  # empty: no leases, so --replicas must be 1
    lease_prefix: str = "lmq"  # Lease <prefix>-slot-<slot>
    lease_duration_ms: int = Field(default=6_000, ge=300)
    kube_api_server: str = ""  # empty: in-cluster (KUBERNETES_SERVICE_HOST/PORT)
    kube_token_file: Path | None = None  # None: the pod's service account token
    kube_ca_file: Path | None = None  # None: the pod's service account CA
