"""Clients and what they subscribe to: the registry kept in step with the protocol, catch-up passes, and the
marks of compare-and-deletes that new subscriptions must respect.

Subscriptions belong to client ids, as in RocketMQ (``registry``; wildcard groups in ``wildcards``). A change
here may create work, which goes to ``delivery`` as offers: topics that already hold messages when they are
subscribed, a gone client's queued topics, and a *catch-up pass*, which walks one client's own subscriptions
(or, for a wildcard group, its parent's lite topics, paged off the loop) for pending work. A pass runs only
when that client's ready queue overflowed, right after it subscribed to topics with backlog, after a restore,
or when the store could not answer for a while; never over all lite topics.

A client's subscription changes are made one at a time. A big one (more than ``registry.SLICE`` names: a
COMPLETE_ADD of 100,000 lite topics) works in slices that yield to the event loop, so other clients' calls
are not kept waiting; it runs in a task of its own that finishes even when its caller goes (a cancelled
call never leaves half a change), and the client's next change waits for it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Final, TypeVar

from lmq_broker import errors, model
from lmq_broker.dispatch import (
    api,
    delivery,
    level_index,
    offsets,
    readyset,
    reclaims,
    registry,
    runtime,
    saved_subscriptions,
    settlement,
    wildcards,
)

log = logging.getLogger(__name__)

NOTICES_PER_CLIENT: Final = 1024
CATCHUP_CHUNK: Final = 512  # lite names per page of a wildcard catch-up pass
# Lite topics probed for pending work per store call: the call holds the GIL throughout (~15 µs a topic),
# and the event loop waits for it, so a probe of many topics goes in short calls.
PROBE_CHUNK: Final = 128
INDEX_SLICE: Final = 2048  # names taken from a level index per loop step
WALK_BUDGET: Final = 8192  # names read or looked up (5 more per read) by a match in key order (~1 µs each)
WALKS_BEFORE_INDEX: Final = 65_536  # what a parent's matches in key order may cost in all (~2 builds of 100,000)
INDEX_PAGE: Final = 4096  # lite names read into a level index being built per loop step (~0.7 ms on it)
# A full sync (COMPLETE_ADD) carries the client's set as it stood when the client built the request, which may be
# older than a subscribe or unsubscribe answered just before the full sync arrived: rocketmq-client-nodejs 1.0.8
# sends its first full sync (of the empty set) at start, unawaited, and a subscribeLite made right after start
# overtakes it. A partial change answered after the full sync arrived, or less than ``full_sync_grace_ms`` before
# (3 s: the official clients' request timeout), is kept as the client made it; its next full sync includes it.
RECENT_KEPT_MS: Final = 10_000  # partial changes remembered this long (and at most RECENT_PER_CLIENT a client)
RECENT_PER_CLIENT: Final = 1_024


T = TypeVar("T")


def lmq_name(parent: str, lite: str) -> str:
    return model.QueueId.lmq(parent, lite).topic


async def sliced(steps: registry.Steps[T]) -> T:
    """Run a registry change's steps, yielding to the event loop between them; the first runs at once."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        await asyncio.sleep(0)


async def lmq_names(parent: str, lites: Sequence[str]) -> dict[str, None]:
    """The LMQ names of ``lites`` without repeats, in order (``registry.unique``), built in slices that yield
    when there are many."""
    out: dict[str, None] = {}
    for index, part in enumerate(registry.slices(lites)):
        if index:
            await asyncio.sleep(0)
        out.update(dict.fromkeys(lmq_name(parent, lite) for lite in part))
    return out


def _round_from(ranges: list[tuple[str, str]], resume: str) -> list[tuple[str, str]]:
    """``ranges`` (start after, end before; "" an open end) walked once round from after ``resume``: to the
    end, then from the start through ``resume`` itself."""
    if not resume:
        return ranges
    ahead = [(max(start, resume), end) for start, end in ranges if not end or end > resume]
    through = resume + "\x00"  # sorts after resume, before every longer name that starts with it
    behind = [(start, end if end and end < through else through) for start, end in ranges if start < resume]
    return ahead + behind


def _filters(patterns: Iterable[str]) -> frozenset[wildcards.Filter]:
    return frozenset(map(wildcards.parse_pattern, patterns))


async def _split(names: Sequence[str]) -> tuple[list[str], list[str]]:
    """(lite topic names, patterns): a name holding a pattern character is a pattern (in slices)."""
    lites: list[str] = []
    patterns: list[str] = []
    for index, part in enumerate(registry.slices(names)):
        if index:
            await asyncio.sleep(0)
        for name in part:
            (patterns if wildcards.is_pattern(name) else lites).append(name)
    return lites, patterns


class _Serial:
    """One client's subscription changes, one at a time."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


class Subscriptions:
    def __init__(
        self,
        rt: runtime.Runtime,
        *,
        subscribers: registry.Registry,
        wild: wildcards.Wildcards,
        ready: readyset.ReadySet,
        deliverer: delivery.Deliverer,
        settling: settlement.Settlement,
    ) -> None:
        self._rt = rt
        self._registry = subscribers
        self._wildcards = wild
        self._ready = ready
        self._deliverer = deliverer
        self._settlement = settling
        self._notices: dict[str, asyncio.Queue[str]] = {}
        self._catchup_cursor: dict[str, list[str]] = {}
        self._wildcard_cursor: dict[str, str] = {}  # client -> last lite name its catch-up offered
        self._catchup_running: set[str] = set()
        self._catchup_again: set[str] = set()  # asked for while a pass ran: one more pass when it ends
        self.marks = reclaims.Marks()  # compare-and-deletes under way (see ``reclaims``)
        # Who last changed each client's subscriptions, (user, address): access control's (``protocol.revoking``),
        # saved with them so a restart checks them again; empty without --acl.
        self.owners: dict[str, tuple[str, str]] = {}
        self._serials: dict[str, _Serial] = {}
        self._indexing: dict[str, asyncio.Event] = {}  # parent -> set once its level index is built
        self._walked: dict[str, int] = {}  # parent without an index -> what its matches in key order cost so far
        self._big_changes: set[asyncio.Task[object]] = set()
        # client -> LMQ or pattern -> (when its last partial change ended, added): what a full sync may not know
        self._recent: dict[str, dict[str, tuple[int, bool]]] = {}

    # --- clients ------------------------------------------------------------------------------------------
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
        state = self._registry.touch(
            client_id, self._rt.clock(), client_type=client_type, group=group, bind_topic=bind_topic, topics=topics
        )
        if language:
            state.language = language
        if version:
            state.version = version
        return state

    def stream_opened(self, client_id: str) -> asyncio.Queue[str]:
        """A telemetry stream opened; returns the client's notices (lite topics taken from it) to relay."""
        self._registry.touch(client_id, self._rt.clock()).streams += 1
        notices = self._notices.get(client_id)
        if notices is None:
            notices = self._notices[client_id] = asyncio.Queue(maxsize=NOTICES_PER_CLIENT)
        return notices

    def stream_closed(self, client_id: str) -> None:
        state = self._registry.get(client_id)
        if state is None:
            self._notices.pop(client_id, None)
            return
        state.streams -= 1
        if state.streams <= 0:
            self._notices.pop(client_id, None)
            if not self._rt.draining:
                self.client_gone(client_id)

    def client_gone(self, client_id: str) -> None:
        """Termination, telemetry close or expiry: forget the client; its pending events go to its peers."""
        state = self._registry.drop(client_id)
        pending = self._ready.drop_client(client_id)
        self._recent.pop(client_id, None)
        self._catchup_cursor.pop(client_id, None)
        self._catchup_again.discard(client_id)
        self._wildcards.remove(client_id)
        self._wildcard_cursor.pop(client_id, None)
        self._deliverer.wake(client_id)
        if state is not None and state.group:
            for lmq in pending:
                self._deliverer.dispatch(lmq, only_group=state.group)

    def expire_idle(self, now: int) -> None:
        expiry_ms = self._rt.config.client_expiry_ms
        for client_id in self._registry.idle_since(now - expiry_ms):
            log.info("client %s expired (no heartbeat or sync for %d ms)", client_id, expiry_ms)
            self.client_gone(client_id)

    def views(self, group: str | None) -> list[api.ClientView]:
        now, wall_now = self._rt.clock(), self._rt.wall_clock()
        return [
            api.ClientView(
                client_id=st.client_id,
                group=st.group,
                topic=st.bind_topic or next(iter(sorted(st.topics)), ""),
                client_type=st.client_type,
                subscription_count=len(st.lite_topics) + len(st.patterns),
                last_seen_ms=wall_now - (now - st.last_seen_ms),
                ready_events=self._ready.size(st.client_id),
            )
            for st in self._registry.clients()
            if group is None or st.group == group
        ]

    def own(self, client_id: str, user: str, peer: str) -> None:
        """Note who changes ``client_id``'s subscriptions (access control's, saved with them; opaque here)."""
        if self.owners.get(client_id) != (user, peer):
            self.owners[client_id] = (user, peer)
            self._registry.version += 1  # saved with the next write

    def export(self) -> list[saved_subscriptions.ClientRecord]:
        registry_, owners = self._registry, self.owners
        for gone in [c for c in owners if registry_.get(c) is None]:
            del owners[gone]
        return [
            saved_subscriptions.ClientRecord(
                st.client_id,
                st.client_type,
                st.group,
                st.bind_topic,
                tuple(st.lite_topics),
                tuple(st.patterns),
                owners.get(st.client_id, ("", "")),
            )
            for st in registry_.clients()
            if (st.lite_topics or st.patterns) and st.group
        ]

    def restore(self, records: list[saved_subscriptions.ClientRecord]) -> None:
        """Re-register clients saved at the last graceful shutdown; a catch-up pass then offers whatever
        their topics hold. Quotas were checked when the subscriptions were made."""
        now = self._rt.clock()
        for r in records:
            try:
                self._registry.touch(
                    r.client_id, now, client_type=r.client_type, group=r.group, bind_topic=r.bind_topic
                )
                self._registry.add(r.client_id, r.lmqs, model.UNLIMITED, now, patterns=r.patterns)
                filters = [wildcards.parse_pattern(p) for p in r.patterns]
            except (errors.LmqError, ValueError) as exc:  # e.g. a lower broker-wide limit since: the client re-syncs
                log.warning("subscriptions of client %s not restored: %s", r.client_id, exc)
                continue
            if filters:
                self._wildcards.add(r.client_id, r.group, r.bind_topic, filters)
            state = self._registry.get(r.client_id)
            if state is not None:
                state.restored = True  # until the client calls again
            if r.owner[0]:
                self.owners[r.client_id] = r.owner
            self._ready.request_catchup(r.client_id, now)
        self._rt.arm(now)

    # --- lite subscriptions -------------------------------------------------------------------------------
    async def add_lite(
        self,
        client_id: str,
        group: str,
        parent: str,
        lites: Sequence[str],
        *,
        namespace: str = "",
        offset: offsets.OffsetReset | None = None,
    ) -> list[str]:
        """Subscribe to lite topics and patterns (``wildcards.is_pattern``); returns the LMQs added."""
        return await self._serially(
            client_id,
            len(lites),
            lambda: self._add_lite(client_id, group, parent, lites, namespace=namespace, offset=offset),
        )

    async def _add_lite(
        self,
        client_id: str,
        group: str,
        parent: str,
        lites: Sequence[str],
        *,
        namespace: str,
        offset: offsets.OffsetReset | None,
    ) -> list[str]:
        lites, patterns = await _split(lites)
        if patterns and offset is not None and offset.moves:
            raise errors.InvalidArgument("an offset option applies to lite topics, not to patterns", kind="offset")
        snap = await self._rt.metadata()
        found = snap.consuming_lite_group(group, parent)
        if found.wildcard:
            raise errors.Conflict(
                f"group {group} is a wildcard group: it receives every lite topic of {parent}; register with "
                "subscribeLiteAll (COMPLETE_ADD), not per lite topic",
                kind="group",
                group=group,
            )
        quota = snap.client_quota(found, parent, namespace)
        lmqs = await lmq_names(parent, lites)
        await self._reclaims_settled(client_id, lmqs)  # no await from here to the registry's first step
        now = self._rt.clock()
        self._registry.touch(client_id, now, group=group, bind_topic=parent)
        added = await sliced(self._registry.add_steps(client_id, lmqs, quota, now, patterns=patterns))
        if patterns:
            self._sync_patterns(client_id, group, parent)
        try:
            if offset is not None and offset.moves:
                await self._settlement.reset_offsets(list(lmqs), group, offset)  # refused: too few replicas stored it
        finally:  # the subscription is made either way: what is pending goes to it (a refused reset is tried again)
            if found.model == model.SubscriptionModel.EXCLUSIVE:
                await self._evict_others(client_id, group, lmqs)
            await self._register_pending(client_id, group, list(lmqs) if offset is not None else added)
        self._note_partial(client_id, [*lmqs, *patterns], added=True)
        return added

    async def remove_lite(self, client_id: str, group: str, parent: str, lites: Sequence[str]) -> list[str]:
        return await self._serially(client_id, len(lites), lambda: self._remove_lite(client_id, group, parent, lites))

    async def _remove_lite(self, client_id: str, group: str, parent: str, lites: Sequence[str]) -> list[str]:
        (await self._rt.metadata()).lite_group(group, parent)
        lites, patterns = await _split(lites)
        lmqs = await lmq_names(parent, lites)
        removed = await sliced(self._registry.remove_steps(client_id, lmqs, self._rt.clock(), patterns=patterns))
        await self._discard_queued(client_id, removed, group)
        if patterns:
            self._sync_patterns(client_id, group, parent)
        self._note_partial(client_id, [*lmqs, *patterns], added=False)
        return removed

    async def replace_lite(
        self, client_id: str, group: str, parent: str, lites: Sequence[str], *, namespace: str = ""
    ) -> tuple[list[str], list[str]]:
        held = self._registry.get(client_id)
        size = max(len(lites), len(held.lite_topics) if held is not None else 0)
        began = self._rt.clock()  # before any change it waits for: those may be newer than the client's set
        return await self._serially(
            client_id, size, lambda: self._replace_lite(client_id, group, parent, lites, namespace, began)
        )

    async def _replace_lite(  # noqa: PLR0917 (the call's arguments and when it arrived)
        self, client_id: str, group: str, parent: str, lites: Sequence[str], namespace: str, began: int
    ) -> tuple[list[str], list[str]]:
        snap = await self._rt.metadata()
        found = snap.consuming_lite_group(group, parent)
        if found.wildcard:  # the group's patterns, if any, say which lite topics (a change: at the next full sync)
            self._register_wildcard(client_id, group, parent, _filters(found.lite_patterns) or None)
            return [], []
        quota = snap.client_quota(found, parent, namespace)
        lites, patterns = await _split(lites)
        lmqs = await lmq_names(parent, lites)
        lmqs, patterns = self._with_recent(client_id, began, lmqs, patterns, quota)
        await self._reclaims_settled(client_id, lmqs)  # no await from here to the registry's first step
        now = self._rt.clock()
        self._registry.touch(client_id, now, group=group, bind_topic=parent)
        added, removed = await sliced(self._registry.replace_steps(client_id, lmqs, quota, now, patterns=patterns))
        await self._discard_queued(client_id, removed)
        self._sync_patterns(client_id, group, parent)
        if found.model == model.SubscriptionModel.EXCLUSIVE:
            await self._evict_others(client_id, group, added)
        await self._register_pending(client_id, group, added)
        return added, removed

    async def remove_all_lite(self, client_id: str, group: str, parent: str) -> None:
        held = self._registry.get(client_id)
        size = len(held.lite_topics) if held is not None else 0
        await self._serially(client_id, size, lambda: self._remove_all_lite(client_id, group, parent))

    async def _remove_all_lite(self, client_id: str, group: str, parent: str) -> None:
        (await self._rt.metadata()).lite_group(group, parent)
        self._recent.pop(client_id, None)
        queued = self._ready.queued(client_id)  # its patterns' topics too, which no removal below names
        if self._wildcards.remove(client_id) is not None:
            self._wildcard_cursor.pop(client_id, None)
        state = self._registry.get(client_id)
        if state is not None:
            steps = self._registry.remove_steps(
                client_id, list(state.lite_topics), self._rt.clock(), patterns=list(state.patterns)
            )
            await sliced(steps)
        await self._discard_queued(client_id, queued, group)

    def _note_partial(self, client_id: str, names: Sequence[str], *, added: bool) -> None:
        """A partial change of ``names`` (LMQs, patterns) ended now: a full sync built before it may not know it."""
        if not self._rt.config.full_sync_grace_ms:
            return
        now = self._rt.clock()
        names = names[-RECENT_PER_CLIENT:]
        recent = self._recent.get(client_id)
        if recent is None:
            recent = self._recent[client_id] = {}
        kept_since = now - max(RECENT_KEPT_MS, 2 * self._rt.config.full_sync_grace_ms)
        while recent:  # oldest first: each change moves its names to the end
            oldest = next(iter(recent))
            if recent[oldest][0] >= kept_since and len(recent) + len(names) <= RECENT_PER_CLIENT:
                break
            del recent[oldest]
        for name in names:
            recent.pop(name, None)
            recent[name] = (now, added)

    def _with_recent(
        self, client_id: str, began: int, lmqs: dict[str, None], patterns: list[str], quota: int
    ) -> tuple[dict[str, None], list[str]]:
        """A full sync's sets (``lmqs``, ``patterns``) with the client's partial changes it may not know yet
        (``full_sync_grace_ms``) made on top; as sent if nothing changed or the result would pass ``quota``."""
        recent = self._recent.get(client_id)
        grace = self._rt.config.full_sync_grace_ms
        if not recent or not grace:
            return lmqs, patterns
        since = began - grace
        newer = [(name, added) for name, (ended, added) in recent.items() if ended >= since]
        if not newer:
            return lmqs, patterns
        topics, wanted = dict(lmqs), dict.fromkeys(patterns)
        for name, added in newer:
            into = wanted if wildcards.is_pattern(name) else topics
            if added:
                into[name] = None
            else:
                into.pop(name, None)
        if quota != model.UNLIMITED and len(topics) + len(wanted) > quota:
            return lmqs, patterns
        return topics, list(wanted)

    async def _discard_queued(self, client_id: str, lmqs: list[str], group: str = "") -> None:
        """``lmqs`` leave the client's ready queue (in slices); ``group``: those it held are offered to the
        client's peers in that group (a shared group's other members), as at its end (``client_gone``)."""
        held = set(self._ready.queued(client_id)) if group else set()
        for index, part in enumerate(registry.slices(lmqs)):
            if index:
                await asyncio.sleep(0)
            self._ready.discard_many(client_id, part)
        for lmq in lmqs:
            if lmq in held:
                self._deliverer.dispatch(lmq, only_group=group)

    async def _serially(self, client_id: str, size: int, change: Callable[[], Awaitable[T]]) -> T:
        """Run ``change`` after the client's changes under way. A big one (``size`` names above a slice)
        runs in a task of its own, shielded: it finishes even when the caller is cancelled."""
        serial = self._serials.get(client_id)
        if serial is None:
            serial = self._serials[client_id] = _Serial()
        serial.users += 1

        async def run() -> T:
            try:
                async with serial.lock:
                    return await change()
            finally:
                serial.users -= 1
                if not serial.users and self._serials.get(client_id) is serial:
                    del self._serials[client_id]

        if size <= registry.SLICE:
            return await run()
        task = asyncio.get_running_loop().create_task(run())
        self._big_changes.add(task)
        task.add_done_callback(self._big_changes.discard)
        return await asyncio.shield(task)

    def forget(self, lmq: str) -> None:
        """A deleted lite topic: no one subscribes to it any more, and no ready queue holds it."""
        self._ready.discard(lmq, self._registry.forget_lmq(lmq))

    def _register_wildcard(
        self, client_id: str, group: str, parent: str, filters: Iterable[wildcards.Filter] | None = None
    ) -> None:
        """A client of a wildcard group takes every lite topic of ``parent`` (or those ``filters`` match); a new
        registration walks the parent's topics for backlog (paged, off the loop), as a catch-up pass does."""
        self._registry.touch(client_id, self._rt.clock(), group=group, bind_topic=parent)
        before = self._taken_filters(client_id)
        if self._wildcards.add(client_id, group, parent, filters):
            self._wildcard_cursor.pop(client_id, None)
            self.start_catchup(client_id)
            self._drop_untaken(client_id, before)

    def _sync_patterns(self, client_id: str, group: str, parent: str) -> None:
        """The client's patterns changed in the registry: register their filters (a new one walks its range
        for backlog), or unregister the client when it holds none."""
        before = self._taken_filters(client_id)
        state = self._registry.get(client_id)
        if state is not None and state.patterns:
            filters = _filters(state.patterns)
            if self._wildcards.add(client_id, group, parent, filters) and self._rt.loop is not None:
                self._rt.spawn(self._pattern_backlog(client_id, (parent, group), filters - before))
        elif self._wildcards.remove(client_id) is not None:
            self._wildcard_cursor.pop(client_id, None)
        self._drop_untaken(client_id, before)

    def _drop_untaken(self, client_id: str, before: frozenset[wildcards.Filter]) -> None:
        """After the client's filters changed from ``before``: topics queued for a filter it no longer holds
        (that it neither names nor matches any more) leave its ready queue."""
        if before <= self._taken_filters(client_id):
            return
        state = self._registry.get(client_id)
        held = state.lite_topics if state is not None else set()
        dropped = [
            q for q in self._ready.queued(client_id) if q not in held and not self._wildcards.holds(client_id, q)
        ]
        self._ready.discard_many(client_id, dropped)

    def _taken_filters(self, client_id: str) -> frozenset[wildcards.Filter]:
        if self._wildcards.registration(client_id) is None:
            return frozenset()
        return self._wildcards.filters(client_id) or frozenset((wildcards.WHOLE_PARENT,))

    async def subscribe_filters(
        self, client_id: str, group: str, parent: str, filters: Sequence[wildcards.Filter]
    ) -> None:
        """Take the lite topics of ``parent`` that ``filters`` match (``wildcards``: MQTT subscriptions), now
        and as they appear, replacing the client's earlier filters; none: the client takes nothing by pattern."""
        (await self._rt.metadata()).consuming_lite_group(group, parent)
        if filters:
            self._register_wildcard(client_id, group, parent, filters)
        elif self._wildcards.remove(client_id) is not None:
            self._wildcard_cursor.pop(client_id, None)

    async def _evict_others(self, client_id: str, group: str, lmqs: Iterable[str]) -> None:
        """Exclusive groups: the newest subscriber of a lite topic takes it from its group peers (in slices)."""
        now = self._rt.clock()
        for index, lmq in enumerate(lmqs):
            if index and not index % registry.SLICE:
                await asyncio.sleep(0)
            for other in self._registry.subscribers(lmq):
                state = self._registry.get(other)
                if other != client_id and state is not None and state.group == group:
                    self._registry.remove(other, [lmq], now)
                    self._ready.discard_many(other, [lmq])
                    recent = self._recent.get(other)
                    if recent is not None:  # taken from it: its full sync built before does not take it back
                        recent.pop(lmq, None)
                    notices = self._notices.get(other)
                    if notices is not None and not notices.full():  # full: the client is not reading anyway
                        notices.put_nowait(model.QueueId(lmq).lite_parts()[1])

    async def _register_pending(self, client_id: str, group: str, lmqs: list[str]) -> None:
        """Newly subscribed topics that already hold undelivered messages go straight to this client."""
        for start in range(0, len(lmqs), PROBE_CHUNK):
            try:
                found = await self._deliverer.pending_among(lmqs[start : start + PROBE_CHUNK], group)
            except errors.StorageError:  # the store rebuilds its index: a catch-up pass looks later
                self._deliverer.retry_catchup(client_id)
                return
            for lmq in found:
                if not self._offer_taken(client_id, lmq, group):
                    return  # full: the catch-up pass it scheduled walks the rest

    async def trigger(self, group: str, lmqs: Sequence[str]) -> list[str]:
        """An operator's nudge: offer ``lmqs`` (empty: every topic a client of ``group`` subscribes to) to the
        group's subscribers if they have work for it, and start a catch-up pass of the group's wildcard
        clients. Pending work is probed in chunks off the loop; returns the topics a client took (not one
        without a subscriber of the group, nor one whose next message is leased in order)."""
        members = [st for st in self._registry.clients() if st.group == group]
        if not lmqs:
            lmqs = sorted({lmq for st in members for lmq in st.lite_topics})
            for st in members:
                if self._wildcards.registration(st.client_id) is not None:
                    self.start_catchup(st.client_id)
        offered: list[str] = []
        for start in range(0, len(lmqs), PROBE_CHUNK):
            for lmq in await self._deliverer.pending_among(list(lmqs[start : start + PROBE_CHUNK]), group):
                if self._deliverer.dispatch(lmq, only_group=group):
                    offered.append(lmq)
        return offered

    # --- catch-up passes ----------------------------------------------------------------------------------
    def start_catchup(self, client_id: str) -> None:
        if self._rt.loop is None:
            return
        if client_id in self._catchup_running:
            # The running pass may have walked already what made this one due: it runs again when done.
            self._catchup_again.add(client_id)
            return
        self._catchup_running.add(client_id)
        self._rt.spawn(self._catchup(client_id))

    async def _catchup(self, client_id: str) -> None:
        """Walk this client's own subscriptions for pending work, once round: from where the last pass stopped
        (a full ready queue stops it), then on over the topics before that point, which may have overflowed
        since that pass walked them."""
        try:
            await self._catchup_walk(client_id)
        except errors.StorageError as exc:  # the store rebuilds its index: walk again later
            log.info("catch-up of client %s deferred: %s", client_id, exc.message)
            self._deliverer.retry_catchup(client_id)
        finally:
            self._catchup_running.discard(client_id)
            if client_id in self._catchup_again:
                self._catchup_again.discard(client_id)
                now = self._rt.clock()
                self._ready.request_catchup(client_id, now)
                self._rt.arm(now)

    async def _catchup_walk(self, client_id: str) -> None:
        state = self._registry.get(client_id)
        if state is None or not state.group:
            return
        if self._wildcards.registration(client_id) is not None and not await self._wildcard_catchup(client_id):
            return  # stopped by a full ready queue: the catch-up it scheduled walks on
        todo = list(state.lite_topics)
        resume = self._catchup_cursor.pop(client_id, None)
        if resume:
            after = set(resume)
            todo = resume + [lmq for lmq in todo if lmq not in after]
        for start in range(0, len(todo), PROBE_CHUNK):
            current = [lmq for lmq in todo[start : start + PROBE_CHUNK] if lmq in state.lite_topics]
            for lmq in await self._deliverer.pending_among(current, state.group):
                if not self._offer_taken(client_id, lmq, state.group):
                    self._catchup_cursor[client_id] = todo[todo.index(lmq, start) :]
                    return
            if self._registry.get(client_id) is not state:
                return

    async def _wildcard_catchup(self, client_id: str) -> bool:
        """Page through the lite names of the wildcard group's parent (those its filters can match) and offer
        the client every topic with work for its group, once round: from after the last offer that fitted (a
        full ready queue stops a pass) to the end, then from the start up to there (those topics may have
        overflowed since they were walked). False when a full ready queue stopped it."""
        where = self._wildcards.registration(client_id)
        if where is None:
            return True
        resume = self._wildcard_cursor.pop(client_id, "")
        names = await self.indexed_names(where[0], self._wildcards.filters(client_id))
        if names is not None:  # no literal prefix: the level index, not a walk of the whole parent
            ahead = [n for n in names if n > resume]
            stopped = await self._offer(client_id, where, ahead + names[: len(names) - len(ahead)], resume)
        else:
            pieces = _round_from(self._wildcards.scan_ranges(client_id), resume)
            stopped = await self._walk(client_id, where, pieces, lambda lite: self._wildcards.takes(client_id, lite))
        if stopped is None:
            return True
        self._wildcard_cursor[client_id] = stopped
        return False

    async def _pattern_backlog(
        self, client_id: str, where: tuple[str, str], filters: frozenset[wildcards.Filter]
    ) -> None:
        """New patterns of a client: offer the topics with work for its group that they match, walking only
        their ranges (a client adds its patterns one at a time: a full catch-up each would walk them all)."""
        try:
            names = await self.indexed_names(where[0], filters)
            if names is not None:
                await self._offer(client_id, where, names, "")
                return
            await self._walk(
                client_id,
                where,
                wildcards.scan_ranges(filters),
                lambda lite: any(wildcards.matches(f, lite.split(wildcards.LEVEL_SEPARATOR)) for f in filters),
            )  # stopped by a full ready queue: the offer that did not fit scheduled a catch-up pass
        except errors.StorageError:  # the store rebuilds its index: a catch-up pass looks later
            self._deliverer.retry_catchup(client_id)

    async def _walk(
        self, client_id: str, where: tuple[str, str], pieces: list[tuple[str, str]], takes: Callable[[str], bool]
    ) -> str | None:
        """Page through ``pieces`` (start after, end before) of the parent's lite names, offering the client the
        topics ``takes`` accepts that have work for its group. None when done (or the client unregistered);
        else where to resume: the walk stopped at a full ready queue."""
        parent, group = where
        for start, end in pieces:
            after = start
            while True:
                page = await self._rt.run(self._rt.store.scan_lite_topics, parent, after, end, CATCHUP_CHUNK)
                if self._wildcards.registration(client_id) != where:
                    return None
                taken = [meta.lite for meta in page if takes(meta.lite)]
                lmqs = [lmq_name(parent, lite) for lite in taken]
                for lmq in await self._deliverer.pending_among(lmqs, group):
                    if not self._offer_taken(client_id, lmq, group):
                        index = lmqs.index(lmq)
                        return taken[index - 1] if index else after
                if len(page) < CATCHUP_CHUNK:
                    break
                after = page[-1].lite
        return None

    async def _offer(self, client_id: str, where: tuple[str, str], names: list[str], before: str) -> str | None:
        """``_walk`` over a list of names (from a level index): None when done, else where to resume."""
        parent, group = where
        for i in range(0, len(names), CATCHUP_CHUNK):
            taken = names[i : i + CATCHUP_CHUNK]
            lmqs = [lmq_name(parent, lite) for lite in taken]
            pending = await self._deliverer.pending_among(lmqs, group)
            if self._wildcards.registration(client_id) != where:
                return None
            for lmq in pending:
                if not self._offer_taken(client_id, lmq, group):
                    index = i + lmqs.index(lmq)
                    return names[index - 1] if index else before
        return None

    def _offer_taken(self, client_id: str, lmq: str, group: str) -> bool:
        """Offer ``lmq`` to the client if it still takes it for ``group`` (names it, or a filter it holds now
        matches it); False only when its ready queue is full. A walk chose ``lmq`` from what it read before an
        await, and an unsubscribe answered meanwhile has dropped the topic from the ready queue for good."""
        state = self._registry.get(client_id)
        named = state is not None and state.group == group and lmq in state.lite_topics
        where = self._wildcards.registration(client_id)
        if named or (where is not None and where[1] == group and self._wildcards.holds(client_id, lmq)):
            return self._deliverer.offer(client_id, lmq, group)
        return True  # no longer its topic: nothing to queue, the walk goes on

    async def indexed_names(self, parent: str, filters: Iterable[wildcards.Filter] | None) -> list[str] | None:
        """The names of ``parent`` that ``filters`` match, sorted: before ``parent`` has a level index, found
        in the store's key order (off the loop) when that reads at most ``WALK_BUDGET`` names; else from its
        level index (built the first time, a page per loop step; taken a slice per loop step); None when the
        filters have a literal prefix (a range scan reads only that range), for a whole-parent client, or with
        the index off."""
        if filters is None or not self._rt.config.lite_level_index:
            return None
        wanted = list(filters)
        if not wanted or wildcards.scan_ranges(wanted) != [("", "")] or wildcards.WHOLE_PARENT in wanted:
            return None
        if parent not in self._wildcards.indexes:  # none built or being built: the store's key order first
            store = self._rt.store
            page, held = functools.partial(store.lite_names, parent), functools.partial(store.lite_names_held, parent)
            walked, spent = await self._rt.run(level_index.matching_in_order, page, held, wanted, WALK_BUDGET)
            if walked is not None:
                self._walks_cost(parent, spent)
                return sorted(walked)
            self._walked.pop(parent, None)
        index = await self._level_index(parent)
        if index is None:
            return None
        found: set[str] = set()
        for f in wanted:
            for n, name in enumerate(index.matching_one(f), 1):
                found.add(name)
                if not n % INDEX_SLICE:
                    await asyncio.sleep(0)
            await asyncio.sleep(0)
        return sorted(found)

    def _walks_cost(self, parent: str, spent: int) -> None:
        """A parent's matches in key order add up; once they have cost about two builds of its level index
        (``WALKS_BEFORE_INDEX``: a client whose catch-up passes keep matching, or SUBSCRIBE after SUBSCRIBE),
        the index is built, in the background (a page per loop step; needs meanwhile wait for it): all in all
        at most about twice what building it at first would have cost."""
        if parent in self._wildcards.indexes:
            return
        spent += self._walked.pop(parent, 0)
        if spent < WALKS_BEFORE_INDEX:
            self._walked[parent] = spent
            return

        async def build() -> None:
            await self._level_index(parent)

        self._rt.spawn(build())

    async def _level_index(self, parent: str) -> level_index.LevelIndex | None:
        building = self._indexing.get(parent)
        if building is not None:
            await building.wait()
        index = self._wildcards.indexes.get(parent)
        if index is not None:
            return index
        index = self._wildcards.indexes[parent] = level_index.LevelIndex()  # arrivals join it from now on
        done = self._indexing[parent] = asyncio.Event()
        try:
            after = ""
            while True:  # a page per loop step: the names read off the loop, added on it (~2 µs a name)
                page = await self._rt.run(self._rt.store.lite_names, parent, after, INDEX_PAGE)
                index.add_many(page)
                if len(page) < INDEX_PAGE:
                    return index
                after = page[-1]
        except BaseException:
            del self._wildcards.indexes[parent]
            raise
        finally:
            done.set()
            del self._indexing[parent]

    # --- reclaim marks ------------------------------------------------------------------------------------
    def begin_reclaim(self, lmqs: Sequence[model.QueueId], allowed_subscribers: Sequence[int] | None) -> reclaims.Mark:
        topics = [lmq.topic for lmq in lmqs]
        return self.marks.begin(topics, list(map(self._registry.subscriber_count, topics)), allowed_subscribers)

    async def _reclaims_settled(self, client_id: str, lmqs: Iterable[str]) -> None:
        """Before ``client_id`` subscribes to ``lmqs``: each topic it does not hold yet that a delete has
        marked is vetoed (kept), or, where that is too late, waited for. Returns in the loop step of its
        last veto, so a caller that registers without awaiting first is registered before the delete."""
        while self.marks:
            state = self._registry.get(client_id)
            held = state.lite_topics if state is not None else set()
            busy = self.marks.blocking(lmq for lmq in lmqs if lmq not in held)
            if busy is None:
                return
            await busy.done.wait()
