"""One broker process: store + dispatcher + the gRPC server (v2 + admin) + the metrics/probe HTTP server, and
the MQTT listener when ``--mqtt-port`` is given.

Start order is the order of dependence (store, bootstrap, dispatcher, gRPC, MQTT, HTTP) and stop is the
reverse, so that a SIGTERM never loses an acknowledged write: the gRPC server stops taking calls and
drains, then the dispatcher stops, then the store flushes and closes.

The probe server is a few lines of asyncio rather than a web framework: three fixed paths.
``/healthz`` answers while the process runs, unless the store met a fault only a restart can clear (a
failed rebuild, a storage fault that did not heal); ``/readyz`` only once the gRPC port accepts calls and
until shutdown begins, and not while the store cannot serve (an index rebuild, a meta store or an index
that cannot write, a log that cannot be made durable: the answer says why); ``/metrics`` is the
Prometheus text format of this broker's registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from pathlib import Path
from typing import Final

import grpc
import prometheus_client

from lmq_broker import errors, heap, model
from lmq_broker.access import control as access_control
from lmq_broker.access import document
from lmq_broker.access.control import AccessControl
from lmq_broker.admin import backups, credentials, expiry
from lmq_broker.admin import service as admin_service
from lmq_broker.cluster import links, mqtt_link, setup
from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch import saved_subscriptions
from lmq_broker.dispatch.dispatcher import Dispatcher
from lmq_broker.mqtt import stats as mqtt_stats
from lmq_broker.mqtt.server import MqttServer
from lmq_broker.protocol import native, native_metrics
from lmq_broker.protocol import server as grpc_server
from lmq_broker.protocol.admission import Admission
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.metrics import Metrics
from lmq_broker.replication import setup as replication
from lmq_broker.storage import store as lmq_store
from lmq_broker.storage.api import Store

log = logging.getLogger(__name__)

BOOTSTRAP_TOPIC: Final = "AGENT_TASK_NS"  # RocketMQ 5.5.0 LiteTopic quick start names
BOOTSTRAP_GROUP: Final = "executor-group"
SHUTDOWN_GRACE_S: Final = 5.0
HTTP_READ_TIMEOUT_S: Final = 5.0
HEALTH_INTERVAL_S: Final = 1.0
# A batched send allocates ~10 tracked objects per message that live until its reply (a few ms); with
# Python's default threshold of 700 they are traversed by several young collections and promoted, which cost
# 4-5 us of CPU per message sent (about a sixth of the broker's total). Cycles are still collected, in
# batches of up to this many new objects.
GC_GEN0_THRESHOLD: Final = 10_000


def bootstrap(store: Store) -> bool:
    """On a fresh store (no parent topic, no group), create the quick-start parent topic and lite group so
    a first-time user can send and consume at once. Blocking. Returns whether it created anything."""
    if store.list_parent_topics() or store.list_groups():
        return False
    store.put_parent_topic(model.ParentTopic(BOOTSTRAP_TOPIC, model.MessageType.LITE))
    store.put_group(model.LiteGroup(BOOTSTRAP_GROUP, BOOTSTRAP_TOPIC))
    return True


def mqtt_default_parent(store: Store, name: str) -> bool:
    """With MQTT on: the default parent of MQTT topics (docs/mqtt.md "Topic mapping") exists, as a LITE parent
    topic. Blocking. Returns whether it was created."""
    if any(t.name == name for t in store.list_parent_topics()):
        return False
    store.put_parent_topic(model.ParentTopic(name, model.MessageType.LITE))
    return True


def admin_key_pair(config: BrokerConfig) -> tuple[str, str] | None:
    """The pair admin calls must be signed with: configured, else the data dir's file (generated on first
    start); None with ``admin_anonymous``. Blocking. Logs where the pair came from, never the secret."""
    if config.admin_anonymous:
        log.warning(
            "admin is open to anonymous callers (--admin-anonymous): anyone who reaches port %d can create and "
            "delete topics, groups and quotas. For development only.",
            config.admin_port if config.admin_port >= 0 else config.port,
        )
        return None
    if config.admin_access_key:
        log.info("admin calls need the configured admin key pair (access key %s)", config.admin_access_key)
        return config.admin_access_key, config.admin_secret_key
    path = credentials.path_in(config.store.data_dir)
    try:
        pair, created = credentials.load_or_create(config.store.data_dir)
    except errors.InvalidArgument as exc:
        raise errors.InvalidArgument(f"{exc.message}; fix or delete it (a new pair is then generated)") from None
    if created:
        log.info("admin credentials generated in %s (mode 0600): lmq-admin --data-dir reads them", path)
    else:
        log.info("admin credentials read from %s", path)
        if credentials.too_open(path):
            log.warning("%s is readable by others than its owner: chmod 600 it", path)
    return pair.access_key, pair.secret_key


def tune_gc() -> None:
    """For a broker process (not for a process that merely hosts one, e.g. tests): collect young objects in
    bigger batches, and leave everything alive at startup (modules, descriptors, metadata) out of every
    later collection."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, older, oldest)


class Broker:
    def __init__(self, config: BrokerConfig, *, store: Store | None = None) -> None:
        self.config = config
        self.store = store
        self.dispatcher: Dispatcher | None = None
        self.metrics = Metrics()
        self.port = 0
        self.admin_port = 0  # the port admin calls are served on: ``port`` unless --admin-port
        self.metrics_port = 0
        self.mqtt_port = 0
        self.mqtt: MqttServer | None = None
        self.access: AccessControl | None = None  # users and policies (--acl), once started
        self.ready = False
        self._server: grpc_server.Server | None = None  # grpcio's or the native edge (--edge)
        self._admin_server: grpc.aio.Server | None = None  # --admin-port
        self._access_server: grpc.aio.Server | None = None  # --access-port (SO_REUSEPORT)
        self._external_servers: list[grpc.aio.Server] = []  # --external-port (and --external-access-port)
        self.external_port = 0
        self.cluster: setup.Cluster | None = None
        self.replication: replication.Replication | None = None
        self.access_port = -1
        self._admission: Admission | None = None
        self._http: asyncio.Server | None = None
        self._stopped = asyncio.Event()
        self._retention: asyncio.Task[None] | None = None
        self._health: asyncio.Task[None] | None = None
        self._heap_trim: asyncio.Task[None] | None = None
        self._expiry: asyncio.Task[None] | None = None
        self._saver: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()  # also read (a flag) by a retention pass between segments

    @property
    def _snapshot_path(self) -> Path:
        return self.config.store.data_dir / saved_subscriptions.FILE_NAME

    @property
    def endpoint(self) -> str:
        return f"{self._local_host}:{self.port}"

    @property
    def admin_endpoint(self) -> str:
        return f"{self._local_host}:{self.admin_port}"

    @property
    def _local_host(self) -> str:
        return "127.0.0.1" if self.config.host in ("0.0.0.0", "::", "") else self.config.host

    async def start(self) -> None:  # noqa: PLR0912, PLR0915 (the broker's start, step by step in order)
        config = self.config
        admin_keys = await asyncio.to_thread(admin_key_pair, config)  # first: a bad file stops us before any I/O
        if self.store is None:
            self.store = await asyncio.to_thread(lmq_store.open_store, config.store)
        if config.bootstrap and await asyncio.to_thread(bootstrap, self.store):
            log.info("bootstrap: created parent topic %s and lite group %s", BOOTSTRAP_TOPIC, BOOTSTRAP_GROUP)
        if (config.mqtt_port >= 0 or config.pod_mqtt) and await asyncio.to_thread(
            mqtt_default_parent, self.store, config.mqtt_default_parent
        ):
            log.info("mqtt: created the default parent topic %s", config.mqtt_default_parent)
        self.dispatcher = Dispatcher(self.store, config)
        await self.dispatcher.start()
        saved = await asyncio.to_thread(saved_subscriptions.load, self._snapshot_path)
        self.dispatcher.restore_subscriptions(saved)
        if saved:
            log.info("restored lite subscriptions of %d clients from the last save", len(saved))
        if config.subscriptions_save_interval_ms > 0:
            registry = self.dispatcher.registry
            saver = saved_subscriptions.Saver(
                lambda: registry.version,
                self.dispatcher.export_subscriptions,
                self._snapshot_path,
                config.subscriptions_save_interval_ms,
            )
            self._saver = asyncio.create_task(saver.run(), name="lmq-save-subscriptions")
        self.metrics.watch(self.dispatcher)
        self.metrics.watch_counts(
            "lmq_backups",
            "Backups served (lmq-admin backup) by outcome: done, refused (one was running), failed",
            "outcome",
            backups.TALLY.outcomes,
        )
        access = self.access = AccessControl(config.acl, admin_keys, cache_entries=config.acl_cache_entries)
        access.load(document.decode(await asyncio.to_thread(self.store.get_access)))
        self.metrics.registry.register(access_control.Collector(access))
        edge = Edge(self.dispatcher, config, metrics=self.metrics, access=access)
        self.metrics.watch_parking(edge.polls, edge.streams, edge.telemetry_buffer)
        cluster = self.cluster = setup.Cluster(
            config, self.store, self.dispatcher, edge, admin_keys=admin_keys, metrics=self.metrics
        )
        await cluster.start()
        server = self._server = grpc_server.create_client_port(config)
        if isinstance(server, native.NativeServer):  # the edge's own counters, lmq_edge_* (native_metrics)
            self.metrics.registry.register(native_metrics.EdgeCollector(server.stats))
        self._start_replication(server, cluster)
        admission = self._admission = grpc_server.admission(config, edge)
        service = grpc_server.add_messaging_service(server, edge, admission)
        if service.gate.revoker is not None:  # --acl: restored subscriptions under the rules as they are now
            await service.gate.revoker.check_restored()
        admin_server = server
        if config.admin_port >= 0:
            admin_server = self._admin_server = grpc_server.create_admin(config)
            server.add_generic_rpc_handlers((grpc_server.AdminElsewhere(lambda: self.admin_port),))
        admin_service.register(
            admin_server,
            self.store,
            self.dispatcher,
            config,
            admission,
            admin_keys=admin_keys,
            cluster=cluster,
            mqtt=lambda: self.mqtt,
            access=access,
        )
        self.port = edge.port = grpc_server.bind(server, config)
        self.admin_port = self.port
        if self._admin_server is not None:
            self.admin_port = grpc_server.bind(self._admin_server, config, config.admin_port)
            await self._admin_server.start()
        if config.access_port >= 0 and isinstance(server, native.NativeServer):  # one native server, two ports
            self.access_port = grpc_server.bind(server, config, config.access_port, shared_port=True)
        elif config.access_port >= 0:  # --processes: the pod's one client port, shared by its broker processes
            shared = self._access_server = grpc_server.create(config, shared_port=True)
            grpc_server.add_messaging_service(shared, edge, admission)
            if self._admin_server is None:
                admin_service.register(
                    shared,
                    self.store,
                    self.dispatcher,
                    config,
                    admission,
                    admin_keys=admin_keys,
                    cluster=cluster,
                    mqtt=lambda: self.mqtt,
                    access=access,
                )
            else:
                shared.add_generic_rpc_handlers((grpc_server.AdminElsewhere(lambda: self.admin_port),))
            self.access_port = grpc_server.bind(shared, config, config.access_port)
            await shared.start()
        if config.external_port >= 0:
            await self._start_external(edge, admission)
        await cluster.listen_locally(admission)
        if isinstance(server, native.NativeServer) and server.forwards:  # --native-forward: without Python
            cluster.forward_natively(server)
        await server.start()
        cluster.serve()
        if self.replication is not None:
            self.replication.start()
        if config.mqtt_port >= 0:
            owners = mqtt_link.MqttLink(lambda: cluster.peers)  # inactive while the broker runs alone
            self.mqtt = MqttServer(self.dispatcher, config, owners, access)
            self.mqtt_port = await self.mqtt.start(config.host, config.mqtt_port)
            mqtt = self.mqtt
            if self.replication is not None:  # its sessions and retained messages go to this slot's followers
                self.replication.mqtt = lambda: mqtt.durable
                self.replication.states.merged = mqtt.wills.wake  # wills of a slot taken over: due ones go out
                mqtt.replicated = self.replication.states.flushed  # a persistent session's change: on the replicas
            self.metrics.registry.register(
                mqtt_stats.Collector(mqtt.stats, mqtt.sockets_open, lambda: mqtt.read_budget.held)
            )
        if config.metrics_port >= 0:
            self._http = await asyncio.start_server(self._serve_http, config.host, config.metrics_port)
            self.metrics_port = self._http.sockets[0].getsockname()[1]
        if config.store.retention_max_age_ms >= 0 or config.store.retention_max_bytes >= 0:
            self._retention = asyncio.create_task(self._apply_retention_periodically(self.store))
        self._health = asyncio.create_task(self._watch_store_health(self.store, self.dispatcher))
        if config.lite_ttl_interval_ms > 0:
            self._expiry = asyncio.create_task(
                expiry.run(
                    self.store,
                    self.dispatcher,
                    expiry.Settings.of(config),
                    self.dispatcher.wall_clock,
                    self._stopping,
                    on_pass=self._time_expiry,
                    on_step=self._count_expiry,
                )
            )
        if config.heap_trim_interval_ms > 0 and heap.supported():
            self._heap_trim = asyncio.create_task(self._trim_heap_periodically())
        if isinstance(self.store, lmq_store.LmqStore):
            self.metrics.watch_store(self.store)
        self.ready = True

    def _start_replication(self, server: grpc_server.Server, cluster: setup.Cluster) -> None:
        """--replicas > 1: this slot's copies, its followers' copy calls and the per-slot leases."""
        replication.check(self.config)
        if self.config.replicas == 1:
            self.metrics.registry.register(replication.idle_gauges())
            replication.forget_stamps(self.config.store.data_dir)  # records stored from now on name no slot
            return
        if cluster.peers is None or self.dispatcher is None or self.store is None:
            raise errors.InvalidArgument("--replicas above 1 needs a cluster (--peers with other brokers)")
        repl = self.replication = replication.Replication(
            self.config, cluster.peers, self.dispatcher, self.store, self.metrics.registry
        )
        server.add_generic_rpc_handlers((repl.handler(),))
        cluster.ring_fixed = repl.stamps.why_fixed
        cluster.slot_of_topic = repl.slots.slot_of_topic
        self.dispatcher.ingest.replicas = repl.slots
        self.dispatcher.settlement.committed = repl.slots.committed
        self.dispatcher.settlement.followed = repl.slots.followed
        self.dispatcher.settlement.fence = repl.slots.fence
        self.dispatcher.settlement.copy_refused = repl.ack_refused
        self.dispatcher.settlement.hands_out = repl.slots.hands_out

    async def _start_external(self, edge: Edge, admission: Admission) -> None:
        """The external listener (clients outside the cluster): the v2 service with routes naming external
        addresses, never admin; with ``--processes`` also on the pod's shared external port."""
        config = self.config
        addresses = links.external_of(config)
        if addresses is not None and addresses.configured:
            edge.external_address = addresses.of(max(config.ordinal, 0)) if not config.peers else ""
        ports = [(config.external_port, False)]
        if config.external_access_port >= 0:
            ports.append((config.external_access_port, True))
        for port, shared in ports:
            server = grpc_server.create(config, shared_port=shared)
            grpc_server.add_messaging_service(server, edge, admission, external=True)
            server.add_generic_rpc_handlers((grpc_server.AdminElsewhere(None),))
            bound = grpc_server.bind(server, config, port)
            if not shared:
                self.external_port = edge.external_port = bound
            await server.start()
            self._external_servers.append(server)

    async def stop(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Graceful: stop taking calls, let running ones finish (long polls are cut at ``grace_s``), flush."""
        self.ready = False
        if self.dispatcher is not None:
            self.dispatcher.begin_drain()
        self._stopping.set()
        if self._retention is not None:
            await self._retention  # a running pass ends after its current segment, before the store closes
            self._retention = None
        if self._expiry is not None:
            await self._expiry  # a running pass ends after its current step, before the dispatcher closes
            self._expiry = None
        if self._health is not None:
            await self._health
            self._health = None
        if self._heap_trim is not None:
            await self._heap_trim
            self._heap_trim = None
        if self._access_server is not None or self._external_servers:
            shared = [s for s in (self._access_server, *self._external_servers) if s is not None]
            await asyncio.gather(*(s.stop(grace_s) for s in shared))
            self._access_server, self._external_servers = None, []
        if self.mqtt is not None:  # its connections give their leases back while the dispatcher still runs
            await self.mqtt.stop()
            self.mqtt = None
        if self._server is not None or self._admin_server is not None:
            await asyncio.gather(*(s.stop(grace_s) for s in (self._server, self._admin_server) if s is not None))
            self._server = self._admin_server = None
        if self.replication is not None:
            await self.replication.close()
        if self.cluster is not None:
            await self.cluster.close()
        if self._admission is not None:
            self._admission.close()  # the overload summary still owed
            self._admission = None
        if self._saver is not None:
            self._saver.cancel()
            await asyncio.wait([self._saver])  # its end, without taking a cancellation of stop() for its own
            self._saver = None
        if self.dispatcher is not None:
            records = self.dispatcher.export_subscriptions()
            await asyncio.to_thread(saved_subscriptions.save, records, self._snapshot_path)
            await self.dispatcher.close()
        if self.store is not None:
            store = self.store
            await asyncio.to_thread(store.flush)
            await asyncio.to_thread(store.close)
        if self._http is not None:
            self._http.close()
            with contextlib.suppress(Exception):
                await self._http.wait_closed()
            self._http = None
        self._stopped.set()

    async def _watch_store_health(self, store: Store, dispatcher: Dispatcher) -> None:
        """Log when the store stops or resumes serving (an index rebuild, a full disk under ``meta/``); once
        it serves again, the dispatcher looks for the work it could not see meanwhile."""
        trouble: str | None = None
        fatal: str | None = None
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), HEALTH_INTERVAL_S)
                return
            now = await asyncio.to_thread(store.health)
            if now is not None and trouble is None:
                log.error("not ready: %s", now)
            elif now is None and trouble is not None:
                log.warning("ready again (after: %s)", trouble)
                dispatcher.resync()
            trouble = now
            if fatal is None and (fatal := store.fatal()) is not None:
                log.critical("unhealthy (/healthz fails: restart the broker): %s", fatal)

    def _count_expiry(self, report: expiry.Report) -> None:
        """What one step of an expiry pass did, counted as it ends."""
        metrics = self.metrics
        metrics.lite_ttl_scanned.inc(report.scanned)
        metrics.lite_ttl_deleted.inc(report.deleted)
        for reason, count in (
            ("changed", report.kept_changed),
            ("subscribed", report.kept_subscribed),
            ("gone", report.not_found),
        ):
            metrics.lite_ttl_kept.labels(reason).inc(count)

    def _time_expiry(self, report: expiry.Report) -> None:
        self.metrics.lite_ttl_pass_seconds.observe(report.seconds)

    async def _trim_heap_periodically(self) -> None:
        """Every ``heap_trim_interval_ms``: hand the C heap's free pages back to the OS (on a thread)."""
        interval_s = self.config.heap_trim_interval_ms / 1000
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), interval_s)
                return
            released = await asyncio.to_thread(heap.trim)
            self.metrics.heap_trims.inc()
            self.metrics.heap_released_bytes.inc(released)

    async def _apply_retention_periodically(self, store: Store) -> None:
        """Every ``retention_interval_ms``: drop the closed segments past the retention limits (on a thread;
        the store serialises it with appends). A failed pass is logged and tried again next time."""
        interval_s = self.config.store.retention_interval_ms / 1000
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), interval_s)
                return
            try:
                report = await asyncio.to_thread(store.apply_retention, self._stopping.is_set)
            except Exception:
                log.exception("retention pass failed; next attempt in %.1f s", interval_s)
                continue
            if report.segments_deleted:
                self.metrics.retention_segments.inc(report.segments_deleted)
                self.metrics.retention_bytes.inc(report.bytes_deleted)
                log.info(
                    "retention: dropped %d segments (%d bytes); %d queues advanced their first offset",
                    report.segments_deleted,
                    report.bytes_deleted,
                    report.queues_advanced,
                )

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    # --- probes and metrics over HTTP -------------------------------------------------------------------
    async def _serve_http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HTTP_READ_TIMEOUT_S)
            parts = request.split(b"\r\n", 1)[0].split()
            path = parts[1].split(b"?", 1)[0].decode() if len(parts) >= 2 else ""
            code, content_type, body = self._http_answer(path)
            head = (
                f"HTTP/1.1 {code}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _http_answer(self, path: str) -> tuple[str, str, bytes]:
        if path == "/metrics":
            return (
                "200 OK",
                prometheus_client.CONTENT_TYPE_LATEST,
                prometheus_client.generate_latest(self.metrics.registry),
            )
        if path == "/healthz":
            fatal = self.store.fatal() if self.store is not None else None
            if fatal is not None:  # only a restart can help: let the kubelet do it
                return "503 Service Unavailable", "text/plain", f"unhealthy: {fatal}\n".encode()
            return "200 OK", "text/plain", b"ok\n"
        if path == "/readyz":
            if not self.ready:
                return "503 Service Unavailable", "text/plain", b"not ready\n"
            trouble = self.store.health() if self.store is not None else None
            if trouble is not None:
                return "503 Service Unavailable", "text/plain", f"not ready: {trouble}\n".encode()
            return "200 OK", "text/plain", b"ready\n"
        return "404 Not Found", "text/plain", b"not found\n"
