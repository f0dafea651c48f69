"""Replication in the chart (docs/replication.md, Operator and chart), rendered at R=1 and R=2: the brokers'
flags and the Lease they name, the token and the Role with exactly the verbs the brokers use on Leases, the
operator told the same R, and the spread that keeps a slot's replicas on other nodes and zones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import helm_python as helm
import pytest

Manifest = dict[str, Any]
Render = Callable[..., list[Manifest]]
One = Callable[..., Manifest]
BROKER = "demo-lmq-broker"
OPERATOR = "demo-lmq-operator"
LEASE_ROLE = f"{BROKER}-leases"
REPLICATION_FLAGS = (
    "--replicas",
    "--min-insync-replicas",
    "--replica-lag-max-ms",
    "--lease-namespace",
    "--lease-prefix",
    "--lease-duration-ms",
    "--replica-port",
)


def pod(objects: list[Manifest], one: One) -> dict[str, Any]:
    spec: dict[str, Any] = one(objects, "StatefulSet", BROKER)["spec"]["template"]["spec"]
    return spec


def flags(args: list[str]) -> dict[str, str]:
    return {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--") and i + 1 < len(args)}


def operator_env(objects: list[Manifest], one: One) -> dict[str, str]:
    container = one(objects, "Deployment", OPERATOR)["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", "") for e in container["env"]}


def test_replicas_null_replicates_two_pods_twice_with_the_release_lease(render: Render, one: One) -> None:
    default = pod(render({}), one)["containers"][0]["args"]  # the chart's default: null (docs/replication.md)
    assert default[default.index("--replicas") + 1] == "2"
    objects = render({"broker": {"replication": {"replicas": None}}})  # null: 2 with broker.replicas 2
    spec = pod(objects, one)
    broker = spec["containers"][0]
    given = flags(broker["args"])
    assert given["--replicas"] == "2"
    assert given["--lease-namespace"] == "$(POD_NAMESPACE)" and given["--lease-prefix"] == "demo-lmq"
    assert given["--lease-duration-ms"] == "6000"
    assert given["--replica-port"] == "8090"  # the copy socket, admitted from this release's brokers only
    policy = one(objects, "NetworkPolicy", BROKER)
    (copies,) = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 8090]
    assert copies["ports"] == [{"port": 8090, "protocol": "TCP"}]
    assert [f["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for f in copies["from"]] == ["broker"]
    four = one(render({"broker": {"processes": 4, "replication": {"replicas": None}}}), "NetworkPolicy", BROKER)
    assert {"port": 8091, "endPort": 8094, "protocol": "TCP"} in [r["ports"][0] for r in four["spec"]["ingress"]]
    assert "--min-insync-replicas" not in given  # 0: every replica (the broker's default)
    namespace = {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}
    assert namespace in broker["env"]
    assert spec["automountServiceAccountToken"] is True  # the Lease calls use the pod's own token
    env = operator_env(objects, one)
    assert env["LMQ_OPERATOR_BROKER_REPLICATION"] == "2" and env["LMQ_OPERATOR_SLOT_LEASE_PREFIX"] == "demo-lmq"


def test_one_pod_or_r_1_has_no_replication_no_token_and_no_lease_role(render: Render, one: One) -> None:
    for values in (
        {"broker": {"replicas": 1}},
        {"broker": {"replicas": 1, "replication": {"replicas": None}}},
        {"broker": {"replication": {"replicas": 1}}},
    ):
        objects = render(values)
        spec = pod(objects, one)
        args = spec["containers"][0]["args"]
        assert not set(REPLICATION_FLAGS) & set(args), values
        assert spec["automountServiceAccountToken"] is False
        assert "POD_NAMESPACE" not in {e["name"] for e in spec["containers"][0]["env"]}
        assert not [o for o in objects if o["metadata"]["name"] == LEASE_ROLE]
        assert operator_env(objects, one)["LMQ_OPERATOR_BROKER_REPLICATION"] == "1"


def test_the_brokers_get_exactly_the_lease_verbs_docs_replication_md_names(render: Render, one: One) -> None:
    objects = render({"broker": {"replicas": 3, "replication": {"replicas": 3, "minInsyncReplicas": 1,
                                                                  "replicaLagMaxMs": 0}}})  # fmt: skip
    role = one(objects, "Role", LEASE_ROLE)
    assert role["metadata"]["namespace"] == "mq"
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "list", "create", "update"]}
    ]
    binding = one(objects, "RoleBinding", LEASE_ROLE)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": LEASE_ROLE}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": BROKER, "namespace": "mq"}]
    given = flags(pod(objects, one)["containers"][0]["args"])
    assert (given["--replicas"], given["--min-insync-replicas"], given["--replica-lag-max-ms"]) == ("3", "1", "0")
    default = flags(
        pod(render({"broker": {"replicas": 3, "replication": {"replicas": 3}}}), one)["containers"][0]["args"]
    )
    assert "--replica-lag-max-ms" not in default  # null: the broker's default
    # the operator reads the slots' Leases (list only) for the status
    brokers_role = one(objects, "Role", f"{OPERATOR}-brokers")
    assert {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["list"]} in brokers_role["rules"]


def test_replicas_of_a_slot_land_on_other_nodes_and_zones(render: Render, one: One) -> None:
    spec = pod(render(), one)
    term = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert [c["topologyKey"] for c in spec["topologySpreadConstraints"]] == ["topology.kubernetes.io/zone"]
    hard = pod(render({"broker": {"podAntiAffinityPreset": "hard"}}), one)
    assert "requiredDuringSchedulingIgnoredDuringExecution" in hard["affinity"]["podAntiAffinity"]


def test_more_replicas_than_pods_is_refused_before_anything_is_rendered(render: Render) -> None:
    with pytest.raises(helm.HelmRenderError, match=r"broker\.replication\.replicas 3 needs at least 3 broker pods"):
        render({"broker": {"replicas": 2, "replication": {"replicas": 3}}})
