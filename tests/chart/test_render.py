"""The chart renders to objects a Kubernetes 1.34 API server accepts, for every shape the values allow.

kubernetes-validate checks each object against the API's OpenAPI schema in strict mode (unknown fields
fail); on top of that we check what the schemas cannot express: object and label names, port names.
A value set that touches every key (FULL) proves no value is dead: changing any one changes the output.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest

Manifest = dict[str, Any]
Render = Callable[..., list[Manifest]]

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
PORT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # IANA_SVC_NAME, at most 15 characters
# Objects whose names Kubernetes restricts to a DNS label (63), not a subdomain (253).
DNS_LABEL_KINDS = {"Service", "StatefulSet", "CronJob"}
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}

# Every key of values.yaml set to a valid value that differs from its default (except the on/off switches
# that would hide other keys; test_objects.py covers those). The test below checks the coverage.
FULL: dict[str, Any] = {
    "nameOverride": "mq",
    "fullnameOverride": "prod-mq",
    "clusterDomain": "k8s.example.org",
    "commonLabels": {"team": "messaging"},
    "image": {"repository": "registry.example.org/lmq", "tag": "9.9.9", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "podSecurity": {"runAsUser": 20002, "runAsGroup": 20003, "fsGroup": 20004},
    "admin": {"existingSecret": "mq-admin-keys"},
    "acl": {"enabled": True},
    "networkPolicy": {
        "enabled": True,
        "clientFrom": [{"namespaceSelector": {"matchLabels": {"tier": "apps"}}}],
        "adminFrom": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
                "podSelector": {"matchLabels": {"app": "lmq-admin"}},
            }
        ],
        "externalFrom": [{"ipBlock": {"cidr": "203.0.113.0/24"}}],
        "metricsFrom": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.9.0.0/16"]}}],
        "extraIngress": [{"ports": [{"port": 1883, "protocol": "TCP"}], "from": [{"podSelector": {}}]}],
    },
    "tls": {
        "enabled": True,
        "existingSecret": "mq-tls",
        "caSecret": "corp-ca-bundle",
        "caKey": "bundle.pem",
        "serverName": "mq.internal.example.org",
        "certManager": {
            "enabled": True,
            "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer", "group": "certmanager.example.org"},
            "duration": "720h",
            "renewBefore": "240h",
            "extraDnsNames": ["mq.example.org"],
        },
    },
    "crds": {"templated": True},
    "test": {
        "enabled": True,
        "resources": {"requests": {"cpu": "10m", "memory": "48Mi"}, "limits": {"memory": "96Mi"}},
    },
    "operator": {
        "enabled": True,
        "image": {"repository": "registry.example.org/lmq/control", "digest": "sha256:" + "ab" * 32},
        "replicas": 2,
        "leaderElection": {"leaseDurationSeconds": 30, "renewDeadlineSeconds": 20, "retryPeriodSeconds": 4},
        "watchNamespace": "apps",
        "extraEnv": [
            {"name": "LMQ_OPERATOR_LOG_LEVEL", "value": "debug"},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        ],
        "extraVolumes": [{"name": "proxy-ca", "configMap": {"name": "proxy-ca"}}],
        "extraVolumeMounts": [{"name": "proxy-ca", "mountPath": "/etc/proxy-ca", "readOnly": True}],
        "extraContainers": [{"name": "log-shipper", "image": "fluent/fluent-bit:3.1", "args": ["-i", "dummy"]}],
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
        "livenessProbe": {"initialDelaySeconds": 11, "periodSeconds": 16, "timeoutSeconds": 6, "failureThreshold": 5},
        "serviceAccount": {"create": True, "name": "mq-operator-sa", "annotations": {"iam": "operator"}},
        "rbac": {"create": True},
        "podAnnotations": {"prometheus.io/port": "9101"},
        "podLabels": {"tier": "control"},
        "nodeSelector": {"pool": "system"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "arch", "operator": "In", "values": ["amd64"]}]}
                    ]
                }
            }
        },
        "priorityClassName": "system-cluster-critical",
    },
    "broker": {
        "image": {"repository": "registry.example.org/lmq/data", "digest": "sha256:" + "cd" * 32},
        "replicas": 5,
        "processes": 3,
        "replication": {
            "replicas": 3,
            "minInsyncReplicas": 1,
            "replicaLagMaxMs": 500,
            "createRole": True,
            "leaseDurationMs": 3000,
            "removableSlotLeases": 64,
        },
        "extraArgs": ["--flush-mode", "async"],
        "liteTtl": {
            "enabled": True,
            "intervalMs": 60_000,
            "batch": 500,
            "stepPauseMs": 5,
            "minAgeMs": 600_000,
            "cpuShare": 0.01,
        },
        "extraEnv": [{"name": "LMQ_MAX_BODY_BYTES", "value": "1048576"}],
        "extraVolumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}}],
        "extraVolumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
        "extraContainers": [
            {
                "name": "exporter",
                "image": "example.org/exporter:1",
                "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True},
            }
        ],
        "resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"cpu": 4, "memory": "8Gi"}},
        "terminationGracePeriodSeconds": 120,
        "persistence": {
            "enabled": True,
            "storageClassName": "fast-ssd",
            "accessModes": ["ReadWriteOncePod"],
            "size": "200Gi",
            "annotations": {"backup": "daily"},
            "retentionPolicy": {"whenDeleted": "Delete", "whenScaled": "Delete"},
        },
        "startupProbe": {"initialDelaySeconds": 1, "periodSeconds": 6, "timeoutSeconds": 4, "failureThreshold": 200},
        "livenessProbe": {"initialDelaySeconds": 2, "periodSeconds": 11, "timeoutSeconds": 5, "failureThreshold": 6},
        "readinessProbe": {"initialDelaySeconds": 3, "periodSeconds": 7, "timeoutSeconds": 2, "failureThreshold": 3},
        "service": {"type": "LoadBalancer", "annotations": {"lb": "internal"}},
        "external": {
            "enabled": True,
            "port": 9095,
            "type": "NodePort",
            "advertisedAddressTemplate": "nodes.example.org:{ordinal+31100}",
            "advertisedAddresses": ["lb-0.example.org:9095"],
            "nodePortBase": 31100,
            "annotations": {"external-dns.alpha.kubernetes.io/hostname": "mq-{ordinal}.example.org"},
            "externalTrafficPolicy": "Local",
            "bootstrap": {"enabled": True, "annotations": {"lb": "bootstrap"}, "nodePort": 31099},
        },
        "headlessService": {"annotations": {"dns": "yes"}},
        "serviceAccount": {"create": True, "name": "mq-broker-sa", "annotations": {"iam": "broker"}},
        "podDisruptionBudget": {"enabled": True, "maxUnavailable": "34%"},
        "podAnnotations": {"prometheus.io/scrape": "true"},
        "podLabels": {"tier": "data"},
        "nodeSelector": {"pool": "brokers"},
        "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30}],
        "podAntiAffinityPreset": "hard",
        "affinity": {  # no podAntiAffinity of its own: the preset's is added
            "nodeAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 50,
                        "preference": {"matchExpressions": [{"key": "disk", "operator": "In", "values": ["ssd"]}]},
                    }
                ]
            }
        },
        "topologySpread": {
            "topologyKey": "topology.example.org/rack",
            "maxSkew": 2,
            "whenUnsatisfiable": "DoNotSchedule",
        },
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "broker"}},
                "matchLabelKeys": ["controller-revision-hash"],
            }
        ],
        "priorityClassName": "messaging-high",
    },
    "backup": {
        "enabled": True,
        "schedule": "5 1 * * *",
        "timeZone": "Europe/Paris",
        "suspend": True,
        "existingClaim": "mq-backups",
        "keep": 14,
        "startingDeadlineSeconds": 300,
        "backoffLimit": 2,
        "activeDeadlineSeconds": 7200,
        "resources": {"requests": {"cpu": "200m", "memory": "64Mi"}, "limits": {"memory": "192Mi"}},
        "nodeSelector": {"pool": "batch"},
        "tolerations": [{"key": "spot", "operator": "Exists"}],
    },
    "reclaim": {
        "enabled": True,
        "image": {"digest": "sha256:" + "ef" * 32},  # its repository stays "<image.repository>-reclaim"
        "schedule": "*/30 * * * *",
        "timeZone": "Europe/Berlin",
        "suspend": True,
        "concurrencyPolicy": "Replace",
        "startingDeadlineSeconds": 120,
        "successfulJobsHistoryLimit": 1,
        "failedJobsHistoryLimit": 5,
        "backoffLimit": 3,
        "activeDeadlineSeconds": 1800,
        "ttlSecondsAfterFinished": 3600,
        "sparkMaster": "local[4]",
        "driverMemory": "3g",
        "classArchive": "/opt/custom/spark.jsa",
        "minAgeMinutes": 30,
        "onlyFullyConsumed": True,
        "noLiveSubscribers": True,
        "dryRun": True,
        "maxDeletesPerSecond": 500,
        "audit": {"existingClaim": "reclaim-audit", "format": "jsonl"},
        "credentialsSecret": "lmq-keys",
        "extraArgs": ["--dry-run"],
        "extraEnv": [{"name": "TZ", "value": "UTC"}],
        "extraVolumes": [{"name": "hadoop-conf", "configMap": {"name": "hadoop-conf"}}],
        "extraVolumeMounts": [{"name": "hadoop-conf", "mountPath": "/etc/hadoop/conf", "readOnly": True}],
        "scratchSizeLimit": "20Gi",
        "resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "6Gi"}},
        "serviceAccount": {"create": True, "name": "mq-reclaim-sa", "annotations": {"iam": "reclaim"}},
        "podAnnotations": {"sidecar": "off"},
        "podLabels": {"tier": "batch"},
        "nodeSelector": {"pool": "batch"},
        "tolerations": [{"key": "spot", "operator": "Exists"}],
        "affinity": {"podAffinity": {}},
        "priorityClassName": "batch-low",
    },
    "monitoring": {
        "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "kps"}},
        "podMonitor": {"enabled": False, "interval": "1m", "labels": {"release": "kps"}},  # not both: PODS_FULL
        "prometheusRule": {
            "enabled": True,
            "labels": {"release": "kps"},
            "consumerLagThreshold": 250,
            "consumerLagFor": "30m",
            "deadLetterThreshold": 5,
            "diskFreeRatio": 0.25,
            "replicationLagThreshold": 500,
            "replicationFor": "10m",
        },
        "grafanaDashboard": {
            "enabled": True,
            "labels": {"grafana_dashboard": "lmq"},
            "annotations": {"grafana_folder": "Messaging"},
        },
    },
}
# Kinds of the Prometheus Operator: kubernetes-validate has no schema for them (conftest.MONITORING_SCHEMAS has).
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}

# Switches FULL leaves at their default so the parts they guard render; each is tested on its own.
SWITCHES = {
    ("operator", "enabled"),
    ("reclaim", "enabled"),
    ("broker", "liteTtl", "enabled"),
    ("broker", "replication", "createRole"),
    ("operator", "rbac", "create"),
    ("operator", "serviceAccount", "create"),
    ("broker", "persistence", "enabled"),
    ("broker", "serviceAccount", "create"),
    ("broker", "podDisruptionBudget", "enabled"),
    ("broker", "external", "bootstrap", "enabled"),
    ("reclaim", "serviceAccount", "create"),
    ("networkPolicy", "enabled"),
    ("test", "enabled"),
    ("monitoring", "podMonitor", "enabled"),  # the schema refuses it beside serviceMonitor: PODS_FULL turns it on
}

# Overrides FULL leaves at their default so that the key they override still shows (test_objects.py's
# test_image_reference sets them).
OVERRIDES = {("reclaim", "image", "repository")}

MINIMAL: dict[str, Any] = {
    "operator": {"enabled": False},
    "networkPolicy": {"enabled": False},
    "test": {"enabled": False},
    "broker": {
        "replicas": 1,
        "persistence": {"enabled": False},
        "podDisruptionBudget": {"enabled": False},
        "serviceAccount": {"create": False, "name": "default"},
    },
    "podSecurity": {"runAsUser": None, "runAsGroup": None, "fsGroup": None},
}

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "full": FULL,
    "minimal": MINIMAL,
    "reclaim-on": {"reclaim": {"enabled": True}},
    "backup-on": {"backup": {"enabled": True, "existingClaim": "lmq-backups"}},
    "single-namespace": {"operator": {"watchNamespace": "apps"}},
    "no-rbac": {"operator": {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "ops"}}},
    "tls-from-a-secret": {"tls": {"enabled": True, "existingSecret": "mq-tls"}, "reclaim": {"enabled": True}},
    "no-spread": {"broker": {"podAntiAffinityPreset": "none", "topologySpread": {"topologyKey": ""}}},
    "external-load-balancers": {
        "broker": {
            "replicas": 3,
            "external": {"enabled": True, "advertisedAddressTemplate": "mq-{ordinal}.example.org:9094"},
        }
    },
    "external-port-forward": {
        "broker": {"replicas": 1, "external": {"enabled": True, "type": "ClusterIP", "nodePortBase": 31100}},
        "networkPolicy": {"enabled": False},
    },
    "processes": {"broker": {"processes": 2}, "networkPolicy": {"clientFrom": [{"podSelector": {}}]}},
}
# Kinds of other projects' CRDs, which kubernetes-validate has no schema for (test_production.py checks them).
FOREIGN_KINDS = {("cert-manager.io/v1", "Certificate")}


def leaves(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Leaf keys of a values tree: scalars, lists and empty maps (maps of user keys such as labels)."""
    out: dict[tuple[str, ...], Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(leaves(value, (*prefix, key)))
        else:
            out[(*prefix, key)] = value
    return out


_MISSING = object()


def value_at(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = tree
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return _MISSING
        node = node[key]
    return node


def with_leaf(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(tree)
    node = changed
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return changed


def check_names(obj: Manifest, namespace: str) -> None:
    kind, meta = obj["kind"], obj["metadata"]
    name = meta["name"]
    if kind in DNS_LABEL_KINDS:
        assert DNS_LABEL.match(name) and len(name) <= 63, f"{kind} name {name!r} is not a DNS label"
    else:
        assert DNS_SUBDOMAIN.match(name) and len(name) <= 253, f"{kind} name {name!r} is not a DNS subdomain"
    if kind == "StatefulSet":
        # Pods are "<name>-<ordinal>" and carry "controller-revision-hash: <name>-<10 chars>" (a label value).
        assert len(name) <= 52, f"StatefulSet name {name!r} is too long for its revision label"
    if kind in CLUSTER_SCOPED:
        assert "namespace" not in meta, f"cluster-scoped {kind} {name} has a namespace"
    elif kind not in ("Role", "RoleBinding"):  # those may live in the watched namespace
        assert meta["namespace"] == namespace, f"{kind} {name} in {meta.get('namespace')}"
    for labels in _label_maps(obj):
        for key, value in labels.items():
            prefix, _, label = key.rpartition("/")
            assert LABEL_NAME.match(label) and len(label) <= 63, f"bad label key {key!r} in {kind} {name}"
            assert not prefix or DNS_SUBDOMAIN.match(prefix), f"bad label prefix {key!r} in {kind} {name}"
            assert isinstance(value, str), f"label {key} of {kind} {name} is not a string: {value!r}"
            assert LABEL_VALUE.match(value) and len(value) <= 63, f"bad label value {key}={value!r} in {kind} {name}"
    for container in _containers(obj):
        for port in container.get("ports", []):
            assert PORT_NAME.match(port["name"]) and len(port["name"]) <= 15, f"bad port name {port['name']!r}"
    for port in obj.get("spec", {}).get("ports", []) if kind == "Service" else []:
        assert PORT_NAME.match(port["name"]) and len(port["name"]) <= 15, f"bad service port name {port['name']!r}"


def _label_maps(obj: Manifest) -> list[dict[str, Any]]:
    maps = [obj["metadata"].get("labels", {})]
    spec = obj.get("spec", {})
    if "selector" in spec and isinstance(spec["selector"], dict):
        maps.append(spec["selector"].get("matchLabels", spec["selector"]))
    template = _pod_template(obj)
    if template is not None:
        maps.append(template["metadata"].get("labels", {}))
    return maps


def _pod_template(obj: Manifest) -> dict[str, Any] | None:
    spec = obj.get("spec", {})
    if obj["kind"] == "CronJob":
        template: dict[str, Any] = spec["jobTemplate"]["spec"]["template"]
        return template
    if obj["kind"] in ("Deployment", "StatefulSet"):
        template = spec["template"]
        return template
    return None


def _containers(obj: Manifest) -> list[dict[str, Any]]:
    template = _pod_template(obj)
    if template is None:
        return []
    containers: list[dict[str, Any]] = template["spec"]["containers"]
    return containers


@pytest.mark.parametrize("case", sorted(VALUE_SETS))
def test_every_rendered_object_is_valid_for_kubernetes(
    render: Render, kube_version: str, namespace: str, case: str, monitoring_schemas: dict[str, Any]
) -> None:
    objects = render(VALUE_SETS[case])
    assert objects, "nothing rendered"
    for obj in objects:
        check_names(obj, namespace)
        if (obj["apiVersion"], obj["kind"]) in FOREIGN_KINDS:
            continue
        if obj["kind"] in MONITORING_KINDS:
            jsonschema.validate(obj, monitoring_schemas[obj["kind"]])
        else:
            validated = kubernetes_validate.validate(obj, kube_version, strict=True)
            assert validated == kube_version


@pytest.mark.parametrize("case", sorted(VALUE_SETS))
def test_helm_lint_is_clean(chart_dir: Path, kube_version: str, case: str) -> None:
    report = helm.lint(chart_dir, VALUE_SETS[case], strict=True, kube_version=f"v{kube_version}.0")
    assert report["errors"] == []
    # Severity 1 is informational ("icon is recommended"); warnings (2) and errors (3) fail.
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert problems == [], problems


def test_strict_validation_catches_an_unknown_field(render: Render, kube_version: str) -> None:
    """Guards the test above: the validator really is strict."""
    statefulset = next(o for o in render() if o["kind"] == "StatefulSet")
    statefulset["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(statefulset, kube_version, strict=True)


def test_the_longest_release_name_still_gives_valid_names(render: Render, kube_version: str, namespace: str) -> None:
    name = "a" * 53  # Helm's limit for release names
    helm.validate_release_name(name)
    objects = render({"reclaim": {"enabled": True}}, name=name)
    for obj in objects:
        check_names(obj, namespace)
        if (obj["apiVersion"], obj["kind"]) not in FOREIGN_KINDS:
            kubernetes_validate.validate(obj, kube_version, strict=True)


def test_rendering_is_deterministic(render: Render) -> None:
    # Restarting nothing on a no-op upgrade needs byte-identical specs from identical values.
    assert render(FULL) == render(copy.deepcopy(FULL))


def test_full_values_set_every_documented_key(chart: helm.Chart) -> None:
    defaults = leaves(chart.values)
    missing = sorted(".".join(path) for path in defaults if value_at(FULL, path) is _MISSING and path not in OVERRIDES)
    assert missing == [], f"keys of values.yaml that FULL does not set: {missing}"
    exempt = SWITCHES | OVERRIDES
    same = sorted(path for path in defaults if defaults[path] == value_at(FULL, path) and path not in exempt)
    assert same == [], f"FULL keeps these at their defaults, so they would not be tested: {same}"


def _full_for(path: tuple[str, ...]) -> str:
    """Which full value set tests ``path``: FULL, or for the PodMonitors' keys FULL with the PodMonitors
    instead of the ServiceMonitors (the schema refuses both)."""
    return "pods" if path[:2] == ("monitoring", "podMonitor") else "full"


def test_no_value_is_dead(render_text: Callable[..., dict[str, str]], chart: helm.Chart) -> None:
    """Setting any single key back to its default changes the rendered output."""
    defaults = leaves(chart.values)
    pods = with_leaf(FULL, ("monitoring", "serviceMonitor", "enabled"), False)
    fulls = {"full": FULL, "pods": with_leaf(pods, ("monitoring", "podMonitor", "enabled"), True)}
    baselines = {name: render_text(values) for name, values in fulls.items()}
    dead = []
    for path, default in sorted(defaults.items()):
        if path in SWITCHES or path in OVERRIDES:
            continue
        full, baseline = fulls[_full_for(path)], baselines[_full_for(path)]
        try:
            changed = render_text(with_leaf(full, path, copy.deepcopy(default)))
        except (helm.HelmRenderError, helm.HelmValuesError):
            continue  # refused at its default (a required value, e.g. tls.certManager.issuerRef.name, or one the
            # schema requires once its feature is on, e.g. backup.existingClaim): it matters
        if changed == baseline:
            dead.append(".".join(path))
    assert dead == [], f"values that change nothing: {dead}"


def test_notes_give_the_quick_start_and_the_crd_upgrade_rule(
    render_notes: Callable[..., str], release: str, namespace: str
) -> None:
    notes = render_notes()
    assert f"rollout status statefulset/{release}-lmq-broker" in notes
    assert f"{release}-lmq-broker.{namespace}.svc.cluster.local:8081" in notes
    assert "kubectl apply --server-side -f crds/" in notes
    assert "replace --force" in notes
    assert "persistence is OFF" not in notes
    assert "persistence is OFF" in render_notes({"broker": {"persistence": {"enabled": False}}})


def test_the_packaged_chart_carries_crds_schema_and_examples(chart_dir: Path, tmp_path: Path) -> None:
    archive = helm.package(chart_dir, destination=tmp_path)
    with helm.Chart.load(archive) as packaged:
        assert packaged.metadata["name"] == "lmq"
        assert len(packaged.crds) == len(list((chart_dir / "crds").glob("*.yaml")))
        assert packaged.schema is not None and packaged.schema["additionalProperties"] is False
        names = {f["name"] for f in packaged.files}
        assert {"README.md", "examples/parenttopic.yaml", "examples/litegroup.yaml"} <= names


def test_the_oldest_supported_kubernetes_accepts_the_objects(
    chart: helm.Chart, chart_dir: Path, render: Render
) -> None:
    match = re.fullmatch(r">=\s*(\d+\.\d+)\.0-0", chart.metadata["kubeVersion"])
    assert match, chart.metadata["kubeVersion"]
    oldest = match.group(1)
    for values in (VALUE_SETS["full"], VALUE_SETS["minimal"]):
        for obj in render(values):
            if (obj["apiVersion"], obj["kind"]) in FOREIGN_KINDS:
                continue
            if obj["kind"] in MONITORING_KINDS:
                continue  # not Kubernetes' own: test_every_rendered_object_is_valid_for_kubernetes checks them
            assert kubernetes_validate.validate(obj, oldest, strict=True) == oldest
        report = helm.lint(chart_dir, values, strict=True, kube_version=f"v{oldest}.0")
        assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []
