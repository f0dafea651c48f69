"""Soak: the broker's RSS under a steady LITE load with the official client (goal: flat after warm-up,
<= 1 MiB/min).

A rocketmq-python-client 5.1.2 Producer sends LITE messages of the bootstrap parent ``AGENT_TASK_NS`` at
``--rate`` per second for ``--minutes`` to a broker process (sync flush, its own temporary data dir), spread
over ``--topics`` live lite topics. As agent sessions do, the set turns over: every ``--new-topic-every``
seconds a new lite topic is subscribed and joins the set, and the oldest leaves it; a topic that left is
unsubscribed ``--retire-after-s`` later or, if not everything sent to it has been consumed by then, once it
has. A LitePushConsumer of
``executor-group`` (its own process, so the two clients do not share a GIL) consumes and acks, so messages
flow through the recent-message cache, leases and offsets. The broker's VmRSS (/proc/<pid>/status) is
sampled every few seconds; a least-squares line is fitted to the samples after ``--warmup-minutes`` (and,
separately, to the last half of them: a slope that is levelling off shows there). Then the consumer drains
(for as long as messages keep arriving) and every message sent is checked to have arrived: the exit code is
1 if any did not. A lite topic is consumed in order, one message out at a time, so a consumer that falls
behind (the clients share the machine with the broker) falls behind per topic; the consumer's lag and each
process's CPU are printed to tell that apart from the broker.

    python bench/bench_soak_rss.py                                        # 30 min at 300 msg/s
    python bench/bench_soak_rss.py --minutes 0.2 --warmup-minutes 0.05    # smoke run
    python bench/bench_soak_rss.py --csv /tmp/soak.csv                    # samples to a CSV as well
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing as mp
import os
import statistics
import tempfile
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Final

import psutil

from lmq_broker.testing import start_broker

TOPIC: Final = "AGENT_TASK_NS"
GROUP: Final = "executor-group"
GOAL_MIB_PER_MIN: Final = 1.0
MAX_IN_FLIGHT: Final = 256  # sends awaiting their receipt
MAX_LAG_S: Final = 1.0  # the pacer forgets a backlog older than this: the achieved rate shows what was held
MIB: Final = 2**20


@dataclass(frozen=True, slots=True)
class Sample:
    t_s: float  # since the first send
    rss: int  # bytes: VmRSS, and its anonymous and file-backed parts
    anon: int
    file: int
    sent: int
    received: int


@dataclass(frozen=True, slots=True)
class Outcome:
    samples: list[Sample]
    sender: Sender
    seen: bytes  # the consumer's bitmap of keys that arrived
    redelivered: int
    sending_s: float
    drain_s: float
    cpu_s: dict[str, float]  # process -> CPU seconds while sending
    refusals: list[str]  # new lite topics the consumer could not subscribe (why)
    consumer_lived: bool  # False: the consumer process died before its drain report


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def read_rss(pid: int) -> tuple[int, int, int]:
    """(VmRSS, RssAnon, RssFile) of ``pid`` in bytes."""
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile"):
                fields[name] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields.get("RssAnon", 0), fields.get("RssFile", 0)


def slope_mib_per_min(samples: list[Sample]) -> float:
    if len(samples) < 2:
        return float("nan")
    fit = statistics.linear_regression([s.t_s / 60 for s in samples], [s.rss / MIB for s in samples])
    return fit.slope


def topic_name(n: int) -> str:
    return f"session-{n}"


def _consume(endpoint: str, shape: tuple[int, int], commands: Connection, ready: Any, received: Any) -> None:
    """The consumer process (``shape``: initial lite topics, consumption threads): subscribe, then obey
    ``commands`` until told to drain.

    Commands: ("sub", topic) -> ("subbed", topic) or ("refused", topic, why); ("unsub", topic, expected) ->
    unsubscribed once ``expected`` messages of the topic arrived; ("drain", sent, idle_s) -> ("result", bitmap
    of keys seen, redeliveries) once ``sent`` distinct messages arrived or none arrived for ``idle_s``.
    """
    from rocketmq import (  # noqa: PLC0415 - the official client stays out of import-time for tooling
        ClientConfiguration,
        ConsumeResult,
        Credentials,
        LitePushConsumer,
        MessageListener,
    )

    seen = bytearray(1 << 16)
    per_topic: dict[str, int] = {}
    redelivered = 0
    lock = threading.Lock()

    class Tally(MessageListener):  # type: ignore[misc]
        def consume(self, message: Any) -> Any:
            nonlocal seen, redelivered
            key = int(bytes(message.body).partition(b":")[0])
            with lock:
                if key >= len(seen):
                    seen += bytearray(max(key + 1, 2 * len(seen)) - len(seen))
                if seen[key]:
                    redelivered += 1
                else:
                    seen[key] = 1
                    per_topic[message.lite_topic] = per_topic.get(message.lite_topic, 0) + 1
                    received.value += 1
            return ConsumeResult.SUCCESS

    initial, threads = shape
    config = ClientConfiguration(endpoint, Credentials(), request_timeout=10)
    consumer = LitePushConsumer(config, GROUP, TOPIC, Tally(), consumption_thread_count=threads)
    consumer.startup()
    try:
        for n in range(initial):
            consumer.subscribe_lite(topic_name(n))
        time.sleep(2.0)  # the push consumer starts its receive loop about 1 s after startup
        ready.set()
        retiring: dict[str, int] = {}  # topic -> messages expected
        while True:
            with lock:
                done = [lite for lite, expected in retiring.items() if per_topic.get(lite, 0) >= expected]
            for lite in done:
                consumer.unsubscribe_lite(lite)
                del retiring[lite]
            if not commands.poll(0.5):
                continue
            command = commands.recv()
            if command[0] == "sub":
                try:
                    consumer.subscribe_lite(command[1])
                except Exception as exc:  # e.g. the client's subscription quota, while retired topics drain
                    commands.send(("refused", command[1], str(exc)))
                else:
                    commands.send(("subbed", command[1]))
            elif command[0] == "unsub":
                retiring[command[1]] = command[2]
            elif command[0] == "drain":
                last, last_at = received.value, time.monotonic()
                while received.value < command[1] and time.monotonic() - last_at < command[2]:
                    time.sleep(0.2)
                    if received.value != last:
                        last, last_at = received.value, time.monotonic()
                with lock:
                    commands.send(("result", bytes(seen), redelivered))
                return
    finally:
        consumer.shutdown()


class Sender:
    """send_async at a paced rate with a bound on sends in flight; records which keys were acknowledged."""

    def __init__(self, producer: Any) -> None:
        self.producer = producer
        self.ok = bytearray(1 << 16)
        self.sent = 0
        self.failed = 0
        self.next_key = 0
        self.topic_of: list[str] = []  # key -> its lite topic
        self.pending: dict[str, int] = {}  # topic -> sends in flight
        self.sent_to: dict[str, int] = {}  # topic -> sends acknowledged
        self._slots = threading.BoundedSemaphore(MAX_IN_FLIGHT)
        self._lock = threading.Lock()

    def send(self, lite: str, body_bytes: int) -> None:
        from rocketmq import Message  # noqa: PLC0415

        key = self.next_key
        self.next_key += 1
        if key >= len(self.ok):
            with self._lock:
                self.ok += bytearray(len(self.ok))
        self.topic_of.append(lite)
        message = Message()
        message.topic, message.lite_topic = TOPIC, lite
        message.body = f"{key}:".encode().ljust(body_bytes, b"x")
        self._slots.acquire()
        with self._lock:
            self.pending[lite] = self.pending.get(lite, 0) + 1
        try:
            future = self.producer.send_async(message)
        except Exception:
            self._done(lite, key, False)
            raise
        future.add_done_callback(lambda f: self._done(lite, key, f.exception() is None))

    def _done(self, lite: str, key: int, ok: bool) -> None:
        with self._lock:
            self.pending[lite] -= 1
            if ok:
                self.ok[key] = 1
                self.sent += 1
                self.sent_to[lite] = self.sent_to.get(lite, 0) + 1
            else:
                self.failed += 1
        self._slots.release()

    def settled(self, lite: str) -> int | None:
        """Messages acknowledged for ``lite`` if none is still in flight."""
        with self._lock:
            return None if self.pending.get(lite, 0) else self.sent_to.get(lite, 0)

    def wait_all(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(self.pending.values()) and time.monotonic() < deadline:
            time.sleep(0.1)


def run(args: argparse.Namespace, endpoint: str, pid: int) -> Outcome:  # noqa: PLR0915 (a benchmark's main reads top to bottom: setup, rounds, report)
    """Drive the load, drain, and say what arrived."""
    from rocketmq import ClientConfiguration, Credentials, Producer  # noqa: PLC0415

    ctx = mp.get_context("spawn")  # gRPC's threads do not survive a fork
    ready, received = ctx.Event(), ctx.Value("q", 0)
    ours, theirs = ctx.Pipe()
    consumer = ctx.Process(
        target=_consume, args=(endpoint, (args.topics, args.consumer_threads), theirs, ready, received), daemon=True
    )
    consumer.start()
    producer = Producer(ClientConfiguration(endpoint, Credentials(), request_timeout=10), (TOPIC,))
    producer.startup()
    try:
        if not ready.wait(300):
            raise SystemExit("the consumer process did not get ready")
        sender = Sender(producer)
        live = [topic_name(n) for n in range(args.topics)]
        next_topic = args.topics
        retired: deque[tuple[str, float]] = deque()  # left the live set, to unsubscribe after the grace period
        samples: list[Sample] = []
        refusals: list[str] = []
        run_s, every_s = args.minutes * 60, args.sample_s or min(5.0, args.minutes * 60 / 60)
        processes = {
            "broker": psutil.Process(pid),
            "producer": psutil.Process(),
            "consumer": psutil.Process(consumer.pid),
        }
        cpu_before = {name: cpu_seconds(p) for name, p in processes.items()}
        started = time.monotonic()
        interval = 1.0 / args.rate
        next_send = next_sample = next_churn = next_print = started
        n = 0
        while (now := time.monotonic()) < started + run_s:
            if now >= next_sample:
                samples.append(Sample(now - started, *read_rss(pid), sender.sent, received.value))
                next_sample += every_s
            if now >= next_churn:
                ours.send(("sub", topic_name(next_topic)))
                next_topic += 1
                next_churn += args.new_topic_every
            while ours.poll():
                reply = ours.recv()
                if reply[0] == "refused":  # the set does not turn over this time
                    refusals.append(reply[2])
                    continue
                live.append(reply[1])
                retired.append((live.pop(0), now + args.retire_after_s))
            while retired and retired[0][1] <= now and (expected := sender.settled(retired[0][0])) is not None:
                ours.send(("unsub", retired.popleft()[0], expected))
            if now >= next_print + 60:
                next_print += 60
                s = samples[-1]
                print(
                    f"  {s.t_s / 60:5.1f} min: sent {s.sent:,}, received {s.received:,} (lag {s.sent - s.received:,}), "
                    f"broker RSS {s.rss / MIB:,.1f} MiB (anon {s.anon / MIB:,.1f}, file {s.file / MIB:,.1f})",
                    flush=True,
                )
            sender.send(live[n % len(live)], args.body_bytes)
            n += 1
            next_send = max(next_send + interval, now - MAX_LAG_S)
            time.sleep(max(0.0, min(next_send, next_sample) - time.monotonic()))
        sending_s = time.monotonic() - started
        samples.append(Sample(sending_s, *read_rss(pid), sender.sent, received.value))
        cpu_s = {name: cpu_seconds(p) - cpu_before[name] for name, p in processes.items()}
        sender.wait_all(60)
        drain_started = time.monotonic()
        ours.send(("drain", sender.sent, args.drain_s))
        seen, redelivered = b"", 0
        while consumer.is_alive() or ours.poll():
            if not ours.poll(1.0):
                continue
            reply = ours.recv()
            if reply[0] == "refused":
                refusals.append(reply[2])
            elif reply[0] == "result":
                seen, redelivered = reply[1], reply[2]
                break
        drain_s = time.monotonic() - drain_started
        return Outcome(samples, sender, seen, redelivered, sending_s, drain_s, cpu_s, refusals, consumer.is_alive())
    finally:
        producer.shutdown()
        consumer.join(60)
        if consumer.is_alive():
            consumer.kill()


def write_csv(path: str, samples: list[Sample]) -> None:
    with open(path, "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["t_s", "rss_mib", "rss_anon_mib", "rss_file_mib", "sent", "received"])
        for s in samples:
            writer.writerow(
                [f"{s.t_s:.1f}", f"{s.rss / MIB:.2f}", f"{s.anon / MIB:.2f}", f"{s.file / MIB:.2f}", s.sent, s.received]
            )


def report(args: argparse.Namespace, outcome: Outcome) -> None:
    samples, sending_s = outcome.samples, outcome.sending_s
    warm_s = args.warmup_minutes * 60
    after = [s for s in samples if s.t_s >= warm_s]
    half = [s for s in after if s.t_s >= (warm_s + sending_s) / 2]
    peak = max(samples, key=lambda s: s.rss)
    first, at_warm, last = samples[0], after[0], samples[-1]
    print(
        f"broker RSS: {first.rss / MIB:,.1f} MiB at the start, {at_warm.rss / MIB:,.1f} MiB at the end of warm-up "
        f"({at_warm.t_s / 60:.1f} min), {last.rss / MIB:,.1f} MiB at the end ({last.t_s / 60:.1f} min), "
        f"peak {peak.rss / MIB:,.1f} MiB ({peak.t_s / 60:.1f} min); anonymous {at_warm.anon / MIB:,.1f} -> "
        f"{last.anon / MIB:,.1f} MiB, file-backed {at_warm.file / MIB:,.1f} -> {last.file / MIB:,.1f} MiB; "
        f"{len(samples)} samples",
        flush=True,
    )
    cpu = ", ".join(f"{name} {100 * s / sending_s:.0f}%" for name, s in outcome.cpu_s.items())
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"CPU while sending, of one core: {cpu}; load average at the end {load}", flush=True)
    whole, late = slope_mib_per_min(after), slope_mib_per_min(half)
    verdict = "met" if whole <= GOAL_MIB_PER_MIN else "not met"
    print(
        f"FIGURE RSS slope after warm-up: {whole:+.3f} MiB/min over {(sending_s - warm_s) / 60:.1f} min "
        f"(goal <= {GOAL_MIB_PER_MIN:g} MiB/min) {verdict}",
        flush=True,
    )
    print(f"FIGURE RSS slope over the last half: {late:+.3f} MiB/min over {(sending_s - half[0].t_s) / 60:.1f} min")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="sending time, warm-up included")
    parser.add_argument("--warmup-minutes", type=float, default=5.0, help="samples before this are not fitted")
    parser.add_argument("--rate", type=float, default=300.0, help="messages per second")
    parser.add_argument("--topics", type=int, default=1000, help="live lite topics at any time")
    parser.add_argument("--new-topic-every", type=float, default=1.0, help="seconds between new lite topics")
    parser.add_argument("--retire-after-s", type=float, default=30.0, help="unsubscribe a topic this long after")
    parser.add_argument("--body-bytes", type=int, default=512)
    parser.add_argument(
        "--consumer-threads", type=int, default=20,
        help="the push consumer's consumption threads (the client's default); each acks synchronously",
    )  # fmt: skip
    parser.add_argument("--sample-s", type=float, default=0.0, help="RSS sampling period (0: 5 s, less if short)")
    parser.add_argument("--drain-s", type=float, default=60.0, help="end the drain after this long without arrivals")
    parser.add_argument("--flush-mode", default="sync", choices=["sync", "async"], help="the broker's flush mode")
    parser.add_argument("--csv", help="write the RSS samples to this CSV file")
    args = parser.parse_args()
    if not 0 <= args.warmup_minutes < args.minutes:
        parser.error("--warmup-minutes must be less than --minutes")
    print(
        f"soak: {args.rate:.0f} msg/s of {args.body_bytes} B for {args.minutes:g} min (warm-up {args.warmup_minutes:g}"
        f" min) over {args.topics:,} live lite topics of {TOPIC}, a new one every {args.new_topic_every:g} s; "
        f"LitePushConsumer {GROUP}; {args.flush_mode} flush",
        flush=True,
    )
    flags = ["--flush-mode", args.flush_mode]
    with tempfile.TemporaryDirectory() as tmp, start_broker(Path(tmp) / "data", extra_args=flags) as broker:
        outcome = run(args, broker.endpoint, broker.pid)
    if args.csv:
        write_csv(args.csv, outcome.samples)
    sender, seen = outcome.sender, outcome.seen
    lags = [s.sent - s.received for s in outcome.samples]
    arrived = sum(1 for key, ok in enumerate(sender.ok) if ok and key < len(seen) and seen[key])
    strays = sum(1 for key, got in enumerate(seen) if got and (key >= len(sender.ok) or not sender.ok[key]))
    print(
        f"messages: sent {sender.sent:,} ({sender.failed:,} sends failed), received {arrived:,} of them "
        f"({outcome.redelivered:,} redeliveries, {strays:,} of the failed sends arrived too); achieved "
        f"{sender.sent / outcome.sending_s:,.1f} msg/s of {args.rate:g} over {outcome.sending_s / 60:.1f} min; "
        f"consumer lag {lags[-1]:,} at the end of sending (max {max(lags):,}), drained in {outcome.drain_s:.0f} s",
        flush=True,
    )
    if outcome.refusals:
        print(f"new lite topics the consumer could not subscribe: {len(outcome.refusals):,} ({outcome.refusals[0]})")
    report(args, outcome)
    if not outcome.seen:
        raise SystemExit("the consumer process died before its drain report")
    if arrived < sender.sent:
        lost = Counter(sender.topic_of[k] for k, ok in enumerate(sender.ok) if ok and not (k < len(seen) and seen[k]))
        examples = ", ".join(f"{topic} ({n})" for topic, n in lost.most_common(5))
        raise SystemExit(
            f"LOST: {sender.sent - arrived:,} of {sender.sent:,} messages sent did not arrive, in {len(lost):,} "
            f"lite topics (e.g. {examples})"
        )


if __name__ == "__main__":
    main()
