"""The operator as the membership source of the broker StatefulSet, on the real apiserver with real brokers.

There is no kubelet and no StatefulSet controller here: the test plays their part. When the operator raises
spec.replicas it starts the new broker with the flags the pod would take from the operator's ConfigMap
(envFrom) and publishes its EndpointSlice; when the operator lowers it, it stops the broker and removes the
endpoint. Messages go through the official Python client (a child process), through broker 0 only.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmq_broker.admin.client import AdminClient
from lmq_broker.supervisor import free_ports
from lmq_operator import scaling, testing

TIMEOUT_S = 60.0
STS = "lmq-broker"
CONFIGMAP = "lmq-broker-membership"
CLIENT = Path(__file__).with_name("lite_client.py")


def _sts(kube: testing.KubeAPI, namespace: str) -> Any:
    return kube.get(f"/apis/apps/v1/namespaces/{namespace}/statefulsets/{STS}")


def _want(kube: testing.KubeAPI, namespace: str, pods: int) -> None:
    """What `helm upgrade --set broker.replicas=<pods>` changes: the annotation, never spec.replicas."""
    path = f"/apis/apps/v1/namespaces/{namespace}/statefulsets/{STS}"
    kube.merge_patch(path, {"metadata": {"annotations": {scaling.ANNOTATION_REPLICAS: str(pods)}}})


def _clusters(admins: list[AdminClient]) -> list[tuple[tuple[str, ...], tuple[int, ...], int]]:
    out = []
    for admin in admins:
        info = admin.cluster()
        out.append((info.members, info.ring_sizes, info.slot))
    return out


def _events(kube: testing.KubeAPI, namespace: str, reason: str) -> list[str]:
    items = kube.get(f"/api/v1/namespaces/{namespace}/events")["items"]
    return [e["message"] for e in items if e["involvedObject"]["name"] == STS and e["reason"] == reason]


def _client(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CLIENT), *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )


def _run(run_operator: Callable[..., testing.OperatorProcess], namespace: str, pods: list[str], **more: Any) -> None:
    """The operator as the chart runs it: discovery by EndpointSlices, the membership managed."""
    run_operator(namespace, None, **testing.scaling_env(namespace, STS, CONFIGMAP, pods), **more)


def test_operator_scales_the_brokers_up_and_down_after_draining(  # noqa: PLR0915 (one scenario told start to end)
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Callable[..., Any],
    unique: Callable[[str], str],
    run_operator: Callable[..., testing.OperatorProcess],
    start_broker: Callable[..., Any],
    bind_documented_rbac: Callable[..., None],
    tmp_path: Path,
) -> None:
    """With exactly the RBAC of docs/operator.md."""
    bind_documented_rbac(namespace)
    ip = testing.host_ip()  # EndpointSlices refuse loopback addresses
    ports = free_ports("0.0.0.0", 3)
    pods = [f"{ip}:{port}" for port in ports]
    initial = ",".join(pods[:2])  # what the chart renders for a fresh install of 2 replicas
    brokers = [
        start_broker(
            f"pod{i}", port=ports[i], extra=("--host", "0.0.0.0", "--peers", initial, "--advertised-address", pods[i])
        )
        for i in range(2)
    ]
    testing.publish_brokers(kube, namespace, STS, [(ip, ports[0]), (ip, ports[1])], replicas=2)
    _want(kube, namespace, 2)
    kubeconfig = testing.write_kubeconfig(kube, kube.operator_token, tmp_path / "operator.kubeconfig")
    _run(run_operator, namespace, pods, kubeconfig=kubeconfig)
    cm_path = f"/api/v1/namespaces/{namespace}/configmaps/{CONFIGMAP}"
    cm = testing.wait_for(lambda: kube.get(cm_path) if kube.exists(cm_path) else None, TIMEOUT_S, "the ConfigMap")
    assert cm["data"] == {"LMQ_PEERS": initial, "LMQ_RING_HISTORY": ""}
    assert cm["metadata"]["ownerReferences"][0]["name"] == STS
    topic, group = unique("scaled"), unique("scaled-g")
    create("ParentTopic", namespace, "scaled", {"topicName": topic})
    create("LiteGroup", namespace, "scaled-g", {"groupName": group, "parentTopic": topic})

    # ---- scale-up 2 -> 3: the operator raises spec.replicas, the new pod starts with the ConfigMap's flags
    _want(kube, namespace, 3)
    testing.wait_for(lambda: _sts(kube, namespace)["spec"]["replicas"] == 3, TIMEOUT_S, "spec.replicas 3")
    env = kube.get(cm_path)["data"]
    assert env == {"LMQ_PEERS": ",".join(pods), "LMQ_RING_HISTORY": "2"}
    flags = ("--host", "0.0.0.0", "--peers", env["LMQ_PEERS"], "--ring-history", env["LMQ_RING_HISTORY"])
    brokers.append(start_broker("pod2", port=ports[2], extra=(*flags, "--advertised-address", pods[2])))
    testing.add_broker_pod(kube, namespace, STS, 2, (ip, ports[2]))
    admins = [AdminClient(b.admin_endpoint, timeout_s=30, **b.admin_keys) for b in brokers]
    try:
        grown = [(tuple(pods), (2, 3), slot) for slot in range(3)]
        testing.wait_for(lambda: _clusters(admins) == grown, TIMEOUT_S, "every broker with 3 slots")
        testing.wait_for(
            lambda: "Steady" in _sts(kube, namespace)["metadata"]["annotations"][scaling.ANNOTATION_STATUS],
            TIMEOUT_S,
            "Steady after the scale-up",
        )
        assert any("scaling up 2 → 3 pods" in m for m in _events(kube, namespace, "ScalingUp"))
        path = testing.cr_path("parenttopics", namespace, "scaled")
        testing.wait_for(lambda: kube.get(path)["status"].get("brokersReady") == "3/3", TIMEOUT_S, "topic on 3")
        groups = testing.cr_path("litegroups", namespace, "scaled-g")
        testing.wait_for(lambda: kube.get(groups)["status"].get("brokersReady") == "3/3", TIMEOUT_S, "group on 3")

        # ---- messages on every broker, through broker 0 only
        lites = [f"l{i}" for i in range(12)]
        sent = _client("send", brokers[0].endpoint, topic, ",".join(lites), "5")
        assert sent.returncode == 0 and sent.stdout.strip() == "60", sent.stderr[-3000:]
        held = admins[2].cluster(with_undrained=True).undrained_messages
        assert held > 0  # jump hashing puts some of the 12 topics on the new slot

        # ---- kubectl scale --replicas=2: the controller stops pod 2 at once; the operator sets spec.replicas
        # back (with a Warning that says how to scale down) and the pod comes back with its volume
        kube.merge_patch(f"/apis/apps/v1/namespaces/{namespace}/statefulsets/{STS}", {"spec": {"replicas": 2}})
        brokers[2].stop()
        testing.set_broker_endpoint(kube, namespace, STS, 2, None)
        testing.wait_for(lambda: _sts(kube, namespace)["spec"]["replicas"] == 3, TIMEOUT_S, "spec.replicas back")
        assert any(scaling.ANNOTATION_REPLICAS in m for m in _events(kube, namespace, "ReplicasRestored"))
        brokers[2] = start_broker("pod2", port=ports[2], extra=(*flags, "--advertised-address", pods[2]))
        testing.set_broker_endpoint(kube, namespace, STS, 2, ip)
        testing.wait_for(lambda: _clusters(admins) == grown, TIMEOUT_S, "pod 2 back in the ring")
        assert admins[2].cluster(with_undrained=True).undrained_messages == held

        # ---- scale-down 3 -> 2: pod 2 is marked leaving and kept running until it is drained
        _want(kube, namespace, 2)
        leaving = [(tuple(pods), (2, 3, 2), slot) for slot in range(3)]
        testing.wait_for(lambda: _clusters(admins) == leaving, TIMEOUT_S, "slot 2 leaving everywhere")
        status = testing.wait_for(
            lambda: (
                (s := _sts(kube, namespace)["metadata"]["annotations"][scaling.ANNOTATION_STATUS]).startswith(
                    "Draining"
                )
                and "undrained" in s
                and s
            ),
            TIMEOUT_S,
            "Draining reported",
        )
        assert f"{pods[2]}: {held} undrained messages" in status
        assert any("scaling down 3 → 2 pods" in m for m in _events(kube, namespace, "Draining"))
        drained = next(c for c in kube.get(path)["status"]["conditions"] if c["type"] == "BrokersDrained")
        testing.wait_for(
            lambda: (
                next(c for c in kube.get(path)["status"]["conditions"] if c["type"] == "BrokersDrained")["status"]
                == "False"
            ),
            TIMEOUT_S,
            "BrokersDrained=False while draining",
        )
        drained = next(c for c in kube.get(path)["status"]["conditions"] if c["type"] == "BrokersDrained")
        assert (
            drained["message"]
            == f"lmq-broker-2 (ordinal 2, leaving: scaling down to 2 pods) still holds {held} undrained messages"
        )
        assert _sts(kube, namespace)["spec"]["replicas"] == 3  # held while undrained

        # ---- consume everything (through broker 0): then pod 2 is drained, removed, and spec.replicas lowered
        got = _client("consume", brokers[0].endpoint, group, topic, ",".join(lites), "60", "60")
        assert got.returncode == 0, got.stderr[-3000:]
        received = [tuple(json.loads(line)) for line in got.stdout.splitlines()]
        assert Counter(received) == Counter((lite, f"{lite}/{n}") for lite in lites for n in range(5))
        testing.wait_for(lambda: _sts(kube, namespace)["spec"]["replicas"] == 2, TIMEOUT_S, "spec.replicas 2")
        assert _clusters(admins[:2]) == [(tuple(pods[:2]), (2,), 0), (tuple(pods[:2]), (2,), 1)]
        assert admins[2].cluster().slot == -1  # removed before it was stopped
        assert any("removing them, then scaling down to 2 pods" in m for m in _events(kube, namespace, "ScaledDown"))
        assert kube.get(cm_path)["data"] == {"LMQ_PEERS": initial, "LMQ_RING_HISTORY": ""}
        # the StatefulSet controller's part: the pod and its endpoint go
        brokers[2].stop()
        testing.set_broker_endpoint(kube, namespace, STS, 2, None)
        testing.wait_for(
            lambda: _sts(kube, namespace)["metadata"]["annotations"][scaling.ANNOTATION_STATUS].startswith("Steady"),
            TIMEOUT_S,
            "Steady after the scale-down",
        )
        testing.wait_for(lambda: kube.get(path)["status"].get("brokersReady") == "2/2", TIMEOUT_S, "topic on 2")
    finally:
        for admin in admins:
            admin.close()


def _free_block(count: int) -> int:
    """A port p with p .. p + count - 1 all free: a pod's client port and its processes' ports p + 1 + i."""
    for _ in range(50):
        (base,) = free_ports("0.0.0.0", 1)
        if base + count < 65536:
            try:
                for port in range(base, base + count):
                    with socket.socket() as s:
                        s.bind(("0.0.0.0", port))
                return base
            except OSError:
                continue
    raise RuntimeError("no block of free ports")


def test_processes_are_ring_slots_the_operator_reaches_on_their_own_ports(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Callable[..., Any],
    unique: Callable[[str], str],
    run_operator: Callable[..., testing.OperatorProcess],
    start_broker: Callable[..., Any],
) -> None:
    """Two processes per pod (`serve --processes 2`): pod k's slots are 2k and 2k + 1 on its ports + 1 + i; the
    operator grows 2 pods (4 slots) to 3 (6 slots), applies a topic to every process, and shrinks back."""
    ip = testing.host_ip()
    bases = [_free_block(3) for _ in range(3)]
    pods = [f"{ip}:{base}" for base in bases]

    def start(ordinal: int, peers: str, history: str = "") -> Any:
        flags = ("--host", "0.0.0.0", "--processes", "2", "--peers", peers, "--ring-history", history)
        return start_broker(f"pod{ordinal}", port=bases[ordinal], extra=(*flags, "--advertised-address", pods[ordinal]))

    brokers = [start(i, ",".join(pods[:2])) for i in range(2)]
    testing.publish_brokers(kube, namespace, STS, [(ip, bases[0]), (ip, bases[1])], replicas=2)
    _want(kube, namespace, 2)
    _run(run_operator, namespace, pods, LMQ_OPERATOR_BROKER_PROCESSES="2")
    topic = unique("procs")
    create("ParentTopic", namespace, "procs", {"topicName": topic})
    path = testing.cr_path("parenttopics", namespace, "procs")
    obj = testing.wait_for(
        lambda: (o := kube.get(path)).get("status", {}).get("brokersReady") == "4/4" and o, TIMEOUT_S, "4"
    )
    assert [b["name"] for b in obj["status"]["brokers"]] == [f"{STS}-{k}-p{i}" for k in range(2) for i in range(2)]
    assert [b["endpoint"] for b in obj["status"]["brokers"]] == [
        f"{ip}:{bases[k] + 1 + i}" for k in range(2) for i in range(2)
    ]

    _want(kube, namespace, 3)
    testing.wait_for(lambda: _sts(kube, namespace)["spec"]["replicas"] == 3, TIMEOUT_S, "spec.replicas 3")
    env = kube.get(f"/api/v1/namespaces/{namespace}/configmaps/{CONFIGMAP}")["data"]
    assert env == {"LMQ_PEERS": ",".join(pods), "LMQ_RING_HISTORY": "4"}
    brokers.append(start(2, env["LMQ_PEERS"], env["LMQ_RING_HISTORY"]))
    testing.add_broker_pod(kube, namespace, STS, 2, (ip, bases[2]))
    slots = [f"{ip}:{base + 1 + i}" for base in bases for i in range(2)]
    admins = [AdminClient(endpoint, timeout_s=30, **brokers[0].admin_keys) for endpoint in slots]
    try:
        grown = [(tuple(slots), (4, 6), slot) for slot in range(6)]
        testing.wait_for(lambda: _clusters(admins) == grown, TIMEOUT_S, "every process with 6 slots")
        testing.wait_for(lambda: kube.get(path)["status"].get("brokersReady") == "6/6", TIMEOUT_S, "topic on 6")

        _want(kube, namespace, 2)  # nothing undrained: the leaving pod is removed at once
        testing.wait_for(lambda: _sts(kube, namespace)["spec"]["replicas"] == 2, TIMEOUT_S, "spec.replicas 2")
        assert _clusters(admins[:4]) == [(tuple(slots[:4]), (4,), slot) for slot in range(4)]
        assert [admin.cluster().slot for admin in admins[4:]] == [-1, -1]
    finally:
        for admin in admins:
            admin.close()


LONG_RESYNC = {"LMQ_OPERATOR_RESYNC_SECONDS": "600"}  # no resource reaches a broker by the resync in these tests


def _drained(kube: testing.KubeAPI, path: str) -> dict[str, Any]:
    conditions = kube.get(path).get("status", {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == "BrokersDrained"), {})


def _wait_ready_on(kube: testing.KubeAPI, path: str, brokers: str, timeout_s: float) -> None:
    testing.wait_for(
        lambda: kube.get(path).get("status", {}).get("brokersReady") == brokers, timeout_s, f"{path} on {brokers}"
    )


def test_a_joining_broker_holds_every_resource_before_any_broker_is_told_the_grown_ring(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Callable[..., Any],
    unique: Callable[[str], str],
    run_operator: Callable[..., testing.OperatorProcess],
    start_broker: Callable[..., Any],
) -> None:
    """Scale-up 2 -> 3 with a resync that cannot deliver anything: the new pod's endpoint is published not
    ready, so only the scaler can give it the resources, and it must before broker 0 or 1 learns of it. Then
    the pod turns ready (statuses count it at once), and comes back with an empty disk (repaired at once)."""
    ip = testing.host_ip()
    ports = free_ports("0.0.0.0", 3)
    pods = [f"{ip}:{port}" for port in ports]
    initial = ",".join(pods[:2])
    brokers = [
        start_broker(
            f"pod{i}", port=ports[i], extra=("--host", "0.0.0.0", "--peers", initial, "--advertised-address", pods[i])
        )
        for i in range(2)
    ]
    testing.publish_brokers(kube, namespace, STS, [(ip, ports[0]), (ip, ports[1])], replicas=2)
    _want(kube, namespace, 2)
    _run(run_operator, namespace, pods, **LONG_RESYNC)
    topic, group = unique("joined"), unique("joined-g")
    create("ParentTopic", namespace, "joined", {"topicName": topic})
    create("LiteGroup", namespace, "joined-g", {"groupName": group, "parentTopic": topic})
    create("LiteQuota", namespace, "joined-q", {"parentTopic": topic, "maxLiteTopics": 50})
    paths = [
        testing.cr_path("parenttopics", namespace, "joined"),
        testing.cr_path("litegroups", namespace, "joined-g"),
        testing.cr_path("litequotas", namespace, "joined-q"),
    ]
    for path in paths:
        _wait_ready_on(kube, path, "2/2", TIMEOUT_S)

    _want(kube, namespace, 3)
    testing.wait_for(lambda: _sts(kube, namespace)["spec"]["replicas"] == 3, TIMEOUT_S, "spec.replicas 3")
    env = kube.get(f"/api/v1/namespaces/{namespace}/configmaps/{CONFIGMAP}")["data"]
    flags = ("--host", "0.0.0.0", "--peers", env["LMQ_PEERS"], "--ring-history", env["LMQ_RING_HISTORY"])
    brokers.append(start_broker("pod2", port=ports[2], extra=(*flags, "--advertised-address", pods[2])))
    testing.add_broker_pod(kube, namespace, STS, 2, (ip, ports[2]), ready=False)
    admins = [AdminClient(b.admin_endpoint, timeout_s=30, **b.admin_keys) for b in brokers]
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not any(len(admin.cluster().members) == 3 for admin in admins[:2]):  # the instant one is told
            assert time.monotonic() < deadline, "no broker was told the grown ring"
        assert admins[2].get_parent_topic(topic).topic.name == topic
        assert admins[2].get_group(group).group.bind_topic == topic
        assert [q.max_lite_topics for q in admins[2].list_quotas() if q.scope == f"parent:{topic}"] == [50]
        grown = [(tuple(pods), (2, 3), slot) for slot in range(3)]
        testing.wait_for(lambda: _clusters(admins) == grown, TIMEOUT_S, "every broker with 3 slots")

        # the pod turns ready: it is a target now, and every status counts it without waiting for the resync
        testing.set_broker_endpoint(kube, namespace, STS, 2, ip, ready=True)
        started = time.monotonic()
        for path in paths:
            _wait_ready_on(kube, path, "3/3", 15.0)
        counted_s = time.monotonic() - started

        # the pod comes back on its address with an empty disk: it gets everything again at once
        brokers[2].stop()
        brokers[2] = start_broker("pod2-empty", port=ports[2], extra=(*flags, "--advertised-address", pods[2]))
        started = time.monotonic()
        testing.wait_for(
            lambda: (
                any(t.topic.name == topic for t in admins[2].list_parent_topics())
                and any(g.group.name == group for g in admins[2].list_groups())
            ),
            15.0,
            "the resources on the emptied broker",
        )
        repaired_s = time.monotonic() - started
        print(
            f"statuses counted the new broker in {counted_s:.1f} s; the emptied broker repaired in {repaired_s:.1f} s"
        )
    finally:
        for admin in admins:
            admin.close()


def test_brokers_drained_follows_a_scale_down(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Callable[..., Any],
    unique: Callable[[str], str],
    run_operator: Callable[..., testing.OperatorProcess],
    start_broker: Callable[..., Any],
) -> None:
    """3 -> 2 with messages on the leaving broker and a resync that cannot be what writes the condition:
    BrokersDrained turns False within seconds of the scale-down starting, and True once they are consumed."""
    ip = testing.host_ip()
    ports = free_ports("0.0.0.0", 3)
    pods = [f"{ip}:{port}" for port in ports]
    peers = ",".join(pods)
    brokers = [
        start_broker(
            f"pod{i}", port=ports[i], extra=("--host", "0.0.0.0", "--peers", peers, "--advertised-address", pods[i])
        )
        for i in range(3)
    ]
    testing.publish_brokers(kube, namespace, STS, [(ip, port) for port in ports], replicas=3)
    _want(kube, namespace, 3)
    _run(run_operator, namespace, pods, **LONG_RESYNC)
    topic, group = unique("drain"), unique("drain-g")
    create("ParentTopic", namespace, "drain", {"topicName": topic})
    create("LiteGroup", namespace, "drain-g", {"groupName": group, "parentTopic": topic})
    path = testing.cr_path("parenttopics", namespace, "drain")
    testing.wait_for(lambda: kube.get(path).get("status", {}).get("brokersReady") == "3/3", TIMEOUT_S, "topic on 3")
    testing.wait_for(
        lambda: (
            kube.get(testing.cr_path("litegroups", namespace, "drain-g")).get("status", {}).get("brokersReady") == "3/3"
        ),
        TIMEOUT_S,
        "group on 3",
    )
    assert _drained(kube, path)["status"] == "True"
    lites = [f"l{i}" for i in range(12)]
    sent = _client("send", brokers[0].endpoint, topic, ",".join(lites), "5")
    assert sent.returncode == 0 and sent.stdout.strip() == "60", sent.stderr[-3000:]
    admin = AdminClient(brokers[2].admin_endpoint, timeout_s=30, **brokers[2].admin_keys)
    try:
        held = admin.cluster(with_undrained=True).undrained_messages
        assert held > 0

        _want(kube, namespace, 2)
        started = time.monotonic()
        testing.wait_for(lambda: _drained(kube, path)["status"] == "False", 10.0, "BrokersDrained=False")
        false_s = time.monotonic() - started
        drained = _drained(kube, path)
        assert drained["reason"] == "UndrainedBrokerLeaving"
        assert drained["message"] == (
            f"lmq-broker-2 (ordinal 2, leaving: scaling down to 2 pods) still holds {held} undrained messages"
        )

        got = _client("consume", brokers[0].endpoint, group, topic, ",".join(lites), "60", "60")
        assert got.returncode == 0, got.stderr[-3000:]
        assert len(got.stdout.splitlines()) == 60
        started = time.monotonic()
        testing.wait_for(lambda: _drained(kube, path)["status"] == "True", 15.0, "BrokersDrained=True")
        true_s = time.monotonic() - started
        testing.wait_for(lambda: _sts(kube, namespace)["spec"]["replicas"] == 2, TIMEOUT_S, "spec.replicas 2")
        print(f"BrokersDrained False {false_s:.1f} s after the scale-down began, True {true_s:.1f} s after the drain")
    finally:
        admin.close()
