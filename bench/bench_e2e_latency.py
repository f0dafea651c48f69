"""Send -> LitePushConsumer latency at light load with the official client (goal p99 <= 10 ms).

A rocketmq-python-client 5.1.2 Producer sends LITE messages at ``--rate`` per second over ``--topics`` lite
topics to a broker process (default settings: sync flush); one LitePushConsumer subscribed to them records
when its listener sees each message. Latency = listener call - the moment just before ``producer.send``
(so the send's own round trip, fsync included, is part of it). The producer and the consumer run as two
processes, as an agent and its caller would (the FIGURE lines); ``--layout`` also measures them sharing one
Python process, where the client's own threads (the consumer's receive loop, both clients' gRPC and
telemetry) compete for one GIL. Both processes read the same monotonic clock (CLOCK_MONOTONIC).

    python bench/bench_e2e_latency.py                  # ~30 s: separate processes
    python bench/bench_e2e_latency.py --layout both    # ~60 s: separate, then shared
    python bench/bench_e2e_latency.py --quick          # smoke run
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

from lmq_broker.testing import start_broker


def figure(name: str, value: float, unit: str, *, op: str, target: float, extra: str = "") -> None:
    ok = value >= target if op == ">=" else value <= target
    verdict = "PASS" if ok else "BELOW TARGET"
    print(f"FIGURE {name}: {value:,.2f} {unit} (target {op} {target:,.0f} {unit}) {verdict}{extra}", flush=True)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def _consume(endpoint: str, topics: int, count: int, ready: Any, out: Connection) -> None:
    """The consumer process: subscribe, say ready, then send back the latency of each message (its body
    carries ``key:perf_counter_ns`` of the moment before the producer sent it) once all ``count`` arrived."""
    from rocketmq import (  # noqa: PLC0415 - the official client stays out of import-time for tooling
        ClientConfiguration,
        ConsumeResult,
        Credentials,
        LitePushConsumer,
        MessageListener,
    )

    latencies: dict[str, float] = {}
    done = threading.Event()
    lock = threading.Lock()

    class Clock(MessageListener):  # type: ignore[misc]
        def consume(self, message: Any) -> Any:
            now = time.perf_counter_ns()
            key, _, rest = message.body.decode().partition(":")
            sent = rest.partition(":")[0]  # bodies may be padded after a second ':' (``size``)
            with lock:
                if sent and key not in latencies:
                    latencies[key] = (now - int(sent)) / 1e9
                if len(latencies) >= count:
                    done.set()
            return ConsumeResult.SUCCESS

    consumer = LitePushConsumer(
        ClientConfiguration(endpoint, Credentials()), "executor-group", "AGENT_TASK_NS", Clock()
    )
    consumer.startup()
    try:
        for t in range(topics):
            consumer.subscribe_lite(f"lat-{t}")
        time.sleep(2.0)  # the push consumer starts its receive loop about 1 s after startup
        ready.set()
        done.wait(60)
    finally:
        consumer.shutdown()
    out.send(list(latencies.values()))


def _produce(endpoint: str, count: int, rate: float, topics: int, before_sends: Any, *, size: int = 0) -> list[float]:
    """Send ``count`` messages at ``rate``; ``before_sends`` runs after the warm-up send. Round trips, s.
    Bodies are padded to ``size`` bytes (0: not padded)."""
    from rocketmq import ClientConfiguration, Credentials, Message, Producer  # noqa: PLC0415

    producer = Producer(ClientConfiguration(endpoint, Credentials()), ("AGENT_TASK_NS",))
    producer.startup()
    round_trips: list[float] = []
    try:
        warm = Message()
        warm.topic, warm.lite_topic, warm.body = "AGENT_TASK_NS", "lat-0", b"warm"
        producer.send(warm)
        before_sends()
        interval = 1.0 / rate
        next_at = time.perf_counter()
        for n in range(count):
            m = Message()
            m.topic, m.lite_topic = "AGENT_TASK_NS", f"lat-{n % topics}"
            started = time.perf_counter_ns()
            body = f"m{n}:{started}:".encode()
            m.body = body + b"x" * max(0, size - len(body))
            producer.send(m)
            round_trips.append((time.perf_counter_ns() - started) / 1e9)
            next_at += interval
            time.sleep(max(0.0, next_at - time.perf_counter()))  # pacing: light, steady load
    finally:
        producer.shutdown()
    return round_trips


def measure(
    endpoint: str, count: int, rate: float, topics: int, *, separate: bool, size: int = 0
) -> tuple[list[float], list[float]]:
    """(send -> listener latencies, producer.send round trips), in seconds; bodies of ``size`` bytes."""
    if separate:
        ctx = mp.get_context("spawn")  # gRPC's threads do not survive a fork
        ready = ctx.Event()
        theirs, ours = ctx.Pipe(duplex=False)
        consumer = ctx.Process(target=_consume, args=(endpoint, topics, count, ready, ours), daemon=True)
        consumer.start()
        try:
            if not ready.wait(60):
                raise SystemExit("the consumer process did not get ready")
            round_trips = _produce(endpoint, count, rate, topics, lambda: None, size=size)
            latencies: list[float] = theirs.recv() if theirs.poll(90) else []
        finally:
            consumer.join(30)
            if consumer.is_alive():
                consumer.kill()
        return latencies, round_trips
    local_ready = threading.Event()
    reader, writer = mp.Pipe(duplex=False)
    thread = threading.Thread(target=_consume, args=(endpoint, topics, count, local_ready, writer), daemon=True)
    thread.start()
    if not local_ready.wait(60):
        raise SystemExit("the consumer did not get ready")
    round_trips = _produce(endpoint, count, rate, topics, lambda: None, size=size)
    latencies = reader.recv() if reader.poll(90) else []
    thread.join(30)
    return latencies, round_trips


def report(label: str, latencies: list[float], round_trips: list[float], count: int) -> None:
    if len(latencies) < count:
        raise SystemExit(f"{label}: only {len(latencies)} of {count} messages arrived")
    ms = [x * 1000 for x in latencies]
    rtt = [x * 1000 for x in round_trips]
    print(
        f"{label}: latency p50 {statistics.median(ms):.2f} ms, p90 {percentile(ms, 90):.2f} ms, "
        f"p99 {percentile(ms, 99):.2f} ms, max {max(ms):.2f} ms; of which producer.send's round trip "
        f"(fsync included): p50 {statistics.median(rtt):.2f} ms, p99 {percentile(rtt, 99):.2f} ms",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=50.0, help="messages per second")
    parser.add_argument("--topics", type=int, default=10, help="lite topics")
    parser.add_argument("--flush-mode", default="sync", choices=["sync", "async"], help="the broker's flush mode")
    parser.add_argument(
        "--layout", default="separate", choices=["separate", "shared", "both"],
        help="producer and consumer in separate processes (the figures), in one, or both",
    )  # fmt: skip
    args = parser.parse_args()
    count = 60 if args.quick else args.count
    flags = ["--flush-mode", args.flush_mode]
    print(
        f"send -> LitePushConsumer, {count} messages at {args.rate:.0f}/s over {args.topics} lite topics, "
        f"{args.flush_mode} flush"
    )
    figures: list[float] = []
    for layout in ("separate", "shared"):
        if args.layout not in (layout, "both"):
            continue
        with tempfile.TemporaryDirectory() as tmp, start_broker(Path(tmp) / "data", extra_args=flags) as broker:
            latencies, round_trips = measure(
                broker.endpoint, count, args.rate, args.topics, separate=layout == "separate"
            )
        label = "producer and consumer in two processes" if layout == "separate" else "both in one process"
        report(label, latencies, round_trips, count)
        if not figures:
            figures = [x * 1000 for x in latencies]
            where = f" ({label})"
    figure("send->consume latency p50", statistics.median(figures), "ms", op="<=", target=10, extra=where)
    figure("send->consume latency p99", percentile(figures, 99), "ms", op="<=", target=10, extra=where)


if __name__ == "__main__":
    main()
