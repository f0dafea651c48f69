"""Who owns each slot: one Kubernetes Lease per slot, renewed by its holder, taken over by an in-sync follower.

The holder acknowledges only while its last successful renewal *began* less than ``duration * FENCE_SHARE``
ago on its own monotonic clock. A candidate sees a lease expire only once its resourceVersion stayed the same
for a whole duration on *its* clock (client-go's rule), counted from when its read *answered* with that version
(never from when the read began: a slow read may have begun before the renewal it returns), which is after that
renewal began: the deposed holder has stopped acknowledging before anyone can take its lease. The lease's
``leaseTransitions`` is the slot's replication epoch; copies carry it and followers refuse older ones.

The lease also records the slot's *in-sync replicas* (``kube.IN_SYNC``, Kafka's ISR), written by its holder
only (``record``, with the resourceVersion it last wrote, like a renewal): a follower takes an expired lease
over only when it is in that set, and it drops the deposed holder from it. Writes of one slot are serialized
here, so a renewal never races the holder's own change of the set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final, Protocol

from lmq_broker.replication import kube

log = logging.getLogger(__name__)

FENCE_SHARE: Final = 2 / 3  # renewals run every third of a duration: one may fail without a gap
TICK_GAP_MIN_S: Final = 0.01  # after a tick that took a third of a duration or more: the next one at once
Clock = Callable[[], float]


InSync = tuple[int, ...]  # ring slots (brokers) of a slot's in-sync replicas, sorted
Drain = Callable[[int, InSync], Awaitable[bool]]  # (epoch, in-sync set) -> its queued copies stored there
# The holder a released lease names (``release``): its releaser, fenced before it wrote it. Not the empty holder:
# a lease a person cleared by hand gives no such promise, so it is taken only once expired.
RELEASED: Final = "released/"


class LeaseApi(Protocol):
    def list_named(self, prefix: str) -> list[kube.Lease]: ...  # every lease whose name starts with ``prefix``
    def create(self, name: str, holder: str, duration_s: int, in_sync: InSync | None = None) -> kube.Lease: ...
    def write(
        self, lease: kube.Lease, holder: str, transitions: int, duration_s: int, in_sync: InSync | None = None
    ) -> kube.Lease: ...


@dataclass(slots=True)
class _Seen:
    version: str
    since: float  # when this broker first saw ``version``
    declined: str = ""  # the version it said it would not take (logged once)


def identity(slot: int, unique: str) -> str:
    return f"slot-{slot}/{unique}"


def slot_of_identity(holder: str) -> int:
    """The slot of a holder named by ``identity``; -1 for another name (a person's forced takeover)."""
    head = holder.partition("/")[0]
    number = head.removeprefix("slot-")
    return int(number) if head.startswith("slot-") and number.isdigit() else -1


class Leadership:
    def __init__(  # noqa: PLR0913 (the slot ring, the lease's settings and the clock)
        self,
        api: LeaseApi,
        identity: str,
        me: int,
        replica_sets: list[list[int]],
        in_sync: Callable[[int, int], bool],
        *,
        prefix: str,
        duration_ms: int,
        min_insync: int = 1,
        clock: Clock = time.monotonic,
    ) -> None:
        self._api = api
        self.identity = identity
        self.me = me
        self.replica_sets = replica_sets  # per slot: its replicas, its preferred owner first
        self.mine = [slot for slot, replicas in enumerate(replica_sets) if me in replicas]
        self.holders: dict[int, str] = {}  # slot -> holder identity as last read (routes follow it)
        self._in_sync = in_sync  # (slot, epoch) -> this broker has every copy of that epoch
        self._prefix = prefix
        self._duration = duration_ms / 1000
        self._duration_s = max(1, math.ceil(self._duration))
        self._clock = clock
        self._min_insync = min_insync  # a takeover keeps the deposed holder in the set rather than go below it
        self._held: dict[int, tuple[kube.Lease, float]] = {}  # slot -> (lease as written, renewal began)
        self._seen: dict[int, _Seen] = {}
        self.epochs: dict[int, int] = {}  # slot -> newest epoch seen (followers refuse older copies)
        self.in_sets: dict[int, InSync | None] = {}  # slot -> its in-sync replicas as last read or written
        self.takeovers = 0
        self.releases = 0
        # A slot this broker must not take (its pod is being removed: it hands slots over, step 5 of a ring
        # change, and takes none back); set by ``setup`` from the membership
        self.may_take: Callable[[int], bool] = lambda slot: True
        self._locks: dict[int, asyncio.Lock] = {}  # one write at a time per slot (renewal, set change, takeover)

    def follow(self, replica_sets: list[list[int]]) -> None:
        """Another ring's replica sets (``replicas.sets_of``): the slots this broker is a replica of, whose
        leases it writes, follow them from the next tick; a new slot's lease is created by its owner then."""
        self.replica_sets = replica_sets
        self.mine = [slot for slot, replicas in enumerate(replica_sets) if self.me in replicas]
        known = (self.epochs, self.in_sets, self.holders, self._seen)
        for removed in {slot for seen in known for slot in seen if slot >= len(replica_sets)}:
            # A slot the ring no longer has (a scale-down removed it; its Lease is deleted then): what was seen of
            # it goes, so a later scale-up that brings its number back starts it afresh (its new Lease's epochs
            # begin again, and copies of them must not be refused as older than the removed slot's)
            for seen in known:
                seen.pop(removed, None)

    def name(self, slot: int) -> str:
        return f"{self._prefix}-slot-{slot}"

    def epoch(self, slot: int) -> int | None:
        """The epoch this broker may acknowledge sends of ``slot`` under right now, else None (fenced)."""
        held = self._held.get(slot)
        if held is None or self._clock() - held[1] >= self._duration * FENCE_SHARE:
            return None
        return held[0].transitions

    def holds(self, slot: int) -> bool:
        return slot in self._held

    def held(self) -> list[int]:
        return list(self._held)

    def in_sync(self, slot: int) -> InSync:
        """The in-sync replicas of a slot this broker holds, as written in its lease; () when not held."""
        held = self._held.get(slot)
        return () if held is None else held[0].in_sync or ()

    async def record(self, slot: int, change: Callable[[InSync], InSync]) -> InSync | None:
        """Write ``change(the set as written)`` as the slot's in-sync replicas (a renewal too): the set now
        recorded, or None when not written (the lease is not held, was taken meanwhile, or the apiserver
        failed: the caller acknowledges nothing that needed it)."""
        async with self._lock(slot):
            held = self._held.get(slot)
            if held is None:
                return None
            lease, began = held[0], self._clock()
            in_sync = tuple(sorted(set(change(lease.in_sync or ()))))
            if lease.in_sync == in_sync:
                return in_sync
            try:
                await self._write(
                    slot,
                    began,
                    lambda: self._api.write(lease, self.identity, lease.transitions, self._duration_s, in_sync),
                )
            except Exception as exc:
                log.warning("lease of slot %d: in-sync replicas %s not recorded: %s", slot, in_sync, exc)
                return None
            return in_sync if self.in_sync(slot) == in_sync else None

    async def release(self, slot: int, drain: Drain | None = None) -> bool:
        """Hand ``slot`` over (this broker's pod is being removed): stop acknowledging first (the slot leaves the
        held set: its fence is closed before anything is written), ``drain`` what is still queued for the in-sync
        set (epoch, set; bounded: ``copies.Owner.drain``), then write the lease as released (holder ``RELEASED`` +
        its identity), the same epoch and the same in-sync set. A follower in that set and reconciled at that
        epoch takes it at the tick that first sees it, without waiting for it to expire (``_visit_locked``):
        nothing acknowledged here after the release, the taker holds everything acknowledged before (at
        --min-insync-replicas 1 once the drain is over: a drain that timed out is logged). True once written (a
        failed write leaves the lease to expire, as after a crash: the fence is closed either way)."""
        async with self._lock(slot):
            held = self._held.pop(slot, None)
            if held is None:
                return False
            lease = held[0]
            if drain is not None and not await drain(lease.transitions, lease.in_sync or ()):
                log.warning("slot %d: released before every copy queued for %s was stored there", slot, lease.in_sync)
            try:
                written = await asyncio.to_thread(
                    self._api.write, lease, RELEASED + self.identity, lease.transitions, self._duration_s, lease.in_sync
                )
            except Exception as exc:
                log.warning("slot %d: lease not released (it expires instead): %s", slot, exc)
                return False
            self.holders.pop(slot, None)
            self.in_sets[slot] = written.in_sync
            self.releases += 1
            log.warning("slot %d: lease released (epoch %d) for a replica that stays", slot, lease.transitions)
            return True

    def _lock(self, slot: int) -> asyncio.Lock:
        found = self._locks.get(slot)
        if found is None:
            found = self._locks[slot] = asyncio.Lock()
        return found

    def serving(self, slot: int) -> int:
        """The slot whose broker holds ``slot``'s lease (where its sends go); ``slot`` itself when unknown."""
        holder = slot_of_identity(self.holders.get(slot, ""))
        return holder if 0 <= holder < len(self.replica_sets) else slot

    async def run(self, stopping: asyncio.Event, after: Callable[[], Awaitable[None]] | None = None) -> None:
        """A tick every third of a duration from when the last one *began*: a slow tick (a loaded apiserver)
        delays the next renewal by nothing more, so one renewal may still fail before the fence closes.
        ``after`` runs after each tick (the replica sets follow the in-sync sets just read)."""
        while not stopping.is_set():
            began = self._clock()
            await self.tick()
            if after is not None:
                try:
                    await after()
                except Exception:  # never the lease loop's end: its renewals are the fence
                    log.exception("leases: after the tick")
            left = self._duration / 3 - (self._clock() - began)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), max(left, TICK_GAP_MIN_S))

    async def tick(self) -> None:
        """Every slot's lease is read, in one LIST of the release's leases (routes follow their holders); only
        those of this broker's slots are written (renewed, created, taken)."""
        began = self._clock()
        try:
            found = await asyncio.to_thread(self._api.list_named, f"{self._prefix}-slot-")
        except Exception as exc:  # the apiserver is slow or unreachable: the fence closes by itself
            log.warning("leases: %s", exc)
            return
        read = self._clock()  # every version found was written before this (a renewal's began is earlier)
        by_name = {lease.name: lease for lease in found}
        for slot in range(len(self.replica_sets)):
            lease = by_name.get(self.name(slot))
            self._note(slot, lease)
            if slot not in self.mine:
                continue
            try:
                await self._visit(slot, lease, began, read)
            except Exception as exc:  # a write failed: the fence closes by itself
                log.warning("lease of slot %d: %s", slot, exc)

    def _note(self, slot: int, lease: kube.Lease | None) -> None:
        if lease is None or not lease.holder or lease.holder.startswith(RELEASED):
            self.holders.pop(slot, None)
        else:
            self.holders[slot] = lease.holder
        if lease is not None:
            self.in_sets[slot] = lease.in_sync

    async def _visit(self, slot: int, lease: kube.Lease | None, began: float, read: float) -> None:
        """Renew, create or take the lease of one of this broker's slots, as read by the tick that ``began`` then
        and had its answer at ``read``: a renewal counts from ``began`` (earlier than the write), a version seen
        from ``read`` (later than the write), so both err on the side of the fence."""
        async with self._lock(slot):
            await self._visit_locked(slot, lease, began, read)

    async def _visit_locked(self, slot: int, lease: kube.Lease | None, began: float, read: float) -> None:
        if lease is None:
            if slot == self.me:  # a new slot: its owner alone is in sync; followers join once they hold it all
                mine = (self.me,)
                await self._write(
                    slot, began, lambda: self._api.create(self.name(slot), self.identity, self._duration_s, mine)
                )
            return
        self.epochs[slot] = max(self.epochs.get(slot, 0), lease.transitions)
        if lease.holder == self.identity:
            # Renewed as this broker last wrote it (the LIST may predate its own change of the in-sync set).
            held = self._held[slot][0] if slot in self._held else lease
            in_sync = held.in_sync or (self.me,)
            await self._write(
                slot,
                began,
                lambda: self._api.write(held, self.identity, held.transitions, self._duration_s, in_sync),
            )
            return
        if self._held.pop(slot, None) is not None:
            log.warning(
                "slot %d: lease taken by %s (epoch %d): no longer its owner", slot, lease.holder, lease.transitions
            )
        seen = self._seen.get(slot)
        released = lease.holder.startswith(RELEASED)
        if seen is None or seen.version != lease.resource_version:
            seen = self._seen[slot] = _Seen(lease.resource_version, read)
            if not released:  # a released lease is taken at first sight: its holder stopped before writing it
                return
        # A released lease (handed over: ``release``) is taken at once; any other after a whole duration unchanged.
        expired = released or began - seen.since >= self._duration
        if not self.may_take(slot):
            return
        recorded = lease.in_sync is None or self.me in lease.in_sync  # None: a lease written before the set was
        if expired and not recorded and seen.declined != lease.resource_version:
            seen.declined = lease.resource_version
            log.warning(
                "slot %d: the lease of %s expired; not taken: this broker is not in its in-sync set %s",
                slot,
                lease.holder or "nobody",
                lease.in_sync,
            )
        if expired and recorded and self._in_sync(slot, lease.transitions):
            epoch = lease.transitions + 1
            # The deposed holder leaves the set (it rejoins once it holds every copy again), unless that takes the
            # set below --min-insync-replicas: it holds every acknowledged message, so it stays eligible.
            deposed, before = slot_of_identity(lease.holder.removeprefix(RELEASED)), {*(lease.in_sync or ()), self.me}
            after = before - {deposed}
            in_sync = tuple(sorted(after if len(after) >= self._min_insync else before))
            await self._write(
                slot, began, lambda: self._api.write(lease, self.identity, epoch, self._duration_s, in_sync)
            )
            if slot in self._held:
                self.takeovers += 1
                log.warning("slot %d: took the lease from %s, epoch %d", slot, lease.holder or "nobody", epoch)

    async def _write(self, slot: int, began: float, write: Callable[[], kube.Lease]) -> None:
        try:
            written = await asyncio.to_thread(write)
        except kube.Conflict:
            self._held.pop(slot, None)  # someone wrote it meanwhile: read it again next tick
            return
        self._held[slot] = (written, began)
        self.holders[slot] = written.holder
        self.in_sets[slot] = written.in_sync
        self.epochs[slot] = max(self.epochs.get(slot, 0), written.transitions)
