"""``dispatch.ingest.Replicas``: the slots this broker holds, each with its own copies and epoch.

A broker holds its own slot, and after a failover also the slots it took over. A lite topic belongs to one
slot for its whole life: the slot its first record was placed on, which the slot's owner records on each of
its records (``model.NewMessage.slot``, copied with them) and which is read back from its last record here,
remembered per topic. Today's ring decides only for a topic without records: the slot its name hashes to when
this broker holds that slot's lease, else this broker's own slot (as for a normal topic or a dead letter).
Records stored before slots were recorded count as topics without records. Computing the slot from today's
ring for every topic would file a topic placed by an older ring under whichever slot its holder happens to
hold, and copy it to replicas that lack its history (docs/replication.md, *Changing the ring*, fact 3).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import Final

from lmq_broker import model
from lmq_broker.replication import copies, wire
from lmq_broker.replication.leadership import Leadership

RingSlot = Callable[[str], int]  # an LMQ name -> its slot in today's ring
Recorded = Callable[[str], int]  # an LMQ name -> the slot on its last record in this store (-1: none; blocking)
RING_SLOTS_KEPT: Final = 65_536  # LMQ names whose ring slot is remembered (a hash of the name each, ~3 µs)
RECORDED_KEPT: Final = 262_144  # LMQ names whose recorded slot is remembered (a store read each); then cleared


class Slots:
    def __init__(
        self,
        leadership: Leadership,
        ring_slot: RingSlot,
        make_owner: Callable[[int], copies.Owner],
        recorded: Recorded = lambda topic: -1,
        slot_count: Callable[[], int] = lambda: 1 << 30,
        *,
        moved: Callable[[str, int, str], int] = lambda topic, slot, last: slot,
    ) -> None:
        self._leadership = leadership
        # remembered: a send asks it two or three times per message, and ``ring_slot`` is a pure function of the
        # name and of the membership (``ring_changed`` forgets them)
        self._ring_slot_of = ring_slot
        self._ring_slot = functools.lru_cache(maxsize=RING_SLOTS_KEPT)(ring_slot)
        self._make_owner = make_owner
        self._owners: dict[int, copies.Owner] = {}
        self._read_recorded = recorded
        self._recorded: dict[str, int] = {}  # LMQ name -> its recorded slot (only topics with a recorded one)
        self._slot_count = slot_count  # the slots of today's membership (leaving ones included)
        # (topic, slot a record names, its message id) -> the topic's slot: another when it was taken over with
        # that record last (``moved``; a copy of its records, fetched by a new replica, names the slot it left)
        self._moved = moved

    def ring_changed(self) -> None:
        """Another membership: the ring slots remembered are forgotten (recorded slots stay: they do not move)."""
        self._ring_slot = functools.lru_cache(maxsize=RING_SLOTS_KEPT)(self._ring_slot_of)

    def owners(self) -> dict[int, copies.Owner]:
        """The copies of every slot this broker holds or held."""
        return dict(self._owners)

    def owner(self, slot: int) -> copies.Owner:
        found = self._owners.get(slot)
        if found is None:
            found = self._owners[slot] = self._make_owner(slot)
        return found

    def admit(self, messages: Sequence[model.NewMessage]) -> Sequence[model.NewMessage]:
        """Fenced unless this broker holds every slot of the lite topics' ``messages``; else them stamped with
        their slot's epoch (the record keeps it: ``following`` finds where a rejoining replica's log diverged by
        it) and with their slot (the topic's slot from then on: ``recorded``). A message of no lite topic (a
        NORMAL topic's, a dead letter) is this broker's alone (``copy``): never fenced, stamped with its own
        slot's epoch when held."""
        epochs: dict[int, int] = {}
        slots = [self._slot_of(m) for m in messages]
        for slot in {s for s, m in zip(slots, messages, strict=True) if _lmq_of(m) is not None}:
            self.owner(slot).admit()
        for slot in set(slots):
            epochs[slot] = self._leadership.epoch(slot) or 0
        return [_stamped(m, epochs[slot], slot) for m, slot in zip(messages, slots, strict=True)]

    def note(self, messages: Sequence[model.NewMessage]) -> None:
        """Remember the slots ``messages`` record for their lite topics (stored here: sent, or copied)."""
        kept = self._recorded
        for m in messages:
            topic = _lmq_of(m)
            if topic is not None and m.slot >= 0:
                slot = self._moved(topic, m.slot, m.message_id)
                if kept.get(topic) != slot:
                    if len(kept) >= RECORDED_KEPT:
                        kept.clear()
                    kept[topic] = slot

    def adopt(self, topic: str, slot: int) -> None:
        """``topic`` moves to ``slot`` (a leaving slot's topic handed over to this broker, which holds ``slot``):
        its next records are stamped with it, and from then on its last record names it."""
        if len(self._recorded) >= RECORDED_KEPT:
            self._recorded.clear()
        self._recorded[topic] = slot

    def forget(self, topic: str) -> None:
        """``topic`` was cut (truncation on rejoin) or deleted: its slot is read again from what is left of it
        (a topic deleted and created again takes the slot it is placed on then)."""
        self._recorded.pop(topic, None)

    def recorded(self, topic: str) -> int:
        """The slot recorded on the last record of ``topic`` here, -1 when it has none (no records, or records
        older than recorded slots) or when it names a slot the ring no longer has. May read the store (blocking)
        the first time a topic is asked about.

        A removed slot: a scale-down removes a leaving slot only once each of its topics was taken over by the
        broker holding the topic's slot in the smaller ring (``adopt``, remembered here only until the topic's
        next record names that slot). A topic taken over idle still has its last record naming the removed slot
        after a restart, or once forgotten; filed by today's ring, as a topic without a recorded slot, it goes to
        the slot that took it over (docs/replication.md, *Changing the ring with R > 1*)."""
        found = self._recorded.get(topic)
        if found is None:
            found = self._read_recorded(topic)
            if found < 0:
                return found  # a topic without records: its first record will be noted
            if len(self._recorded) >= RECORDED_KEPT:
                self._recorded.clear()
            self._recorded[topic] = found
        return found if found < self._slot_count() else -1

    async def copy(self, messages: Sequence[model.NewMessage], results: list[model.AppendResult]) -> None:
        """Return once enough replicas of their slot stored the lite topics' ``messages``. Not the others (a
        NORMAL topic's, a dead letter): those are stored where they arrive and served there, each broker its
        own queues, as at --replicas 1 (docs/replication.md). A follower stored such copies in its own queue of
        the same name, which it serves too: every such message was delivered twice, once by each broker."""
        self.note(messages)  # stored here: their topics' slots are recorded from now on
        parts: dict[int, tuple[list[model.NewMessage], list[model.AppendResult]]] = {}
        for m, r in zip(messages, results, strict=True):
            if _lmq_of(m) is None:
                continue
            part = parts.setdefault(self._slot_of(m), ([], []))
            part[0].append(m)
            part[1].append(r)
        if not parts:
            return
        if len(parts) == 1:
            ((slot, (ms, rs)),) = parts.items()
            await self.owner(slot).copy(ms, rs)
            return
        await asyncio.gather(*(self.owner(slot).copy(ms, rs) for slot, (ms, rs) in parts.items()))

    def fence(self, queue: model.QueueId) -> None:
        """``dispatch.settlement``'s check before an ack: ``errors.Fenced`` unless this broker holds the lease of
        the lite topic's slot now (another queue is this broker's alone: ``copy``)."""
        if queue.topic.startswith(model.LMQ_PREFIX):
            self.owner(self._acting_slot(queue.topic)).admit()

    def hands_out(self, queue: model.QueueId) -> bool:
        """``dispatch.delivery``'s check before a hand-out: False (counted) unless this broker holds the lease of
        the lite topic's slot now, so a deposed owner leases nothing and counts no attempt; the holder delivers.
        Another queue (a NORMAL topic's, a dead letter queue) is this broker's alone (``copy``): served here."""
        if not queue.topic.startswith(model.LMQ_PREFIX):
            return True
        return self.owner(self._acting_slot(queue.topic)).hands_out()

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
        """``dispatch.settlement``'s commit points, for the followers of their slot (when this broker holds it).

        Not for a topic of another broker's slot that this broker neither holds nor has records of (an offset
        reset that reached a broker that is no replica of it: lmq-admin's ResetLiteOffsets, a subscription's
        OffsetOption fanned out to every candidate): filed under this broker's own slot, its copy would replace
        the commit point of that slot's follower, which may be the topic's live holder."""
        if not queue.topic.startswith(model.LMQ_PREFIX):
            return None
        slot = self.slot_of_topic(queue.topic)
        if not self._leadership.holds(slot):
            return None
        if self.recorded(queue.topic) < 0 and self._ring_slot(queue.topic) != slot:
            return None
        return self.owner(slot).note_commit(wire.Commit(queue, group, offset, tuple(acked), handouts))

    def lag(self) -> list[tuple[int, str, int]]:
        """(slot, follower endpoint, messages it has not confirmed) of the slots this broker holds."""
        return [(s, f, n) for s, o in self._owners.items() if self._leadership.holds(s) for f, n in o.lag()]

    async def close(self) -> None:
        await asyncio.gather(*(o.close() for o in self._owners.values()))

    def _slot_of(self, message: model.NewMessage) -> int:
        topic = _lmq_of(message)
        return self._leadership.me if topic is None else self._acting_slot(topic)

    def _acting_slot(self, topic: str) -> int:
        """The slot whose lease a send or a settlement of ``topic`` acts under: its recorded slot whoever holds
        that slot now, else its ring slot also after this broker lost that slot's lease (it held it:
        ``_owners``), so the call is fenced there and not taken under this broker's own slot."""
        slot = self.recorded(topic)
        if slot >= 0:
            return slot
        me = self._leadership.me
        slot = self._ring_slot(topic)
        return slot if slot != me and (slot in self._owners or self._leadership.holds(slot)) else me

    def slot_of_topic(self, topic: str) -> int:
        """The slot an LMQ stored here belongs to: its recorded slot; for a topic without one, its ring slot
        when this broker holds that one, else its own."""
        slot = self.recorded(topic)
        if slot >= 0:
            return slot
        me = self._leadership.me
        slot = self._ring_slot(topic)
        return slot if slot != me and self._leadership.holds(slot) else me

    def followed_slot(self, topic: str) -> int:
        """The slot a follower files an LMQ it stored under (truncation on rejoin): its recorded slot, else its
        ring slot (the copies of a topic without a recorded slot came from its ring slot's owner)."""
        slot = self.recorded(topic)
        return slot if slot >= 0 else self._ring_slot(topic)


def _stamped(m: model.NewMessage, epoch: int, slot: int) -> model.NewMessage:
    """``m`` with its epoch and, for a lite topic's message, its slot (positional: ``dataclasses.replace``
    cost 3.5 µs a message on the send path)."""
    return model.NewMessage(
        m.message_id,
        m.topic,
        m.body,
        m.queues,
        m.lite_topic,
        m.message_type,
        m.born_timestamp_ms,
        m.born_host,
        m.tag,
        m.keys,
        m.message_group,
        m.user_properties,
        epoch,
        slot if _lmq_of(m) is not None else -1,
    )


def _lmq_of(message: model.NewMessage) -> str | None:
    for queue in message.queues:
        if queue.topic.startswith(model.LMQ_PREFIX):
            return queue.topic
    return None
