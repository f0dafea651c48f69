"""The follower's end: it stores a copy only from its slot's current epoch, and each lite topic only where it
ends, and it *reconciles* before it may take a slot over.

Before it stores the first messages of an epoch it *rejoins*: each lite topic of the slot is compared with the
holder's by the epochs of their records (``divergence``) and cut back where they part (records stored here and
never acknowledged: a deposed owner's that did not reach enough followers), so that what it appends next
follows exactly what the holder has. A copy that starts past where a lite topic ends here is answered with
the ends (the owner sends what is missing first); messages a copy repeats (a catch-up and a live copy
crossing) are passed over once their ids match what is stored at their offsets; a different message there
(which a rejoin rules out) is refused, ``out_of_sync``, and the next copy rejoins again; so is a copy whose next
message of a lite topic lies past the offset it would take here (the holder lacks the records between).

One owner's log of a topic only grows within its epoch, except where the owner deletes the topic (its expiry, the
reclaimer: each broker deletes its own copy, when it finds it expired) and a send creates it again from offset 0:
a copy then holds, at an offset stored here from the same epoch, another message. That topic is deleted here as
well once it is expired here by the same rule (``expired``), and fetched again from 0; until then every copy of
it is refused and the slot is not in sync (never a copy appended after the old records: another message at
each of their offsets than at the owner).

Reconciling: a follower may hold nothing of lite topics that got no send since it (re)started (a new disk, or
sends it missed while down). So after a start, and whenever the slot's holder changes, it asks the holder for
the end of every lite topic of the slot (page by page) and fetches what it lacks; only then, and until a copy
is refused, is it *in sync* for that epoch, which a takeover requires. A reconcile during which a copy was
refused does not count (``out_of_sync``): it is tried again (``reconciling`` retries it at once).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, NoReturn, Protocol

from lmq_broker import errors, model
from lmq_broker.replication import copies, wire
from lmq_broker.replication.leadership import Leadership
from lmq_broker.storage import keys

log = logging.getLogger(__name__)

RECREATED: Final = (  # why a copy of a topic deleted and created again at its holder is refused (see above)
    "was deleted and created again at its holder (another message at an offset of the same epoch): refused until "
    "it expires here"
)

Append = Callable[[Sequence[model.NewMessage]], Awaitable[list[model.AppendResult]]]
StoredId = Callable[[model.QueueId, int], Awaitable[str | None]]  # the id of the message stored at an offset
# (holder slot, slot, cursor: "" first) -> a page of its lite topics' ends, and the next page's cursor (None: last)
Ends = Callable[[int, int, str], Awaitable[tuple[dict[str, int], str | None]]]
Fetch = Callable[[int, int, str, int], Awaitable[bytes]]  # (holder slot, slot, topic, from) -> a copy
Answer = tuple[int | None, int]  # ``divergence.answer``
# (holder slot, slot, epoch, {topic: epoch of its last record here}) -> the holder's answer per topic
Diverge = Callable[[int, int, int, dict[str, int]], Awaitable[dict[str, Answer]]]


class Local(Protocol):
    """This broker's store as a rejoin reads and cuts it (``setup``: ``sources`` run in a thread)."""

    async def tails(self, slot: int) -> dict[str, int]: ...  # topic -> epoch of its last record, non-empty ones
    async def last_epoch(self, topic: str) -> int | None: ...
    async def cut_point(self, topic: str, epoch: int, theirs: Answer) -> int: ...  # ``divergence.cut_point``
    async def truncate(self, topic: str, end: int) -> int: ...  # offsets cut (the store's ``truncate_queue``)


class Follower:
    def __init__(  # noqa: PLR0913, PLR0917 (the store's doors)
        self,
        leadership: Leadership,
        append: Append,
        next_offset: Callable[[model.QueueId], int],
        stored_id: StoredId,
        commit: Callable[[wire.Commit], Awaitable[None]],
        counters: copies.Counters,
        local: Local | None = None,
        diverge: Diverge | None = None,
        failpoint: Callable[[], bool] | None = None,
        expired: Callable[[str], Awaitable[bool]] | None = None,
    ) -> None:
        self._leadership = leadership
        self._append = append
        self._next_offset = next_offset
        self._stored_id = stored_id
        self._commit = commit
        self._counters = counters
        self._failpoint = failpoint  # tests: True while copies of messages are to be lost on the way
        self._local = local
        self._diverge = diverge
        self._expired = expired  # deletes this broker's copy of a lite topic if it is expired here; True: it is gone
        self._recreated: dict[str, int] = {}  # topic -> slot: created again at its owner, not yet deleted here
        self.reconciled: dict[int, int] = {}  # slot -> epoch it was reconciled in, while no copy was refused
        self.drops: dict[int, int] = {}  # slot -> times it fell out of sync (a reconcile counts only if none since)
        self.on_out_of_sync: Callable[[int], None] = lambda slot: None  # ``reconciling`` wakes up
        self.checked: dict[int, int] = {}  # slot -> epoch whose holder's log this broker's was cut back to
        self.cut = 0  # offsets cut by rejoins
        self._lock = asyncio.Lock()  # one copy at a time: offsets are checked and written together

    def in_sync(self, slot: int, epoch: int) -> bool:
        return self.reconciled.get(slot) == epoch

    def out_of_sync(self, slot: int) -> None:
        """Not in sync any more (a copy found it behind or elsewhere, a state batch missed): reconcile again."""
        self.reconciled.pop(slot, None)
        self.drops[slot] = self.drops.get(slot, 0) + 1
        self.on_out_of_sync(slot)

    def mark(self, slot: int) -> int:
        """What ``reconcile(since=…)`` compares with: a reconcile counts only if the slot did not fall out of sync
        since the mark."""
        return self.drops.get(slot, 0)

    async def accept(self, data: bytes) -> dict[str, int]:
        """Store a copy: {} once stored; the ends of this broker's lite topics the copy starts past, or that a
        commit point it carries was clamped to (the owner does not count it as stored)."""
        copy = wire.decode(data)
        slot = copy.slot
        if slot not in self._leadership.mine:
            raise errors.InvalidArgument(f"this broker is no replica of slot {slot}")
        if copy.messages and self._failpoint is not None and self._failpoint():
            raise errors.BrokerUnavailable(f"slot {slot}: a copy lost on the way (failpoint)")
        async with self._lock:
            self._check_epoch(slot, copy.epoch)
            if copy.messages and self.checked.get(slot) != copy.epoch:
                await self._rejoin(slot, copy.epoch)
            behind: dict[str, int] = {}
            for queue, first in copies.first_offsets(copy).items():
                found = self._next_offset(queue)
                if found < first:
                    behind[queue.topic] = found
            if behind:
                self.out_of_sync(slot)
                return behind
            fresh = await self._fresh(slot, copy)
            if fresh:
                await self._append(fresh)
            clamped: dict[str, int] = {}
            for point in copy.commits:  # after the messages a fetch carries with them
                within = self._within(point)
                await self._commit(within)
                if within.offset != point.offset or len(within.acked) != len(point.acked):
                    clamped[point.queue.topic] = self._next_offset(point.queue)  # it lacks what the point counts
                else:  # hand-outs past this broker's end are trimmed, not refused: the point itself is stored
                    self._counters.commits_stored.labels("yes" if within.handouts.mark else "no").inc()
            return clamped

    async def take_over(self, data: bytes) -> int:
        """Store a page of a lite topic this broker takes over from a leaving slot (``Replication.adopt``),
        fetched from that slot's holder from where the topic ends here: the messages it lacks (those it has, as
        that slot's follower, are passed over once their ids match) and the commit points within them. No
        epoch or replica check: the topic leaves that slot for this broker's, whose lease it holds. Returns the
        messages stored (0: it has the holder's whole topic). Conflict when the page does not start where the
        topic ends here (the holder no longer has its first records) or holds another message at an offset
        stored here: the topic is not taken over."""
        copy = wire.decode(data)
        async with self._lock:
            for queue, first in copies.first_offsets(copy).items():
                if (end := self._next_offset(queue)) < first:
                    raise errors.Conflict(
                        f"{queue.topic} cannot be taken over from slot {copy.slot}: its holder's records start at "
                        f"{first}, this broker's end at {end}"
                    )
            fresh = await self._fresh(copy.slot, copy)
            if fresh:
                await self._append(fresh)
            for point in copy.commits:
                await self._commit(self._within(point))
        return len(fresh)

    def _within(self, point: wire.Commit) -> wire.Commit:
        """A commit point no further than this broker's end of its queue: the owner's consumers may have taken
        records that never reached this broker (nor were acknowledged): were it to take over, its own records at
        those offsets would be skipped. Clamped, they may be delivered again (at-least-once), never skipped. The
        same for the offsets acked above the point: only those below the end (``wire.acked_below``); and hand-outs."""
        end = self._next_offset(point.queue)
        if point.offset > end:
            return wire.Commit(point.queue, point.group, end, ())
        handouts = _handouts_within(point.offset, end, point.handouts)
        acked = wire.acked_below(point.acked, end)
        if handouts is point.handouts and acked is point.acked:
            return point
        return wire.Commit(point.queue, point.group, point.offset, acked, handouts)

    async def _fresh(self, slot: int, copy: wire.Copy) -> list[model.NewMessage]:
        """The copy's messages not stored here yet; Conflict when one at an offset here is another message, or when
        one comes past the offset it would take here: the holder lost the records between (a read passes over a
        record that fails its CRC, a lost range), so appended, it and every later one would sit at another offset
        than at the holder."""
        out: list[model.NewMessage] = []
        ends: dict[model.QueueId, int] = {}  # the offset the next message of each queue takes here
        for message, offsets in zip(copy.messages, copy.offsets, strict=True):
            lmq = [(q, o) for q, o in zip(message.queues, offsets, strict=True) if q.topic.startswith(model.LMQ_PREFIX)]
            if not lmq:  # a NORMAL topic's message, a dead letter: its broker's alone, served there (an older
                continue  # owner's copy; stored here it was served twice: ``owning.Slots.copy``)
            queue, offset = lmq[0]
            end = ends.get(queue)
            if end is None:
                if queue.topic in self._recreated and not await self._deleted_here(queue):
                    self._refuse(slot, f"{queue.topic} {RECREATED} (offset {offset})")
                end = ends[queue] = self._next_offset(queue)
            if offset < end:
                if await self._stored_id(queue, offset) != message.message_id:
                    if not await self._recreated_at_holder(slot, queue, message.epoch):
                        self._refuse(slot, f"{queue.topic} holds another message at {offset}")
                    if queue.topic in self._recreated:
                        self._refuse(slot, f"{queue.topic} {RECREATED} (offset {offset})")
                    end = ends[queue] = self._next_offset(queue)  # deleted here too
                else:
                    continue
            if offset > end:
                self.out_of_sync(slot)
                self._counters.copies_refused.labels("out_of_sync").inc()
                raise errors.Conflict(
                    f"slot {slot}: {queue.topic} ends at {end} here, the copy's next message is at {offset} (the "
                    "holder lacks the records between): refused, not stored at other offsets"
                )
            ends[queue] = end + 1
            out.append(message)
        return out

    def _refuse(self, slot: int, why: str) -> NoReturn:
        self.out_of_sync(slot)
        self.checked.pop(slot, None)
        self._counters.copies_refused.labels("out_of_sync").inc()
        raise errors.Conflict(f"slot {slot}: {why}")

    async def _recreated_at_holder(self, slot: int, queue: model.QueueId, epoch: int) -> bool:
        """Another message than here at an offset of ``queue``: when this broker's last record of it is of the
        copy's epoch too, the holder deleted the topic and created it again (see the module's docstring). True
        when so: then the topic is deleted here as well if it is expired here, else remembered (``_recreated``)
        and refused until it is."""
        if self._expired is None or self._local is None or await self._local.last_epoch(queue.topic) != epoch:
            return False
        self._recreated[queue.topic] = slot
        await self._deleted_here(queue)
        return True

    async def _deleted_here(self, queue: model.QueueId) -> bool:
        """(Under the lock.) Delete this broker's copy of a topic created again at its holder, if it is expired
        here; True once it is gone."""
        assert self._expired is not None
        if not await self._expired(queue.topic):
            return False
        slot = self._recreated.pop(queue.topic)
        log.info("slot %d: %s was deleted and created again by its holder: deleted here too", slot, queue.topic)
        return True

    def _check_epoch(self, slot: int, epoch: int) -> None:
        if self._leadership.holds(slot):
            self._counters.copies_refused.labels("owner").inc()
            raise errors.Fenced(f"this broker holds the lease of slot {slot}: a copy of epoch {epoch} is refused")
        newest = self._leadership.epochs.get(slot, 0)
        if epoch < newest:
            self._counters.copies_refused.labels("stale_epoch").inc()
            raise errors.Fenced(f"slot {slot} is at epoch {newest}: a copy of epoch {epoch} is refused")
        self._leadership.epochs[slot] = epoch

    async def reconcile(self, slot: int, ends: Ends, fetch: Fetch, since: int | None = None) -> bool:
        """Fetch from the slot's holder every message of its lite topics this broker lacks; True once done
        (then in sync for the holder's epoch), False when it must be tried again: the holder changed meanwhile,
        or the slot fell out of sync since ``since`` (a ``mark``; by default the start of this call)."""
        leadership = self._leadership
        holder = leadership.serving(slot)
        epoch = leadership.epochs.get(slot)
        if holder == leadership.me or leadership.holds(slot) or epoch is None or slot not in leadership.holders:
            return False
        mark = self.mark(slot) if since is None else since
        async with self._lock:
            await self._rejoin(slot, epoch)
        topics = 0
        cursor: str | None = ""
        while cursor is not None:
            theirs, cursor = await ends(holder, slot, cursor)
            topics += len(theirs)
            for topic, end in theirs.items():
                if topic in self._recreated:
                    async with self._lock:
                        if not await self._deleted_here(model.QueueId(topic, 0)):
                            continue  # the slot stays out of sync (below)
                await self._fetch_topic(slot, holder, topic, end, fetch)
        if waiting := [t for t, s in self._recreated.items() if s == slot]:
            log.info(
                "slot %d: %d lite topic(s) created again at the holder are not expired here yet", slot, len(waiting)
            )
            return False
        if leadership.epochs.get(slot) != epoch or leadership.serving(slot) != holder:
            return False  # the holder changed meanwhile: again, from the new one
        if self.mark(slot) != mark:
            log.info("slot %d: fell out of sync while it reconciled (a copy found it behind): again", slot)
            return False
        self.reconciled[slot] = epoch
        log.info("slot %d: reconciled with slot %d's broker at epoch %d (%d lite topics)", slot, holder, epoch, topics)
        return True

    async def _fetch_topic(self, slot: int, holder: int, topic: str, end: int, fetch: Fetch) -> None:
        queue = model.QueueId(topic, 0)
        while (mine := self._next_offset(queue)) < end:
            data = await fetch(holder, slot, topic, mine)
            if (await self.accept(data)) or self._next_offset(queue) == mine:
                raise errors.Conflict(f"slot {slot}: fetching {topic} from {mine} made no progress")

    async def _rejoin(self, slot: int, epoch: int) -> None:
        """Cut every lite topic of ``slot`` back to where it parts from the log of the holder of ``epoch``
        (under the lock: no copy is stored meanwhile). Records of ``epoch`` itself came from that holder after
        an earlier rejoin: their topics need no question."""
        if self.checked.get(slot) == epoch:
            return
        if self._local is None or self._diverge is None:
            self.checked[slot] = epoch  # a broker without a store's doors (tests of the copy rules)
            return
        holder = self._leadership.serving(slot)
        if holder == self._leadership.me:
            raise errors.BrokerUnavailable(f"slot {slot}: its holder is not known yet; try again")
        pending = {t: e for t, e in (await self._local.tails(slot)).items() if e != epoch}
        cut = 0
        while pending:
            answers = await self._diverge(holder, slot, epoch, pending)
            again: dict[str, int] = {}
            for topic, last in pending.items():
                theirs = answers[topic]
                point = await self._local.cut_point(topic, last, theirs)
                cut += await self._local.truncate(topic, point)
                if theirs[0] != last and (now := await self._local.last_epoch(topic)) is not None:
                    again[topic] = now  # lower than ``last``: this ends
            pending = again
        self.checked[slot] = epoch
        self.cut += cut
        if cut:
            log.warning("slot %d: rejoined the holder of epoch %d, %d offsets never acknowledged cut", slot, epoch, cut)


def _handouts_within(committed: int, end: int, handouts: model.Handouts) -> model.Handouts:
    """The owner's hand-outs as this broker's store takes them (``keys.checked_handouts``): below its end (a
    hand-out of a record that never reached it is no attempt here) and above the commit point; those a store
    would refuse are dropped (the next hand-out counts from 1 again: at-least-once either way)."""
    mark = min(handouts.mark, end)
    if mark <= committed:
        return model.NO_HANDOUTS
    counts = tuple((o, n) for o, n in handouts.counts if committed <= o < mark and n >= 0)[: keys.HANDOUTS_MAX_COUNTS]
    if mark == handouts.mark and counts == handouts.counts:
        return handouts
    return model.Handouts(mark, counts)
