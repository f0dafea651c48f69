"""MQTT publish -> subscribe latency (p50/p99) and message rate, with paho-mqtt against a broker process.

A subscriber process (paho, one connection, QoS 1 subscription ``B/#``) records when each message arrives; the
publisher (paho, another connection, in this process) sends through the broker's default settings (sync
flush: every QoS 1 PUBACK waits for the fsync). Both processes read CLOCK_MONOTONIC.

- latency: ``--count`` messages at ``--rate`` per second, QoS 1, over ``--topics`` lite topics; latency =
  subscriber's on_message - the moment before ``publish``.
- rate: ``--burst`` messages as fast as paho sends them (up to 100 QoS 1 in flight), once at QoS 1 and once
  at QoS 0; rate = messages / (last arrival - first publish).

    python bench/bench_mqtt.py            # ~30 s
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

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.testing import start_broker

PARENT = "B"
INFLIGHT = 100


def figure(name: str, value: float, unit: str, extra: str = "") -> None:
    print(f"FIGURE {name}: {value:,.2f} {unit}{extra}", flush=True)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def _subscribe(port: int, expected: list[int], ready: Any, out: Connection) -> None:
    """The subscriber process: for each round (a count in ``expected``), send back the arrival times (ns)."""
    import paho.mqtt.client as mqtt  # noqa: PLC0415 - imported in the child
    from paho.mqtt.enums import CallbackAPIVersion  # noqa: PLC0415

    arrivals: dict[str, int] = {}
    changed = threading.Condition()

    def on_message(_c: Any, _u: Any, message: Any) -> None:
        now = time.perf_counter_ns()
        with changed:
            arrivals.setdefault(message.payload.decode().split(":", 1)[0], now)
            changed.notify_all()

    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench-sub")
    client.on_message = on_message
    client.connect("127.0.0.1", port)
    client.loop_start()
    client.subscribe(f"{PARENT}/#", qos=1)
    time.sleep(1.0)
    ready.set()
    for count in expected:
        with changed:
            changed.wait_for(lambda n=count: len(arrivals) >= n, 120)  # type: ignore[misc]
            out.send(dict(arrivals))
            arrivals.clear()
    client.disconnect()
    client.loop_stop()


def _publisher(port: int) -> Any:
    import paho.mqtt.client as mqtt  # noqa: PLC0415
    from paho.mqtt.enums import CallbackAPIVersion  # noqa: PLC0415

    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench-pub")
    client.max_inflight_messages_set(INFLIGHT)
    client.max_queued_messages_set(0)
    client.connect("127.0.0.1", port)
    client.loop_start()
    return client


def latency_round(client: Any, count: int, rate: float, topics: int) -> dict[str, int]:
    sent: dict[str, int] = {}
    interval, next_at = 1.0 / rate, time.perf_counter()
    for n in range(count):
        key = f"l{n}"
        sent[key] = time.perf_counter_ns()
        client.publish(f"{PARENT}/lat/{n % topics}", f"{key}:".encode() + b"x" * 64, qos=1)
        next_at += interval
        time.sleep(max(0.0, next_at - time.perf_counter()))
    return sent


def burst_round(client: Any, count: int, qos: int, tag: str) -> int:
    """Publish ``count`` messages back to back; returns when the first was handed to paho (ns)."""
    first = time.perf_counter_ns()
    infos = [
        client.publish(f"{PARENT}/burst/{n % 8}", f"{tag}{n}:".encode() + b"x" * 64, qos=qos) for n in range(count)
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
    args = parser.parse_args()
    if args.quick:
        args.count, args.burst = 200, 500
    with tempfile.TemporaryDirectory() as tmp, start_broker(Path(tmp) / "data", extra_args=["--mqtt-port", "0"]) as b:
        with AdminClient(b.admin_endpoint, timeout_s=10, **b.admin_keys) as admin:
            admin.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        theirs, ours = ctx.Pipe(duplex=False)
        rounds = [args.count, args.burst, args.burst]
        sub = ctx.Process(target=_subscribe, args=(b.mqtt_port, rounds, ready, ours), daemon=True)
        sub.start()
        try:
            if not ready.wait(60):
                raise SystemExit("the subscriber did not get ready")
            client = _publisher(b.mqtt_port)
            sent = latency_round(client, args.count, args.rate, args.topics)
            arrived: dict[str, int] = theirs.recv() if theirs.poll(180) else {}
            latencies = [(arrived[k] - sent[k]) / 1e6 for k in sent if k in arrived]
            if len(latencies) < len(sent):
                raise SystemExit(f"only {len(latencies)} of {len(sent)} latency messages arrived")
            extra = f" ({len(latencies)} messages at {args.rate:.0f}/s over {args.topics} lite topics, QoS 1)"
            figure("MQTT publish->subscribe latency p50", statistics.median(latencies), "ms", extra)
            figure("MQTT publish->subscribe latency p99", percentile(latencies, 99), "ms", extra)
            for qos, tag in ((1, "q"), (0, "z")):
                first = burst_round(client, args.burst, qos, tag)
                got: dict[str, int] = theirs.recv() if theirs.poll(180) else {}
                if len(got) < args.burst:
                    raise SystemExit(f"only {len(got)} of {args.burst} QoS {qos} messages arrived")
                seconds = (max(got.values()) - first) / 1e9
                figure(f"MQTT publish->subscribe rate QoS {qos}", args.burst / seconds, "msg/s",
                       f" ({args.burst} messages, one publisher, one subscriber, sync flush)")  # fmt: skip
            client.disconnect()
            client.loop_stop()
        finally:
            sub.join(30)
            if sub.is_alive():
                sub.kill()


if __name__ == "__main__":
    main()
