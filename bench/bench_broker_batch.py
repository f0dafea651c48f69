"""Batched sends into 10k lite topics: messages per second through SendMessage (goal >= 50,000 msg/s).

A broker process (default settings: sync flush, group commit) takes SendMessage requests of ``--batch``
LITE messages each, spread round-robin over ``--topics`` lite topics of AGENT_TASK_NS, with ``--inflight``
requests outstanding. Requests are serialized before the clock starts, so the client process spends its
CPU on the wire, not on protobuf. Prints ``FIGURE`` lines, and the broker's CPU per message (its
event-loop thread apart from the others: the appender and gRPC's), which the machine's load does not blur:
the broker's Python work is serialized by the GIL, so the rate is bounded by about 1 / (CPU per message).

    python bench/bench_broker_batch.py           # ~20 s
    python bench/bench_broker_batch.py --quick   # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import psutil

from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.testing import start_broker

METHOD = "/apache.rocketmq.v2.MessagingService/SendMessage"


def figure(name: str, value: float, unit: str, *, op: str, target: float, extra: str = "") -> None:
    ok = value >= target if op == ">=" else value <= target
    verdict = "PASS" if ok else "BELOW TARGET"
    print(f"FIGURE {name}: {value:,.1f} {unit} (target {op} {target:,.0f} {unit}) {verdict}{extra}", flush=True)


def requests(count: int, batch: int, topics: int, body: bytes) -> list[bytes]:
    out = []
    n = 0
    for _ in range(count):
        messages = []
        for _ in range(batch):
            messages.append(
                pb.Message(
                    topic=pb.Resource(name="AGENT_TASK_NS"),
                    body=body,
                    system_properties=pb.SystemProperties(
                        message_id=f"{n:034X}",
                        message_type=pb.LITE,
                        lite_topic=f"t{n % topics}",
                        body_encoding=pb.IDENTITY,
                    ),
                )
            )
            n += 1
        out.append(spb.SendMessageRequest(messages=messages).SerializeToString())
    return out


def thread_cpu_s(pid: int) -> tuple[float, float]:
    """(CPU seconds of the process's main thread, of all its other threads) so far."""
    threads = psutil.Process(pid).threads()
    main = sum(t.user_time + t.system_time for t in threads if t.id == pid)
    return main, sum(t.user_time + t.system_time for t in threads) - main


async def pump(endpoint: str, payloads: list[bytes], inflight: int) -> float:
    async with grpc.aio.insecure_channel(
        endpoint, options=[("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]
    ) as channel:
        call = channel.unary_unary(
            METHOD, request_serializer=None, response_deserializer=spb.SendMessageResponse.FromString
        )
        queue = list(reversed(payloads))

        async def worker() -> None:
            while queue:
                reply = await call(queue.pop(), timeout=60)
                if reply.status.code != pb.OK:
                    raise RuntimeError(f"send failed: {reply.status}")

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(inflight)))
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--batch", type=int, default=1000, help="messages per SendMessage")
    parser.add_argument("--topics", type=int, default=10_000, help="distinct lite topics")
    parser.add_argument("--inflight", type=int, default=4, help="requests outstanding")
    parser.add_argument("--body", type=int, default=128, help="body bytes")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    total = 20_000 if args.quick else 200_000
    runs = 1 if args.quick else args.runs
    body = b"x" * args.body
    rates = []
    loop_us: list[float] = []
    other_us: list[float] = []
    with tempfile.TemporaryDirectory() as tmp, start_broker(Path(tmp) / "data") as broker:
        warm = requests(2, args.batch, args.topics, body)
        asyncio.run(pump(broker.endpoint, warm, 1))
        for _ in range(runs):
            payloads = requests(total // args.batch, args.batch, args.topics, body)
            main0, other0 = thread_cpu_s(broker.pid)
            elapsed = asyncio.run(pump(broker.endpoint, payloads, args.inflight))
            main1, other1 = thread_cpu_s(broker.pid)
            rates.append(total / elapsed)
            loop_us.append((main1 - main0) * 1e6 / total)
            other_us.append((other1 - other0) * 1e6 / total)
    print(
        f"batched send: {total:,} messages/run, {args.batch}/request, {args.topics:,} lite topics, "
        f"{args.body} B bodies, {args.inflight} in flight, sync flush; load average {os.getloadavg()[0]:.1f}"
    )
    loop, other = statistics.median(loop_us), statistics.median(other_us)
    print(
        f"broker CPU per message: {loop + other:.1f} us (event-loop thread {loop:.1f}: gRPC, protobuf, "
        f"validation, reply; other threads {other:.1f}: the appender's store.append, gRPC's pollers)"
    )
    extra = f" (median of {runs}; best {max(rates):,.0f})"
    figure("batched send rate", statistics.median(rates), "msg/s", op=">=", target=50_000, extra=extra)


if __name__ == "__main__":
    main()
