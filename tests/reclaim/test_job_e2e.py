"""The real job in local mode against real broker processes: expired, fresh, never-expiring, consumed,
subscribed and racing lite topics; dry run, reclaim with races between scan and delete, re-run; and the
per-parent summary each broker keeps of the last run (what the operator shows as status.lastReclaim).

Ages are written through the store API with an injected clock before the brokers start, and the job
runs with ``now_ms`` pinned to the same instant, so every verdict is exact.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from pyspark.sql import DataFrame, SparkSession

from lmq_broker import config, errors, model, testing
from lmq_broker.admin.client import AdminClient
from lmq_broker.storage.store import open_store
from lmq_reclaim import columns as c
from lmq_reclaim import job, options

PARENTS = [
    model.ParentTopic("Agent", expiration_minutes=60),
    model.ParentTopic("Forever", expiration_minutes=-1),
    model.ParentTopic("Short", expiration_minutes=0),
]
GROUPS = [model.LiteGroup("G", bind_topic="Agent")]
BROKER_0 = [
    ("Agent", "old-a", 180, None),
    ("Agent", "old-b", 180, None),
    ("Agent", "fresh", 30, None),
    ("Agent", "consumed-late", 180, 10),
    ("Agent", "done", 180, 170),
    ("Agent", "race-msg", 180, None),
    ("Agent", "race-sub", 180, None),
    ("Agent", "gone", 180, None),
    ("Forever", "ancient", 100_000, None),
    ("Short", "ten", 10, None),  # expiration 0 but younger than the 15 min minimum age
    ("Short", "twenty", 20, None),
]
BROKER_1 = [
    ("Agent", "b1-old-1", 180, None),
    ("Agent", "b1-old-2", 180, None),
    ("Agent", "b1-old-3", 180, None),
    ("Agent", "b1-subscribed", 180, None),
    ("Agent", "b1-sub-grew", 180, None),
    ("Agent", "b1-done", 180, 170),
]
DELETED = {
    ("broker-0", "Agent", "old-a"),
    ("broker-0", "Agent", "old-b"),
    ("broker-0", "Agent", "done"),
    ("broker-0", "Short", "twenty"),
    ("broker-1", "Agent", "b1-old-1"),
    ("broker-1", "Agent", "b1-old-2"),
    ("broker-1", "Agent", "b1-old-3"),
    ("broker-1", "Agent", "b1-subscribed"),  # subscribed before the scan: the default rules still reclaim it
    ("broker-1", "Agent", "b1-done"),
}
RACES = {
    ("broker-0", "Agent", "race-msg"),
    ("broker-0", "Agent", "race-sub"),
    ("broker-0", "Agent", "gone"),
    ("broker-1", "Agent", "b1-sub-grew"),  # subscribed before the scan, and by another client after it
}


def counts(admin: AdminClient, parent: str) -> tuple[object, ...]:
    """The parent's last run as the broker recorded it: run id, dry run, then the counts in table order."""
    run = admin.get_parent_topic(parent).last_reclaim
    assert run is not None, f"no reclaim run recorded for {parent}"
    return (
        run.run_id, run.dry_run, run.scanned, run.expired, run.reclaimed,
        run.kept_changed, run.kept_subscribed, run.not_found, run.errors,
    )  # fmt: skip


@pytest.mark.slow
def test_reclaims_exactly_the_expired_topics_and_keeps_what_changed_after_the_scan(  # noqa: PLR0915 (one scenario told start to end)
    tmp_path: Path,
    spark: SparkSession,
    seeder: Callable[..., None],
    v2_client: Callable[..., Any],
    start_brokers: Callable[[int], list[testing.BrokerProcess]],
) -> None:
    now_ms = int(time.time() * 1000)
    seeder(tmp_path / "broker-0", now_ms, PARENTS, GROUPS, BROKER_0)
    seeder(tmp_path / "broker-1", now_ms, PARENTS[:1], GROUPS, BROKER_1)
    b0, b1 = start_brokers(2)
    v2_b0, v2_b1 = v2_client(b0.endpoint), v2_client(b1.endpoint)
    admins = {
        "broker-0": AdminClient(b0.admin_endpoint, **b0.admin_keys),
        "broker-1": AdminClient(b1.admin_endpoint, **b1.admin_keys),
    }
    try:
        v2_b1.subscribe("Agent", "G", "b1-subscribed")
        v2_b1.subscribe("Agent", "G", "b1-sub-grew")
        base = ["--brokers", f"{b0.admin_endpoint},{b1.admin_endpoint}", "--now-ms", str(now_ms)]

        # 1. Dry run with both optional rules: only fully consumed, unsubscribed topics qualify; nothing goes.
        dry_audit = tmp_path / "audit-dry"
        dry = job.run(
            options.parse(
                [
                    *base,
                    *("--dry-run", "--only-fully-consumed", "--no-live-subscribers", "--run-id", "dry-1"),
                    *("--audit-path", str(dry_audit), "--audit-format", "jsonl"),
                ]
            ),
            spark=spark,
        )
        lines = [json.loads(line) for f in sorted(dry_audit.glob("part-*.json")) for line in f.read_text().splitlines()]
        assert {(r["broker"], r["parent"], r["lite"]) for r in lines} == {
            ("broker-0", "Agent", "done"),
            ("broker-1", "Agent", "b1-done"),
        }
        assert {r["outcome"] for r in lines} == {"WOULD_DELETE"} and all(r["dry_run"] for r in lines)
        assert (dry.total.reclaimed, dry.total.errors, dry.exit_code) == (2, 0, 0)
        for broker, parent, lite in DELETED | RACES:
            assert admins[broker].describe_lite_topic(parent, lite).meta.lite == lite
        # A dry run records too, flagged: only "done" would go of the six Agent rows broker-0 returned.
        assert counts(admins["broker-0"], "Agent") == ("dry-1", True, 6, 1, 1, 0, 0, 0, 0)
        assert counts(admins["broker-0"], "Short") == ("dry-1", True, 1, 0, 0, 0, 0, 0, 0)  # no group: not consumed
        assert counts(admins["broker-1"], "Agent") == ("dry-1", True, 6, 1, 1, 0, 0, 0, 0)

        # 2. The real run; between scan and delete one candidate gets a message, one a subscriber, one is
        #    deleted by someone else, and one that had a subscriber at the scan gets a second one.
        seen: list[set[tuple[str, str, str]]] = []

        def meddle(candidates: DataFrame) -> None:
            seen.append({(r[c.BROKER], r[c.PARENT], r[c.LITE]) for r in candidates.collect()})
            v2_b0.send("Agent", "race-msg")
            v2_b0.subscribe("Agent", "G", "race-sub")
            v2_client(b1.endpoint, "second-client").subscribe("Agent", "G", "b1-sub-grew")
            gone = admins["broker-0"].describe_lite_topic("Agent", "gone").meta
            row: dict[str, list[Any]] = {
                "parent": ["Agent"], "lite": ["gone"], "max_offset": [gone.max_offset],
                "last_store_ms": [gone.last_store_ms], "last_consume_ms": [gone.last_consume_ms],
            }  # fmt: skip
            assert [o.name for o in admins["broker-0"].compare_and_delete(row)] == ["DELETED"]

        audit_path = tmp_path / "audit-{now}"
        result = job.run(
            options.parse([*base, "--audit-path", str(audit_path), "--run-id", "run-2"]),
            spark=spark,
            hooks=job.Hooks(before_delete=meddle),
        )
        assert seen == [DELETED | RACES]
        s0, s1 = result.brokers["broker-0"], result.brokers["broker-1"]
        # Parents that never expire are not even scanned, and the brokers return only rows idle longer than
        # max(expiration, min age): fresh, consumed-late (Agent) and ten (Short) stay on the broker.
        assert (s0.scanned, s0.expired, s0.reclaimed) == (7, 7, 4)
        assert (s0.kept_changed, s0.kept_subscribed, s0.not_found, s0.errors) == (1, 1, 1, 0)
        assert (s1.scanned, s1.expired, s1.reclaimed, s1.kept_subscribed, s1.errors) == (6, 6, 5, 1, 0)
        assert result.exit_code == 0
        # Each broker now holds its own share of this run, per parent, as the parent's last run; the shares
        # add up to the broker's row of the summary table.
        assert (sorted(result.recorded_on), result.record_failures) == (["broker-0", "broker-1"], 0)
        assert counts(admins["broker-0"], "Agent") == ("run-2", False, 6, 6, 3, 1, 1, 1, 0)
        assert counts(admins["broker-0"], "Short") == ("run-2", False, 1, 1, 1, 0, 0, 0, 0)
        assert counts(admins["broker-0"], "Forever") == ("run-2", False, 0, 0, 0, 0, 0, 0, 0)  # not even scanned
        assert counts(admins["broker-1"], "Agent") == ("run-2", False, 6, 6, 5, 0, 1, 0, 0)
        last = admins["broker-0"].get_parent_topic("Agent").last_reclaim
        assert last is not None and last.start_ms == now_ms <= last.finish_ms <= now_ms + 600_000
        for name, summary in result.brokers.items():
            shares = [v for (b, _), v in result.parents.items() if b == name]
            assert summary.scanned == sum(v.scanned for v in shares)
            assert summary.expired == sum(v.expired for v in shares)
            assert summary.reclaimed == sum(v.reclaimed for v in shares)
        audit = pq.read_table(str(tmp_path / f"audit-{now_ms}")).to_pylist()
        assert {(r["broker"], r["parent"], r["lite"]) for r in audit} == DELETED
        assert {r["outcome"] for r in audit} == {"DELETED"}
        old_a = next(r for r in audit if r["lite"] == "old-a")
        assert old_a["reason"] == "idle 180 min > expiration 60 min; min age 15 min"
        assert old_a["idle_ms"] == 180 * 60_000 and old_a["run_now_ms"] == now_ms
        for broker, parent, lite in DELETED | {("broker-0", "Agent", "gone")}:
            with pytest.raises(errors.NotFound):
                admins[broker].describe_lite_topic(parent, lite)
        kept = ["fresh", "consumed-late", "race-msg", "race-sub"]
        assert all(admins["broker-0"].describe_lite_topic("Agent", k).meta.lite == k for k in kept)
        assert admins["broker-0"].describe_lite_topic("Forever", "ancient").meta.lite == "ancient"
        grew = admins["broker-1"].describe_lite_topic("Agent", "b1-sub-grew")
        assert sorted(grew.subscribed_clients) == ["reclaim-test-client", "second-client"]
        assert admins["broker-0"].describe_lite_topic("Short", "ten").meta.lite == "ten"

        # 3. A second run (a CronJob may fire twice) finds nothing more to reclaim.
        again = job.run(options.parse([*base, "--no-live-subscribers"]), spark=spark)
        assert (again.total.expired, again.total.reclaimed, again.total.errors) == (0, 0, 0)
        # Left on broker-0: fresh, consumed-late, race-msg, race-sub (Agent) and ten (Short); only race-sub
        # (idle, but subscribed) passes the brokers' filter, and decide keeps it; on broker-1, b1-sub-grew.
        assert (again.brokers["broker-0"].scanned, again.brokers["broker-1"].scanned) == (1, 1)
        # Without the pushdown every remaining row is scanned and decided in Spark, with the same outcome.
        full = job.run(options.parse([*base, "--no-live-subscribers", "--no-pushdown"]), spark=spark)
        assert (full.total.expired, full.total.reclaimed, full.total.errors) == (0, 0, 0)
        assert (full.brokers["broker-0"].scanned, full.brokers["broker-1"].scanned) == (5, 1)
    finally:
        for a in admins.values():
            a.close()

    # 4. Offsets and index entries are gone from the store itself, not only from the admin view.
    b0.stop()
    store = open_store(config.StoreConfig(data_dir=b0.data_dir))
    try:
        for broker, parent, lite in DELETED | {("broker-0", "Agent", "gone")}:
            if broker != "broker-0":
                continue
            queue = model.QueueId.lmq(parent, lite)
            assert store.lite_topic(parent, lite) is None
            assert store.queue_offsets(queue) == (0, 0)
            assert store.get_offset(queue, "G") is None
            assert store.read(queue, 0, 10) == []
        assert store.get_offset(model.QueueId.lmq("Agent", "consumed-late"), "G") == 1
        assert store.read(model.QueueId.lmq("Agent", "race-msg"), 0, 10)[-1].body == b"late"
    finally:
        store.close()
