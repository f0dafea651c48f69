"""MQTT publish -> subscribe latency (p50/p99) and message rate, with paho-mqtt against a broker process, for
MQTT 3.1.1 and MQTT 5.0 in the same run (same broker; 5.0 messages carry a user property, as 5.0 users tend to).

A subscriber process (paho, one connection, QoS 2 subscription ``B/#``: each message comes at its publish
QoS) records when each message arrives; the publisher (paho, another connection, in this process) sends
through the broker's default settings (sync flush: every QoS 1 PUBACK waits for the fsync). Both
processes read CLOCK_MONOTONIC.

- latency: ``--count`` messages at ``--rate`` per second, QoS 1, over ``--topics`` lite topics; latency =
  subscriber's on_message - the moment before ``publish``. Each publish waits for its PUBACK before the next
  goes, as the gRPC round's ``producer.send`` waits for its answer (a closed loop both ways: a store stall
  delays the next sends instead of piling them up; ``--open-loop`` publishes on the schedule regardless,
  where one 100 ms fsync stall shows in every message published during it, which gRPC's round cannot show).
- rate: ``--burst`` messages as fast as paho sends them (up to 100 QoS 1/2 in flight), at QoS 1, QoS 0 and
  QoS 2 (PUBLISH/PUBREC/PUBREL/PUBCOMP both ways; a persistent-session-free client, so no packet-id writes;
  ``--persistent``: the subscriber's session is persistent, so each delivery batch records its packet ids);
  rate = messages / (last arrival - first publish); then QoS 2's rate divided by QoS 1's of the same run.

Each protocol runs the four rounds in turn with its own subscriber process and parent topic; ``--repeat``
alternates the protocols that many times (the machine is noisy: compare figures of one sitting).

Beside them, on the same broker and in the same run, the latency round of the gRPC path: the official Python
client's Producer sends the same number of messages of the same body size at the same rate over as many lite
topics, and a LitePushConsumer in its own process records them (``bench_e2e_latency.measure``). The goal
(issue 27): MQTT QoS 1 p99 <= 1.5 x the gRPC send -> push p99; the ratio is printed per protocol.

    python bench/bench_mqtt.py            # ~60 s
    python bench/bench_mqtt.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from bench_e2e_latency import measure as grpc_measure

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.testing import start_broker

INFLIGHT = 100
PAD_BYTES = 64  # after the ``l<n>:`` key: a ~70-byte payload
GRPC_BODY_BYTES = 70  # the gRPC round's body, as big as the MQTT payloads
GOAL_RATIO = 1.5  # MQTT p99 <= 1.5 x gRPC p99
PROTOCOLS = {"3.1.1": ("B", "MQTT"), "5.0": ("B5", "MQTT 5")}  # protocol -> (parent topic, figure prefix)


def figure(name: str, value: float, unit: str, extra: str = "") -> None:
    print(f"FIGURE {name}: {value:,.2f} {unit}{extra}", flush=True)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def _client(client_id: str, protocol: str, *, persistent: bool = False) -> Any:
    import paho.mqtt.client as mqtt  # noqa: PLC0415 - imported where used (the child too)
    from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion  # noqa: PLC0415

    if protocol == "5.0":
        return mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=MQTTProtocolVersion.MQTTv5)
    return mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=MQTTProtocolVersion.MQTTv311,
                       clean_session=not persistent)  # fmt: skip


def _connect(client: Any, port: int, protocol: str, *, persistent: bool) -> None:
    """Connected; ``persistent``: a persistent session (3.1.1 clean session 0, 5.0 an hour's expiry)."""
    if protocol != "5.0" or not persistent:
        client.connect("127.0.0.1", port)
        return
    from paho.mqtt.packettypes import PacketTypes  # noqa: PLC0415
    from paho.mqtt.properties import Properties  # noqa: PLC0415

    props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    props.SessionExpiryInterval = 3600
    client.connect("127.0.0.1", port, clean_start=True, properties=props)


def _subscribe(port: int, protocol: str, expected: list[int], ready: Any, out: Connection, *, persistent: bool) -> None:
    """The subscriber process: for each round (a count in ``expected``), send back the arrival times (ns)."""

    arrivals: dict[str, int] = {}
    changed = threading.Condition()

    def on_message(_c: Any, _u: Any, message: Any) -> None:
        now = time.perf_counter_ns()
        with changed:
            arrivals.setdefault(message.payload.decode().split(":", 1)[0], now)
            changed.notify_all()

    client = _client(f"bench-sub-{protocol}", protocol, persistent=persistent)
    client.on_message = on_message
    _connect(client, port, protocol, persistent=persistent)
    client.loop_start()
    client.subscribe(f"{PROTOCOLS[protocol][0]}/#", qos=2)
    time.sleep(1.0)
    ready.set()
    for count in expected:
        with changed:
            changed.wait_for(lambda n=count: len(arrivals) >= n, 120)  # type: ignore[misc]
            out.send(dict(arrivals))
            arrivals.clear()
    client.disconnect()
    client.loop_stop()


def _publisher(port: int, protocol: str) -> Any:
    client = _client(f"bench-pub-{protocol}", protocol)
    client.max_inflight_messages_set(INFLIGHT)
    client.max_queued_messages_set(0)
    client.connect("127.0.0.1", port)
    client.loop_start()
    return client


def _properties(protocol: str) -> Any:
    """What a 5.0 publish carries here: one user property (None for 3.1.1)."""
    if protocol != "5.0":
        return None
    from paho.mqtt.packettypes import PacketTypes  # noqa: PLC0415
    from paho.mqtt.properties import Properties  # noqa: PLC0415

    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.UserProperty = [("trace", "bench")]
    return props


def latency_round(
    client: Any, count: int, rate: float, topics: int, *, parent: str, props: Any, closed: bool
) -> dict[str, int]:
    sent: dict[str, int] = {}
    interval, next_at = 1.0 / rate, time.perf_counter()
    for n in range(count):
        key = f"l{n}"
        sent[key] = time.perf_counter_ns()
        payload = f"{key}:".encode() + b"x" * PAD_BYTES
        info = client.publish(f"{parent}/lat/{n % topics}", payload, qos=1, properties=props)
        if closed:
            info.wait_for_publish(60)
        next_at += interval
        time.sleep(max(0.0, next_at - time.perf_counter()))
    return sent


def burst_round(client: Any, count: int, qos: int, tag: str, *, parent: str, props: Any) -> int:
    """Publish ``count`` messages back to back; returns when the first was handed to paho (ns)."""
    first = time.perf_counter_ns()
    infos = [
        client.publish(f"{parent}/burst/{n % 8}", f"{tag}{n}:".encode() + b"x" * 64, qos=qos, properties=props)
        for n in range(count)
    ]
    for info in infos:
        info.wait_for_publish(120)
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=2000, help="latency messages")
    parser.add_argument("--rate", type=float, default=200.0, help="latency messages per second")
    parser.add_argument("--topics", type=int, default=16, help="lite topics of the latency round")
    parser.add_argument("--burst", type=int, default=5000, help="messages of each rate round")
    parser.add_argument("--quick", action="store_true", help="a few hundred messages: a smoke run")
    parser.add_argument("--repeat", type=int, default=1, help="alternate 3.1.1 and 5.0 this many times")
    parser.add_argument("--open-loop", action="store_true", help="latency round: publish without awaiting PUBACKs")
    parser.add_argument("--persistent", action="store_true", help="the subscriber's session is persistent")
    args = parser.parse_args()
    if args.quick:
        args.count, args.burst = 200, 500
    with tempfile.TemporaryDirectory() as tmp, start_broker(Path(tmp) / "data", extra_args=["--mqtt-port", "0"]) as b:
        with AdminClient(b.admin_endpoint, timeout_s=10, **b.admin_keys) as admin:
            for parent, _ in PROTOCOLS.values():
                admin.put_parent_topic(model.ParentTopic(parent, model.MessageType.LITE))
        p99s: dict[str, list[tuple[float, float]]] = {p: [] for p in PROTOCOLS}
        grpc: list[float] = []
        for n in range(args.repeat):
            grpc.append(grpc_round(b.endpoint, args))
            for protocol in PROTOCOLS if n % 2 == 0 else reversed(PROTOCOLS):
                p99s[protocol].append(run_protocol(b.mqtt_port, protocol, args))
    compare(p99s, grpc)


def grpc_round(endpoint: str, args: argparse.Namespace) -> float:
    """The gRPC send -> LitePushConsumer p99 (ms) of one latency round like the MQTT one."""
    latencies, _ = grpc_measure(endpoint, args.count, args.rate, args.topics, separate=True, size=GRPC_BODY_BYTES)
    if len(latencies) < args.count:
        raise SystemExit(f"only {len(latencies)} of {args.count} gRPC messages arrived")
    ms = [x * 1000 for x in latencies]
    extra = f" (official Python client, LitePushConsumer, {args.count} messages of {GRPC_BODY_BYTES} B)"
    figure("gRPC send->push latency p50", statistics.median(ms), "ms", extra)
    figure("gRPC send->push latency p99", percentile(ms, 99), "ms", extra)
    return percentile(ms, 99)


def compare(mqtt: dict[str, list[tuple[float, float]]], grpc: list[float]) -> None:
    """Each protocol's p50/p99 beside the gRPC p99 of the same run (medians over ``--repeat``) and the goal."""
    grpc_p99 = statistics.median(grpc)
    for protocol, runs in mqtt.items():
        p50 = statistics.median(r[0] for r in runs)
        p99 = statistics.median(r[1] for r in runs)
        ratio = p99 / grpc_p99
        verdict = "MET" if ratio <= GOAL_RATIO else "MISSED"
        print(
            f"MQTT {protocol} QoS 1 p50 {p50:.2f} ms, p99 {p99:.2f} ms | gRPC send->push p99 {grpc_p99:.2f} ms | "
            f"ratio {ratio:.2f} (goal <= {GOAL_RATIO}) {verdict}",
            flush=True,
        )
        figure(f"{PROTOCOLS[protocol][1]} p99 / gRPC p99", ratio, "x", f" (goal <= {GOAL_RATIO}: {verdict})")


def run_protocol(port: int, protocol: str, args: argparse.Namespace) -> tuple[float, float]:
    """Runs the three rounds of ``protocol``; returns its latency round's (p50, p99), ms."""
    parent, prefix = PROTOCOLS[protocol]
    props = _properties(protocol)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    theirs, ours = ctx.Pipe(duplex=False)
    rounds = [args.count, args.burst, args.burst, args.burst]
    sub = ctx.Process(
        target=_subscribe,
        args=(port, protocol, rounds, ready, ours),
        kwargs={"persistent": args.persistent},
        daemon=True,
    )
    sub.start()
    try:
        if not ready.wait(60):
            raise SystemExit("the subscriber did not get ready")
        client = _publisher(port, protocol)
        sent = latency_round(
            client, args.count, args.rate, args.topics, parent=parent, props=props, closed=not args.open_loop
        )
        arrived: dict[str, int] = theirs.recv() if theirs.poll(180) else {}
        latencies = [(arrived[k] - sent[k]) / 1e6 for k in sent if k in arrived]
        if len(latencies) < len(sent):
            raise SystemExit(f"only {len(latencies)} of {len(sent)} latency messages arrived ({protocol})")
        loop = "open loop" if args.open_loop else "each awaiting its PUBACK"
        extra = f" ({len(latencies)} messages at {args.rate:.0f}/s over {args.topics} lite topics, QoS 1, {loop})"
        figure(f"{prefix} publish->subscribe latency p50", statistics.median(latencies), "ms", extra)
        figure(f"{prefix} publish->subscribe latency p99", percentile(latencies, 99), "ms", extra)
        result = statistics.median(latencies), percentile(latencies, 99)
        rates: dict[int, float] = {}
        for qos, tag in ((1, "q"), (0, "z"), (2, "t")):
            first = burst_round(client, args.burst, qos, tag, parent=parent, props=props)
            got: dict[str, int] = theirs.recv() if theirs.poll(180) else {}
            if len(got) < args.burst:
                raise SystemExit(f"only {len(got)} of {args.burst} QoS {qos} messages arrived ({protocol})")
            rates[qos] = args.burst / ((max(got.values()) - first) / 1e9)
            figure(f"{prefix} publish->subscribe rate QoS {qos}", rates[qos], "msg/s",
                   f" ({args.burst} messages, one publisher, one subscriber, sync flush)")  # fmt: skip
        figure(f"{prefix} rate QoS 2 / QoS 1", rates[2] / rates[1], "x", " (same run, same connections)")
        client.disconnect()
        client.loop_stop()
    finally:
        sub.join(30)
        if sub.is_alive():
            sub.kill()
    return result


if __name__ == "__main__":
    main()
