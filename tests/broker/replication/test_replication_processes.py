"""Replication with ``serve --processes 2`` pods (docs/replication.md, *Failover and rejoin*): two pods of two
broker processes each (four ring slots, pod-major: pod 0 serves slots 0 and 1, pod 1 slots 2 and 3) on a real
kube-apiserver + etcd, --replicas 2. A slot's follower is the same process of the next pod, never the other
process of its own pod, so when every process of pod 0 is killed with -9 (a pod lost, not one process its
supervisor restarts) pod 1's processes take slots 0 and 1 over, and no acknowledged send is lost.

Before the supervisor passed ``--pod-processes`` to its processes, each took its pod for a pod of one process and
slot 0's follower was slot 1, on the same pod: killing the pod left slots 0 and 1 with nobody to take them over.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from partitions import held
from pods import child_pid, free_block
from steady_sender import Sender, ids
from waiting import eventually

from lmq_broker import model, testing
from lmq_broker.cluster import membership as mb
from lmq_broker.cluster import ring
from lmq_broker.replication import kube as kube_api
from lmq_operator import testing as kube_testing

PARENT = "AGENT_TASK_NS"  # the bootstrap parent (LITE)
LEASE_MS = 1500
PREFIX = "procs"
PROCESSES = 2
FAILOVER_BUDGET_S = 5.0  # the issue: a follower takes over within 5 s of the lease's expiry
PROCESS_LINE = re.compile(r"lmq-broker process (\d+) grpc=\S+ metrics=(\d+)")


def start_pod(tmp_path: Path, kube: kube_testing.KubeAPI, bases: list[int], ordinal: int) -> testing.BrokerProcess:
    token = tmp_path / "token"
    token.write_text(kube.token)
    flags = ["--processes", str(PROCESSES), "--peers", ",".join(f"127.0.0.1:{b}" for b in bases)]
    flags += ["--ordinal", str(ordinal), "--admin-access-key", "ak", "--admin-secret-key", "sk"]
    flags += ["--flush-mode", "sync", "--replicas", "2", "--lease-namespace", "default", "--lease-prefix", PREFIX]
    flags += ["--lease-duration-ms", str(LEASE_MS), "--kube-api-server", kube.server]
    flags += ["--kube-token-file", str(token), "--kube-ca-file", str(kube.ca_file)]
    return testing.start_broker(tmp_path / f"pod{ordinal}", bases[ordinal], flags)


def metrics_ports(pod: testing.BrokerProcess) -> list[int]:
    """Each process's metrics port, from the lines its supervisor printed at its (last) start."""
    found = dict(PROCESS_LINE.findall(pod.log()))
    return [int(found[str(i)]) for i in range(PROCESSES)]


def in_sync_everywhere(pods: list[testing.BrokerProcess]) -> bool:
    """Every process says it is in sync with the holder of each slot it follows (``lmq_replication_in_sync``)."""
    for pod in pods:
        for port in metrics_ports(pod):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                text = response.read().decode()
            if re.search(r'^lmq_replication_in_sync\{slot="\d+"\} 0\.0$', text, re.MULTILINE):
                return False
    return True


def owner(membership: mb.Membership, lite: str) -> int:
    return mb.owner(membership, model.QueueId.lmq(PARENT, lite).topic)


def test_a_lost_processes_2_pod_fails_over_to_the_same_processes_of_the_next_pod(
    tmp_path: Path, kube: kube_testing.KubeAPI
) -> None:
    bases = [free_block(PROCESSES + 1) for _ in range(2)]
    slots = [f"127.0.0.1:{ring.process_port(b, i)}" for b in bases for i in range(PROCESSES)]
    membership = mb.Membership.parse(",".join(slots))
    lites = [next(f"p{s}-{i}" for i in range(1000) if owner(membership, f"p{s}-{i}") == s) for s in (0, 1)]
    api = kube_api.ApiServer(kube.server, kube.token, kube.ca_file, "default")

    def lease(slot: int) -> kube_api.Lease | None:
        return api.get(f"{PREFIX}-slot-{slot}")

    pods = [start_pod(tmp_path, kube, bases, ordinal) for ordinal in (0, 1)]
    senders: list[Sender] = []
    try:
        # Follower of slot s: slot s + 2, the same process of the other pod.
        want = {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}
        eventually(
            lambda: all((got := lease(s)) is not None and got.in_sync == want[s] for s in range(4)),
            "every slot's follower (the same process of the other pod) probed into its in-sync set",
            timeout_s=60,  # four processes per pod starting beside the other suites' workers
            ignoring=(OSError,),
        )
        eventually(lambda: in_sync_everywhere(pods), "every follower reconciled", timeout_s=60, ignoring=(OSError,))
        # The clients call pod 1's shared port, as a Service would route them; each send is forwarded to its owner.
        access = f"127.0.0.1:{bases[1]}"
        for lite in lites:
            senders.append(Sender(tmp_path / f"{lite}.jsonl", lite, lite, [access], timeout_s=10))
        eventually(lambda: all(len(s.acked()) >= 20 for s in senders), "sends acknowledged by pod 0's processes")
        victims = [child_pid(pods[0], slot) for slot in (0, 1)]
        assert None not in victims
        os.kill(pods[0].pid, signal.SIGKILL)  # the supervisor first: it would start its processes again
        for pid in victims:
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        pods[0].kill()

        def taken() -> bool:
            found = [lease(s) for s in (0, 1)]
            return all(got is not None and got.holder.startswith(f"slot-{s + 2}/") for s, got in enumerate(found))

        eventually(taken, "pod 1's processes took slots 0 and 1 over", timeout_s=30, ignoring=(OSError,))
        failover_s = time.monotonic() - killed
        print(f"\n--processes {PROCESSES}: slots 0 and 1 taken by slots 2 and 3 {failover_s:.2f} s after kill -9")
        assert failover_s <= LEASE_MS / 1000 + FAILOVER_BUDGET_S
        # At --min-insync-replicas 2 the new holders refuse sends until pod 0 is back: it rejoins on its disk.
        pods[0] = pods[0].restart()
        after = [len(s.acked()) for s in senders]
        eventually(
            lambda: all(len(s.acked()) >= n + 10 for s, n in zip(senders, after, strict=True)),
            "sends acknowledged again with pod 0 back as the follower",
            timeout_s=60,
        )
    finally:
        attempts = [s.stop() for s in senders]
        for pod in pods:
            pod.stop()
    for process, (lite, tried) in enumerate(zip(lites, attempts, strict=True)):
        acked = ids(tried)
        for ordinal in (0, 1):  # slot ``process`` and its follower: process ``process`` of either pod
            found = held(tmp_path / f"pod{ordinal}" / f"p{process}", lite)
            counts = Counter(found)
            assert [m for m in found if m in set(acked)] == acked, f"pod {ordinal}: {lite} lost or out of order"
            assert all(counts[m] == 1 for m in acked), f"pod {ordinal}: {lite} stored twice"
        print(f"{lite}: {len(acked)} sends acknowledged of {len(tried)} tried, on both replicas once and in order")


@pytest.mark.parametrize(("pods", "replicas"), [(1, 2), (2, 3)])
def test_a_processes_pod_with_more_replicas_than_pods_is_refused_at_start(
    tmp_path: Path, pods: int, replicas: int
) -> None:
    """A pod's processes never follow each other: R replicas need R pods, whatever the processes per pod."""
    flags = ["--processes", "2", "--replicas", str(replicas), "--lease-namespace", "default"]
    flags += ["--admin-access-key", "ak", "--admin-secret-key", "sk", "--data-dir", str(tmp_path / "d"), "--port", "0"]
    if pods > 1:
        flags += ["--peers", ",".join(f"127.0.0.1:{free_block(3)}" for _ in range(pods)), "--ordinal", "0"]
    env = {**os.environ, "PYTHONPATH": str(Path(testing.__file__).parents[1])}
    command = [sys.executable, "-m", "lmq_broker", "serve", *flags]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode != 0
    assert f"--replicas {replicas} needs at least {replicas} pods, the ring has {pods}" in done.stderr
    assert not (tmp_path / "d").exists()  # refused before any process started
