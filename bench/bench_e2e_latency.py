"""Send -> LitePushConsumer latency at light load with the official client (goal p99 <= 10 ms).

A rocketmq-python-client 5.1.2 Producer sends LITE messages at ``--rate`` per second over ``--topics`` lite
topics to a broker process (default settings: sync flush); one LitePushConsumer subscribed to them records
when its listener sees each message. Latency = listener call - the moment just before ``producer.send``
(so the send's own round trip, fsync included, is part of it). Prints ``FIGURE`` lines.

    python bench/bench_e2e_latency.py           # ~30 s
    python bench/bench_e2e_latency.py --quick   # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
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


def measure(endpoint: str, count: int, rate: float, topics: int) -> tuple[list[float], list[float]]:
    """(send -> listener latencies, producer.send round trips), in seconds."""
    from rocketmq import (  # noqa: PLC0415 - the official client stays out of import-time for tooling
        ClientConfiguration,
        ConsumeResult,
        Credentials,
        LitePushConsumer,
        Message,
        MessageListener,
        Producer,
    )

    sent_at: dict[str, float] = {}
    latencies: dict[str, float] = {}
    round_trips: list[float] = []
    done = threading.Event()
    lock = threading.Lock()

    class Clock(MessageListener):  # type: ignore[misc]
        def consume(self, message: Any) -> Any:
            now = time.perf_counter()
            key = message.body.decode()
            with lock:
                if key in sent_at and key not in latencies:
                    latencies[key] = now - sent_at[key]
                if len(latencies) >= count:
                    done.set()
            return ConsumeResult.SUCCESS

    config = ClientConfiguration(endpoint, Credentials())
    consumer = LitePushConsumer(config, "executor-group", "AGENT_TASK_NS", Clock())
    consumer.startup()
    producer = Producer(config, ("AGENT_TASK_NS",))
    producer.startup()
    try:
        for t in range(topics):
            consumer.subscribe_lite(f"lat-{t}")
        warm = Message()
        warm.topic, warm.lite_topic, warm.body = "AGENT_TASK_NS", "lat-0", b"warm"
        producer.send(warm)
        time.sleep(2.0)  # the push consumer starts its receive loop about 1 s after startup
        interval = 1.0 / rate
        next_at = time.perf_counter()
        for n in range(count):
            m = Message()
            key = f"m{n}"
            m.topic, m.lite_topic, m.body = "AGENT_TASK_NS", f"lat-{n % topics}", key.encode()
            with lock:
                sent_at[key] = time.perf_counter()
            producer.send(m)
            round_trips.append(time.perf_counter() - sent_at[key])
            next_at += interval
            time.sleep(max(0.0, next_at - time.perf_counter()))  # pacing: light, steady load
        done.wait(30)
    finally:
        producer.shutdown()
        consumer.shutdown()
    return list(latencies.values()), round_trips


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=50.0, help="messages per second")
    parser.add_argument("--topics", type=int, default=10, help="lite topics")
    parser.add_argument("--flush-mode", default="sync", choices=["sync", "async"], help="the broker's flush mode")
    args = parser.parse_args()
    count = 60 if args.quick else args.count
    flags = ["--flush-mode", args.flush_mode]
    with tempfile.TemporaryDirectory() as tmp, start_broker(Path(tmp) / "data", extra_args=flags) as broker:
        latencies, round_trips = measure(broker.endpoint, count, args.rate, args.topics)
    if len(latencies) < count:
        raise SystemExit(f"only {len(latencies)} of {count} messages arrived")
    ms = [x * 1000 for x in latencies]
    print(
        f"send -> LitePushConsumer, {count} messages at {args.rate:.0f}/s over {args.topics} lite topics, "
        f"{args.flush_mode} flush"
    )
    print(f"latency p50 {statistics.median(ms):.2f} ms, p90 {percentile(ms, 90):.2f} ms, max {max(ms):.2f} ms")
    rtt = [x * 1000 for x in round_trips]
    print(
        f"of which producer.send's round trip (fsync included): p50 {statistics.median(rtt):.2f} ms, "
        f"p99 {percentile(rtt, 99):.2f} ms; producer, consumer and listener share this one Python process"
    )
    figure("send->consume latency p50", statistics.median(ms), "ms", op="<=", target=10)
    figure("send->consume latency p99", percentile(ms, 99), "ms", op="<=", target=10)


if __name__ == "__main__":
    main()
