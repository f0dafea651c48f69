"""What an offset reset costs with replication (issue 32): SyncLiteSubscription latency p50/p99 with an OffsetOption
(MAX: start at the end, as an MQTT subscription's start at the end does) at ``--replicas 2`` / ``--replicas 1`` in
the same run. At R=2 (``--min-insync-replicas`` 2) the reset is answered once the follower stored the commit
point it wrote, so a follower that takes over does not deliver what came before; at R=1 nothing is copied.

Brokers as in ``bench_replication`` (three processes, ``sync`` flush, the per-slot Leases on the test apiserver);
``--topics`` lite topics broker 0 owns get one message each, then one consumer subscribes to them one at a time.

    python bench/bench_replication_resets.py            # 3 rounds of 500 subscriptions
    python bench/bench_replication_resets.py --quick    # 1 round of 100
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
CONSUMER = (("x-mq-client-id", "bench-resets"), ("x-mq-language", "JAVA"), ("x-mq-client-version", "5.2.0"))


async def subscribe_load(endpoint: str, lites: list[str]) -> list[float]:
    """Latencies (s) of one SyncLiteSubscription per lite topic, each starting at the topic's end."""
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = service_pb2_grpc.MessagingServiceStub(channel)
        for lite in lites:
            request = spb.SyncLiteSubscriptionRequest(
                action=pb.PARTIAL_ADD, topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP),
                lite_topic_set=[lite], offset_option=pb.OffsetOption(policy=pb.OffsetOption.MAX),
            )  # fmt: skip
            began = time.perf_counter()
            reply = await stub.SyncLiteSubscription(request, metadata=CONSUMER)
            latencies.append(time.perf_counter() - began)
            assert reply.status.code == pb.OK, reply.status.message
    return latencies


def measure(workdir: Path, kube: kube_testing.KubeAPI, replicas: int, topics: int, tag: str) -> list[float]:
    brokers, members = start_pair(workdir, kube, str(replicas), tag)
    try:
        membership = mb.Membership.parse(",".join(members))
        names = (f"t{i}" for i in range(1_000_000))
        lites = [n for n in names if mb.owner(membership, model.QueueId.lmq(PARENT, n).topic) == 0][:topics]
        asyncio.run(send_load(members[0], lites, topics, 8))
        latencies = asyncio.run(subscribe_load(members[0], lites))
    finally:
        for b in brokers:
            b.stop()
    latencies.sort()
    return [statistics.median(latencies) * 1e6, latencies[int(len(latencies) * 0.99) - 1] * 1e6]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--topics", type=int, default=500)
    args = parser.parse_args()
    rounds, topics = (1, 100) if args.quick else (args.rounds, args.topics)
    print(f"load average {os.getloadavg()[0]:.1f}; {topics} subscriptions x {rounds} rounds")
    with tempfile.TemporaryDirectory() as tmp, kube_testing.testenv(Path(tmp) / "testenv") as kube:
        figures: dict[int, list[list[float]]] = {1: [], 2: []}
        for r in range(rounds):
            for replicas in (1, 2):
                got = measure(Path(tmp), kube, replicas, topics, f"r{r}-{replicas}")
                figures[replicas].append(got)
                print(f"round {r} R={replicas}: subscribe p50 {got[0]:,.0f} µs  p99 {got[1]:,.0f} µs")
        med = {k: [statistics.median(x[i] for x in v) for i in range(2)] for k, v in figures.items()}
        for i, name in enumerate(("p50", "p99")):
            print(f"FIGURE subscribe at the end {name} R=2 ÷ R=1: {med[2][i] / med[1][i]:.2f} "
                  f"({med[2][i]:,.0f} vs {med[1][i]:,.0f} µs)")  # fmt: skip
        print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
