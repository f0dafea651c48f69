"""The real job against one real pod of ``serve --processes 2``, found as the chart finds it (the pod's address,
``--broker-port`` its first admin port, ``--broker-processes 2``): each process is its own broker with its own
store, so an expired topic held by process 1 is reclaimed too, not only process 0's.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from lmq_broker import errors, model, testing
from lmq_broker.admin.client import AdminClient
from lmq_reclaim import discovery, job, options

PARENT = model.ParentTopic("Agent", expiration_minutes=60)
PROCESSES = 2


def consecutive_free_ports(count: int) -> int:
    """A first port whose next ``count - 1`` are free too (serve --processes uses --port + 1 + i)."""
    for _ in range(50):
        with ExitStack() as held:
            first = held.enter_context(socket.socket())
            first.bind(("127.0.0.1", 0))
            base = int(first.getsockname()[1])
            try:
                for offset in range(1, count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", base + offset))
            except OSError:
                continue
            return base
    raise AssertionError(f"no {count} consecutive free ports")


@pytest.mark.slow
def test_the_job_reclaims_on_every_process_of_a_pod(
    tmp_path: Path, spark: SparkSession, seeder: Callable[..., None]
) -> None:
    now_ms = int(time.time() * 1000)
    # Process i's store is <data-dir>/p<i>: an expired and a fresh topic in each.
    for i in range(PROCESSES):
        seeder(
            tmp_path / "pod" / f"p{i}",
            now_ms,
            [PARENT],
            [],
            [("Agent", f"old-{i}", 180, None), ("Agent", f"new-{i}", 5, None)],
        )
    port = consecutive_free_ports(1 + PROCESSES)
    args = ["--processes", str(PROCESSES), "--no-bootstrap", "--broker-name", "pod-0"]
    with testing.start_broker(tmp_path / "pod", port=port, extra_args=args, env=testing.SHARED_ADMIN_ENV):
        # 127.0.0.1 stands in for the headless Service's name (it resolves to the one pod's address).
        argv = ["--broker-service", "127.0.0.1", "--broker-port", str(port + 1)]
        argv += ["--broker-processes", str(PROCESSES), "--now-ms", str(now_ms)]
        opts = options.parse(argv)
        endpoints = discovery.discover(opts)
        assert endpoints == [f"127.0.0.1:{port + 1 + i}" for i in range(PROCESSES)]

        result = job.run(opts, spark=spark)

        assert sorted(result.brokers) == ["pod-0-p0", "pod-0-p1"]  # both processes planned, by their own names
        assert (result.total.reclaimed, result.total.errors, result.exit_code) == (2, 0, 0)
        for i, endpoint in enumerate(endpoints):
            with AdminClient(endpoint, **testing.SHARED_ADMIN_KEYS) as admin:
                assert admin.broker_info(with_undrained=False).broker_name == f"pod-0-p{i}"
                assert admin.describe_lite_topic("Agent", f"new-{i}").meta.lite == f"new-{i}"
                with pytest.raises(errors.NotFound):
                    admin.describe_lite_topic("Agent", f"old-{i}")
