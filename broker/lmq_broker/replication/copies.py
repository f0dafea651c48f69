"""The owner's end of a slot's copies: it ships each stored batch to its followers, in order, and
acknowledges once enough of them stored it (the follower's end: ``following``).

Per follower one shipper sends the copies one call at a time, in the order the owner stored them (what queued
up meanwhile goes in the next call, one call per epoch): a follower sees every lite topic's messages in the
owner's order, so its offsets are the owner's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

from prometheus_client import CollectorRegistry, Counter

from lmq_broker import errors, model
from lmq_broker.replication import wire
from lmq_broker.replication.leadership import Leadership

log = logging.getLogger(__name__)

# (follower endpoint, copy) -> {} once stored there, or where the follower's lite topics end when it is behind
Send = Callable[[str, bytes], Awaitable[dict[str, int]]]
Read = Callable[[model.QueueId, int, int], Awaitable[list[model.StoredMessage]]]  # the owner's store
CATCH_UP_ROUNDS: Final = 8  # catch-up copies tried before a copy fails (each takes up to CATCH_UP_BATCH per topic)
CATCH_UP_BATCH: Final = 1_000
_Item = tuple[int, Sequence[model.NewMessage], list[model.AppendResult], asyncio.Future[None]]
LMQ_PREFIX: Final = model.LMQ_PREFIX


class Counters:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.refused = Counter(
            "lmq_replication_refused",
            "Sends and settlements refused (fenced: lease not held; insync: too few replicas stored it)",
            ["reason"],
            registry=registry,
        )
        self.copies_refused = Counter(
            "lmq_replication_copies_refused",
            "Copies a follower refused (stale_epoch, owner: it holds the slot, out_of_sync)",
            ["reason"],
            registry=registry,
        )


class _Shipper:
    """The ordered copies to one follower."""

    def __init__(self, endpoint: str, slot: int, send: Send, read: Read) -> None:
        self._endpoint = endpoint
        self._slot = slot
        self._send = send
        self._read = read
        self.caught_up = 0  # messages sent again to this follower because it was behind
        self._queue: list[_Item] = []
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"lmq-replica-{endpoint}")

    def put(self, item: _Item) -> None:
        self._queue.append(item)
        self._wake.set()

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            items, self._queue = self._queue, []
            while items:
                epoch = items[0][0]
                same = [i for i in items if i[0] == epoch]
                items = [i for i in items if i[0] != epoch]
                messages = [m for i in same for m in i[1]]
                results = [r for i in same for r in i[2]]
                outcome: BaseException | None = None
                try:
                    await self._ship(epoch, messages, results)
                except Exception as exc:
                    outcome = exc
                for *_, future in same:
                    if not future.done():
                        future.set_result(None) if outcome is None else future.set_exception(outcome)

    async def _ship(self, epoch: int, messages: list[model.NewMessage], results: list[model.AppendResult]) -> None:
        """Send a copy; while the follower is behind (it missed copies: down, slow, restarted), first send it what
        it lacks, read back from this broker's store."""
        data = wire.encode(self._slot, epoch, messages, results)
        for _ in range(CATCH_UP_ROUNDS):
            behind = await self._send(self._endpoint, data)
            if not behind:
                return
            await self._catch_up(epoch, behind, _starts(messages, results))
        raise errors.BrokerUnavailable(f"{self._endpoint} is still behind after {CATCH_UP_ROUNDS} catch-up copies")

    async def _catch_up(self, epoch: int, behind: dict[str, int], starts: dict[str, int]) -> None:
        missing: list[model.NewMessage] = []
        offsets: list[model.AppendResult] = []
        for topic, end in behind.items():
            start = starts.get(topic)
            if start is None or end >= start:
                raise errors.Conflict(f"{self._endpoint} is ahead of this owner in {topic} ({end} ≥ {start})")
            queue = model.QueueId(topic, 0)
            for m in await self._read(queue, end, min(start - end, CATCH_UP_BATCH)):
                missing.append(as_new(m))
                offsets.append(model.AppendResult(m.message_id, (queue,), (m.offset,), m.store_timestamp_ms))
        await self._send(self._endpoint, wire.encode(self._slot, epoch, missing, offsets))
        self.caught_up += len(missing)


def _observed(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


def _starts(messages: list[model.NewMessage], results: list[model.AppendResult]) -> dict[str, int]:
    out: dict[str, int] = {}
    for m, r in zip(messages, results, strict=True):
        for queue, offset in zip(m.queues, r.queue_offsets, strict=True):
            if queue.topic.startswith(LMQ_PREFIX):
                out.setdefault(queue.topic, offset)
    return out


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
    )


class Owner:
    """The copies of one slot this broker holds the lease of."""

    def __init__(  # noqa: PLR0917 (the owner's slot, its followers and its rule)
        self,
        leadership: Leadership,
        slot: int,
        followers: list[str],
        min_insync: int,
        send: Send,
        read: Read,
        counters: Counters,
    ) -> None:
        self._leadership = leadership
        self._slot = slot
        self._need = min_insync - 1  # followers that must have it
        self._counters = counters
        self._shippers = [_Shipper(f, slot, send, read) for f in followers]
        self._send = send
        self._followers = followers
        self._commits: dict[tuple[model.QueueId, str], wire.Commit] = {}  # the newest per key, not sent yet
        self._flushing: asyncio.Task[None] | None = None

    def admit(self) -> None:
        if self._leadership.epoch(self._slot) is None:
            self._counters.refused.labels("fenced").inc()
            raise errors.Fenced(
                f"this broker does not hold the lease of slot {self._slot} now: nothing acknowledged, try again"
            )

    async def copy(self, messages: Sequence[model.NewMessage], results: list[model.AppendResult]) -> None:
        epoch = self._leadership.epoch(self._slot)
        if epoch is None:
            self.admit()
            return
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[None]] = []
        for shipper in self._shippers:
            future: asyncio.Future[None] = loop.create_future()
            future.add_done_callback(_observed)  # with enough answers, the others are not awaited
            shipper.put((epoch, messages, results, future))
            futures.append(future)
        stored, failures = 0, []
        waiting: set[asyncio.Future[None]] = set(futures)
        while waiting and stored < self._need:
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                error = future.exception()
                if error is None:
                    stored += 1
                else:
                    failures.append(str(error))
        if stored < self._need:
            self._counters.refused.labels("insync").inc()
            raise errors.NotEnoughReplicas(
                f"not enough in-sync replicas of slot {self._slot}: {stored + 1} of {self._need + 1} stored it "
                f"({'; '.join(failures)}); try again"
            )
        if self._leadership.epoch(self._slot) != epoch:
            self.admit()

    def note_commit(self, commit: wire.Commit) -> None:
        """A commit point persisted here: sent to the followers soon, coalesced per key, one flush at a time
        (so a key's commits never arrive out of order). Asynchronous: after a failover a consumer may get
        again what it acked just before (at-least-once)."""
        self._commits[(commit.queue, commit.group)] = commit
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush(), name=f"lmq-commits-{self._slot}")

    async def _flush(self) -> None:
        try:
            while self._commits:
                epoch = self._leadership.epoch(self._slot)
                batch, self._commits = list(self._commits.values()), {}
                if epoch is None:
                    return  # fenced: the new owner's commits count
                data = wire.encode(self._slot, epoch, [], [], batch)
                await asyncio.gather(*(self._send(f, data) for f in self._followers), return_exceptions=True)
        finally:
            self._flushing = None

    async def close(self) -> None:
        if self._flushing is not None:
            self._flushing.cancel()
        await asyncio.gather(*(s.close() for s in self._shippers))


def first_offsets(copy: wire.Copy) -> dict[model.QueueId, int]:
    """Each lite topic queue of the copy and the owner's first offset in it."""
    out: dict[model.QueueId, int] = {}
    for message, offsets in zip(copy.messages, copy.offsets, strict=True):
        for queue, offset in zip(message.queues, offsets, strict=True):
            if queue.topic.startswith(LMQ_PREFIX) and queue not in out:
                out[queue] = offset
    return out
