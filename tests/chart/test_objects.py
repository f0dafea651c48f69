"""What the rendered objects say, field by field: the parts an operator of the cluster relies on (probes,
security, RBAC, storage, wiring between objects) and what each switch in values.yaml turns on or off.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

Manifest = dict[str, Any]
Render = Callable[..., list[Manifest]]
One = Callable[..., Manifest]

CRD_RESOURCES = ("parenttopics", "litegroups", "litequotas", "lmqusers")
BROKER = "demo-lmq-broker"
HEADLESS = "demo-lmq-broker-headless"
OPERATOR = "demo-lmq-operator"


def pod_spec(obj: Manifest) -> dict[str, Any]:
    if obj["kind"] == "CronJob":
        spec: dict[str, Any] = obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        return spec
    spec = obj["spec"]["template"]["spec"]
    return spec


def container(obj: Manifest) -> dict[str, Any]:
    containers = pod_spec(obj)["containers"]
    assert len(containers) == 1
    only: dict[str, Any] = containers[0]
    return only


def env(obj: Manifest) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(obj).get("env", [])}


def rules(role: Manifest) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) triples a Role or ClusterRole grants (to any object of the resource: a rule
    limited to named objects is refused here, see ``named_rules``)."""
    granted = set()
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, f"unexpected rule fields {rule}"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    granted.add((group, resource, verb))
    return granted


def resource_rules() -> set[tuple[str, str, str]]:
    expected = set()
    for resource in CRD_RESOURCES:
        expected |= {("lmq.io", resource, v) for v in ("list", "watch", "patch")}
        expected |= {("lmq.io", f"{resource}/status", "patch")}
    expected |= {("", "events", "create")}
    expected |= {("", "secrets", "get")}  # an LmqUser's Secret, by name: never list or watch
    return expected


def named_rules(role: Manifest) -> set[tuple[str, str, str, tuple[str, ...]]]:
    """(apiGroup, resource, verb, resourceNames) of every rule; () for a rule on every object."""
    return {
        (group, resource, verb, tuple(rule.get("resourceNames", ())))
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


# Leader election: create any Lease (create cannot be limited to a name), read and renew only the operator's.
LEASE_RULES = {
    ("coordination.k8s.io", "leases", "create", ()),
    ("coordination.k8s.io", "leases", "get", (OPERATOR,)),
    ("coordination.k8s.io", "leases", "update", (OPERATOR,)),
}
LEADER_ROLE = f"{OPERATOR}-leader"
BROKER_LEASES_ROLE = f"{BROKER}-leases"  # the brokers' own, with replication (test_replication.py)
SLOT_LEASES_ROLE = f"{OPERATOR}-slot-leases"  # the operator deletes removed slots' Leases, by name (replication)


def rbac_roles(objects: list[Manifest]) -> list[Manifest]:
    """The operator's Roles and ClusterRoles but its leader-election Role (checked on its own)."""
    others = (LEADER_ROLE, BROKER_LEASES_ROLE, SLOT_LEASES_ROLE)
    return [o for o in objects if o["kind"] in ("Role", "ClusterRole") and o["metadata"]["name"] not in others]


CRD_READ = {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")}
NAMESPACES = {("", "namespaces", "list"), ("", "namespaces", "watch")}
BROKER_READ = {
    ("discovery.k8s.io", "endpointslices", "list"),
    ("apps", "statefulsets", "get"),
    ("", "persistentvolumeclaims", "list"),
    # the membership of the brokers: spec.replicas and its annotation, the operator's ConfigMap, Events
    ("apps", "statefulsets", "patch"),
    ("", "configmaps", "get"),
    ("", "configmaps", "create"),
    ("", "configmaps", "patch"),
    ("", "events", "create"),
    ("coordination.k8s.io", "leases", "list"),  # replication: the slots' Leases, read for the status
}


# -- the broker StatefulSet


def test_broker_statefulset_shape(render: Render, one: One) -> None:
    sts = one(render(), "StatefulSet", BROKER)
    spec = sts["spec"]
    assert spec["replicas"] == 2
    assert sts["metadata"]["annotations"] == {"lmq.io/replicas": "2"}
    assert spec["podManagementPolicy"] == "Parallel"
    assert spec["serviceName"] == HEADLESS
    assert spec["updateStrategy"] == {"type": "RollingUpdate"}
    assert spec["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}
    assert spec["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "lmq",
        "app.kubernetes.io/instance": "demo",
        "app.kubernetes.io/component": "broker",
    }
    # The selector picks the pods, and pod labels carry nothing that changes with the chart version.
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert "app.kubernetes.io/version" not in labels and "helm.sh/chart" not in labels


def test_broker_runs_serve_with_its_stable_identity(render: Render, one: One) -> None:
    # R=1 here; the replication flags at R=2 (the default with two pods): test_replication.py
    broker = container(one(render({"broker": {"replication": {"replicas": 1}}}), "StatefulSet", BROKER))
    assert broker["command"] == ["python", "-m", "lmq_broker"]
    assert broker["args"] == [
        "serve",
        "--data-dir",
        "/data",
        "--port",
        "8081",
        "--admin-port",
        "8082",
        "--metrics-port",
        "9100",
        "--broker-name",
        "$(POD_NAME)",
        "--advertised-host",
        f"$(POD_NAME).{HEADLESS}.mq.svc.cluster.local",
        "--advertised-address",
        f"$(POD_NAME).{HEADLESS}.mq.svc.cluster.local:8081",
        "--no-bootstrap",
    ]
    assert broker["env"][0] == {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    # its membership (LMQ_PEERS, LMQ_RING_HISTORY): the operator's ConfigMap once it exists, else the first one
    assert broker["envFrom"] == [
        {"configMapRef": {"name": f"{BROKER}-peers"}},
        {"configMapRef": {"name": "demo-lmq-broker-membership", "optional": True}},
    ]
    assert {(p["name"], p["containerPort"]) for p in broker["ports"]} == {
        ("grpc", 8081),
        ("admin", 8082),
        ("metrics", 9100),
    }


def test_broker_extra_args_and_env_come_after_the_fixed_ones(render: Render, one: One) -> None:
    broker = container(
        one(
            render(
                {
                    "clusterDomain": "corp.local",
                    "broker": {
                        "extraArgs": ["--flush-mode", "async"],
                        "extraEnv": [{"name": "LMQ_MAX_BODY_BYTES", "value": "1024"}],
                        "replication": {"replicas": 1},  # R=2's flags and env: test_replication.py
                    },
                }
            ),
            "StatefulSet",
            BROKER,
        )
    )
    assert broker["args"][-4:] == [
        f"$(POD_NAME).{HEADLESS}.mq.svc.corp.local:8081",
        "--no-bootstrap",
        "--flush-mode",
        "async",
    ]
    names = ["POD_NAME", "LMQ_ADMIN_ACCESS_KEY", "LMQ_ADMIN_SECRET_KEY", "LMQ_ADMIN_ENDPOINT", "LMQ_MAX_BODY_BYTES"]
    assert [e["name"] for e in broker["env"]] == names


def test_acl_values_turn_access_control_on_in_every_broker(render: Render, one: One) -> None:
    assert "--acl" not in container(one(render(), "StatefulSet", BROKER))["args"]  # off by default
    args = container(one(render({"acl": {"enabled": True}}), "StatefulSet", BROKER))["args"]
    assert args.count("--acl") == 1
    assert args.index("--acl") > args.index("--no-bootstrap")  # after the fixed flags, before extraArgs


def test_the_operator_reads_secrets_one_by_name_and_never_lists_them(render: Render, one: One) -> None:
    for values in ({}, {"operator": {"watchNamespace": "apps"}}):
        granted = {(g, r, v) for role in rbac_roles(render(values)) for g, r, v in rules(role)}
        assert {v for g, r, v in granted if (g, r) == ("", "secrets")} == {"get"}, values


def test_broker_probes(render: Render, one: One) -> None:
    broker = container(one(render(), "StatefulSet", BROKER))
    assert broker["startupProbe"] == {
        "httpGet": {"path": "/healthz", "port": "metrics"},
        "initialDelaySeconds": 0,
        "periodSeconds": 5,
        "timeoutSeconds": 3,
        "failureThreshold": 120,
    }
    assert broker["livenessProbe"] == {
        "httpGet": {"path": "/healthz", "port": "metrics"},
        "initialDelaySeconds": 0,
        "periodSeconds": 10,
        "timeoutSeconds": 3,
        "failureThreshold": 3,
    }
    assert broker["readinessProbe"] == {
        "httpGet": {"path": "/readyz", "port": "metrics"},
        "initialDelaySeconds": 0,
        "periodSeconds": 5,
        "timeoutSeconds": 3,
        "failureThreshold": 2,
    }
    tuned = container(one(render({"broker": {"readinessProbe": {"periodSeconds": 2}}}), "StatefulSet", BROKER))
    assert tuned["readinessProbe"]["periodSeconds"] == 2
    assert tuned["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}


def test_broker_volume_claim_template(render: Render, one: One) -> None:
    sts = one(render(), "StatefulSet", BROKER)
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}}}
    mounts = {m["name"]: m["mountPath"] for m in container(sts)["volumeMounts"]}
    assert mounts == {"data": "/data", "tmp": "/tmp"}
    assert [v["name"] for v in pod_spec(sts)["volumes"]] == ["tmp"]  # data comes from the claim

    sized = one(
        render({"broker": {"persistence": {"storageClassName": "fast", "size": "1Ti", "annotations": {"a": "b"}}}}),
        "StatefulSet",
    )
    (claim,) = sized["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == "fast"
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Ti"
    assert claim["metadata"]["annotations"] == {"a": "b"}


def test_broker_without_persistence_uses_an_empty_dir(render: Render, one: One) -> None:
    sts = one(render({"broker": {"persistence": {"enabled": False}}}), "StatefulSet", BROKER)
    assert "volumeClaimTemplates" not in sts["spec"]
    assert "persistentVolumeClaimRetentionPolicy" not in sts["spec"]
    volumes = {v["name"]: v for v in pod_spec(sts)["volumes"]}
    assert volumes["data"] == {"name": "data", "emptyDir": {}}


@pytest.mark.parametrize(
    ("kind", "name", "values"),
    [
        ("StatefulSet", BROKER, {}),
        ("Deployment", OPERATOR, {}),
        ("CronJob", "demo-lmq-reclaim", {"reclaim": {"enabled": True}}),
    ],
)
def test_every_pod_runs_non_root_read_only_without_capabilities(
    render: Render, one: One, kind: str, name: str, values: dict[str, Any]
) -> None:
    obj = one(render(values), kind, name)
    assert pod_spec(obj)["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "fsGroup": 10001,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert container(obj)["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
    }
    # With a read-only root, every component gets a writable /tmp.
    assert "/tmp" in {m["mountPath"] for m in container(obj)["volumeMounts"]}


def test_platform_assigned_ids_leave_run_as_non_root(render: Render, one: One) -> None:
    values = {"podSecurity": {"runAsUser": None, "runAsGroup": None, "fsGroup": None}}
    context = pod_spec(one(render(values), "StatefulSet", BROKER))["securityContext"]
    assert context == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


def test_only_the_operator_mounts_an_api_token(render: Render, one: One) -> None:
    # without replication; with it the brokers mount theirs for the slot Leases (test_replication.py)
    objects = render({"reclaim": {"enabled": True}, "broker": {"replication": {"replicas": 1}}})
    assert pod_spec(one(objects, "StatefulSet", BROKER))["automountServiceAccountToken"] is False
    assert pod_spec(one(objects, "CronJob"))["automountServiceAccountToken"] is False
    assert pod_spec(one(objects, "Deployment", OPERATOR))["automountServiceAccountToken"] is True
    for account in [o for o in objects if o["kind"] == "ServiceAccount"]:
        expected = None if account["metadata"]["name"] == OPERATOR else False
        assert account.get("automountServiceAccountToken") is expected, account["metadata"]["name"]


# -- Services and the disruption budget


def test_services(render: Render, one: One) -> None:
    objects = render()
    pod_labels = one(objects, "StatefulSet", BROKER)["spec"]["template"]["metadata"]["labels"]
    operator_labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]

    headless = one(objects, "Service", HEADLESS)["spec"]
    assert headless["clusterIP"] == "None"
    assert headless["publishNotReadyAddresses"] is True
    assert {(p["name"], p["port"], p["targetPort"]) for p in headless["ports"]} == {
        ("grpc", 8081, "grpc"),
        ("admin", 8082, "admin"),  # per pod, for the operator and the reclaim job
        ("metrics", 9100, "metrics"),
    }

    client = one(objects, "Service", BROKER)["spec"]
    assert client["type"] == "ClusterIP"
    assert "clusterIP" not in client and "publishNotReadyAddresses" not in client
    assert [(p["name"], p["port"], p["targetPort"], p["appProtocol"]) for p in client["ports"]] == [
        ("grpc", 8081, "grpc", "grpc")
    ]  # never the admin port: a LoadBalancer client Service must not expose it
    for spec in (headless, client):
        assert spec["selector"].items() <= pod_labels.items()
        assert not spec["selector"].items() <= operator_labels.items()


def test_pod_disruption_budget(render: Render, one: One) -> None:
    given = {"admin": {"existingSecret": "keys"}}  # a generated admin Secret would differ between renders
    objects = render(given)
    pdb = one(objects, "PodDisruptionBudget", BROKER)
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"] == one(objects, "StatefulSet")["spec"]["selector"]
    assert render({**given, "broker": {"podDisruptionBudget": {"enabled": False}}}) == [
        o for o in objects if o["kind"] != "PodDisruptionBudget"
    ]


# -- the operator and its RBAC


def test_operator_deployment(render: Render, one: One) -> None:
    deployment = one(render(), "Deployment", OPERATOR)
    assert deployment["spec"]["replicas"] == 1
    # replicas elect a leader, so a new pod may start beside the old one (it stands by until the old releases)
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    operator = container(deployment)
    assert operator["command"] == ["python", "-m", "lmq_operator"]
    assert "args" not in operator
    assert env(deployment) == {
        "LMQ_OPERATOR_BROKER_SERVICE": HEADLESS,
        "LMQ_OPERATOR_BROKER_NAMESPACE": "mq",
        "LMQ_OPERATOR_BROKER_STATEFULSET": BROKER,
        "LMQ_OPERATOR_BROKER_MEMBERSHIP": "demo-lmq-broker-membership",
        "LMQ_OPERATOR_BROKER_ADDRESS": "{pod}." + HEADLESS + ".mq.svc.cluster.local:8081",
        "LMQ_OPERATOR_BROKER_PROCESSES": "1",
        "LMQ_OPERATOR_BROKER_REPLICATION": "2",  # the chart's default (null: 2 with its 2 pods)
        "LMQ_OPERATOR_SLOT_LEASE_PREFIX": "demo-lmq",
        "LMQ_OPERATOR_BROKER_PORT": "8082",
        "LMQ_OPERATOR_METRICS_PORT": "9101",
        "LMQ_OPERATOR_LIVENESS_ENDPOINT": "http://0.0.0.0:8080/healthz",
        "LMQ_OPERATOR_LEASE_NAME": OPERATOR,
        "LMQ_OPERATOR_LEASE_NAMESPACE": "mq",
        "LMQ_OPERATOR_POD_NAME": {"fieldRef": {"fieldPath": "metadata.name"}},
        "LMQ_OPERATOR_LEASE_DURATION_SECONDS": "15",
        "LMQ_OPERATOR_LEASE_RENEW_DEADLINE_SECONDS": "10",
        "LMQ_OPERATOR_LEASE_RETRY_SECONDS": "2",
        "LMQ_OPERATOR_ACCESS_KEY": {"secretKeyRef": {"name": "demo-lmq-admin", "key": "accessKey"}},
        "LMQ_OPERATOR_SECRET_KEY": {"secretKeyRef": {"name": "demo-lmq-admin", "key": "secretKey"}},
    }
    assert operator["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {(p["name"], p["containerPort"]) for p in operator["ports"]} == {("metrics", 9101), ("health", 8080)}
    assert pod_spec(deployment)["serviceAccountName"] == OPERATOR


def test_operator_replicas_and_leader_election_timings(render: Render, one: One) -> None:
    timings = {"leaseDurationSeconds": 30, "renewDeadlineSeconds": 20, "retryPeriodSeconds": 5}
    deployment = one(render({"operator": {"replicas": 2, "leaderElection": timings}}), "Deployment", OPERATOR)
    assert deployment["spec"]["replicas"] == 2
    found = env(deployment)
    assert [found[f"LMQ_OPERATOR_LEASE_{k}_SECONDS"] for k in ("DURATION", "RENEW_DEADLINE", "RETRY")] == [
        "30",
        "20",
        "5",
    ]


def test_operator_metrics_service_selects_the_operator_pods(render: Render, one: One) -> None:
    objects = render()
    service = one(objects, "Service", f"{OPERATOR}-metrics")
    deployment = one(objects, "Deployment", OPERATOR)
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9101, "targetPort": "metrics", "protocol": "TCP", "appProtocol": "http"}
    ]


def test_the_leader_role_reads_and_renews_only_the_operators_lease(render: Render, one: One) -> None:
    for values in ({}, {"operator": {"watchNamespace": "apps"}}):
        objects = render(values)
        role = one(objects, "Role", LEADER_ROLE)
        assert role["metadata"]["namespace"] == "mq"  # the Lease lives with the operator, not in watched namespaces
        assert named_rules(role) == LEASE_RULES
        binding = one(objects, "RoleBinding", LEADER_ROLE)
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": LEADER_ROLE}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": OPERATOR, "namespace": "mq"}]
        assert env(one(objects, "Deployment", OPERATOR))["LMQ_OPERATOR_LEASE_NAME"] == OPERATOR


def test_operator_watching_one_namespace_is_told_so(render: Render, one: One) -> None:
    deployment = one(render({"operator": {"watchNamespace": "apps"}}), "Deployment")
    assert env(deployment)["LMQ_OPERATOR_NAMESPACE"] == "apps"


def test_cluster_wide_rbac_is_least_privilege(render: Render, one: One) -> None:
    objects = render()
    cluster_role = one(objects, "ClusterRole", OPERATOR)
    assert rules(cluster_role) == CRD_READ | resource_rules()
    broker_role = one(objects, "Role", f"{OPERATOR}-brokers")
    assert broker_role["metadata"]["namespace"] == "mq"
    assert rules(broker_role) == BROKER_READ
    roles = sorted(o["metadata"]["name"] for o in objects if o["kind"] == "Role")
    # R = 2 by default: the brokers' and the operator's on slot Leases
    assert roles == ["demo-lmq-broker-leases", f"{OPERATOR}-brokers", LEADER_ROLE, SLOT_LEASES_ROLE]
    one_copy = render({"broker": {"replication": {"replicas": 1}}})
    assert sorted(o["metadata"]["name"] for o in one_copy if o["kind"] == "Role") == [roles[1], LEADER_ROLE]

    binding = one(objects, "ClusterRoleBinding", OPERATOR)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": OPERATOR}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": OPERATOR, "namespace": "mq"}]
    broker_binding = one(objects, "RoleBinding", f"{OPERATOR}-brokers")
    assert broker_binding["roleRef"]["name"] == f"{OPERATOR}-brokers"
    assert broker_binding["subjects"] == binding["subjects"]


def test_single_namespace_rbac_grants_resources_in_that_namespace_only(render: Render, one: One) -> None:
    objects = render({"operator": {"watchNamespace": "apps"}})
    assert rules(one(objects, "ClusterRole", OPERATOR)) == CRD_READ | NAMESPACES  # both cluster-scoped
    resources_role = one(objects, "Role", OPERATOR)
    assert resources_role["metadata"]["namespace"] == "apps"
    assert rules(resources_role) == resource_rules()
    assert rules(one(objects, "Role", f"{OPERATOR}-brokers")) == BROKER_READ
    binding = one(objects, "RoleBinding", OPERATOR)
    assert binding["metadata"]["namespace"] == "apps"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": OPERATOR}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": OPERATOR, "namespace": "mq"}]


def test_no_rule_uses_wildcards_or_creates_or_deletes_custom_resources(render: Render, one: One) -> None:
    for values in ({}, {"operator": {"watchNamespace": "apps"}}):
        objects = render(values)
        for role in rbac_roles(objects):
            for group, resource, verb in rules(role):
                assert "*" not in (group, resource, verb)
                assert verb in ("get", "list", "watch", "patch", "create")
                assert verb != "create" or resource in ("events", "configmaps")  # configmaps: the membership
        assert named_rules(one(objects, "Role", LEADER_ROLE)) == LEASE_RULES  # update only on its own Lease


def test_rbac_is_the_one_docs_operator_md_documents_and_tests(render: Render, one: One, repo_root: Path) -> None:
    """The operator suite runs the operator with exactly the documented rules; the chart grants the same."""
    text = (repo_root / "docs" / "operator.md").read_text()
    block = re.search(r"<!-- rbac:begin -->\s*```yaml\n(.*?)```\s*<!-- rbac:end -->", text, re.S)
    assert block is not None, "docs/operator.md lost its rbac block"
    documented = rules(yaml.safe_load(block.group(1)))
    # The document lists the union of both modes; namespaces are only needed with one watched namespace.
    for values, expected in (({}, documented - NAMESPACES), ({"operator": {"watchNamespace": "apps"}}, documented)):
        granted = set()
        for role in rbac_roles(render(values)):
            granted |= rules(role)
        assert granted == expected, values
    leader = re.search(r"<!-- rbac-leader:begin -->\s*```yaml\n(.*?)```\s*<!-- rbac-leader:end -->", text, re.S)
    assert leader is not None, "docs/operator.md lost its rbac-leader block"
    lease_name = {("lmq-operator",): (OPERATOR,), (): ()}  # the document's Lease name is the release's here
    documented_leader = {(g, r, v, lease_name[n]) for g, r, v, n in named_rules(yaml.safe_load(leader.group(1)))}
    assert named_rules(one(render(), "Role", LEADER_ROLE)) == documented_leader


def test_with_replication_the_operator_may_delete_slot_leases_by_name_only(render: Render, one: One) -> None:
    """The Leases of slots a scale-down removed (docs/operator.md): delete, by name, slots 0-1023 of this release
    (``broker.replication.removableSlotLeases``), bound to the operator's account; no such Role without
    replication."""
    for more, count in (({}, 1024), ({"removableSlotLeases": 3000}, 3000)):
        role = one(render({"broker": {"replication": {"replicas": 2, **more}}}), "Role", SLOT_LEASES_ROLE)
        names = tuple(f"demo-lmq-slot-{slot}" for slot in range(count))
        assert named_rules(role) == {("coordination.k8s.io", "leases", "delete", names)}
    binding = one(render({"broker": {"replication": {"replicas": 2}}}), "RoleBinding", SLOT_LEASES_ROLE)
    assert binding["roleRef"]["name"] == SLOT_LEASES_ROLE and binding["subjects"][0]["name"] == OPERATOR
    objects = render({"broker": {"replicas": 1}})
    assert not [o for o in objects if o["metadata"]["name"] == SLOT_LEASES_ROLE]


def test_rbac_and_service_accounts_can_be_brought_by_the_user(render: Render, one: One) -> None:
    objects = render(
        {
            "operator": {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "ops"}},
            "broker": {"replication": {"createRole": False}},
        }
    )
    kinds = {o["kind"] for o in objects}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"] == [BROKER, "demo-lmq-reclaim"]
    assert pod_spec(one(objects, "Deployment"))["serviceAccountName"] == "ops"

    with pytest.raises(helm.HelmRenderError, match=r"broker\.serviceAccount\.name is required"):
        render({"broker": {"serviceAccount": {"create": False}}})
    with pytest.raises(helm.HelmRenderError, match=r"operator\.serviceAccount\.name is required"):
        render({"operator": {"serviceAccount": {"create": False}}})


def test_operator_can_be_left_out(render: Render) -> None:
    objects = render({"operator": {"enabled": False}})
    components = {o["metadata"]["labels"]["app.kubernetes.io/component"] for o in objects}
    assert components == {"admin", "broker", "reclaim", "test"}


# -- the reclaim CronJob


def test_reclaim_cronjob_is_present_by_default_and_can_be_left_out(render: Render) -> None:
    components = {o["metadata"]["labels"]["app.kubernetes.io/component"] for o in render()}
    assert components == {"admin", "broker", "operator", "reclaim", "test"}
    without = {o["metadata"]["labels"]["app.kubernetes.io/component"] for o in render({"reclaim": {"enabled": False}})}
    assert without == {"admin", "broker", "operator", "test"}


def test_reclaim_cronjob_when_enabled(render: Render, one: One) -> None:
    objects = render({"reclaim": {"enabled": True}})
    cronjob = one(objects, "CronJob", "demo-lmq-reclaim")
    spec = cronjob["spec"]
    assert spec["schedule"] == "17 * * * *"
    assert "timeZone" not in spec
    assert spec["concurrencyPolicy"] == "Forbid"
    assert spec["suspend"] is False
    assert spec["startingDeadlineSeconds"] == 600
    assert (spec["successfulJobsHistoryLimit"], spec["failedJobsHistoryLimit"]) == (3, 3)
    job = spec["jobTemplate"]["spec"]
    assert (job["backoffLimit"], job["activeDeadlineSeconds"], job["ttlSecondsAfterFinished"]) == (1, 3600, 86400)
    assert pod_spec(cronjob)["restartPolicy"] == "Never"
    assert pod_spec(cronjob)["serviceAccountName"] == "demo-lmq-reclaim"
    reclaim = container(cronjob)
    assert reclaim["command"] == ["python", "-m", "lmq_reclaim"]
    assert reclaim["args"] == [
        "--broker-service",
        HEADLESS,
        "--namespace",
        "mq",
        "--cluster-domain",
        "cluster.local",
        "--broker-port",
        "8082",
        "--master",
        "local[2]",
        "--driver-memory",
        "1g",
        "--class-archive",
        "/opt/lmq/reclaim-classes.jsa",
        "--local-dir",
        "/tmp/spark",
    ]
    assert reclaim["workingDir"] == "/tmp"
    assert env(cronjob) == {
        "HOME": "/tmp",
        # The run id of the records the job leaves on brokers is the Job's name (a label the Job controller sets).
        "LMQ_RECLAIM_RUN_ID": {"fieldRef": {"fieldPath": "metadata.labels['batch.kubernetes.io/job-name']"}},
        # The brokers' admin pair: the job's scans and deletes are admin calls.
        "LMQ_RECLAIM_ACCESS_KEY": {"secretKeyRef": {"name": "demo-lmq-admin", "key": "accessKey"}},
        "LMQ_RECLAIM_SECRET_KEY": {"secretKeyRef": {"name": "demo-lmq-admin", "key": "secretKey"}},
    }
    assert {m["mountPath"]: m["name"] for m in reclaim["volumeMounts"]} == {"/tmp": "scratch"}
    volumes = {v["name"]: v for v in pod_spec(cronjob)["volumes"]}
    assert volumes["scratch"]["emptyDir"] == {"sizeLimit": "4Gi"}
    assert one(objects, "ServiceAccount", "demo-lmq-reclaim")["automountServiceAccountToken"] is False


def test_reclaim_schedule_values(render: Render, one: One) -> None:
    cronjob = one(
        render(
            {
                "clusterDomain": "corp.local",
                "reclaim": {
                    "enabled": True,
                    "timeZone": "Etc/UTC",
                    "sparkMaster": "local[*]",
                    "extraArgs": ["--dry-run", "--min-age-minutes", "60"],
                    "schedule": "0 3 * * *",
                },
            }
        ),
        "CronJob",
    )
    assert cronjob["spec"]["timeZone"] == "Etc/UTC"
    assert cronjob["spec"]["schedule"] == "0 3 * * *"
    args = container(cronjob)["args"]
    assert args[args.index("--cluster-domain") + 1] == "corp.local"
    assert args[args.index("--master") + 1] == "local[*]"
    assert args[-3:] == ["--dry-run", "--min-age-minutes", "60"]


# -- names, labels and the image


def test_every_object_carries_the_recommended_labels(render: Render) -> None:
    for obj in render({"reclaim": {"enabled": True}, "commonLabels": {"team": "mq"}}):
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "lmq"
        assert labels["app.kubernetes.io/instance"] == "demo"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/part-of"] == "lmq"
        assert labels["app.kubernetes.io/version"] == "0.1.0"
        assert labels["helm.sh/chart"] == "lmq-0.1.0"
        assert labels["app.kubernetes.io/component"] in ("admin", "broker", "operator", "reclaim", "test")
        assert labels["team"] == "mq"


def test_names_follow_the_release(render: Render) -> None:
    def names(objects: list[Manifest]) -> set[str]:
        return {o["metadata"]["name"] for o in objects}

    assert names(render(name="lmq")) == {
        "lmq-admin",
        "lmq-broker",
        "lmq-broker-headless",
        "lmq-broker-leases",
        "lmq-broker-peers",
        "lmq-operator",
        "lmq-operator-brokers",
        "lmq-test",
        "lmq-operator-leader",
        "lmq-operator-metrics",
        "lmq-operator-slot-leases",
        "lmq-reclaim",
    }
    assert names(render({"fullnameOverride": "mq"})) == {
        "mq-admin",
        "mq-broker",
        "mq-broker-headless",
        "mq-broker-leases",
        "mq-broker-peers",
        "mq-operator",
        "mq-operator-brokers",
        "mq-test",
        "mq-operator-leader",
        "mq-operator-metrics",
        "mq-operator-slot-leases",
        "mq-reclaim",
    }


DIGEST = "sha256:" + "a" * 64


@pytest.mark.parametrize(
    ("values", "references"),
    [
        ({}, ("lmq-broker:0.1.0", "lmq-operator:0.1.0", "lmq-reclaim:0.1.0")),
        ({"image": {"tag": "1.2.3"}}, ("lmq-broker:1.2.3", "lmq-operator:1.2.3", "lmq-reclaim:1.2.3")),
        (
            {"image": {"repository": "registry.example.org/mq/lmq"}},
            tuple(f"registry.example.org/mq/lmq-{c}:0.1.0" for c in ("broker", "operator", "reclaim")),
        ),
        (
            {"broker": {"image": {"digest": DIGEST}}, "operator": {"image": {"repository": "ops/op"}}},
            (f"lmq-broker@{DIGEST}", "ops/op:0.1.0", "lmq-reclaim:0.1.0"),
        ),
        (
            {"image": {"tag": "1.2.3"}, "reclaim": {"image": {"digest": DIGEST, "repository": "r/spark"}}},
            ("lmq-broker:1.2.3", "lmq-operator:1.2.3", f"r/spark:1.2.3@{DIGEST}"),
        ),
    ],
)
def test_image_reference(render: Render, values: dict[str, Any], references: tuple[str, str, str]) -> None:
    """One image per component ("<image.repository>-<component>"); each may name its own and pin a digest."""
    objects = render({**values, "reclaim": {**values.get("reclaim", {}), "enabled": True}})
    images = {
        o["metadata"]["labels"]["app.kubernetes.io/component"]: c["image"]
        for o in objects
        if o["kind"] in ("StatefulSet", "Deployment", "CronJob", "Pod")
        for c in (o["spec"] if o["kind"] == "Pod" else pod_spec(o))["containers"]
    }
    broker, operator, reclaim = references
    assert images == {"broker": broker, "operator": operator, "reclaim": reclaim, "test": broker}
