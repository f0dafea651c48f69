"""The only module of the job that talks to brokers: the broker's own admin client, with Arrow at this end.

Calls, signing, deadlines and error translation are the client's (``lmq_broker.admin.client``); what is
left here is the job's side of the columns. A scan batch arrives as the client's columns, which carry the
names of ``columns.SCANNED``, and becomes one Arrow batch; a delete sends a batch's columns back and gets
the outcome names of ``columns.Outcome``. Failures stay ``lmq_broker.errors`` values, so a caller decides
per broker whether to carry on.
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Final, Self

import pyarrow as pa

from lmq_broker import model
from lmq_broker.admin.client import COMPARE_COLUMNS, AdminClient, DeleteOutcome, ParentTopicInfo, ReclaimRecording
from lmq_broker.admin.credentials import KeyPair
from lmq_broker.admin.tls import ClientTls
from lmq_reclaim import columns as c
from lmq_reclaim import report
from lmq_reclaim.columns import Outcome
from lmq_reclaim.keyspace import KeyRange

UNARY_TIMEOUT_S: Final = 30.0
_DELETE_COLUMNS: Final = (*COMPARE_COLUMNS, c.SUBSCRIBER_COUNT)
_OUTCOMES: Final = {o: Outcome(o.name).value for o in DeleteOutcome}  # the same names: a new one fails here


class ArrowAdmin:
    """One broker's admin client as the job uses it. Use as a context manager; ``timeout_s`` bounds every
    call, a scan stream or a delete call included (the job gives each its own deadline option)."""

    def __init__(
        self,
        endpoint: str,
        timeout_s: float = UNARY_TIMEOUT_S,
        keys: KeyPair | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.client = AdminClient(endpoint, timeout_s, long_timeout_s=timeout_s, keys=keys, tls=tls)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self.client.close()

    # --- driver side: small unary calls ----------------------------------------------------------------
    def broker_name(self) -> str:
        return self.client.broker_info(with_undrained=False).broker_name

    def parents(self) -> list[ParentTopicInfo]:
        return self.client.list_parent_topics()

    def first_key_after(self, parent: str, after: str) -> str | None:
        """The smallest lite name of ``parent`` greater than ``after`` (a key-space probe)."""
        page = self.client.list_lite_topics(parent, start_after=after, limit=1)
        return page.topics[0].meta.lite if page.topics else None

    def record_run(self, out: report.Report, parents: Mapping[str, report.ParentSummary]) -> ReclaimRecording:
        """Leave ``out``'s summary of each of ``parents`` (this broker's share) as that parent's last run."""
        runs = [
            model.ReclaimRun(
                parent=parent,
                run_id=out.run_id,
                start_ms=out.now_ms,
                finish_ms=out.finish_ms,
                scanned=counts.scanned,
                expired=counts.expired,
                reclaimed=counts.reclaimed,
                kept_changed=counts.kept_changed,
                kept_subscribed=counts.kept_subscribed,
                not_found=counts.not_found,
                errors=counts.errors,
                dry_run=out.dry_run,
            )
            for parent, counts in parents.items()
        ]
        return self.client.record_reclaim_runs(runs)

    # --- executor side: the columnar hot paths ---------------------------------------------------------
    def scan(
        self,
        *,
        broker: str,
        parent: str,
        key_range: KeyRange,
        batch_size: int,
        with_fully_consumed: bool,
        idle_since_before_ms: int = 0,
    ) -> Iterator[pa.RecordBatch]:
        """The rows of one key range of one parent, as Arrow batches in the ``columns.SCANNED`` schema."""
        batches = self.client.scan_lite_topics_columns(
            parent,
            start_after=key_range.start_after,
            end_before=key_range.end_before,
            batch_size=batch_size,
            with_subscribers=True,
            with_fully_consumed=with_fully_consumed,
            idle_since_before_ms=idle_since_before_ms,
        )
        try:
            for scanned in batches:
                n = len(scanned[c.LITE])
                if n:
                    yield _scan_batch(broker, scanned, n)
        finally:
            batches.close()

    def start_compare_and_delete(self, rows: pa.RecordBatch, *, dry_run: bool) -> PendingDelete:
        """Send the call for ``rows`` (parent, lite, expected columns and the subscriber count the scan saw: a
        subscriber beyond it keeps the row) and return at once: the caller prepares its next call meanwhile."""
        sent = {name: rows.column(name).to_pylist() for name in _DELETE_COLUMNS}
        return PendingDelete(self.client.start_compare_and_delete(sent, dry_run=dry_run, subscribers_seen=True))


class PendingDelete:
    """A compare-and-delete call in flight; ``result`` waits for its outcome names (``columns.Outcome``)."""

    def __init__(self, call: concurrent.futures.Future[list[DeleteOutcome]]) -> None:
        self._call = call

    def result(self) -> pa.Array:
        return pa.array([_OUTCOMES[o] for o in self._call.result()], pa.string())


def _scan_batch(broker: str, scanned: Mapping[str, Sequence[Any]], n: int) -> pa.RecordBatch:
    subscribers, fully = scanned.get(c.SUBSCRIBER_COUNT, ()), scanned.get(c.FULLY_CONSUMED, ())
    return pa.RecordBatch.from_arrays(
        [
            pa.array(itertools.repeat(broker, n), pa.string(), size=n),
            pa.array(scanned[c.PARENT], pa.string()),
            pa.array(scanned[c.LITE], pa.string()),
            pa.array(scanned[c.CREATED_MS], pa.int64()),
            pa.array(scanned[c.LAST_STORE_MS], pa.int64()),
            pa.array(scanned[c.LAST_CONSUME_MS], pa.int64()),
            pa.array(scanned[c.MIN_OFFSET], pa.int64()),
            pa.array(scanned[c.MAX_OFFSET], pa.int64()),
            pa.array(subscribers, pa.int32()) if len(subscribers) == n else pa.repeat(0, n).cast(pa.int32()),
            pa.array(fully, pa.bool_()) if len(fully) == n else pa.nulls(n, pa.bool_()),
        ],
        schema=c.SCANNED,
    )
