"""Replication's price (issue 32): send latency p50/p99 and broker CPU per message with ``--replicas 2`` and
``--replicas 3`` / ``--replicas 1``, in the same run, on the same host; and asynchronous replication
(``--replicas 2 --min-insync-replicas 1``, row ``R=2/M=1``: the send is answered before the copy is made).

Three broker processes (``--peers``, ``sync`` flush) on a real kube-apiserver + etcd (``make testenv``, the per-slot
Leases); a producer sends 1 KiB LITE messages to lite topics broker 0 owns, through broker 0, ``--inflight``
at a time, one message per SendMessage. CPU is user + system time of *all* brokers (the followers' work is
part of the price) over the timed sends, per message. The settings (``--configs``, ``R`` or ``R/M``) alternate
``--rounds`` times. Goal (issue 32): p99 ≤ 2x and CPU ≤ 1.5x at R=2.

    python bench/bench_replication.py            # 3 rounds of 3,000 sends each
    python bench/bench_replication.py --quick    # 1 round of 500
    python bench/bench_replication.py --configs 1,2,2/1   # R=1, R=2 (all in sync), R=2 asynchronous
    python bench/bench_replication.py --configs 1,2 --edge grpcio   # every broker on grpcio's edge (default: native)
    python bench/bench_replication.py --configs 1,2,2+grpc   # R=2 with copies on the copy socket, then gRPC only

``--case catch-up``: the catch-up rate of a rejoining follower. R=2 with ``--min-insync-replicas 1`` (the owner
acknowledges alone), the follower of broker 0's slot stopped while ``--messages`` 1 KiB sends to 50 lite
topics are acknowledged, then started again on its disk: messages/s and MiB/s from its readiness until it
stored all of them (its ``lmq_replication_copied_total``: live copies, catch-up copies and reconcile fetches).

    python bench/bench_replication.py --case catch-up --messages 50000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc

from lmq_broker import model
from lmq_broker.cluster import membership as mb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc
from lmq_broker.supervisor import free_ports
from lmq_broker.testing import BrokerProcess, start_broker
from lmq_operator import testing as kube_testing

PARENT = "AGENT_TASK_NS"
HEADERS = (("x-mq-client-id", "bench-repl"), ("x-mq-language", "JAVA"), ("x-mq-client-version", "5.2.0"))
BODY = b"x" * 1024
BROKERS = 3


def cpu_s(broker: BrokerProcess) -> float:
    fields = Path(f"/proc/{broker.pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_pair(
    workdir: Path, kube: kube_testing.KubeAPI, setting: str, tag: str, edge: str = "native"
) -> tuple[list[BrokerProcess], list[str]]:
    setting, _, transport = setting.partition("+")
    replicas, _, min_insync = setting.partition("/")
    members = [f"127.0.0.1:{p}" for p in free_ports("127.0.0.1", BROKERS)]
    token = workdir / "token"
    token.write_text(kube.token)
    brokers = []
    for slot in range(BROKERS):
        flags = ["--peers", ",".join(members), "--ordinal", str(slot), "--advertised-address", members[slot]]
        flags += ["--admin-access-key", "ak", "--admin-secret-key", "sk", "--flush-mode", "sync"]
        flags += ["--replicas", replicas, "--min-insync-replicas", min_insync or "0", "--edge", edge]
        if transport == "grpc":  # copies over the gRPC stream only (no copy socket)
            flags += ["--replica-port", "-1"]
        if replicas != "1":
            flags += ["--lease-namespace", "default", "--lease-prefix", tag, "--kube-api-server", kube.server]
            flags += ["--kube-token-file", str(token), "--kube-ca-file", str(kube.ca_file)]
        brokers.append(start_broker(workdir / f"{tag}-b{slot}", int(members[slot].rsplit(":", 1)[1]), flags))
    return brokers, members


def copied(broker: BrokerProcess) -> float:
    """The broker's ``lmq_replication_copied_total`` (messages stored from copies since it started)."""
    with urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    found = [line.split()[-1] for line in text.splitlines() if line.startswith("lmq_replication_copied_total ")]
    return float(found[0]) if found else 0.0


def catch_up(workdir: Path, kube: kube_testing.KubeAPI, messages: int, inflight: int) -> tuple[float, float]:
    """(seconds from the follower's readiness until it stored ``messages``, seconds the sends took)."""
    brokers, members = start_pair(workdir, kube, "2/1", "catch-up")
    try:
        membership = mb.Membership.parse(",".join(members))
        names = (f"t{i}" for i in range(100_000))
        lites = [n for n in names if mb.owner(membership, model.QueueId.lmq(PARENT, n).topic) == 0][:50]
        asyncio.run(send_load(members[0], lites, 10, 1))  # the owner's lease taken
        follower = brokers[1]
        follower.stop()
        began = time.perf_counter()
        asyncio.run(send_load(members[0], lites, messages, inflight))
        sent_s = time.perf_counter() - began
        brokers[1] = follower.restart()
        ready = time.perf_counter()
        while copied(brokers[1]) < messages:
            time.sleep(0.05)
        return time.perf_counter() - ready, sent_s
    finally:
        for b in brokers:
            b.stop()


async def send_load(endpoint: str, lites: list[str], total: int, inflight: int) -> list[float]:
    """Latencies (s) of ``total`` sends, ``inflight`` at a time; a send that is not OK is retried (counted once)."""
    latencies: list[float] = []
    counter = iter(range(total))
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = service_pb2_grpc.MessagingServiceStub(channel)

        async def worker() -> None:
            for n in counter:
                lite = lites[n % len(lites)]
                props = pb.SystemProperties(message_id=f"m-{n}-{time.time_ns()}", message_type=pb.LITE, lite_topic=lite)
                msg = pb.Message(topic=pb.Resource(name=PARENT), body=BODY, system_properties=props)
                while True:
                    began = time.perf_counter()
                    reply = await stub.SendMessage(spb.SendMessageRequest(messages=[msg]), metadata=HEADERS)
                    if reply.status.code == pb.OK:
                        latencies.append(time.perf_counter() - began)
                        break
                    await asyncio.sleep(0.05)  # not in sync yet (a lease being taken at start)

        await asyncio.gather(*(worker() for _ in range(inflight)))
    return latencies


def measure(  # noqa: PLR0917 (one run's settings)
    workdir: Path, kube: kube_testing.KubeAPI, setting: str, sends: int, inflight: int, tag: str, edge: str
) -> tuple[float, float, float]:
    brokers, members = start_pair(workdir, kube, setting, tag, edge)
    try:
        membership = mb.Membership.parse(",".join(members))
        names = (f"t{i}" for i in range(100_000))
        lites = [n for n in names if mb.owner(membership, model.QueueId.lmq(PARENT, n).topic) == 0][:50]
        asyncio.run(send_load(members[0], lites, 200, inflight))  # warm-up (and the owner's lease taken)
        cpu0 = sum(cpu_s(b) for b in brokers)
        latencies = asyncio.run(send_load(members[0], lites, sends, inflight))
        cpu = sum(cpu_s(b) for b in brokers) - cpu0
    finally:
        for b in brokers:
            b.stop()
    latencies.sort()
    p50 = statistics.median(latencies) * 1e6
    p99 = latencies[int(len(latencies) * 0.99) - 1] * 1e6
    return p50, p99, cpu / sends * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sends", type=int, default=3000)
    parser.add_argument("--inflight", type=int, default=8)
    parser.add_argument("--configs", default="1,2,2/1,3", help="R or R/M (--min-insync-replicas), comma-separated")
    parser.add_argument("--case", choices=("price", "catch-up"), default="price")
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--edge", choices=("grpcio", "native"), default="native", help="every broker's --edge")
    args = parser.parse_args()
    if args.case == "catch-up":
        with tempfile.TemporaryDirectory() as tmp, kube_testing.testenv(Path(tmp) / "testenv") as kube:
            took, sent = catch_up(Path(tmp), kube, args.messages, args.inflight)
        rate = args.messages / took
        print(f"{args.messages:,} x 1 KiB acknowledged in {sent:.1f} s with the follower away")
        mib = rate / 1024
        print(f"FIGURE catch-up: {args.messages:,} messages in {took:.2f} s: {rate:,.0f} msg/s, {mib:.1f} MiB/s")
        print(f"load average {os.getloadavg()[0]:.1f}")
        return
    rounds, sends = (1, 500) if args.quick else (args.rounds, args.sends)
    settings = args.configs.split(",")
    print(
        f"load average {os.getloadavg()[0]:.1f}; {sends} sends x {rounds} rounds, {args.inflight} in flight, "
        f"{args.edge} edge"
    )
    with tempfile.TemporaryDirectory() as tmp, kube_testing.testenv(Path(tmp) / "testenv") as kube:
        figures: dict[str, list[tuple[float, float, float]]] = {s: [] for s in settings}
        for r in range(rounds):
            for setting in settings:
                tag = f"r{r}-{setting.replace('/', 'm').replace('+', '-')}"
                got = measure(Path(tmp), kube, setting, sends, args.inflight, tag, args.edge)
                figures[setting].append(got)
                print(f"round {r} R={setting}: p50 {got[0]:,.0f} µs  p99 {got[1]:,.0f} µs  CPU {got[2]:,.0f} µs/msg")
        med = {k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in figures.items()}
        base = med.get("1")
        for setting in settings:
            if base is None or setting == "1":
                continue
            for i, name in enumerate(("p50", "p99", "CPU/msg")):
                ratio = med[setting][i] / base[i]
                print(f"FIGURE {name} R={setting} ÷ R=1: {ratio:.2f} ({med[setting][i]:,.0f} vs {base[i]:,.0f} µs)")
        print(f"load average {os.getloadavg()[0]:.1f}; goal: p99 ≤ 2.00, CPU ≤ 1.50")


if __name__ == "__main__":
    main()
