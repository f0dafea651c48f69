"""The chart's side of scale-out: the wanted pod count the operator follows, the first membership every broker
pod starts with, processes per pod, and what the operator needs to be the brokers' membership source."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Manifest = dict[str, Any]
Render = Callable[..., list[Manifest]]

BROKER, HEADLESS = "demo-lmq-broker", "demo-lmq-broker-headless"
DOMAIN = f"{HEADLESS}.mq.svc.cluster.local"


def find(objects: list[Manifest], kind: str, name: str) -> list[Manifest]:
    return [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]


def _sts(objects: list[Manifest]) -> Manifest:
    (sts,) = find(objects, "StatefulSet", BROKER)
    return sts


def _broker(objects: list[Manifest]) -> dict[str, Any]:
    (container,) = _sts(objects)["spec"]["template"]["spec"]["containers"]
    found: dict[str, Any] = container
    return found


def _peers(objects: list[Manifest]) -> dict[str, str]:
    (cm,) = find(objects, "ConfigMap", f"{BROKER}-peers")
    data: dict[str, str] = cm["data"]
    return data


def test_replicas_is_the_annotation_and_the_first_membership(render: Render) -> None:
    objects = render()
    sts = _sts(objects)
    assert (sts["spec"]["replicas"], sts["metadata"]["annotations"]["lmq.io/replicas"]) == (2, "2")
    assert _peers(objects) == {
        "LMQ_PEERS": f"{BROKER}-0.{DOMAIN}:8081,{BROKER}-1.{DOMAIN}:8081",
        "LMQ_RING_HISTORY": "",
    }
    objects = render({"broker": {"replicas": 3}})
    assert (_sts(objects)["spec"]["replicas"], _sts(objects)["metadata"]["annotations"]["lmq.io/replicas"]) == (3, "3")
    assert _peers(objects)["LMQ_PEERS"].split(",") == [f"{BROKER}-{i}.{DOMAIN}:8081" for i in range(3)]
    # without the operator nobody follows the annotation: spec.replicas is the value
    objects = render({"broker": {"replicas": 4}, "operator": {"enabled": False}})
    assert _sts(objects)["spec"]["replicas"] == 4 and len(_peers(objects)["LMQ_PEERS"].split(",")) == 4


def test_each_broker_knows_its_own_place_in_the_peers(render: Render) -> None:
    broker = _broker(render())
    args = broker["args"]
    assert args[args.index("--advertised-address") + 1] == f"$(POD_NAME).{DOMAIN}:8081"
    # the peers' endpoints are the advertised ones, so each pod finds itself in them
    assert args[args.index("--advertised-host") + 1] + ":8081" == args[args.index("--advertised-address") + 1]
    assert [e["configMapRef"]["name"] for e in broker["envFrom"]] == [f"{BROKER}-peers", "demo-lmq-broker-membership"]
    assert "--processes" not in args


def test_processes_per_pod(render: Render) -> None:
    objects = render({"broker": {"processes": 3}})
    broker = _broker(objects)
    args = broker["args"]
    assert args[args.index("--processes") + 1] == "3"
    assert "--admin-port" not in args  # each process serves admin on its own port
    ports = {p["name"]: p["containerPort"] for p in broker["ports"]}
    assert ports == {
        "grpc": 8081,
        "admin": 8082,
        "proc-1": 8083,
        "proc-2": 8084,
        "metrics": 9101,
        "metrics-1": 9102,
        "metrics-2": 9103,
    }
    (operator,) = find(objects, "Deployment", "demo-lmq-operator")
    env = {e["name"]: e.get("value") for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["LMQ_OPERATOR_BROKER_PROCESSES"] == "3"
    assert env["LMQ_OPERATOR_BROKER_ADDRESS"] == "{pod}." + DOMAIN + ":8081"
    # the peers stay one per pod; the brokers expand them into slots (pod-major)
    assert len(_peers(objects)["LMQ_PEERS"].split(",")) == 2


def test_network_policy_opens_the_process_ports(render: Render) -> None:
    # R = 1: the copy socket's ports have their own test (test_replication.py)
    (policy,) = find(render({"broker": {"replication": {"replicas": 1}}}), "NetworkPolicy", BROKER)
    assert [r["ports"] for r in policy["spec"]["ingress"]] == [
        [{"port": 8081, "protocol": "TCP"}],
        [{"port": 8082, "protocol": "TCP"}],
        [{"port": 9100, "protocol": "TCP"}],
    ]
    (policy,) = find(render({"broker": {"processes": 4, "replication": {"replicas": 1}}}), "NetworkPolicy", BROKER)
    ingress = policy["spec"]["ingress"]
    assert [r["ports"] for r in ingress] == [
        [{"port": 8081, "protocol": "TCP"}],
        [{"port": 8082, "endPort": 8085, "protocol": "TCP"}],
        [{"port": 9101, "endPort": 9104, "protocol": "TCP"}],
    ]
    assert "from" not in ingress[0] and "from" not in ingress[2]  # clientFrom, metricsFrom empty: everyone
    assert ingress[1]["from"]  # the processes' ports serve admin too: never open to every pod


def _admin_rule(policy: Manifest) -> dict[str, Any]:
    (rule,) = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 8082]
    found: dict[str, Any] = rule
    return found


ADMIN_FROM = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}, "podSelector": {}}]


def test_admin_ports_admit_the_same_pods_with_one_process_and_with_two(render: Render) -> None:
    for extra in ({}, {"adminFrom": ADMIN_FROM}):
        one_process = _admin_rule(find(render({"networkPolicy": extra}), "NetworkPolicy", BROKER)[0])
        values = {"broker": {"processes": 2}, "networkPolicy": extra}
        two_processes = _admin_rule(find(render(values), "NetworkPolicy", BROKER)[0])
        assert two_processes["ports"] == [{"port": 8082, "endPort": 8083, "protocol": "TCP"}]
        assert one_process["from"] and two_processes["from"] == one_process["from"]
        components = [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in one_process["from"][:5]]
        assert components == ["operator", "reclaim", "backup", "test", "broker"]
        assert one_process["from"][5:] == extra.get("adminFrom", [])
    # clientFrom adds the client pods to the processes' ports (they are in routes), not to the one-process admin port
    clients = [{"namespaceSelector": {"matchLabels": {"team": "a"}}}]
    one_process = _admin_rule(find(render({"networkPolicy": {"clientFrom": clients}}), "NetworkPolicy", BROKER)[0])
    values = {"broker": {"processes": 2}, "networkPolicy": {"clientFrom": clients}}
    two_processes = _admin_rule(find(render(values), "NetworkPolicy", BROKER)[0])
    assert two_processes["from"] == clients + one_process["from"]


def test_operator_manages_the_membership(render: Render) -> None:
    objects = render()
    (operator,) = find(objects, "Deployment", "demo-lmq-operator")
    env = {e["name"]: e.get("value") for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["LMQ_OPERATOR_BROKER_MEMBERSHIP"] == "demo-lmq-broker-membership"
    (role,) = find(objects, "Role", "demo-lmq-operator-brokers")
    verbs = {(r["apiGroups"][0], r["resources"][0]): r["verbs"] for r in role["rules"]}
    assert verbs[("apps", "statefulsets")] == ["get", "patch"]
    assert verbs[("", "configmaps")] == ["get", "create", "patch"]
    assert verbs[("", "events")] == ["create"]
