"""Reclaim at scale: N lite topics over 2 real brokers, 10% of them expired; the job in local[2].

Setup (timed and printed, but not part of the figure): each broker's data dir is filled through the store
API before the broker starts, one tiny message per lite topic, appended in large batches with an injected
clock so every tenth block is two hours old (expiration 60 min). Names are uuid4-shaped, as
rocketmq-a2a makes them. Brokers then start as real processes (``--flush`` mode, async unless told: see
below).

Figure: the job's wall time from Spark start to summary (goal <= 60 s for 10M topics), and how it
splits: plan (driver probes), Spark start, scan+decide (one pipelined Spark pass; ``scan task-s`` is the
time scan tasks spent waiting on brokers and building Arrow batches, summed over tasks), delete, audit;
plus the decide step alone on as many rows made inside the JVM, which splits the scan+decide pass.
Deletes run unthrottled (``--max-deletes-per-second 0``) so the figure shows the brokers' capacity, not
the bucket. ``--dry-run`` runs the job with --dry-run (candidates compared on the brokers, nothing deleted).
The job pushes its idle filter down to the brokers, which then return only the old 10%; ``--no-pushdown``
scans every row (the baseline of that change).

Brokers run with async flush unless ``--flush sync`` is given. That is *not* the production default: the
broker's default (``--flush-mode``, ``StoreConfig.flush_mode``) is ``sync``. Async is kept as the bench's
default so its figures compare with the ones recorded in docs/reclaim.md, all measured with async. A
delete call is one tombstone write and one index batch per chunk of rows either way; ``sync`` adds one
fsync per chunk (``--delete-batch-size`` rows), so ``--flush sync`` measures what a production broker pays.

``--fixture DIR`` generates the stores into DIR once (kept, never served) and gives each run a fresh copy
(immutable RocksDB tables and sealed log segments hard-linked, the rest copied), so a 10M run can be
repeated without regenerating.

Where the cores went: the machine has 2, shared by the brokers, Spark's JVM, its Python workers and this
driver, so the wall time of each phase follows from CPU seconds; ``cpu-s`` lines give them per role and
phase (``others``: whatever else ran on the machine meantime), plus the JVM's by thread kind (JIT, GC,
tasks, the py4j threads that plan queries).

    python bench/bench_reclaim.py [--quick] [--topics N] [--flush async|sync] [--dry-run] [--no-pushdown]
                                  [--keep DIR] [--fixture DIR] [--class-archive FILE] [--py-spy DIR]
                                  [--job-arg=--conf=K=V ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql import functions as sf

from lmq_broker import config, model, testing
from lmq_broker.storage import keys
from lmq_broker.storage import store as store_mod
from lmq_reclaim import columns as c
from lmq_reclaim import job, options, report, session, transforms

PARENT = "Agent"
EXPIRATION_MIN = 60
BLOCK = 1_000  # topics per append call (and per clock value)
OLD_EVERY = 10  # one block in ten is old: 10% of the topics expire
T0_MS = 1_750_000_000_000
NOW_MS = T0_MS + 120 * 60_000
GOAL_S = 60.0


def generate(data_dir: Path, topics: int, seed: int) -> tuple[int, float]:
    """Fill one broker's store; returns (expired topics written, seconds)."""
    started = time.perf_counter()
    rng = random.Random(seed)
    clock = [T0_MS]
    cfg = config.StoreConfig(data_dir=data_dir, flush_mode=config.FlushMode.ASYNC)
    store = store_mod.open_store(cfg, clock=lambda: clock[0])
    expired = 0
    try:
        store.put_parent_topic(model.ParentTopic(PARENT, expiration_minutes=EXPIRATION_MIN))
        parent_q = model.QueueId(PARENT, 0)
        pending: list[model.NewMessage] = []
        for b, start in enumerate(range(0, topics, BLOCK)):
            n = min(BLOCK, topics - start)
            old = b % OLD_EVERY == 0
            expired += n if old else 0
            for i in range(n):
                lite = str(uuid.UUID(int=rng.getrandbits(128), version=4))
                pending.append(
                    model.NewMessage(
                        message_id=f"{seed}-{start + i}",
                        topic=PARENT,
                        body=b"x",
                        queues=(parent_q, model.QueueId.lmq(PARENT, lite)),
                        lite_topic=lite,
                        message_type=model.MessageType.LITE,
                    )
                )
            # The clock is read per append call: one call per block keeps old and fresh blocks apart.
            clock[0] = T0_MS if old else NOW_MS - 5 * 60_000
            store.append(pending)
            pending.clear()
        store.flush()
    finally:
        store.close()
    return expired, time.perf_counter() - started


def _identity(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    yield from batches


def decide_alone(spark: SparkSession, topics: int) -> float:
    """The decide step by itself on ``topics`` rows of the same shape, made inside the JVM (no scan), in the
    job's warm session: what the scan+decide pass would cost if scanning were free."""
    old = (sf.col("id") / BLOCK).cast("long") % OLD_EVERY == 0
    store = sf.when(old, sf.lit(T0_MS)).otherwise(sf.lit(NOW_MS - 5 * 60_000))
    rows = spark.range(0, topics, 1, 4).select(
        sf.lit("broker-0").alias(c.BROKER),
        sf.lit(PARENT).alias(c.PARENT),
        sf.format_string("%036d", sf.col("id")).alias(c.LITE),
        store.alias(c.CREATED_MS),
        store.alias(c.LAST_STORE_MS),
        sf.lit(0).cast("long").alias(c.LAST_CONSUME_MS),
        sf.lit(0).cast("long").alias(c.MIN_OFFSET),
        sf.lit(1).cast("long").alias(c.MAX_OFFSET),
        sf.lit(0).alias(c.SUBSCRIBER_COUNT),
        sf.lit(None).cast("boolean").alias(c.FULLY_CONSUMED),
    )
    policy = spark.createDataFrame([("broker-0", PARENT, EXPIRATION_MIN)], c.POLICY_DDL)
    best = float("inf")
    for _ in range(2):  # the second run is warm, like the job's pass
        t0 = time.perf_counter()
        decided = transforms.decide(transforms.attach_policy(rows, policy), transforms.Rules(now_ms=NOW_MS))
        transforms.candidates(decided).localCheckpoint(eager=True)
        best = min(best, time.perf_counter() - t0)
    return best


def expired_of(topics: int) -> int:
    """How many of ``topics`` the generator makes old (same block rule as ``generate``)."""
    return sum(min(BLOCK, topics - start) for b, start in enumerate(range(0, topics, BLOCK)) if b % OLD_EVERY == 0)


def copy_store(source: Path, target: Path) -> None:
    """A fresh, writable copy of a generated store. RocksDB never rewrites a table file and the log only
    appends to its last segment, so those can be shared by hard links; everything else is copied."""
    segments = sorted((source / "commitlog").glob("*.log"))
    shared = set(segments[:-1])
    for path in sorted(source.rglob("*")):
        dest = target / path.relative_to(source)
        if path.is_dir():
            dest.mkdir(parents=True, exist_ok=True)
        elif path.suffix == ".sst" or path in shared:
            os.link(path, dest)
        elif path.name != "LOCK":
            shutil.copy2(path, dest)


def fixture_stores(fixture: Path, work: Path, per_broker: list[int]) -> int:
    """Generate into ``fixture`` unless it already holds this shape; copy it into ``work``; returns expired."""
    marker = fixture / "fixture.json"
    # Delete the fixture by hand after a change of the store's files that keeps LAYOUT_VERSION.
    shape = {"per_broker": per_broker, "block": BLOCK, "old_every": OLD_EVERY, "layout": keys.LAYOUT_VERSION}
    if not marker.exists() or json.loads(marker.read_text()) != shape:
        shutil.rmtree(fixture, ignore_errors=True)
        fixture.mkdir(parents=True)
        started = time.perf_counter()
        with ProcessPoolExecutor(max_workers=len(per_broker)) as pool:
            dirs = [fixture / f"broker-{i}" for i in range(len(per_broker))]
            list(pool.map(generate, dirs, per_broker, range(len(per_broker))))
        gen_s = time.perf_counter() - started
        marker.write_text(json.dumps(shape))
        print(f"generation: {gen_s:.1f} s ({sum(per_broker) / gen_s:,.0f} topics/s; into fixture {fixture})")
    else:
        print(f"generation: reused fixture {fixture} (not counted)")
    t0 = time.perf_counter()
    for i in range(len(per_broker)):
        shutil.rmtree(work / f"broker-{i}", ignore_errors=True)
        copy_store(fixture / f"broker-{i}", work / f"broker-{i}")
    print(f"fixture copied in {time.perf_counter() - t0:.1f} s")
    return sum(expired_of(n) for n in per_broker)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_table() -> dict[int, tuple[int, str, float]]:
    """pid -> (parent pid, command name, CPU seconds) of every process we can read."""
    table: dict[int, tuple[int, str, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
        except OSError:
            continue
        head, rest = raw.rsplit(")", 1)
        fields = rest.split()
        # utime + stime + cutime + cstime: a reaped child's time moves into its parent, so forked Python workers
        # that exit stay counted.
        cpu = sum(int(f) for f in fields[11:15]) / tick
        table[int(entry.name)] = (int(fields[1]), head.split("(", 1)[1], cpu)
    return table


def jvm_threads() -> dict[str, float]:
    """CPU seconds of Spark's JVM by thread kind (JIT compilers, GC, task threads, the rest), from /proc."""
    table = _proc_table()
    me = os.getpid()
    kinds: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid, (ppid, comm, _) in table.items():
        if comm != "java" or ppid != me:
            continue
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                head, rest = (task / "stat").read_text().rsplit(")", 1)
            except OSError:
                continue
            name = head.split("(", 1)[1]
            fields = rest.split()
            kind = next(
                (k for k, prefix in _JVM_KINDS if name.startswith(prefix)),
                "other",
            )
            kinds[kind] = kinds.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return kinds


_JVM_KINDS = (
    ("jit", "C1 Compiler"),
    ("jit", "C2 Compiler"),
    ("gc", "GC Thread"),
    ("gc", "G1 "),
    ("gc", "VM Thread"),
    ("tasks", "Executor task"),
    ("python-io", "stdout writer"),
    ("python-io", "stdin writer"),
    ("python-io", "Thread-"),
)


class CpuSampler:
    """CPU seconds by role over time: the brokers, Spark's JVM, its Python workers, and this driver.
    Sampled from /proc every ``interval_s`` so each phase of the job gets its share (where the cores went)."""

    def __init__(self, broker_pids: list[int], interval_s: float = 0.25) -> None:
        self.broker_pids = set(broker_pids)
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def roles(self) -> dict[str, float]:
        table = _proc_table()
        me = os.getpid()
        out = {"brokers": 0.0, "jvm": 0.0, "py-workers": 0.0, "driver": 0.0}
        for pid, (_ppid, comm, cpu) in table.items():
            chain = [pid]
            while chain[-1] in table and table[chain[-1]][0] not in (0, 1) and len(chain) < 10:
                chain.append(table[chain[-1]][0])
            if pid in self.broker_pids:
                out["brokers"] += cpu
            elif pid == me:
                out["driver"] += cpu
            elif me in chain and comm == "java":
                out["jvm"] += cpu
            elif me in chain and any(table.get(p, (0, "", 0.0))[1] == "java" for p in chain[1:]):
                out["py-workers"] += cpu
        # Everything else the machine ran meanwhile (other people's work on a shared box): busy time of all
        # cores from /proc/stat minus ours.
        busy = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        total_busy = (sum(busy) - busy[3] - busy[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait
        out["others"] = total_busy - sum(out.values())
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), self.roles()))
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.perf_counter(), self.roles()))

    def between(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds per role from the last sample at or before t0 to the first at or after t1."""
        before = max((s for s in self.samples if s[0] <= t0), key=lambda s: s[0], default=self.samples[0])
        after = min((s for s in self.samples if s[0] >= t1), key=lambda s: s[0], default=self.samples[-1])
        return {k: after[1][k] - before[1].get(k, 0.0) for k in after[1]}


def main() -> int:  # noqa: PLR0915 (a benchmark's main reads top to bottom: setup, rounds, report)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topics", type=int, default=10_000_000, help="lite topics over all brokers (10M)")
    ap.add_argument("--quick", action="store_true", help="100k topics")
    ap.add_argument("--brokers", type=int, default=2)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--keep", type=Path, default=None, help="work in this dir and keep it")
    ap.add_argument(
        "--fixture", type=Path, default=None, help="generate the stores here once and copy them for each run"
    )
    ap.add_argument("--job-arg", action="append", default=[], help="extra job argument (repeatable), e.g. --conf=K=V")
    ap.add_argument(
        "--class-archive",
        type=Path,
        default=None,
        help="the job's --class-archive: written at exit by a run without the file (after the figures), then mapped",
    )
    ap.add_argument("--py-spy", type=Path, default=None, help="record the brokers with py-spy into this dir")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="the job with --dry-run: brokers still compare every candidate (WOULD_DELETE) but delete nothing",
    )
    ap.add_argument("--no-pushdown", action="store_true", help="the job scans every row (no broker-side filter)")
    ap.add_argument(
        "--flush",
        choices=[m.value for m in config.FlushMode],
        default=config.FlushMode.ASYNC.value,
        help="the brokers' --flush-mode (default async, as the recorded figures; production's default is sync)",
    )
    args = ap.parse_args()
    topics = 100_000 if args.quick else args.topics
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-reclaim-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.py_spy is not None:
        args.py_spy.mkdir(parents=True, exist_ok=True)
    existing = all((work / f"broker-{i}" / "index").exists() for i in range(args.brokers))
    per_broker = [topics // args.brokers + (1 if i < topics % args.brokers else 0) for i in range(args.brokers)]
    print(f"setup: {topics} lite topics over {args.brokers} brokers, 1 in {OLD_EVERY} expired; work dir {work}")
    print(f"brokers: --flush-mode {args.flush}")
    if args.dry_run:
        print("mode: --dry-run (candidates are compared on the brokers, nothing is deleted)")

    started = time.perf_counter()
    if args.fixture is not None:
        expired = fixture_stores(args.fixture, work, per_broker)
    elif existing and args.keep is not None:
        # A kept dir from an earlier --dry-run holds the same topics (the generator is seeded).
        expired = sum(expired_of(n) for n in per_broker)
        print("generation: reused the kept data dirs (not counted)")
    else:
        with ProcessPoolExecutor(max_workers=args.brokers) as pool:
            dirs = [work / f"broker-{i}" for i in range(args.brokers)]
            results = list(pool.map(generate, dirs, per_broker, range(args.brokers)))
        gen_s = time.perf_counter() - started
        expired = sum(r[0] for r in results)
        print(f"generation: {gen_s:.1f} s ({topics / gen_s:,.0f} topics/s over {args.brokers} processes; not counted)")

    brokers: list[testing.BrokerProcess] = []
    try:
        for i in range(args.brokers):
            extra = ["--no-bootstrap", "--broker-name", f"broker-{i}", "--flush-mode", args.flush]
            # The generated records carry store times of T0_MS (months ago): a serving broker's retention would
            # drop their segments in the middle of the measured run.
            extra += ["--retention-max-age-ms", "-1"]
            brokers.append(
                testing.start_broker(work / f"broker-{i}", extra_args=extra, env=testing.SHARED_ADMIN_ENV, timeout=600)
            )
        opts = options.parse(
            [
                *("--brokers", ",".join(b.admin_endpoint for b in brokers)),
                *("--access-key", testing.SHARED_ADMIN_KEYS["access_key"]),
                *("--secret-key", testing.SHARED_ADMIN_KEYS["secret_key"]),
                *("--now-ms", str(NOW_MS), "--master", args.master, "--local-dir", str(work / "spark")),
                *("--max-deletes-per-second", "0", "--driver-memory", "2g"),
                *("--audit-path", str(work / "audit"), "--log-level", "WARNING"),
                *(["--dry-run"] if args.dry_run else []),
                *(["--no-pushdown"] if args.no_pushdown else []),
                *(["--class-archive", str(args.class_archive)] if args.class_archive else []),
                *args.job_arg,
            ]
        )
        sampler = CpuSampler([b.pid for b in brokers])
        sampler.start()
        archive = "none"
        if opts.class_archive is not None:
            archive = f"{opts.class_archive} ({'mapped' if opts.class_archive.exists() else 'written at exit'})"
        t0 = time.perf_counter()
        spark = session.build(opts)
        spark_start = time.perf_counter() - t0
        try:
            t1 = time.perf_counter()
            # Spark's first Python job starts the worker daemon and imports pyarrow/pandas/grpc in each
            # worker; done here on its own so the scan+decide figure is the pass itself, not the warm-up.
            spark.range(0, 2, 1, 2).mapInArrow(_identity, "id long").count()
            warm_up = time.perf_counter() - t1
            cpu_before = [cpu_s(b.pid) for b in brokers]
            spies = [
                subprocess.Popen(
                    [
                        *(str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(b.pid)),
                        *("-f", "raw", "-r", "50", "-o", str(args.py_spy / f"broker-{i}.txt")),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for i, b in enumerate(brokers)
                if args.py_spy is not None
            ]
            job_t0 = time.perf_counter()
            result = job.run(opts, spark=spark)
            job_t1 = time.perf_counter()
            for spy in spies:
                spy.send_signal(signal.SIGINT)
                spy.wait(60)
            broker_cpu = sum(cpu_s(b.pid) for b in brokers) - sum(cpu_before)
            wall = time.perf_counter() - t0
            decided_rows = topics if args.no_pushdown else expired  # what reaches decide
            sampler.stop()
            jvm_kinds = jvm_threads()
            decide_s = decide_alone(spark, decided_rows)
        finally:
            session.stop(spark)
    finally:
        for b in brokers:
            b.stop()
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)

    total = result.total
    t = result.timings_s
    print(report.render_table(result))
    returned = topics if args.no_pushdown else expired  # the filter lets exactly the old blocks through
    print(
        f"topics walked: {topics}; returned by the brokers: {total.scanned} (expected {returned}); "
        f"expired: {total.expired} (expected {expired})"
    )
    print(f"reclaimed: {total.reclaimed}; errors: {total.errors}")
    print(
        f"reclaim wall (scan + reclaim, Spark start included): {wall:.1f} s  goal <= {GOAL_S:.0f} s  "
        f"ratio {wall / GOAL_S:.2f}x of goal"
    )
    print(f"JVM: {opts.jvm_options or '(defaults)'}; class archive: {archive}")
    print(
        f"split: plan {t.get('plan', 0):.1f} s | spark start {spark_start:.1f} s | "
        f"python workers warm-up {warm_up:.1f} s | "
        f"scan+decide {t.get('scan+decide', 0):.1f} s (scan task-s {t.get('scan_busy_s', 0):.1f}) | "
        f"delete {t.get('delete', 0):.1f} s (delete call task-s {t.get('delete_busy_s', 0):.1f}) | "
        f"audit {t.get('audit', 0):.1f} s"
    )
    print(
        f"broker CPU during the job: {broker_cpu:.1f} s over {args.brokers} brokers "
        f"({broker_cpu * 1e6 / max(1, total.reclaimed):.0f} us per reclaimed topic, scan included); "
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    edges = [("spark start + warm-up", t0, job_t0)]
    at = job_t0
    for phase in ("plan", "scan+decide", "delete", "audit"):
        edges.append((phase, at, at + t.get(phase, 0.0)))
        at += t.get(phase, 0.0)
    edges.append(("job rest", at, job_t1))
    for phase, lo, hi in edges:
        used = sampler.between(lo, hi)
        shares = " ".join(f"{k} {v:.1f}" for k, v in used.items())
        print(f"cpu-s {phase} ({hi - lo:.1f} s wall, {2 * (hi - lo):.1f} core-s on 2 cores): {shares}")
    print("cpu-s JVM by thread kind (whole run): " + " ".join(f"{k} {v:.1f}" for k, v in sorted(jvm_kinds.items())))
    scan_s = t.get("scan+decide", 0) or 1e-9
    delete_s = t.get("delete", 0) or 1e-9
    print(
        f"rates: scan+decide {topics / scan_s:,.0f} topics walked/s | delete {total.reclaimed / delete_s:,.0f} topics/s"
    )
    print(
        f"decide alone ({decided_rows} rows of the same shape made in the JVM, warm): {decide_s:.1f} s -> "
        f"scan share of the scan+decide pass ~ {max(0.0, t.get('scan+decide', 0) - decide_s):.1f} s"
    )
    ok = total.scanned == returned and total.expired == expired and total.reclaimed == expired and total.errors == 0
    print("result: " + ("OK" if ok else "MISMATCH"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
