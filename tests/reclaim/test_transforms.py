"""The decision, as pure DataFrame functions on tiny frames (real SparkSession, local[1])."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, Observation, SparkSession
from pyspark.sql import functions as sf

from lmq_reclaim import columns as c
from lmq_reclaim import job, options, transforms
from lmq_reclaim.columns import Outcome, Verdict

MIN = transforms.MS_PER_MINUTE
NOW = 1_000_000 * MIN


def scanned_row(
    lite: str,
    *,
    broker: str = "b0",
    parent: str = "P",
    idle_min: float = 0,
    created_min_ago: float | None = None,
    consume_min_ago: float | None = None,
    subscribers: int = 0,
    fully: bool | None = None,
) -> tuple[Any, ...]:
    store = NOW - int(idle_min * MIN)
    created = NOW - int((created_min_ago if created_min_ago is not None else idle_min + 1) * MIN)
    consume = NOW - int(consume_min_ago * MIN) if consume_min_ago is not None else 0
    return (broker, parent, lite, created, store, consume, 0, 1, subscribers, fully)


def frame(spark: SparkSession, rows: list[tuple[Any, ...]]) -> DataFrame:
    return spark.createDataFrame(rows, c.SCANNED_DDL)


def policy(spark: SparkSession, rows: list[tuple[str, str, int]]) -> DataFrame:
    return spark.createDataFrame(rows, c.POLICY_DDL)


def verdicts(
    spark: SparkSession, rows: list[tuple[Any, ...]], rules: transforms.Rules, pol: list[Any]
) -> dict[str, str]:
    decided = transforms.decide(transforms.attach_policy(frame(spark, rows), policy(spark, pol)), rules)
    return {r[c.LITE]: r[c.VERDICT] for r in decided.collect()}


def test_idle_longer_than_expiration_and_min_age_expires(spark: SparkSession) -> None:
    rows = [
        scanned_row("old", idle_min=61),
        scanned_row("edge", idle_min=60),  # exactly the expiration: not yet (RocketMQ expires on ">")
        scanned_row("fresh", idle_min=5),
    ]
    got = verdicts(spark, rows, transforms.Rules(now_ms=NOW, min_age_ms=15 * MIN), [("b0", "P", 60)])
    assert got == {"old": Verdict.EXPIRED, "edge": Verdict.FRESH, "fresh": Verdict.FRESH}


def test_the_pushed_down_cutoff_never_hides_a_row_that_decide_expires(spark: SparkSession) -> None:
    opts = options.Options(min_age_minutes=15)
    for expiration in (0, 10, 15, 60):
        cutoff = job.idle_cutoff_ms(NOW, opts, expiration)
        horizon = max(expiration, 15)
        rows = [
            scanned_row(f"idle{ms}", idle_min=ms / MIN, created_min_ago=10**4)
            for ms in (horizon * MIN - 1, horizon * MIN, horizon * MIN + 1, 10**4 * MIN)
        ]
        got = verdicts(spark, rows, transforms.Rules(now_ms=NOW, min_age_ms=15 * MIN), [("b0", "P", expiration)])
        passes = {row[2] for row in rows if max(row[3], row[4], row[5]) < cutoff}
        assert {lite for lite, v in got.items() if v == Verdict.EXPIRED} <= passes, expiration
        assert f"idle{horizon * MIN - 1}" not in passes  # the filter does skip what cannot expire
    assert job.idle_cutoff_ms(NOW, options.Options(pushdown=False), 60) == 0


def test_min_age_holds_back_short_expirations(spark: SparkSession) -> None:
    rows = [scanned_row("ten", idle_min=10), scanned_row("twenty", idle_min=20)]
    got = verdicts(spark, rows, transforms.Rules(now_ms=NOW, min_age_ms=15 * MIN), [("b0", "P", 0)])
    assert got == {"ten": Verdict.BELOW_MIN_AGE, "twenty": Verdict.EXPIRED}


def test_never_expires_and_unknown_parent_are_kept(spark: SparkSession) -> None:
    rows = [
        scanned_row("a", parent="Never", idle_min=10**5),
        scanned_row("b", parent="Unknown", idle_min=10**5),
        scanned_row("c", parent="P", broker="b1", idle_min=10**5),  # P is known on b0 only
    ]
    pol = [("b0", "Never", -1), ("b0", "P", 1)]
    got = verdicts(spark, rows, transforms.Rules(now_ms=NOW), pol)
    assert got == {"a": Verdict.NEVER, "b": Verdict.NO_POLICY, "c": Verdict.NO_POLICY}


def test_recent_consume_or_creation_counts_as_activity(spark: SparkSession) -> None:
    rows = [
        scanned_row("consumed", idle_min=500, consume_min_ago=3),
        scanned_row("created", idle_min=500, created_min_ago=3),
        scanned_row("idle", idle_min=500, consume_min_ago=400),
    ]
    got = verdicts(spark, rows, transforms.Rules(now_ms=NOW), [("b0", "P", 60)])
    assert got == {"consumed": Verdict.FRESH, "created": Verdict.FRESH, "idle": Verdict.EXPIRED}


def test_optional_rules_keep_unconsumed_and_subscribed_topics(spark: SparkSession) -> None:
    rows = [
        scanned_row("unconsumed", idle_min=500, fully=False),
        scanned_row("unknown", idle_min=500, fully=None),
        scanned_row("subscribed", idle_min=500, fully=True, subscribers=2),
        scanned_row("done", idle_min=500, fully=True),
    ]
    pol = [("b0", "P", 60)]
    strict = transforms.Rules(now_ms=NOW, only_fully_consumed=True, no_live_subscribers=True)
    assert verdicts(spark, rows, strict, pol) == {
        "unconsumed": Verdict.NOT_FULLY_CONSUMED,
        "unknown": Verdict.NOT_FULLY_CONSUMED,
        "subscribed": Verdict.SUBSCRIBED,
        "done": Verdict.EXPIRED,
    }
    lenient = transforms.Rules(now_ms=NOW)
    assert set(verdicts(spark, rows, lenient, pol).values()) == {Verdict.EXPIRED}


def test_candidates_are_the_expired_rows_and_the_audit_gives_their_reason(spark: SparkSession) -> None:
    rows = [scanned_row("old", idle_min=125), scanned_row("fresh", idle_min=1)]
    rules = transforms.Rules(now_ms=NOW, no_live_subscribers=True)
    decided = transforms.decide(transforms.attach_policy(frame(spark, rows), policy(spark, [("b0", "P", 60)])), rules)
    why = "idle 125 min > expiration 60 min; min age 15 min; no live subscribers"
    assert {r[c.LITE]: r[c.REASON] for r in decided.collect()} == {"old": why, "fresh": None}
    got = transforms.candidates(decided).collect()
    assert [r[c.LITE] for r in got] == ["old"]
    assert tuple(got[0].asDict()) == c.CANDIDATE_COLUMNS
    assert got[0][c.IDLE_MS] == 125 * MIN
    outcomes = transforms.candidates(decided).select(
        "*", sf.lit(Outcome.DELETED.value).alias(c.OUTCOME), sf.lit(None).cast("string").alias(c.ERROR)
    )
    assert [r[c.REASON] for r in transforms.audit(outcomes, rules, dry_run=False).collect()] == [why]


def test_verdict_metrics_count_per_broker_in_the_same_pass(spark: SparkSession) -> None:
    rows = [
        scanned_row("x", broker="b0", idle_min=500),
        scanned_row("y", broker="b0", idle_min=1),
        scanned_row("z", broker="b1", idle_min=500),
    ]
    pol = [("b0", "P", 60), ("b1", "P", 60)]
    decided = transforms.decide(transforms.attach_policy(frame(spark, rows), policy(spark, pol)), transforms.Rules(NOW))
    obs = Observation("t")
    kept = transforms.candidates(decided.observe(obs, *transforms.verdict_metrics(["b0", "b1", "b2"]))).count()
    assert kept == 2
    assert obs.get == {
        "scanned_0": 2, "expired_0": 1, "scanned_1": 1, "expired_1": 1, "scanned_2": 0, "expired_2": 0,
    }  # fmt: skip


def test_audit_lists_reclaimed_rows_and_counts_group_outcomes(spark: SparkSession) -> None:
    outcome_rows = [
        ("b0", "P", "a", 1, 0, 1, 0, 90 * MIN, 60, Outcome.DELETED.value, None),
        ("b0", "P", "b", 1, 0, 1, 0, 90 * MIN, 60, Outcome.KEPT_CHANGED.value, None),
        ("b1", "P", "c", 1, 0, 1, 0, 90 * MIN, 60, Outcome.DELETED.value, None),
        ("b1", "P", "d", 1, 0, 1, 0, 90 * MIN, 60, Outcome.WOULD_DELETE.value, None),
    ]
    outcomes = spark.createDataFrame(outcome_rows, c.OUTCOMES_DDL)
    rules = transforms.Rules(now_ms=7, min_age_ms=30 * MIN, only_fully_consumed=True)
    audit = transforms.audit(outcomes, rules, dry_run=False).collect()
    assert sorted(r[c.LITE] for r in audit) == ["a", "c"]
    why = "idle 90 min > expiration 60 min; min age 30 min; fully consumed"
    assert {(r["run_now_ms"], r["dry_run"], r[c.REASON]) for r in audit} == {(7, False, why)}
    dry = transforms.audit(outcomes, rules, dry_run=True).collect()
    assert [r[c.LITE] for r in dry] == ["d"]
    obs = Observation("outcomes")
    assert outcomes.observe(obs, *transforms.outcome_metrics(["b0", "b1"])).count() == 4
    counts = {name: n for name, n in obs.get.items() if n}
    assert counts == {"DELETED_0": 1, "KEPT_CHANGED_0": 1, "DELETED_1": 1, "WOULD_DELETE_1": 1}
    assert len(obs.get) == 2 * len(Outcome)  # every (broker, outcome), zeros included


def test_session_is_headless_and_quiet(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> None:
    conf = spark.sparkContext.getConf()
    assert conf.get("spark.ui.enabled") == "false"
    assert conf.get("spark.ui.showConsoleProgress") == "false"
    local = Path(conf.get("spark.local.dir", ""))
    # the fixture's tmp dir (under xdist, the worker's own base: .../pytest-N/popen-gwK/spark0)
    assert local.name.startswith("spark") and local.parent == tmp_path_factory.getbasetemp()
    assert "log4j2.configurationFile" in (conf.get("spark.driver.extraJavaOptions") or "")


def test_every_broker_gets_a_partition_of_its_own(spark: SparkSession) -> None:
    # The delete step relies on this: one token bucket per broker sees all of that broker's deletes.
    names = [f"broker-{i}" for i in range(5)]
    rows = [scanned_row(f"t{j}", broker=names[j % 5]) for j in range(200)]
    spread = job.one_partition_per_broker(spark, frame(spark, rows), names)
    placed = spread.select(c.BROKER, sf.spark_partition_id().alias("p")).distinct().collect()
    by_broker = {r[c.BROKER]: r["p"] for r in placed}
    assert len(placed) == 5
    assert sorted(by_broker.values()) == [0, 1, 2, 3, 4]
