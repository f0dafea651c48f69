"""The read side of the broker: subscriptions in, leased messages out, driven by events, never by scans.

Work reaches a consumer through three doors, each naming one lite topic: a message arrived (coalesced per
loop tick), an ack left more behind, a lease expired. The topic is offered to one subscribed client per
group (shared mode) through that client's ready queue, and the client's long poll wakes. A receive
drains its ready queue, reads from the group's committed offset and leases. Nothing walks all lite
topics: arrival is a dict lookup, idle topics cost no CPU and no memory beyond their subscription entry.
A catch-up pass over one client's own subscriptions runs only when its ready queue overflowed (or right
after it subscribed to topics that already hold messages).

Runs on one asyncio loop; the store is blocking, so store calls go through ``run`` (a thread pool), except
those that never wait for another writer: an ack's offset commit (``try_commit_offset``, on the pool only
when refused) and the max offset read after it. Dispatcher state is never touched from the pool's threads.
Time is injected (``clock``, monotonic milliseconds); ``tick`` does whatever is due and is what the
timer calls, so tests drive expiry with a fake clock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import random
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, filterfalse
from operator import attrgetter, itemgetter, methodcaller
from typing import Final, ParamSpec, TypeVar

from lmq_broker import errors, model
from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch import (
    api,
    appender,
    catalog,
    leases,
    offsets,
    quotas,
    readyset,
    recent,
    reclaims,
    registry,
    snapshot,
    wildcards,
)
from lmq_broker.storage import keys, ranges
from lmq_broker.storage.api import Store

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

HOUSEKEEPING_INTERVAL_MS: Final = 10_000
COMMITTED_CACHE_SIZE: Final = 100_000
NOTICES_PER_CLIENT: Final = 1024
CATCHUP_CHUNK: Final = 512
RENEW_AHEAD_MS: Final = 5_000  # an auto-renew lease is renewed this long before it would expire
DLQ_PREFIX: Final = catalog.DLQ_PREFIX
NORMAL_WINDOW: Final = 1024  # in-flight messages per (normal queue, group)
STORE_RETRY_MS: Final = 1_000  # a lite topic whose read the store refused (index rebuild) is looked at again


_queues_of = attrgetter("queues")
_topic_of = itemgetter(0)  # of a QueueId
_is_lmq_topic = methodcaller("startswith", model.LMQ_PREFIX)


def monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def epoch_ms() -> int:
    return time.time_ns() // 1_000_000


def lmq_name(parent: str, lite: str) -> str:
    return model.QueueId.lmq(parent, lite).topic


OffsetPolicy = offsets.OffsetPolicy
OffsetReset = offsets.OffsetReset
dlq_topic = offsets.dlq_topic


@dataclass(frozen=True, slots=True)
class Delivery:
    message: model.StoredMessage
    attempt: int
    receipt_handle: str
    invisible_ms: int


Key = leases.Key


class Dispatcher:
    def __init__(
        self,
        store: Store,
        config: BrokerConfig,
        *,
        clock: Callable[[], int] = monotonic_ms,
        wall_clock: Callable[[], int] = epoch_ms,
        executor: concurrent.futures.Executor | None = None,
        incarnation: str | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.clock = clock
        self.wall_clock = wall_clock
        self._own_executor = executor is None
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="lmq-store")
        self.registry = registry.Registry(config.max_subscriptions_per_broker)
        self.ready = readyset.ReadySet()
        self.leases = leases.LeaseTable(incarnation or secrets.token_hex(6), NORMAL_WINDOW)
        self._rng = rng or random.Random()
        self._snap = catalog.Snapshot(config)
        self._snap_stale = True
        self._snap_reload: asyncio.Task[catalog.Snapshot] | None = None
        self._client_events: dict[str, asyncio.Event] = {}
        self._notices: dict[str, asyncio.Queue[str]] = {}
        self._topic_events: dict[str, asyncio.Event] = {}
        self._arrived: dict[str, None] = {}
        self._flush_scheduled = False
        self._busy: set[Key] = set()
        self._commit_locks: dict[Key, tuple[asyncio.Lock, list[int]]] = {}
        self._catchup_cursor: dict[str, list[str]] = {}
        self.wildcards = wildcards.Wildcards()
        self._wildcard_cursor: dict[str, str] = {}  # client -> last lite name its catch-up offered
        self._catchup_running: set[str] = set()
        self._catchup_again: set[str] = set()  # asked for while a pass ran: one more pass when it ends
        self._reclaims: dict[str, list[reclaims.Mark]] = {}  # LMQ -> compare-and-deletes deleting it
        self._buckets: dict[str, catalog.TokenBucket] = {}
        self._rr = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._appender: appender.Appender | None = None
        self.recent = recent.RecentMessages()
        self._renewal = leases.Renewal(
            config.lease_renew_slice_ms, min(RENEW_AHEAD_MS, config.lease_renew_slice_ms // 2), self._holds
        )
        # Commit points of (queue, group) pairs with nothing in flight (their lease state is dropped when
        # idle), so the next delivery need not read it back: this broker is the only writer of offsets.
        self._committed: OrderedDict[str, dict[tuple[int, str], int]] = OrderedDict()  # topic -> (queue, group)
        # What the store holds for each key with lease state: (commit point, acked above it), as last persisted
        # (-1: no commit point stored). A key whose memory differs after a failed write is *dirty*: it keeps its
        # state (a released state would re-read the stale commit point and hand acked messages out again) and
        # its commit is retried by the next ack, by housekeeping and by ``resync``.
        self._persisted: dict[Key, tuple[int, ranges.OffsetRanges]] = {}
        self._dirty: set[Key] = set()
        self._retrying = False
        self._generation = store.index_generation()  # see ``_check_generation``
        self._unverified: set[Key] = set()  # lease state kept across an index replacement, not yet clipped
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0
        self._next_housekeeping = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.draining = False  # shutting down: closing streams must not forget their clients

    # --- lifecycle --------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._appender = appender.Appender(self.store, self._loop)
        await self.metadata()
        self._next_housekeeping = self.clock() + HOUSEKEEPING_INTERVAL_MS
        self._arm(self._next_housekeeping)

    def begin_drain(self) -> None:
        """Shutdown begins: end every long poll now (empty), and keep clients whose streams close."""
        self.draining = True
        for event in [*self._client_events.values(), *self._topic_events.values()]:
            event.set()

    async def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for event in [*self._client_events.values(), *self._topic_events.values()]:
            event.set()
        if self._appender is not None:
            await self._appender.aclose()
        if self._own_executor:
            await asyncio.to_thread(self._executor.shutdown, True)

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run a blocking store call on the thread pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def _spawn(self, coro: Awaitable[None]) -> None:
        async def wrapper() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("background dispatch task failed")

        task = asyncio.get_running_loop().create_task(wrapper())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def next_round_robin(self) -> int:
        self._rr += 1
        return self._rr

    # --- metadata ---------------------------------------------------------------------------------------
    async def metadata(self) -> catalog.Snapshot:
        """The current metadata snapshot, reloaded first if metadata changed since it was taken."""
        if not self._snap_stale:
            return self._snap
        if self._snap_reload is None:
            self._snap_stale = False  # a change during the reload marks it stale again
            self._snap_reload = asyncio.get_running_loop().create_task(
                self.run(catalog.Snapshot.load, self.store, self.config)
            )
        reload = self._snap_reload
        try:
            snap = await asyncio.shield(reload)
        except BaseException:
            self._snap_stale = True
            raise
        finally:
            if self._snap_reload is reload and reload.done():
                self._snap_reload = None
        self._snap = snap
        return snap

    def metadata_changed(self) -> None:
        self._snap_stale = True

    # --- clients ----------------------------------------------------------------------------------------
    def client_seen(
        self,
        client_id: str,
        *,
        client_type: int | None = None,
        group: str | None = None,
        bind_topic: str | None = None,
        topics: Iterable[str] | None = None,
        language: str = "",
        version: str = "",
    ) -> registry.ClientState:
        state = self.registry.touch(
            client_id, self.clock(), client_type=client_type, group=group, bind_topic=bind_topic, topics=topics
        )
        if language:
            state.language = language
        if version:
            state.version = version
        return state

    def stream_opened(self, client_id: str) -> asyncio.Queue[str]:
        """A telemetry stream opened; returns the client's notices (lite topics taken from it) to relay."""
        self.registry.touch(client_id, self.clock()).streams += 1
        notices = self._notices.get(client_id)
        if notices is None:
            notices = self._notices[client_id] = asyncio.Queue(maxsize=NOTICES_PER_CLIENT)
        return notices

    def stream_closed(self, client_id: str) -> None:
        state = self.registry.get(client_id)
        if state is None:
            self._notices.pop(client_id, None)
            return
        state.streams -= 1
        if state.streams <= 0:
            self._notices.pop(client_id, None)
            if not self.draining:
                self.client_gone(client_id)

    def _holds(self, client_id: str, key: Key) -> bool:
        """Are the client's leases of ``key`` still renewed: it is registered (not terminated or expired), in
        the key's group, and for a lite topic still subscribed to it (not unsubscribed, nor evicted by an
        Exclusive peer)."""
        state = self.registry.get(client_id)
        if state is None or state.group != key[2]:
            return False
        if not key[0].startswith(model.LMQ_PREFIX):
            return True
        return key[0] in state.lite_topics or self.wildcards.holds(client_id, key[0])

    def client_gone(self, client_id: str) -> None:
        """Termination, telemetry close or expiry: forget the client; its pending events go to its peers."""
        state = self.registry.drop(client_id)
        pending = self.ready.drop_client(client_id)
        self._catchup_cursor.pop(client_id, None)
        self._catchup_again.discard(client_id)
        self.wildcards.remove(client_id)
        self._wildcard_cursor.pop(client_id, None)
        event = self._client_events.pop(client_id, None)
        if event is not None:
            event.set()
        if state is not None and state.group:
            for lmq in pending:
                self._dispatch(lmq, only_group=state.group)

    def export_subscriptions(self) -> list[snapshot.ClientRecord]:
        return [
            snapshot.ClientRecord(st.client_id, st.client_type, st.group, st.bind_topic, tuple(st.lite_topics))
            for st in self.registry.clients()
            if st.lite_topics and st.group
        ]

    def restore_subscriptions(self, records: list[snapshot.ClientRecord]) -> None:
        """Re-register clients saved at the last graceful shutdown; a catch-up pass then offers whatever
        their topics hold. Quotas were checked when the subscriptions were made."""
        now = self.clock()
        for r in records:
            try:
                self.registry.touch(r.client_id, now, client_type=r.client_type, group=r.group, bind_topic=r.bind_topic)
                self.registry.add(r.client_id, r.lmqs, registry.UNLIMITED, now)
            except errors.LmqError as exc:  # e.g. a lower broker-wide limit since: the client re-syncs
                log.warning("subscriptions of client %s not restored: %s", r.client_id, exc.message)
                continue
            self.ready.request_catchup(r.client_id, now)
        self._arm(now)

    # --- lite subscriptions -----------------------------------------------------------------------------
    async def add_lite(
        self,
        client_id: str,
        group: str,
        parent: str,
        lites: Sequence[str],
        *,
        namespace: str = "",
        offset: OffsetReset | None = None,
    ) -> list[str]:
        snap = await self.metadata()
        found = snap.consuming_lite_group(group, parent)
        if found.wildcard:
            raise errors.Conflict(
                f"group {group} is a wildcard group: it receives every lite topic of {parent}; register with "
                "subscribeLiteAll (COMPLETE_ADD), not per lite topic",
                kind="group",
                group=group,
            )
        quota = snap.client_quota(found, parent, namespace)
        lmqs = [lmq_name(parent, lite) for lite in lites]
        await self._reclaims_settled(client_id, lmqs)  # no await from here to the registry's add
        now = self.clock()
        self.registry.touch(client_id, now, group=group, bind_topic=parent)
        added = self.registry.add(client_id, lmqs, quota, now)
        if offset is not None and offset.moves:
            await self._reset_offsets(lmqs, group, offset)
        if found.model == model.SubscriptionModel.EXCLUSIVE:
            self._evict_others(client_id, group, lmqs)
        await self._register_pending(client_id, group, lmqs if offset is not None else added)
        return added

    async def remove_lite(self, client_id: str, group: str, parent: str, lites: Sequence[str]) -> list[str]:
        snap = await self.metadata()
        snap.lite_group(group, parent)
        lmqs = [lmq_name(parent, lite) for lite in lites]
        removed = self.registry.remove(client_id, lmqs, self.clock())
        self.ready.discard_many(client_id, removed)
        return removed

    async def replace_lite(
        self, client_id: str, group: str, parent: str, lites: Sequence[str], *, namespace: str = ""
    ) -> tuple[list[str], list[str]]:
        snap = await self.metadata()
        found = snap.consuming_lite_group(group, parent)
        if found.wildcard:
            self._register_wildcard(client_id, group, parent)
            return [], []
        quota = snap.client_quota(found, parent, namespace)
        lmqs = [lmq_name(parent, lite) for lite in lites]
        await self._reclaims_settled(client_id, lmqs)  # no await from here to the registry's replace
        now = self.clock()
        self.registry.touch(client_id, now, group=group, bind_topic=parent)
        added, removed = self.registry.replace(client_id, lmqs, quota, now)
        self.ready.discard_many(client_id, removed)
        if found.model == model.SubscriptionModel.EXCLUSIVE:
            self._evict_others(client_id, group, added)
        await self._register_pending(client_id, group, added)
        return added, removed

    async def remove_all_lite(self, client_id: str, group: str, parent: str) -> None:
        snap = await self.metadata()
        snap.lite_group(group, parent)
        if self.wildcards.remove(client_id) is not None:
            self._wildcard_cursor.pop(client_id, None)
        state = self.registry.get(client_id)
        if state is not None:
            removed = self.registry.remove(client_id, list(state.lite_topics), self.clock())
            self.ready.discard_many(client_id, removed)

    def _register_wildcard(
        self, client_id: str, group: str, parent: str, filters: Sequence[wildcards.Filter] | None = None
    ) -> None:
        """A client of a wildcard group takes every lite topic of ``parent`` (or those ``filters`` match); a new
        registration walks the parent's topics for backlog (paged, off the loop), as a catch-up pass does."""
        self.registry.touch(client_id, self.clock(), group=group, bind_topic=parent)
        if self.wildcards.add(client_id, group, parent, filters):
            self._wildcard_cursor.pop(client_id, None)
            self._start_catchup(client_id)

    async def subscribe_filters(
        self, client_id: str, group: str, parent: str, filters: Sequence[wildcards.Filter]
    ) -> None:
        """Take the lite topics of ``parent`` that ``filters`` match (``wildcards``: MQTT subscriptions), now
        and as they appear, replacing the client's earlier filters; none: the client takes nothing by pattern."""
        (await self.metadata()).consuming_lite_group(group, parent)
        if filters:
            self._register_wildcard(client_id, group, parent, filters)
        elif self.wildcards.remove(client_id) is not None:
            self._wildcard_cursor.pop(client_id, None)

    async def reset_offsets(self, group: str, parent: str, lites: Sequence[str], option: OffsetReset) -> None:
        """Move ``group``'s start in lite topics of ``parent`` (as a subscription's OffsetOption does)."""
        await self._reset_offsets([lmq_name(parent, lite) for lite in lites], group, option)

    def _evict_others(self, client_id: str, group: str, lmqs: Iterable[str]) -> None:
        """Exclusive groups: the newest subscriber of a lite topic takes it from its group peers."""
        now = self.clock()
        for lmq in lmqs:
            for other in self.registry.subscribers(lmq):
                state = self.registry.get(other)
                if other != client_id and state is not None and state.group == group:
                    self.registry.remove(other, [lmq], now)
                    self.ready.discard_many(other, [lmq])
                    notices = self._notices.get(other)
                    if notices is not None and not notices.full():  # full: the client is not reading anyway
                        notices.put_nowait(model.QueueId(lmq).lite_parts()[1])

    async def _reset_offsets(self, lmqs: list[str], group: str, option: OffsetReset) -> None:
        if any((lmq, 0, group) in self._busy for lmq in lmqs):
            raise errors.TooManyRequests("offsets of a lite topic being delivered cannot be reset now")
        for lmq in lmqs:  # in-flight state and its cached commit point are superseded by the reset
            self.leases.forget((lmq, 0, group))
            self._committed.get(lmq, {}).pop((0, group), None)
            self._persisted.pop((lmq, 0, group), None)
            self._dirty.discard((lmq, 0, group))  # the reset supersedes whatever was not persisted
        await self.run(offsets.reset, self.store, lmqs, group, option)

    async def _register_pending(self, client_id: str, group: str, lmqs: list[str]) -> None:
        """Newly subscribed topics that already hold undelivered messages go straight to this client."""
        for start in range(0, len(lmqs), CATCHUP_CHUNK):
            try:
                found = await self._pending_among(lmqs[start : start + CATCHUP_CHUNK], group)
            except errors.StorageError:  # the store rebuilds its index: a catch-up pass looks later
                self._retry_catchup(client_id)
                return
            for lmq in found:
                if not self._offer(client_id, lmq, group):
                    return  # full: the catch-up pass it scheduled walks the rest

    async def _pending_among(self, lmqs: list[str], group: str) -> list[str]:
        """Which of ``lmqs`` have work for ``group`` (store reads on the pool, decision on the loop)."""

        def probe() -> list[tuple[str, int, int, int | None]]:
            rows = []
            for lmq in lmqs:
                queue = model.QueueId(lmq)
                lo, hi = self.store.queue_offsets(queue)
                if hi > lo:
                    rows.append((lmq, lo, hi, self.store.get_offset(queue, group)))
            return rows

        self._check_generation()
        rows = await self.run(probe)
        now = self.clock()
        pending = []
        for lmq, lo, hi, committed in rows:
            state = self.leases.get((lmq, 0, group))
            if state is not None:
                if state.has_ready(now, hi):
                    pending.append(lmq)
            elif hi > max(lo, committed if committed is not None else lo):
                pending.append(lmq)
        return pending

    # --- arrivals ---------------------------------------------------------------------------------------
    def notify_appended(self, topics: dict[str, None]) -> None:
        """Called after an append with the topics it touched, in order: offer the lite topics, wake
        normal-topic receivers. Coalesced: one flush per loop tick, and it owns ``topics`` from here on."""
        if self._arrived:
            self._arrived.update(topics)
        else:
            self._arrived = topics
        if not self._flush_scheduled and self._arrived:
            self._flush_scheduled = True
            (self._loop or asyncio.get_running_loop()).call_soon(self._flush_arrivals)

    def _flush_arrivals(self) -> None:
        self._flush_scheduled = False
        arrived, self._arrived = self._arrived, {}
        # Most LMQs written have no subscriber on this broker: ``&`` finds the others in C (walking the smaller
        # side), and the topics are then offered in arrival order.
        subscribed = self.registry.subscribed() & arrived.keys()
        if self.wildcards:
            subscribed |= {lmq for lmq in filter(_is_lmq_topic, arrived) if self.wildcards.groups_of_lmq(lmq)}
        if subscribed:
            for lmq in filter(subscribed.__contains__, arrived):
                self._dispatch(lmq)
        for topic in filterfalse(_is_lmq_topic, arrived):
            self._wake_topic(topic)

    def _dispatch(self, lmq: str, *, only_group: str | None = None, prefer: str | None = None) -> None:
        """Offer ``lmq`` to one subscriber per group (the ``prefer``red one first, else a random start)."""
        subscribers = self.registry.subscribers(lmq)
        wild = self.wildcards.groups_of_lmq(lmq)
        if not subscribers and not wild:
            return
        by_group: dict[str, list[str]] = {}
        for cid in subscribers:
            state = self.registry.get(cid)
            if state is not None and state.group and (only_group is None or state.group == only_group):
                by_group.setdefault(state.group, []).append(cid)
        for group, members in wild.items():
            if only_group is None or group == only_group:
                by_group.setdefault(group, []).extend(sorted(members))
        now = self.clock()
        for group, cids in by_group.items():
            in_flight = self.leases.get((lmq, 0, group))
            if in_flight is not None and in_flight.blocked(now):
                continue  # its ack or lease expiry dispatches again
            if prefer in cids:
                order = [prefer, *(c for c in cids if c != prefer)]
            else:
                start = self._rng.randrange(len(cids))
                order = cids[start:] + cids[:start]
            for cid in order:
                if self._offer(cid, lmq, group):
                    break

    def _offer(self, client_id: str, lmq: str, group: str) -> bool:
        outcome = self.ready.offer(client_id, lmq, self._snap.ready_capacity(group), self.clock())
        if outcome is readyset.Offer.ADDED:
            self._wake(client_id)
        elif outcome is readyset.Offer.FULL:
            next_at = self.ready.next_catchup_ms()
            if next_at is not None:
                self._arm(next_at)
        return outcome is not readyset.Offer.FULL

    def _wake(self, client_id: str) -> None:
        event = self._client_events.pop(client_id, None)
        if event is not None:
            event.set()

    def _wake_topic(self, topic: str) -> None:
        event = self._topic_events.pop(topic, None)
        if event is not None:
            event.set()

    # --- sending ----------------------------------------------------------------------------------------
    async def send(self, messages: Sequence[model.NewMessage]) -> list[model.AppendResult]:
        """Enforce send quotas, append (one store call, so the batch shares one fsync), then signal."""
        snap = await self.metadata()
        quotas.check_send_rates(snap, self._buckets, messages, self.clock())
        check = quotas.lite_topic_check(self.store, snap, messages)
        if check is not None:
            await self.run(check)
        assert self._appender is not None, "Dispatcher.start() was not awaited"
        results = await self._appender.append(messages)
        topics = dict.fromkeys(map(_topic_of, chain.from_iterable(map(_queues_of, results))))  # in C, in order
        # Kept for quick delivery: messages of normal topics, and of the LMQs someone here subscribes to.
        readers = {*(self.registry.subscribed() & topics.keys()), *filterfalse(_is_lmq_topic, topics)}
        self.recent.add(messages, results, readers)
        self.notify_appended(topics)
        return results

    # --- receiving --------------------------------------------------------------------------------------
    async def receive_lite(
        self,
        client_id: str,
        group: str,
        parent: str,
        *,
        batch: int,
        invisible_ms: int,
        poll_ms: int,
        auto_renew: bool = False,
    ) -> list[Delivery]:
        """Long-poll this client's ready lite topics. ``auto_renew``: ``invisible_ms`` is a slice, renewed
        while the client lives (up to ``lease_renew_max_ms``)."""
        snap = await self.metadata()
        found = snap.consuming_lite_group(group, parent)
        deadline = self.clock() + poll_ms
        self.registry.touch(client_id, self.clock(), group=group, bind_topic=parent)
        while not self._closed and not self.draining:
            event = self._client_events.get(client_id)
            if event is None:
                event = self._client_events[client_id] = asyncio.Event()
            self._check_generation()
            if self._arrived:
                self._flush_arrivals()  # do not let the per-tick coalescing hide an arrival from this poll
            out: list[Delivery] = []
            while len(out) < batch:
                popped = self.ready.pop(client_id, 1)
                if not popped:
                    break
                out += await self._deliver(
                    (popped[0], 0, group), batch - len(out), invisible_ms, client_id, found, auto_renew=auto_renew
                )
            if out:
                return out
            if not await self._wait(event, deadline):
                return []
            self.registry.touch(client_id, self.clock())
        return []

    async def receive_normal(
        self,
        client_id: str,
        group: str,
        topic: str,
        *,
        batch: int,
        invisible_ms: int,
        poll_ms: int,
        auto_renew: bool = False,
    ) -> list[Delivery]:
        snap = await self.metadata()
        found = snap.normal_group(group, topic)
        queues = max(1, snap.topic(topic).queue_count)
        deadline = self.clock() + poll_ms
        self.registry.touch(client_id, self.clock(), group=group)
        while not self._closed and not self.draining:
            event = self._topic_events.get(topic)
            if event is None:
                event = self._topic_events[topic] = asyncio.Event()
            out: list[Delivery] = []
            self._rr += 1
            for i in range(queues):
                key = (topic, (self._rr + i) % queues, group)
                out += await self._deliver(
                    key, batch - len(out), invisible_ms, client_id, found, ordered=False, auto_renew=auto_renew
                )
                if len(out) >= batch:
                    self._wake_topic(topic)  # there may be more: let other receivers look too
                    break
            if out:
                return out
            if not await self._wait(event, deadline):
                return []
        return []

    async def _wait(self, event: asyncio.Event, deadline: int) -> bool:
        """One long-poll wait: until ``event`` is set or ``deadline`` (ms); False once the deadline has passed."""
        remaining = deadline - self.clock()
        if remaining <= 0:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), remaining / 1000)
        return True

    async def _deliver(
        self,
        key: Key,
        limit: int,
        invisible_ms: int,
        holder: str,
        group: model.LiteGroup,
        *,
        ordered: bool = True,
        auto_renew: bool = False,
    ) -> list[Delivery]:
        if limit <= 0 or key in self._busy:
            return []  # whoever holds it delivers; later events come from its acks and expiries
        self._busy.add(key)
        try:
            queue = model.QueueId(key[0], key[1])
            generation = self._check_generation()
            try:
                state = await self._state_of(key, queue, ordered)
                picks = state.picks(self.clock(), limit)
                end = self.recent.end((key[0], key[1]))
                if end is not None:
                    picks = [p for p in picks if p.offset < end]
                if not picks:
                    return []
                first = picks[0].offset
                cached = self.recent.window((key[0], key[1]), first, picks[-1].offset)
                if cached is not None:
                    messages, span_end = cached, -1
                else:
                    read = await self.run(self.store.read_span, queue, first, picks[-1].offset - first + 1)
                    messages, span_end = read
                    if not messages or messages[0].offset > first:
                        lo, _, _, _ = await self.run(self._offsets, queue, key[2])
                        if lo > state.committed:  # retention dropped what we were about to deliver
                            state.skip_to(lo)
                    if self.store.index_generation() != generation:
                        # the index was replaced under the read: its holes prove nothing; read again later
                        raise errors.StorageError("the store's index was replaced during the read")
            except errors.StorageError as exc:  # an index rebuild (or meta trouble): nothing read, nothing settled
                self._store_refused(key, holder, exc)
                return []
            if span_end >= 0 and self._settle_gone(key, state, first, span_end, messages):
                with contextlib.suppress(errors.StorageError):  # dirty now: retried, and the receive goes on
                    await self._commit(key, state)
                picks = [p for p in state.picks(self.clock(), limit) if p.offset < span_end]
            by_offset = {m.offset: m for m in messages}
            now = self.clock()
            renew_max = self.config.lease_renew_max_ms
            renew_until = now + renew_max if auto_renew and renew_max > invisible_ms else 0
            out: list[Delivery] = []
            dead: list[tuple[leases.Pick, model.StoredMessage]] = []
            for pick in picks:
                message = by_offset.get(pick.offset)
                if message is None or pick.offset < state.committed:
                    continue
                if pick.attempt > group.retry.max_attempts:
                    dead.append((pick, message))
                    continue
                lease_id = self.leases.new_lease_id()
                lease = state.lease(
                    pick, now, invisible_ms, lease_id, holder, renew_until_ms=renew_until, message_id=message.message_id
                )
                out.append(
                    Delivery(message, pick.attempt, self.leases.receipt(key, pick.offset, lease_id), invisible_ms)
                )
            if out:
                at = self.leases.watch_at(lease, self._renewal.ahead_ms)  # the batch's leases are alike
                self.leases.watch(key, at)
                self._arm(at)
            if dead:
                try:
                    await self._dead_letter(key, [m for _, m in dead], state, dead)
                except errors.StorageError as exc:  # not appended: their leases expire and they come again
                    self._store_refused(key, holder, exc)
            return out
        finally:
            self._busy.discard(key)
            self._release(key)

    async def _state_of(self, key: Key, queue: model.QueueId, ordered: bool) -> leases.QueueLeases:
        """The key's lease state: opened from the commit point (cached, else read with the acks above it), or
        the existing one, clipped to its queue first if the store's index was replaced since (``_verify``)."""
        state = self.leases.get(key)
        if state is not None:
            if key in self._unverified:
                await self._verify(key, state)
            return state
        committed = self._committed.get(key[0], {}).get((key[1], key[2]))
        acked: Sequence[int] = ()
        stored: int | None = committed
        if committed is None:  # first use since start: what was committed, and acked above it
            lo, _, stored, acked = await self.run(self._offsets, queue, key[2])
            committed = max(lo, stored if stored is not None else lo)
        state = self.leases.open(key, committed, ordered)
        state.seed(acked)
        self._persisted[key] = (-1 if stored is None else stored, ranges.OffsetRanges.of(acked))
        return state

    def _store_refused(self, key: Key, holder: str, exc: errors.StorageError) -> None:
        """A read for ``key`` failed (the store rebuilds its index): the receive answers empty, and the lite
        topic is looked at again in ``STORE_RETRY_MS`` (a catch-up pass of ``holder``); normal-topic receivers
        poll again anyway."""
        log.info("%s queue %d group %s: store not readable (%s); retried", key[0], key[1], key[2], exc.message)
        if key[0].startswith(model.LMQ_PREFIX):
            self._retry_catchup(holder)

    def _retry_catchup(self, client_id: str) -> None:
        at = self.clock() + STORE_RETRY_MS
        self.ready.request_catchup(client_id, at)
        self._arm(at)

    # --- the store's index replaced while serving ------------------------------------------------------
    def _check_generation(self) -> int:
        """The store's index generation, handling a change first (one int read: called wherever reads happen,
        so a rebuild that began and ended between two health polls is not missed)."""
        generation = self.store.index_generation()
        if generation != self._generation:
            self._generation = generation
            self._index_replaced()
        return generation

    def _index_replaced(self) -> None:
        """The index was rebuilt from the log while serving: queue ends, commit points and messages cached from
        before may be wrong, and a queue's end may even be lower (a lost log tail), so that new messages take
        offsets this dispatcher has seen. Policy: caches are dropped (read again from the store); lease state
        with no lease out and nothing unpersisted is dropped (re-seeded from the store on next use); lease
        state with leases out (clients hold their handles) or a dirty commit is kept but *unverified*: before
        its next hand-out, ack or commit it is clipped to the queue's new end (``QueueLeases.clip``: leases and
        settled offsets at or above the end are forgotten and their handles refused). Then every client is
        caught up."""
        log.warning("the store's index was replaced (generation %d): dispatch caches dropped", self._generation)
        self._committed.clear()
        self.recent.clear()
        for key, state in self.leases.states():
            if state.entries or key in self._dirty or key in self._busy or key in self._commit_locks:
                self._unverified.add(key)
            else:
                self.leases.forget(key)
                self._persisted.pop(key, None)
        self.resync()

    async def _verify(self, key: Key, state: leases.QueueLeases) -> None:
        """Bring a state kept across an index replacement in line with the store: each lease out must still
        name the message at its offset (else it is dropped and its handle refused: the offset is handed out
        again); settlement the store refused (a dirty key: those acks were answered with the error) goes back
        to what was persisted; nothing may lie at or above the queue's end."""
        offsets = list(state.entries)
        lo, hi, ids = await self.run(self._message_ids, model.QueueId(key[0], key[1]), offsets)
        if key not in self._unverified or self.leases.get(key) is not state:
            return  # verified meanwhile (or forgotten)
        self._unverified.discard(key)
        floor = self.leases.next_lease_id
        entries = state.entries
        lost = [o for o in offsets if o in entries and entries[o].message_id != ids.get(o)]
        state.drop_leases(lost, floor)
        persisted = self._persisted.get(key)
        rolled_back = key in self._dirty and persisted is not None and key not in self._commit_locks
        if rolled_back and persisted is not None:
            state.rollback(persisted[0] if persisted[0] >= 0 else lo, persisted[1])
            self._dirty.discard(key)
        state.clip(hi, floor)
        if lo > state.committed:
            state.skip_to(lo)
        if lost or rolled_back:
            note = "; refused acks forgotten" if rolled_back else ""
            log.warning("%s queue %d group %s: %d leases named messages the rebuilt index no longer holds there%s",
                        key[0], key[1], key[2], len(lost), note)  # fmt: skip
            if state.has_ready(self.clock(), hi):
                self._redispatch(key)

    def _message_ids(self, queue: model.QueueId, offsets: list[int]) -> tuple[int, int, dict[int, str]]:
        lo, hi = self.store.queue_offsets(queue)
        ids: dict[int, str] = {}
        for offset in offsets:
            messages, _ = self.store.read_span(queue, offset, 1)
            if messages and messages[0].offset == offset:
                ids[offset] = messages[0].message_id
        return lo, hi, ids

    def _offsets(self, queue: model.QueueId, group: str) -> tuple[int, int, int | None, Sequence[int]]:
        lo, hi = self.store.queue_offsets(queue)
        return lo, hi, self.store.get_offset(queue, group), self.store.get_acked(queue, group)

    def _settle_gone(
        self, key: Key, state: leases.QueueLeases, first: int, end: int, messages: list[model.StoredMessage]
    ) -> bool:
        """Offsets in [first, end) that the store read passed over are gone (a damaged record, a lost
        segment; the store has reported them): settle them so that the rest of the queue flows and the commit
        point can pass them. True when anything was settled."""
        settled = False
        at = max(first, state.committed)
        for m in messages:
            if m.offset >= end:
                break  # never settle beyond the span the store vouched for
            if m.offset > at:
                state.settle_gone(at, m.offset)
                settled = True
            at = max(at, m.offset + 1)
        if end > at:
            state.settle_gone(at, end)
            settled = True
        if settled:
            log.warning("%s queue %d group %s: offsets in [%d, %d) are gone from the store; passed over",
                        key[0], key[1], key[2], first, end)  # fmt: skip
        return settled

    async def _dead_letter(
        self,
        key: Key,
        messages: list[model.StoredMessage],
        state: leases.QueueLeases,
        picks: list[tuple[leases.Pick, model.StoredMessage]],
    ) -> None:
        await self.run(self.store.append, [offsets.dead_letter(key[2], m) for m in messages])
        now = self.clock()
        for pick, _ in picks:
            state.lease(pick, now, 0, self.leases.new_lease_id(), "")
        for pick, _ in picks:
            state.ack(pick.offset)
        with contextlib.suppress(errors.StorageError):  # dirty now: retried by housekeeping and ``resync``
            await self._commit(key, state)

    # --- ack / nack / dead letter -----------------------------------------------------------------------
    async def ack(self, group: str, receipt_handle: str, *, client_id: str = "") -> None:
        receipt, key = self.leases.resolve(receipt_handle, group)
        self._check_generation()
        state = self.leases.get(key)
        if state is not None and key in self._unverified:
            await self._verify(key, state)  # raises while the store cannot say: the client retries the ack
        changed = self.leases.ack(key, receipt)
        state = self.leases.get(key)
        if state is None or not (changed or key in self._dirty):
            return  # nothing new, and what memory holds is persisted
        hi = await self._commit(key, state)  # raises when the write failed: the client learns the ack is not in
        if key in self._dirty and not self._is_persisted(key, receipt.offset):
            raise errors.TooManyRequests(
                f"too many acknowledged ranges above the commit point of {key[0]} to persist "
                f"(at most {keys.ACKED_MAX_RUNS}); the ack is kept in memory, retry it once earlier messages are acked"
            )
        if state.has_ready(self.clock(), hi):
            self._redispatch(key, prefer=client_id)
        self._release(key)

    def _release(self, key: Key) -> None:
        """Drop an idle key's in-flight state, unless a delivery or an offset write is still using it (a
        fresh state would re-read a commit point that is not persisted yet)."""
        if key in self._busy or key in self._commit_locks or key in self._dirty:
            return
        state = self.leases.get(key)
        if state is not None and state.idle:
            self.leases.forget(key)
            self._persisted.pop(key, None)
            self._unverified.discard(key)

    async def change_invisible(
        self, group: str, receipt_handle: str, invisible_ms: int, *, suspend: bool = False
    ) -> str:
        receipt, key = self.leases.resolve(receipt_handle, group)
        new_receipt, lease = self.leases.change(key, receipt, self.clock(), invisible_ms, suspend)
        self._arm(lease.visible_at_ms)
        return self.leases.seal(new_receipt, group)

    async def dead_letter(self, group: str, receipt_handle: str) -> None:
        """The client gave up on a message (ForwardMessageToDeadLetterQueue): store it in ``%DLQ%<group>``."""
        receipt, key = self.leases.resolve(receipt_handle, group)
        state = self.leases.get(key)
        lease = state.entries.get(receipt.offset) if state is not None else None
        if state is None or lease is None or state.lost(receipt) or key in self._unverified:
            if state is None or receipt.offset < state.committed:
                return  # already settled
            raise errors.InvalidReceiptHandle("receipt handle names a message that is not out")
        messages = await self.run(self.store.read, model.QueueId(key[0], key[1]), receipt.offset, 1)
        if messages and messages[0].offset == receipt.offset:
            await self.run(self.store.append, [offsets.dead_letter(group, messages[0])])
        await self.ack(group, receipt_handle)

    async def _commit(self, key: Key, state: leases.QueueLeases) -> int:
        """Persist the commit point and the offsets acked above it, if memory differs from what was last
        persisted; writes for one key are serialised so offsets never go backwards. Returns the queue's max
        offset. When the write fails the key stays dirty (see ``_persisted``) and the error propagates."""
        entry = self._commit_locks.get(key)
        if entry is None:
            entry = self._commit_locks[key] = (asyncio.Lock(), [0])  # [users]
        lock, counters = entry
        counters[0] += 1
        try:
            async with lock:
                target = state.committed
                acked = state.acked_above()
                complete = len(acked.runs) <= keys.ACKED_MAX_RUNS
                if not complete:  # over the cap: the oldest runs, the rest stays dirty (see ``ack``)
                    acked = ranges.OffsetRanges(acked.runs[: keys.ACKED_MAX_RUNS])
                    self._dirty.add(key)
                queue = model.QueueId(key[0], key[1])
                if (target, acked) != self._persisted.get(key):
                    self._dirty.add(key)
                    # On the loop when no writer holds the store (two small index writes cost less than the
                    # hop, which waits for the GIL behind whatever the loop does next); else on the pool.
                    if self.store.try_commit_offset(queue, key[2], target, acked):
                        hi = self.store.queue_offsets(queue)[1]
                    else:
                        hi = await self.run(self._commit_and_max, queue, key[2], target, acked)
                    self._persisted[key] = (target, acked)
                    if complete:
                        self._dirty.discard(key)  # a change made meanwhile has its own commit waiting on the lock
                    self._remember_commit(key, target)
                else:
                    hi = self.store.queue_offsets(queue)[1]  # the cached queue state: no I/O once loaded
                return hi
        finally:
            counters[0] -= 1
            if counters[0] == 0:
                del self._commit_locks[key]

    def _is_persisted(self, key: Key, offset: int) -> bool:
        committed, acked = self._persisted.get(key, (-1, ranges.EMPTY))
        return offset < committed or offset in acked

    async def _retry_commits(self) -> None:
        """Persist what failed to persist earlier (housekeeping, ``resync``); a key still refused stays dirty."""
        if self._retrying:
            return
        self._retrying = True
        try:
            for key in list(self._dirty):
                state = self.leases.get(key)
                if state is None:
                    self._dirty.discard(key)
                    continue
                try:
                    if key in self._unverified:
                        await self._verify(key, state)
                    hi = await self._commit(key, state)
                except errors.LmqError as exc:
                    log.warning("%s queue %d group %s: commit still refused (%s); retried later",
                                key[0], key[1], key[2], exc.message)  # fmt: skip
                    continue
                if state.has_ready(self.clock(), hi):
                    self._redispatch(key)
                self._release(key)
        finally:
            self._retrying = False

    def _remember_commit(self, key: Key, offset: int) -> None:
        per_topic = self._committed.get(key[0])
        if per_topic is None:
            per_topic = self._committed[key[0]] = {}
        else:
            self._committed.move_to_end(key[0])
        per_topic[(key[1], key[2])] = offset
        if len(self._committed) > COMMITTED_CACHE_SIZE:
            self._committed.popitem(last=False)

    def _commit_and_max(self, queue: model.QueueId, group: str, offset: int, acked: Sequence[int]) -> int:
        self.store.commit_offset(queue, group, offset, acked)
        return self.store.queue_offsets(queue)[1]

    def _redispatch(self, key: Key, *, prefer: str = "") -> None:
        topic, _, group = key
        if topic.startswith(model.LMQ_PREFIX):
            self._dispatch(topic, only_group=group, prefer=prefer or None)
        else:
            self._wake_topic(topic)

    # --- timers -----------------------------------------------------------------------------------------
    def _arm(self, at_ms: int) -> None:
        if self._loop is None or self._closed:
            return
        if self._timer is not None and self._timer_at <= at_ms:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at_ms
        self._timer = self._loop.call_later(max(0, at_ms - self.clock()) / 1000, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.tick()

    def tick(self) -> None:
        """Do everything that is due: redeliveries, catch-up passes, client expiry. Re-arms the timer."""
        now = self.clock()
        for key in self.leases.due(now, self._renewal):
            self._redispatch(key)
        for client_id in self.ready.due_catchups(now):
            self._start_catchup(client_id)
        if now >= self._next_housekeeping:
            self._next_housekeeping = now + HOUSEKEEPING_INTERVAL_MS
            if self._dirty:
                self._spawn(self._retry_commits())
            for client_id in self.registry.idle_since(now - self.config.client_expiry_ms):
                log.info("client %s expired (no heartbeat or sync for %d ms)", client_id, self.config.client_expiry_ms)
                self.client_gone(client_id)
        candidates = [
            t for t in (self.leases.next_expiry_ms(), self.ready.next_catchup_ms(), self._next_housekeeping) if t
        ]
        if candidates:
            self._arm(min(candidates))

    def resync(self) -> None:
        """After the store was unable to serve reads for a while (an index rebuild): look again for pending
        work of every client, wake every receiver of a normal topic, and persist the commits that failed."""
        if self._dirty and self._loop is not None:
            self._spawn(self._retry_commits())
        for st in self.registry.clients():
            self._start_catchup(st.client_id)
            for topic in st.topics:
                self._wake_topic(topic)

    def _start_catchup(self, client_id: str) -> None:
        if self._loop is None:
            return
        if client_id in self._catchup_running:
            # The running pass may have walked already what made this one due: it runs again when done.
            self._catchup_again.add(client_id)
            return
        self._catchup_running.add(client_id)
        self._spawn(self._catchup(client_id))

    async def _catchup(self, client_id: str) -> None:
        """Walk this client's own subscriptions for pending work, once round: from where the last pass stopped
        (a full ready queue stops it), then on over the topics before that point, which may have overflowed
        since that pass walked them."""
        try:
            await self._catchup_walk(client_id)
        except errors.StorageError as exc:  # the store rebuilds its index: walk again later
            log.info("catch-up of client %s deferred: %s", client_id, exc.message)
            self._retry_catchup(client_id)
        finally:
            self._catchup_running.discard(client_id)
            if client_id in self._catchup_again:
                self._catchup_again.discard(client_id)
                now = self.clock()
                self.ready.request_catchup(client_id, now)
                self._arm(now)

    async def _catchup_walk(self, client_id: str) -> None:
        state = self.registry.get(client_id)
        if state is None or not state.group:
            return
        if self.wildcards.registration(client_id) is not None:
            await self._wildcard_catchup(client_id)
            return
        todo = list(state.lite_topics)
        resume = self._catchup_cursor.pop(client_id, None)
        if resume:
            after = set(resume)
            todo = resume + [lmq for lmq in todo if lmq not in after]
        for start in range(0, len(todo), CATCHUP_CHUNK):
            current = [lmq for lmq in todo[start : start + CATCHUP_CHUNK] if lmq in state.lite_topics]
            for lmq in await self._pending_among(current, state.group):
                if not self._offer(client_id, lmq, state.group):
                    self._catchup_cursor[client_id] = todo[todo.index(lmq, start) :]
                    return
            if self.registry.get(client_id) is not state:
                return

    async def _wildcard_catchup(self, client_id: str) -> None:
        """Page through the wildcard group's parent by lite name and offer the client every topic with work
        for its group, once round: from after the last offer that fitted (a full ready queue stops a pass) to
        the end, then from the start up to there (those topics may have overflowed since they were walked)."""
        first, end = self.wildcards.scan_range(client_id)  # a client with filters: the names they can match
        resume = self._wildcard_cursor.pop(client_id, "")
        after, wrapped = max(resume, first), not resume
        where = self.wildcards.registration(client_id)
        while where is not None:
            parent, group = where
            page = await self.run(self.store.scan_lite_topics, parent, after, end, CATCHUP_CHUNK)
            if self.wildcards.registration(client_id) != where:
                return  # unregistered meanwhile
            last = len(page) < CATCHUP_CHUNK
            if resume and wrapped and page and page[-1].lite > resume:
                page, last = [meta for meta in page if meta.lite <= resume], True
            page_end = page[-1].lite if page else after
            page = [meta for meta in page if self.wildcards.takes(client_id, meta.lite)]
            lmqs = [lmq_name(parent, meta.lite) for meta in page]
            for lmq in await self._pending_among(lmqs, group):
                if not self._offer(client_id, lmq, group):
                    index = lmqs.index(lmq)  # full: the catch-up it scheduled resumes at this topic
                    self._wildcard_cursor[client_id] = page[index - 1].lite if index else after
                    return
            if last and wrapped:
                return
            after, wrapped = (first, True) if last else (page_end, wrapped)
            where = self.wildcards.registration(client_id)

    # --- LiveView ---------------------------------------------------------------------------------------
    def subscribers(self, lmq: model.QueueId) -> list[str]:
        return list(self.registry.subscribers(lmq.topic))

    def subscriber_count(self, lmq: model.QueueId) -> int:
        return self.registry.subscriber_count(lmq.topic)

    def clients(self, group: str | None = None) -> list[api.ClientView]:
        now = self.clock()
        wall_now = self.wall_clock()
        return [
            api.ClientView(
                client_id=st.client_id,
                group=st.group,
                topic=st.bind_topic or next(iter(sorted(st.topics)), ""),
                client_type=st.client_type,
                subscription_count=len(st.lite_topics),
                last_seen_ms=wall_now - (now - st.last_seen_ms),
                ready_events=self.ready.size(st.client_id),
            )
            for st in self.registry.clients()
            if group is None or st.group == group
        ]

    def subscription_count(self) -> int:
        return self.registry.pair_count()

    def client_count(self) -> int:
        return self.registry.client_count()

    def forget_lite_topic(self, lmq: model.QueueId) -> None:
        holders = self.registry.forget_lmq(lmq.topic)
        self.ready.discard(lmq.topic, holders)
        self.leases.drop_topic(lmq.topic)
        self.recent.forget((lmq.topic, lmq.queue))
        self._committed.pop(lmq.topic, None)
        for key in [k for k in self._persisted if k[0] == lmq.topic]:
            del self._persisted[key]
        self._dirty.difference_update([k for k in self._dirty if k[0] == lmq.topic])  # the store drops its offsets

    # --- reclaim marks (see ``reclaims``) ---------------------------------------------------------------
    def begin_reclaim(self, lmqs: Sequence[model.QueueId], allowed_subscribers: Sequence[int] | None) -> reclaims.Mark:
        topics = [lmq.topic for lmq in lmqs]
        count = self.registry.subscriber_count
        mark = reclaims.check_and_mark(topics, list(map(count, topics)), allowed_subscribers)
        for topic in mark.topics:
            self._reclaims.setdefault(topic, []).append(mark)
        return mark

    def end_reclaim(self, mark: reclaims.Mark, deleted: Sequence[model.QueueId]) -> None:
        for lmq in deleted:
            self.forget_lite_topic(lmq)
        for topic in mark.topics:
            marks = self._reclaims[topic]
            marks.remove(mark)
            if not marks:
                del self._reclaims[topic]
        mark.done.set()

    def reclaims_in_flight(self) -> int:
        """Lite topics marked by a compare-and-delete right now."""
        return len(self._reclaims)

    async def _reclaims_settled(self, client_id: str, lmqs: Iterable[str]) -> None:
        """Before ``client_id`` subscribes to ``lmqs``: each topic it does not hold yet that a delete has
        marked is vetoed (kept), or, where that is too late, waited for. Returns in the loop step of its
        last veto, so a caller that registers without awaiting first is registered before the delete."""
        while self._reclaims:
            state = self.registry.get(client_id)
            held = state.lite_topics if state is not None else set()
            marked = [(lmq, self._reclaims.get(lmq, ())) for lmq in lmqs if lmq not in held]
            busy = next((mark for lmq, marks in marked for mark in marks if not mark.veto(lmq)), None)
            if busy is None:
                return
            await busy.done.wait()

    # --- introspection for metrics ----------------------------------------------------------------------
    def ready_events(self) -> int:
        return self.ready.total()

    def in_flight(self) -> int:
        return self.leases.in_flight()

    def append_stats(self) -> appender.AppendStats:
        return appender.AppendStats(0, 0, 0.0) if self._appender is None else self._appender.stats


def _check_live_view(d: Dispatcher) -> api.LiveView:
    return d  # mypy proves Dispatcher satisfies the LiveView seam
