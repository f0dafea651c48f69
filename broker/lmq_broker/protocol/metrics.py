"""Prometheus metrics of the data plane (prefix ``lmq_``), on a registry owned by one broker instance so
that several brokers in one test process never collide."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from lmq_broker.dispatch import lag
from lmq_broker.dispatch.appender import AppendStats
from lmq_broker.dispatch.delivery import ReadyWaits
from lmq_broker.dispatch.dispatcher import Dispatcher
from lmq_broker.protocol.parking import Budget, Parking
from lmq_broker.storage.api import FaultStats
from lmq_broker.storage.store import LmqStore


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.rpcs = Counter(
            "lmq_rpc", "apache.rocketmq.v2 calls served, by method and v2 status code", ["method", "code"],
            registry=self.registry,
        )  # fmt: skip
        self.rpc_seconds = Histogram(
            "lmq_rpc_duration_seconds", "Time to answer a v2 call (long polls included)", ["method"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5, 30),
        )  # fmt: skip
        self.messages_in = Counter(
            "lmq_messages_in", "Messages stored, by message type", ["type"], registry=self.registry
        )
        self.messages_out = Counter(
            "lmq_messages_out", "Messages handed to consumers (redeliveries included)", registry=self.registry
        )
        self.redeliveries = Counter(
            "lmq_redeliveries", "Messages handed out again after a nack or lease expiry", registry=self.registry
        )
        self.acks = Counter("lmq_acks", "Messages acknowledged", registry=self.registry)
        self.dead_letters = Counter(
            "lmq_dead_letters", "Messages forwarded to a %DLQ% topic on request", registry=self.registry
        )
        self.retention_segments = Counter(
            "lmq_retention_segments_deleted", "Commit-log segments dropped by retention", registry=self.registry
        )
        self.retention_bytes = Counter(
            "lmq_retention_bytes_deleted", "Commit-log bytes dropped by retention", registry=self.registry
        )
        self.lite_ttl_deleted = Counter(
            "lmq_lite_ttl_deleted", "Lite topics deleted by the in-broker expiry (idle past their parent's expiration)",
            registry=self.registry,
        )  # fmt: skip
        self.lite_ttl_kept = Counter(
            "lmq_lite_ttl_kept",
            "Lite topics the in-broker expiry chose but kept at the compare-and-delete, by reason (changed: a message "
            "or consume since; subscribed: a new subscriber; gone: deleted by someone else)",
            ["reason"],
            registry=self.registry,
        )
        self.lite_ttl_scanned = Counter(
            "lmq_lite_ttl_scanned", "Lite topics read by in-broker expiry passes", registry=self.registry
        )
        self.lite_ttl_pass_seconds = Histogram(
            "lmq_lite_ttl_pass_duration_seconds", "Wall time of one in-broker expiry pass (pauses included)",
            registry=self.registry, buckets=(0.01, 0.1, 0.5, 1, 5, 15, 60, 300, 1800, 7200),
        )  # fmt: skip
        self.heap_trims = Counter("lmq_heap_trims", "Periodic hand-backs of free C-heap pages", registry=self.registry)
        self.heap_released_bytes = Counter(
            "lmq_heap_released_bytes", "Resident bytes released by the periodic C-heap trim", registry=self.registry
        )
        self.calls_refused = Counter(
            "lmq_calls_refused",
            "Calls answered at once without being run (v2 TOO_MANY_REQUESTS or gRPC RESOURCE_EXHAUSTED), by RPC "
            "and reason (overload: --max-concurrent-calls were running; per_client, per_connection: the client id or "
            "the connection had --max-polls-per-* long polls parked or --max-telemetry-streams-per-* streams open; "
            "unread: a Telemetry stream's client left --telemetry-stream-buffer-bytes of replies unread; "
            "telemetry_buffer: --telemetry-buffer-bytes of Telemetry replies were waiting to be read)",
            ["rpc", "reason"],
            registry=self.registry,
        )

        self._calls: dict[tuple[str, int], Any] = {}
        self._seconds: dict[str, Any] = {}
        self._in: dict[str, Any] = {}
        self._refused: dict[tuple[str, str], Any] = {}

    def observe(self, method: str, code: int, seconds: float) -> None:
        """Count one answered call (label children are looked up once, then kept: this runs per RPC)."""
        calls = self._calls.get((method, code))
        if calls is None:
            calls = self._calls[(method, code)] = self.rpcs.labels(method, str(code))
        calls.inc()
        timer = self._seconds.get(method)
        if timer is None:
            timer = self._seconds[method] = self.rpc_seconds.labels(method)
        timer.observe(seconds)

    def refused(self, rpc: str, reason: str) -> None:
        counter = self._refused.get((rpc, reason))
        if counter is None:
            counter = self._refused[(rpc, reason)] = self.calls_refused.labels(rpc, reason)
        counter.inc()

    def stored(self, kind: str, count: int) -> None:
        counter = self._in.get(kind)
        if counter is None:
            counter = self._in[kind] = self.messages_in.labels(kind)
        counter.inc(count)

    def watch(self, dispatcher: Dispatcher) -> None:
        """Gauges read from the dispatcher at scrape time."""
        waits = dispatcher.ready_waits
        gauges = (
            ("lmq_clients", "Connected clients known to the registry", dispatcher.client_count),
            ("lmq_lite_subscriptions", "Active (client, lite topic) subscriptions", dispatcher.subscription_count),
            ("lmq_ready_events", "Lite topics queued in clients' ready sets", dispatcher.ready_events),
            ("lmq_in_flight_messages", "Leased, unacknowledged messages", dispatcher.in_flight),
            ("lmq_ready_waits_parked", "Waits for clients' ready lite topics parked now (AwaitLiteReady calls of "
             "other brokers, and this broker's own for the clients it gathers for)", lambda: waits.total),
        )  # fmt: skip
        for name, doc, read in gauges:
            Gauge(name, doc, registry=self.registry).set_function(read)
        self.registry.register(_ReadyWaitsCollector(waits))
        self.registry.register(_AppendCollector(dispatcher.append_stats))
        board = lag.LagBoard(dispatcher.store, dispatcher.client_states, asyncio.get_running_loop(), dispatcher.run)
        self.registry.register(_LagCollector(board))

    def watch_parking(self, polls: Parking, streams: Parking, buffered: Budget) -> None:
        """Calls that wait, read at scrape time."""
        gauges = (
            ("lmq_parked_polls", "ReceiveMessage long polls parked now", lambda: polls.total),
            ("lmq_telemetry_streams", "Telemetry streams open now", lambda: streams.total),
            ("lmq_telemetry_buffered_bytes", "Bytes of Telemetry replies queued for clients that have not read them "
             "yet (at most --telemetry-buffer-bytes)", lambda: buffered.used),
        )  # fmt: skip
        for name, doc, read in gauges:
            Gauge(name, doc, registry=self.registry).set_function(read)

    def watch_counts(self, name: str, doc: str, label: str, read: Callable[[], Mapping[str, float]]) -> None:
        """A counter family read at scrape time, one sample per label value that ``read`` returns."""
        self.registry.register(_CountsCollector(name, doc, label, read))

    def watch_store(self, store: LmqStore) -> None:
        """Damage the store stepped over, and index rebuilds, read at scrape time."""
        self.registry.register(_DamageCollector(store))


class _CountsCollector(Collector):
    def __init__(self, name: str, doc: str, label: str, read: Callable[[], Mapping[str, float]]) -> None:
        self._name, self._doc, self._label, self._read = name, doc, label, read

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._doc, labels=[self._label])
        for value, count in self._read().items():
            family.add_metric([value], count)
        yield family


class _ReadyWaitsCollector(Collector):
    def __init__(self, waits: ReadyWaits) -> None:
        self._waits = waits

    def collect(self) -> Iterator[CounterMetricFamily]:
        w = self._waits
        yield CounterMetricFamily("lmq_ready_waits", "Waits for a client's ready lite topics begun", value=w.started)
        yield CounterMetricFamily(
            "lmq_ready_waits_answered_ready", "Waits that ended because the client had work", value=w.ready
        )
        yield CounterMetricFamily(
            "lmq_ready_waits_refused",
            "AwaitLiteReady calls refused (RESOURCE_EXHAUSTED): too many waits parked for the client or in all",
            value=w.refused,
        )


class _DamageCollector(Collector):
    def __init__(self, store: LmqStore) -> None:
        self._store = store

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        skipped = CounterMetricFamily(
            "lmq_store_damage_skipped",
            "Records the store skipped and reported: corrupt_read (failed its CRC when read), quarantined (bad "
            "record with good ones after it, at recovery; copied to quarantine/), lost (index entries of a "
            "missing segment)",
            labels=["kind"],
        )
        for kind in ("corrupt_read", "quarantined", "lost"):
            skipped.add_metric([kind], self._store.damage.total(kind))
        yield skipped
        yield CounterMetricFamily(
            "lmq_store_index_rebuilds",
            "Index rebuilds from the commit log after damage",
            value=self._store.index_rebuilds,
        )
        yield GaugeMetricFamily(
            "lmq_store_healthy", "1 while the store serves reads and writes (else /readyz says why)",
            value=1 if self._store.health() is None else 0,
        )  # fmt: skip
        yield from _fault_metrics(self._store.faults())


def _fault_metrics(f: FaultStats) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    yield CounterMetricFamily(
        "lmq_store_fsync_failures", "Commit log fsyncs that failed (retries included); writes pause meanwhile",
        value=f.fsync_failures,
    )  # fmt: skip
    yield GaugeMetricFamily(
        "lmq_store_durable", "1 while the commit log can be made durable (0 after a failed fsync, until one "
        "succeeds: writes are refused and /readyz fails meanwhile)", value=1 if f.durable else 0,
    )  # fmt: skip
    yield GaugeMetricFamily(
        "lmq_store_index_writable", "1 while the index takes writes (0 after a failed write, a full disk: "
        "until it is reopened)", value=1 if f.index_writable else 0,
    )  # fmt: skip
    yield CounterMetricFamily(
        "lmq_store_index_reopens", "Reopens of the index to clear a write error (tries, successful or not)",
        value=f.index_reopens,
    )  # fmt: skip
    refused = CounterMetricFamily(
        "lmq_store_writes_refused",
        "Writes the store refused while paused by a fault: not_durable (an fsync failed), index_unwritable",
        labels=["reason"],
    )
    for reason, n in sorted(f.refused.items()):
        refused.add_metric([reason], n)
    yield refused


class _AppendCollector(Collector):
    """Where SendMessage appends run, read at scrape time: the appender keeps plain ints (it counts on the
    event loop, where a Prometheus counter's lock would cost every send)."""

    def __init__(self, read: Callable[[], AppendStats]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self._read()
        commits = CounterMetricFamily(
            "lmq_append_commits",
            "Group commits of SendMessage appends, by where they ran: on the event loop (small requests), or on "
            "the appender thread (large requests, a busy store, or a slow disk)",
            labels=["path"],
        )
        commits.add_metric(["loop"], stats.loop_commits)
        commits.add_metric(["thread"], stats.thread_commits)
        yield commits
        yield GaugeMetricFamily(
            "lmq_append_inline_seconds_average",
            "Moving average of how long an append on the event loop held it (fsync included in sync mode); "
            "above 2 ms, small requests go to the appender thread",
            value=stats.inline_seconds,
        )


class _LagCollector(Collector):
    """Consumer lag per lite group, from the board's last walk (``dispatch/lag.py`` says what it costs)."""

    def __init__(self, board: lag.LagBoard) -> None:
        self._board = board

    def collect(self) -> Iterator[GaugeMetricFamily]:
        found = self._board.read()
        lags = GaugeMetricFamily(
            "lmq_consumer_lag",
            "Messages a lite group has still to consume on this broker, summed over the lite topics of its parent "
            "it consumed from or subscribes to (as lmq-admin groups get); refreshed in the background, at most "
            "every 30 s",
            labels=["group", "parent"],
        )
        for (group, parent), count in sorted(found.items()):
            lags.add_metric([group, parent], count)
        yield lags
        yield GaugeMetricFamily(
            "lmq_consumer_lag_walk_seconds",
            "How long the last consumer-lag walk over the lite topics took (on a worker thread)",
            value=self._board.walk_seconds,
        )
