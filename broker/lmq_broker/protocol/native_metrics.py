"""The native edge's own counters (``serve --edge native``) as Prometheus metrics, prefix ``lmq_edge_``: what
happens below Python (connections, TLS handshakes, HTTP/2 streams the client reset, deadlines and refusals
answered natively, bytes). The Rust side counts with plain atomics (``native/edge/src/stats.rs``); this collector
reads all of them in one call at scrape time, so a call costs no Python work for them. docs/monitoring.md
lists them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Native counter name -> (metric name, help). Counters; ``connections_open`` is the one gauge.
COUNTERS: Final = {
    "connections_accepted": ("lmq_edge_connections_accepted", "TCP connections accepted on the client port(s)"),
    "accept_errors": (
        "lmq_edge_accept_errors",
        "Accepts that failed (out of file descriptors or memory: the edge pauses 100 ms after each; a client that "
        "reset its connection in the backlog)",
    ),
    "tls_handshakes_failed": (
        "lmq_edge_tls_handshakes_failed",
        "TLS handshakes that failed or timed out (plaintext client, client that refused the certificate)",
    ),
    "calls": ("lmq_edge_calls", "gRPC calls (HTTP/2 streams) opened, whatever their method"),
    "calls_cancelled": (
        "lmq_edge_calls_cancelled",
        "Calls the client ended before their status: stream reset (RST_STREAM) or connection closed",
    ),
    "deadlines": ("lmq_edge_deadlines_exceeded", "Calls ended natively by their grpc-timeout (DEADLINE_EXCEEDED)"),
    "request_messages": ("lmq_edge_request_messages", "Request messages read and handed to the broker"),
    "read_pauses": (
        "lmq_edge_read_pauses",
        "Times a call's stream stopped being read: --max-unread-requests messages waited for its handler",
    ),
    "bytes_in": ("lmq_edge_received_bytes", "Request body bytes received (gRPC framing included, TLS not)"),
    "bytes_out": ("lmq_edge_sent_bytes", "Reply message bytes handed to HTTP/2 (gRPC framing included)"),
    "forwarded_calls": (
        "lmq_edge_forwarded_calls",
        "SendMessage calls the edge wrote to a sibling's local hop socket itself (--native-forward), not seen by "
        "this process's Python (each also counted in lmq_edge_calls, not in lmq_edge_request_messages)",
    ),
    "forwards_unanswered": (
        "lmq_edge_forwards_unanswered",
        "Calls forwarded natively whose sibling did not answer in time or whose connection closed (the client got "
        "'did not answer; nothing was stored, try again')",
    ),
    "forwards_crowded": (
        "lmq_edge_forwards_crowded",
        "SendMessage calls the edge left to Python because the sibling's connection already carried 1,024 forwards "
        "or 64 MiB not yet written (Python's admission, --max-concurrent-calls, applies to them)",
    ),
    "forward_connections": (
        "lmq_edge_forward_connections",
        "Connections the edge opened to siblings' local hop sockets for natively forwarded sends",
    ),
}
REFUSED: Final = {
    "refused_too_large": "message_too_large",
    "refused_compressed": "compressed",
    "refused_metadata": "metadata_too_large",
    "refused_buffer": "request_buffer",
}
REFUSED_HELP: Final = (
    "Calls refused natively before the broker saw them, by reason: message_too_large (RESOURCE_EXHAUSTED, a "
    "request message over the size limit, inflated or not), compressed (UNIMPLEMENTED: an encoding not served), "
    "metadata_too_large (RESOURCE_EXHAUSTED: headers over 16 KiB), request_buffer (RESOURCE_EXHAUSTED: the bytes of "
    "unfinished request messages past --max-request-buffer-bytes or its per-connection cap)"
)
# Connections closed at their accept, by the cap they would have passed.
CONNECTIONS_REFUSED: Final = {
    "connections_refused": "connections",
    "connections_refused_per_address": "connections_per_address",
}


class EdgeCollector(Collector):
    """``read``: the native edge's snapshot, ``lmq_edge.Server.stats`` (a list of (name, value))."""

    def __init__(self, read: Callable[[], Iterable[tuple[str, int]]]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        values = dict(self._read())
        yield GaugeMetricFamily(
            "lmq_edge_connections_open", "Client connections open now (TLS handshakes in progress included)",
            value=values.get("connections_open", 0),
        )  # fmt: skip
        yield GaugeMetricFamily(
            "lmq_edge_request_buffer_bytes",
            "Request bytes held now in messages not yet whole, every connection (--max-request-buffer-bytes)",
            value=values.get("request_buffer_bytes", 0),
        )
        for key, (name, doc) in COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=values.get(key, 0))
        refused = CounterMetricFamily("lmq_edge_calls_refused", REFUSED_HELP, labels=["reason"])
        for key, reason in REFUSED.items():
            refused.add_metric([reason], values.get(key, 0))
        yield refused
        closed = CounterMetricFamily(
            "lmq_edge_connections_refused",
            "Connections closed at their accept: past --max-connections (connections) or "
            "--max-connections-per-address (connections_per_address)",
            labels=["reason"],
        )
        for key, reason in CONNECTIONS_REFUSED.items():
            closed.add_metric([reason], values.get(key, 0))
        yield closed
