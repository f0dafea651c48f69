"""Bulk reads and deletes of lite topics for the reclaim job and parent purges.

The store is read and written in worker threads, one batch per call, so the broker's event loop serves
clients between batches; the live view (the dispatcher's, owned by the loop) is only touched on the loop.

A delete is compare-and-delete: the expected (max offset, last store, last consume) come from the scan,
so a topic that received a message or a consume since then is kept; the offset writes of the batch's topics
under way when it is marked land before it (``Mark.writes_done``), those begun later wait for it. The
subscriber check is made on the loop in the same step that marks the batch's topics as being deleted
(``LiveView.begin_reclaim``); a subscription to a marked topic keeps it until the delete holds the store's
write lock (the store asks ``Mark.close`` then), and waits for the delete after that. The mark is cleared
and the deletions are told to the live view from a done-callback of the worker's future, so they are
forgotten even if the RPC is cancelled while the worker runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import functools
import re
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from lmq_broker import errors, model
from lmq_broker.admin import convert, validation
from lmq_broker.admin.inspection import groups_by_parent, scan_key
from lmq_broker.dispatch import reclaims
from lmq_broker.dispatch.api import LiveView
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as pb
from lmq_broker.storage.api import Store

SCAN_BATCH_DEFAULT: Final = 10_000
SCAN_BATCH_MAX: Final = 100_000
DELETE_BATCH: Final = 500  # rows per worker-thread call; bounds what a cancelled RPC leaves in flight
DELETE_ROWS_MAX: Final = 100_000  # rows per CompareAndDelete request
LOOP_SLICE: Final = 2_000  # live-view lookups between two yields to the event loop


class Outcome(enum.IntEnum):
    """Same numbers as ``lmq.admin.v1.DeleteOutcome``."""

    DELETED = pb.DELETED
    KEPT_CHANGED = pb.KEPT_CHANGED
    KEPT_SUBSCRIBED = pb.KEPT_SUBSCRIBED
    NOT_FOUND = pb.NOT_FOUND
    WOULD_DELETE = pb.WOULD_DELETE


@dataclass(frozen=True, slots=True)
class Row:
    parent: str
    lite: str
    max_offset: int
    last_store_ms: int
    last_consume_ms: int


@dataclass(slots=True)
class _Done:
    outcomes: list[Outcome] = field(default_factory=list)
    deleted: list[model.QueueId] = field(default_factory=list)
    error: errors.LmqError | None = None
    cursor: str | None = None  # where a walk resumes; None when it is finished


# --- scan ---------------------------------------------------------------------------------------------------
async def scan(
    store: Store, live: LiveView, request: pb.ScanLiteTopicsRequest
) -> AsyncIterator[pb.ScanLiteTopicsResponse]:
    parent = validation.name("parent", request.parent) if request.parent else ""
    idle_since_before = request.idle_since_before_ms
    if idle_since_before < 0:
        raise errors.InvalidArgument("idle_since_before_ms must be >= 0 (0: no filter)", value=idle_since_before)
    batch_size = validation.limit("batch_size", request.batch_size, default=SCAN_BATCH_DEFAULT, maximum=SCAN_BATCH_MAX)
    bound: dict[str, list[str]] | None = None
    if request.with_fully_consumed:
        bound = groups_by_parent(await asyncio.to_thread(store.list_groups))

    def read(start_after: str) -> tuple[list[model.LiteTopicMeta], pb.ScanLiteTopicsResponse]:
        metas = store.scan_lite_topics(parent or None, start_after, request.end_before, batch_size, idle_since_before)
        batch = convert.scan_batch_to_pb(metas)
        if bound is not None:
            batch.fully_consumed.extend([_fully_consumed(store, m, bound.get(m.parent, ())) for m in metas])
        return metas, batch

    cursor = request.start_after
    while True:
        metas, batch = await asyncio.to_thread(read, cursor)
        if not metas:
            return
        if request.with_subscribers:
            for start in range(0, len(metas), LOOP_SLICE):
                batch.subscriber_count.extend(
                    [
                        live.subscriber_count(model.QueueId.lmq(m.parent, m.lite))
                        for m in metas[start : start + LOOP_SLICE]
                    ]
                )
                await asyncio.sleep(0)
        yield batch
        if len(metas) < batch_size:
            return
        cursor = scan_key(metas[-1], parent)


def _fully_consumed(store: Store, meta: model.LiteTopicMeta, groups: Sequence[str]) -> bool:
    if meta.max_offset <= meta.min_offset:
        return True
    if not groups:
        return False
    queue = model.QueueId.lmq(meta.parent, meta.lite)
    for group in groups:
        committed = store.get_offset(queue, group)
        if committed is None or committed < meta.max_offset:
            return False
    return True


# --- compare-and-delete -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Rows:
    """Compare-and-delete rows as the request carries them: one list per column, no object per row."""

    parent: list[str]
    lite: list[str]
    max_offset: list[int]
    last_store_ms: list[int]
    last_consume_ms: list[int]
    subscribers: list[int] = field(default_factory=list)  # seen by the scan; empty: 0 for every row

    def __len__(self) -> int:
        return len(self.lite)

    def take(self, start: int, stop: int) -> Rows:
        return Rows(
            self.parent[start:stop],
            self.lite[start:stop],
            self.max_offset[start:stop],
            self.last_store_ms[start:stop],
            self.last_consume_ms[start:stop],
            self.subscribers[start:stop],
        )

    def pick(self, indexes: Sequence[int]) -> Rows:
        return Rows(
            [self.parent[i] for i in indexes],
            [self.lite[i] for i in indexes],
            [self.max_offset[i] for i in indexes],
            [self.last_store_ms[i] for i in indexes],
            [self.last_consume_ms[i] for i in indexes],
            [self.subscribers[i] for i in indexes] if self.subscribers else [],
        )

    def allowed_subscribers(self) -> list[int]:
        return self.subscribers or [0] * len(self)

    def compared(self) -> list[tuple[str, str, model.LiteTopicMeta]]:
        """The rows as ``Store.delete_lite_topics`` takes them."""
        expected = map(_expected, self.parent, self.lite, self.max_offset, self.last_store_ms, self.last_consume_ms)
        return list(zip(self.parent, self.lite, expected, strict=True))


# Every character a lite topic may hold, at most its byte length, one per line: when a whole column matches at
# once, each name in it is valid (one regex pass in C instead of a check per row); otherwise the rows are
# checked one by one to name the first bad one exactly as before.
_LITE_LINES: Final = re.compile(rf"(?:[A-Za-z0-9_-]{{1,{model.MAX_LITE_TOPIC_BYTES}}}\n)*")


def rows_of(request: pb.CompareAndDeleteRequest) -> Rows:
    columns: dict[str, Sequence[Any]] = {
        "parent": request.parent,
        "lite": request.lite,
        "expected_max_offset": request.expected_max_offset,
        "expected_last_store_ms": request.expected_last_store_ms,
        "expected_last_consume_ms": request.expected_last_consume_ms,
    }
    count = convert.row_count(columns, columns)
    if count > DELETE_ROWS_MAX:
        raise errors.InvalidArgument(f"at most {DELETE_ROWS_MAX} rows per request, got {count}", rows=count)
    if request.expected_subscriber_count:  # optional: empty, or one per row
        columns["expected_subscriber_count"] = request.expected_subscriber_count
        convert.row_count(columns, columns)
        if min(request.expected_subscriber_count) < 0:
            raise errors.InvalidArgument("expected_subscriber_count must be >= 0", field="expected_subscriber_count")
    rows = Rows(
        list(request.parent),
        list(request.lite),
        list(request.expected_max_offset),
        list(request.expected_last_store_ms),
        list(request.expected_last_consume_ms),
        list(request.expected_subscriber_count),
    )
    # A request names few parents (the job sends one broker's rows of one scan): check each distinct one once.
    bad_parents = {p for p in set(rows.parent) if not model.is_valid_resource_name(p)}
    lites_ok = _LITE_LINES.fullmatch("\n".join(rows.lite) + "\n") is not None if count else True
    if bad_parents or not lites_ok:
        for i in range(count):
            validation.name(f"parent[{i}]", rows.parent[i])
            validation.lite_topic(f"lite[{i}]", rows.lite[i])
    return rows


async def compare_and_delete(
    store: Store, live: LiveView, rows: Rows, *, require_no_subscribers: bool, dry_run: bool
) -> list[Outcome]:
    outcomes: list[Outcome] = []
    for start in range(0, len(rows), DELETE_BATCH):
        part = rows.take(start, start + DELETE_BATCH)
        outcomes += await _compare_batch(
            store, live, part, require_no_subscribers=require_no_subscribers, dry_run=dry_run
        )
    return outcomes


async def _compare_batch(
    store: Store, live: LiveView, rows: Rows, *, require_no_subscribers: bool, dry_run: bool
) -> list[Outcome]:
    lmqs = list(map(model.QueueId.lmq, rows.parent, rows.lite))
    mark = live.begin_reclaim(lmqs, rows.allowed_subscribers() if require_no_subscribers else None)
    todo = [i for i, kept in enumerate(mark.kept) if not kept]
    if not todo:
        live.end_reclaim(mark, [])
        return [Outcome.KEPT_SUBSCRIBED] * len(rows)
    part = rows if len(todo) == len(rows) else rows.pick(todo)
    try:
        await mark.writes_done()  # an ack's commit point under way lands first: its topic compares as changed
    except BaseException:
        live.end_reclaim(mark, [])
        raise
    done = await _in_worker(
        functools.partial(_compare_rows, store, part, mark, dry_run), functools.partial(live.end_reclaim, mark)
    )
    if done.error is not None:
        raise done.error
    outcomes = [Outcome.KEPT_SUBSCRIBED] * len(rows)
    for i, outcome in zip(todo, done.outcomes, strict=True):
        outcomes[i] = outcome
    return outcomes


def _compare_rows(store: Store, rows: Rows, mark: reclaims.Mark, dry_run: bool) -> _Done:
    done = _Done()
    try:
        # A parent set to never expire since the scan keeps its topics (KEPT_CHANGED below): its policy now.
        never = _never_expiring(store, rows)
        if dry_run:
            vetoed = mark.close()
            done.outcomes = [_dry_run_row(store, rows, i, vetoed, never) for i in range(len(rows))]
            return done
        # One store call for the chunk: one commit-log write, one fsync and one index batch, not one per row.
        deleted = store.delete_lite_topics(rows.compared(), keep=lambda: mark.close() | never)
        vetoed = mark.vetoed
        lmq = model.QueueId.lmq
        for i, ok in enumerate(deleted):
            queue = lmq(rows.parent[i], rows.lite[i])
            if ok:
                done.deleted.append(queue)
                done.outcomes.append(Outcome.DELETED)
            elif queue.topic in vetoed:  # a subscriber arrived while it was marked
                done.outcomes.append(Outcome.KEPT_SUBSCRIBED)
            else:  # changed since the scan, or already gone (deleted by someone else, or twice in this request)
                gone = store.lite_topic(rows.parent[i], rows.lite[i]) is None
                done.outcomes.append(Outcome.NOT_FOUND if gone else Outcome.KEPT_CHANGED)
    except errors.LmqError as exc:
        done.error = exc
    return done


def _expected(parent: str, lite: str, max_offset: int, last_store_ms: int, last_consume_ms: int) -> model.LiteTopicMeta:
    """What the store compares: max offset, last store and last consume (the other fields are not looked at)."""
    return model.LiteTopicMeta(parent, lite, 0, last_store_ms, last_consume_ms, 0, max_offset)


def _never_expiring(store: Store, rows: Rows) -> frozenset[str]:
    """The LMQ topics of ``rows`` whose parent's expiration is -1 now."""
    never = {p for p in set(rows.parent) if (t := store.get_parent_topic(p)) is not None and t.expiration_minutes < 0}
    if not never:
        return frozenset()
    lmq = model.QueueId.lmq
    return frozenset(lmq(p, lite).topic for p, lite in zip(rows.parent, rows.lite, strict=True) if p in never)


def _dry_run_row(store: Store, rows: Rows, i: int, vetoed: frozenset[str], never: frozenset[str]) -> Outcome:
    current = store.lite_topic(rows.parent[i], rows.lite[i])
    if current is None:
        return Outcome.NOT_FOUND
    if never and model.QueueId.lmq(rows.parent[i], rows.lite[i]).topic in never:
        return Outcome.KEPT_CHANGED
    if model.QueueId.lmq(rows.parent[i], rows.lite[i]).topic in vetoed:
        return Outcome.KEPT_SUBSCRIBED
    expected = dataclasses.replace(
        current,
        max_offset=rows.max_offset[i],
        last_store_ms=rows.last_store_ms[i],
        last_consume_ms=rows.last_consume_ms[i],
    )
    return Outcome.KEPT_CHANGED if expected != current else Outcome.WOULD_DELETE


# --- purge --------------------------------------------------------------------------------------------------
async def purge(store: Store, live: LiveView, parent: str) -> int:
    """Delete every lite topic of ``parent`` unconditionally, a batch per worker call; returns how many."""

    def batch(start_after: str) -> _Done:
        done = _Done()
        metas = store.scan_lite_topics(parent, start_after, "", DELETE_BATCH)
        done.cursor = metas[-1].lite if len(metas) == DELETE_BATCH else None
        try:
            deleted = store.delete_lite_topics([(parent, meta.lite, None) for meta in metas])
            done.deleted.extend(model.QueueId.lmq(parent, m.lite) for m, ok in zip(metas, deleted, strict=True) if ok)
        except errors.LmqError as exc:
            done.error = exc
        return done

    total = 0
    cursor: str | None = ""
    while cursor is not None:
        done = await _in_worker(functools.partial(batch, cursor), functools.partial(_forget, live))
        total += len(done.deleted)
        if done.error is not None:
            raise done.error
        cursor = done.cursor
    return total


def _forget(live: LiveView, deleted: Sequence[model.QueueId]) -> None:
    for queue in deleted:
        live.forget_lite_topic(queue)


async def _in_worker(work: Callable[[], _Done], settle: Callable[[list[model.QueueId]], None]) -> _Done:
    """Run ``work`` in a thread; ``settle`` what it deleted on the loop as soon as it ends (with nothing if
    it failed), even if we are cancelled."""
    future = asyncio.ensure_future(asyncio.to_thread(work))

    def finished(result: asyncio.Future[_Done]) -> None:
        ok = not result.cancelled() and result.exception() is None
        settle(result.result().deleted if ok else [])

    future.add_done_callback(finished)
    return await asyncio.shield(future)
