"""The values a production install turns on (issue 15): who may reach the admin port, TLS for the brokers and
every caller, extra volumes and containers, spreading brokers over nodes and zones, the `helm test` pod, no
demo objects, and CRDs that `helm upgrade` upgrades and `helm uninstall` keeps. Each value is checked in what
it renders, and against the objects it has to fit (selectors against pod labels, ports against containers,
mounted files against arguments)."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from lmq_broker import __main__ as broker_cli

Manifest = dict[str, Any]
Render = Callable[..., list[Manifest]]
One = Callable[..., Manifest]

BROKER = "demo-lmq-broker"
POD_DOMAIN = "demo-lmq-broker-headless.mq.svc.cluster.local"
TLS = {"tls": {"enabled": True, "existingSecret": "mq-tls"}}
CERT_MANAGER = {"tls": {"enabled": True, "certManager": {"enabled": True, "issuerRef": {"name": "corp-ca"}}}}


def pod_spec(obj: Manifest) -> dict[str, Any]:
    if obj["kind"] == "Pod":
        spec: dict[str, Any] = obj["spec"]
    elif obj["kind"] == "CronJob":
        spec = obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    else:
        spec = obj["spec"]["template"]["spec"]
    return spec


def pod_labels(obj: Manifest) -> dict[str, str]:
    if obj["kind"] == "Pod":
        labels: dict[str, str] = obj["metadata"]["labels"]
    elif obj["kind"] == "CronJob":
        labels = obj["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["labels"]
    else:
        labels = obj["spec"]["template"]["metadata"]["labels"]
    return labels


def workloads(objects: list[Manifest]) -> dict[str, Manifest]:
    """component -> the object whose pods it runs (broker, operator, reclaim, test)."""
    return {
        pod_labels(o)["app.kubernetes.io/component"]: o
        for o in objects
        if o["kind"] in ("StatefulSet", "Deployment", "CronJob", "Pod")
    }


def main_container(obj: Manifest) -> dict[str, Any]:
    first: dict[str, Any] = pod_spec(obj)["containers"][0]
    return first


def literal_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


# -- the admin port and the NetworkPolicy


def test_admin_is_reachable_only_from_the_control_plane_of_the_release(render: Render, one: One) -> None:
    objects = render({"reclaim": {"enabled": True}})
    policy = one(objects, "NetworkPolicy", BROKER)
    pods = workloads(objects)
    copies = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 8090]  # R = 2 (the default)
    assert copies and "containerPort" not in str(copies)
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]  # egress is left alone
    assert selects(spec["podSelector"]["matchLabels"], pod_labels(pods["broker"]))
    assert spec["podSelector"]["matchLabels"] == pods["broker"]["spec"]["selector"]["matchLabels"]
    by_port = {rule["ports"][0]["port"]: rule for rule in spec["ingress"] if rule["ports"][0]["port"] != 8090}
    ports = {p["name"]: p["containerPort"] for p in main_container(pods["broker"])["ports"]}
    assert set(by_port) == set(ports.values()) == {8081, 8082, 9100}  # every port the broker listens on
    assert "from" not in by_port[ports["grpc"]] and "from" not in by_port[ports["metrics"]]  # open by default
    admitted = [peer["podSelector"]["matchLabels"] for peer in by_port[ports["admin"]]["from"]]
    assert all(set(peer) == {"podSelector"} for peer in by_port[ports["admin"]]["from"])  # this namespace only
    for component in ("operator", "reclaim", "test", "broker"):  # brokers: peers of a cluster ask each other
        assert any(selects(peer, pod_labels(pods[component])) for peer in admitted), component
    assert len(admitted) == 5  # and the backup job's pods (backup.enabled)
    assert {"app.kubernetes.io/component": "backup"}.items() <= admitted[2].items()
    other_release = {**pod_labels(pods["operator"]), "app.kubernetes.io/instance": "other"}
    assert not any(selects(peer, other_release) for peer in admitted)

    broker = main_container(pods["broker"])
    assert "--admin-port" in broker["args"] and broker["args"][broker["args"].index("--admin-port") + 1] == "8082"
    client_service = one(objects, "Service", BROKER)
    assert [p["port"] for p in client_service["spec"]["ports"]] == [8081]  # a LoadBalancer never exposes admin


def test_network_policy_peers_and_switch(render: Render, one: One) -> None:
    ops = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}}
    apps = {"namespaceSelector": {"matchLabels": {"team": "apps"}}}
    prometheus = {"podSelector": {"matchLabels": {"app": "prometheus"}}}
    mqtt = {"ports": [{"port": 1883, "protocol": "TCP"}]}
    values = {"adminFrom": [ops], "clientFrom": [apps], "metricsFrom": [prometheus], "extraIngress": [mqtt]}
    policy = one(render({"networkPolicy": values}), "NetworkPolicy")
    by_port = {rule["ports"][0]["port"]: rule.get("from") for rule in policy["spec"]["ingress"]}
    assert by_port[8081] == [apps]
    assert by_port[8082][-1] == ops and len(by_port[8082]) == 6
    assert by_port[9100] == [prometheus]
    assert policy["spec"]["ingress"][-1] == mqtt
    assert [o for o in render({"networkPolicy": {"enabled": False}}) if o["kind"] == "NetworkPolicy"] == []


# -- TLS


def test_without_tls_nothing_mentions_it(render: Render) -> None:
    for obj in workloads(render({"reclaim": {"enabled": True}})).values():
        container = main_container(obj)
        assert not {"LMQ_TLS_CA", "LMQ_TLS_SERVER_NAME"} & set(literal_env(container))
        assert not [a for a in container.get("args", []) if a.startswith("--tls")]
        assert not [v for v in pod_spec(obj).get("volumes", []) if v["name"].startswith("tls")]


def test_tls_from_a_secret_reaches_the_brokers_and_every_caller(render: Render) -> None:
    pods = workloads(render({**TLS, "reclaim": {"enabled": True}}))
    broker = main_container(pods["broker"])
    args = broker["args"]
    mounts = {m["name"]: m["mountPath"] for m in broker["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(pods["broker"])["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "mq-tls"
    files = {f"{mounts['tls']}/{i['path']}": i["key"] for i in volumes["tls"]["secret"]["items"]}
    assert files[args[args.index("--tls-cert") + 1]] == "tls.crt"
    assert files[args[args.index("--tls-key") + 1]] == "tls.key"
    assert volumes["tls"]["secret"]["defaultMode"] == 0o440  # the key: readable by the pod's group (fsGroup)
    for component in ("broker", "operator", "reclaim", "test"):  # the broker too: `kubectl exec ... lmq-admin`
        container = main_container(pods[component])
        env = literal_env(container)
        assert env["LMQ_TLS_SERVER_NAME"] == f"{BROKER}.mq.svc", component
        ca = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["tls-ca"]
        (volume,) = [v for v in pod_spec(pods[component])["volumes"] if v["name"] == "tls-ca"]
        assert volume["secret"]["secretName"] == "mq-tls"
        assert volume["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]  # never the private key
        assert env["LMQ_TLS_CA"] == f"{ca}/ca.crt", component
    assert literal_env(broker)["LMQ_ADMIN_ENDPOINT"] == "localhost:8082"


def test_the_ca_may_come_from_its_own_secret_and_key(render: Render) -> None:
    values = {"tls": {**TLS["tls"], "caSecret": "corp-bundle", "caKey": "root.pem", "serverName": "mq.corp"}}
    for component, obj in workloads(render(values)).items():
        (volume,) = [v for v in pod_spec(obj)["volumes"] if v["name"] == "tls-ca"]
        assert volume["secret"]["secretName"] == "corp-bundle"
        assert volume["secret"]["items"] == [{"key": "root.pem", "path": "ca.crt"}]
        assert literal_env(main_container(obj))["LMQ_TLS_SERVER_NAME"] == "mq.corp", component


def test_tls_needs_a_secret_or_cert_manager_and_an_issuer(render: Render) -> None:
    with pytest.raises(helm.HelmRenderError, match=r"tls\.existingSecret"):
        render({"tls": {"enabled": True}})
    with pytest.raises(helm.HelmRenderError, match=r"issuerRef\.name is required"):
        render({"tls": {"enabled": True, "certManager": {"enabled": True}}})


def test_cert_manager_issues_a_certificate_every_caller_and_client_can_check(render: Render, one: One) -> None:
    objects = render({**CERT_MANAGER, "reclaim": {"enabled": True}})
    certificate = one(objects, "Certificate", BROKER)
    assert certificate["apiVersion"] == "cert-manager.io/v1"
    spec = certificate["spec"]
    # Fields of cert-manager's Certificate v1 (it has no schema in kubernetes-validate).
    assert set(spec) <= {"secretName", "issuerRef", "duration", "renewBefore", "dnsNames", "privateKey", "usages"}
    assert spec["issuerRef"] == {"name": "corp-ca", "kind": "Issuer", "group": "cert-manager.io"}
    assert (spec["duration"], spec["renewBefore"]) == ("2160h", "360h")
    assert spec["privateKey"]["rotationPolicy"] == "Always"
    assert "server auth" in spec["usages"]
    pods = workloads(objects)
    (volume,) = [v for v in pod_spec(pods["broker"])["volumes"] if v["name"] == "tls"]
    assert volume["secret"]["secretName"] == spec["secretName"] == f"{BROKER}-tls"

    def covered(name: str) -> bool:  # a wildcard covers one DNS label, as TLS clients match it
        return any(
            fnmatch.fnmatch(name, pattern) and name.count(".") == pattern.count(".") for pattern in spec["dnsNames"]
        )

    server_name = literal_env(main_container(pods["operator"]))["LMQ_TLS_SERVER_NAME"]
    broker_args = main_container(pods["broker"])["args"]
    advertised = broker_args[broker_args.index("--advertised-host") + 1].replace("$(POD_NAME)", f"{BROKER}-3")
    for name in (server_name, advertised, f"{BROKER}.mq.svc.cluster.local", f"{BROKER}.mq"):
        assert covered(name), name  # the callers' expectation, the routes' names, the client Service


def test_cert_manager_values(render: Render, one: One) -> None:
    values = {
        "tls": {
            "enabled": True,
            "existingSecret": "mine",
            "serverName": "mq.corp",
            "certManager": {
                "enabled": True,
                "issuerRef": {"name": "root", "kind": "ClusterIssuer"},
                "duration": "720h",
                "renewBefore": "48h",
                "extraDnsNames": ["mq.example.org"],
            },
        }
    }
    spec = one(render(values), "Certificate")["spec"]
    assert spec["secretName"] == "mine"
    assert spec["issuerRef"]["kind"] == "ClusterIssuer"
    assert (spec["duration"], spec["renewBefore"]) == ("720h", "48h")
    assert {"mq.corp", "mq.example.org"} <= set(spec["dnsNames"])
    assert [o for o in render(TLS) if o["kind"] == "Certificate"] == []


# -- extra volumes, mounts and containers


@pytest.mark.parametrize("component", ["broker", "operator", "reclaim"])
def test_extra_volumes_mounts_and_containers(render: Render, component: str) -> None:
    volume = {"name": "extra", "configMap": {"name": "extra"}}
    mount = {"name": "extra", "mountPath": "/etc/extra", "readOnly": True}
    sidecar = {"name": "sidecar", "image": "example.org/sidecar:1"}
    section: dict[str, Any] = {"extraVolumes": [volume], "extraVolumeMounts": [mount]}
    if component != "reclaim":  # a Job's sidecar would keep the Job from finishing
        section["extraContainers"] = [sidecar]
    reclaim = {"extraVolumes": [volume], "extraVolumeMounts": [mount]} if component == "reclaim" else {}
    values: dict[str, Any] = {component: section, "reclaim": {**reclaim, "enabled": True}}
    obj = workloads(render(values))[component]
    spec = pod_spec(obj)
    assert spec["volumes"][-1] == volume
    assert spec["containers"][0]["volumeMounts"][-1] == mount
    assert [c["name"] for c in spec["containers"]] == [component, *(["sidecar"] if component != "reclaim" else [])]
    names = [v["name"] for v in spec["volumes"]]
    assert len(names) == len(set(names))
    baseline = pod_spec(workloads(render({"reclaim": {"enabled": True}}))[component])
    assert spec["volumes"][:-1] == baseline["volumes"]  # added, nothing of the chart's replaced


# -- spreading brokers


def test_brokers_prefer_different_nodes_and_zones_by_default(render: Render, one: One) -> None:
    sts = one(render(), "StatefulSet", BROKER)
    spec = sts["spec"]["template"]["spec"]
    selector = sts["spec"]["selector"]["matchLabels"]
    (preferred,) = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred["podAffinityTerm"] == {
        "topologyKey": "kubernetes.io/hostname",
        "labelSelector": {"matchLabels": selector},
    }
    (zones,) = spec["topologySpreadConstraints"]
    assert zones == {
        "topologyKey": "topology.kubernetes.io/zone",
        "maxSkew": 1,
        "whenUnsatisfiable": "ScheduleAnyway",  # a single-zone cluster still schedules them
        "labelSelector": {"matchLabels": selector},
    }


def test_spreading_presets_merge_with_the_users_rules(render: Render, one: One) -> None:
    def spec(broker: dict[str, Any]) -> dict[str, Any]:
        found: dict[str, Any] = one(render({"broker": broker}), "StatefulSet")["spec"]["template"]["spec"]
        return found

    hard = spec({"podAntiAffinityPreset": "hard"})["affinity"]["podAntiAffinity"]
    assert list(hard) == ["requiredDuringSchedulingIgnoredDuringExecution"]
    node: dict[str, Any] = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}
    }
    merged = spec({"affinity": node})["affinity"]
    assert merged["nodeAffinity"] == node["nodeAffinity"] and "podAntiAffinity" in merged
    own: dict[str, Any] = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}
    assert spec({"affinity": own})["affinity"] == own  # the user's own podAntiAffinity wins
    none = spec({"podAntiAffinityPreset": "none", "topologySpread": {"topologyKey": ""}})
    assert "affinity" not in none and "topologySpreadConstraints" not in none

    zone = {"maxSkew": 2, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule"}
    assert spec({"topologySpreadConstraints": [zone]})["topologySpreadConstraints"] == [zone]  # same key: replaced
    host = {**zone, "topologyKey": "kubernetes.io/hostname"}
    both = spec({"topologySpreadConstraints": [host]})["topologySpreadConstraints"]
    assert [c["topologyKey"] for c in both] == ["kubernetes.io/hostname", "topology.kubernetes.io/zone"]


# -- the helm test, and no demo objects


def test_the_helm_test_pod_sends_through_broker_zero(render: Render, one: One) -> None:
    objects = render()
    pod = one(objects, "Pod", "demo-lmq-test")
    assert pod["metadata"]["annotations"] == {
        "helm.sh/hook": "test",
        "helm.sh/hook-delete-policy": "before-hook-creation,hook-succeeded",
    }
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
    (container,) = spec["containers"]
    assert container["command"] == ["python", "-m", "lmq_broker.roundtrip"]
    assert container["image"] == main_container(one(objects, "StatefulSet"))["image"]
    assert container["args"] == [
        "--endpoint",
        f"{BROKER}-0.{POD_DOMAIN}:8081",
        "--admin-endpoint",
        f"{BROKER}-0.{POD_DOMAIN}:8082",
    ]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    assert refs == {
        "LMQ_ADMIN_ACCESS_KEY": {"name": "demo-lmq-admin", "key": "accessKey"},
        "LMQ_ADMIN_SECRET_KEY": {"name": "demo-lmq-admin", "key": "secretKey"},
    }
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert [o for o in render({"test": {"enabled": False}}) if o["kind"] == "Pod"] == []


def test_brokers_start_without_demo_objects_unless_asked(render: Render, one: One) -> None:
    for extra, bootstrap in (([], False), (["--bootstrap"], True)):
        broker = main_container(one(render({"broker": {"extraArgs": extra}}), "StatefulSet"))
        args = [a.replace("$(POD_NAME)", f"{BROKER}-0") for a in broker["args"]]
        assert broker_cli.config_from(broker_cli.build_parser().parse_args(args), {}).bootstrap is bootstrap


# -- CRDs as templates


def test_templated_crds_are_the_generated_ones_kept_on_uninstall(
    render: Render, crds: dict[str, Manifest], render_notes: Callable[..., str]
) -> None:
    assert [o for o in render() if o["kind"] == "CustomResourceDefinition"] == []
    rendered = {o["spec"]["names"]["kind"]: o for o in render({"crds": {"templated": True}})
                if o["kind"] == "CustomResourceDefinition"}  # fmt: skip
    assert rendered.keys() == crds.keys()
    for kind, crd in rendered.items():
        assert crd["spec"] == crds[kind]["spec"]  # the generated bytes, not a hand-kept copy
        assert crd["metadata"]["name"] == crds[kind]["metadata"]["name"]
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert "namespace" not in crd["metadata"]
    notes = render_notes({"crds": {"templated": True}})
    assert "--skip-crds" in notes and "kubectl apply --server-side -f crds/" not in notes


# -- persistence


def test_values_yaml_says_which_persistence_keys_are_fixed_after_install(chart_dir: Path) -> None:
    """volumeClaimTemplates cannot change: values.yaml (the manual) says so on each key that feeds them."""
    text = (chart_dir / "values.yaml").read_text()
    section = text[text.index("  persistence:") - 800 : text.index("    retentionPolicy:")]
    assert "volumeClaimTemplates" in section and "Forbidden" in section
    persistence = yaml.safe_load(text)["broker"]["persistence"]
    for key in ("enabled", "storageClassName", "accessModes", "size", "annotations"):
        assert key in persistence
        comment = section[: section.index(f"    {key}:")].rsplit("# --", 1)[1]
        assert "Fixed" in comment, key
