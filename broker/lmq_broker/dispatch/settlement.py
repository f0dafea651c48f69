"""The one door for settlement: acks, dead letters and offset resets, and what the store holds of them.

Per (queue, group) with lease state, the store holds the commit point, the offsets settled above it (as
runs, ``QueueLeases.acked_above``) and what was handed out above it (``QueueLeases.handouts``: delivery
attempts survive a restart); ``_persisted`` remembers what was last written, so an ack that changes
nothing writes nothing, and writes for one key are serialised (offsets never go backwards) and coalesced
(acks that arrive while a write runs are covered by the next one). A key whose memory differs from the store
after a failed write is *dirty*: it keeps its lease state (a fresh state would re-read the stale commit point
and hand acked messages out again), the ack is answered with the error, and the write is retried by the next
ack, by housekeeping and by ``resync``. A hand-out is never written on the reply path: it notes its key
(``handed_out``), and one background pass ``HANDOUT_WRITE_DELAY_MS`` later commits each noted key whose
memory still differs from the store (an ack meanwhile wrote it already, in its own commit: then nothing). A
crash within that delay forgets those hand-outs, so their next attempt is understated by one. Idle keys drop
their lease state; their commit point stays cached
(``_committed``), since this broker is the only writer of offsets while it serves the key (with replication, a
follower's store takes the holder's commit points: ``copied_in`` drops what memory keeps of such a key).

The store's index may be replaced while serving (a rebuild from the log): cached commit points are dropped,
and lease state with leases out or unpersisted acks is *unverified* until it was checked against the rebuilt
index (``_verify``). Settlement tells the delivery side what it needs to know through ``Deliveries``
(a key has work again; is a delivery using a key right now), never by reaching into its state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Final, Protocol

from lmq_broker import caches, errors, model
from lmq_broker.dispatch import leases, offsets, reclaims, runtime
from lmq_broker.dispatch.leases import LeaseKey
from lmq_broker.storage import keys, ranges

log = logging.getLogger(__name__)

COMMITTED_CACHE_SIZE: Final = 100_000  # topics whose idle commit points are remembered
# (queue, group, offset, acked above it, hand-outs above it) -> the copy's future (``committed`` below)
Committed = Callable[[model.QueueId, str, int, Sequence[int], model.Handouts], asyncio.Future[None] | None]
HANDOUT_WRITE_DELAY_MS: Final = 5  # a hand-out is persisted this long after it, unless an ack wrote it first
HANDOUT_WRITES_PER_YIELD: Final = 64  # keys a background hand-out pass commits between two yields to the loop
RESET_COPY_WAIT_S: Final = 3.0  # an offset reset waits this long at most for its commit copies (as a send does)
RESET_COPY_RETRY_S: Final = 0.1  # between two tries of a reset's copies meanwhile
RECOPY_INTERVAL_S: Final = 0.5  # a reset's copy left to the background (``copy_later``) is tried this often
UNCOPIED_MAX: Final = 100_000  # keys whose reset waits to be copied again in the background, at most


class Deliveries(Protocol):
    """The delivery side, as settlement sees it."""

    def delivering(self, key: LeaseKey) -> bool:
        """Is a receive reading or leasing ``key`` right now?"""
        ...

    def ready_again(self, key: LeaseKey, *, prefer: str = "") -> None:
        """``key`` may have something to hand out (an ack or a dead letter left more behind)."""
        ...


class Settlement:
    deliveries: Deliveries  # wired by the dispatcher once the delivery side exists

    def __init__(
        self,
        rt: runtime.Runtime,
        table: leases.LeaseTable,
        dead_letter: Callable[[str, Sequence[model.StoredMessage]], Awaitable[None]],
        on_index_replaced: Callable[[], None],
    ) -> None:
        self._rt = rt
        self._store = rt.store
        self._leases = table
        self._append_dead = dead_letter
        self._on_index_replaced = on_index_replaced
        self._commit_locks: dict[LeaseKey, tuple[asyncio.Lock, list[int]]] = {}
        # Commit points of (queue, group) pairs with nothing in flight, so the next delivery need not read it.
        # topic -> (queue, group) -> commit point
        self._committed: caches.LRU[str, dict[tuple[int, str], int]] = caches.LRU(COMMITTED_CACHE_SIZE)
        # What the store holds for each key with lease state: (commit point, acked above it, hand-outs above it),
        # as last persisted (-1: no commit point stored).
        self._persisted: dict[LeaseKey, tuple[int, ranges.OffsetRanges, model.Handouts]] = {}
        self._handed_out: dict[LeaseKey, None] = {}  # keys whose hand-outs the next background pass writes
        self._handout_timer: asyncio.TimerHandle | None = None
        self.dirty: set[LeaseKey] = set()
        # With replication: told each commit point persisted here (and what was acked and handed out above it), so the
        # slot's followers get it too (lmq_broker.replication); the future, when it gives one, is done once enough
        # followers stored it, and an ack waits for it. None: nobody is told.
        self.committed: Committed | None = None
        # With replication: is this lite topic of a slot this broker follows and does not hold? An offset reset
        # asked here (an MQTT session's start at the end at every broker) leaves it alone: a follower's commit
        # points are its holder's, and its own end may be behind the holder's. None: none is.
        self.followed: Callable[[str], bool] | None = None
        self._copying: dict[LeaseKey, asyncio.Future[None]] = {}  # the newest commit copy per key, until stored
        self._uncopied: dict[LeaseKey, None] = {}  # keys whose offset reset is copied again (``_copy_later``)
        self._recopying = False
        # With replication: told of each ack refused because the commit copy it waited for failed (counted there
        # once per ack; a copy nobody waited on, a hand-out write's, refused no client). None: nobody is told.
        self.copy_refused: Callable[[BaseException], None] | None = None
        # With replication: raises ``errors.Fenced`` for a queue whose slot's lease this broker does not hold
        # now, so a deposed owner settles nothing (ack, dead letter, invisibility change). None: every settlement
        # is this broker's to take.
        self.fence: Callable[[model.QueueId], None] | None = None
        # With replication: False for a queue whose slot's lease this broker does not hold now (counted there), so
        # a deposed owner hands nothing out: no lease, no attempt counted. None: every queue is this broker's.
        self.hands_out: Callable[[model.QueueId], bool] | None = None
        self.retrying = False
        self._generation = rt.store.index_generation()
        self._unverified: set[LeaseKey] = set()  # lease state kept across an index replacement, not yet clipped
        # The compare-and-delete mark on a lite topic, if any (wired by the dispatcher): an offset write of a
        # marked topic waits for the delete (``commit``).
        self.reclaim_of: Callable[[str], reclaims.Mark | None] = _no_reclaim
        self._after_reclaim: dict[LeaseKey, int] = {}  # keys whose writes wait for a delete: their state stays

    # --- acks and dead letters ------------------------------------------------------------------------------
    def check_fence(self, queue: model.QueueId) -> None:
        """``errors.Fenced`` when replication says this broker no longer holds the lease of ``queue``'s slot: a
        deposed owner changes no consumer state (the new owner's is the one that counts)."""
        if self.fence is not None:
            self.fence(queue)

    async def ack(self, group: str, receipt_handle: str, *, client_id: str = "", dead_lettered: bool = False) -> None:
        """``dead_lettered``: the message's copy is in its DLQ (``dead_letter``, which checked the handle before
        storing it): settled even if its lease ran out or went to another consumer while the copy was stored
        (not delivered again beside its dead letter)."""
        receipt, key = self._leases.resolve(receipt_handle, group)
        self.check_fence(key.queue_id)
        self.check_generation()
        state = self._leases.get(key)
        if state is not None and key in self._unverified:
            await self._verify(key, state)  # raises while the store cannot say: the client retries the ack
        changed = self._leases.ack(key, receipt, self._rt.clock(), checked=dead_lettered)
        state = self._leases.get(key)
        if state is None or not (changed or key in self.dirty):
            # Nothing new, and what memory holds is persisted; its copy may still be under way (this ack sent
            # again while the first waits for it): answered only once the followers hold it, as the first is
            copying = self._copying.get(key)
            if copying is not None:
                await self._copied(copying)
            return
        hi = await self.commit(key, state)  # raises when the write failed: the client learns the ack is not in
        copying = self._copying.get(key)
        if copying is not None:  # the followers' copy of this commit point (or of a newer one) is in too
            await self._copied(copying)
        else:  # no copy made: none needed, or the slot's lease was lost while the write waited (then none is made)
            self.check_fence(key.queue_id)
        if key in self.dirty and not self._is_persisted(key, receipt.offset):
            raise errors.TooManyRequests(
                f"too many acknowledged ranges above the commit point of {key.topic} to persist "
                f"(at most {keys.ACKED_MAX_RUNS}); the ack is kept in memory, retry it once earlier messages are acked"
            )
        if state.has_ready(self._rt.clock(), hi):
            self.deliveries.ready_again(key, prefer=client_id)
        self.release(key)

    async def _copied(self, copying: asyncio.Future[None]) -> None:
        try:
            await asyncio.shield(copying)
        except errors.LmqError as exc:
            if self.copy_refused is not None:
                self.copy_refused(exc)
            raise

    async def dead_letter(self, group: str, receipt_handle: str) -> None:
        """The client gave up on a message (ForwardMessageToDeadLetterQueue): store it in ``%DLQ%<group>``."""
        receipt, key = self._leases.resolve(receipt_handle, group)
        self.check_fence(key.queue_id)  # before the dead letter is stored: nothing of it at a deposed owner
        state = self._leases.get(key)
        lease = state.entries.get(receipt.offset) if state is not None else None
        if state is not None and state.predates(receipt):
            return  # settled before this state was opened, or gone with its (since re-created) lite topic
        if state is None or lease is None or state.lost(receipt) or key in self._unverified:
            if state is None or receipt.offset < state.committed:
                return  # already settled
            raise errors.InvalidReceiptHandle("receipt handle names a message that is not out")
        leases.current(state, receipt, self._rt.clock())  # not another delivery's message, nor one due again
        messages = await self._rt.run(self._store.read, key.queue_id, receipt.offset, 1)
        if messages and messages[0].offset == receipt.offset:
            await self._append_dead(group, messages[:1])
        await self.ack(group, receipt_handle, dead_lettered=True)

    async def settle_dead(
        self, key: LeaseKey, state: leases.QueueLeases, dead: list[tuple[leases.Pick, model.StoredMessage]]
    ) -> None:
        """Messages past their group's last attempt: into the DLQ, then settled as if acknowledged."""
        await self._append_dead(key.group, [m for _, m in dead])
        await self.settle_passed(key, state, [pick for pick, _ in dead])

    async def settle_passed(self, key: LeaseKey, state: leases.QueueLeases, picks: list[leases.Pick]) -> None:
        """Settle ``picks`` as if acknowledged without handing them out (dead-lettered, or not taken by the
        receiver's tag filter), and persist the commit point."""
        self.pass_over(state, picks)
        await self.persist(key, state)

    def pass_over(self, state: leases.QueueLeases, picks: list[leases.Pick]) -> None:
        """Settle ``picks`` in memory (no await: nothing can change ``state`` between the picking and this)."""
        now = self._rt.clock()
        for pick in picks:
            state.lease(pick, now, 0, self._leases.new_lease_id(), "")
        for pick in picks:
            state.ack(pick.offset)

    async def persist(self, key: LeaseKey, state: leases.QueueLeases) -> None:
        """``commit``, a failure left to the retries."""
        with contextlib.suppress(errors.StorageError):  # dirty now: retried by housekeeping and ``resync``
            await self.commit(key, state)

    def settle_gone(
        self, key: LeaseKey, state: leases.QueueLeases, first: int, end: int, messages: list[model.StoredMessage]
    ) -> bool:
        """Offsets in [first, end) that the store read passed over are gone (a damaged record, a lost
        segment; the store has reported them): settle them so that the rest of the queue flows and the commit
        point can pass them. True when anything was settled."""
        skipped: list[tuple[int, int]] = []  # the spans settled, [start, end)
        at = max(first, state.committed)
        for m in messages:
            if m.offset >= end:
                break  # never settle beyond the span the store vouched for
            if m.offset > at:
                state.settle_gone(at, m.offset)
                skipped.append((at, m.offset))
            at = max(at, m.offset + 1)
        if end > at:
            state.settle_gone(at, end)
            skipped.append((at, end))
        if skipped:
            log.warning("%s queue %d group %s: gone from the store, passed over: %s", *key, _spans(skipped))
        return bool(skipped)

    async def reset_offsets(
        self,
        lmqs: list[str],
        group: str,
        option: offsets.OffsetReset,
        ends: Sequence[int] | None = None,
        *,
        copy_later: bool = False,
    ) -> None:
        """OffsetOption on subscribe: in-flight state and cached commit points are superseded by the reset. With
        replication it is answered once the followers stored it (``_copy_reset``); ``copy_later`` (an MQTT start
        at the end): when they cannot, it is answered all the same and copied again in the background."""
        if self.followed is not None:  # their holder's reset reaches this store as its commit copies
            kept = [i for i, lmq in enumerate(lmqs) if not self.followed(lmq)]
            lmqs, ends = [lmqs[i] for i in kept], None if ends is None else [ends[i] for i in kept]
        lease_keys = [LeaseKey(lmq, 0, group) for lmq in lmqs]
        if any(map(self.deliveries.delivering, lease_keys)):
            raise errors.TooManyRequests("offsets of a lite topic being delivered cannot be reset now")
        for key in lease_keys:
            self._leases.forget(key)
            self._committed.get(key.topic, {}).pop((0, group), None)
            self._persisted.pop(key, None)
            self.dirty.discard(key)  # the reset supersedes whatever was not persisted
        moved = await self._rt.run(offsets.reset, self._store, lmqs, group, option, ends)
        await self._copy_reset(moved, copy_later)

    async def _copy_reset(self, moved: list[tuple[model.QueueId, str, int]], copy_later: bool) -> None:
        """Send the commit points a reset wrote to the followers of their slots, and wait until they stored them
        (a follower that takes over then starts where the reset said). A copy refused for too few in-sync
        replicas is sent again, the point as the store holds it then, until ``RESET_COPY_WAIT_S`` (a member
        back or joining meanwhile stores it). What still failed then (or at once: the lease lost meanwhile)
        refuses the reset, as an ack is refused: the caller is told to try again, not OK while a takeover could
        serve the point from before it. The reset stays written here either way. ``copy_later`` (an MQTT
        start at the end, docs/replication.md *Offset resets*): the reset is answered all the same, a refusal
        for too few replicas logged and its keys copied again in the background until stored (``_copy_later``),
        a lost lease left to the new holder (the SUBSCRIBE's fan-out starts the session at its end there too):
        a SUBSCRIBE refused would drop the session's new filters, and MQTT clients do not subscribe again."""
        committed = self.committed
        if committed is None:
            return
        deadline = time.monotonic() + RESET_COPY_WAIT_S
        copying = {
            LeaseKey(q.topic, q.queue, g): committed(q, g, offset, (), model.NO_HANDOUTS) for q, g, offset in moved
        }
        failed, tries, fenced = await _failures(copying), 0, None
        while failed:
            fenced = next((e for e in failed.values() if isinstance(e, errors.Fenced)), None)
            if fenced is not None or time.monotonic() + RESET_COPY_RETRY_S >= deadline:
                break
            await asyncio.sleep(RESET_COPY_RETRY_S)
            keys, turn = list(failed), tries % len(failed)  # another key first each time (``_again``)
            failed = await self._again(keys[turn:] + keys[:turn])
            tries += 1
        if not failed:
            return
        error = fenced or next(iter(failed.values()))
        if copy_later:  # a topic whose lease was lost: its new holder starts the session (the SUBSCRIBE's fan-out)
            later = [key for key, e in failed.items() if not isinstance(e, errors.Fenced)]
            log.warning("an offset reset's commit copy failed (%s): answered; %d of %d topics copied again later",
                        error, len(later), len(failed))  # fmt: skip
            self._copy_later(later)
            return
        if fenced is not None:
            raise errors.Fenced(f"the offset reset is not in force (written here, but {fenced}); try it again")
        if isinstance(error, errors.NotEnoughReplicas):
            raise errors.NotEnoughReplicas(
                f"the offset reset is not stored by enough in-sync replicas within {RESET_COPY_WAIT_S:g} s (written "
                f"here; a takeover could start from before it): {error.message}"
            )
        raise errors.BrokerUnavailable(f"the offset reset's commit copy failed (written here): {error}; try it again")

    async def _copy_current(self, key: LeaseKey) -> asyncio.Future[None] | None:
        """Copy ``key``'s commit point as the store holds it now (a commit made since the reset is not undone at
        the followers), in turn with the key's commits; None when nothing is to be copied (no point). Called
        only for a key copied before (its slot was this broker's then): a slot not held now fails as fenced,
        never as nothing to copy (the reset would be answered OK while its new holder never had it)."""
        async with self._writing(key):
            point = await self._rt.run(self._stored_point, key.queue_id, key.group)
            committed = self.committed
            if point is None or committed is None:
                return None
            copy = committed(key.queue_id, key.group, *point)
            if copy is None:
                lost = asyncio.get_running_loop().create_future()
                lost.set_exception(errors.Fenced(f"{key.topic}: this broker no longer holds its slot's lease"))
                return lost
            return copy

    def _stored_point(self, queue: model.QueueId, group: str) -> tuple[int, Sequence[int], model.Handouts] | None:
        """Blocking: the commit point, acked and handed out above it; None without a point."""
        offset = self._store.get_offset(queue, group)
        if offset is None:
            return None
        return offset, self._store.get_acked(queue, group), self._store.get_handouts(queue, group)

    def _copy_later(self, keys: Iterable[LeaseKey]) -> None:
        """Copy these keys' commit points again in the background, every ``RECOPY_INTERVAL_S``, until stored or
        no longer this broker's to copy (at most ``UNCOPIED_MAX`` keys wait: a slot short of in-sync replicas for
        long and a flood of new subscriptions; those past it are logged and left to the next commit)."""
        for key in keys:
            if len(self._uncopied) >= UNCOPIED_MAX:
                log.warning("%s queue %d group %s: offset reset not copied again (too many waiting)", *key)
                continue
            self._uncopied[key] = None
        if not self._recopying and self._uncopied and not self._rt.closed:
            self._recopying = True
            self._rt.spawn(self._recopy())

    async def _recopy(self) -> None:
        try:
            while self._uncopied:
                await asyncio.sleep(RECOPY_INTERVAL_S)
                keys = list(self._uncopied)
                failed = await self._again(keys)
                for key in keys:
                    error = failed.get(key)
                    if error is None or isinstance(error, errors.Fenced):  # the lease lost: the new holder's counts
                        self._uncopied.pop(key, None)
                    elif key == keys[0]:  # another key goes first next time
                        del self._uncopied[key]
                        self._uncopied[key] = None
                if len(failed) < len(keys):
                    log.info("offset resets copied again: %d of %d", len(keys) - len(failed), len(keys))
        finally:
            self._recopying = False

    async def _again(self, keys: list[LeaseKey]) -> dict[LeaseKey, BaseException]:
        """Copy ``keys`` again (``_copy_current``), the first alone first: while it fails for too few in-sync
        replicas the rest are not sent and count as failed with it (a round costs one copy while the set is
        short, not one per key; callers put another key first each time, so a key of another slot is not held
        back for good); one fenced (its slot's lease lost) fails alone. Those that failed, with why."""
        first, *rest = keys
        failed = await _failures({first: await self._copy_current(first)})
        if failed and isinstance(failed[first], errors.NotEnoughReplicas):
            return dict.fromkeys(keys, failed[first])
        return failed | await _failures({key: await self._copy_current(key) for key in rest})  # fenced: key by key

    @property
    def uncopied(self) -> int:
        """Keys whose offset reset waits to be copied again (``copy_later``)."""
        return len(self._uncopied)

    # --- lease state: opened from what the store holds, dropped when idle ------------------------------------
    async def state_of(self, key: LeaseKey, ordered: bool) -> leases.QueueLeases:
        """The key's lease state: opened from the commit point (cached, else read with the acks above it), or
        the existing one, clipped to its queue first if the store's index was replaced since (``_verify``)."""
        state = self._leases.get(key)
        if state is not None:
            if key in self._unverified:
                await self._verify(key, state)
            return state
        cached = self._committed.get(key.topic, {}).get((key.queue, key.group))
        acked: Sequence[int] = ()
        handouts, end = model.NO_HANDOUTS, -1
        stored: int | None = cached
        if cached is None:  # first use since start: what was committed, and acked and handed out above it
            committed, end, stored, acked, handouts = await self._rt.run(self._progress, key.queue_id, key.group)
        else:
            committed = cached
        state = self._leases.open(key, committed, ordered)
        state.seed(acked, handouts, end)
        self._persisted[key] = (-1 if stored is None else stored, ranges.OffsetRanges.of(acked), handouts)
        return state

    def release(self, key: LeaseKey) -> None:
        """Drop an idle key's lease state, unless a delivery or an offset write is still using it (a fresh
        state would re-read a commit point that is not persisted yet)."""
        state = self._leases.get(key)
        if state is None or not state.idle:
            return
        if (
            key not in self._commit_locks
            and key not in self.dirty
            and key not in self._after_reclaim
            and not self.deliveries.delivering(key)
        ):
            self._leases.forget(key)
            self._persisted.pop(key, None)
            self._unverified.discard(key)

    def copied_in(self, queue: model.QueueId, group: str) -> None:
        """Replication stored the commit point of ``queue`` and ``group`` of the holder of the queue's slot here
        (this broker follows that slot): what memory keeps of the key, from an earlier holding of the slot by
        this broker, is no longer the store's. Dropped, so that once this broker holds the slot again the key is
        read from the store (a commit point remembered from before served it from there: what was acked at the
        other holder meanwhile was handed out again), and no write retried from memory goes over the copy."""
        key = LeaseKey(queue.topic, queue.queue, group)
        cached = self._committed.get(queue.topic)
        if cached is not None:
            cached.pop((queue.queue, group), None)
        self._leases.drop(key)
        self._persisted.pop(key, None)
        self.dirty.discard(key)
        self._unverified.discard(key)

    def forget_topic(self, topic: str) -> None:
        """A deleted lite topic: its lease state and offsets are gone (the store drops its offsets)."""
        self._leases.drop_topic(topic)
        self._committed.pop(topic, None)
        for key in [k for k in self._persisted if k.topic == topic]:
            del self._persisted[key]
        self.dirty.difference_update([k for k in self.dirty if k.topic == topic])

    def offsets(self, queue: model.QueueId, group: str) -> tuple[int, int, int | None, Sequence[int]]:
        """Blocking: (min offset, max offset, commit point, acked above it)."""
        lo, hi = self._store.queue_offsets(queue)
        return lo, hi, self._store.get_offset(queue, group), self._store.get_acked(queue, group)

    def _progress(self, queue: model.QueueId, group: str) -> tuple[int, int, int | None, Sequence[int], model.Handouts]:
        """Blocking: where the group starts (its commit point, at least the queue's first offset), then as
        ``offsets`` and the hand-outs above the commit point. In a queue that is not a lite topic, a group that
        has a commit point starts at least where a leaving broker's copy of it got to (``cluster.relocating``):
        every message below is at a remaining broker, or was consumed by every group with a point here when it
        was copied, so a broker kept after a cancelled scale-down (or back on its volume) does not deliver the
        copies' originals again. A group without a point starts at the first offset, as before."""
        lo, hi, stored, acked = self.offsets(queue, group)
        start = lo if stored is None else max(lo, stored)
        if stored is not None and not queue.is_lmq:
            start = max(start, self._store.relocated(queue))
        return start, hi, stored, acked, self._store.get_handouts(queue, group)

    # --- offset writes --------------------------------------------------------------------------------------
    async def commit(self, key: LeaseKey, state: leases.QueueLeases) -> int:
        """Persist the commit point and the offsets acked above it, if memory differs from what was last
        persisted; writes for one key are serialised so offsets never go backwards. Returns the queue's max
        offset. When the write fails the key stays dirty (see ``_persisted``) and the error propagates.

        While a compare-and-delete has the key's lite topic marked, the write waits for it; if the topic was
        deleted, nothing is written (nor copied, nor cached): the offsets of ``state`` are those of the deleted
        topic, and a send may already have re-created it from offset 0 (see ``reclaims``)."""
        if self.reclaim_of(key.topic) is not None:
            await self._reclaim_over(key)
        if state.gone:
            return self._store.queue_offsets(key.queue_id)[1]
        async with self._writing(key):
            target = state.committed
            acked = state.acked_above()
            handouts = state.handouts()
            complete = len(acked.runs) <= keys.ACKED_MAX_RUNS
            if not complete:  # over the cap: the oldest runs, the rest stays dirty (see ``ack``)
                acked = ranges.OffsetRanges(acked.runs[: keys.ACKED_MAX_RUNS])
                self.dirty.add(key)
            queue = key.queue_id
            if (target, acked, handouts) != self._persisted.get(key):
                self.dirty.add(key)
                # On the loop when no writer holds the store (two small index writes cost less than the
                # hop, which waits for the GIL behind whatever the loop does next); else on the pool.
                if self._store.try_commit_offset(queue, key.group, target, acked, handouts):
                    hi = self._store.queue_offsets(queue)[1]
                else:
                    hi = await self._rt.run(self._commit_and_max, queue, key.group, target, acked, handouts)
                self._persisted[key] = (target, acked, handouts)
                if self.committed is not None:
                    self._copy(key, self.committed(queue, key.group, target, acked, handouts))
                if complete:
                    self.dirty.discard(key)  # a change made meanwhile has its own commit waiting on the lock
                self._remember_commit(key, target)
            else:
                hi = self._store.queue_offsets(queue)[1]  # the cached queue state: no I/O once loaded
            return hi

    async def _reclaim_over(self, key: LeaseKey) -> None:
        self._after_reclaim[key] = self._after_reclaim.get(key, 0) + 1
        try:
            while (mark := self.reclaim_of(key.topic)) is not None:
                await mark.done.wait()
        finally:
            self._after_reclaim[key] -= 1
            if not self._after_reclaim[key]:
                del self._after_reclaim[key]

    def writes_under_way(self, topics: frozenset[str]) -> list[asyncio.Lock]:
        """The locks of the offset writes of ``topics`` in progress or waiting (``reclaims.Mark.writes``)."""
        return [lock for key, (lock, _) in self._commit_locks.items() if key.topic in topics]

    @contextlib.asynccontextmanager
    async def _writing(self, key: LeaseKey) -> AsyncIterator[None]:
        """One offset write (and its copy) of ``key`` at a time: offsets never go backwards, here or at the
        followers; the key counts as being written (``release`` keeps its state) while anyone waits."""
        entry = self._commit_locks.get(key)
        if entry is None:
            entry = self._commit_locks[key] = (asyncio.Lock(), [0])  # [users]
        lock, counters = entry
        counters[0] += 1
        try:
            async with lock:
                yield
        finally:
            counters[0] -= 1
            if counters[0] == 0:
                del self._commit_locks[key]

    def _copy(self, key: LeaseKey, copying: asyncio.Future[None] | None) -> None:
        """Keep the newest commit copy of ``key`` for the acks to wait on: forgotten once stored; one that failed
        makes the key dirty (the followers' store is behind), so the client's retry of the ack writes it again."""
        if copying is None:
            return
        self._copying[key] = copying

        def done(future: asyncio.Future[None]) -> None:
            if future.cancelled() or future.exception() is not None:
                if self._copying.get(key) is future:
                    self._persisted.pop(key, None)
                    self.dirty.add(key)
            elif self._copying.get(key) is future:
                del self._copying[key]

        copying.add_done_callback(done)

    def _is_persisted(self, key: LeaseKey, offset: int) -> bool:
        committed, acked, _ = self._persisted.get(key, (-1, ranges.EMPTY, model.NO_HANDOUTS))
        return offset < committed or offset in acked

    # --- hand-outs: one coalesced background write ----------------------------------------------------------
    def handed_out(self, key: LeaseKey) -> None:
        """``key`` handed messages out (or a suspend or nack changed an attempt count): have its hand-outs
        persisted by the next background pass, ``HANDOUT_WRITE_DELAY_MS`` from the first such note. O(1)."""
        self._handed_out[key] = None
        if self._handout_timer is None and not self._rt.closed:
            delay_s = HANDOUT_WRITE_DELAY_MS / 1000
            self._handout_timer = asyncio.get_running_loop().call_later(delay_s, self._handouts_due)

    def _handouts_due(self) -> None:
        self._handout_timer = None
        if not self._rt.closed:
            self._rt.spawn(self.write_handouts())

    async def write_handouts(self) -> None:
        """Commit every noted key whose memory differs from what was persisted (an ack that came first wrote
        the hand-outs with its commit point: nothing to do). A failed write leaves the key dirty (retried)."""
        if self._handout_timer is not None:
            self._handout_timer.cancel()
            self._handout_timer = None
        noted, self._handed_out = self._handed_out, {}
        for i, key in enumerate(noted):
            if i and not i % HANDOUT_WRITES_PER_YIELD:
                await asyncio.sleep(0)  # a commit on the loop awaits nothing: let receives and acks in meanwhile
            state = self._leases.get(key)
            if state is None or key in self._unverified:
                continue  # released (idle: its ack wrote what there is), or verified (and committed) first
            persisted = self._persisted.get(key)
            if persisted is not None and persisted == (state.committed, state.acked_above(), state.handouts()):
                continue
            await self.persist(key, state)
            self.release(key)

    async def retry_commits(self) -> None:
        """Persist what failed to persist earlier (housekeeping, ``resync``); a key still refused stays dirty."""
        if self.retrying:
            return
        self.retrying = True
        try:
            for key in list(self.dirty):
                state = self._leases.get(key)
                if state is None:
                    self.dirty.discard(key)
                    self._copying.pop(key, None)
                    continue
                try:
                    if key in self._unverified:
                        await self._verify(key, state)
                    hi = await self.commit(key, state)
                except errors.LmqError as exc:
                    log.warning("%s queue %d group %s: commit still refused (%s); retried later", *key, exc.message)
                    continue
                if state.has_ready(self._rt.clock(), hi):
                    self.deliveries.ready_again(key)
                self.release(key)
        finally:
            self.retrying = False

    def _remember_commit(self, key: LeaseKey, offset: int) -> None:
        per_topic = self._committed.touch(key.topic)
        if per_topic is None:
            per_topic = self._committed.put(key.topic, {})
        per_topic[(key.queue, key.group)] = offset

    def _commit_and_max(
        self, queue: model.QueueId, group: str, offset: int, acked: Sequence[int], handouts: model.Handouts
    ) -> int:
        self._store.commit_offset(queue, group, offset, acked, handouts)
        return self._store.queue_offsets(queue)[1]

    # --- the store's index replaced while serving -----------------------------------------------------------
    def check_generation(self) -> int:
        """The store's index generation, handling a change first (one int read: called wherever reads happen,
        so a rebuild that began and ended between two health polls is not missed)."""
        generation = self._store.index_generation()
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
        settled offsets at or above the end are forgotten and their handles refused). Then ``on_index_replaced``
        (the recent-message cache is dropped and every client caught up)."""
        log.warning("the store's index was replaced (generation %d): dispatch caches dropped", self._generation)
        self._committed.clear()
        for key, state in self._leases.states():
            if state.entries or key in self.dirty or key in self._commit_locks or self.deliveries.delivering(key):
                self._unverified.add(key)
            else:
                self._leases.forget(key)
                self._persisted.pop(key, None)
        self._on_index_replaced()

    async def _verify(self, key: LeaseKey, state: leases.QueueLeases) -> None:
        """Bring a state kept across an index replacement in line with the store: each lease out must still
        name the message at its offset (else it is dropped and its handle refused: the offset is handed out
        again); settlement the store refused (a dirty key: those acks were answered with the error) goes back
        to what was persisted; nothing may lie at or above the queue's end."""
        out = list(state.entries)
        lo, hi, ids = await self._rt.run(self._message_ids, key.queue_id, out)
        if key not in self._unverified or self._leases.get(key) is not state:
            return  # verified meanwhile (or forgotten)
        self._unverified.discard(key)
        floor = self._leases.next_lease_id
        entries = state.entries
        lost = [o for o in out if o in entries and entries[o].message_id != ids.get(o)]
        state.drop_leases(lost, floor)
        persisted = self._persisted.get(key)
        rolled_back = key in self.dirty and persisted is not None and key not in self._commit_locks
        if rolled_back and persisted is not None:
            state.rollback(persisted[0] if persisted[0] >= 0 else lo, persisted[1])
            self.dirty.discard(key)
        state.clip(hi, floor)
        if lo > state.committed:
            state.skip_to(lo)
        if lost or rolled_back:
            note = "; refused acks forgotten" if rolled_back else ""
            log.warning("%s queue %d group %s: %d leases named messages the rebuilt index no longer holds there%s",
                        *key, len(lost), note)  # fmt: skip
            if state.has_ready(self._rt.clock(), hi):
                self.deliveries.ready_again(key)

    def _message_ids(self, queue: model.QueueId, out: list[int]) -> tuple[int, int, dict[int, str]]:
        lo, hi = self._store.queue_offsets(queue)
        ids: dict[int, str] = {}
        for offset in out:
            messages, _ = self._store.read_span(queue, offset, 1)
            if messages and messages[0].offset == offset:
                ids[offset] = messages[0].message_id
        return lo, hi, ids


def _spans(spans: list[tuple[int, int]]) -> str:
    """``[(3, 4), (7, 10)]`` -> ``"offset 3, offsets 7-9"``: exactly what was skipped."""
    return ", ".join(f"offset {a}" if b == a + 1 else f"offsets {a}-{b - 1}" for a, b in spans)


async def _failures(copying: dict[LeaseKey, asyncio.Future[None] | None]) -> dict[LeaseKey, BaseException]:
    """Once every copy is done: those that failed, with why (a cancelled one as unavailable)."""
    waits = [f for f in copying.values() if f is not None]
    if waits:
        await asyncio.wait(waits)  # not gather: a cancelled reset leaves the copies' futures alone
    failed: dict[LeaseKey, BaseException] = {}
    for key, f in copying.items():
        if f is None:
            continue
        if f.cancelled():
            failed[key] = errors.BrokerUnavailable("the commit copy was cancelled")
        elif (exc := f.exception()) is not None:
            failed[key] = exc
    return failed


def _no_reclaim(topic: str) -> reclaims.Mark | None:
    return None
