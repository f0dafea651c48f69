"""Fixtures: a real kube-apiserver + etcd (session), the CRDs, real brokers and the operator as a process.

A missing apiserver/etcd binary fails the suite with the command that builds them; nothing here skips.
"""

from __future__ import annotations

import itertools
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from lmq_broker import testing as broker_testing
from lmq_broker.admin.client import AdminClient
from lmq_operator import testing

_counter = itertools.count()


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[testing.KubeAPI]:
    try:
        env = testing.testenv(tmp_path_factory.mktemp("testenv"))
        api = env.__enter__()
    except testing.TestenvMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield api
    finally:
        env.__exit__(None, None, None)


@pytest.fixture(scope="session")
def crds(kube: testing.KubeAPI) -> list[str]:
    return kube.apply_crds()


@pytest.fixture
def namespace(kube: testing.KubeAPI, crds: list[str]) -> str:
    """A fresh namespace per test, so tests never see each other's resources."""
    name = f"t{next(_counter)}-{uuid.uuid4().hex[:6]}"
    kube.ensure_namespace(name)
    return name


@pytest.fixture
def unique() -> Callable[[str], str]:
    """Broker-side names unique across the session: brokers are shared by tests."""
    suffix = uuid.uuid4().hex[:8]
    return lambda stem: f"{stem}-{suffix}"


@pytest.fixture
def create(kube: testing.KubeAPI) -> Callable[..., Any]:
    def create(kind: str, namespace: str, name: str, spec: dict[str, Any], **meta: Any) -> Any:
        plural = {"ParentTopic": "parenttopics", "LiteGroup": "litegroups", "LiteQuota": "litequotas"}.get(
            kind, f"{kind.lower()}s"
        )
        body = {
            "apiVersion": "lmq.io/v1alpha1",
            "kind": kind,
            "metadata": {"name": name, **meta},
            "spec": spec,
        }
        return kube.post(testing.cr_path(plural, namespace), body)

    return create


@pytest.fixture
def tmp_log(tmp_path: Path) -> Path:
    return tmp_path / "operator.log"


def stop_broker(broker: broker_testing.BrokerProcess) -> None:
    broker.stop()
    if broker.process.stdout is not None:  # the reader thread is done with the pipe; close it
        broker.process.stdout.close()


@pytest.fixture(scope="session")
def brokers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[broker_testing.BrokerProcess]]:
    """Two real brokers shared by the suite (tests use unique broker-side names)."""
    root = tmp_path_factory.mktemp("brokers")
    started: list[broker_testing.BrokerProcess] = []
    try:
        for i in range(2):
            started.append(
                broker_testing.start_broker(
                    root / f"b{i}", extra_args=["--no-bootstrap"], env=broker_testing.SHARED_ADMIN_ENV
                )
            )
        yield started
    finally:
        for b in started:
            stop_broker(b)


@pytest.fixture
def start_broker(tmp_path: Path) -> Iterator[Callable[..., broker_testing.BrokerProcess]]:
    """A broker of one test; stopped (and its pipe closed) at teardown, including every restart. Every broker of
    the suite takes the shared admin pair, as every pod of a release takes the chart's one Secret."""
    started: list[broker_testing.BrokerProcess] = []

    def start(name: str, port: int = 0, extra: tuple[str, ...] = ()) -> broker_testing.BrokerProcess:
        broker = broker_testing.start_broker(
            tmp_path / name, port=port, extra_args=["--no-bootstrap", *extra], env=broker_testing.SHARED_ADMIN_ENV
        )
        started.append(broker)
        return broker

    yield start
    for b in started:
        stop_broker(b)


@pytest.fixture
def admin_of() -> Iterator[Callable[[str], AdminClient]]:
    """A real admin client per endpoint, to look at what the operator did on each broker."""
    opened: dict[str, AdminClient] = {}

    def get(endpoint: str) -> AdminClient:
        if endpoint not in opened:
            opened[endpoint] = AdminClient(endpoint, timeout_s=5.0, **broker_testing.SHARED_ADMIN_KEYS)
        return opened[endpoint]

    yield get
    for client in opened.values():
        client.close()


OPERATOR_ENV: dict[str, str] = {
    "LMQ_OPERATOR_RESYNC_SECONDS": "1.5",
    "LMQ_OPERATOR_DISCOVERY_SECONDS": "0.3",
    "LMQ_OPERATOR_RETRY_SECONDS": "0.5",
    "LMQ_OPERATOR_ADMIN_TIMEOUT_SECONDS": "2",
    "LMQ_OPERATOR_ACCESS_KEY": broker_testing.SHARED_ADMIN_KEYS["access_key"],  # the brokers' shared admin pair
    "LMQ_OPERATOR_SECRET_KEY": broker_testing.SHARED_ADMIN_KEYS["secret_key"],
}


@pytest.fixture
def run_operator(kube: testing.KubeAPI, tmp_path: Path) -> Iterator[Callable[..., testing.OperatorProcess]]:
    """Start ``python -m lmq_operator`` (fast resync for tests); every one started is stopped afterwards."""
    started: list[testing.OperatorProcess] = []

    def run(
        namespace: str, brokers: list[str] | None = None, kubeconfig: Path | None = None, **env: str
    ) -> testing.OperatorProcess:
        full = {**OPERATOR_ENV, "LMQ_OPERATOR_NAMESPACE": namespace, **env}
        if brokers is not None:
            full["LMQ_OPERATOR_BROKERS"] = ",".join(brokers)
        handle = testing.start_operator(kube, tmp_path / f"operator-{len(started)}.log", full, kubeconfig)
        started.append(handle)
        return handle

    yield run
    for handle in started:
        handle.stop()


DOC = testing.REPO / "docs" / "operator.md"


def documented_rbac(marker: str) -> dict[str, Any]:
    """The role in docs/operator.md between ``<!-- marker:begin -->`` and ``<!-- marker:end -->``."""
    block = re.search(rf"<!-- {marker}:begin -->\s*```yaml\n(.*?)```\s*<!-- {marker}:end -->", DOC.read_text(), re.S)
    assert block is not None, f"docs/operator.md lost its {marker} block"
    role: dict[str, Any] = yaml.safe_load(block.group(1))
    return role


@pytest.fixture
def documented_role() -> Callable[[str], dict[str, Any]]:
    return documented_rbac


@pytest.fixture
def bind_documented_rbac(kube: testing.KubeAPI) -> Callable[..., None]:
    """bind(namespace, leader=False): the powerless operator user gets the documented ClusterRole, and with
    ``leader`` the documented Lease Role in ``namespace``; nothing else."""
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    user = [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": testing.OPERATOR_USER}]

    def bind_to(path: str, kind: str, name: str) -> None:
        ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": name}
        binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": f"{kind}Binding"}
        kube.post(path, {**binding, "metadata": {"name": name}, "roleRef": ref, "subjects": user})

    def bind(namespace: str, *, leader: bool = False) -> None:
        cluster_role = documented_rbac("rbac")
        assert cluster_role["kind"] == "ClusterRole"
        cluster_role["metadata"]["name"] = f"lmq-operator-{namespace}"
        kube.post(f"{rbac}/clusterroles", cluster_role)
        bind_to(f"{rbac}/clusterrolebindings", "ClusterRole", cluster_role["metadata"]["name"])
        if leader:
            role = documented_rbac("rbac-leader")
            assert role["kind"] == "Role"
            kube.post(f"{rbac}/namespaces/{namespace}/roles", role)
            bind_to(f"{rbac}/namespaces/{namespace}/rolebindings", "Role", role["metadata"]["name"])

    return bind
