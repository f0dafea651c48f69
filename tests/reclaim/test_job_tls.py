"""The job, in local mode, against a broker as the chart runs it with tls.enabled: admin on its own port, TLS,
dialled by address and checked against the server name. The CA and the name travel from the driver's
options into the executors' Python workers with the scan and delete tasks."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from lmq_broker import model, testing
from lmq_broker.admin import tls
from lmq_broker.admin.client import AdminClient
from lmq_reclaim import job, options

NAME = "demo-lmq-broker.mq.svc"


def test_a_run_over_tls_reclaims_and_records(
    tmp_path: Path, spark: SparkSession, seeder: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    now_ms = int(time.time() * 1000)
    parents = [model.ParentTopic("Agent", expiration_minutes=60)]
    groups = [model.LiteGroup("G", bind_topic="Agent")]
    seeder(tmp_path / "data", now_ms, parents, groups, [("Agent", "old", 180, None), ("Agent", "fresh", 5, None)])
    cert = testing.issue_certificate(tmp_path / "tls", NAME)
    args = ["--no-bootstrap", "--admin-port", "0", "--tls-cert", str(cert.cert), "--tls-key", str(cert.key)]
    broker = testing.start_broker(tmp_path / "data", extra_args=args, env=testing.SHARED_ADMIN_ENV)
    try:
        monkeypatch.setenv(tls.CA_ENV, str(cert.ca))
        monkeypatch.setenv(tls.SERVER_NAME_ENV, NAME)
        opts = options.parse(["--brokers", broker.admin_endpoint, "--now-ms", str(now_ms), "--run-id", "tls-run"])
        result = job.run(opts, spark=spark)
        assert result.exit_code == 0, result.error_messages
        (summary,) = result.brokers.values()
        # the scan brings only topics idle long enough to expire (pushdown): the fresh one stays on the broker
        assert (summary.scanned, summary.expired, summary.reclaimed, summary.errors) == (1, 1, 1, 0)
        with AdminClient(broker.admin_endpoint, 10.0, tls=tls.client_tls(), **testing.SHARED_ADMIN_KEYS) as admin:
            assert [t.meta.lite for t in admin.list_lite_topics("Agent").topics] == ["fresh"]
            last = admin.get_parent_topic("Agent").last_reclaim
            assert last is not None and (last.run_id, last.reclaimed) == ("tls-run", 1)
    finally:
        broker.stop()
