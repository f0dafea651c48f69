"""The chart against a real kube-apiserver (the testenv of lmq_operator.testing: apiserver + etcd on
loopback, no kubelet): everything `helm install` would send is accepted with strict field validation,
the CRDs install and re-apply the way the chart's README says, the examples pass the CRDs' CEL rules,
and the operator's RBAC grants exactly what it needs, checked by the API server's own authorizer.

What the offline suites cannot see is checked here: the API server's semantic validation (names, ports,
selectors, label syntax), its admission chain, and RBAC evaluation.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from lmq_broker import testing as broker_testing
from lmq_operator import testing

Manifest = dict[str, Any]
Render = Callable[..., list[Manifest]]

# Where each kind the chart renders lives in the API: (path prefix, plural, namespaced).
API_PATHS = {
    "Secret": ("/api/v1", "secrets", True),
    "Pod": ("/api/v1", "pods", True),
    "ConfigMap": ("/api/v1", "configmaps", True),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies", True),
    "CustomResourceDefinition": ("/apis/apiextensions.k8s.io/v1", "customresourcedefinitions", False),
    "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "Service": ("/api/v1", "services", True),
    "StatefulSet": ("/apis/apps/v1", "statefulsets", True),
    "Deployment": ("/apis/apps/v1", "deployments", True),
    "CronJob": ("/apis/batch/v1", "cronjobs", True),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets", True),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "ParentTopic": ("/apis/lmq.io/v1alpha1", "parenttopics", True),
    "LiteGroup": ("/apis/lmq.io/v1alpha1", "litegroups", True),
    "LiteQuota": ("/apis/lmq.io/v1alpha1", "litequotas", True),
    "LmqUser": ("/apis/lmq.io/v1alpha1", "lmqusers", True),
}
NAMESPACES = ("mq", "apps", "team")
RECONCILE_DEADLINE_S = 90.0


def object_path(obj: Manifest, namespace: str | None = None) -> str:
    prefix, plural, namespaced = API_PATHS[obj["kind"]]
    name = obj["metadata"]["name"]
    if not namespaced:
        return f"{prefix}/{plural}/{name}"
    ns = obj["metadata"].get("namespace", namespace)
    assert ns, f"{obj['kind']} {name} has no namespace"
    return f"{prefix}/namespaces/{ns}/{plural}/{name}"


def apply(api: testing.KubeAPI, obj: Manifest, *, namespace: str | None = None, dry_run: bool = False) -> Any:
    """Server-side apply with strict field validation: an unknown or duplicated field is an error."""
    query = "?fieldManager=lmq-chart-tests&force=true&fieldValidation=Strict"
    if dry_run:
        query += "&dryRun=All"
    return api.request("PATCH", object_path(obj, namespace) + query, obj, content_type="application/apply-patch+yaml")


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[testing.KubeAPI]:
    try:
        env = testing.testenv(tmp_path_factory.mktemp("chart-testenv"))
        api = env.__enter__()
    except testing.TestenvMissing as missing:
        pytest.fail(str(missing), pytrace=False)
    try:
        for namespace in NAMESPACES:
            api.ensure_namespace(namespace)
        yield api
    finally:
        env.__exit__(None, None, None)


@pytest.fixture(scope="module")
def installed_crds(kube: testing.KubeAPI, chart_dir: Path) -> list[str]:
    # The README's upgrade step, `kubectl apply --server-side -f crds/`, is a server-side apply like this.
    return kube.apply_crds(chart_dir / "crds")


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"reclaim": {"enabled": True}, "operator": {"watchNamespace": "apps"}},
        {"broker": {"persistence": {"enabled": False}, "replicas": 1}, "operator": {"enabled": False}},
        {
            "tls": {"enabled": True, "existingSecret": "mq-tls"},
            "reclaim": {"enabled": True, "extraVolumes": [{"name": "x", "emptyDir": {}}]},
            "crds": {"templated": True},
            "networkPolicy": {"adminFrom": [{"namespaceSelector": {"matchLabels": {"team": "ops"}}}]},
            "broker": {
                "podAntiAffinityPreset": "hard",
                "extraContainers": [{"name": "sidecar", "image": "example.org/sidecar:1"}],
                "extraVolumes": [{"name": "extra", "emptyDir": {}}],
                "extraVolumeMounts": [{"name": "extra", "mountPath": "/extra"}],
            },
        },
        {
            "broker": {
                "replicas": 2,
                "external": {
                    "enabled": True,
                    "type": "NodePort",
                    "nodePortBase": 31094,
                    "externalTrafficPolicy": "Local",
                    "advertisedAddressTemplate": "nodes.example.org:{ordinal+31094}",
                    "bootstrap": {"nodePort": 31093},
                },
            },
        },
        {"broker": {"replicas": 2, "external": {"enabled": True, "advertisedAddresses": ["a:1", "b:2"]}}},
        {"backup": {"enabled": True, "existingClaim": "lmq-backups"}, "broker": {"processes": 2}},
    ],
    ids=[
        "defaults",
        "reclaim-single-namespace",
        "no-persistence-no-operator",
        "production",
        "external-node-ports",
        "external-load-balancers",
        "backup",
    ],
)
def test_the_api_server_accepts_every_rendered_object(
    kube: testing.KubeAPI, render: Render, values: dict[str, Any]
) -> None:
    objects = render(values)
    assert {o["kind"] for o in objects} <= API_PATHS.keys()
    refused = {}
    for obj in objects:
        try:
            apply(kube, obj, dry_run=True)
        except testing.ApiError as error:
            refused[f"{obj['kind']}/{obj['metadata']['name']}"] = error.message
    assert refused == {}


def test_the_api_server_refuses_what_the_chart_must_never_render(kube: testing.KubeAPI, render: Render) -> None:
    """Guards the test above: strict validation and semantic checks are really on."""
    statefulset = next(o for o in render() if o["kind"] == "StatefulSet")
    statefulset["spec"]["template"]["spec"]["containers"][0]["ports"][0]["name"] = "name-longer-than-15"
    with pytest.raises(testing.ApiError) as invalid:
        apply(kube, statefulset, dry_run=True)
    assert invalid.value.status == 422
    statefulset = next(o for o in render() if o["kind"] == "StatefulSet")
    statefulset["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(testing.ApiError, match="not declared in schema"):
        apply(kube, statefulset, dry_run=True)


def test_every_pod_meets_the_restricted_pod_security_standard(kube: testing.KubeAPI, render: Render) -> None:
    """The pods the workloads would create, admitted by PodSecurity in a namespace enforcing `restricted`."""
    kube.post(
        "/api/v1/namespaces",
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": "restricted", "labels": {"pod-security.kubernetes.io/enforce": "restricted"}},
        },
    )
    templates = {}
    values = {
        "reclaim": {"enabled": True},
        "backup": {"enabled": True, "existingClaim": "lmq-backups"},
        "tls": {"enabled": True, "existingSecret": "mq-tls"},
    }
    for obj in render(values):
        if obj["kind"] == "CronJob":  # the reclaim and the backup job
            templates[obj["metadata"]["name"]] = obj["spec"]["jobTemplate"]["spec"]["template"]
        elif obj["kind"] in ("Deployment", "StatefulSet"):
            templates[obj["kind"]] = obj["spec"]["template"]
        elif obj["kind"] == "Pod":  # the helm test
            templates[obj["kind"]] = obj
    assert set(templates) == {"demo-lmq-reclaim", "demo-lmq-backup", "Deployment", "StatefulSet", "Pod"}
    for kind, template in templates.items():
        spec = dict(template["spec"])
        if kind == "StatefulSet":  # the claim template becomes a volume of the pod
            spec["volumes"] = [*spec["volumes"], {"name": "data", "persistentVolumeClaim": {"claimName": "data-0"}}]
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": kind.lower()}, "spec": spec}
        kube.post("/api/v1/namespaces/restricted/pods?dryRun=All&fieldValidation=Strict", pod)

    # Guard: the same namespace refuses a pod that may escalate.
    spec = dict(templates["Deployment"]["spec"])
    spec["containers"] = [{**spec["containers"][0], "securityContext": {"allowPrivilegeEscalation": True}}]
    with pytest.raises(testing.ApiError, match="restricted"):
        kube.post(
            "/api/v1/namespaces/restricted/pods?dryRun=All",
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "escalating"}, "spec": spec},
        )


def test_a_reclaim_job_gets_the_label_its_run_id_is_read_from(kube: testing.KubeAPI, render: Render) -> None:
    """The CronJob's pods take LMQ_RECLAIM_RUN_ID from a label of their own: the API server must put it on the
    pod template of every Job made from the jobTemplate (as the CronJob controller makes them)."""
    cronjob = next(o for o in render({"reclaim": {"enabled": True}}) if o["kind"] == "CronJob")
    (container,) = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    field_path = next(e for e in container["env"] if e["name"] == "LMQ_RECLAIM_RUN_ID")["valueFrom"]["fieldRef"]
    label = field_path["fieldPath"].removeprefix("metadata.labels['").removesuffix("']")
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "demo-lmq-reclaim-29000000"},
        "spec": cronjob["spec"]["jobTemplate"]["spec"],
    }
    stored = kube.post("/apis/batch/v1/namespaces/mq/jobs?dryRun=All&fieldValidation=Strict", job)
    assert stored["spec"]["template"]["metadata"]["labels"][label] == "demo-lmq-reclaim-29000000"


def holds(stored: Any, given: Any) -> bool:
    """``stored`` is ``given`` with defaults added, at any depth (in the objects of a list too)."""
    if isinstance(given, dict):
        return isinstance(stored, dict) and all(k in stored and holds(stored[k], v) for k, v in given.items())
    if isinstance(given, list):
        return isinstance(stored, list) and len(stored) == len(given) and all(map(holds, stored, given))
    return bool(stored == given)


def test_examples_pass_the_crds_including_their_cel_rules(
    kube: testing.KubeAPI, installed_crds: list[str], chart_dir: Path
) -> None:
    assert sorted(installed_crds) == [
        "litegroups.lmq.io",
        "litequotas.lmq.io",
        "lmqusers.lmq.io",
        "parenttopics.lmq.io",
    ]
    examples = [
        doc
        for path in sorted((chart_dir / "examples").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]
    for doc in examples:
        stored = apply(kube, doc, namespace="team")
        assert holds(stored["spec"], doc["spec"]), doc  # nothing pruned, only defaults added

    # Re-applying the CRDs (the upgrade step) keeps every custom resource.
    kube.apply_crds(chart_dir / "crds")
    for doc in examples:
        assert kube.exists(object_path(doc, "team"))


def test_examples_break_only_where_a_cel_rule_says_so(kube: testing.KubeAPI, installed_crds: list[str]) -> None:
    quota = {
        "apiVersion": "lmq.io/v1alpha1",
        "kind": "LiteQuota",
        "metadata": {"name": "both-scopes"},
        "spec": {"parentTopic": "agent-replies", "rocketmqNamespace": "tenant-a"},
    }
    with pytest.raises(testing.ApiError) as refused:
        apply(kube, quota, namespace="team", dry_run=True)
    assert refused.value.status == 422
    assert "exactly one of" in refused.value.message


def test_templated_crds_upgrade_the_installed_ones_in_place_and_are_kept(
    kube: testing.KubeAPI, installed_crds: list[str], render: Render, chart_dir: Path
) -> None:
    """crds.templated: the chart's CRD objects applied over the ones crds/ installed (what `helm upgrade` does
    once the release owns them) are accepted with strict validation, stay Established, carry the keep policy that
    `helm uninstall` honours, and leave every custom resource in place."""
    (topic,) = [
        doc
        for doc in yaml.safe_load_all((chart_dir / "examples" / "parenttopic.yaml").read_text())
        if doc and doc["kind"] == "ParentTopic"
    ]
    topic["metadata"]["name"] = "survives-crd-upgrade"
    apply(kube, topic, namespace="team")
    crds = [o for o in render({"crds": {"templated": True}}) if o["kind"] == "CustomResourceDefinition"]
    assert sorted(c["metadata"]["name"] for c in crds) == sorted(installed_crds)
    for crd in crds:
        stored = apply(kube, crd)
        assert stored["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert stored["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    for crd in crds:
        deadline = time.monotonic() + 30
        while not any(
            c["type"] == "Established" and c["status"] == "True"
            for c in kube.get(object_path(crd)).get("status", {}).get("conditions", [])
        ):
            assert time.monotonic() < deadline, crd["metadata"]["name"]
            time.sleep(0.1)
    assert kube.exists(object_path(topic, "team"))


# -- RBAC, decided by the API server's authorizer


@pytest.fixture(scope="module")
def releases(kube: testing.KubeAPI, render: Render) -> dict[str, str]:
    """Two installs of the chart's RBAC (for real): cluster-wide and watching namespace "apps", both replicated
    (R=2: the brokers' Lease Role too)."""
    accounts = {}
    replicated = {"broker": {"replication": {"replicas": 2}}}
    for release, values in (("wide", replicated), ("narrow", {**replicated, "operator": {"watchNamespace": "apps"}})):
        for obj in render(values, name=release):
            if obj["kind"] in ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"):
                apply(kube, obj)
        accounts[release] = f"system:serviceaccount:mq:{release}-lmq-operator"
    return accounts


Action = tuple[str, str, str]  # (verb, resource[/subresource], API group)


def can(kube: testing.KubeAPI, user: str, action: Action, namespace: str = "", name: str = "") -> bool:
    verb, resource, group = action
    resource, _, subresource = resource.partition("/")
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": user,
            "groups": ["system:serviceaccounts", "system:serviceaccounts:mq", "system:authenticated"],
            "resourceAttributes": {
                "verb": verb,
                "group": group,
                "resource": resource,
                "subresource": subresource,
                "namespace": namespace,
                "name": name,
            },
        },
    }
    answer = kube.post("/apis/authorization.k8s.io/v1/subjectaccessreviews", review)
    return bool(answer["status"].get("allowed", False))


# What kopf and the operator do (docs/operator.md): follow and patch their resources, patch status, post
# events, follow the CRDs, and read the brokers' EndpointSlices, StatefulSet and volume claims.
NEEDED_EVERYWHERE: list[Action] = [
    ("list", "parenttopics", "lmq.io"),
    ("watch", "litegroups", "lmq.io"),
    ("patch", "litequotas", "lmq.io"),
    ("patch", "litegroups/status", "lmq.io"),
    ("create", "events", ""),
]
NEEDED_FOR_BROKERS: list[Action] = [
    ("list", "endpointslices", "discovery.k8s.io"),
    ("get", "statefulsets", "apps"),
    ("list", "persistentvolumeclaims", ""),
    ("patch", "statefulsets", "apps"),  # the membership: spec.replicas, its own ConfigMap
    ("get", "configmaps", ""),
    ("create", "configmaps", ""),
    ("patch", "configmaps", ""),
]
NEVER: list[Action] = [
    ("create", "parenttopics", "lmq.io"),
    ("update", "parenttopics", "lmq.io"),
    ("delete", "litegroups", "lmq.io"),
    ("deletecollection", "litequotas", "lmq.io"),
    ("update", "litequotas/status", "lmq.io"),
    ("list", "secrets", ""),
    ("list", "configmaps", ""),
    ("delete", "configmaps", ""),
    ("create", "pods", ""),
    ("update", "statefulsets", "apps"),
    ("delete", "persistentvolumeclaims", ""),
    ("watch", "persistentvolumeclaims", ""),
    ("create", "customresourcedefinitions", "apiextensions.k8s.io"),
]


def test_cluster_wide_operator_may_do_its_job_and_nothing_more(kube: testing.KubeAPI, releases: dict[str, str]) -> None:
    user = releases["wide"]
    for action in NEEDED_EVERYWHERE:
        for namespace in ("team", "apps"):
            assert can(kube, user, action, namespace), (action, namespace)
    for action in NEEDED_FOR_BROKERS:
        assert can(kube, user, action, "mq"), action
        assert not can(kube, user, action, "team"), (action, "outside the brokers' namespace")
    assert can(kube, user, ("list", "customresourcedefinitions", "apiextensions.k8s.io"))
    assert not can(kube, user, ("list", "namespaces", ""))  # kopf watches cluster-wide without them
    for action in NEVER:
        for namespace in ("mq", "team"):
            assert not can(kube, user, action, namespace), (action, namespace)


def test_the_operator_may_hold_its_own_lease_and_no_other(kube: testing.KubeAPI, releases: dict[str, str]) -> None:
    """Leader election: create a Lease, read and renew the release's own one, in the release namespace only."""
    for release, user in releases.items():
        lease = f"{release}-lmq-operator"
        assert can(kube, user, ("create", "leases", "coordination.k8s.io"), "mq")
        for verb in ("get", "update"):
            assert can(kube, user, (verb, "leases", "coordination.k8s.io"), "mq", lease), (release, verb)
            assert not can(kube, user, (verb, "leases", "coordination.k8s.io"), "mq", "kube-scheduler"), verb
            assert not can(kube, user, (verb, "leases", "coordination.k8s.io"), "apps", lease), verb
        for verb in ("delete", "watch", "patch"):
            assert not can(kube, user, (verb, "leases", "coordination.k8s.io"), "mq", lease), (release, verb)
        # replication: it lists the brokers' slot Leases for the status, in the broker namespace only, and deletes
        # those of removed slots: slot Leases only, by name
        assert can(kube, user, ("list", "leases", "coordination.k8s.io"), "mq")
        assert not can(kube, user, ("list", "leases", "coordination.k8s.io"), "apps")
        for slot in (0, 2, 255, 1023):  # broker.replication.removableSlotLeases: 1024 by default
            assert can(kube, user, ("delete", "leases", "coordination.k8s.io"), "mq", f"{release}-lmq-slot-{slot}")
        assert not can(kube, user, ("delete", "leases", "coordination.k8s.io"), "mq", f"{release}-lmq-slot-1024")
        assert not can(kube, user, ("delete", "leases", "coordination.k8s.io"), "apps", f"{release}-lmq-slot-2")


def test_the_brokers_may_use_leases_in_their_namespace_and_nowhere_else(
    kube: testing.KubeAPI, releases: dict[str, str]
) -> None:
    """Replication (R=2, as the releases are installed): exactly get, list, create and update on Leases, in the release
    namespace: what lmq_broker.replication.kube calls (docs/replication.md)."""
    for release in releases:
        broker = f"system:serviceaccount:mq:{release}-lmq-broker"
        for verb in ("get", "list", "create", "update"):
            assert can(kube, broker, (verb, "leases", "coordination.k8s.io"), "mq", f"{release}-lmq-slot-0"), verb
            assert not can(kube, broker, (verb, "leases", "coordination.k8s.io"), "apps"), verb
        for verb in ("delete", "watch", "patch"):
            assert not can(kube, broker, (verb, "leases", "coordination.k8s.io"), "mq"), verb
        assert not can(kube, broker, ("get", "secrets", ""), "mq")


def test_single_namespace_operator_is_confined_to_it(kube: testing.KubeAPI, releases: dict[str, str]) -> None:
    user = releases["narrow"]
    for action in NEEDED_EVERYWHERE:
        assert can(kube, user, action, "apps"), action
        assert not can(kube, user, action, "team"), (action, "outside its namespace")
    for action in NEEDED_FOR_BROKERS:
        assert can(kube, user, action, "mq"), action
    assert can(kube, user, ("watch", "customresourcedefinitions", "apiextensions.k8s.io"))
    assert can(kube, user, ("watch", "namespaces", ""))  # kopf matches its namespace pattern
    for action in NEVER:
        assert not can(kube, user, action, "apps"), action


# -- the operator itself, running with nothing but the chart's ServiceAccount and RBAC


def service_account_kubeconfig(kube: testing.KubeAPI, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig holding a token of the ServiceAccount (what the pod's mounted token would be)."""
    request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}}
    token = kube.post(f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token", request)["status"]["token"]
    ca = base64.b64encode(kube.ca_file.read_bytes()).decode()
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": kube.server, "certificate-authority-data": ca}}],
                "users": [{"name": account, "user": {"token": token}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": account}}],
                "current-context": "c",
            }
        )
    )
    return path


def publish_broker_pod(
    kube: testing.KubeAPI, headless: Manifest, pod: str, address: str, ports: dict[str, int]
) -> None:
    """The EndpointSlice the cluster's controller would derive from the chart's headless Service: each Service
    port under its name, at the port the (local) broker listens on for the container port it targets."""
    namespace = headless["metadata"]["namespace"]
    kube.post(
        f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": f"{headless['metadata']['name']}-x1",
                "labels": {"kubernetes.io/service-name": headless["metadata"]["name"]},
            },
            "addressType": "IPv4",
            # The slice names the port after the Service port; on the pod it is the container port.
            "ports": [
                {"name": p["name"], "port": ports[p["targetPort"]], "protocol": "TCP"}
                for p in headless["spec"]["ports"]
            ],
            "endpoints": [
                {
                    "addresses": [address],
                    "hostname": pod,
                    "conditions": {"ready": True},
                    "targetRef": {"kind": "Pod", "name": pod, "namespace": namespace},
                }
            ],
        },
    )


@pytest.mark.parametrize(
    ("release", "values", "namespace"),
    [
        ("live", {}, "team"),
        (
            "solo",
            {"operator": {"watchNamespace": "apps"}, "tls": {"enabled": True, "existingSecret": "solo-tls"}},
            "apps",
        ),
    ],
    ids=["cluster-wide", "single-namespace-tls"],
)
def test_the_operator_reconciles_with_only_the_charts_rbac(  # noqa: PLR0915 (one scenario told start to end)
    *,
    kube: testing.KubeAPI,
    installed_crds: list[str],
    render: Render,
    chart_dir: Path,
    tmp_path: Path,
    release: str,
    values: dict[str, Any],
    namespace: str,
) -> None:
    objects = render(values, name=release)
    by_kind = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    for obj in objects:  # the release, for real (no kubelet: nothing runs, the objects exist)
        apply(kube, obj)
    # EndpointSlices refuse loopback addresses: the broker listens on every interface, and the slice names
    # this machine's own address.
    # The broker pod's admin pair comes from the chart's generated Secret, as the kubelet would pass it.
    admin_secret = by_kind["Secret", f"{release}-lmq-admin"]
    pair = {key: base64.b64decode(value).decode() for key, value in admin_secret["data"].items()}
    admin_env = {"LMQ_ADMIN_ACCESS_KEY": pair["accessKey"], "LMQ_ADMIN_SECRET_KEY": pair["secretKey"]}
    # The broker listens as the chart's does: admin on a port of its own, TLS when the values ask for it.
    statefulset = by_kind["StatefulSet", f"{release}-lmq-broker"]
    chart_args = statefulset["spec"]["template"]["spec"]["containers"][0]["args"]
    args = ["--host", "0.0.0.0", "--admin-port", "0"]
    assert chart_args[chart_args.index("--admin-port") + 1] == "8082"
    certificate = None
    if "--tls-cert" in chart_args:
        certificate = broker_testing.issue_certificate(tmp_path / "tls", f"{release}-lmq-broker.mq.svc")
        args += ["--tls-cert", str(certificate.cert), "--tls-key", str(certificate.key)]
    broker = broker_testing.start_broker(tmp_path / "data", extra_args=args, env=admin_env)
    operator = None
    try:
        headless = by_kind["Service", f"{release}-lmq-broker-headless"]
        ports = {"grpc": broker.port, "admin": broker.admin_port, "metrics": broker.metrics_port}
        publish_broker_pod(kube, headless, f"{release}-lmq-broker-0", testing.host_ip(), ports)

        deployment = by_kind["Deployment", f"{release}-lmq-operator"]
        pod_spec = deployment["spec"]["template"]["spec"]
        (container,) = pod_spec["containers"]
        chart_env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        for entry in container["env"]:  # the operator's admin pair: from the same Secret
            ref = entry.get("valueFrom", {}).get("secretKeyRef")
            if ref is not None:
                assert ref["name"] == admin_secret["metadata"]["name"]
                chart_env[entry["name"]] = pair[ref["key"]]
        # Ports: the pod has its own network; start_operator picks free ones on this shared machine.
        for local in ("LMQ_OPERATOR_METRICS_PORT", "LMQ_OPERATOR_LIVENESS_ENDPOINT"):
            chart_env.pop(local)
        if certificate is not None:  # the CA file where the chart mounts it: here, the test CA's path
            (ca_volume,) = [v for v in pod_spec["volumes"] if v["name"] == "tls-ca"]
            assert ca_volume["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
            assert chart_env["LMQ_TLS_CA"] == "/etc/lmq/ca/ca.crt"
            chart_env["LMQ_TLS_CA"] = str(certificate.ca)
        else:
            assert "LMQ_TLS_CA" not in chart_env
        kubeconfig = service_account_kubeconfig(kube, "mq", pod_spec["serviceAccountName"], tmp_path / "sa.yaml")
        operator = testing.start_operator(kube, tmp_path / "operator.log", {**chart_env, "KUBECONFIG": str(kubeconfig)})

        (topic,) = [
            doc
            for doc in yaml.safe_load_all((chart_dir / "examples" / "parenttopic.yaml").read_text())
            if doc and doc["kind"] == "ParentTopic"
        ]
        topic["metadata"]["name"] = f"rbac-check-{release}"
        topic["spec"]["topicName"] = f"rbac-check-{release}"
        apply(kube, topic, namespace=namespace)
        path = object_path(topic, namespace)

        def ready() -> dict[str, Any] | None:
            status = kube.get(path).get("status", {})
            conditions = {c["type"]: c for c in status.get("conditions", [])}
            return status if conditions.get("Ready", {}).get("status") == "True" else None

        deadline = time.monotonic() + RECONCILE_DEADLINE_S
        status = ready()
        while status is None:
            assert time.monotonic() < deadline, (
                f"not Ready: {kube.get(path).get('status')}\n{operator.output()[-3000:]}"
            )
            assert operator.proc.poll() is None, operator.output()[-3000:]
            time.sleep(0.1)
            status = ready()
        assert status["brokersReady"] == "1/1"
        assert "forbidden" not in operator.output().lower(), operator.output()[-3000:]
    finally:
        if operator is not None:
            operator.stop()
        broker.stop()
        if broker.process.stdout is not None:  # start_broker leaves its pipe to the garbage collector
            broker.process.stdout.close()
