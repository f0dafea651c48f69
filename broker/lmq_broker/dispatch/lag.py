"""Consumer lag per lite group, for ``/metrics`` (``lmq_consumer_lag{group, parent}``).

Lag here is what ``GetLiteGroup`` reports (``admin/inspection.py``): messages a group has still to consume,
summed over the lite topics of its parent that it committed an offset on or that one of its clients
subscribes to. Nothing keeps that sum up to date as messages come and go, so it is counted from offsets:
one offset read per (lite topic, group of its parent), a walk over every lite topic of every parent that
has groups. It must never cost the serving loop that walk, nor run once per scrape:

* the walk runs on a worker thread, from a copy of the subscriptions taken on the loop (``subscriptions``:
  O(subscriptions), the lite topics are never walked there);
* ``LagBoard.read`` (the scrape) returns the last finished walk and, once that is older than the refresh
  interval, starts the next one in the background; the interval stretches to ten times the last walk's
  duration, so walking takes at most a tenth of a core however many lite topics there are;
* nothing is walked while nobody scrapes.

So the figure is up to one interval (30 s or more) plus one scrape interval old; it is a trend for alerts
and dashboards, not an exact count (``lmq-admin groups get`` walks on demand for that).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Final

from lmq_broker import model
from lmq_broker.dispatch.registry import ClientState
from lmq_broker.storage.api import Store

log = logging.getLogger(__name__)

WALK_BATCH: Final = 1000  # lite topics per store scan
REFRESH_MIN_S: Final = 30.0
WALK_SHARE: Final = 0.1  # at most this share of the time is spent walking

Lags = dict[tuple[str, str], int]  # (group, parent) -> messages not consumed yet


def backlog(meta: model.LiteTopicMeta, committed: int | None) -> int:
    """Messages of a lite topic a group has still to consume; no commit yet means all that are stored."""
    start = meta.min_offset if committed is None else max(committed, meta.min_offset)
    return max(0, meta.max_offset - start)


def subscriptions(clients: Iterable[ClientState]) -> dict[str, frozenset[str]]:
    """Group -> the LMQs (``%LMQ%$parent$lite``) its clients subscribe to. On the loop, which owns them."""
    found: defaultdict[str, set[str]] = defaultdict(set)
    for client in clients:
        if client.group and client.lite_topics:
            found[client.group].update(client.lite_topics)
    return {group: frozenset(lmqs) for group, lmqs in found.items()}


def walk(store: Store, subscribed: Mapping[str, frozenset[str]]) -> Lags:
    """Lag of every lite group (0 for a group with nothing to consume). Blocking: run it on a worker thread."""
    by_parent: defaultdict[str, list[str]] = defaultdict(list)
    for group in store.list_groups():
        if group.bind_topic:
            by_parent[group.bind_topic].append(group.name)
    lags: Lags = {}
    for parent, names in by_parent.items():
        totals = dict.fromkeys(names, 0)
        cursor = ""
        while True:
            metas = store.scan_lite_topics(parent, cursor, "", WALK_BATCH)
            for meta in metas:
                if meta.max_offset <= meta.min_offset:
                    continue  # empty: no group has anything to consume there
                queue = model.QueueId.lmq(meta.parent, meta.lite)
                for name in names:
                    committed = store.get_offset(queue, name)
                    if committed is None and queue.topic not in subscribed.get(name, ()):
                        continue  # never consumed nor subscribed by this group: not its topic
                    totals[name] += backlog(meta, committed)
            if len(metas) < WALK_BATCH:
                break
            cursor = metas[-1].lite
        lags.update(((name, parent), total) for name, total in totals.items())
    return lags


class LagBoard:
    """The last walk's figures, refreshed in the background when read and stale. ``read`` may be called from
    any thread; the walk is started on ``loop``, where ``clients`` (the subscription registry) is read."""

    def __init__(
        self,
        store: Store,
        clients: Callable[[], Iterable[ClientState]],
        loop: asyncio.AbstractEventLoop,
        run: Callable[[Callable[[], Lags | None]], Awaitable[Lags | None]],
        *,
        clock: Callable[[], float] = time.monotonic,
        refresh_min_s: float = REFRESH_MIN_S,
    ) -> None:
        self._store = store
        self._clients = clients
        self._loop = loop
        self._run = run  # the dispatcher's store pool: ``Dispatcher.run``
        self._clock = clock
        self._refresh_min_s = refresh_min_s
        self._lock = threading.Lock()
        self._lags: Lags = {}
        self._done_at: float | None = None
        self._interval_s = refresh_min_s
        self._running = False
        self._task: asyncio.Task[None] | None = None
        self.walk_seconds = 0.0  # duration of the last walk

    def read(self) -> Lags:
        """The last figures; starts a walk when they are older than the interval (or there are none)."""
        with self._lock:
            stale = self._done_at is None or self._clock() - self._done_at >= self._interval_s
            start = stale and not self._running
            if start:
                self._running = True
            lags = dict(self._lags)
        if start:
            self._loop.call_soon_threadsafe(self._start)
        return lags

    def _start(self) -> None:
        self._task = self._loop.create_task(self._refresh())

    async def _refresh(self) -> None:
        started = self._clock()
        try:
            subscribed = subscriptions(self._clients())
            found = await self._run(lambda: self._walk(subscribed))
        finally:
            with self._lock:
                self._running = False
        took = self._clock() - started
        with self._lock:
            if found is not None:
                self._lags = found
            self._done_at = self._clock()
            self.walk_seconds = took
            self._interval_s = max(self._refresh_min_s, took / WALK_SHARE)

    def _walk(self, subscribed: Mapping[str, frozenset[str]]) -> Lags | None:
        try:
            return walk(self._store, subscribed)
        except Exception as exc:  # a closing store, an index being rebuilt: keep the last figures
            log.info("consumer lag walk failed, keeping the last figures: %s", exc)
            return None
