"""Read-only views of lite topics, groups and the broker: what an operator or a human asks "how is it?".

Store reads run in worker threads, one page at a time; ``LiveView`` lookups stay on the event loop, which
owns the dispatcher's state. Nothing here walks every lite topic of the broker except ``undrained`` (and
only when asked):

* group lag walks the lite topics of the group's bind topic — O(lite topics of that parent) point reads,
  one offset read per (lite topic, group of that parent) — because neither the store nor the live view
  can list "the topics of a group". A topic counts for a group when the group has committed an offset
  on it or one of its clients subscribes to it; groups bound to the same parent share one walk.
* undrained messages walk every lite topic of the broker: a non-empty topic costs one offset read per
  group of its parent, an empty one costs nothing. A message counts while some group bound to its
  parent has not consumed it, and every message of a parent without groups counts: conservative, as the
  figure guards scale-down.
* one group's lag detail (``group_lag``) is the group-lag walk of its bind topic plus one message read per
  lagging topic (the age of its oldest unconsumed message), keeping only a heap of the top K.
"""

from __future__ import annotations

import asyncio
import heapq
import os
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from typing import Final

import lmq_broker
from lmq_broker import errors, model
from lmq_broker.admin import convert, validation
from lmq_broker.admin.results import GroupLag, LiteTopicLag
from lmq_broker.cluster import relocating
from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch.api import LiveView
from lmq_broker.dispatch.lag import backlog
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as pb
from lmq_broker.storage.api import Store

WALK_BATCH: Final = 1000  # lite topics read per worker-thread call when walking a parent or the broker
PAGE_DEFAULT: Final = 100
PAGE_MAX: Final = 10_000
TOP_K_DEFAULT: Final = 10
TOP_K_MAX: Final = 1000
Drains = Callable[[str], bool]  # an LMQ name stored here -> whether this broker drains it (blocking: may read)


def scan_key(meta: model.LiteTopicMeta, parent: str) -> str:
    """The key a next page starts after: the lite name within a parent, ``parent$lite`` across parents."""
    return meta.lite if parent else f"{meta.parent}{model.LMQ_SEPARATOR}{meta.lite}"


def groups_by_parent(groups: Iterable[model.LiteGroup]) -> dict[str, list[str]]:
    bound: defaultdict[str, list[str]] = defaultdict(list)
    for group in groups:
        bound[group.bind_topic].append(group.name)
    return dict(bound)


# --- one lite topic, pages of lite topics ---------------------------------------------------------------
async def describe(
    store: Store, live: LiveView, parent: str, lite: str, held: Callable[[str], bool] | None = None
) -> pb.DescribeLiteTopicResponse:
    """One lite topic; NOT_FOUND when this store has none, or when ``held`` (a placement question about one slot,
    with replication) says its records name another slot."""
    validation.name("parent", parent)
    validation.lite_topic("lite", lite)

    def read() -> tuple[model.LiteTopicMeta, dict[str, int]]:
        meta = store.lite_topic(parent, lite)
        if meta is None or (held is not None and not held(model.QueueId.lmq(parent, lite).topic)):
            raise errors.NotFound(f"lite topic {lite!r} of {parent!r} not found", parent=parent, lite=lite)
        queue = model.QueueId.lmq(parent, lite)
        offsets = {}
        for group in groups_by_parent(store.list_groups()).get(parent, []):
            offset = store.get_offset(queue, group)
            if offset is not None:
                offsets[group] = offset
        return meta, offsets

    meta, offsets = await asyncio.to_thread(read)
    clients = live.subscribers(model.QueueId.lmq(parent, lite))
    return pb.DescribeLiteTopicResponse(
        topic=convert.lite_topic_to_pb(meta, len(clients)), group_offsets=offsets, subscribed_clients=clients
    )


async def list_page(
    store: Store, live: LiveView, parent: str, start_after: str, limit: int
) -> pb.ListLiteTopicsResponse:
    if parent:
        validation.name("parent", parent)
    limit = validation.limit("limit", limit, default=PAGE_DEFAULT, maximum=PAGE_MAX)
    # One row more than asked tells whether another page exists.
    metas = await asyncio.to_thread(store.scan_lite_topics, parent or None, start_after, "", limit + 1)
    page, more = metas[:limit], len(metas) > limit
    return pb.ListLiteTopicsResponse(
        topics=[convert.lite_topic_to_pb(m, live.subscriber_count(model.QueueId.lmq(m.parent, m.lite))) for m in page],
        next_start_after=scan_key(page[-1], parent) if more else "",
    )


# --- groups -----------------------------------------------------------------------------------------------
async def group_views(store: Store, live: LiveView, groups: Sequence[model.LiteGroup]) -> list[pb.GetLiteGroupResponse]:
    lags = await group_lags(store, live, groups)
    views = []
    for group in groups:
        clients = live.clients(group.name)
        views.append(
            pb.GetLiteGroupResponse(
                group=convert.lite_group_to_pb(group),
                subscription_count=sum(c.subscription_count for c in clients),
                client_count=len(clients),
                lag=lags[group.name],
            )
        )
    return views


async def group_lags(store: Store, live: LiveView, groups: Sequence[model.LiteGroup]) -> dict[str, int]:
    lags = dict.fromkeys((g.name for g in groups), 0)
    for parent, names in groups_by_parent(groups).items():
        async for meta, name, offset, _oldest in _group_topics(store, live, parent, names):
            lags[name] += backlog(meta, offset)
    return lags


async def _group_topics(
    store: Store,
    live: LiveView,
    parent: str,
    names: Sequence[str],
    *,
    with_oldest: bool = False,
    unclaimed: Callable[[model.LiteTopicMeta], None] | None = None,
) -> AsyncIterator[tuple[model.LiteTopicMeta, str, int | None, int | None]]:
    """(topic, group, committed offset, store time of the oldest unconsumed message if asked) for every lite
    topic of ``parent`` that counts for each group of ``names``, a page of ``WALK_BATCH`` per worker-thread call;
    a topic that counts for none of them is given to ``unclaimed``."""
    group_of_client = {c.client_id: c.group for c in live.clients()}
    cursor = ""
    while True:
        rows = await asyncio.to_thread(_offsets_page, store, parent, names, cursor, with_oldest)
        for meta, committed, oldest in rows:
            subscribed: set[str] | None = None
            for name, offset, first in zip(names, committed, oldest, strict=True):
                if offset is None:
                    if subscribed is None:
                        lmq = model.QueueId.lmq(meta.parent, meta.lite)
                        subscribed = {group_of_client.get(c, "") for c in live.subscribers(lmq)}
                    if name not in subscribed:
                        if unclaimed is not None:
                            unclaimed(meta)
                        continue  # never consumed nor subscribed by this group: not its topic
                yield meta, name, offset, first
        if len(rows) < WALK_BATCH:
            return
        cursor = rows[-1][0].lite


async def group_lag(store: Store, live: LiveView, group: model.LiteGroup, top_k: int, now_ms: int) -> GroupLag:
    """One group's lag, its latency (age of the oldest unconsumed message) and its ``top_k`` lite topics by lag:
    the same paged walk as ``group_lags`` plus one message read per lagging topic, with a heap of ``top_k``."""
    top_k = validation.limit("top_k", top_k, default=TOP_K_DEFAULT, maximum=TOP_K_MAX)
    total = latency = lagging = 0
    heap: list[tuple[int, _Reversed, LiteTopicLag]] = []  # min-heap of the k largest (lag, then first name)
    waiting = [0, 0]  # messages, topics not claimed by the group

    def unclaimed(meta: model.LiteTopicMeta) -> None:
        if (count := backlog(meta, None)) > 0:
            waiting[0] += count
            waiting[1] += 1

    async for meta, _name, offset, oldest in _group_topics(
        store, live, group.bind_topic, [group.name], with_oldest=True, unclaimed=unclaimed
    ):
        lag = backlog(meta, offset)
        if lag <= 0:
            continue
        age = max(0, now_ms - oldest) if oldest is not None else 0
        total, lagging, latency = total + lag, lagging + 1, max(latency, age)
        row = LiteTopicLag(meta.lite, lag, -1 if offset is None else offset, meta.max_offset, age)
        entry = (lag, _Reversed(meta.lite), row)
        if len(heap) < top_k:
            heapq.heappush(heap, entry)
        elif entry[:2] > heap[0][:2]:
            heapq.heapreplace(heap, entry)
    top = tuple(row for *_, row in sorted(heap, key=lambda e: (-e[0], e[2].lite)))
    return GroupLag(group.name, group.bind_topic, total, latency, lagging, top, waiting[0], waiting[1])


class _Reversed(str):
    """A name that orders backwards: among equal lags the heap keeps the alphabetically first names."""

    __slots__ = ()

    def __lt__(self, other: str) -> bool:
        return str.__gt__(self, other)

    def __gt__(self, other: str) -> bool:
        return str.__lt__(self, other)


def _offsets_page(
    store: Store, parent: str, groups: Sequence[str], start_after: str, with_oldest: bool = False
) -> list[tuple[model.LiteTopicMeta, list[int | None], list[int | None]]]:
    """A page of ``parent``'s lite topics, each with the committed offset of every group in ``groups`` and,
    ``with_oldest``, the store time of the first message each group has not consumed (None: no backlog)."""
    rows = []
    for meta in store.scan_lite_topics(parent, start_after, "", WALK_BATCH):
        queue = model.QueueId.lmq(meta.parent, meta.lite)
        committed = [store.get_offset(queue, g) for g in groups]
        oldest: list[int | None] = [None] * len(groups)
        if with_oldest:
            for i, offset in enumerate(committed):
                if backlog(meta, offset) > 0:
                    first = store.read(queue, meta.min_offset if offset is None else max(offset, meta.min_offset), 1)
                    oldest[i] = first[0].store_timestamp_ms if first else None
        rows.append((meta, committed, oldest))
    return rows


# --- the broker -------------------------------------------------------------------------------------------
async def broker_info(
    store: Store,
    live: LiveView,
    config: BrokerConfig,
    *,
    skip_undrained: bool,
    drains: Drains | None = None,
    relocated: relocating.Consumers | None = None,
) -> pb.GetBrokerInfoResponse:
    """``relocated``: at a leaving broker, the groups its consumers said they consume (``Cluster.normal_consumers``):
    its undrained messages include those of its queues that are not lite topics not yet copied to a remaining
    broker (``cluster.relocating``)."""

    def counts() -> tuple[int, int, int, int]:
        return (
            store.lite_topic_count(None),
            len(store.list_parent_topics()),
            len(store.list_groups()),
            disk_usage(config.store.data_dir),
        )

    lite_topics, parents, groups, stored_bytes = await asyncio.to_thread(counts)
    return pb.GetBrokerInfoResponse(
        broker_name=config.broker_name,
        version=lmq_broker.__version__,
        lite_topic_count=lite_topics,
        subscription_count=live.subscription_count(),
        client_count=live.client_count(),
        stored_bytes=stored_bytes,
        undrained_messages=-1 if skip_undrained else await undrained(store, drains, relocated=relocated),
        parent_topic_count=parents,
        group_count=groups,
    )


async def undrained(
    store: Store,
    drains: Drains | None = None,
    handed_over: Drains | None = None,
    *,
    relocated: relocating.Consumers | None = None,
) -> int:
    """Messages of this broker's lite topics that some group bound to their parent has not consumed (a topic
    whose parent has no group: all of them). With replication, only the topics ``drains`` names (the topics of
    this broker's own slot, by the slot their records name): its copies of the slots it follows drain at their
    holders, and counting them would keep a leaving follower undrained for as long as those slots take sends.
    With ``handed_over`` (a leaving broker) a topic not handed over to its owner in today's ring yet counts at
    least 1 even when consumed: only the hand-over subscribes its consumers at that owner, and with replication
    its next owner takes it over where it ends (its followers hold copies at those offsets), neither of which
    can happen once the leaving slot is removed. With ``relocated`` (a leaving broker: the groups its consumers
    said they consume) or ``handed_over``, the messages of its NORMAL topics and dead letters that some group has
    not consumed and that are not copied to a remaining broker yet count too (``cluster.relocating``): removed,
    the broker would strand them."""
    bound = groups_by_parent(await asyncio.to_thread(store.list_groups))

    def page(start_after: str) -> tuple[int, str | None]:
        metas = store.scan_lite_topics(None, start_after, "", WALK_BATCH)
        total = 0
        for meta in metas:
            if meta.max_offset <= meta.min_offset:
                continue
            if drains is not None and not drains(model.QueueId.lmq(meta.parent, meta.lite).topic):
                continue
            names = bound.get(meta.parent)
            if not names:
                total += meta.max_offset - meta.min_offset
                continue
            queue = model.QueueId.lmq(meta.parent, meta.lite)
            left = max(backlog(meta, store.get_offset(queue, name)) for name in names)
            total += max(left, 1) if handed_over is not None and not handed_over(queue.topic) else left
        return total, scan_key(metas[-1], "") if len(metas) == WALK_BATCH else None

    leaving = relocated is not None or handed_over is not None
    total = await asyncio.to_thread(relocating.undrained, store, relocated) if leaving else 0
    cursor: str | None = ""
    while cursor is not None:
        count, cursor = await asyncio.to_thread(page, cursor)
        total += count
    return total


def disk_usage(root: Path) -> int:
    """Bytes of every file under ``root`` (segments and index); files vanishing meanwhile are skipped."""
    total = 0
    for folder, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name), follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
    return total
