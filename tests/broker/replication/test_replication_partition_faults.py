"""Partitions other than the owner's (docs/replication.md, *Failover and rejoin*), with real network namespaces,
broker processes and a real kube-apiserver + etcd, a client sending all along (``steady_sender``):

* a **follower alone** cut from its peers and the apiserver (its namespace's end of the veth pair down): at R = 3,
  M = 2 the owner records it out of the slot's in-sync set and goes on acknowledging with the other follower; at
  R = 2, M = 2 that would go below M, so every send is refused (never acknowledged with fewer replicas: a silent
  downgrade). After the heal it catches up, rejoins the set, and every replica holds every acknowledged send
  once and in order.
* the **apiserver alone** cut off: every broker and the client inside the namespace (they still call each other
  on 127.0.0.1), the apiserver on this host. Nobody can renew a lease, so the holder stops acknowledging once its
  lease could have expired (fencing: nothing acknowledged from the lease deadline until the heal), nothing
  acknowledged is lost, and sends are acknowledged again once the apiserver is back.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
from netns import Namespace
from partitions import LEASE_MS, LEASE_S, Ring
from steady_sender import Attempt, Sender, ids
from waiting import eventually

from lmq_operator import testing as kube_testing

HEAL_BUDGET_S = 30.0


@pytest.fixture(scope="module")
def kube_reachable_at(namespace: Namespace) -> tuple[str, ...]:
    return (namespace.host_ip,)  # brokers inside call the apiserver over the veth pair


def settled(ring: Ring) -> None:
    everyone = tuple(range(len(ring.members)))
    eventually(lambda: ring.in_sync() == everyone, "the followers probed into the in-sync set", ignoring=(OSError,))
    eventually(ring.followers_reconciled, "the followers reconciled with the owner", ignoring=(OSError,))


def refused_insync(ring: Ring) -> float:
    """The owner's ``lmq_replication_refused_total{reason="insync"}``."""
    for line in ring.metrics(0).splitlines():
        if line.startswith('lmq_replication_refused_total{reason="insync"}'):
            return float(line.split(" ")[1])
    return 0.0


def check_stores(ring: Ring, lite: str, acked: list[str]) -> list[int]:
    """Every replica (brokers stopped) holds every acknowledged send once and in order; their record counts."""
    counts = []
    for slot in range(len(ring.members)):
        found = ring.held(slot, lite)
        seen = Counter(found)
        assert [m for m in found if m in set(acked)] == acked, f"replica {slot}: an acknowledged send lost or moved"
        assert all(seen[m] == 1 for m in acked), f"replica {slot}: an acknowledged send stored twice"
        counts.append(len(found))
    return counts


@pytest.mark.parametrize(("replicas", "partitioned"), [(3, 2), (2, 1)], ids=["R3-M2-removed", "R2-M2-refused"])
def test_a_partitioned_follower_leaves_the_in_sync_set_or_sends_are_refused_and_it_rejoins_after_the_heal(
    tmp_path: Path, kube: kube_testing.KubeAPI, namespace: Namespace, replicas: int, partitioned: int
) -> None:
    tag = f"[R={replicas} M=2, follower {partitioned} cut]"
    ring = Ring.start(
        namespace, kube, tmp_path, replicas, 2, inside=frozenset({partitioned}), prefix=f"follower-r{replicas}"
    )
    lite = ring.lite()
    sender: Sender | None = None
    cut = healed = 0.0
    try:
        settled(ring)
        sender = Sender(tmp_path / "sends.jsonl", lite, "s", [ring.members[0]], timeout_s=10)
        eventually(lambda: len(sender.acked()) >= 20, "sends acknowledged before the cut")
        refused_before = refused_insync(ring)
        namespace.cut()
        cut = time.monotonic()
        if replicas > 2:
            rest = tuple(s for s in range(replicas) if s != partitioned)
            eventually(lambda: ring.in_sync() == rest, "the owner recorded the cut follower out of the set", 30)
            print(f"\n{tag} recorded out of the in-sync set {time.monotonic() - cut:.2f} s after the cut")
            out = len(sender.acked())
            eventually(lambda: len(sender.acked()) >= out + 20, "sends acknowledged without the cut follower", 30)
        else:
            eventually(
                lambda: sum(1 for a in sender.attempts() if a.start > cut and "in-sync replicas" in a.why) >= 3,
                "sends refused for too few in-sync replicas",
                timeout_s=40,
            )
            assert ring.in_sync() == (0, 1), "the set was written below --min-insync-replicas"
            assert refused_insync(ring) >= refused_before + 3
        namespace.heal()
        healed = time.monotonic()
        everyone = tuple(range(replicas))
        eventually(
            lambda: ring.in_sync() == everyone, "the follower rejoined the set", HEAL_BUDGET_S, ignoring=(OSError,)
        )
        in_set = time.monotonic() - healed
        first = eventually(lambda: next((a for a in sender.acked() if a.start > healed), None), "a send after the heal")
        assert first is not None
        print(
            f"{tag} in the in-sync set {in_set:.2f} s after the heal{'' if replicas > 2 else ' (never out: M = 2)'}; "
            f"first send "
            f"acknowledged {first.end - healed:.2f} s after it"
        )
        back = len(sender.acked())
        eventually(lambda: len(sender.acked()) >= back + 10, "sends acknowledged with the follower back", 30)
    finally:
        tried = sender.stop() if sender is not None else []
        namespace.heal()  # the next test starts joined
        ring.stop()
    during = [a for a in tried if a.ok and cut < a.start and a.end < healed]
    if replicas == 2:  # the only follower was cut: an acknowledgement then would be the owner's alone
        assert not during, f"{len(during)} sends acknowledged by the owner alone during the cut"
    counts = check_stores(ring, lite, ids(tried))
    print(
        f"{tag} {len(ids(tried))} sends acknowledged of {len(tried)} tried, {len(during)} during the cut; "
        f"records per replica {counts}"
    )


def test_with_the_apiserver_cut_off_holders_stop_acknowledging_at_their_lease_deadline_and_resume_after_it(
    tmp_path: Path, kube: kube_testing.KubeAPI, namespace: Namespace
) -> None:
    tag = "[R=2 M=2, apiserver cut]"
    ring = Ring.start(namespace, kube, tmp_path, 2, 2, inside=frozenset({0, 1}), prefix="apiserver")
    lite = ring.lite()
    sender: Sender | None = None
    cut = cut_began = deadline = healed = 0.0
    try:
        settled(ring)
        # The client inside calls both brokers in turn: one forwards to the other, as a Service would route.
        endpoints = [f"127.0.0.1:{ring.port(s)}" for s in (0, 1)]
        sender = Sender(tmp_path / "sends.jsonl", lite, "s", endpoints, wrapper=namespace.wrapper, timeout_s=10)
        eventually(lambda: len(sender.acked()) >= 20, "sends acknowledged before the cut")
        cut_began = time.monotonic()
        namespace.cut()
        cut = time.monotonic()
        deadline = cut + LEASE_S  # the holder's last renewal began before the cut
        eventually(
            lambda: sum(1 for a in sender.attempts() if a.start > deadline + 2 * LEASE_S) >= 3,
            "sends tried well past every lease's deadline",
            timeout_s=30,
        )
        namespace.heal()
        healed = time.monotonic()

        def resumed() -> Attempt | None:
            return next((a for a in sender.acked() if a.start > healed), None)

        first = eventually(resumed, "a send acknowledged after the heal", HEAL_BUDGET_S)
        assert first is not None
        print(f"\n{tag} first send acknowledged {first.end - healed:.2f} s after the heal")
        after = len(sender.acked())
        eventually(lambda: len(sender.acked()) >= after + 10, "sends acknowledged after the heal", 30)
    finally:
        tried = sender.stop() if sender is not None else []
        namespace.heal()
        ring.stop()
    late = [a for a in tried if a.ok and a.end > deadline and a.start < healed]
    last = max((a.end for a in tried if a.ok and a.start < healed), default=0.0)
    fenced = [a for a in tried if deadline < a.start < healed]
    print(
        f"{tag} cut in {cut - cut_began:.3f} s; last acknowledgement before the heal {last - cut:+.3f} s from the "
        f"cut (lease {LEASE_MS} ms); {len(fenced)} sends tried between the lease deadline and the heal, "
        f"{sum(1 for a in fenced if 'does not hold the lease' in a.why)} refused as fenced"
    )
    assert not late, f"{len(late)} sends acknowledged past the holder's lease deadline with the apiserver cut off"
    assert fenced and all("does not hold the lease" in a.why or not a.ok for a in fenced)
    counts = check_stores(ring, lite, ids(tried))
    print(f"{tag} {len(ids(tried))} sends acknowledged of {len(tried)} tried; records per replica {counts}")
