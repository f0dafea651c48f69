"""Fixtures: a real kube-apiserver + etcd (session), the CRDs, real brokers and the operator as a process.

A missing apiserver/etcd binary fails the suite with the command that builds them; nothing here skips.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

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
        plural = {"ParentTopic": "parenttopics", "LiteGroup": "litegroups", "LiteQuota": "litequotas"}[kind]
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
