"""A leaving broker (scale-down) stores what its groups have not consumed of its other queues at a remaining one.

Lite topics drain where they are and move whole (``draining``). The queues that are not lite topics (NORMAL
topics and dead letters, ``%DLQ%<group>``) belong to no owner: each broker keeps what was sent to it, and a
consumer group receives from every broker. So once a broker is leaving (routes list it READ: producers send it
nothing more), every ``RELOCATE_EVERY_S`` it copies each such queue's messages to one remaining broker, which
appends them to its own queue of that topic with the same ids and properties (``StoreRelocated``, a peer's
call). It copies from the lowest start of the groups that consume the topic here: those with a commit point in
some queue of the topic, and those of the consumers that told this broker they consume it (their Telemetry
settings; the clients it remembers, ``client_expiry_ms``); a group with no point in the queue starts at its
first message, and the whole queue is copied when no group is known. The groups with a commit point for the
topic at a remaining broker count too (asked once a pass, ``CommittedGroups``): one that never consumed here
and whose consumers were down meanwhile starts here at each queue's first offset when it comes back. While a
remaining broker does not answer, any group may: every queue is copied (and counted) from its first offset.

It records how far each queue got (``Store.put_relocated``, synced) only after the remaining broker answered
that the batch is stored: a crash (kill -9) between the two sends the batch again, so a message may be stored
twice there, never lost (at least once). A message that arrives here later (a producer on an old route) is
copied at the next pass. The leaving broker keeps serving its copies until it is removed: a consumer may get a
message from both (at least once again). What is left to copy counts as undrained (``undrained``), so the
broker is removed only once every such message is at a remaining broker.

Each queue goes to one remaining broker (its name and queue id hashed over today's ring), so a FIFO queue's
messages keep their order there; a broker that does not answer is passed over for the next slot of today's
ring, and a pass that fails is tried again at the next one. A broker that did not answer in time may have
stored the batch: it is asked again (never the next one), and it stores only what it does not hold yet from
this broker's queue (``relocated_from``), so a retried batch is not stored twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Final, NamedTuple, cast

from prometheus_client import CollectorRegistry, Counter

from lmq_broker import errors, model
from lmq_broker.cluster import ring
from lmq_broker.dispatch import metadata
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as admin_pb
from lmq_broker.storage.api import Store

log = logging.getLogger(__name__)

RELOCATE_EVERY_S: Final = 1.0
BATCH_MESSAGES: Final = 500  # messages per StoreRelocated call at most
QUEUES_PAGE: Final = 1_000

SAME_SLOT_TRIES: Final = 3  # a broker that did not answer in time is asked again before the pass gives up
# (slot of today's ring, messages) -> once that broker stored them durably; raises ``Unanswered`` when it may
# have (a timeout), another LmqError when it did not
Send = Callable[[int, Sequence[model.StoredMessage]], Awaitable[None]]
# topic -> groups known to consume it (their consumers' Telemetry settings here; commit points elsewhere)
Consumers = Mapping[str, Collection[str]]
# topics -> the groups with a commit point in them at the remaining brokers; None when one did not answer
Committed = Callable[[Collection[str]], Awaitable[Consumers | None]]
ANY_TOPIC: Final = ""  # a key of Consumers: groups of every topic
# no broker could rule out a group (one did not answer): a group that has no point anywhere here (no name
# has), so every queue counts from its first offset
UNKNOWN: Final[Consumers] = {ANY_TOPIC: ("",)}


class Unanswered(errors.BrokerUnavailable):
    """A remaining broker did not answer in time: it may have stored the batch (ask it again, not the next)."""


class Pending(NamedTuple):
    queue: model.QueueId
    start: int  # the first offset still to be copied
    end: int  # the queue's end when looked at


def start_of(store: Store, queue: model.QueueId, groups: Collection[str] = ()) -> Pending:
    """Blocking. What of ``queue`` is to be copied: from the lowest commit point of ``groups`` (the groups that
    consumed some queue of its topic here; a group without a point in this queue starts at its first message, so
    it counts as the queue's first offset) and of any other group with a point in it (all of it when no group
    did), or from where earlier copies got to, to its end."""
    lo, hi = store.queue_offsets(queue)
    points = store.commit_points(queue)
    starts = [points.get(group, lo) for group in {*groups, *points}]
    consumed = min(starts) if starts else lo
    return Pending(queue, max(lo, consumed, store.relocated(queue)), hi)


def pending(store: Store, consumers: Consumers | None = None) -> list[Pending]:
    """Blocking. Every queue of this store's NORMAL topics and dead letters that has something to copy, for the
    groups with a commit point in some queue of its topic here and those of ``consumers``. Other
    queues that are not lite topics are passed over: a LITE parent's own queue (``--index-parent-queue``: its
    messages are its lite topics', which drain as those), and the queues of a topic deleted since (nobody can
    receive them any more, and the remaining brokers refuse them)."""
    normal = {t.name for t in store.list_parent_topics() if t.message_type != model.MessageType.LITE}
    queues: list[model.QueueId] = []
    after: model.QueueId | None = None
    while True:
        page = store.normal_queues(after, QUEUES_PAGE)
        queues += (q for q in page if q.topic in normal or q.topic.startswith(metadata.DLQ_PREFIX))
        if len(page) < QUEUES_PAGE:
            break
        after = page[-1]
    groups: defaultdict[str, set[str]] = defaultdict(set)  # topic -> the groups that consume it here
    for topic, names in (consumers or {}).items():
        groups[topic].update(names)
    for queue in queues:
        groups[queue.topic].update(store.commit_points(queue))
    every = groups[ANY_TOPIC]
    found = (start_of(store, queue, {*groups[queue.topic], *every}) for queue in queues)
    return [p for p in found if p.start < p.end]


def undrained(store: Store, consumers: Consumers | None = None) -> int:
    """Blocking. Messages of this store's queues that are not lite topics still to be copied by a leaving broker."""
    return sum(p.end - p.start for p in pending(store, consumers))


def batch(store: Store, job: Pending, max_bytes: int) -> tuple[list[model.StoredMessage], int]:
    """Blocking. The next messages of ``job`` from its start (at most ``BATCH_MESSAGES``, and ``max_bytes`` of
    bodies unless a single message is bigger), and the offset after them (offsets the store knows are gone are
    passed over)."""
    messages, after = store.read_span(job.queue, job.start, min(BATCH_MESSAGES, job.end - job.start))
    size = 0
    for i, message in enumerate(messages):
        size += len(message.body)
        if size > max_bytes and i > 0:
            return messages[:i], message.offset
    return messages, after


def destination(queue: model.QueueId, size: int, attempt: int) -> int:
    """The slot of today's ring (``size`` slots) a queue's messages go to; ``attempt`` > 0: the next ones."""
    return (ring.slot_of(f"{queue.topic}\x00{queue.queue}", size) + attempt) % size


class Relocator:
    """One leaving broker's copies of its queues that are not lite topics (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        send: Send,
        max_bytes: int,
        registry: CollectorRegistry,
        *,
        consumers: Callable[[], Consumers] = dict,
        committed: Committed | None = None,
    ) -> None:
        self._store = store
        self._send = send
        self._consumers = consumers  # on the loop
        self._committed = committed
        # the remaining brokers' groups by topic at the last pass (UNKNOWN until all of them answered one)
        self.remote: Consumers = UNKNOWN if committed is not None else {}
        self._max_bytes = max_bytes
        self.copied = Counter(
            "lmq_relocated_messages",
            "Messages of NORMAL topics and dead letters a leaving broker stored at a remaining one (scale-down)",
            registry=registry,
        )

    async def run(self, size: Callable[[], int], stopping: asyncio.Event) -> None:
        """Until ``stopping`` is set: a pass every ``RELOCATE_EVERY_S`` while ``size`` (today's ring, 0: this
        broker is not leaving) is positive. A failed pass is logged and tried again at the next."""
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), RELOCATE_EVERY_S)
            slots = size()
            if slots <= 0 or stopping.is_set():
                continue
            try:
                await self.relocate(slots)
            except errors.LmqError as exc:
                log.info("copying NORMAL messages and dead letters to remaining brokers: %s (next pass)", exc.message)
            except Exception:  # the loop must outlive any one pass
                log.exception("copying NORMAL messages and dead letters to remaining brokers failed (next pass)")

    async def relocate(self, slots: int) -> int:
        """One pass: every queue's messages to copy, stored at a remaining broker; returns how many."""
        copied = 0
        failed: list[str] = []
        for found in await self._pending():
            try:
                copied += await self._copy(found, slots)
            except errors.LmqError as exc:  # this queue waits for the next pass; the others go on
                failed.append(exc.message)
        if copied:
            log.info("%d NORMAL messages and dead letters copied to remaining brokers", copied)
        if failed:
            raise errors.BrokerUnavailable(f"{len(failed)} queues not copied, first: {failed[0]}")
        return copied

    def groups(self) -> Consumers:
        """On the loop. The groups a copy (and the undrained count) is for: those of the consumers that told this
        broker, and those with a commit point at the remaining brokers at the last pass (``UNKNOWN`` while one
        did not answer)."""
        merged: defaultdict[str, set[str]] = defaultdict(set)
        for part in (self._consumers(), self.remote):
            for topic, names in part.items():
                merged[topic].update(names)
        return merged

    async def _pending(self) -> list[Pending]:
        """What this pass copies. The remaining brokers are asked once for the groups of every topic with
        something not copied yet from its first offset (none: no need to ask)."""
        if self._committed is not None:
            anything = await asyncio.to_thread(pending, self._store, UNKNOWN)
            topics = sorted({job.queue.topic for job in anything})
            answer = await self._committed(topics) if topics else {}
            self.remote = UNKNOWN if answer is None else answer
        return await asyncio.to_thread(pending, self._store, self.groups())

    async def _copy(self, job: Pending, slots: int) -> int:
        copied = 0
        while job.start < job.end:
            messages, after = await asyncio.to_thread(batch, self._store, job, self._max_bytes)
            if after <= job.start:  # nothing readable there now: the next pass tries again
                break
            if messages:
                await self._store_at_remaining(job.queue, messages, slots)
            await asyncio.to_thread(self._store.put_relocated, job.queue, after)
            copied += len(messages)
            self.copied.inc(len(messages))
            job = job._replace(start=after)
        return copied

    async def _store_at_remaining(
        self, queue: model.QueueId, messages: Sequence[model.StoredMessage], slots: int
    ) -> None:
        failures = []
        for attempt in range(slots):
            slot = destination(queue, slots, attempt)
            for _ in range(SAME_SLOT_TRIES):
                try:
                    await self._send(slot, messages)
                    return
                except Unanswered as exc:  # it may hold the batch: ask it again, it stores only what it lacks
                    failures.append(f"slot {slot}: {exc.message}")
                except errors.LmqError as exc:
                    failures.append(f"slot {slot}: {exc.message}")
                    break
            else:  # never the next slot after a timeout (the batch may be stored twice): the next pass
                break
        raise errors.BrokerUnavailable(
            f"{queue.topic} queue {queue.queue}: no remaining broker stored it ({'; '.join(failures)})"
        )


def to_wire(message: model.StoredMessage) -> admin_pb.RelocatedMessage:
    return admin_pb.RelocatedMessage(
        topic=message.topic,
        queue=message.queue.queue,
        message_id=message.message_id,
        body=message.body,
        born_timestamp_ms=message.born_timestamp_ms,
        born_host=message.born_host,
        tag=message.tag or "",
        keys=message.keys,
        message_group=message.message_group or "",
        user_properties=message.user_properties,
        message_type=int(message.message_type),
        source_offset=message.offset,
    )


def committed_groups(store: Store, topics: Collection[str]) -> dict[str, set[str]]:
    """Blocking. The groups with a commit point in some queue of each of ``topics`` at this store (the
    remaining broker's side of ``CommittedGroups``)."""
    wanted = set(topics)
    out: dict[str, set[str]] = {}
    after: model.QueueId | None = None
    while wanted:
        page = store.normal_queues(after, QUEUES_PAGE)
        for queue in page:
            if queue.topic in wanted:
                out.setdefault(queue.topic, set()).update(store.commit_points(queue))
        if len(page) < QUEUES_PAGE:
            break
        after = page[-1]
    return out


def new_tail(
    store: Store, source: str, sent: Sequence[admin_pb.RelocatedMessage]
) -> tuple[list[admin_pb.RelocatedMessage], int]:
    """Blocking. Of one queue's batch from leaving broker ``source``, what this store does not hold yet (a retry
    of a batch it stored), and the end (source offsets) it holds once that is stored."""
    if not source or not sent:
        return list(sent), 0
    queue = model.QueueId(sent[0].topic, sent[0].queue)
    if queue.queue < 0 or any(m.topic != queue.topic or m.queue != queue.queue for m in sent):
        raise errors.InvalidArgument("a relocated batch is of one queue, its id not negative", kind="messages")
    held = store.relocated_from(source, queue)
    return [m for m in sent if m.source_offset >= held], max(held, max(m.source_offset for m in sent) + 1)


class Receiver:
    """A remaining broker's side of ``StoreRelocated``: one queue's batch from a leaving broker appended here
    (``append``, as ``from_wire`` makes them of the current metadata), but for what this broker holds of that
    queue already (``new_tail``), and how far it got recorded. One batch per (source, topic, queue) at a time.
    The append and the record run in a task of their own that the caller's cancellation does not stop (a call
    whose deadline passed is cancelled; the append it queued is made all the same): before, a cancelled call
    left the appended batch unrecorded and let the retry in at once, which stored it again."""

    def __init__(
        self,
        store: Store,
        run: Callable[..., Awaitable[object]],
        append: Callable[[list[model.NewMessage]], Awaitable[object]],
        snapshot: Callable[[], Awaitable[metadata.Metadata]],
    ) -> None:
        self._store = store
        self._run = run
        self._append = append
        self._snapshot = snapshot
        # (source, topic, queue) -> its lock and how many calls use it (dropped when none does)
        self._locks: dict[tuple[str, str, int], tuple[asyncio.Lock, list[int]]] = {}
        self._storing: set[asyncio.Task[int]] = set()

    @property
    def busy(self) -> int:
        """Keys with a batch being stored or waiting (their locks; none is kept once idle)."""
        return len(self._locks)

    async def receive(self, messages: Sequence[admin_pb.RelocatedMessage], source: str) -> int:
        """Stores what is new of ``messages``; how many. Finishes even when the caller is cancelled."""
        if not messages:
            return 0
        task = asyncio.get_running_loop().create_task(self._receive(messages, source))
        self._storing.add(task)
        task.add_done_callback(self._stored)
        return await asyncio.shield(task)

    def _stored(self, task: asyncio.Task[int]) -> None:
        self._storing.discard(task)
        if not task.cancelled() and (failed := task.exception()) is not None:  # retrieved: its caller may be gone
            log.info("a relocated batch was not stored: %s", failed)

    async def _receive(self, messages: Sequence[admin_pb.RelocatedMessage], source: str) -> int:
        key = (source, messages[0].topic, messages[0].queue)
        lock, users = self._locks.setdefault(key, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                found = await self._run(new_tail, self._store, source, messages)
                fresh, end = cast("tuple[list[admin_pb.RelocatedMessage], int]", found)
                if fresh:
                    snap = await self._snapshot()
                    await self._append([from_wire(snap, m) for m in fresh])
                if source:
                    queue = model.QueueId(messages[0].topic, messages[0].queue)
                    await self._run(self._store.put_relocated_from, source, queue, end)
                return len(fresh)
        finally:
            users[0] -= 1
            if not users[0]:
                del self._locks[key]


def from_wire(snap: metadata.Metadata, sent: admin_pb.RelocatedMessage) -> model.NewMessage:
    """A relocated message as this broker stores it: in its own queue of the topic (the queue id modulo its
    queue count). A lite topic, a LITE parent or a topic this broker does not have is refused."""
    if not model.is_valid_resource_name(sent.topic):
        raise errors.InvalidName(f"illegal topic name {sent.topic[:160]!r}", kind="topic")
    topic = snap.topic(sent.topic)
    if topic.message_type == model.MessageType.LITE:
        raise errors.InvalidArgument(f"{sent.topic} is a LITE parent topic: its messages are not relocated")
    try:
        kind = model.MessageType(sent.message_type)
    except ValueError:
        raise errors.InvalidArgument(f"unknown message type {sent.message_type}", kind="message_type") from None
    if not sent.message_id:
        raise errors.InvalidArgument("a relocated message needs its message id", kind="message_id")
    return model.NewMessage(
        sent.message_id,
        sent.topic,
        sent.body,
        (model.QueueId(sent.topic, max(sent.queue, 0) % max(1, topic.queue_count)),),
        None,
        kind,
        sent.born_timestamp_ms,
        sent.born_host,
        sent.tag or None,
        tuple(sent.keys),
        sent.message_group or None,
        dict(sent.user_properties),
    )
