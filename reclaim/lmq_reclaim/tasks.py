"""What runs inside Spark tasks: the scan of one (broker, parent, key range) and the deletes of one broker.

Both are ``mapInArrow`` functions built by closures over small picklable values, so they ship to executors
as they are. Rows only ever move as Arrow batches. A broker that fails is recorded as an error value in
the stats accumulator (and, for deletes, as ERROR rows) instead of failing the Spark job: one bad broker
must not stop the others from being reclaimed.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.accumulators import Accumulator, AccumulatorParam

from lmq_broker import errors
from lmq_broker.admin.credentials import KeyPair
from lmq_broker.admin.tls import ClientTls
from lmq_reclaim import brokers
from lmq_reclaim import columns as c
from lmq_reclaim.columns import Outcome
from lmq_reclaim.keyspace import KeyRange
from lmq_reclaim.ratelimit import TokenBucket

MAX_ERROR_MESSAGES: Final = 50
PROGRESS_EVERY_ROWS: Final = 100_000
# Delete calls in flight per broker: while the broker works on one, the next is built and on its way, so the
# broker does not sit idle between calls (two are enough: the broker runs them one after the other anyway).
DELETES_IN_FLIGHT: Final = 2

ArrowMap = Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]
_PARENT_STAT: Final = "parent"


def parent_stat(metric: str, broker: str, parent: str) -> str:
    """The accumulator key of a count per (broker, parent): ``scanned``, ``errors`` or an outcome name.
    NUL separates the parts because no broker or topic name can hold one."""
    return f"{_PARENT_STAT}\x00{metric}\x00{broker}\x00{parent}"


def split_parent_stat(key: str) -> tuple[str, str, str] | None:
    """(metric, broker, parent) of a ``parent_stat`` key; None for the other keys."""
    parts = key.split("\x00")
    if len(parts) != 4 or parts[0] != _PARENT_STAT:
        return None
    return parts[1], parts[2], parts[3]


class StatsParam(AccumulatorParam[dict[str, float]]):
    """Sums numbers per ``"<metric>:<broker>"`` key: rows and seconds of scans and deletes, and
    ``errors:<broker>``, the failed calls; and per ``parent_stat`` key, the same counts per (broker, parent).
    Messages of the failures travel in ``MessagesParam``."""

    def zero(self, value: dict[str, float]) -> dict[str, float]:
        return {}

    def addInPlace(self, value1: dict[str, float], value2: dict[str, float]) -> dict[str, float]:  # noqa: N802
        for key, v in value2.items():
            value1[key] = value1.get(key, 0.0) + v
        return value1


class MessagesParam(AccumulatorParam[list[str]]):
    """The first ``MAX_ERROR_MESSAGES`` failure messages: enough to diagnose, bounded if a broker is down."""

    def zero(self, value: list[str]) -> list[str]:
        return []

    def addInPlace(self, value1: list[str], value2: list[str]) -> list[str]:  # noqa: N802
        room = MAX_ERROR_MESSAGES - len(value1)
        if room > 0:
            value1.extend(value2[:room])
        return value1


@dataclass(frozen=True, slots=True)
class ScanTask:
    broker: str
    endpoint: str
    parent: str
    key_range: KeyRange
    # Pushed down to the broker: only rows last active before this (epoch ms) come back; 0: every row.
    idle_since_before_ms: int = 0


@dataclass(frozen=True, slots=True)
class ScanSettings:
    batch_size: int
    with_fully_consumed: bool
    timeout_s: float
    credentials: KeyPair | None = None
    tls: ClientTls | None = None


@dataclass(frozen=True, slots=True)
class DeleteSettings:
    endpoints: dict[str, str]  # broker -> admin endpoint
    max_deletes_per_second: float  # per broker; <= 0 unlimited
    batch_size: int
    dry_run: bool
    timeout_s: float
    credentials: KeyPair | None = None
    tls: ClientTls | None = None


def scan_fn(
    tasks: Sequence[ScanTask],
    settings: ScanSettings,
    stats: Accumulator[dict[str, float]],
    messages: Accumulator[list[str]],
) -> ArrowMap:
    """Input: batches of ``id`` (task indexes, one task per partition); output: ``columns.SCANNED``."""

    def run(ids: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for id_batch in ids:
            for task_id in id_batch.column(0).to_pylist():
                yield from _scan_one(tasks[task_id], settings, stats, messages, f"{task_id + 1}/{len(tasks)}")

    return run


def _scan_one(
    task: ScanTask,
    settings: ScanSettings,
    stats: Accumulator[dict[str, float]],
    messages: Accumulator[list[str]],
    label: str = "",
) -> Iterator[pa.RecordBatch]:
    rows = 0
    busy = 0.0
    started = time.perf_counter()
    failed = False
    try:
        with brokers.ArrowAdmin(task.endpoint, settings.timeout_s, settings.credentials, settings.tls) as admin:
            batches = admin.scan(
                broker=task.broker,
                parent=task.parent,
                key_range=task.key_range,
                batch_size=settings.batch_size,
                with_fully_consumed=settings.with_fully_consumed,
                idle_since_before_ms=task.idle_since_before_ms,
            )
            while True:
                t0 = time.perf_counter()
                batch = next(batches, None)
                busy += time.perf_counter() - t0
                if batch is None:
                    break
                rows += batch.num_rows
                yield batch
    except errors.LmqError as exc:
        failed = True
        stats.add({f"errors:{task.broker}": 1.0, parent_stat("errors", task.broker, task.parent): 1.0})
        messages.add([f"scan {task.broker} {task.parent} {task.key_range}: {exc.message}"])
    finally:
        # busy = time waiting on the broker and building Arrow arrays; the rest of the task's wall time is
        # Spark consuming our batches (the decide step runs in the same pipeline).
        stats.add({f"scan_rows:{task.broker}": float(rows), f"scan_busy_s:{task.broker}": busy})
        stats.add({parent_stat("scanned", task.broker, task.parent): float(rows)})
        wall = time.perf_counter() - started
        stats.add({f"scan_wall_s:{task.broker}": wall})
        # One line per finished task: a long scan shows how far it got (the driver logs the total at the end).
        outcome = "failed" if failed else "done"
        _progress(f"scan task {label} {outcome}: {task.broker} {task.parent}: {rows} row(s) in {wall:.1f}s")


def delete_fn(
    settings: DeleteSettings,
    stats: Accumulator[dict[str, float]],
    messages: Accumulator[list[str]],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> ArrowMap:
    """Input: candidate rows (``columns.CANDIDATE_COLUMNS``), every row of a broker in one partition;
    output: ``columns.OUTCOMES``. One token bucket per broker bounds that broker's delete rate."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        buckets: dict[str, TokenBucket] = {}
        admins: dict[str, brokers.ArrowAdmin] = {}
        done: dict[str, int] = {}
        try:
            for batch in batches:
                for broker in pc.unique(batch.column(c.BROKER)).to_pylist():
                    mine = batch.filter(pc.equal(batch.column(c.BROKER), broker))
                    if broker not in admins:
                        admins[broker] = brokers.ArrowAdmin(
                            settings.endpoints[broker], settings.timeout_s, settings.credentials, settings.tls
                        )
                        rate = settings.max_deletes_per_second
                        buckets[broker] = TokenBucket(rate, burst=max(1.0, rate), clock=clock, sleep=sleep)
                    yield from _delete_rows(
                        broker=broker,
                        rows=mine,
                        admin=admins[broker],
                        bucket=buckets[broker],
                        settings=settings,
                        stats=stats,
                        messages=messages,
                    )
                    before = done.get(broker, 0)
                    done[broker] = before + mine.num_rows
                    if done[broker] // PROGRESS_EVERY_ROWS > before // PROGRESS_EVERY_ROWS:
                        _progress(f"delete {broker}: {done[broker]} candidates processed")
            for broker, count in done.items():  # a broker's rows are all in this partition: it is finished
                _progress(f"delete {broker} done: {count} candidates processed")
        finally:
            for broker, admin in admins.items():
                admin.close()
                stats.add({f"delete_throttled_s:{broker}": buckets[broker].waited_s})

    return run


def _delete_rows(
    *,
    broker: str,
    rows: pa.RecordBatch,
    admin: brokers.ArrowAdmin,
    bucket: TokenBucket,
    settings: DeleteSettings,
    stats: Accumulator[dict[str, float]],
    messages: Accumulator[list[str]],
) -> Iterator[pa.RecordBatch]:
    # Each row carries the subscribers its scan saw: a topic that gained one since (or gains one while the
    # broker deletes it) is kept; the subscribers it already had were judged by the rules.
    in_flight: deque[tuple[pa.RecordBatch, float, brokers.PendingDelete | errors.LmqError]] = deque()
    for start in range(0, rows.num_rows, settings.batch_size):
        chunk = rows.slice(start, settings.batch_size)
        bucket.acquire(chunk.num_rows)  # before sending: the bucket bounds what the broker is asked to do
        sent = time.perf_counter()
        try:
            call: brokers.PendingDelete | errors.LmqError = admin.start_compare_and_delete(
                chunk, dry_run=settings.dry_run
            )
        except errors.LmqError as exc:
            call = exc
        in_flight.append((chunk, sent, call))
        if len(in_flight) >= DELETES_IN_FLIGHT:
            yield _finish(broker, *in_flight.popleft(), stats=stats, messages=messages)
    while in_flight:
        yield _finish(broker, *in_flight.popleft(), stats=stats, messages=messages)


def _finish(
    broker: str,
    chunk: pa.RecordBatch,
    sent: float,
    call: brokers.PendingDelete | errors.LmqError,
    *,
    stats: Accumulator[dict[str, float]],
    messages: Accumulator[list[str]],
) -> pa.RecordBatch:
    """The outcome batch of one delete call (ERROR rows when the call failed)."""
    error: str | None = None
    try:
        if isinstance(call, errors.LmqError):
            raise call
        outcome = call.result()
    except errors.LmqError as exc:
        error = exc.message
        outcome = pa.array([Outcome.ERROR.value] * chunk.num_rows, pa.string())
        failed = {parent_stat("errors", broker, p): 1.0 for p in pc.unique(chunk.column(c.PARENT)).to_pylist()}
        stats.add({f"errors:{broker}": 1.0, **failed})
        messages.add([f"delete {broker}: {error}"])
    stats.add({f"delete_busy_s:{broker}": time.perf_counter() - sent, **_outcomes_by_parent(broker, chunk, outcome)})
    return _outcome_batch(chunk, outcome, error)


def _outcomes_by_parent(broker: str, chunk: pa.RecordBatch, outcome: pa.Array) -> dict[str, float]:
    """Outcome counts of one call per parent (Arrow's group-by: no Python object per row)."""
    counted = pa.table({"parent": chunk.column(c.PARENT), "outcome": outcome}).group_by(["parent", "outcome"])
    table = counted.aggregate([([], "count_all")])
    parents, outcomes, counts = (table.column(name).to_pylist() for name in ("parent", "outcome", "count_all"))
    return {parent_stat(o, broker, p): float(n) for p, o, n in zip(parents, outcomes, counts, strict=True)}


def _outcome_batch(chunk: pa.RecordBatch, outcome: pa.Array, error: str | None) -> pa.RecordBatch:
    arrays = [chunk.column(name) for name in c.CANDIDATE_COLUMNS]
    arrays.append(outcome)
    arrays.append(pa.array([error] * chunk.num_rows, pa.string()) if error else pa.nulls(chunk.num_rows, pa.string()))
    return pa.RecordBatch.from_arrays(arrays, schema=c.OUTCOMES)


def _progress(line: str) -> None:
    # Executors log to their own stderr (the job's, in local mode); the driver logs phase totals.
    sys.stderr.write(f"lmq-reclaim: {line}\n")
    sys.stderr.flush()
