"""``dispatch.ingest.Replicas``: the slots this broker holds, each with its own copies and epoch.

A broker holds its own slot, and after a failover also the slots it took over. A stored message belongs to
the slot its lite topic hashes to when this broker holds that slot's lease, else to this broker's own slot
(a topic placed here by an older ring, a normal topic, a dead letter).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Final

from lmq_broker import model
from lmq_broker.replication import copies, wire
from lmq_broker.replication.leadership import Leadership

RingSlot = Callable[[str], int]  # an LMQ name -> its slot in today's ring
RING_SLOTS_KEPT: Final = 65_536  # LMQ names whose ring slot is remembered (a hash of the name each, ~3 µs)


class Slots:
    def __init__(self, leadership: Leadership, ring_slot: RingSlot, make_owner: Callable[[int], copies.Owner]) -> None:
        self._leadership = leadership
        # remembered: a send asks it two or three times per message, and ``ring_slot`` is a pure function of the
        # name (``setup`` hands it the membership it started with; a replicated ring does not change meanwhile)
        self._ring_slot = functools.lru_cache(maxsize=RING_SLOTS_KEPT)(ring_slot)
        self._make_owner = make_owner
        self._owners: dict[int, copies.Owner] = {}

    def owner(self, slot: int) -> copies.Owner:
        found = self._owners.get(slot)
        if found is None:
            found = self._owners[slot] = self._make_owner(slot)
        return found

    def admit(self, messages: Sequence[model.NewMessage]) -> Sequence[model.NewMessage]:
        """Fenced unless this broker holds every slot of ``messages``; else them stamped with their slot's epoch
        (the record keeps it: ``following`` finds where a rejoining replica's log diverged by it)."""
        epochs: dict[int, int] = {}
        for slot in {self._slot_of(m) for m in messages}:
            self.owner(slot).admit()
            epochs[slot] = self._leadership.epoch(slot) or 0
        if not any(epochs.values()):
            return messages  # the first epoch is 0: nothing to stamp
        return [dataclasses.replace(m, epoch=epochs[self._slot_of(m)]) for m in messages]

    async def copy(self, messages: Sequence[model.NewMessage], results: list[model.AppendResult]) -> None:
        parts: dict[int, tuple[list[model.NewMessage], list[model.AppendResult]]] = {}
        for m, r in zip(messages, results, strict=True):
            part = parts.setdefault(self._slot_of(m), ([], []))
            part[0].append(m)
            part[1].append(r)
        if len(parts) == 1:
            ((slot, (ms, rs)),) = parts.items()
            await self.owner(slot).copy(ms, rs)
            return
        await asyncio.gather(*(self.owner(slot).copy(ms, rs) for slot, (ms, rs) in parts.items()))

    def fence(self, queue: model.QueueId) -> None:
        """``dispatch.settlement``'s check before an ack: ``errors.Fenced`` unless this broker holds the lease of
        the queue's slot now."""
        if queue.topic.startswith(model.LMQ_PREFIX):
            self.owner(self._acting_slot(queue.topic)).admit()
        else:
            self.owner(self._leadership.me).admit()

    def hands_out(self, queue: model.QueueId) -> bool:
        """``dispatch.delivery``'s check before a hand-out: False (counted) unless this broker holds the lease of
        the queue's slot now, so a deposed owner leases nothing and counts no attempt; the holder delivers."""
        slot = self._acting_slot(queue.topic) if queue.topic.startswith(model.LMQ_PREFIX) else self._leadership.me
        return self.owner(slot).hands_out()

    def followed(self, topic: str) -> bool:
        """``dispatch.settlement``'s question before an offset reset: is ``topic`` a lite topic of a slot this broker
        follows without holding its lease (its commit points are the holder's copies)?"""
        if not topic.startswith(model.LMQ_PREFIX):
            return False
        slot = self._ring_slot(topic)
        return slot in self._leadership.mine and not self._leadership.holds(slot)

    def committed(
        self,
        queue: model.QueueId,
        group: str,
        offset: int,
        acked: Sequence[int],
        handouts: model.Handouts = model.NO_HANDOUTS,
    ) -> asyncio.Future[None] | None:
        """``dispatch.settlement``'s commit points, for the followers of their slot (when this broker holds it)."""
        if not queue.topic.startswith(model.LMQ_PREFIX):
            return None
        slot = self.slot_of_topic(queue.topic)
        if not self._leadership.holds(slot):
            return None
        return self.owner(slot).note_commit(wire.Commit(queue, group, offset, tuple(acked), handouts))

    def lag(self) -> list[tuple[int, str, int]]:
        """(slot, follower endpoint, messages it has not confirmed) of the slots this broker holds."""
        return [(s, f, n) for s, o in self._owners.items() if self._leadership.holds(s) for f, n in o.lag()]

    async def close(self) -> None:
        await asyncio.gather(*(o.close() for o in self._owners.values()))

    def _slot_of(self, message: model.NewMessage) -> int:
        for queue in message.queues:
            if queue.topic.startswith(model.LMQ_PREFIX):
                return self._acting_slot(queue.topic)
        return self._leadership.me

    def _acting_slot(self, topic: str) -> int:
        """The slot whose lease a send or a settlement of ``topic`` acts under: its ring slot also after this
        broker lost that slot's lease (it held it: ``_owners``), so the call is fenced there and not taken
        under this broker's own slot."""
        me = self._leadership.me
        slot = self._ring_slot(topic)
        return slot if slot != me and (slot in self._owners or self._leadership.holds(slot)) else me

    def slot_of_topic(self, topic: str) -> int:
        """The slot an LMQ stored here belongs to: its ring slot when this broker holds that one, else its own."""
        me = self._leadership.me
        slot = self._ring_slot(topic)
        return slot if slot != me and self._leadership.holds(slot) else me
