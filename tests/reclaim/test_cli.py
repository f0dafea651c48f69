"""The job as the CronJob runs it (``python -m lmq_reclaim``): a separate process, its exit code, table and
audit (spark-submit running the package's ``__main__.py`` as the application file: test_spark_submit.py).

One broker is real, one endpoint is dead: the live broker is reclaimed anyway, the dead one is an error
row, and the exit code says the run was partial.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from lmq_broker import model, testing
from lmq_broker.admin.client import AdminClient

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_module_entry_point_reclaims_a_live_broker_and_reports_a_dead_one(
    tmp_path: Path,
    seeder: Callable[..., None],
    start_brokers: Callable[[int], list[testing.BrokerProcess]],
) -> None:
    now_ms = int(time.time() * 1000)
    seeds = [("Agent", f"old-{i}", 120, None) for i in range(3)] + [("Agent", "fresh", 5, None)]
    seeder(tmp_path / "broker-0", now_ms, [model.ParentTopic("Agent", expiration_minutes=60)], [], seeds)
    (broker,) = start_brokers(1)
    audit = tmp_path / "audit"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "lmq_reclaim"),
            *("--brokers", f"{broker.admin_endpoint},127.0.0.1:1", "--now-ms", str(now_ms)),
            *("--audit-path", str(audit), "--audit-format", "jsonl", "--local-dir", str(tmp_path / "spark")),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "LMQ_RECLAIM_RUN_ID": "lmq-reclaim-29000000"},  # as the chart sets it: the Job's name
    )
    assert done.returncode == 1, done.stdout + done.stderr  # partial: one endpoint could not be planned
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.strip()}
    assert rows["broker-0"][2:] == ["3", "3", "3", "0", "0", "0", "0"]  # "fresh" is filtered out by the broker
    assert rows["127.0.0.1:1"][1:] == ["127.0.0.1:1", "0", "0", "0", "0", "0", "0", "1"]
    assert rows["TOTAL"][1:] == ["3", "3", "3", "0", "0", "0", "1"]
    assert "error: plan 127.0.0.1:1" in done.stderr
    # Progress on stderr: each finished scan task with its rows, each broker's deletes when they are done.
    assert re.search(r"^lmq-reclaim: scan task 1/1 done: broker-0 Agent: 3 row\(s\) in \d+\.\ds$", done.stderr, re.M)
    assert re.search(r"^lmq-reclaim: delete broker-0 done: 3 candidates processed$", done.stderr, re.M)
    assert re.search(r"INFO lmq_reclaim: scanned 3 lite topic\(s\), 3 expired", done.stderr)
    # The live broker keeps the run's summary under the Job's name; the dead endpoint was never planned.
    assert "recorded: run lmq-reclaim-29000000 on 1 broker(s)" in done.stdout
    with AdminClient(broker.admin_endpoint, **broker.admin_keys) as admin:
        last = admin.get_parent_topic("Agent").last_reclaim
    assert last is not None
    assert (last.run_id, last.start_ms, last.scanned, last.reclaimed) == ("lmq-reclaim-29000000", now_ms, 3, 3)
    lines = [json.loads(x) for f in sorted(audit.glob("part-*.json")) for x in f.read_text().splitlines()]
    assert sorted(r["lite"] for r in lines) == ["old-0", "old-1", "old-2"]
    # Quiet: Spark's own INFO chatter stays out of the job's output.
    assert " INFO " not in done.stderr.replace("INFO lmq_reclaim", "")


@pytest.mark.slow
@pytest.mark.timeout(900)  # four Spark jobs, each a JVM start: ~30 s apiece quiet, but past 300 s in all at load 13
def test_class_archive_from_the_warmup_or_a_run_is_mapped_by_the_next_run(
    tmp_path: Path,
    seeder: Callable[..., None],
    start_brokers: Callable[[int], list[testing.BrokerProcess]],
) -> None:
    now_ms = int(time.time() * 1000)
    seeder(
        tmp_path / "broker-0",
        now_ms,
        [model.ParentTopic("Agent", expiration_minutes=60)],
        [],
        [("Agent", "old", 120, None)],
    )
    (broker,) = start_brokers(1)
    archive = tmp_path / "classes.jsa"

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                *(sys.executable, "-m", "lmq_reclaim", "--dry-run", "--class-archive", str(archive)),
                *("--brokers", broker.admin_endpoint, "--now-ms", str(now_ms), "--local-dir", str(tmp_path / "spark")),
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )

    def assert_mapped() -> None:
        # -Xshare:on makes the JVM refuse to start unless it maps the archive.
        done = run("--jvm-options=-XX:TieredStopAtLevel=1 -Xshare:on")
        assert done.returncode == 0, done.stdout + done.stderr
        rows = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.strip()}
        assert rows["broker-0"][2:5] == ["1", "1", "1"]  # scanned, expired, would delete

    # The image build's way: a run against a synthetic broker in the warmup process.
    warm = subprocess.run(
        [sys.executable, "-m", "lmq_reclaim.warmup", str(archive)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert warm.returncode == 0, warm.stdout + warm.stderr
    assert "[cds]" not in warm.stdout + warm.stderr  # the dump's warnings about skipped classes are muted
    assert_mapped()

    # Without the file, a run of the job writes it as its JVM exits: aside first, then moved into place.
    archive.unlink()
    first = run()
    assert first.returncode == 0, first.stdout + first.stderr
    assert archive.stat().st_size > 0
    assert not list(tmp_path.glob("classes.jsa.*"))
    assert_mapped()
