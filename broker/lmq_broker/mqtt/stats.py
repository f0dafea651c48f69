"""What the MQTT listener refused and what failed without a client to tell: plain counts kept on the event
loop (a Prometheus counter's lock would cost every connection), read at scrape time by ``Collector``."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector as _Collector

log = logging.getLogger(__name__)

# refusal reasons (``lmq_mqtt_refused``)
CONNECTIONS = "connections"  # --mqtt-max-connections sockets were open
PER_ADDRESS = "connections_per_address"  # --mqtt-max-connections-per-address from the client's address
UNANSWERED = "unanswered"  # over a cap while too many refusals were being answered: closed before CONNECT
WILL_BYTES = "will_bytes"  # --mqtt-max-will-bytes
WILL_DELAY = "will_delay"  # --mqtt-max-will-delay-s
CONNECT_TOO_LARGE = "connect_too_large"  # a CONNECT over what the will cap and its other fields allow
READ_BYTES = "read_bytes"  # a large packet over what --mqtt-max-read-bytes had left
# failures with no client to answer (``lmq_mqtt_errors``)
SESSION_EXPIRY_WRITE = "session_expiry_write"  # a session's end not recorded: it may expire late or early
CONNECTION_END = "connection_end"  # a connection's publisher or settler failed as the connection ended
WILL_WRITE = "will_write"  # a delayed will not stored (published at once instead)
WILL_PUBLISH = "will_publish"  # a will due not published (it waits and is tried again)


@dataclass
class Stats:
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)


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
            "read_bytes (a large packet while --mqtt-max-read-bytes were being read: DISCONNECT 0x97)",
            labels=["reason"],
        )
        for reason in (CONNECTIONS, PER_ADDRESS, UNANSWERED, WILL_BYTES, WILL_DELAY, CONNECT_TOO_LARGE, READ_BYTES):
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
