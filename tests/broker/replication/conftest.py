"""The real apiserver + etcd of the replication suites: one per test module (each module's leases apart).

lmq_operator is imported inside the fixture: the other Pythons' broker-only venvs load this file too, and run
only this folder's modules that need no apiserver.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from lmq_operator.testing import KubeAPI


@pytest.fixture(scope="module")
def kube(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeAPI]:
    from lmq_operator import testing  # noqa: PLC0415 (see the module's docstring)

    name = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_replication").strip("_") or "replication"
    try:
        env = testing.testenv(tmp_path_factory.mktemp(f"{name}-testenv"))
        api = env.__enter__()
    except testing.TestenvMissing as missing:
        pytest.fail(str(missing), pytrace=False)
    try:
        yield api
    finally:
        env.__exit__(None, None, None)
