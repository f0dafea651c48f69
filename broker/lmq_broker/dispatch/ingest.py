"""The one door for writes: every append of this broker, sends and dead letters alike, goes through ``Ingest``.

What was appended must reach the recent-message cache (so that handing it out needs no store read) and must
wake whoever waits for it. Dead letters once went to the store by a side door and woke no reader of
``%DLQ%<group>``; with one door, a dead letter is an arrival like any other.

Arrivals are coalesced: the topics of every append of one loop pass are handed to the reading side once, at
the end of the pass, in the order they were written (``Readers.arrived``). Ingest knows that side only
through the ``Readers`` Protocol; it never looks at subscriptions, ready sets or leases.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from itertools import chain, filterfalse
from operator import attrgetter, itemgetter, methodcaller
from typing import Protocol

from lmq_broker import model
from lmq_broker.dispatch import appender, quotas, recent, runtime

_queues_of = attrgetter("queues")
_topic_of = itemgetter(0)  # of a QueueId
_is_lmq_topic = methodcaller("startswith", model.LMQ_PREFIX)


class Readers(Protocol):
    """The side that hands messages out, as ingest sees it."""

    def subscribed(self) -> AbstractSet[str]:
        """The LMQs someone on this broker subscribes to (their messages are worth keeping in memory)."""
        ...

    def arrived(self, topics: dict[str, None]) -> None:
        """Topics appended to since the last call, in order; called once per loop pass, and owns ``topics``."""
        ...


class Replicas(Protocol):
    """The copies of this broker's slot on its followers (``lmq_broker.replication``); None with --replicas 1."""

    def admit(self, messages: Sequence[model.NewMessage]) -> Sequence[model.NewMessage]:
        """Raise ``errors.Fenced`` unless this broker may acknowledge ``messages`` now (it holds their slots'
        leases); else ``messages`` stamped with their slots' epochs (stored with them)."""
        ...

    async def copy(self, messages: Sequence[model.NewMessage], results: list[model.AppendResult]) -> None:
        """Return once enough followers stored ``messages`` as ``results`` say (``errors.NotEnoughReplicas``, or
        ``errors.Fenced`` when the lease was lost meanwhile: the send is not acknowledged)."""
        ...

    def forget(self, topic: str) -> None:
        """``topic`` was deleted: what is remembered of it (its recorded slot) is forgotten."""
        ...


class Ingest:
    readers: Readers  # wired by the dispatcher once the reading side exists
    replicas: Replicas | None = None  # wired by the app with --replicas > 1

    def __init__(self, rt: runtime.Runtime) -> None:
        self._rt = rt
        self.recent = recent.RecentMessages()
        self._appender: appender.Appender | None = None
        self._buckets: dict[str, quotas.TokenBucket] = {}
        self._arrived: dict[str, None] = {}
        self._flush_scheduled = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._appender = appender.Appender(self._rt.store, loop)

    async def close(self) -> None:
        if self._appender is not None:
            await self._appender.aclose()

    @property
    def stats(self) -> appender.AppendStats:
        return appender.AppendStats(0, 0, 0.0) if self._appender is None else self._appender.stats

    async def send(self, messages: Sequence[model.NewMessage]) -> list[model.AppendResult]:
        """A producer's messages: enforce send quotas, then append (one store call: the batch shares one fsync)."""
        rt = self._rt
        snap = await rt.metadata()
        quotas.check_send_rates(snap, self._buckets, messages, rt.clock())
        check = quotas.lite_topic_check(rt.store, snap, messages)
        if check is not None:
            await rt.run(check)
        if self.replicas is not None:
            return await self._replicated(self.replicas, messages)
        assert self._appender is not None, "Dispatcher.start() was not awaited"
        results = await self._appender.append(messages)
        self._appended(messages, results)
        return results

    async def append(self, messages: Sequence[model.NewMessage]) -> list[model.AppendResult]:
        """Append what the broker writes itself: no quota applies."""
        if self.replicas is not None:
            return await self._replicated(self.replicas, messages)
        return await self.append_copy(messages)

    async def _replicated(self, replicas: Replicas, messages: Sequence[model.NewMessage]) -> list[model.AppendResult]:
        """Stored here and on enough followers, or an error: never acknowledged by a fenced owner."""
        messages = replicas.admit(messages)
        results = await self.append_copy(messages)
        await replicas.copy(messages, results)
        return results

    async def append_copy(self, messages: Sequence[model.NewMessage]) -> list[model.AppendResult]:
        """Append without copying to followers: a follower's copy of its owner's batch."""
        assert self._appender is not None, "Dispatcher.start() was not awaited"
        results = await self._appender.append(messages)
        self._appended(messages, results)
        return results

    def _appended(self, messages: Sequence[model.NewMessage], results: list[model.AppendResult]) -> None:
        topics = dict.fromkeys(map(_topic_of, chain.from_iterable(map(_queues_of, results))))  # in C, in order
        # Kept for quick delivery: messages of normal topics, and of the LMQs someone here subscribes to.
        readers = {*(self.readers.subscribed() & topics.keys()), *filterfalse(_is_lmq_topic, topics)}
        self.recent.add(messages, results, readers)
        self.notify_appended(topics)

    def notify_appended(self, topics: dict[str, None]) -> None:
        """Called after an append with the topics it touched, in order. Coalesced: one flush per loop pass,
        and it owns ``topics`` from here on."""
        if self._arrived:
            self._arrived.update(topics)
        else:
            self._arrived = topics
        if not self._flush_scheduled and self._arrived:
            self._flush_scheduled = True
            (self._rt.loop or asyncio.get_running_loop()).call_soon(self._flush)

    def flush(self) -> None:
        """Hand arrivals over now rather than at the end of the pass (a receive about to wait must see them)."""
        if self._arrived:
            self._flush()

    def _flush(self) -> None:
        self._flush_scheduled = False
        arrived, self._arrived = self._arrived, {}
        if arrived:  # empty when ``flush`` ran ahead of this scheduled call
            self.readers.arrived(arrived)
