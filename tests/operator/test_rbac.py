"""The RBAC written in docs/operator.md is enough: the operator runs as a user bound to exactly that
ClusterRole (no other permission) and still discovers brokers, applies, reports status, posts Events and
deletes. The chart's ClusterRole is meant to match this document."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from lmq_operator import testing

DOC = testing.REPO / "docs" / "operator.md"
TIMEOUT_S = 30.0


def documented_cluster_role() -> dict[str, Any]:
    text = DOC.read_text()
    block = re.search(r"<!-- rbac:begin -->\s*```yaml\n(.*?)```\s*<!-- rbac:end -->", text, re.S)
    assert block is not None, "docs/operator.md lost its rbac block"
    role: dict[str, Any] = yaml.safe_load(block.group(1))
    assert role["kind"] == "ClusterRole"
    return role


def test_documented_rules_are_least_privilege() -> None:
    rules = documented_cluster_role()["rules"]
    verbs = {v for r in rules for v in r["verbs"]}
    assert verbs <= {"get", "list", "watch", "patch", "create"}  # never update/delete/deletecollection or "*"
    lmq = [r for r in rules if r["apiGroups"] == ["lmq.io"]]
    assert all("create" not in r["verbs"] for r in lmq)  # the operator never creates resources or writes spec
    assert not any("*" in r["resources"] or "*" in r["apiGroups"] for r in rules)


def test_operator_runs_with_exactly_the_documented_rbac(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Callable[..., Any],
    unique: Callable[[str], str],
    run_operator: Callable[..., testing.OperatorProcess],
    start_broker: Callable[..., Any],
    tmp_path: Path,
) -> None:
    role = documented_cluster_role()
    role["metadata"]["name"] = f"lmq-operator-{namespace}"
    kube.post("/apis/rbac.authorization.k8s.io/v1/clusterroles", role)
    kube.post(
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": f"lmq-operator-{namespace}"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": role["metadata"]["name"],
            },
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": testing.OPERATOR_USER}],
        },
    )
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
    kube.delete(path)
    testing.wait_for(lambda: not kube.exists(path), TIMEOUT_S, "deleted with the documented RBAC")
