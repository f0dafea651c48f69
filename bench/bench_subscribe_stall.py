"""Do other clients' sends wait while one client subscribes 100,000 lite topics?

Definition printed with the result: a broker process (defaults, sync flush; quota raised to fit). Client A (its own
process and channel) sends SyncLiteSubscription COMPLETE_ADD of ``--topics`` lite topics, three calls in a row:
all new names, a wholly different set (every name added and every old one removed), and the same set again (the
30 s re-sync every official consumer makes). Client B (its own channel) sends one single-message SendMessage
every 10 ms throughout. We print B's send latency (max and p99) over the probes sent while one of A's calls was
in progress, the same over an idle stretch before, and each of A's call durations. Goal: max <= 50 ms during A's
calls (the broker does a big subscription change in slices that let other calls in between).

    python bench/bench_subscribe_stall.py           # 100,000 lite topics
    python bench/bench_subscribe_stall.py --quick   # 20,000 lite topics
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import grpc

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as sg
from lmq_broker.testing import start_broker

PARENT, GROUP = "STALL_PARENT", "stall-group"
SUBSCRIBER = (("x-mq-client-id", "big-subscriber"), ("x-mq-language", "JAVA"), ("x-mq-client-version", "5.0.8"))
PROBE = (("x-mq-client-id", "probe-producer"), ("x-mq-language", "JAVA"), ("x-mq-client-version", "5.0.8"))
PROBE_EVERY_S = 0.010
TARGET_MS = 50.0
CHANNEL_OPTIONS = (("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20))
ROUNDS = (("all new", "a"), ("replace every name", "b"), ("same set again", "b"))


def sync_request(names: list[str]) -> spb.SyncLiteSubscriptionRequest:
    return spb.SyncLiteSubscriptionRequest(
        action=pb.COMPLETE_ADD, topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP), lite_topic_set=names
    )


def big_subscriber(endpoint: str, topics: int, pipe: Connection) -> None:
    """Client A, in its own process: builds each request before it is told to go, then reports when the call
    began and ended (``time.monotonic`` is system-wide on Linux, so comparable with the parent's)."""
    requests = {prefix: sync_request([f"{prefix}-{i:07d}" for i in range(topics)]) for _, prefix in ROUNDS}
    with grpc.insecure_channel(endpoint, options=CHANNEL_OPTIONS) as channel:
        stub = sg.MessagingServiceStub(channel)
        for _, prefix in ROUNDS:
            pipe.recv()
            began = time.monotonic()
            reply = stub.SyncLiteSubscription(requests[prefix], metadata=SUBSCRIBER, timeout=300)
            pipe.send((began, time.monotonic(), reply.status.code, reply.status.message))


async def probe_loop(stub: sg.MessagingServiceAsyncStub, stop: asyncio.Event, out: list[tuple[float, float]]) -> None:
    """Client B: one send every 10 ms (a send still waiting does not hold the next one back)."""
    pending: set[asyncio.Task[None]] = set()
    n = 0

    async def one(i: int) -> None:
        props = pb.SystemProperties(message_id=f"probe-{i}", message_type=pb.LITE, lite_topic=f"probe-{i % 16}")
        message = pb.Message(topic=pb.Resource(name=PARENT), body=b"probe", system_properties=props)
        began = time.monotonic()
        reply = await stub.SendMessage(spb.SendMessageRequest(messages=[message]), metadata=PROBE, timeout=60)
        if reply.status.code != pb.OK:
            raise SystemExit(f"probe send failed: {reply.status}")
        out.append((began, time.monotonic() - began))

    while not stop.is_set():
        task = asyncio.create_task(one(n))
        pending.add(task)
        task.add_done_callback(pending.discard)
        n += 1
        await asyncio.sleep(PROBE_EVERY_S)
    await asyncio.gather(*pending)


def summary(latencies_s: list[float]) -> tuple[float, float]:
    ordered = sorted(latencies_s)
    if not ordered:
        raise SystemExit("no probe fell in the window")
    return ordered[-1] * 1000, ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000


async def run(endpoint: str, topics: int, idle_s: float) -> None:
    parent_end, child_end = multiprocessing.Pipe()
    child = multiprocessing.get_context("spawn").Process(
        target=big_subscriber, args=(endpoint, topics, child_end), daemon=True
    )
    child.start()
    probes: list[tuple[float, float]] = []
    windows: list[tuple[str, float, float]] = []
    stop = asyncio.Event()
    async with grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS) as channel:
        stub: sg.MessagingServiceAsyncStub = sg.MessagingServiceStub(channel)
        prober = asyncio.create_task(probe_loop(stub, stop, probes))
        await asyncio.sleep(0.5)  # the channel and the probe topics warm
        idle_from = time.monotonic()
        await asyncio.sleep(idle_s)
        windows.append(("idle", idle_from, time.monotonic()))
        for label, _ in ROUNDS:
            parent_end.send("go")
            began, ended, code, message = await asyncio.to_thread(parent_end.recv)
            if code != pb.OK:
                raise SystemExit(f"COMPLETE_ADD ({label}) failed: {code} {message}")
            windows.append((label, began, ended))
            await asyncio.sleep(0.3)
        stop.set()
        await prober
    child.join(10)
    report(topics, probes, windows)


def report(topics: int, probes: list[tuple[float, float]], windows: list[tuple[str, float, float]]) -> None:
    busy: list[float] = []
    for label, start, end in windows:
        inside = [lat for began, lat in probes if start <= began <= end]
        worst, p99 = summary(inside)
        took = "" if label == "idle" else f", A's COMPLETE_ADD of {topics:,} took {(end - start) * 1000:,.0f} ms"
        print(f"{label:>20}: {len(inside):4d} probe sends, max {worst:6.1f} ms, p99 {p99:6.1f} ms{took}", flush=True)
        if label != "idle":
            busy.extend(inside)
    idle_max, idle_p99 = summary([lat for began, lat in probes if windows[0][1] <= began <= windows[0][2]])
    worst, p99 = summary(busy)
    verdict = "PASS" if worst <= TARGET_MS else "ABOVE TARGET"
    print(
        f"FIGURE probe send latency max during a {topics:,}-topic COMPLETE_ADD: {worst:.1f} ms "
        f"(target <= {TARGET_MS:.0f} ms) {verdict}; p99 {p99:.1f} ms; "
        f"idle max {idle_max:.1f} ms, p99 {idle_p99:.1f} ms",
        flush=True,
    )
    calls = ", ".join(f"{label} {(end - start) * 1000:,.0f} ms" for label, start, end in windows[1:])
    print(f"FIGURE COMPLETE_ADD of {topics:,} lite topics, call duration: {calls}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topics", type=int, default=100_000)
    parser.add_argument("--idle-s", type=float, default=3.0)
    parser.add_argument("--quick", action="store_true", help="20,000 topics, 1 s idle")
    args = parser.parse_args()
    topics, idle_s = (20_000, 1.0) if args.quick else (args.topics, args.idle_s)
    print(__doc__.split("\n\n")[1], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        broker = start_broker(
            Path(tmp) / "data", extra_args=["--no-bootstrap", "--max-subscriptions-per-broker", str(4 * topics)]
        )
        try:
            with AdminClient(broker.admin_endpoint, timeout_s=30, **broker.admin_keys) as admin:
                admin.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
                admin.put_group(model.LiteGroup(GROUP, PARENT, client_quota=2 * topics))
            asyncio.run(run(broker.endpoint, topics, idle_s))
        finally:
            broker.stop()


if __name__ == "__main__":
    main()
