"""The RBAC written in docs/operator.md is enough: the operator runs as a user bound to exactly that
ClusterRole (no other permission) and still discovers brokers, applies, reports status, posts Events and
deletes. The chart's ClusterRole is meant to match this document."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmq_operator import testing

TIMEOUT_S = 30.0


def test_documented_rules_are_least_privilege(documented_role: Callable[[str], dict[str, Any]]) -> None:
    rules = documented_role("rbac")["rules"]
    verbs = {v for r in rules for v in r["verbs"]}
    assert verbs <= {"get", "list", "watch", "patch", "create"}  # never update/delete/deletecollection or "*"
    lmq = [r for r in rules if r["apiGroups"] == ["lmq.io"]]
    assert all("create" not in r["verbs"] for r in lmq)  # the operator never creates resources or writes spec
    assert not any("*" in r["resources"] or "*" in r["apiGroups"] for r in rules)
    # leader election: Leases only; reading and renewing (update) limited to the operator's own one
    leader = documented_role("rbac-leader")["rules"]
    assert all(r["apiGroups"] == ["coordination.k8s.io"] and r["resources"] == ["leases"] for r in leader)
    assert {v for r in leader for v in r["verbs"]} == {"create", "get", "update"}
    assert all(r.get("resourceNames") for r in leader if set(r["verbs"]) & {"get", "update"})


def test_operator_runs_with_exactly_the_documented_rbac(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Callable[..., Any],
    unique: Callable[[str], str],
    run_operator: Callable[..., testing.OperatorProcess],
    start_broker: Callable[..., Any],
    tmp_path: Path,
    bind_documented_rbac: Callable[..., None],
) -> None:
    bind_documented_rbac(namespace)
    ip = testing.host_ip()
    pods = [start_broker(f"rbac{i}", extra=("--host", "0.0.0.0")) for i in range(2)]
    testing.publish_brokers(kube, namespace, "lmq-broker", [(ip, p.port) for p in pods], replicas=2)
    kubeconfig = testing.write_kubeconfig(kube, kube.operator_token, tmp_path / "operator.kubeconfig")
    run_operator(
        namespace,
        None,
        kubeconfig=kubeconfig,
        LMQ_OPERATOR_BROKER_SERVICE="lmq-broker",
        LMQ_OPERATOR_BROKER_NAMESPACE=namespace,
        LMQ_OPERATOR_BROKER_STATEFULSET="lmq-broker",
    )
    topic = unique("rbac")
    create("ParentTopic", namespace, "rbac", {"topicName": topic})
    path = testing.cr_path("parenttopics", namespace, "rbac")

    def applied() -> Any:
        obj = kube.get(path)
        conds = (obj.get("status") or {}).get("conditions") or []
        ok = any(c["type"] == "Ready" and c["status"] == "True" for c in conds)
        return obj if ok and obj["status"].get("brokersReady") == "2/2" else None

    try:
        obj = testing.wait_for(applied, TIMEOUT_S, "Ready with the documented RBAC")
    except TimeoutError:
        raise AssertionError(f"not Ready with the documented RBAC: {kube.get(path)}") from None
    assert obj["metadata"]["finalizers"] == ["lmq.io/finalizer"]

    def event_posted() -> bool:
        items = kube.get(f"/api/v1/namespaces/{namespace}/events")["items"]
        return any(e["involvedObject"]["name"] == "rbac" and e["reason"] == "Created" for e in items)

    testing.wait_for(event_posted, TIMEOUT_S, "Created event posted by the operator user")

    # An LmqUser: its Secret is read with the documented `get` alone (no list, no watch of Secrets).
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "rbac-user"}}
    kube.post(f"/api/v1/namespaces/{namespace}/secrets", {**secret, "stringData": {"secretKey": "rbac-secret-1"}})
    user = unique("rbac-user")
    create("LmqUser", namespace, "rbac-user", {"userName": user, "secretRef": {"name": "rbac-user"}})
    user_path = testing.cr_path("lmqusers", namespace, "rbac-user")

    def user_applied() -> bool:
        conds = (kube.get(user_path).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Ready" and (c["status"], c["reason"]) == ("True", "Applied") for c in conds)

    try:
        testing.wait_for(user_applied, TIMEOUT_S, "LmqUser Ready with the documented RBAC")
    except TimeoutError:
        raise AssertionError(f"LmqUser not Ready with the documented RBAC: {kube.get(user_path)}") from None
    kube.delete(user_path)
    testing.wait_for(lambda: not kube.exists(user_path), TIMEOUT_S, "LmqUser deleted with the documented RBAC")
    kube.delete(path)
    testing.wait_for(lambda: not kube.exists(path), TIMEOUT_S, "deleted with the documented RBAC")
