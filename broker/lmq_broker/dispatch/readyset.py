"""Per-client queues of lite topics that have something to deliver.

A lite topic enters a client's queue when it may have work for that client's group (a message arrived,
an ack left more behind, a lease expired). The queue is a set with insertion order, so a busy topic is
queued once however many messages it gets, and it has a capacity: when it is full the topic is not
queued and the client is marked for a *catch-up* pass instead (the dispatcher later walks that client's
own subscriptions for pending work). Memory is bounded by ``clients x capacity`` and idle topics cost
nothing; nothing here ever looks at all lite topics.
"""

from __future__ import annotations

import enum
import heapq


class Offer(enum.Enum):
    ADDED = "added"
    ALREADY = "already"  # deduplicated: the client will look at that topic anyway
    FULL = "full"  # not queued; a catch-up pass was scheduled for the client


class ReadySet:
    def __init__(self, catchup_delay_ms: int = 1000) -> None:
        self._queues: dict[str, dict[str, None]] = {}
        self._catchup_at: dict[str, int] = {}
        self._catchup_heap: list[tuple[int, str]] = []
        self.catchup_delay_ms = catchup_delay_ms

    def offer(self, client_id: str, lmq: str, capacity: int, now_ms: int) -> Offer:
        queue = self._queues.get(client_id)
        if queue is None:
            queue = self._queues[client_id] = {}
        elif lmq in queue:
            return Offer.ALREADY
        if len(queue) >= capacity:
            self.request_catchup(client_id, now_ms + self.catchup_delay_ms)
            return Offer.FULL
        queue[lmq] = None
        return Offer.ADDED

    def pop(self, client_id: str, limit: int) -> list[str]:
        """Up to ``limit`` topics in the order they became ready."""
        queue = self._queues.get(client_id)
        if not queue:
            return []
        taken: list[str] = []
        for lmq in queue:
            taken.append(lmq)
            if len(taken) >= limit:
                break
        for lmq in taken:
            del queue[lmq]
        return taken

    def size(self, client_id: str) -> int:
        queue = self._queues.get(client_id)
        return len(queue) if queue else 0

    def total(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def drop_client(self, client_id: str) -> list[str]:
        """Forget a client's queue; returns what it still held, for re-dispatch to others."""
        self._catchup_at.pop(client_id, None)
        queue = self._queues.pop(client_id, None)
        return list(queue) if queue else []

    def queued(self, client_id: str) -> list[str]:
        queue = self._queues.get(client_id)
        return list(queue) if queue else []

    def discard_many(self, client_id: str, lmqs: list[str]) -> None:
        queue = self._queues.get(client_id)
        if queue:
            for lmq in lmqs:
                queue.pop(lmq, None)

    def discard(self, lmq: str, client_ids: list[str]) -> None:
        for cid in client_ids:
            queue = self._queues.get(cid)
            if queue is not None:
                queue.pop(lmq, None)

    # --- catch-up scheduling ----------------------------------------------------------------------------
    def request_catchup(self, client_id: str, at_ms: int) -> None:
        """Ask for a catch-up pass no later than ``at_ms`` (an earlier request wins)."""
        current = self._catchup_at.get(client_id)
        if current is not None and current <= at_ms:
            return
        self._catchup_at[client_id] = at_ms
        heapq.heappush(self._catchup_heap, (at_ms, client_id))

    def due_catchups(self, now_ms: int) -> list[str]:
        due: list[str] = []
        while self._catchup_heap and self._catchup_heap[0][0] <= now_ms:
            at, cid = heapq.heappop(self._catchup_heap)
            if self._catchup_at.get(cid) == at:
                del self._catchup_at[cid]
                due.append(cid)
        return due

    def next_catchup_ms(self) -> int | None:
        while self._catchup_heap:
            at, cid = self._catchup_heap[0]
            if self._catchup_at.get(cid) == at:
                return at
            heapq.heappop(self._catchup_heap)  # superseded entry
        return None

    def catchup_pending(self, client_id: str) -> bool:
        return client_id in self._catchup_at
