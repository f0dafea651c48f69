"""In-broker expiry of lite topics idle past their parent's expiration: the light path beside the reclaim job.

RocketMQ 5.5.0 expires lite topics in the broker; without this, nothing expired unless the Spark job ran. The
job stays the bulk path (millions of topics, audit, policies such as ``--only-fully-consumed``); this pass
makes expiry happen on a broker alone, at a modest, bounded cost.

A pass walks the parents whose expiration is not -1, ``lite_ttl_batch`` index rows per step, each step on a
worker thread with a pause between steps: the serving loop never walks the index, it only sees the few
candidates of a step (their subscriber counts, and the delete's marks). The walk reads every row rather than
pushing the idle filter down, because a filtered walk goes on until it finds ``batch`` matches, which on a
mostly fresh parent is the whole parent in one thread call.

The rule is the reclaim job's (``lmq_reclaim.transforms.decide``): idle = now - max(created, last store, last
consume); a topic expires when idle > its parent's expiration and idle >= the minimum age. The delete is the
job's too: ``reclaiming.compare_and_delete`` with what the step read, so a topic that got a message, a
consume or a new subscriber since is kept, and a deleted topic's subscriptions, offsets and ready events go
the way a reclaimed one's do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final

from lmq_broker import model
from lmq_broker.admin import reclaiming
from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch.api import LiveView
from lmq_broker.storage.api import Store

log = logging.getLogger(__name__)

MS_PER_MINUTE: Final = 60_000
LOG_EVERY_S: Final = 300.0  # at most one summary line per this many seconds, covering the passes since the last
# Candidates per compare-and-delete call. Smaller than the job's chunk (reclaiming.DELETE_BATCH): each call holds
# the store's write lock for its whole chunk, and sends wait for it; this path favours their latency over its rate
# (and pauses between chunks as between steps).
DELETE_CHUNK: Final = 25


@dataclass(frozen=True, slots=True)
class Settings:
    interval_ms: int  # 0: off
    batch: int
    step_pause_ms: int
    min_age_ms: int
    # At most this share of one core on average over a pass (its reads' thread CPU and its deletes' time, paced
    # by longer pauses between steps); 0: only ``step_pause_ms``.
    cpu_share: float = 0.0

    @classmethod
    def of(cls, config: BrokerConfig) -> Settings:
        return cls(
            interval_ms=config.lite_ttl_interval_ms,
            batch=config.lite_ttl_batch,
            step_pause_ms=config.lite_ttl_step_pause_ms,
            min_age_ms=config.lite_ttl_min_age_ms,
            cpu_share=config.lite_ttl_cpu_share,
        )

    def pause_s(self, spent_s: float, took_s: float) -> float:
        """The pause after a step that spent ``spent_s`` (CPU, or time where CPU is not counted) in ``took_s``."""
        pause = self.step_pause_ms / 1000
        if self.cpu_share <= 0:
            return pause
        return max(pause, spent_s / self.cpu_share - took_s)


@dataclass(slots=True)
class Report:
    """What one pass (or several, summed) did."""

    passes: int = 0
    parents: int = 0
    scanned: int = 0
    expired: int = 0  # chosen for deletion
    deleted: int = 0
    kept_changed: int = 0
    kept_subscribed: int = 0
    not_found: int = 0
    seconds: float = 0.0
    longest_step_s: float = 0.0  # the longest worker-thread read of one step

    def count(self, outcomes: Sequence[reclaiming.Outcome]) -> None:
        for outcome in outcomes:
            if outcome is reclaiming.Outcome.DELETED:
                self.deleted += 1
            elif outcome is reclaiming.Outcome.KEPT_CHANGED:
                self.kept_changed += 1
            elif outcome is reclaiming.Outcome.KEPT_SUBSCRIBED:
                self.kept_subscribed += 1
            elif outcome is reclaiming.Outcome.NOT_FOUND:
                self.not_found += 1

    def add(self, other: Report) -> None:
        self.passes += other.passes
        self.parents += other.parents
        self.scanned += other.scanned
        self.expired += other.expired
        self.deleted += other.deleted
        self.kept_changed += other.kept_changed
        self.kept_subscribed += other.kept_subscribed
        self.not_found += other.not_found
        self.seconds += other.seconds
        self.longest_step_s = max(self.longest_step_s, other.longest_step_s)


def is_expired(meta: model.LiteTopicMeta, now_ms: int, expiration_minutes: int, min_age_ms: int) -> bool:
    """The reclaim job's rule for one topic of a parent whose expiration is ``expiration_minutes`` (>= 0)."""
    idle = now_ms - max(meta.created_ms, meta.last_store_ms, meta.last_consume_ms)
    return idle > expiration_minutes * MS_PER_MINUTE and idle >= min_age_ms


@dataclass(slots=True)
class _Step:
    candidates: list[model.LiteTopicMeta]
    cursor: str | None  # where the next step resumes; None: the parent is done
    read: int
    seconds: float
    cpu_s: float  # the worker thread's CPU time for the step


def _read_step(
    store: Store, parent: model.ParentTopic, cursor: str, settings: Settings, clock: Callable[[], int]
) -> _Step:
    """One step, on a worker thread: ``batch`` rows of ``parent`` after ``cursor``, and which of them expired, by
    the parent's policy as it is now (a paced pass over a large parent lasts hours: a changed expiration counts
    from the next step on; a parent gone or set to never expire ends its walk)."""
    started, cpu = time.perf_counter(), time.thread_time()
    current = store.get_parent_topic(parent.name)
    if current is None or current.expiration_minutes < 0:
        return _Step([], None, 0, time.perf_counter() - started, time.thread_time() - cpu)
    metas = store.scan_lite_topics(parent.name, cursor, "", settings.batch)
    now = clock()
    expiration, min_age_ms = current.expiration_minutes, settings.min_age_ms
    candidates = [m for m in metas if is_expired(m, now, expiration, min_age_ms)]
    following = metas[-1].lite if len(metas) == settings.batch else None
    return _Step(candidates, following, len(metas), time.perf_counter() - started, time.thread_time() - cpu)


async def run_pass(
    store: Store,
    live: LiveView,
    settings: Settings,
    clock: Callable[[], int],
    *,
    stop: Callable[[], bool] = lambda: False,
    pause: Callable[[float], Awaitable[None]] = asyncio.sleep,
    on_step: Callable[[Report], None] = lambda _: None,
) -> Report:
    """One pass over every expiring parent; ``stop`` is asked before each step (True ends the pass early).
    ``on_step`` gets what each step did as it ends (a paced pass over millions of topics lasts hours: its
    counts are told as they happen, not at its end)."""
    started = time.perf_counter()
    report = Report(passes=1)
    parents = [p for p in await asyncio.to_thread(store.list_parent_topics) if p.expiration_minutes >= 0]
    report.parents = len(parents)
    pause_s = settings.step_pause_ms / 1000
    for parent in parents:
        cursor: str | None = ""
        while cursor is not None and not stop():
            began = time.perf_counter()
            step = await asyncio.to_thread(_read_step, store, parent, cursor, settings, clock)
            done = Report(scanned=step.read, expired=len(step.candidates), longest_step_s=step.seconds)
            cursor = step.cursor
            for start in range(0, len(step.candidates), DELETE_CHUNK):
                if start and pause_s > 0:  # each chunk holds the store's write lock: paced like the reads
                    await pause(pause_s)
                done.count(await _delete(store, live, parent.name, step.candidates[start : start + DELETE_CHUNK]))
            report.add(done)
            on_step(done)
            deleting_s = time.perf_counter() - began - step.seconds  # their CPU is not told apart: counted whole
            wait_s = settings.pause_s(step.cpu_s + max(0.0, deleting_s), time.perf_counter() - began)
            if cursor is not None and wait_s > 0:
                await pause(wait_s)
        if stop():
            break
    report.seconds = time.perf_counter() - started
    return report


async def _delete(
    store: Store, live: LiveView, parent: str, candidates: Sequence[model.LiteTopicMeta]
) -> list[reclaiming.Outcome]:
    """The reclaim job's compare-and-delete with what the step read, and the subscriber counts it sees now: a
    topic that gains a subscriber before the delete is kept, as one that gets a message or a consume is."""
    lmq = model.QueueId.lmq
    rows = reclaiming.Rows(
        [parent] * len(candidates),
        [m.lite for m in candidates],
        [m.max_offset for m in candidates],
        [m.last_store_ms for m in candidates],
        [m.last_consume_ms for m in candidates],
        [live.subscriber_count(lmq(parent, m.lite)) for m in candidates],
    )
    return await reclaiming.compare_and_delete(store, live, rows, require_no_subscribers=True, dry_run=False)


async def expire_one(store: Store, live: LiveView, queue: model.QueueId, now_ms: int, min_age_ms: int) -> bool:
    """Delete ``queue``'s lite topic if it is expired here by the rule (its parent's expiration, ``min_age_ms``;
    subscribers do not keep it, as in a pass), as a pass would; True when it is gone (deleted, or absent)."""
    parent, lite = queue.lite_parts()
    meta = await asyncio.to_thread(store.lite_topic, parent, lite)
    if meta is None:
        return True
    policy = await asyncio.to_thread(store.get_parent_topic, parent)
    if policy is None or policy.expiration_minutes < 0:
        return False
    if not is_expired(meta, now_ms, policy.expiration_minutes, min_age_ms):
        return False
    rows = reclaiming.Rows([parent], [lite], [meta.max_offset], [meta.last_store_ms], [meta.last_consume_ms])
    (outcome,) = await reclaiming.compare_and_delete(store, live, rows, require_no_subscribers=False, dry_run=False)
    return outcome in {reclaiming.Outcome.DELETED, reclaiming.Outcome.NOT_FOUND}


class Summary:
    """The passes' log line: at most one per ``every_s``, with the totals since the previous one."""

    def __init__(self, every_s: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._every_s = every_s
        self._clock = clock
        self._since = Report()
        self._last: float | None = None

    def add(self, report: Report) -> bool:
        """Count a pass; True when it wrote a line."""
        self._since.add(report)
        now = self._clock()
        if self._last is not None and now - self._last < self._every_s:
            return False
        total, self._since, self._last = self._since, Report(), now
        log.info(
            "lite-topic expiry: %d pass(es) in %.1f s over %d parent(s): %d topics read, %d expired, %d deleted, "
            "%d kept (changed %d, subscribed %d), %d already gone; longest step %.1f ms",
            total.passes,
            total.seconds,
            report.parents,
            total.scanned,
            total.expired,
            total.deleted,
            total.kept_changed + total.kept_subscribed,
            total.kept_changed,
            total.kept_subscribed,
            total.not_found,
            total.longest_step_s * 1000,
        )
        return True


async def run(
    store: Store,
    live: LiveView,
    settings: Settings,
    clock: Callable[[], int],
    stopping: asyncio.Event,
    *,
    on_pass: Callable[[Report], None],
    on_step: Callable[[Report], None] = lambda _: None,
) -> None:
    """A pass ``interval_ms`` after the previous one ended, until ``stopping``; the first ``max(min_age_ms,
    interval_ms)`` after start
    (as RocketMQ's first check waits minLiteTTl: clients reconnecting to a broker that was down get time to
    touch their topics again). A pass that fails is logged and the next one runs on time."""
    summary = Summary()
    delay_ms = max(settings.min_age_ms, settings.interval_ms)
    while not stopping.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), delay_ms / 1000)
            return
        delay_ms = settings.interval_ms
        trouble = store.health()
        if trouble is not None:
            log.debug("lite-topic expiry: pass skipped, the store cannot serve (%s)", trouble)
            continue
        try:
            report = await run_pass(store, live, settings, clock, stop=stopping.is_set, on_step=on_step)
        except Exception:
            log.exception("lite-topic expiry pass failed; next one in %.1f s", settings.interval_ms / 1000)
            continue
        on_pass(report)
        summary.add(report)
