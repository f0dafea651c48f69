"""The reclaim job: discover brokers, plan the scan, scan + decide, delete, report.

Shape of a run (why it is cut where it is):
1. Driver: discover endpoints, ask each broker its name and ParentTopics (the policy), and plan scan tasks
   per (broker, parent, key range). Parents that never expire are not scanned at all.
2. One Spark pass: scan (``mapInArrow``) -> join the broadcast policy -> decide -> keep the expired rows.
   The full scan is never materialised; its per-broker counts are observed during that same pass, and
   only the candidates are checkpointed (they are ~10% of the rows and must not be recomputed: a second
   scan would see a different world).
3. Deletes, after a shuffle that puts every row of a broker in one partition, so one token bucket bounds
   that broker's delete rate. Compare-and-delete keeps whatever changed after the scan. Outcomes are
   checkpointed once and feed both the summary and the audit.
4. Record: each planned broker keeps its share of the run, per parent, as that parent's last run (the
   operator's ParentTopic ``status.lastReclaim``); see ``recording``.
A CronJob may run this twice or concurrently with nothing: every step is safe to repeat.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from pyspark import StorageLevel
from pyspark.sql import DataFrame, Observation, SparkSession
from pyspark.sql import functions as sf

from lmq_broker import errors
from lmq_broker.admin.credentials import KeyPair
from lmq_reclaim import brokers, discovery, keyspace, options, recording, report, session, tasks, transforms
from lmq_reclaim import columns as c
from lmq_reclaim.columns import Outcome

log = logging.getLogger("lmq_reclaim")

_PARTITION_COLUMN = "_broker_partition"
# Checkpoints keep their rows serialized (memory, spilling to disk): deserialized blocks make Spark estimate
# the size of every cached row object as it stores them, which cost more than the serializing.
CHECKPOINT_LEVEL: Final = StorageLevel.MEMORY_AND_DISK


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    endpoint: str


@dataclass(slots=True)
class Plan:
    targets: list[Target] = field(default_factory=list)
    policy_rows: list[tuple[str, str, int]] = field(default_factory=list)
    scan_tasks: list[tasks.ScanTask] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Hooks:
    """Seams for tests: ``before_delete`` sees the checkpointed candidates between scan and delete."""

    before_delete: Callable[[DataFrame], None] | None = None


def plan(endpoints: Sequence[str], opts: options.Options, out: report.Report) -> Plan:
    """Driver-side planning against each broker; a broker that fails here is reported and skipped."""
    result = Plan()
    for ep in endpoints:
        name = ep
        try:
            with brokers.ArrowAdmin(ep, opts.timeout_s, _credentials(opts), opts.tls) as admin:
                name = admin.broker_name() or ep
                if name in out.brokers:  # two endpoints, one broker name: keep both apart
                    name = f"{name}@{ep}"
                out.brokers[name] = report.BrokerSummary(name, ep)
                parents = admin.parents()
                result.policy_rows.extend((name, p.topic.name, p.topic.expiration_minutes) for p in parents)
                for p in parents:
                    if p.topic.expiration_minutes < 0:
                        continue
                    n = keyspace.ranges_for(p.lite_topic_count, opts.rows_per_task, opts.max_ranges_per_parent)
                    if n == 0:
                        continue
                    ranges = keyspace.split(n, _prober(admin, p.topic.name))
                    cutoff = idle_cutoff_ms(out.now_ms, opts, p.topic.expiration_minutes)
                    result.scan_tasks.extend(tasks.ScanTask(name, ep, p.topic.name, r, cutoff) for r in ranges)
            result.targets.append(Target(name, ep))
            for p in parents:  # every parent gets a summary, zeros when it was not scanned
                out.parents[(name, p.topic.name)] = report.ParentSummary()
        except errors.LmqError as exc:
            summary = out.brokers.setdefault(name, report.BrokerSummary(name, ep))
            summary.errors += 1
            out.error_messages.append(f"plan {name}: {exc.message}")
            log.error("broker %s skipped: %s", name, exc.message)
    result.scan_tasks = interleave(result.scan_tasks)
    return result


def idle_cutoff_ms(now_ms: int, opts: options.Options, expiration_minutes: int) -> int:
    """The scan filter of one parent: a row last active at or after it cannot expire in this run.

    ``decide`` expires a row when idle > expiration and idle >= min age (idle = now - last activity), so
    every expirable row has last activity <= now - max(expiration, min age), i.e. < this cutoff. The filter
    is only a pre-selection: ``decide`` still applies the full rule to what comes back.
    """
    if not opts.pushdown:
        return 0
    horizon = max(expiration_minutes * transforms.MS_PER_MINUTE, opts.min_age_minutes * transforms.MS_PER_MINUTE)
    return max(0, now_ms - horizon + 1)


def interleave(scan_tasks: Sequence[tasks.ScanTask]) -> list[tasks.ScanTask]:
    """Round-robin over brokers: Spark starts partitions in order, so neighbours should hit different
    brokers rather than all cores queueing on the first one."""
    by_broker: dict[str, list[tasks.ScanTask]] = {}
    for t in scan_tasks:
        by_broker.setdefault(t.broker, []).append(t)
    queues = list(by_broker.values())
    return [q[i] for i in range(max((len(q) for q in queues), default=0)) for q in queues if i < len(q)]


def _credentials(opts: options.Options) -> KeyPair | None:
    return KeyPair(opts.access_key, opts.secret_key) if opts.access_key else None


def _prober(admin: brokers.ArrowAdmin, parent: str) -> keyspace.Probe:
    def probe(after: str) -> str | None:
        return admin.first_key_after(parent, after)

    return probe


def run(
    opts: options.Options,
    spark: SparkSession | None = None,
    hooks: Hooks | None = None,
    discover: Callable[[options.Options], list[str]] = discovery.discover,
) -> report.Report:
    """One reclaim run. Uses ``spark`` when given (and leaves it running), else builds and stops its own."""
    now_ms = opts.now_ms if opts.now_ms is not None else int(time.time() * 1000)
    out = report.Report(now_ms=now_ms, dry_run=opts.dry_run, run_id=opts.run_id or str(now_ms))
    started = time.perf_counter()
    try:
        endpoints = discover(opts)
    except errors.LmqError as exc:
        out.brokers["(discovery)"] = report.BrokerSummary("(discovery)", "", errors=1)
        out.error_messages.append(f"discovery: {exc.message}")
        return out
    log.info("discovered %d broker endpoint(s): %s", len(endpoints), ", ".join(endpoints))
    the_plan = plan(endpoints, opts, out)
    out.scan_tasks = len(the_plan.scan_tasks)
    out.timings_s["plan"] = time.perf_counter() - started
    log.info("planned %d scan task(s) over %d broker(s)", len(the_plan.scan_tasks), len(the_plan.targets))
    if not the_plan.scan_tasks:
        _record(the_plan, opts, out, started)
        return out
    t0 = time.perf_counter()
    own = spark is None
    active = spark if spark is not None else session.build(opts)
    out.timings_s["spark_start"] = time.perf_counter() - t0
    try:
        _execute(active, opts, the_plan, out, hooks or Hooks())
        _record(the_plan, opts, out, started)  # before Spark stops, which can take seconds (class archive)
    finally:
        if own:
            session.stop(active)
    out.timings_s["total"] = time.perf_counter() - started
    return out


def _record(the_plan: Plan, opts: options.Options, out: report.Report, started: float) -> None:
    """The run ends here: its finish time is the start plus what the monotonic clock measured."""
    out.finish_ms = out.now_ms + int((time.perf_counter() - started) * 1000)
    if not opts.record:
        return
    t0 = time.perf_counter()
    targets = [(t.name, t.endpoint) for t in the_plan.targets]
    recording.record(targets, out, opts.timeout_s, _credentials(opts), opts.tls)
    out.timings_s["record"] = time.perf_counter() - t0


def _execute(spark: SparkSession, opts: options.Options, the_plan: Plan, out: report.Report, hooks: Hooks) -> None:  # noqa: PLR0912 (the job's phases in order)
    sc = spark.sparkContext
    stats = sc.accumulator({}, tasks.StatsParam())
    messages = sc.accumulator([], tasks.MessagesParam())
    names = [t.name for t in the_plan.targets]
    rules = transforms.Rules(
        now_ms=out.now_ms,
        min_age_ms=opts.min_age_minutes * transforms.MS_PER_MINUTE,
        only_fully_consumed=opts.only_fully_consumed,
        no_live_subscribers=opts.no_live_subscribers,
    )

    t0 = time.perf_counter()
    n_tasks = len(the_plan.scan_tasks)
    scan_settings = tasks.ScanSettings(
        opts.scan_batch_size, opts.only_fully_consumed, opts.scan_timeout_s, _credentials(opts), opts.tls
    )
    scanned = spark.range(0, n_tasks, 1, n_tasks).mapInArrow(
        tasks.scan_fn(the_plan.scan_tasks, scan_settings, stats, messages), c.SCANNED_DDL
    )
    policy = spark.createDataFrame(the_plan.policy_rows, c.POLICY_DDL)
    decided = transforms.decide(transforms.attach_policy(scanned, policy), rules)
    observation = Observation("lmq-reclaim")
    decided = decided.observe(observation, *transforms.verdict_metrics(names))
    candidates = transforms.candidates(decided).localCheckpoint(eager=True, storageLevel=CHECKPOINT_LEVEL)
    metrics = observation.get
    for i, name in enumerate(names):
        out.brokers[name].scanned = int(metrics[f"scanned_{i}"])
        out.brokers[name].expired = int(metrics[f"expired_{i}"])
    out.timings_s["scan+decide"] = time.perf_counter() - t0
    expired = sum(out.brokers[n].expired for n in names)
    log.info(
        "scanned %d lite topic(s), %d expired, in %.1fs",
        sum(out.brokers[n].scanned for n in names),
        expired,
        out.timings_s["scan+decide"],
    )

    if hooks.before_delete is not None:
        hooks.before_delete(candidates)

    t0 = time.perf_counter()
    delete_settings = tasks.DeleteSettings(
        endpoints={t.name: t.endpoint for t in the_plan.targets},
        max_deletes_per_second=opts.max_deletes_per_second,
        batch_size=opts.delete_batch_size,
        dry_run=opts.dry_run,
        timeout_s=opts.delete_timeout_s,
        credentials=_credentials(opts),
        tls=opts.tls,
    )
    if expired:
        counted = Observation("lmq-reclaim-outcomes")
        outcomes = (
            one_partition_per_broker(spark, candidates, names)
            .mapInArrow(tasks.delete_fn(delete_settings, stats, messages), c.OUTCOMES_DDL)
            .observe(counted, *transforms.outcome_metrics(names))
            .localCheckpoint(eager=True, storageLevel=CHECKPOINT_LEVEL)
        )
        counts = counted.get
        for i, name in enumerate(names):
            for outcome in Outcome:
                out.brokers[name].add_outcome(outcome, int(counts[f"{outcome}_{i}"]))
    else:  # nothing to delete: skip the shuffle, still write an (empty) audit for this run
        outcomes = spark.createDataFrame([], c.OUTCOMES_DDL)
    out.timings_s["delete"] = time.perf_counter() - t0
    total = out.total
    log.info(
        "%s %d, kept (changed) %d, kept (subscribed) %d, already gone %d, in %.1fs",
        "would delete" if opts.dry_run else "deleted",
        total.reclaimed,
        total.kept_changed,
        total.kept_subscribed,
        total.not_found,
        out.timings_s["delete"],
    )

    if opts.audit_path:
        t0 = time.perf_counter()
        out.audit_path = opts.audit_path.replace("{now}", str(out.now_ms))
        # One file per broker (the outcomes' partitions), written in parallel: no coalescing into one task.
        audit = transforms.audit(outcomes, rules, opts.dry_run).write.mode("overwrite")
        if opts.audit_format == "parquet":
            audit.parquet(out.audit_path)
        else:
            audit.json(out.audit_path)
        out.timings_s["audit"] = time.perf_counter() - t0
        log.info("audit written to %s (%s)", out.audit_path, opts.audit_format)

    values = stats.value
    for name in names:
        out.brokers[name].errors += int(values.get(f"errors:{name}", 0))
    for key, value in values.items():
        split = tasks.split_parent_stat(key)
        if split is None:
            continue
        metric, broker, parent = split
        share = out.parents.setdefault((broker, parent), report.ParentSummary())
        if metric == "scanned":
            share.scanned += int(value)
        elif metric == "errors":
            share.errors += int(value)
        else:  # an outcome of one of the parent's candidates
            share.add_outcome(metric, int(value))
    for key in ("scan_busy_s", "delete_busy_s", "delete_throttled_s"):
        out.timings_s[key] = sum(v for k, v in values.items() if k.startswith(f"{key}:"))
    out.error_messages.extend(messages.value)


def one_partition_per_broker(spark: SparkSession, frame: DataFrame, names: Sequence[str]) -> DataFrame:
    """Hash-partition by a per-broker key chosen so that broker i lands in partition i.

    Spark's hash partitioning is ``pmod(murmur3(key, 42), n)``, the same function as SQL ``hash``; we ask
    Spark which small integers land where and give each broker one of those. Should a partition still get
    two brokers, deletes stay correct (one bucket per broker), only less parallel.
    """
    n = len(names)
    landing: dict[int, int] = {}
    probe = spark.range(0, 64 * n).select("id", sf.expr(f"pmod(hash(id), {n})").alias("p")).collect()
    for row in probe:
        landing.setdefault(int(row["p"]), int(row["id"]))
    key = sf.lit(None).cast("long")
    for i, name in enumerate(names):
        key = sf.when(sf.col(c.BROKER) == name, sf.lit(landing.get(i, i))).otherwise(key)
    return frame.withColumn(_PARTITION_COLUMN, key).repartition(n, _PARTITION_COLUMN).drop(_PARTITION_COLUMN)


def main(argv: Sequence[str] | None = None) -> int:
    opts = options.parse(argv)
    logging.basicConfig(
        level=opts.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("py4j").setLevel(logging.WARNING)  # its gateway chatter is not our progress
    result = run(opts)
    print(report.render_table(result))
    print(f"timings: {report.render_timings(result.timings_s)}")
    if result.audit_path:
        print(f"audit: {result.audit_path}")
    if opts.record and result.brokers:
        print(f"recorded: run {result.run_id} on {len(result.recorded_on)} broker(s)")
    for message in result.error_messages:
        print(f"error: {message}", file=sys.stderr)
    return result.exit_code
