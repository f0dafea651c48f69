"""Do other clients' sends wait while one client subscribes 100,000 lite topics?

Definition printed with the result: a broker process (defaults, sync flush; quota raised to fit). Client A (its own
process and channel) sends SyncLiteSubscription COMPLETE_ADD of ``--topics`` lite topics, three calls in a row:
all new names, a wholly different set (every name added and every old one removed), and the same set again (the
30 s re-sync every official consumer makes). Client B (its own channel) sends one single-message SendMessage
every 10 ms throughout. We print B's send latency (max and p99) over the probes sent while one of A's calls was
in progress, the same over an idle stretch before, and each of A's call durations. Goal: max <= 50 ms during A's
calls (the broker does a big subscription change in slices that let other calls in between).

MQTT case (``--case mqtt``; both by default): a parent of ``--topics`` lite topics named like MQTT topics
``b<0-9>/f<0-9>/r<room>`` (one message each), and one MQTT client's SUBSCRIBE of 100 filters without a literal
prefix after the parent level (``MQ_STALL/+/f<j % 10>/r<j>``: 10 topics each), then another of other rooms,
then a third of ``MQ_STALL/+/+/r<n>`` (100 topics each: 10,000, ten times the goal's case). We print the
broker's CPU (all its threads, ns ``schedstat``) from the SUBSCRIBE until it is idle again after the SUBACK
(less what the probes cost meanwhile, measured idle) and the probe send max over that window; first with
``--no-lite-level-index`` (the plain walk of the parent per filter set), then with the level index (the first
two SUBSCRIBEs are found on the store's key order before any index exists, ~200 names read, 1,000 looked up; the third
would read more than that walk's budget, so it builds the index). Goal: <= 100 ms CPU and probe max
<= 50 ms. Also the index's memory per lite topic (built here). ``--repeat N``: N brokers with the level index
(each the three SUBSCRIBEs); ``--no-plain``: without the plain walk's broker.

    python bench/bench_subscribe_stall.py           # 100,000 lite topics
    python bench/bench_subscribe_stall.py --quick   # 20,000 lite topics
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import tempfile
import threading
import time
import tracemalloc
from multiprocessing.connection import Connection
from pathlib import Path

import grpc
from paho.mqtt.enums import CallbackAPIVersion

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.dispatch import level_index, subscriptions
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as sg
from lmq_broker.testing import BrokerProcess, start_broker

PARENT, GROUP = "STALL_PARENT", "stall-group"
SUBSCRIBER = (("x-mq-client-id", "big-subscriber"), ("x-mq-language", "JAVA"), ("x-mq-client-version", "5.0.8"))
PROBE = (("x-mq-client-id", "probe-producer"), ("x-mq-language", "JAVA"), ("x-mq-client-version", "5.0.8"))
PROBE_EVERY_S = 0.010
TARGET_MS = 50.0
CHANNEL_OPTIONS = (("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20))
ROUNDS = (("all new", "a"), ("replace every name", "b"), ("same set again", "b"))
MQTT_PARENT = "MQ_STALL"
MQTT_FILTERS = 100
MQTT_ROUNDS = (  # (label, filter after the parent level, the goal's case): three SUBSCRIBEs, each of other rooms
    ("first (no index yet: found in key order)", "+/f{f}/r{r}", True),
    ("second (other filters)", "+/f{f}/r{r}", True),
    ("third (+/+/r<n>, 10,000 topics: too much to read in key order, the index is built)", "+/+/r{r}", False),
)
MQTT_TARGET_CPU_MS = 100.0
FILL_BATCH = 500


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


async def probe_loop(
    stub: sg.MessagingServiceAsyncStub, stop: asyncio.Event, out: list[tuple[float, float]], parent: str = PARENT
) -> None:
    """Client B: one send every 10 ms (a send still waiting does not hold the next one back)."""
    pending: set[asyncio.Task[None]] = set()
    n = 0

    async def one(i: int) -> None:
        props = pb.SystemProperties(message_id=f"probe-{i}", message_type=pb.LITE, lite_topic=f"probe-{i % 16}")
        message = pb.Message(topic=pb.Resource(name=parent), body=b"probe", system_properties=props)
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


def cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid``'s threads so far, to the nanosecond (each thread's ``schedstat``: the
    ``stat`` file's user + system time moves in 10 ms ticks, a tenth of the target). A thread that ended
    takes its time with it: ``threads`` tells whether the set changed over a window."""
    total = 0
    for tid in threads(pid):
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except FileNotFoundError:  # it ended meanwhile
            continue
    return total / 1e9


def threads(pid: int) -> frozenset[str]:
    return frozenset(os.listdir(f"/proc/{pid}/task"))


def room_names(topics: int) -> list[str]:
    return [f"b{i % 10}_f{(i // 10) % 10}_r{i // 100}" for i in range(topics)]


def fill(endpoint: str, names: list[str]) -> None:
    """One message in each lite topic of the MQTT parent (batched sends)."""
    with grpc.insecure_channel(endpoint, options=CHANNEL_OPTIONS) as channel:
        stub = sg.MessagingServiceStub(channel)
        for start in range(0, len(names), FILL_BATCH):
            messages = [
                pb.Message(
                    topic=pb.Resource(name=MQTT_PARENT),
                    body=b"x",
                    system_properties=pb.SystemProperties(message_id=f"f-{n}", message_type=pb.LITE, lite_topic=n),
                )
                for n in names[start : start + FILL_BATCH]
            ]
            reply = stub.SendMessage(spb.SendMessageRequest(messages=messages), metadata=PROBE, timeout=120)
            if reply.status.code != pb.OK:
                raise SystemExit(f"fill failed: {reply.status}")


def mqtt_subscribe(port: int, client_id: str, filters: list[str]) -> tuple[float, float]:
    """One SUBSCRIBE of ``filters``; (sent, SUBACK received) in ``time.monotonic``."""
    import paho.mqtt.client as mqtt  # noqa: PLC0415 (only this case needs it)

    done = threading.Event()
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id)
    client.on_subscribe = lambda *_: done.set()
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        time.sleep(0.2)  # connected
        sent = time.monotonic()
        client.subscribe([(f, 1) for f in filters])
        if not done.wait(300):
            raise SystemExit("no SUBACK")
        return sent, time.monotonic()
    finally:
        client.loop_stop()
        client.disconnect()


async def quiet(pid: int, idle_rate: float, step_s: float = 0.25, limit_s: float = 60.0) -> None:
    """Wait until the broker's CPU is back to its idle rate (probes only) for a step."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        began, used = time.monotonic(), cpu_s(pid)
        await asyncio.sleep(step_s)
        if cpu_s(pid) - used <= 2 * idle_rate * (time.monotonic() - began) + 0.01:
            return


async def mqtt_rounds(broker: BrokerProcess, label: str) -> None:
    """Probe sends throughout; idle, then the SUBSCRIBEs of ``MQTT_ROUNDS``; CPU and probe max of each."""
    pid = broker.process.pid
    probes: list[tuple[float, float]] = []
    stop = asyncio.Event()
    async with grpc.aio.insecure_channel(broker.endpoint, options=CHANNEL_OPTIONS) as channel:
        stub: sg.MessagingServiceAsyncStub = sg.MessagingServiceStub(channel)
        prober = asyncio.create_task(probe_loop(stub, stop, probes, MQTT_PARENT))
        await asyncio.sleep(0.5)
        idle_from, idle_cpu = time.monotonic(), cpu_s(pid)
        await asyncio.sleep(2.0)
        idle_rate = (cpu_s(pid) - idle_cpu) / (time.monotonic() - idle_from)
        idle_max, _ = summary([lat for began, lat in probes if began >= idle_from])  # the host's own noise
        for n, (which, shape, goal) in enumerate(MQTT_ROUNDS):
            filters = [f"{MQTT_PARENT}/{shape.format(j=j, f=j % 10, r=j + 50 * n)}" for j in range(MQTT_FILTERS)]
            before, alive = cpu_s(pid), threads(pid)
            sent, acked = await asyncio.to_thread(mqtt_subscribe, broker.mqtt_port, f"stall-{n}", filters)
            await quiet(pid, idle_rate)  # the catch-up after the SUBACK, however slow a loaded host makes it
            took = time.monotonic() - sent
            spent_ms = (cpu_s(pid) - before - idle_rate * took) * 1000
            ended = len(alive - threads(pid))
            note = f" ({ended} broker threads ended meanwhile: their CPU is not counted)" if ended else ""
            worst, _ = summary([lat for began, lat in probes if sent <= began <= sent + took])
            verdict = "PASS" if spent_ms <= MQTT_TARGET_CPU_MS and worst <= TARGET_MS else "ABOVE TARGET"
            verdict = verdict if goal else "(10x the goal's topics: no target)"
            print(
                f"FIGURE MQTT {MQTT_FILTERS}-filter SUBSCRIBE, {label}, {which}: broker CPU {spent_ms:,.0f} ms "
                f"(target <= {MQTT_TARGET_CPU_MS:.0f} ms), SUBACK after {(acked - sent) * 1000:,.0f} ms, "
                f"probe send max {worst:.1f} ms (target <= {TARGET_MS:.0f} ms; idle {idle_max:.1f} ms) {verdict}{note}",
                flush=True,
            )
        stop.set()
        await prober


def index_memory(names: list[str]) -> None:
    """The level index of these names, built as the broker builds it (pages in key order), measured here with
    tracemalloc (the broker's RSS moves by more than one index between samples)."""
    ordered = sorted(names)
    tracemalloc.start()
    index = level_index.LevelIndex()
    for start in range(0, len(ordered), subscriptions.INDEX_PAGE):
        index.add_many(ordered[start : start + subscriptions.INDEX_PAGE])
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(
        f"FIGURE level index memory: {held / len(names):.0f} B per lite topic at {len(names):,} "
        f"({held / 2**20:.1f} MiB; tracemalloc, names and all)",
        flush=True,
    )


def mqtt_case(topics: int, repeat: int, plain: bool) -> None:
    names = room_names(topics)
    index_memory(names)
    runs = [("plain walk (--no-lite-level-index)", ["--no-lite-level-index"])] if plain else []
    runs += [(f"level index, broker {i + 1} of {repeat}" if repeat > 1 else "level index", []) for i in range(repeat)]
    for label, flags in runs:
        with tempfile.TemporaryDirectory() as tmp:
            broker = start_broker(Path(tmp) / "data", extra_args=["--no-bootstrap", "--mqtt-port", "0", *flags])
            try:
                with AdminClient(broker.admin_endpoint, timeout_s=30, **broker.admin_keys) as admin:
                    admin.put_parent_topic(model.ParentTopic(MQTT_PARENT, model.MessageType.LITE))
                fill(broker.endpoint, names)
                asyncio.run(mqtt_rounds(broker, label))
            finally:
                broker.stop()


def grpc_case(topics: int, idle_s: float) -> None:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topics", type=int, default=100_000)
    parser.add_argument("--idle-s", type=float, default=3.0)
    parser.add_argument("--quick", action="store_true", help="20,000 topics, 1 s idle")
    parser.add_argument("--case", choices=("grpc", "mqtt", "both"), default="both")
    parser.add_argument("--repeat", type=int, default=1, help="MQTT case: brokers measured with the level index")
    parser.add_argument("--no-plain", action="store_true", help="MQTT case: without the plain walk's broker")
    args = parser.parse_args()
    topics, idle_s = (20_000, 1.0) if args.quick else (args.topics, args.idle_s)
    print(__doc__.split("\n\n")[1], flush=True)
    if args.case in ("grpc", "both"):
        grpc_case(topics, idle_s)
    if args.case in ("mqtt", "both"):
        mqtt_case(topics, args.repeat, not args.no_plain)


if __name__ == "__main__":
    main()
