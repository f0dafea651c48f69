"""The job submitted the way docs/reclaim.md gives it: ``spark-submit --master local[1] …/lmq_reclaim/__main__.py``.

spark-submit starts the JVM and runs the package's ``__main__.py`` as a plain Python file: the job then
builds its session on a JVM it did not launch. One real broker, a handful of lite topics of known ages
(the run's ``now`` is pinned to the seeding instant, so every verdict is exact): the expired ones go, the
fresh ones stay, the table and the exit code say so, and the Parquet audit names exactly what went.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from lmq_broker import errors, model, testing
from lmq_broker.admin.client import AdminClient

REPO = Path(__file__).resolve().parents[2]
SPARK_SUBMIT = Path(sys.executable).parent / "spark-submit"
JOB_FILE = REPO / "reclaim" / "lmq_reclaim" / "__main__.py"

PARENTS = [
    model.ParentTopic("Agent", expiration_minutes=60),
    model.ParentTopic("Short", expiration_minutes=0),
    model.ParentTopic("Forever", expiration_minutes=-1),
]
SEEDS = [
    ("Agent", "old-a", 180, None),
    ("Agent", "old-b", 120, None),
    ("Agent", "recent", 30, None),  # idle 30 min < expiration 60 min
    ("Agent", "consumed", 180, 10),  # stored long ago, consumed 10 min ago
    ("Short", "twenty", 20, None),  # expiration 0, older than the 15 min minimum age
    ("Short", "ten", 10, None),  # expiration 0, but younger than the minimum age
    ("Forever", "ancient", 100_000, None),  # never expires
]
EXPIRED = {("Agent", "old-a"), ("Agent", "old-b"), ("Short", "twenty")}
KEPT = {("Agent", "recent"), ("Agent", "consumed"), ("Short", "ten"), ("Forever", "ancient")}


@pytest.mark.slow
def test_spark_submit_reclaims_the_expired_topics_of_a_live_broker(
    tmp_path: Path,
    seeder: Callable[..., None],
    start_brokers: Callable[[int], list[testing.BrokerProcess]],
) -> None:
    now_ms = int(time.time() * 1000)
    seeder(tmp_path / "broker-0", now_ms, PARENTS, [model.LiteGroup("G", bind_topic="Agent")], SEEDS)
    (broker,) = start_brokers(1)
    audit = tmp_path / "audit" / "reclaim-{now}"  # the chart's form: one directory per run
    # The job's package must be importable by the driver (spark-submit runs a file) and by the Python workers.
    pythonpath = os.pathsep.join(
        p for p in (str(REPO / "reclaim"), str(REPO / "broker"), os.environ.get("PYTHONPATH", "")) if p
    )
    env = {
        **os.environ,
        "PYTHONPATH": pythonpath,
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "LMQ_RECLAIM_RUN_ID": "submitted-1",
    }
    done = subprocess.run(
        [
            *(str(SPARK_SUBMIT), "--master", "local[1]", "--driver-java-options", "-XX:TieredStopAtLevel=1"),
            str(JOB_FILE),
            *("--brokers", broker.admin_endpoint, "--now-ms", str(now_ms), "--local-dir", str(tmp_path / "spark")),
            *("--audit-path", str(audit)),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # The summary: the brokers return only rows idle longer than max(expiration, min age), so "recent",
    # "consumed" and "ten" are not even scanned, and "Forever" is never scanned.
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.strip()}
    assert rows["broker"] == [
        *("broker", "endpoint", "scanned", "expired", "reclaimed"),
        *("kept_changed", "kept_subscribed", "not_found", "errors"),
    ]
    assert rows["broker-0"][1:] == [broker.admin_endpoint, "3", "3", "3", "0", "0", "0", "0"]
    assert rows["TOTAL"][1:] == ["3", "3", "3", "0", "0", "0", "0"]
    assert "recorded: run submitted-1 on 1 broker(s)" in done.stdout
    assert "error:" not in done.stdout  # the job prints its errors on stderr, which spark-submit joins into stdout
    # spark-submit joins the Python driver's stderr (its log) into its own stdout
    assert "spark master local[1]" in done.stdout  # spark-submit's --master holds (the job gives none)

    # The audit: one Parquet directory for this run, one row per reclaimed topic.
    written = tmp_path / "audit" / f"reclaim-{now_ms}"
    assert f"audit: {written}" in done.stdout
    table = pq.read_table(str(written)).to_pylist()
    assert {(r["parent"], r["lite"]) for r in table} == EXPIRED
    assert {(r["broker"], r["outcome"], r["dry_run"], r["run_now_ms"]) for r in table} == {
        ("broker-0", "DELETED", False, now_ms)
    }

    # The broker itself: exactly the expired topics are gone, the others are still there.
    with AdminClient(broker.admin_endpoint, **broker.admin_keys) as admin:
        for parent, lite in EXPIRED:
            with pytest.raises(errors.NotFound):
                admin.describe_lite_topic(parent, lite)
        for parent, lite in KEPT:
            assert admin.describe_lite_topic(parent, lite).meta.lite == lite
