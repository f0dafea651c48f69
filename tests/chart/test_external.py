"""broker.external: clients outside the cluster (docs/scale-out.md). The brokers' external listener flags, a
Service per broker pod selecting it by statefulset.kubernetes.io/pod-name, the bootstrap Service in front of all,
and the NetworkPolicy rule for the external port, for every value of broker.external."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import helm_python as helm
import pytest

Manifest = dict[str, Any]
Render = Callable[..., list[Manifest]]
One = Callable[..., Manifest]

BROKER = "demo-lmq-broker"


def external(replicas: int = 3, **values: Any) -> dict[str, Any]:
    return {"broker": {"replicas": replicas, "external": {"enabled": True, **values}}}


def services(objects: list[Manifest]) -> dict[str, Manifest]:
    return {
        o["metadata"]["name"]: o for o in objects if o["kind"] == "Service" and "-external" in o["metadata"]["name"]
    }


def broker_container(objects: list[Manifest], one: One) -> dict[str, Any]:
    container: dict[str, Any] = one(objects, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    return container


def external_rule(objects: list[Manifest], one: One, port: int) -> list[dict[str, Any]]:
    policy = one(objects, "NetworkPolicy", BROKER)
    return [rule for rule in policy["spec"]["ingress"] if rule["ports"] == [{"port": port, "protocol": "TCP"}]]


def test_off_by_default(render: Render, one: One) -> None:
    objects = render()
    assert services(objects) == {}
    container = broker_container(objects, one)
    assert not any(a.startswith("--external") for a in container["args"])
    assert "external" not in [p["name"] for p in container["ports"]]
    assert external_rule(objects, one, 9094) == []


def test_a_service_per_broker_pod_and_a_bootstrap_service(render: Render, one: One) -> None:
    objects = render(external(advertisedAddressTemplate="lmq-{ordinal}.example.com:9094"))
    found = services(objects)
    assert sorted(found) == [f"{BROKER}-external", *(f"{BROKER}-external-{i}" for i in range(3))]
    for i in range(3):
        spec = found[f"{BROKER}-external-{i}"]["spec"]
        assert spec["type"] == "LoadBalancer"
        assert spec["selector"]["statefulset.kubernetes.io/pod-name"] == f"{BROKER}-{i}"
        assert spec["selector"]["app.kubernetes.io/component"] == "broker"
        assert spec["ports"] == [
            {"name": "external", "port": 9094, "targetPort": "external", "protocol": "TCP", "appProtocol": "grpc"}
        ]
        assert "externalTrafficPolicy" not in spec
    bootstrap = found[f"{BROKER}-external"]["spec"]
    assert "statefulset.kubernetes.io/pod-name" not in bootstrap["selector"]
    assert bootstrap["type"] == "LoadBalancer" and bootstrap["ports"][0]["port"] == 9094
    container = broker_container(objects, one)
    args = container["args"]
    at = args.index("--external-port")
    assert args[at : at + 4] == [
        "--external-port",
        "9094",
        "--external-address-template",
        "lmq-{ordinal}.example.com:9094",
    ]
    assert "--external-addresses" not in args
    assert {"name": "external", "containerPort": 9094, "protocol": "TCP"} in container["ports"]
    assert args.index("--external-port") < len(args) - 1  # before extraArgs, which come last
    # the in-cluster routes stay on the pods' DNS names
    assert args[args.index("--advertised-host") + 1].endswith(".demo-lmq-broker-headless.mq.svc.cluster.local")


def test_node_ports_numbered_from_the_base(render: Render) -> None:
    objects = render(
        external(
            type="NodePort",
            nodePortBase=31100,
            bootstrap={"nodePort": 31099},
            externalTrafficPolicy="Local",
            advertisedAddressTemplate="nodes.example.com:{ordinal+31100}",
        )
    )
    found = services(objects)
    for i in range(3):
        spec = found[f"{BROKER}-external-{i}"]["spec"]
        assert (spec["type"], spec["ports"][0]["nodePort"], spec["externalTrafficPolicy"]) == (
            "NodePort",
            31100 + i,
            "Local",
        )
    bootstrap = found[f"{BROKER}-external"]["spec"]
    assert (bootstrap["ports"][0]["nodePort"], bootstrap["externalTrafficPolicy"]) == (31099, "Local")


def test_cluster_ip_services_take_no_node_port_nor_traffic_policy(render: Render) -> None:
    """ClusterIP (an ingress with TLS passthrough, a port-forward): Kubernetes refuses nodePort and
    externalTrafficPolicy there, so they are left out whatever the values say."""
    objects = render(
        external(
            replicas=2,
            type="ClusterIP",
            nodePortBase=31100,
            externalTrafficPolicy="Local",
            bootstrap={"nodePort": 31099},
            advertisedAddresses=["localhost:19094", "localhost:19095"],
        )
    )
    for service in services(objects).values():
        spec = service["spec"]
        assert spec["type"] == "ClusterIP"
        assert "nodePort" not in spec["ports"][0] and "externalTrafficPolicy" not in spec


def test_listed_addresses_and_the_template_both_reach_the_brokers(render: Render, one: One) -> None:
    listed = ["lb-0.example.com:9094", "lb-1.example.com:9094"]
    args = broker_container(
        render(external(advertisedAddresses=listed, advertisedAddressTemplate="lmq-{ordinal}.example.com:9094")), one
    )["args"]
    assert args[args.index("--external-addresses") + 1] == ",".join(listed)
    assert args[args.index("--external-address-template") + 1] == "lmq-{ordinal}.example.com:9094"


def test_several_brokers_need_an_address_each(render: Render, one: One) -> None:
    with pytest.raises(helm.HelmRenderError, match="advertisedAddressTemplate"):
        render(external(replicas=3))
    with pytest.raises(helm.HelmRenderError, match="advertisedAddressTemplate"):
        render(external(replicas=3, advertisedAddresses=["a.example.com:1", "b.example.com:2"]))
    args = broker_container(render(external(replicas=3, advertisedAddresses=["a:1", "b:2", "c:3"])), one)["args"]
    assert args[args.index("--external-addresses") + 1] == "a:1,b:2,c:3"
    args = broker_container(render(external(replicas=1)), one)["args"]  # alone: the address the client dialled
    assert (
        "--external-port" in args and "--external-addresses" not in args and "--external-address-template" not in args
    )


def test_per_pod_annotations_name_their_ordinal(render: Render) -> None:
    annotations = {"external-dns.alpha.kubernetes.io/hostname": "lmq-{ordinal}.example.com", "team": "mq"}
    found = services(
        render(
            external(
                annotations=annotations,
                advertisedAddressTemplate="lmq-{ordinal}.example.com:9094",
                bootstrap={"annotations": {"lb": "shared"}},
            )
        )
    )
    for i in range(3):
        assert found[f"{BROKER}-external-{i}"]["metadata"]["annotations"] == {
            "external-dns.alpha.kubernetes.io/hostname": f"lmq-{i}.example.com",
            "team": "mq",
        }
    assert found[f"{BROKER}-external"]["metadata"]["annotations"] == {"lb": "shared"}


def test_without_the_bootstrap_service(render: Render) -> None:
    found = services(
        render(external(advertisedAddressTemplate="a-{ordinal}.example.com:9094", bootstrap={"enabled": False}))
    )
    assert sorted(found) == [f"{BROKER}-external-{i}" for i in range(3)]


def test_another_port_everywhere(render: Render, one: One) -> None:
    objects = render(external(replicas=1, port=19094, type="NodePort"))
    container = broker_container(objects, one)
    assert container["args"][container["args"].index("--external-port") + 1] == "19094"
    assert {"name": "external", "containerPort": 19094, "protocol": "TCP"} in container["ports"]
    for service in services(objects).values():
        assert service["spec"]["ports"][0]["port"] == 19094
    assert len(external_rule(objects, one, 19094)) == 1


def test_the_network_policy_admits_the_external_port(render: Render, one: One) -> None:
    objects = render(external(replicas=1))
    assert external_rule(objects, one, 9094) == [{"ports": [{"port": 9094, "protocol": "TCP"}]}]  # from anyone
    sources = [{"ipBlock": {"cidr": "203.0.113.0/24"}}]
    objects = render({**external(replicas=1), "networkPolicy": {"externalFrom": sources}})
    assert external_rule(objects, one, 9094) == [{"ports": [{"port": 9094, "protocol": "TCP"}], "from": sources}]
    admin = [r for r in one(objects, "NetworkPolicy", BROKER)["spec"]["ingress"] if r["ports"][0]["port"] == 8082]
    assert len(admin) == 1 and "from" in admin[0]  # admin stays closed to outside


@pytest.mark.parametrize(
    "values",
    [
        {"port": 8081},
        {"port": 8082},
        {"type": "ExternalName"},
        {"advertisedAddressTemplate": "lmq-{pod}.example.com:9094"},
        {"advertisedAddressTemplate": "lmq.example.com"},
        {"advertisedAddresses": ["no-port.example.com"]},
        {"externalTrafficPolicy": "Nearest"},
        {"nodePortBase": 0},
    ],
)
def test_the_schema_refuses_bad_values(render: Render, values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        render(external(replicas=1, **values))


def test_notes_point_outside_clients_to_the_bootstrap_service(render_notes: Callable[..., str]) -> None:
    assert "need broker.external.enabled" in render_notes()
    notes = render_notes(external(replicas=1, type="ClusterIP"))
    assert f"the bootstrap Service {BROKER}-external, port 9094" in notes
    assert f"port-forward svc/{BROKER}-external 9094:9094" in notes
    notes = render_notes(external(advertisedAddressTemplate="lmq-{ordinal}.example.com:9094"))
    assert "(LoadBalancer)" in notes and "port-forward svc/" + BROKER + "-external" not in notes


def test_the_network_policy_admits_every_process_external_port(render: Render, one: One) -> None:
    """broker.processes > 1: process i listens on the external port + 1 + i (its own routes' port)."""
    values = external(advertisedAddressTemplate="lmq-{ordinal}.example.com:9094")
    values["broker"]["processes"] = 3
    policy = one(render(values), "NetworkPolicy", BROKER)
    rules = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 9094]
    assert rules == [{"ports": [{"port": 9094, "endPort": 9097, "protocol": "TCP"}]}]
