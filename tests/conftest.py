"""Test tiers, as markers given at collection (``make check``, ``make test-fast``; ``make test`` runs all).

A marker says which real part a test needs, read from what the test uses rather than written on each test:
``kube`` a real kube-apiserver + etcd (the ``kube`` fixture, or a module that starts one itself), ``spark`` a
real PySpark (the ``spark`` fixture, or a module that drives pyspark/spark-submit itself), ``e2e`` other
processes speaking to a broker (tests/e2e: the official Python client in its own interpreter; tests/clients:
the Java, Go and Node drivers).
``unit`` marks the modules that run in this process on fakes or a tmp_path store, with no socket, child
process or real waiting: ``make check`` runs them in well under a minute. A module named there that no longer
exists fails collection, so the list cannot silently shrink.

``make test`` runs the suites on several pytest-xdist workers (``-n 3 --dist loadgroup --no-loadscope-reorder``).
A worker takes a whole module, so a module's own broker, SparkSession or apiserver starts once (and a test never
meets another module's state); a ``slow`` test is a unit of its own, so one module of long independent runs
(the benchmark smoke runs, the reclaim job's processes) spreads over the workers. The longest units go first,
so none of them is the last one left running while the other workers idle.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import Final

# hypothesis's pytest plugin imports this at the run's terminal summary, and pytest compiles it then. Python
# 3.11 keeps the compiler's AST recursion count per interpreter, not per thread: an official client's thread
# still running at that moment (tests/e2e ends such runs only afterwards, in ``pytest_unconfigure``) that
# compiles too (a dataclass, a lazy import) made it raise "SystemError: AST constructor recursion depth
# mismatch", failing a run whose 94 e2e tests had all passed (a fresh clone). Imported here, before any thread.
import hypothesis.internal.observability  # noqa: F401
import pytest

from lmq_broker import supervisor

TESTS: Final = Path(__file__).resolve().parent
E2E_DIRS: Final = ("e2e", "clients")
SPARK_WORDS: Final = ("pyspark", "spark-submit", "spark_submit")
KUBE_WORDS: Final = ("testenv(", "bench_operator")  # modules that start the real apiserver themselves
UNIT_MODULES: Final = frozenset(
    {
        "admin/test_backup_stream.py",
        "broker/admin/test_expiry.py",
        "broker/cluster/test_cluster.py",
        "broker/cluster/test_external.py",
        "broker/dispatch/test_dispatcher.py",
        "broker/dispatch/test_ingest.py",
        "broker/dispatch/test_leases.py",
        "broker/dispatch/test_quotas.py",
        "broker/dispatch/test_readyset.py",
        "broker/dispatch/test_recent.py",
        "broker/dispatch/test_registry.py",
        "broker/dispatch/test_saved_subscriptions.py",
        "broker/dispatch/test_settlement.py",
        "broker/dispatch/test_subscriptions.py",
        "broker/dispatch/test_topic_filters.py",
        "broker/dispatch/test_wildcards.py",
        "broker/protocol/test_convert.py",
        "operator/test_crd_schema.py",
        "operator/test_election.py",
        "operator/test_resyncing.py",
        "operator/test_scaling.py",
        "mqtt/test_codec.py",
        "mqtt/test_codec5.py",
        "mqtt/test_share_names.py",
        "mqtt/test_topics.py",
        "reclaim/test_ratelimit.py",
        "storage/test_codec.py",
        "storage/test_contract.py",
        "storage/test_keys.py",
    }
)


@cache
def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = sorted(name for name in UNIT_MODULES if not (TESTS / name).is_file())
    if missing:
        raise pytest.UsageError(f"tests/conftest.py UNIT_MODULES names modules that do not exist: {missing}")
    for item in items:
        path = Path(str(item.path)).resolve()
        relative = path.relative_to(TESTS).as_posix()
        fixtures = getattr(item, "fixturenames", ())
        if relative.split("/", 1)[0] in E2E_DIRS:
            item.add_marker(pytest.mark.e2e)
        if "kube" in fixtures or any(word in _text(path) for word in KUBE_WORDS):
            item.add_marker(pytest.mark.kube)
        if "spark" in fixtures or any(word in _text(path) for word in SPARK_WORDS):
            item.add_marker(pytest.mark.spark)
        if relative in UNIT_MODULES:
            item.add_marker(pytest.mark.unit)
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: what goes to one worker, in which order
        for item in items:
            if item.get_closest_marker("slow") is None:
                item.add_marker(pytest.mark.xdist_group(Path(str(item.path)).resolve().relative_to(TESTS).as_posix()))
        items.sort(key=_longest_first)


def _longest_first(item: pytest.Item) -> int:
    """Slow tests, then modules that start a JVM (Spark, the Java client), the apiserver, other clients, the rest."""
    for rank, marker in enumerate(("slow", "spark", "kube", "e2e")):
        if item.get_closest_marker(marker) is not None:
            return rank
    return 4


def _own_ports() -> None:
    """This worker's range of ports for ``--port 0`` and the tests' free ports (``supervisor.free_ports``):
    below the kernel's ephemeral ports, split between the pytest-xdist workers (inherited by the brokers the
    tests start), so that a port released for a restart is not taken meanwhile by another worker's bind(0)."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    first = 10_000
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    size = (ephemeral - first) // workers
    if size < 1_000 or worker >= workers:
        return  # a kernel that hands out low ports: its own choice, as without this
    low = first + worker * size
    os.environ.setdefault(supervisor.FREE_PORTS_ENV, f"{low}-{low + size - 1}")


_own_ports()
