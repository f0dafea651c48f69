"""What the MQTT listener refused and what failed without a client to tell: plain counts kept on the event
loop (a Prometheus counter's lock would cost every connection), read at scrape time by ``Collector``."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector as _Collector

log = logging.getLogger(__name__)

# refusal reasons (``lmq_mqtt_refused``)
CONNECTIONS = "connections"  # --mqtt-max-connections sockets were open
PER_ADDRESS = "connections_per_address"  # --mqtt-max-connections-per-address from the client's address
UNANSWERED = "unanswered"  # over a cap while too many refusals were being answered: closed before CONNECT
WILL_BYTES = "will_bytes"  # --mqtt-max-will-bytes
WILL_DELAY = "will_delay"  # --mqtt-max-will-delay-s
KEEP_ALIVE = "keep_alive"  # --mqtt-max-keep-alive-s (3.1.1)
CONNECT_TOO_LARGE = "connect_too_large"  # a CONNECT over what the will cap and its other fields allow
READ_BYTES = "read_bytes"  # a large packet over what --mqtt-max-read-bytes had left
READ_BYTES_PER_ADDRESS = "read_bytes_per_address"  # over what --mqtt-max-read-bytes-per-address had left
READ_RATE = "read_rate"  # a large packet begun arriving slower than --mqtt-min-read-rate
SESSIONS = "sessions"  # a CONNECT that would make a persistent session past --mqtt-max-sessions
QOS2_INFLIGHT = "qos2_inflight"  # 3.1.1: a QoS 2 publish over --mqtt-max-qos2-inflight awaiting PUBREL
RECEIVE_MAXIMUM = "receive_maximum"  # 5.0: a QoS 1/2 publish over our Receive Maximum unanswered
SHARES_PER_CLIENT = "shares_per_client"  # a shared subscription over --mqtt-max-shares-per-client
FILTERS_PER_CLIENT = "filters_per_client"  # a topic filter over the 1,000 one session may hold
SHARE_MEMBERS = "share_members"  # a member over --mqtt-max-share-members
# failures with no client to answer (``lmq_mqtt_errors``)
SESSION_EXPIRY_WRITE = "session_expiry_write"  # a session's end not recorded: it may expire late or early
CONNECTION_END = "connection_end"  # a connection's publisher or settler failed as the connection ended
WILL_WRITE = "will_write"  # a delayed will not stored (published at once instead)
WILL_PUBLISH = "will_publish"  # a will due not published (it waits and is tried again)


REFUSALS_LOGGED_PER_S: Final = 20  # INFO lines about refused packets, at most, per second (the rest: counted)


class RefusalLog:
    """Refused publishes and subscriptions at INFO, with the client id, the topic and why (never a payload or
    a credential): a client looping on a refused publish must not flood the log, so at most
    ``REFUSALS_LOGGED_PER_S`` lines a second; the next line says how many were left out meanwhile."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._second = 0
        self._logged = 0
        self._skipped = 0

    def refused(self, client_id: str, what: str, topic: str, why: str, outcome: str) -> None:
        second = int(self._clock())
        if second != self._second:
            self._second, self._logged = second, 0
        if self._logged >= REFUSALS_LOGGED_PER_S:
            self._skipped += 1
            return
        self._logged += 1
        skipped, self._skipped = self._skipped, 0
        more = f" ({skipped} more refusals not logged)" if skipped else ""
        log.info("mqtt client %s: %s to %r refused: %s; %s%s", client_id, what, topic[:200], why, outcome, more)


@dataclass
class Stats:
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    publishes_refused: collections.Counter[str] = field(default_factory=collections.Counter)  # by reason name
    refusals: RefusalLog = field(default_factory=RefusalLog)


class Collector(_Collector):
    def __init__(self, stats: Stats, sockets: Callable[[], int], reading: Callable[[], int]) -> None:
        self._stats = stats
        self._sockets = sockets
        self._reading = reading

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        refused = CounterMetricFamily(
            "lmq_mqtt_refused",
            "MQTT connections refused, by cap: connections, connections_per_address (CONNACK 0x97, 3.1.1: 0x03), "
            "unanswered (over a cap, closed before CONNECT), will_bytes, connect_too_large (0x95), will_delay (0x97), "
            "keep_alive (3.1.1: a keep alive over --mqtt-max-keep-alive-s: CONNACK 0x02), "
            "read_bytes (a large packet while --mqtt-max-read-bytes were being read: DISCONNECT 0x97), "
            "read_bytes_per_address (the same, of --mqtt-max-read-bytes-per-address from its address), "
            "read_rate (a large packet arriving slower than --mqtt-min-read-rate: DISCONNECT 0x97), "
            "sessions (a new persistent session past --mqtt-max-sessions: CONNACK 0x97, 3.1.1: 0x03), "
            "qos2_inflight (3.1.1: a QoS 2 publish over --mqtt-max-qos2-inflight awaiting PUBREL: closed), "
            "receive_maximum (5.0: a QoS 1/2 publish over our Receive Maximum: DISCONNECT 0x93), "
            "shares_per_client, share_members (a shared subscription: SUBACK 0x97, 3.1.1: 0x80), "
            "filters_per_client (a topic filter over the 1,000 a session may hold: SUBACK 0x97, 3.1.1: 0x80)",
            labels=["reason"],
        )
        caps = (CONNECTIONS, PER_ADDRESS, UNANSWERED, WILL_BYTES, WILL_DELAY, KEEP_ALIVE, CONNECT_TOO_LARGE)
        subscribing = (SHARES_PER_CLIENT, SHARE_MEMBERS, FILTERS_PER_CLIENT)
        reading = (READ_BYTES, READ_BYTES_PER_ADDRESS, READ_RATE)
        for reason in (*caps, SESSIONS, *reading, QOS2_INFLIGHT, RECEIVE_MAXIMUM, *subscribing):
            refused.add_metric([reason], self._stats.refused[reason])
        yield refused
        errors = CounterMetricFamily(
            "lmq_mqtt_errors",
            "MQTT failures no client could be told of (each also logged): session_expiry_write, connection_end, "
            "will_write, will_publish",
            labels=["kind"],
        )
        for kind in (SESSION_EXPIRY_WRITE, CONNECTION_END, WILL_WRITE, WILL_PUBLISH):
            errors.add_metric([kind], self._stats.errors[kind])
        yield errors
        publishes = CounterMetricFamily(
            "lmq_mqtt_publishes_refused",
            "MQTT publishes refused, by MQTT 5 reason (5.0 QoS 1/2: a PUBACK/PUBREC with it; 3.1.1 and QoS 0: the "
            "connection closed, 5.0 after a DISCONNECT with it); each also logged at INFO (rate-limited)",
            labels=["reason"],
        )
        for reason, n in sorted(self._stats.publishes_refused.items()):
            publishes.add_metric([reason], n)
        yield publishes
        yield GaugeMetricFamily("lmq_mqtt_sockets", "MQTT sockets open (CONNECT or not)", value=self._sockets())
        yield GaugeMetricFamily(
            "lmq_mqtt_read_bytes", "Bytes of large MQTT packets (over 64 KiB) being read now (--mqtt-max-read-bytes)",
            value=self._reading(),
        )  # fmt: skip


async def wait_ended(task: asyncio.Task[None], what: str, counts: Stats) -> None:
    """Wait for ``task``, which ends with its connection: its failure logged and counted (``CONNECTION_END``),
    never raised. A cancellation of this wait goes on up: ``asyncio.wait`` raises it, never the task's own."""
    await asyncio.wait([task])
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        counts.errors[CONNECTION_END] += 1
        log.error("%s failed as the connection ended", what, exc_info=exc)
