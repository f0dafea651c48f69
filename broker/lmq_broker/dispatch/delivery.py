"""Handing messages out: lite topics offered to clients' ready queues, long polls woken, messages leased.

Work reaches a consumer through three doors, each naming one lite topic: a message arrived (from ``ingest``,
coalesced per loop pass), an ack left more behind (from ``settlement``), a lease expired (the timer). The
topic is offered to one subscribed client per group (shared mode) through that client's ready queue, and the
client's long poll wakes. A receive drains its ready queue, reads from the group's commit point (the
recent-message cache first, the store otherwise) and leases. Nothing walks all lite topics: an arrival is a
dict lookup, and idle topics cost no CPU. Normal topics have no ready queues: an arrival wakes the topic's
waiting receivers, which look at every queue of the topic.

``Deliverer`` is what ingest knows as ``Readers`` and settlement as ``Deliveries``; it opens, commits and
releases lease state through ``settlement`` and reads the recent cache and appends dead letters through
``ingest``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, KeysView
from dataclasses import dataclass, field
from itertools import filterfalse
from operator import methodcaller
from typing import Final

from lmq_broker import errors, model
from lmq_broker.dispatch import filters, ingest, leases, readyset, registry, runtime, settlement, wildcards
from lmq_broker.dispatch.leases import LeaseKey

log = logging.getLogger(__name__)

READY_WAITS_PER_CLIENT: Final = 8  # ``await_ready`` calls parked at once for one client id
READY_WAITS_TOTAL: Final = 100_000  # ... and for all clients
RENEW_AHEAD_MS: Final = 5_000  # an auto-renew lease is renewed this long before it would expire
STORE_RETRY_MS: Final = 1_000  # a lite topic whose read the store refused (index rebuild) is looked at again

_is_lmq_topic = methodcaller("startswith", model.LMQ_PREFIX)


@dataclass(slots=True)
class ReadyWaits:
    """The ``await_ready`` calls parked now (per client and in all), their caps, and counts since the start."""

    per_client_cap: int = READY_WAITS_PER_CLIENT
    total_cap: int = READY_WAITS_TOTAL
    parked: dict[str, int] = field(default_factory=dict)
    total: int = 0
    started: int = 0
    ready: int = 0
    refused: int = 0


@dataclass(frozen=True, slots=True)
class Delivery:
    message: model.StoredMessage
    attempt: int
    receipt_handle: str
    invisible_ms: int


class Deliverer:
    def __init__(
        self,
        rt: runtime.Runtime,
        *,
        table: leases.LeaseTable,
        ready: readyset.ReadySet,
        subscribers: registry.Registry,
        wild: wildcards.Wildcards,
        writes: ingest.Ingest,
        settling: settlement.Settlement,
    ) -> None:
        self._rt = rt
        self._leases = table
        self._ready = ready
        self._registry = subscribers
        self._wildcards = wild
        self._ingest = writes
        self._recent = writes.recent
        self._settlement = settling
        self._client_events: dict[str, asyncio.Event] = {}
        self._topic_events: dict[str, asyncio.Event] = {}
        # keys being leased (a read under way), each with the last client that found it so meanwhile ("": none)
        self._busy: dict[LeaseKey, str] = {}
        self.ready_waits = ReadyWaits()
        slice_ms = rt.config.lease_renew_slice_ms
        self.renewal = leases.Renewal(slice_ms, min(RENEW_AHEAD_MS, slice_ms // 2), self.holds)

    # --- what ingest and settlement tell ------------------------------------------------------------------
    def subscribed(self) -> KeysView[str]:
        return self._registry.subscribed()

    def arrived(self, topics: dict[str, None]) -> None:
        """Offer the arrived lite topics, in arrival order, and wake normal-topic receivers."""
        # Most LMQs written have no subscriber on this broker: ``&`` finds the others in C (walking the smaller
        # side), and the topics are then offered in arrival order.
        subscribed = self._registry.subscribed() & topics.keys()
        if self._wildcards.indexes:
            self._wildcards.index_arrived(topics)
        if self._wildcards:
            subscribed |= {lmq for lmq in filter(_is_lmq_topic, topics) if self._wildcards.groups_of_lmq(lmq)}
        if subscribed:
            for lmq in filter(subscribed.__contains__, topics):
                self.dispatch(lmq)
        for topic in filterfalse(_is_lmq_topic, topics):
            self.wake_topic(topic)

    def delivering(self, key: LeaseKey) -> bool:
        return key in self._busy

    def ready_again(self, key: LeaseKey, *, prefer: str = "") -> None:
        if key.topic.startswith(model.LMQ_PREFIX):
            self.dispatch(key.topic, only_group=key.group, prefer=prefer or None)
        else:
            self.wake_topic(key.topic)

    def expire(self, now: int) -> None:
        """Leases that expired (auto-renew ones of live holders renewed instead): their topics are offered again."""
        for key in self._leases.due(now, self.renewal):
            self.ready_again(key)

    def holds(self, client_id: str, key: LeaseKey) -> bool:
        """Are the client's leases of ``key`` still renewed: it is registered (not terminated or expired), in
        the key's group, and for a lite topic still subscribed to it (not unsubscribed, nor evicted by an
        Exclusive peer)."""
        state = self._registry.get(client_id)
        if state is None or state.group != key.group:
            return False
        if not key.topic.startswith(model.LMQ_PREFIX):
            return True
        return key.topic in state.lite_topics or self._wildcards.holds(client_id, key.topic)

    # --- offers and wake-ups ------------------------------------------------------------------------------
    def dispatch(self, lmq: str, *, only_group: str | None = None, prefer: str | None = None) -> bool:
        """Offer ``lmq`` to one subscriber per group (the ``prefer``red one first, else a random start); True
        when some client took it."""
        subscribers = self._registry.subscribers(lmq)
        wild = self._wildcards.groups_of_lmq(lmq)
        if not subscribers and not wild:
            return False
        by_group: dict[str, list[str]] = {}
        for cid in subscribers:
            state = self._registry.get(cid)
            if state is not None and state.group and (only_group is None or state.group == only_group):
                by_group.setdefault(state.group, []).append(cid)
        for group, members in wild.items():
            if only_group is None or group == only_group:
                by_group.setdefault(group, []).extend(sorted(members))
        now = self._rt.clock()
        taken = False
        for group, cids in by_group.items():
            in_flight = self._leases.get(LeaseKey(lmq, 0, group))
            if in_flight is not None and in_flight.blocked(now):
                continue  # its ack or lease expiry dispatches again
            if prefer in cids:
                order = [prefer, *(c for c in cids if c != prefer)]
            else:
                start = self._rt.rng.randrange(len(cids))
                order = self._live_first(cids[start:] + cids[:start])
            for cid in order:
                if self.offer(cid, lmq, group):
                    taken = True
                    break
        return taken

    def _live_first(self, cids: list[str]) -> list[str]:
        """Clients heard from since the start before those only restored from the data dir (which may be gone
        for good: a topic offered to one would wait for its expiry)."""
        restored = [c for c in cids if (st := self._registry.get(c)) is not None and st.restored]
        return [c for c in cids if c not in restored] + restored if restored else cids

    def offer(self, client_id: str, lmq: str, group: str) -> bool:
        """Queue ``lmq`` for the client; False when its ready queue is full (a catch-up pass is scheduled)."""
        outcome = self._ready.offer(client_id, lmq, self._rt.snap.ready_capacity(group), self._rt.clock())
        if outcome is readyset.Offer.ADDED:
            self.wake(client_id)
        elif outcome is readyset.Offer.FULL:
            next_at = self._ready.next_catchup_ms()
            if next_at is not None:
                self._rt.arm(next_at)
        return outcome is not readyset.Offer.FULL

    def retry_catchup(self, client_id: str) -> None:
        """The store refused a read for this client (an index rebuild): a catch-up pass looks again later."""
        at = self._rt.clock() + STORE_RETRY_MS
        self._ready.request_catchup(client_id, at)
        self._rt.arm(at)

    def wake(self, client_id: str) -> None:
        event = self._client_events.pop(client_id, None)
        if event is not None:
            event.set()

    def wake_topic(self, topic: str) -> None:
        event = self._topic_events.pop(topic, None)
        if event is not None:
            event.set()

    def wake_all(self) -> None:
        for event in [*self._client_events.values(), *self._topic_events.values()]:
            event.set()

    # --- receiving ----------------------------------------------------------------------------------------
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
        tags: filters.TagFilter = filters.ALL,
    ) -> list[Delivery]:
        """Long-poll this client's ready lite topics. ``auto_renew``: ``invisible_ms`` is a slice, renewed
        while the client lives (up to ``lease_renew_max_ms``). ``tags``: messages it does not take are settled
        for the group, never delivered."""
        rt = self._rt
        snap = await rt.metadata()
        found = snap.consuming_lite_group(group, parent)
        deadline = rt.clock() + poll_ms
        self._registry.touch(client_id, rt.clock(), group=group, bind_topic=parent)
        while not rt.closed and not rt.draining:
            event = self._client_events.get(client_id)
            if event is None:
                event = self._client_events[client_id] = asyncio.Event()
            self._settlement.check_generation()
            self._ingest.flush()  # do not let the per-pass coalescing hide an arrival from this poll
            out: list[Delivery] = []
            try:
                while len(out) < batch:
                    popped = self._ready.pop(client_id, 1)
                    if not popped:
                        break
                    key = LeaseKey(popped[0], 0, group)
                    out += await self._deliver(
                        key, batch - len(out), invisible_ms, client_id, found, auto_renew=auto_renew, tags=tags
                    )
            except BaseException:  # cancelled (the receiver is gone) with leases it will never see
                self._give_back(group, out)
                raise
            if out:
                return out
            if not await self._wait(event, deadline):
                return []
            self._registry.touch(client_id, rt.clock())
        return []

    async def await_ready(self, client_id: str, group: str, parent: str, poll_ms: int, *, capped: bool = True) -> bool:
        """Wait, leasing nothing, until the client has lite topics ready (True) or ``poll_ms`` passed (False);
        another broker asks this on behalf of a client it serves (then receives here without waiting), so a wait
        cut off loses nothing. The client is touched as a receive touches it (it stays registered); a client
        forgotten meanwhile (gone, expired) ends the wait. ``errors.TooManyRequests`` beyond the caps of parked
        waits (``ready_waits``); ``capped`` False: this broker's own wait for a client it serves (a long poll's,
        bounded as long polls are), counted but never refused."""
        rt, waits = self._rt, self.ready_waits
        mine = waits.parked.get(client_id, 0)
        if capped and (mine >= waits.per_client_cap or waits.total >= waits.total_cap):
            waits.refused += 1
            raise errors.TooManyRequests(
                f"too many waits parked for client {client_id} ({mine}, at most {waits.per_client_cap}) or in all "
                f"({waits.total}, at most {waits.total_cap}); try again later"
            )
        (await rt.metadata()).consuming_lite_group(group, parent)
        deadline = rt.clock() + poll_ms
        self._registry.touch(client_id, rt.clock(), group=group, bind_topic=parent)
        waits.parked[client_id] = mine + 1
        waits.total += 1
        waits.started += 1
        try:
            while not rt.closed and not rt.draining:
                event = self._client_events.get(client_id)
                if event is None:
                    event = self._client_events[client_id] = asyncio.Event()
                self._ingest.flush()  # as a receive: an arrival coalesced for this loop pass counts
                if self._ready.size(client_id):
                    waits.ready += 1
                    return True
                if not await self._wait(event, deadline) or self._registry.get(client_id) is None:
                    return False
                self._registry.touch(client_id, rt.clock())
            return False
        finally:
            left = waits.parked.pop(client_id) - 1
            if left:
                waits.parked[client_id] = left
            waits.total -= 1

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
        tags: filters.TagFilter = filters.ALL,
    ) -> list[Delivery]:
        rt = self._rt
        snap = await rt.metadata()
        found = snap.normal_group(group, topic)
        queues = max(1, snap.topic(topic).queue_count)
        deadline = rt.clock() + poll_ms
        self._registry.touch(client_id, rt.clock(), group=group)
        while not rt.closed and not rt.draining:
            event = self._topic_events.get(topic)
            if event is None:
                event = self._topic_events[topic] = asyncio.Event()
            out: list[Delivery] = []
            rr = rt.next_round_robin()
            for i in range(queues):
                key = LeaseKey(topic, (rr + i) % queues, group)
                out += await self._deliver(
                    key,
                    batch - len(out),
                    invisible_ms,
                    client_id,
                    found,
                    ordered=found.fifo,
                    auto_renew=auto_renew,
                    tags=tags,
                )
                if len(out) >= batch:
                    self.wake_topic(topic)  # there may be more: let other receivers look too
                    break
            if out:
                return out
            if not await self._wait(event, deadline):
                return []
        return []

    async def _wait(self, event: asyncio.Event, deadline: int) -> bool:
        """One long-poll wait: until ``event`` is set or ``deadline`` (ms); False once the deadline has passed,
        unless ``event`` is set already (a receive that settled filtered messages woke itself to read on).

        ``asyncio.timeout``, not ``wait_for``: in Python 3.11 ``wait_for`` runs the wait as a task of its own (a
        task, its coroutine, a future and a callback: ~1.6 KiB per parked poll, measured), and parked long
        polls and ``await_ready`` waits are many and idle."""
        if event.is_set():
            return True
        remaining = deadline - self._rt.clock()
        if remaining <= 0:
            return False
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(remaining / 1000):
                await event.wait()
        return True

    async def _deliver(
        self,
        key: LeaseKey,
        limit: int,
        invisible_ms: int,
        holder: str,
        group: model.LiteGroup,
        *,
        ordered: bool = True,
        auto_renew: bool = False,
        tags: filters.TagFilter = filters.ALL,
    ) -> list[Delivery]:
        """Lease up to ``limit`` messages of ``key`` to ``holder``; those past their attempts (or suspended too
        long) go to the dead letters instead, those ``tags`` does not take are settled as if consumed."""
        if limit <= 0:
            return []
        if key in self._busy:  # the holder delivers what its read finds; offered to this client again after it
            self._busy[key] = holder
            return []
        hands_out = self._settlement.hands_out
        if hands_out is not None and not hands_out(key.queue_id):
            # a deposed owner (replication): the lease holder hands it out; looked at again should this broker
            # hold the lease again (a lease late to renew closes the fence for a moment)
            if key.topic.startswith(model.LMQ_PREFIX):
                self.retry_catchup(holder)
            return []
        self._busy[key] = ""
        try:
            read = await self._read(key, limit, holder, ordered)
            if read is None:
                return []
            state, picks, by_offset = read
            passed: list[leases.Pick] = []
            if not tags.takes_all:  # settled before the first await, so no ack or expiry comes in between
                picks, passed = filters.split(picks, by_offset, tags)
                self._settlement.pass_over(state, passed)
            out, dead = self._lease(
                key,
                state,
                picks,
                by_offset,
                holder=holder,
                invisible_ms=invisible_ms,
                auto_renew=auto_renew,
                retry=group.retry,
            )
            if len(out) >= limit and not state.blocked(self._rt.clock()):
                # the receive took all it asked: what follows (an MQTT session's pipelined topic has more
                # while these are out) is offered again, or it would wait for an ack or the next arrival
                self._busy[key] = self._busy[key] or holder
            try:
                if passed:
                    await self._passed_filtered(key, state, holder, wanted=len(out) < limit)
                if dead:
                    await self._give_up(key, state, dead, holder, delivered=bool(out))
            except BaseException:
                self._give_back(key.group, out)
                raise
            return out
        finally:
            asked = self._busy.pop(key)
            self._settlement.release(key)
            if asked:  # what offered it to another client may have come after the read: that client looks again
                self.ready_again(key, prefer=asked)

    async def _read(
        self, key: LeaseKey, limit: int, holder: str, ordered: bool
    ) -> tuple[leases.QueueLeases, list[leases.Pick], dict[int, model.StoredMessage]] | None:
        """The key's lease state, what is due in it (up to ``limit``) and those messages by offset; None: nothing
        is due, or the store refused the read (the key is looked at again later)."""
        settling = self._settlement
        generation = settling.check_generation()
        try:
            state = await settling.state_of(key, ordered)
            picks = state.picks(self._rt.clock(), limit)
            end = self._recent.end(key.queue_id)
            if end is not None:
                picks = [p for p in picks if p.offset < end]
            if not picks:
                return None
            messages, span_end = await self._messages(key, state, picks, generation)
        except errors.StorageError as exc:  # an index rebuild (or meta trouble): nothing read, nothing settled
            self._store_refused(key, holder, exc)
            return None
        if span_end >= 0 and settling.settle_gone(key, state, picks[0].offset, span_end, messages):
            with contextlib.suppress(errors.StorageError):  # dirty now: retried, and the receive goes on
                await settling.commit(key, state)
            picks = [p for p in state.picks(self._rt.clock(), limit) if p.offset < span_end]
        return state, picks, {m.offset: m for m in messages}

    async def _messages(
        self, key: LeaseKey, state: leases.QueueLeases, picks: list[leases.Pick], generation: int
    ) -> tuple[list[model.StoredMessage], int]:
        """The messages of ``picks``' span, from the recent cache (span end -1) or the store (with the end of
        the span read: offsets below it that were not read are gone for good)."""
        rt, queue = self._rt, key.queue_id
        first, last = picks[0].offset, picks[-1].offset
        cached = self._recent.window(queue, first, last)
        if cached is not None:
            return cached, -1
        messages, span_end = await rt.run(rt.store.read_span, queue, first, last - first + 1)
        if not messages or messages[0].offset > first:
            lo, _, _, _ = await rt.run(self._settlement.offsets, queue, key.group)
            if lo > state.committed:  # retention dropped what we were about to deliver
                state.skip_to(lo)
        if rt.store.index_generation() != generation:
            # the index was replaced under the read: its holes prove nothing; read again later
            raise errors.StorageError("the store's index was replaced during the read")
        return messages, span_end

    def _lease(
        self,
        key: LeaseKey,
        state: leases.QueueLeases,
        picks: list[leases.Pick],
        by_offset: dict[int, model.StoredMessage],
        *,
        holder: str,
        invisible_ms: int,
        auto_renew: bool,
        retry: model.RetryPolicy,
    ) -> tuple[list[Delivery], list[tuple[leases.Pick, model.StoredMessage]]]:
        """Lease ``picks`` to ``holder`` (no await: nothing comes in between); returns the deliveries and the
        picks given up (past ``retry``'s attempts or the suspend cap), which are not leased."""
        rt, table = self._rt, self._leases
        now = rt.clock()
        renew_max, max_suspend = rt.config.lease_renew_max_ms, rt.config.max_suspend_ms
        renew_until = now + renew_max if auto_renew and renew_max > invisible_ms else 0
        out: list[Delivery] = []
        dead: list[tuple[leases.Pick, model.StoredMessage]] = []
        for pick in picks:
            message = by_offset.get(pick.offset)
            if message is None or pick.offset < state.committed:
                continue
            if pick.attempt > retry.max_attempts or leases.over_suspend_cap(pick.suspended_ms, max_suspend):
                dead.append((pick, message))
                continue
            lease_id = table.new_lease_id()
            state.lease(
                pick, now, invisible_ms, lease_id, holder, renew_until_ms=renew_until, message_id=message.message_id
            )
            out.append(Delivery(message, pick.attempt, table.receipt(key, pick.offset, lease_id), invisible_ms))
        if out:  # every lease of the batch is visible again at the same time, with the same renewal deadline
            at = leases.watch_time(now + invisible_ms, renew_until, self.renewal.ahead_ms)
            table.watch(key, at)
            rt.arm(at)
            self._settlement.handed_out(key)  # persisted in the background, with whatever else happens meanwhile
        return out, dead

    async def _give_up(
        self,
        key: LeaseKey,
        state: leases.QueueLeases,
        dead: list[tuple[leases.Pick, model.StoredMessage]],
        holder: str,
        *,
        delivered: bool,
    ) -> None:
        """Settle ``dead`` as dead letters. The key was taken off the ready queue; when it was for dead letters
        only (nothing ``delivered``), it is offered again: what follows would otherwise wait."""
        try:
            await self._settlement.settle_dead(key, state, dead)
        except errors.StorageError as exc:  # not appended: their leases expire and they come again
            self._store_refused(key, holder, exc)
        else:
            if not delivered:
                self.ready_again(key, prefer=holder)

    async def _passed_filtered(self, key: LeaseKey, state: leases.QueueLeases, holder: str, *, wanted: bool) -> None:
        """Messages the receiver's tag filter does not take were settled as if consumed: persist that. When it
        left too few to fill the receive (``wanted``), the key is offered again at once: what follows the
        passed span would otherwise wait for the next arrival or ack."""
        await self._settlement.persist(key, state)
        if wanted:
            self.ready_again(key, prefer=holder)

    def _give_back(self, group: str, leased: list[Delivery]) -> None:
        """Leases of a receive that does not return them (cancelled, failed): visible again at once (no await:
        the cancellation may come again), or they would wait their invisible time, an auto-renewed one renewed
        for as long as its holder (an MQTT session that reconnects) is registered."""
        self.give_back(group, [delivery.receipt_handle for delivery in leased])

    def give_back(self, group: str, receipt_handles: Iterable[str]) -> None:
        """Leases returned but never handed to their client (its call ended before they were written): visible
        again at once, as ``_give_back``; a handle acked or changed meanwhile is passed over."""
        for handle in receipt_handles:
            with contextlib.suppress(errors.LmqError):
                self._change_invisible(group, handle, 0)

    def _store_refused(self, key: LeaseKey, holder: str, exc: errors.StorageError) -> None:
        """A read for ``key`` failed (the store rebuilds its index): the receive answers empty, and the lite
        topic is looked at again in ``STORE_RETRY_MS`` (a catch-up pass of ``holder``); normal-topic receivers
        poll again anyway."""
        log.info("%s queue %d group %s: store not readable (%s); retried", *key, exc.message)
        if key.topic.startswith(model.LMQ_PREFIX):
            self.retry_catchup(holder)

    async def change_invisible(
        self, group: str, receipt_handle: str, invisible_ms: int, *, suspend: bool = False
    ) -> str:
        return self._change_invisible(group, receipt_handle, invisible_ms, suspend=suspend)

    def _change_invisible(self, group: str, receipt_handle: str, invisible_ms: int, *, suspend: bool = False) -> str:
        receipt, key = self._leases.resolve(receipt_handle, group)
        self._settlement.check_fence(key.queue_id)
        new_receipt, lease = self._leases.change(
            key, receipt, self._rt.clock(), invisible_ms, suspend, max_suspend_ms=self._rt.config.max_suspend_ms
        )
        self._rt.arm(lease.visible_at_ms)
        self._settlement.handed_out(key)  # a suspend (or a nack after one) changed the attempt count
        return self._leases.seal(new_receipt, group)

    async def pending_among(self, lmqs: list[str], group: str) -> list[str]:
        """Which of ``lmqs`` have work for ``group`` (store reads on the pool, decision on the loop)."""
        store = self._rt.store

        def probe() -> list[tuple[str, int, int, int | None]]:
            rows = []
            for lmq in lmqs:
                queue = model.QueueId(lmq)
                lo, hi = store.queue_offsets(queue)
                if hi > lo:
                    rows.append((lmq, lo, hi, store.get_offset(queue, group)))
            return rows

        self._settlement.check_generation()
        rows = await self._rt.run(probe)
        now = self._rt.clock()
        pending = []
        for lmq, lo, hi, committed in rows:
            state = self._leases.get(LeaseKey(lmq, 0, group))
            if state is not None:
                if state.has_ready(now, hi):
                    pending.append(lmq)
            elif hi > max(lo, committed if committed is not None else lo):
                pending.append(lmq)
        return pending
