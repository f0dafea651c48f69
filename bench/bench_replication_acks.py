"""What an ack costs with replication (issue 32): AckMessage latency p50/p99 with ``--replicas 2`` / ``--replicas 1``
in the same run. At R=2 (``--min-insync-replicas`` 2) an ack is answered once the follower stored its commit
point, so a follower that takes over never delivers it again; at R=1 nothing is copied.

Brokers as in ``bench_replication`` (three processes, ``sync`` flush, the per-slot Leases on the test apiserver);
``--messages`` messages are sent to lite topics broker 0 owns, then a consumer subscribed at broker 0 receives
them in batches of 32 and acks each message with its own AckMessage, ``--inflight`` at a time.

    python bench/bench_replication_acks.py            # 3 rounds of 2,000 acks each
    python bench/bench_replication_acks.py --quick    # 1 round of 300
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
from bench_replication import PARENT, send_load, start_pair

from lmq_broker import model
from lmq_broker.cluster import membership as mb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc
from lmq_operator import testing as kube_testing

GROUP = "executor-group"
CONSUMER = (("x-mq-client-id", "bench-acks"), ("x-mq-language", "JAVA"), ("x-mq-client-version", "5.2.0"))


async def ack_load(endpoint: str, lites: list[str], total: int, inflight: int) -> list[float]:
    """Latencies (s) of ``total`` acks, each message acked alone, ``inflight`` at a time."""
    group, parent = pb.Resource(name=GROUP), pb.Resource(name=PARENT)
    latencies: list[float] = []
    gate = asyncio.Semaphore(inflight)
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = service_pb2_grpc.MessagingServiceStub(channel)
        sync = spb.SyncLiteSubscriptionRequest(action=pb.PARTIAL_ADD, topic=parent, group=group, lite_topic_set=lites)
        assert (await stub.SyncLiteSubscription(sync, metadata=CONSUMER)).status.code == pb.OK

        async def ack(message: pb.Message) -> None:
            props = message.system_properties
            entry = spb.AckMessageEntry(
                message_id=props.message_id, receipt_handle=props.receipt_handle, lite_topic=props.lite_topic
            )
            request = spb.AckMessageRequest(group=group, topic=parent, entries=[entry])
            async with gate:
                began = time.perf_counter()
                reply = await stub.AckMessage(request, metadata=CONSUMER)
                assert reply.status.code == pb.OK, reply.status.message
                latencies.append(time.perf_counter() - began)

        while len(latencies) < total:
            request = spb.ReceiveMessageRequest(group=group, message_queue=pb.MessageQueue(topic=parent), batch_size=32)
            request.invisible_duration.FromSeconds(60)
            request.long_polling_timeout.FromSeconds(2)
            frames = [f async for f in stub.ReceiveMessage(request, metadata=CONSUMER, timeout=10)]
            await asyncio.gather(*(ack(f.message) for f in frames if f.HasField("message")))
    return latencies


def measure(  # noqa: PLR0917 (one run's settings)
    workdir: Path, kube: kube_testing.KubeAPI, replicas: int, total: int, inflight: int, tag: str
) -> list[float]:
    brokers, members = start_pair(workdir, kube, str(replicas), tag)
    try:
        membership = mb.Membership.parse(",".join(members))
        names = (f"t{i}" for i in range(100_000))
        lites = [n for n in names if mb.owner(membership, model.QueueId.lmq(PARENT, n).topic) == 0][:50]
        asyncio.run(send_load(members[0], lites, total, 8))
        latencies = asyncio.run(ack_load(members[0], lites, total, inflight))
    finally:
        for b in brokers:
            b.stop()
    latencies.sort()
    return [statistics.median(latencies) * 1e6, latencies[int(len(latencies) * 0.99) - 1] * 1e6]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--inflight", type=int, default=8)
    args = parser.parse_args()
    rounds, total = (1, 300) if args.quick else (args.rounds, args.messages)
    print(f"load average {os.getloadavg()[0]:.1f}; {total} acks x {rounds} rounds, {args.inflight} in flight")
    with tempfile.TemporaryDirectory() as tmp, kube_testing.testenv(Path(tmp) / "testenv") as kube:
        figures: dict[int, list[list[float]]] = {1: [], 2: []}
        for r in range(rounds):
            for replicas in (1, 2):
                got = measure(Path(tmp), kube, replicas, total, args.inflight, f"a{r}-{replicas}")
                figures[replicas].append(got)
                print(f"round {r} R={replicas}: ack p50 {got[0]:,.0f} µs  p99 {got[1]:,.0f} µs")
        med = {k: [statistics.median(x[i] for x in v) for i in range(2)] for k, v in figures.items()}
        for i, name in enumerate(("p50", "p99")):
            print(f"FIGURE ack {name} R=2 ÷ R=1: {med[2][i] / med[1][i]:.2f} ({med[2][i]:,.0f} vs {med[1][i]:,.0f} µs)")
        print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
