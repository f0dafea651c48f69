"""Who owns each slot: one Kubernetes Lease per slot, renewed by its holder, taken over by an in-sync follower.

The holder acknowledges only while its last successful renewal *began* less than ``duration * FENCE_SHARE``
ago on its own monotonic clock. A candidate sees a lease expire only once its resourceVersion stayed the same
for a whole duration on *its* clock (client-go's rule), which starts after that renewal was written: the
deposed holder has stopped acknowledging before anyone can take its lease. The lease's ``leaseTransitions``
is the slot's replication epoch; copies carry it and followers refuse older ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

from lmq_broker.replication import kube

log = logging.getLogger(__name__)

FENCE_SHARE: Final = 2 / 3  # renewals run every third of a duration: one may fail without a gap
Clock = Callable[[], float]


class LeaseApi(Protocol):
    def list_named(self, prefix: str) -> list[kube.Lease]: ...  # every lease whose name starts with ``prefix``
    def create(self, name: str, holder: str, duration_s: int) -> kube.Lease: ...
    def write(self, lease: kube.Lease, holder: str, transitions: int, duration_s: int) -> kube.Lease: ...


@dataclass(slots=True)
class _Seen:
    version: str
    since: float  # when this broker first saw ``version``


def identity(slot: int, unique: str) -> str:
    return f"slot-{slot}/{unique}"


def slot_of_identity(holder: str) -> int:
    """The slot of a holder named by ``identity``; -1 for another name (a person's forced takeover)."""
    head = holder.partition("/")[0]
    number = head.removeprefix("slot-")
    return int(number) if head.startswith("slot-") and number.isdigit() else -1


class Leadership:
    def __init__(
        self,
        api: LeaseApi,
        identity: str,
        me: int,
        replica_sets: list[list[int]],
        in_sync: Callable[[int, int], bool],
        *,
        prefix: str,
        duration_ms: int,
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
        self._held: dict[int, tuple[kube.Lease, float]] = {}  # slot -> (lease as written, renewal began)
        self._seen: dict[int, _Seen] = {}
        self.epochs: dict[int, int] = {}  # slot -> newest epoch seen (followers refuse older copies)
        self.takeovers = 0

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

    def serving(self, slot: int) -> int:
        """The slot whose broker holds ``slot``'s lease (where its sends go); ``slot`` itself when unknown."""
        holder = slot_of_identity(self.holders.get(slot, ""))
        return holder if 0 <= holder < len(self.replica_sets) else slot

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            await self.tick()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), self._duration / 3)

    async def tick(self) -> None:
        """Every slot's lease is read, in one LIST of the release's leases (routes follow their holders); only
        those of this broker's slots are written (renewed, created, taken)."""
        began = self._clock()
        try:
            found = await asyncio.to_thread(self._api.list_named, f"{self._prefix}-slot-")
        except Exception as exc:  # the apiserver is slow or unreachable: the fence closes by itself
            log.warning("leases: %s", exc)
            return
        by_name = {lease.name: lease for lease in found}
        for slot in range(len(self.replica_sets)):
            lease = by_name.get(self.name(slot))
            self._note(slot, lease)
            if slot not in self.mine:
                continue
            try:
                await self._visit(slot, lease, began)
            except Exception as exc:  # a write failed: the fence closes by itself
                log.warning("lease of slot %d: %s", slot, exc)

    def _note(self, slot: int, lease: kube.Lease | None) -> None:
        if lease is None or not lease.holder:
            self.holders.pop(slot, None)
        else:
            self.holders[slot] = lease.holder

    async def _visit(self, slot: int, lease: kube.Lease | None, began: float) -> None:
        """Renew, create or take the lease of one of this broker's slots, as read when the tick ``began``."""
        if lease is None:
            if slot == self.me:
                await self._write(
                    slot, began, lambda: self._api.create(self.name(slot), self.identity, self._duration_s)
                )
            return
        self.epochs[slot] = max(self.epochs.get(slot, 0), lease.transitions)
        if lease.holder == self.identity:
            await self._write(
                slot, began, lambda: self._api.write(lease, self.identity, lease.transitions, self._duration_s)
            )
            return
        if self._held.pop(slot, None) is not None:
            log.warning(
                "slot %d: lease taken by %s (epoch %d): no longer its owner", slot, lease.holder, lease.transitions
            )
        seen = self._seen.get(slot)
        if seen is None or seen.version != lease.resource_version:
            self._seen[slot] = _Seen(lease.resource_version, began)
            return
        expired = began - seen.since >= self._duration
        if expired and self._in_sync(slot, lease.transitions):
            epoch = lease.transitions + 1
            await self._write(slot, began, lambda: self._api.write(lease, self.identity, epoch, self._duration_s))
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
        self.epochs[slot] = max(self.epochs.get(slot, 0), written.transitions)
