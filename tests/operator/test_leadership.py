"""Leader election on a real apiserver: of two operator processes only the Lease holder reconciles; the other
stands by and takes over when the first stops (at once after a clean stop, after one lease duration after a
SIGKILL). Both run as a user with only the documented RBAC (the ClusterRole and the Lease Role of
docs/operator.md), so those rules are checked too. The election's decisions on their own: test_pure.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmq_operator import testing

LEASE = "lmq-operator"  # the name docs/operator.md's Role allows
TIMINGS = {  # short, so that the SIGKILL takeover is seconds, not 15 s
    "LMQ_OPERATOR_LEASE_DURATION_SECONDS": "4",
    "LMQ_OPERATOR_LEASE_RENEW_DEADLINE_SECONDS": "3",
    "LMQ_OPERATOR_LEASE_RETRY_SECONDS": "0.5",
}
TIMEOUT_S = 30.0


def reconciled(op: testing.OperatorProcess) -> float:
    """Reconciliations this process ran, of any kind and trigger."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in op.metrics().splitlines()
        if line.startswith("lmq_operator_reconciliations_total{")
    )


def leader_gauge(op: testing.OperatorProcess) -> float:
    [line] = [x for x in op.metrics().splitlines() if x.startswith("lmq_operator_leader ")]
    return float(line.split()[1])


def test_only_the_lease_holder_reconciles_and_a_standby_takes_over(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Callable[..., Any],
    unique: Callable[[str], str],
    brokers: list[Any],
    run_operator: Callable[..., testing.OperatorProcess],
    tmp_path: Path,
    bind_documented_rbac: Callable[..., None],
) -> None:
    bind_documented_rbac(namespace, leader=True)
    kubeconfig = testing.write_kubeconfig(kube, kube.operator_token, tmp_path / "operator.kubeconfig")
    endpoints = [b.admin_endpoint for b in brokers]
    lease_path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{LEASE}"

    def start(name: str) -> testing.OperatorProcess:
        env = {"LMQ_OPERATOR_LEASE_NAME": LEASE, "LMQ_OPERATOR_LEASE_NAMESPACE": namespace, **TIMINGS}
        return run_operator(namespace, endpoints, kubeconfig=kubeconfig, LMQ_OPERATOR_POD_NAME=name, **env)

    def holder() -> str:
        return str(kube.get(lease_path)["spec"].get("holderIdentity") or "") if kube.exists(lease_path) else ""

    def applied(name: str) -> Any:
        path = testing.cr_path("parenttopics", namespace, name)
        conds = (kube.get(path).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    first = start("op-a")
    testing.wait_for(lambda: holder() == "op-a", TIMEOUT_S, "op-a holding the Lease")
    second = start("op-b")  # its liveness endpoint answers while it stands by (start_operator waited for it)
    assert second.healthz() == {"standby": True}
    create("ParentTopic", namespace, "one", {"topicName": unique("one")})
    testing.wait_for(lambda: applied("one"), TIMEOUT_S, "ParentTopic one Ready (op-a leads)")
    testing.wait_for(lambda: "op-a leads; op-b waits as a standby" in second.output(), TIMEOUT_S, "op-b standing by")
    time.sleep(2.0)  # several renewals and standby attempts: the standby must stay idle through them
    assert holder() == "op-a"
    assert (leader_gauge(first), leader_gauge(second)) == (1.0, 0.0)
    assert reconciled(first) >= 1 and reconciled(second) == 0
    assert "kopf" not in second.output()  # a standby never started kopf: no watch, no handler, no Event

    first.stop()  # SIGTERM: kopf stops, the Lease is released
    released_at = time.monotonic()
    testing.wait_for(lambda: holder() == "op-b", TIMEOUT_S, "op-b taking the released Lease")
    assert time.monotonic() - released_at < 4.0  # well within one lease duration: it did not wait for expiry
    lease = kube.get(lease_path)["spec"]
    assert lease["leaseTransitions"] >= 1 and lease["leaseDurationSeconds"] == 4
    create("ParentTopic", namespace, "two", {"topicName": unique("two")})
    testing.wait_for(lambda: applied("two"), TIMEOUT_S, "ParentTopic two Ready (op-b leads)")
    testing.wait_for(lambda: leader_gauge(second) == 1.0 and reconciled(second) >= 1, TIMEOUT_S, "op-b reconciling")
    assert "released lease" in first.output()

    third = start("op-c")
    testing.wait_for(lambda: "op-b leads; op-c waits as a standby" in third.output(), TIMEOUT_S, "op-c standing by")
    second.kill()  # SIGKILL: nobody releases; op-c must wait until the Lease has not been renewed for 4 s
    killed_at = time.monotonic()
    testing.wait_for(lambda: holder() == "op-c", TIMEOUT_S, "op-c taking the expired Lease")
    waited = time.monotonic() - killed_at
    assert waited >= 4.0 - 0.5 - 0.3, waited  # a lease duration after the last renewal op-c saw (<= 1 retry ago)
    create("ParentTopic", namespace, "three", {"topicName": unique("three")})
    testing.wait_for(lambda: applied("three"), TIMEOUT_S, "ParentTopic three Ready (op-c leads)")
    assert reconciled(third) >= 1
