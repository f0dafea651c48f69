"""The follower's end: it stores a copy only from its slot's current epoch, and each lite topic only where it
ends, and it *reconciles* before it may take a slot over.

A copy that starts past where a lite topic ends here is answered with the ends (the owner sends what is
missing first); messages a copy repeats (a catch-up and a live copy crossing) are passed over once their ids
match what is stored at their offsets; a different message there means the logs diverged (a deposed owner that
kept records never acknowledged): refused, ``out_of_sync`` (truncation is not built).

Reconciling: a follower may hold nothing of lite topics that got no send since it (re)started (a new disk, or
sends it missed while down). So after a start, and whenever the slot's holder changes, it asks the holder for
the end of every lite topic of the slot and fetches what it lacks; only then, and until a copy is refused, is
it *in sync* for that epoch, which a takeover requires.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from lmq_broker import errors, model
from lmq_broker.replication import copies, wire
from lmq_broker.replication.leadership import Leadership

log = logging.getLogger(__name__)

Append = Callable[[Sequence[model.NewMessage]], Awaitable[list[model.AppendResult]]]
StoredId = Callable[[model.QueueId, int], Awaitable[str | None]]  # the id of the message stored at an offset
Ends = Callable[[int, int], Awaitable[dict[str, int]]]  # (holder slot, slot) -> its lite topics' ends
Fetch = Callable[[int, int, str, int], Awaitable[bytes]]  # (holder slot, slot, topic, from) -> a copy


class Follower:
    def __init__(  # noqa: PLR0917 (the store's doors)
        self,
        leadership: Leadership,
        append: Append,
        next_offset: Callable[[model.QueueId], int],
        stored_id: StoredId,
        commit: Callable[[wire.Commit], Awaitable[None]],
        counters: copies.Counters,
    ) -> None:
        self._leadership = leadership
        self._append = append
        self._next_offset = next_offset
        self._stored_id = stored_id
        self._commit = commit
        self._counters = counters
        self.reconciled: dict[int, int] = {}  # slot -> epoch it was reconciled in, while no copy was refused
        self._lock = asyncio.Lock()  # one copy at a time: offsets are checked and written together

    def in_sync(self, slot: int, epoch: int) -> bool:
        return self.reconciled.get(slot) == epoch

    async def accept(self, data: bytes) -> dict[str, int]:
        """Store a copy: {} once stored; the ends of this broker's lite topics the copy starts past."""
        copy = wire.decode(data)
        slot = copy.slot
        if slot not in self._leadership.mine:
            raise errors.InvalidArgument(f"this broker is no replica of slot {slot}")
        async with self._lock:
            self._check_epoch(slot, copy.epoch)
            for point in copy.commits:
                await self._commit(point)
            behind: dict[str, int] = {}
            for queue, first in copies.first_offsets(copy).items():
                found = self._next_offset(queue)
                if found < first:
                    behind[queue.topic] = found
            if behind:
                self.reconciled.pop(slot, None)
                return behind
            fresh = await self._fresh(slot, copy)
            if fresh:
                await self._append(fresh)
            return {}

    async def _fresh(self, slot: int, copy: wire.Copy) -> list[model.NewMessage]:
        """The copy's messages not stored here yet; Conflict when one at an offset here is another message."""
        out: list[model.NewMessage] = []
        ends: dict[model.QueueId, int] = {}
        for message, offsets in zip(copy.messages, copy.offsets, strict=True):
            lmq = [(q, o) for q, o in zip(message.queues, offsets, strict=True) if q.topic.startswith(model.LMQ_PREFIX)]
            if lmq:
                queue, offset = lmq[0]
                end = ends.get(queue)
                if end is None:
                    end = ends[queue] = self._next_offset(queue)
                if offset < end:
                    if await self._stored_id(queue, offset) != message.message_id:
                        self.reconciled.pop(slot, None)
                        self._counters.copies_refused.labels("out_of_sync").inc()
                        raise errors.Conflict(f"slot {slot}: {queue.topic} holds another message at {offset}")
                    continue
            out.append(message)
        return out

    def _check_epoch(self, slot: int, epoch: int) -> None:
        if self._leadership.holds(slot):
            self._counters.copies_refused.labels("owner").inc()
            raise errors.Fenced(f"this broker holds the lease of slot {slot}: a copy of epoch {epoch} is refused")
        newest = self._leadership.epochs.get(slot, 0)
        if epoch < newest:
            self._counters.copies_refused.labels("stale_epoch").inc()
            raise errors.Fenced(f"slot {slot} is at epoch {newest}: a copy of epoch {epoch} is refused")
        self._leadership.epochs[slot] = epoch

    async def reconcile(self, slot: int, ends: Ends, fetch: Fetch) -> bool:
        """Fetch from the slot's holder every message of its lite topics this broker lacks; True once done
        (then in sync for the holder's epoch)."""
        leadership = self._leadership
        holder = leadership.serving(slot)
        epoch = leadership.epochs.get(slot)
        if holder == leadership.me or leadership.holds(slot) or epoch is None or slot not in leadership.holders:
            return False
        theirs = await ends(holder, slot)
        for topic, end in theirs.items():
            queue = model.QueueId(topic, 0)
            while (mine := self._next_offset(queue)) < end:
                data = await fetch(holder, slot, topic, mine)
                if (await self.accept(data)) or self._next_offset(queue) == mine:
                    raise errors.Conflict(f"slot {slot}: fetching {topic} from {mine} made no progress")
        if leadership.epochs.get(slot) != epoch or leadership.serving(slot) != holder:
            return False  # the holder changed meanwhile: again, from the new one
        self.reconciled[slot] = epoch
        log.info(
            "slot %d: reconciled with slot %d's broker at epoch %d (%d lite topics)", slot, holder, epoch, len(theirs)
        )
        return True
