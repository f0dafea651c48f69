"""The reclaim decision as pure DataFrame functions: frames in, frames out, no I/O, no clock.

Everything that decides whether a lite topic goes lives here, so it is unit-tested on tiny frames and the
job only wires it between the scan and the delete. ``now`` and the rules arrive as a value (``Rules``),
never read from the environment.

Idle time follows RocketMQ's TTL check, widened to consumption: ``now - max(created, last store, last
consume)``. A topic expires when that exceeds its parent's expiration and the minimum age (RocketMQ's
``minLiteTTl``, 15 min); expiration -1, or a parent the broker does not know, never expires.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as sf

from lmq_reclaim import columns as c
from lmq_reclaim.columns import Outcome, Verdict

MS_PER_MINUTE = 60_000


@dataclass(frozen=True, slots=True)
class Rules:
    now_ms: int
    min_age_ms: int = 15 * MS_PER_MINUTE
    only_fully_consumed: bool = False
    no_live_subscribers: bool = False


def attach_policy(scanned: DataFrame, policy: DataFrame) -> DataFrame:
    """Each scanned row gets its parent's expiration on that broker (null when the broker lacks it).

    The policy is one row per (broker, parent): tiny, so it is broadcast and the scan is never shuffled.
    """
    return scanned.join(sf.broadcast(policy), on=[c.BROKER, c.PARENT], how="left")


def idle_ms(now_ms: int) -> Column:
    last_activity = sf.greatest(sf.col(c.CREATED_MS), sf.col(c.LAST_STORE_MS), sf.col(c.LAST_CONSUME_MS))
    return sf.lit(now_ms) - last_activity


def decide(with_policy: DataFrame, rules: Rules) -> DataFrame:
    """Adds ``idle_ms``, ``verdict`` (first rule that applies, see ``Verdict``) and ``reason`` (text for
    the audit, set on expired rows)."""
    idle = sf.col(c.IDLE_MS)
    expiration = sf.col(c.EXPIRATION_MINUTES)
    verdict = (
        sf.when(expiration.isNull(), sf.lit(Verdict.NO_POLICY.value))
        .when(expiration < 0, sf.lit(Verdict.NEVER.value))
        .when(idle <= expiration.cast("long") * MS_PER_MINUTE, sf.lit(Verdict.FRESH.value))
        .when(idle < sf.lit(rules.min_age_ms), sf.lit(Verdict.BELOW_MIN_AGE.value))
    )
    if rules.only_fully_consumed:
        verdict = verdict.when(~sf.coalesce(sf.col(c.FULLY_CONSUMED), sf.lit(False)), Verdict.NOT_FULLY_CONSUMED.value)
    if rules.no_live_subscribers:
        verdict = verdict.when(sf.col(c.SUBSCRIBER_COUNT) > 0, sf.lit(Verdict.SUBSCRIBED.value))
    verdict = verdict.otherwise(sf.lit(Verdict.EXPIRED.value))

    return (
        with_policy.withColumn(c.IDLE_MS, idle_ms(rules.now_ms))
        .withColumn(c.VERDICT, verdict)
        .withColumn(c.REASON, sf.when(sf.col(c.VERDICT) == Verdict.EXPIRED.value, reason(rules)))
    )


def reason(rules: Rules) -> Column:
    """The audit's text for an expired row, from its ``idle_ms`` and ``expiration_minutes`` and the rules."""
    notes = [sf.lit(f"min age {rules.min_age_ms // MS_PER_MINUTE} min")]
    if rules.only_fully_consumed:
        notes.append(sf.lit("fully consumed"))
    if rules.no_live_subscribers:
        notes.append(sf.lit("no live subscribers"))
    # Plain concatenation, not format_string: Java's Formatter parses its pattern again for every row.
    return sf.concat_ws(
        "; ",
        sf.concat(
            sf.lit("idle "),
            sf.floor(sf.col(c.IDLE_MS) / MS_PER_MINUTE).cast("string"),
            sf.lit(" min > expiration "),
            sf.col(c.EXPIRATION_MINUTES).cast("string"),
            sf.lit(" min"),
        ),
        *notes,
    )


def candidates(decided: DataFrame) -> DataFrame:
    """Only the expired rows, with exactly the columns the delete step and the audit need. The reason is not
    among them: the audit derives it again from idle time and expiration, rather than carrying ~50 bytes of
    text per row through the checkpoint, the shuffle and both Arrow hops of the delete step."""
    return decided.where(sf.col(c.VERDICT) == Verdict.EXPIRED.value).select(*c.CANDIDATE_COLUMNS)


def verdict_metrics(brokers: Sequence[str]) -> list[Column]:
    """Aggregates for ``DataFrame.observe``: rows and expired rows per broker, gathered during the same
    pass that filters the candidates (the full scan is never kept or counted twice)."""
    metrics: list[Column] = []
    for i, broker in enumerate(brokers):
        mine = sf.col(c.BROKER) == broker
        metrics.append(sf.count(sf.when(mine, 1)).alias(f"scanned_{i}"))
        metrics.append(sf.count(sf.when(mine & (sf.col(c.VERDICT) == Verdict.EXPIRED.value), 1)).alias(f"expired_{i}"))
    return metrics


def outcome_metrics(brokers: Sequence[str]) -> list[Column]:
    """Aggregates for ``DataFrame.observe``: rows per (broker, outcome), named ``<outcome>_<broker index>``,
    gathered while the outcomes are checkpointed (no second pass over them for the summary table)."""
    metrics: list[Column] = []
    for i, broker in enumerate(brokers):
        mine = sf.col(c.BROKER) == broker
        for outcome in Outcome:
            metrics.append(sf.count(sf.when(mine & (sf.col(c.OUTCOME) == outcome.value), 1)).alias(f"{outcome}_{i}"))
    return metrics


def audit(outcomes: DataFrame, rules: Rules, dry_run: bool) -> DataFrame:
    """One row per reclaimed topic (or, in a dry run, per topic that would have been) with its reason."""
    reclaimed = Outcome.WOULD_DELETE if dry_run else Outcome.DELETED
    return outcomes.where(sf.col(c.OUTCOME) == reclaimed.value).select(
        sf.lit(rules.now_ms).alias("run_now_ms"),
        sf.lit(dry_run).alias("dry_run"),
        c.BROKER,
        c.PARENT,
        c.LITE,
        c.OUTCOME,
        reason(rules).alias(c.REASON),
        c.IDLE_MS,
        c.EXPIRATION_MINUTES,
        c.LAST_STORE_MS,
        c.LAST_CONSUME_MS,
        c.MAX_OFFSET,
    )
