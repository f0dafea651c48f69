"""The cluster's seams in figures (issue 25): how soon a restarted owner holds its consumers' subscriptions again,
and what watching the peers costs an idle broker.

* Restore: three ``--peers`` brokers; a client subscribes (SyncLiteSubscription through broker 0) to lite topics
  broker 2 owns, some of them while broker 2 is down; broker 2 is killed with SIGKILL and restarted; the figure
  is the time from its ready line until broker 2 holds every one of that client's subscriptions again (read
  with GetLiteClient every 20 ms). Goal: <= 3 s (no client action; before issue 25 it waited for the clients'
  30 s resync). The official clients then reconnect on their own gRPC backoff, which no broker shortens.
* Idle CPU: each broker of the idle 3-broker cluster (its peer watch probes every peer once a second) next to
  a broker alone, measured in the same run over the same seconds with psutil.

    python bench/bench_cluster.py           # 5 restarts, 10 s idle
    python bench/bench_cluster.py --quick   # 1 restart, 3 s idle
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import psutil

from lmq_broker import errors, model
from lmq_broker.admin.client import AdminClient
from lmq_broker.cluster import membership as mb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc
from lmq_broker.supervisor import free_ports
from lmq_broker.testing import SHARED_ADMIN_ENV, SHARED_ADMIN_KEYS, BrokerProcess, start_broker

TOPIC, GROUP, CLIENT = "BENCH_NS", "bench-group", "bench-cluster-client"
HEADERS = (("x-mq-client-id", CLIENT), ("x-mq-language", "JAVA"), ("x-mq-client-version", "5.2.0"))
GOAL_S = 3.0


def figure(name: str, value: float, unit: str, extra: str = "") -> None:
    print(f"FIGURE {name}: {value:,.3f} {unit}{extra}", flush=True)


def owned_by(members: list[str], slot: int, prefix: str, count: int) -> list[str]:
    membership = mb.Membership(tuple(members), (len(members),))
    names = (f"{prefix}-{i}" for i in range(100_000))
    return [n for n in names if mb.owner(membership, model.QueueId.lmq(TOPIC, n).topic) == slot][:count]


def subscribe(endpoint: str, lites: list[str]) -> None:
    with grpc.insecure_channel(endpoint) as channel:
        reply = service_pb2_grpc.MessagingServiceStub(channel).SyncLiteSubscription(
            spb.SyncLiteSubscriptionRequest(
                action=pb.PARTIAL_ADD,
                topic=pb.Resource(name=TOPIC),
                group=pb.Resource(name=GROUP),
                lite_topic_set=lites,
            ),
            metadata=HEADERS,
            timeout=30,
        )
    if reply.status.code != pb.OK:
        raise RuntimeError(f"subscribe failed: {reply.status}")


def held_again(endpoint: str, lites: list[str], timeout: float = 60) -> float:
    deadline = time.monotonic() + timeout
    with AdminClient(endpoint, timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
        while time.monotonic() < deadline:
            with contextlib.suppress(errors.NotFound):
                if set(lites) <= set(admin.get_lite_client(CLIENT).lite_topics):
                    return time.monotonic()
            time.sleep(0.02)
    raise RuntimeError(f"subscriptions not back at {endpoint} within {timeout} s")


def cpu_percent(processes: list[psutil.Process], seconds: float) -> list[float]:
    before = [p.cpu_times() for p in processes]
    t0 = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - t0
    after = [p.cpu_times() for p in processes]
    return [100 * ((a.user + a.system) - (b.user + b.system)) / elapsed for a, b in zip(after, before, strict=True)]


def run(tmp: Path, rounds: int, idle_s: float) -> None:
    ports = free_ports("127.0.0.1", 3)
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    brokers: list[BrokerProcess] = []
    alone: BrokerProcess | None = None
    try:
        for i in range(3):
            args = ["--peers", peers, "--ordinal", str(i), "--no-bootstrap"]
            brokers.append(start_broker(tmp / f"b{i}", port=ports[i], extra_args=args, env=SHARED_ADMIN_ENV))
        alone = start_broker(tmp / "alone", extra_args=["--no-bootstrap"], env=SHARED_ADMIN_ENV)
        endpoints = [b.endpoint for b in brokers]
        with AdminClient(endpoints[0], timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
            admin.put_parent_topic(model.ParentTopic(TOPIC, model.MessageType.LITE))
            admin.put_group(model.LiteGroup(GROUP, TOPIC))
        time.sleep(2)  # past start-up work
        processes = [psutil.Process(b.pid) for b in (*brokers, alone)]
        cpu = cpu_percent(processes, idle_s)
        cluster_cpu = statistics.mean(cpu[:3])
        figure(f"idle CPU per broker of a 3-broker cluster over {idle_s:.0f} s", cluster_cpu, "% of a core")
        figure(f"idle CPU of a broker alone, same {idle_s:.0f} s", cpu[3], "% of a core")

        members = [f"127.0.0.1:{p}" for p in ports]
        subscribe(endpoints[0], owned_by(members, 2, "held", 50))
        took: list[float] = []
        for n in range(rounds):
            brokers[2].kill()
            later = owned_by(members, 2, f"late{n}", 10)
            subscribe(endpoints[0], later)  # kept by broker 0, applied when broker 2 answers
            brokers[2] = brokers[2].restart()
            ready = time.monotonic()
            took.append(held_again(endpoints[2], owned_by(members, 2, "held", 50) + later) - ready)
        figure(
            "restarted owner holds its subscriptions again after its readiness, median",
            statistics.median(took),
            "s",
            f" (max {max(took):.3f} s over {rounds} SIGKILL restarts; goal <= {GOAL_S:.0f} s)",
        )
    finally:
        for broker in (*brokers, *([alone] if alone else [])):
            broker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run(Path(tmp), 1 if a.quick else 5, 3.0 if a.quick else 10.0)


if __name__ == "__main__":
    main()
