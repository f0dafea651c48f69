"""Lite topics a compare-and-delete is deleting, and what a new subscription to one of them does.

The subscriber check runs on the event loop and the delete in a store thread, so without a mark a
subscription made in between would be registered and then dropped by the delete. A mark is set in the
loop step that checks the subscribers and cleared, with the deleted topics forgotten, in the loop step
after the delete. While it is set, a new subscription to a marked topic either *vetoes* its deletion (the
topic is kept as KEPT_SUBSCRIBED) or, once the delete can no longer be vetoed, waits for it to finish and
is registered after it. The veto window closes inside the store call, under the store's write lock
(``Store.delete_lite_topics(keep=...)``), so a veto and the delete never overlap.

Offset writes (commit points of acks) and the delete never overlap either: the delete waits for the writes of
its topics under way when they were marked (``Mark.writes_done``; one that lands compares as a change: the
topic is kept), and a write that begins while its topic is marked waits for ``done``, then writes nothing if
the topic was deleted (its commit point must not become that of the topic a send re-creates from offset 0).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Sequence


class Mark:
    """One compare-and-delete batch. ``kept[i]``: row i was kept at the subscriber check (not marked);
    ``topics``: the marked LMQ names. ``veto`` runs on the loop, ``close`` in the store's writer thread."""

    def __init__(self, topics: Sequence[str], kept: Sequence[bool], *, vetoable: bool) -> None:
        self.topics = frozenset(topics)
        self.kept = list(kept)
        self.done = asyncio.Event()  # set on the loop once the delete is over and its topics are forgotten
        self._vetoable = vetoable  # False: subscribers do not protect these topics, they only wait
        self._lock = threading.Lock()
        self._closed = False
        self._vetoed: set[str] = set()
        self.writes: list[asyncio.Lock] = []  # the offset writes of its topics under way when it was set

    async def writes_done(self) -> None:
        """Wait for ``writes`` (held, or queued for, when the mark was set; none queues behind them for a
        marked topic: those wait for ``done``)."""
        for lock in self.writes:
            async with lock:
                pass

    def veto(self, topic: str) -> bool:
        """A new subscriber of ``topic``: True when the topic will be kept; False when the caller must wait
        for ``done`` (the delete is already under way, or subscribers do not protect the topic)."""
        with self._lock:
            if self._closed or not self._vetoable:
                return False
            self._vetoed.add(topic)
            return True

    def close(self) -> frozenset[str]:
        """No more vetoes; the topics to keep. Called once the delete holds the store's write lock."""
        with self._lock:
            self._closed = True
            return frozenset(self._vetoed)

    @property
    def vetoed(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._vetoed)


def check_and_mark(topics: Sequence[str], counts: Sequence[int], allowed: Sequence[int] | None) -> Mark:
    """The subscriber check: with ``allowed`` (subscribers the caller accepts per row), a row whose count is
    above it is kept; every other row's topic is marked. Without ``allowed`` nothing is kept or vetoable."""
    if allowed is None:
        return Mark(topics, [False] * len(topics), vetoable=False)
    kept = [count > limit for count, limit in zip(counts, allowed, strict=True)]
    return Mark([t for t, k in zip(topics, kept, strict=True) if not k], kept, vetoable=True)


class Marks:
    """The marks in force, by marked LMQ name."""

    def __init__(self) -> None:
        self._by_topic: dict[str, list[Mark]] = {}

    def __len__(self) -> int:
        """Lite topics marked right now."""
        return len(self._by_topic)

    def begin(self, topics: Sequence[str], counts: Sequence[int], allowed: Sequence[int] | None) -> Mark:
        """``check_and_mark``, and the mark in force until ``end``."""
        mark = check_and_mark(topics, counts, allowed)
        for topic in mark.topics:
            self._by_topic.setdefault(topic, []).append(mark)
        return mark

    def of(self, topic: str) -> Mark | None:
        """A mark in force on ``topic``, if any."""
        marks = self._by_topic.get(topic)
        return marks[0] if marks else None

    def end(self, mark: Mark) -> None:
        for topic in mark.topics:
            marks = self._by_topic[topic]
            marks.remove(mark)
            if not marks:
                del self._by_topic[topic]
        mark.done.set()

    def blocking(self, topics: Iterable[str]) -> Mark | None:
        """A new subscription to ``topics``: vetoes the marks on them, in order, up to the first one that takes
        no veto, which is returned (the subscriber waits for its ``done``, then asks again); None when every
        mark on them was vetoed."""
        for topic in topics:
            for mark in self._by_topic.get(topic, ()):
                if not mark.veto(topic):
                    return mark
        return None
