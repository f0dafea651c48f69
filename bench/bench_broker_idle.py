"""Idle subscriptions cost nothing: receive latency with 1M subscribed idle lite topics vs 1k (goal ratio
<= 1.2), and the broker's CPU while 1M subscriptions sit idle (goal <= 1% of one core over >= 10 s).

One client of a lite group holds the subscriptions (PARTIAL_ADD in chunks of 10k) plus one ``hot`` lite
topic. A receive latency is the time from SendMessage to the message arriving on that client's parked
ReceiveMessage long poll (the ready-set path: arrival -> offer -> wake -> read -> lease -> stream), then
the message is acked. The same broker process is measured with 1k subscriptions, then grown to 1M and
measured again. Idle CPU is read with psutil over the broker process while its one client sits in long
polls. The "idle" topics have subscriptions but no messages. Prints ``FIGURE`` lines.

With ``--stored N`` the broker is then stopped, N more lite topics of one message each (none subscribed) are
written into its data dir through the store, as a broker would have stored them, and the broker is started
again with its subscriptions restored: restart to ready, receive latency and idle CPU are measured once more,
and the receive p99 with N stored ÷ without (the same 1M subscriptions) printed (issue 28 item 6: 10M lite
topics, 1M subscribed).

    python bench/bench_broker_idle.py           # ~2-4 min (subscribing 1M topics dominates)
    python bench/bench_broker_idle.py --stored 10000000   # + ~10 min: 10M stored lite topics
    python bench/bench_broker_idle.py --quick   # smoke run (1k vs 20k subscriptions, 2 s idle)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import psutil

from lmq_broker import config, model
from lmq_broker.admin.client import AdminClient
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc
from lmq_broker.storage import store as store_mod
from lmq_broker.testing import BrokerProcess, start_broker

TOPIC, GROUP, CLIENT = "AGENT_TASK_NS", "idle-bench", "idle-bench-client"
HEADERS = (("x-mq-client-id", CLIENT), ("x-mq-language", "JAVA"), ("x-mq-client-version", "5.1.0"))
CHUNK = 10_000
STORE_BATCH = 1000


def figure(name: str, value: float, unit: str, *, op: str, target: float, extra: str = "") -> None:
    ok = value >= target if op == ">=" else value <= target
    verdict = "PASS" if ok else "BELOW TARGET"
    print(f"FIGURE {name}: {value:,.3f} {unit} (target {op} {target:,.2f} {unit}) {verdict}{extra}", flush=True)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def subscribe(stub: service_pb2_grpc.MessagingServiceAsyncStub, start: int, end: int) -> None:
    for lo in range(start, end, CHUNK):
        names = [f"idle-{i}" for i in range(lo, min(end, lo + CHUNK))]
        request = spb.SyncLiteSubscriptionRequest(
            action=pb.PARTIAL_ADD, topic=pb.Resource(name=TOPIC), group=pb.Resource(name=GROUP), lite_topic_set=names
        )
        reply = await stub.SyncLiteSubscription(request, metadata=HEADERS, timeout=120)
        if reply.status.code != pb.OK:
            raise RuntimeError(f"subscribe failed: {reply.status}")


async def receive_latencies(stub: service_pb2_grpc.MessagingServiceAsyncStub, samples: int) -> list[float]:
    latencies = []
    receive = spb.ReceiveMessageRequest(
        group=pb.Resource(name=GROUP), message_queue=pb.MessageQueue(topic=pb.Resource(name=TOPIC)),
        batch_size=32, auto_renew=True,
    )  # fmt: skip
    for n in range(samples):
        call = stub.ReceiveMessage(receive, metadata=HEADERS, timeout=30)
        await asyncio.sleep(0.005)  # let the poll park on the broker before the message exists
        message = pb.Message(
            topic=pb.Resource(name=TOPIC), body=b"ping",
            system_properties=pb.SystemProperties(message_id=f"hot-{n}", message_type=pb.LITE, lite_topic="hot"),
        )  # fmt: skip
        started = time.perf_counter()
        sent = await stub.SendMessage(spb.SendMessageRequest(messages=[message]), metadata=HEADERS, timeout=10)
        assert sent.status.code == pb.OK, sent.status
        got = None
        async for frame in call:
            if frame.HasField("message"):
                got = frame.message
                latencies.append(time.perf_counter() - started)
        assert got is not None, "the hot message did not arrive"
        ack = spb.AckMessageRequest(
            group=pb.Resource(name=GROUP), topic=pb.Resource(name=TOPIC),
            entries=[spb.AckMessageEntry(message_id=got.system_properties.message_id,
                                         receipt_handle=got.system_properties.receipt_handle)],
        )  # fmt: skip
        assert (await stub.AckMessage(ack, metadata=HEADERS, timeout=10)).status.code == pb.OK
    return latencies


async def idle_cpu(stub: service_pb2_grpc.MessagingServiceAsyncStub, pid: int, seconds: float) -> float:
    """Percent of one core the broker used while its client sat in one long poll."""
    process = psutil.Process(pid)
    receive = spb.ReceiveMessageRequest(
        group=pb.Resource(name=GROUP), message_queue=pb.MessageQueue(topic=pb.Resource(name=TOPIC)),
        batch_size=32, auto_renew=True,
    )  # fmt: skip
    call = stub.ReceiveMessage(receive, metadata=HEADERS, timeout=seconds + 30)
    await asyncio.sleep(0.5)
    before, t0 = process.cpu_times(), time.monotonic()
    await asyncio.sleep(seconds)
    after, t1 = process.cpu_times(), time.monotonic()
    call.cancel()
    used = (after.user - before.user) + (after.system - before.system)
    return 100.0 * used / (t1 - t0)


async def settle(pid: int, timeout: float = 120) -> None:
    """Wait until the broker is done with the subscription burst (its background catch-up passes)."""
    process = psutil.Process(pid)
    deadline = time.monotonic() + timeout
    process.cpu_percent(None)
    while time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        if process.cpu_percent(None) < 5.0:
            return


async def run(endpoint: str, pid: int, *, small: int, large: int, samples: int, idle_s: float) -> float:
    """The figures with ``small`` then ``large`` subscriptions; the receive p99 (ms) with ``large``."""
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = service_pb2_grpc.MessagingServiceStub(channel)
        await subscribe(stub, 0, small)
        await stub.SyncLiteSubscription(
            spb.SyncLiteSubscriptionRequest(
                action=pb.PARTIAL_ADD, topic=pb.Resource(name=TOPIC), group=pb.Resource(name=GROUP),
                lite_topic_set=["hot"],
            ),
            metadata=HEADERS,
        )  # fmt: skip
        await receive_latencies(stub, 10)  # warm
        few = await receive_latencies(stub, samples)
        started = time.monotonic()
        await subscribe(stub, small, large)
        subscribe_s = time.monotonic() - started
        await settle(pid)
        rss = psutil.Process(pid).memory_info().rss
        many = await receive_latencies(stub, samples)
        cpu = await idle_cpu(stub, pid, idle_s)
    p99_few, p99_many = percentile(few, 99) * 1000, percentile(many, 99) * 1000
    print(
        f"subscriptions: {small + 1:,} then {large + 1:,} (added in {subscribe_s:.1f} s); "
        f"broker RSS {rss / 2**20:,.0f} MiB"
    )
    print(
        f"receive latency with {small:,} idle: p50 {statistics.median(few) * 1000:.2f} ms, p99 {p99_few:.2f} ms; "
        f"with {large:,} idle: p50 {statistics.median(many) * 1000:.2f} ms, p99 {p99_many:.2f} ms ({samples} samples)"
    )
    figure(f"receive p99 {large:,} idle / {small:,} idle", p99_many / p99_few, "x", op="<=", target=1.2)
    figure(f"broker idle CPU with {large:,} subscriptions over {idle_s:.0f} s", cpu, "% of a core", op="<=", target=1.0)
    return p99_many


def store_more(data_dir: Path, count: int) -> float:
    """``count`` lite topics ``cold-<n>`` of the broker's parent, one message each, written through the store into
    the stopped broker's data dir (async flush: setup, not measured); the seconds it took."""
    started = time.perf_counter()
    store = store_mod.open_store(config.StoreConfig(data_dir=data_dir, flush_mode=config.FlushMode.ASYNC))
    parent = model.QueueId(TOPIC, 0)
    try:
        for low in range(0, count, STORE_BATCH):
            batch = []
            for n in range(low, min(count, low + STORE_BATCH)):
                lite = f"cold-{n}"
                queues = (parent, model.QueueId.lmq(TOPIC, lite))
                batch.append(
                    model.NewMessage(
                        f"cold-{n}", TOPIC, b"c" * 128, queues, lite_topic=lite, message_type=model.MessageType.LITE
                    )
                )
            store.append(batch)
    finally:
        store.close()
    return time.perf_counter() - started


async def run_stored(endpoint: str, pid: int, *, stored: int, samples: int, idle_s: float, before_ms: float) -> None:
    """The figures again after ``stored`` more lite topics, against the receive p99 before them."""
    await settle(pid)
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = service_pb2_grpc.MessagingServiceStub(channel)
        await receive_latencies(stub, 10)  # warm
        after = await receive_latencies(stub, samples)
        cpu = await idle_cpu(stub, pid, idle_s)
    p99_after = percentile(after, 99) * 1000
    print(
        f"receive latency with {stored:,} more lite topics stored: p50 {statistics.median(after) * 1000:.2f} ms, "
        f"p99 {p99_after:.2f} ms; broker RSS {psutil.Process(pid).memory_info().rss / 2**20:,.0f} MiB"
    )
    figure(f"receive p99 with {stored:,} stored / without", p99_after / before_ms, "x", op="<=", target=1.2)
    figure(f"broker idle CPU with {stored:,} stored over {idle_s:.0f} s", cpu, "% of a core", op="<=", target=1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument(
        "--stored", type=int, default=0, help="then this many more stored lite topics, the broker restarted"
    )
    args = parser.parse_args()
    small, large = (1_000, 20_000) if args.quick else (1_000, 1_000_000)
    samples = 30 if args.quick else args.samples
    idle_s = 2.0 if args.quick else 12.0
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        flags = ["--max-subscriptions-per-broker", str(2 * large), "--metrics-port", "-1"]
        broker = stack.enter_context(start_broker(Path(tmp) / "data", extra_args=flags))
        with AdminClient(broker.admin_endpoint, timeout_s=30, **broker.admin_keys) as admin:
            admin.put_group(model.LiteGroup(GROUP, TOPIC, client_quota=2 * large))
        asyncio.run(phases(broker, stack, args.stored, small=small, large=large, samples=samples, idle_s=idle_s))


async def phases(
    broker: BrokerProcess,
    stack: contextlib.ExitStack,
    stored: int,
    *,
    small: int,
    large: int,
    samples: int,
    idle_s: float,
) -> None:
    """The subscriptions' figures, then (``stored`` > 0) the stored topics' after a restart: in one event loop,
    as grpc's asyncio channels want (a second ``asyncio.run`` leaves the first loop's poller behind)."""
    before = await run(broker.endpoint, broker.pid, small=small, large=large, samples=samples, idle_s=idle_s)
    if not stored:
        return
    started = time.perf_counter()
    broker = stack.enter_context(await asyncio.to_thread(broker.restart, 300))
    print(f"restart to ready with {large:,} subscribed, nothing stored: {time.perf_counter() - started:.2f} s")
    broker.stop()
    took = await asyncio.to_thread(store_more, broker.data_dir, stored)
    print(f"stored {stored:,} more lite topics in {took:.0f} s ({stored / took:,.0f} a second)")
    started = time.perf_counter()
    broker = stack.enter_context(await asyncio.to_thread(broker.restart, 300))
    ready_s = time.perf_counter() - started
    figure(f"restart to ready with {stored:,} stored, {large:,} subscribed", ready_s, "s", op="<=", target=5)
    await run_stored(broker.endpoint, broker.pid, stored=stored, samples=samples, idle_s=idle_s, before_ms=before)


if __name__ == "__main__":
    main()
