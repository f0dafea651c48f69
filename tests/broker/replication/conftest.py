"""The real apiserver + etcd of the replication suites: one per test module (each module's leases apart).

lmq_operator is imported inside the fixture: the other Pythons' broker-only venvs load this file too, and run
only this folder's modules that need no apiserver. A module whose brokers call the apiserver at another address of
this host (a network namespace's peer address) overrides ``kube_reachable_at``; ``namespace`` is the network
namespace of the partition suites (one per module).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from netns import Namespace, NamespaceUnavailable

if TYPE_CHECKING:
    from lmq_operator.testing import KubeAPI


@pytest.fixture(scope="module")
def kube_reachable_at() -> tuple[str, ...]:
    """More addresses of this host the apiserver is called at (``testing.testenv``'s ``reachable_at``)."""
    return ()


@pytest.fixture(scope="module")
def kube(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, kube_reachable_at: tuple[str, ...]
) -> Iterator[KubeAPI]:
    from lmq_operator import testing  # noqa: PLC0415 (see the module's docstring)

    name = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_replication").strip("_") or "replication"
    try:
        env = testing.testenv(tmp_path_factory.mktemp(f"{name}-testenv"), reachable_at=kube_reachable_at)
        api = env.__enter__()
    except testing.TestenvMissing as missing:
        pytest.fail(str(missing), pytrace=False)
    try:
        yield api
    finally:
        env.__exit__(None, None, None)


@pytest.fixture(scope="module")
def namespace() -> Iterator[Namespace]:
    try:
        made = Namespace.make()
    except NamespaceUnavailable as exc:
        pytest.fail(
            "this test partitions brokers with a Linux network namespace and a veth pair and could not make them "
            f"(it needs root, or CAP_NET_ADMIN and CAP_SYS_ADMIN, and iproute2): {exc}",
            pytrace=False,
        )
    try:
        yield made
    finally:
        made.close()
