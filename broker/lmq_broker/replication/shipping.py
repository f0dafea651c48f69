"""The ordered copies from a slot's owner to one follower, and what the owner knows of that follower's log.

Every batch the owner stores gets the next sequence number of each follower (``put``); one call at a time
ships what queued up meanwhile (one call per run of one epoch), in the owner's order, so the follower's
offsets are the owner's. After a call ``done`` is the last number shipped; a failure (the call failed, or the
batch was dropped because the queue held ``cap`` messages already) moves ``clean_from`` past it. Batch n is
*stored* there once ``done >= n >= clean_from`` and *lost* once ``n < clean_from`` (a later failure also marks
earlier batches lost: the owner errs on the side of refusing). Nothing per send is kept but the batch itself:
the owner compares numbers, and at --min-insync-replicas 1 does not wait at all.

A woken shipper first lets ``COALESCE_PASSES`` event-loop passes go by: a send's batch reaches the queue a few
passes after its request was read (the handler, the inline group commit at the end of a pass, the handler
resumed), so the sends read in the same few passes join one copy instead of each taking its own. Measured
(bench/RESULTS.md, 2026-11-29): 8 sends in flight made copies of 1.2 messages without the passes, 2.7 with
five, and every copy costs both brokers a stream message each way and the follower a store append with its
fsync; throughput rose (fewer copies per send), so no send waited longer. Order and what is acknowledged are
unchanged: the passes only decide how many queued batches one copy carries.

A follower outside the slot's in-sync set is *probed* (``insync``): the owner sends it the last message of
every lite topic of the slot, read back from its own store; the follower answers where it is behind and the
catch-up fills the gap. Then, while no commit copy is sent, every commit point of those topics (read back from
the store, after which the last messages are sent once more, so none points past the follower's end). A probe
that succeeds proves the follower holds everything the owner had stored when it began (``covered``): every
batch numbered up to then was stored before the probe read the store, and every commit point persisted before
it read them; a commit copy that fails there (``missed``) undoes that proof, as a failed batch does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final

from lmq_broker import errors, model
from lmq_broker.replication import wire

log = logging.getLogger(__name__)

# (follower endpoint, copy) -> {} once stored there, or where the follower's lite topics end when it is behind
Send = Callable[[str, bytes], Awaitable[dict[str, int]]]
Read = Callable[[model.QueueId, int, int], Awaitable[list[model.StoredMessage]]]  # the owner's store
Tails = Callable[[], Awaitable[list[model.StoredMessage]]]  # the last message of every lite topic of the slot
Points = Callable[[], Awaitable[list[wire.Commit]]]  # every commit point of the slot's lite topics (the store)
CATCH_UP_ROUNDS: Final = 8  # catch-up copies tried before a copy fails (each takes up to CATCH_UP_BATCH per topic)
CATCH_UP_BATCH: Final = 1_000
PROBE_BATCH: Final = 500  # last messages per probe copy
PROBE_GAP_S: Final = 0.1  # between two probes at least (one follows a call that succeeded, to rejoin soon)
QUEUE_MESSAGES: Final = 10_000  # default of --replica-queue-messages
COALESCE_PASSES: Final = 5  # event-loop passes a woken shipper lets go by before it takes its queue


@dataclass(frozen=True, slots=True)
class _Item:
    seq: int
    epoch: int
    messages: Sequence[model.NewMessage]
    results: list[model.AppendResult]


@dataclass(frozen=True, slots=True)
class Doors:
    """What a shipper needs of its owner: the copy call, the store, the epoch, and whom to tell."""

    send: Send
    read: Read
    tails: Tails
    epoch: Callable[[], int | None]  # the slot's epoch while its lease is held, else None
    changed: Callable[[Shipper], None]  # after each call, probe or drop
    wants_probe: Callable[[Shipper], bool]  # the follower is out of the in-sync set and not joining
    dropped: Callable[[int], None]  # messages not queued (the queue was full)
    points: Points
    commits: asyncio.Lock  # held while commit points are sent (the owner's flush, a probe): never reordered


class Shipper:
    def __init__(  # noqa: PLR0917 (who, where, how, how much)
        self, follower: int, endpoint: str, slot: int, doors: Doors, cap: int, probe_interval_s: float
    ) -> None:
        self.follower = follower  # its ring slot
        self.endpoint = endpoint
        self._slot = slot
        self._doors = doors
        self._cap = cap
        self._probe_interval_s = probe_interval_s
        self.seq = 0  # batches numbered so far
        self.done = 0  # the last batch shipped (stored, or failed)
        self.clean_from = 1  # every batch shipped from here on was stored
        self.covered: int | None = None  # a probe proved batches up to this held there (None: none since a failure)
        self.caught_up = 0  # messages sent again because the follower was behind
        self._queue: list[_Item] = []
        self._queued = 0  # messages in the queue
        self._shipping = 0  # messages of the run being shipped
        self._probed_at = -1e9
        self._answered = False  # a call succeeded since the last probe (so probe at once)
        self._probing = False
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"lmq-replica-{endpoint}")

    @property
    def pending(self) -> int:
        """Messages put here that the follower has not answered yet (lmq_replication_lag_messages)."""
        return self._queued + self._shipping

    def stored(self, seq: int) -> bool:
        return self.done >= seq >= self.clean_from

    def lost(self, seq: int) -> bool:
        return seq < self.clean_from

    def holds(self, seq: int) -> bool:
        """Batch ``seq`` is there: stored, or covered by a probe since the last failure."""
        return self.stored(seq) or (self.complete() and self.covered is not None and seq <= self.covered)

    def complete(self) -> bool:
        """Holds every batch up to ``done`` (a probe covered what came before, nothing failed since)."""
        return self.covered is not None and self.clean_from <= self.covered + 1

    def hopeful(self) -> bool:
        """Answering: a probe is under way, or due because a call succeeded since the last one."""
        return self._probing or self._answered

    def put(self, epoch: int, messages: Sequence[model.NewMessage], results: list[model.AppendResult]) -> int:
        """Queue a stored batch; its number. A full queue drops it: the follower leaves the set (catches up)."""
        self.seq += 1
        if self._queued + len(messages) > self._cap:
            self._failed(self.seq)
            self.done = self.seq  # answered (lost); what is still queued before it counts as lost too
            self._doors.dropped(len(messages))
            self._doors.changed(self)
            return self.seq
        self._queue.append(_Item(self.seq, epoch, messages, results))
        self._queued += len(messages)
        self._wake.set()
        return self.seq

    def missed(self) -> None:
        """A commit copy failed there: what it holds is no longer proven (out of the set it is probed again)."""
        self._failed(self.seq)

    def _failed(self, seq: int) -> None:
        self.clean_from = max(self.clean_from, seq + 1)
        self.covered = None

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            since = time.monotonic() - self._probed_at
            if self._doors.wants_probe(self) and (
                since >= self._probe_interval_s or (self._answered and since >= PROBE_GAP_S)
            ):
                await self._probe()
            if not self._queue:
                try:  # with a timeout: the follower may leave the set meanwhile (then it is probed)
                    async with asyncio.timeout(self._probe_interval_s):
                        await self._wake.wait()
                except TimeoutError:
                    continue
            for _ in range(COALESCE_PASSES):  # the sends read meanwhile join this copy (see the module's note)
                await asyncio.sleep(0)
            self._wake.clear()  # after: what was put during the passes goes now, not in an empty round after
            items, self._queue, self._queued = self._queue, [], 0
            while items:
                epoch = items[0].epoch
                n = next((k for k, i in enumerate(items) if i.epoch != epoch), len(items))
                run, items = items[:n], items[n:]
                await self._ship_run(epoch, run)

    async def _ship_run(self, epoch: int, run: list[_Item]) -> None:
        last = run[-1].seq
        messages = [m for i in run for m in i.messages]
        self._shipping = len(messages)
        try:
            await self._ship(epoch, messages, [r for i in run for r in i.results])
        except Exception as exc:
            log.debug("copy to %s failed: %s", self.endpoint, exc)
            self._failed(last)
        else:
            self._answered = True
        finally:
            self._shipping = 0
        self.done = max(self.done, last)
        self._doors.changed(self)

    async def _probe(self) -> None:
        self._probed_at, self._answered = time.monotonic(), False
        epoch = self._doors.epoch()
        if epoch is None:
            return
        self._probing = True
        try:
            await self._probe_in(epoch)
        finally:
            self._probing = False
        self._doors.changed(self)

    async def _probe_in(self, epoch: int) -> None:
        covered, clean = self.seq, self.clean_from  # every batch numbered so far is in the store already
        try:
            await self._doors.send(self.endpoint, wire.encode(self._slot, epoch, [], []))  # up? (before reading)
            await self._ship_tails(epoch)
            async with self._doors.commits:  # no commit copy meanwhile: none is overtaken by an older point
                points = await self._doors.points()
                await self._ship_tails(epoch)  # what came since: every point read is within the follower's ends
                for start in range(0, len(points), PROBE_BATCH):
                    part = points[start : start + PROBE_BATCH]
                    if behind := await self._doors.send(self.endpoint, wire.encode(self._slot, epoch, [], [], part)):
                        raise errors.Conflict(f"{self.endpoint} lacks messages the commit points count: {behind}")
        except Exception as exc:
            log.debug("probe of %s failed: %s", self.endpoint, exc)
            return
        if self.clean_from == clean:  # nothing dropped meanwhile
            self.covered = covered

    async def _ship_tails(self, epoch: int) -> None:
        tails = await self._doors.tails()
        for start in range(0, len(tails), PROBE_BATCH):
            part = tails[start : start + PROBE_BATCH]
            await self._ship(epoch, [as_new(m) for m in part], [appended(m) for m in part])

    async def _ship(self, epoch: int, messages: list[model.NewMessage], results: list[model.AppendResult]) -> None:
        """Send a copy; while the follower is behind (it missed copies: down, slow, restarted), first send it what
        it lacks, read back from this broker's store."""
        data = wire.encode(self._slot, epoch, messages, results)
        for _ in range(CATCH_UP_ROUNDS):
            behind = await self._doors.send(self.endpoint, data)
            if not behind:
                return
            await self._catch_up(epoch, behind, _starts(messages, results))
        raise errors.BrokerUnavailable(f"{self.endpoint} is still behind after {CATCH_UP_ROUNDS} catch-up copies")

    async def _catch_up(self, epoch: int, behind: dict[str, int], starts: dict[str, int]) -> None:
        missing: list[model.NewMessage] = []
        offsets: list[model.AppendResult] = []
        for topic, end in behind.items():
            start = starts.get(topic)
            if start is None or end >= start:
                raise errors.Conflict(f"{self.endpoint} is ahead of this owner in {topic} ({end} ≥ {start})")
            queue = model.QueueId(topic, 0)
            for m in await self._doors.read(queue, end, min(start - end, CATCH_UP_BATCH)):
                missing.append(as_new(m))
                offsets.append(appended(m))
        await self._doors.send(self.endpoint, wire.encode(self._slot, epoch, missing, offsets))
        self.caught_up += len(missing)


def _starts(messages: list[model.NewMessage], results: list[model.AppendResult]) -> dict[str, int]:
    out: dict[str, int] = {}
    for m, r in zip(messages, results, strict=True):
        for queue, offset in zip(m.queues, r.queue_offsets, strict=True):
            if queue.topic.startswith(model.LMQ_PREFIX):
                out.setdefault(queue.topic, offset)
    return out


def appended(m: model.StoredMessage) -> model.AppendResult:
    return model.AppendResult(m.message_id, (m.queue,), (m.offset,), m.store_timestamp_ms)


def as_new(m: model.StoredMessage) -> model.NewMessage:
    return model.NewMessage(
        message_id=m.message_id,
        topic=m.topic,
        body=m.body,
        queues=(m.queue,),
        lite_topic=m.lite_topic,
        message_type=m.message_type,
        born_timestamp_ms=m.born_timestamp_ms,
        born_host=m.born_host,
        tag=m.tag,
        keys=m.keys,
        message_group=m.message_group,
        user_properties=m.user_properties,
        epoch=m.epoch,
        slot=m.slot,
    )
