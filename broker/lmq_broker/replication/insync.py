"""A held slot's in-sync replicas (Kafka's ISR), recorded in its Lease by this broker, its holder.

The rule every write keeps: *every replica in the recorded set holds every message acknowledged in the set's
epoch*, so any of them may take the lease over without losing one (``leadership`` lets only members do so).

* **Shrink before acknowledging.** A send is acknowledged only once every member (and every follower joining)
  answered for it; one that failed or lost its batch is removed from the set, the lease written, *before* the
  answer goes out (``Owner.copy``). Never below --min-insync-replicas: then the send is refused instead, and
  the members stay (they miss no acknowledged message, so they may still take over). At
  --min-insync-replicas 1 nobody waits: a failed member is removed soon after, and an acknowledged message
  may be missing from a member meanwhile (asynchronous replication).
* **Grow once caught up.** A follower outside the set is probed (``shipping``); once a probe succeeded it is
  *joining*: sends numbered after that wait for it as for a member. When every batch numbered up to the join
  was stored there too (no failure since the probe), it is added, the lease written. A message acknowledged
  before it joined was numbered before the join: the probe covered it, or it was stored there before the grow.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable
from typing import Any

from lmq_broker.replication.leadership import InSync, Leadership
from lmq_broker.replication.shipping import Shipper

log = logging.getLogger(__name__)


class Keeper:
    def __init__(self, leadership: Leadership, slot: int, floor: int = 1) -> None:
        self._leadership = leadership
        self._slot = slot
        self._floor = floor  # --min-insync-replicas: the set is never recorded smaller
        self.shippers: dict[int, Shipper] = {}  # follower's ring slot -> its shipper
        self.joining: dict[int, int] = {}  # follower -> the last batch numbered when it began to join
        self._ok_from: dict[int, int] = {}  # member -> its shipper's clean_from when it was last seen in the set
        self._on: dict[int, list[tuple[int, asyncio.Future[None]]]] = {}  # follower -> (batch, waiter) (``wait``)
        self._tasks: set[asyncio.Task[object]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None  # the running loop, at the first ``wait``

    def recorded(self) -> InSync:
        return self._leadership.in_sync(self._slot)

    def awaited(self) -> list[int]:
        """The followers a send waits for: members of the set and those joining it."""
        return sorted({*(f for f in self.recorded() if f != self._leadership.me), *self.joining})

    def wants_probe(self, shipper: Shipper) -> bool:
        f = shipper.follower
        return f not in self.recorded() and f not in self.joining and not shipper.complete()

    async def wait(self, timeout_s: float, on: tuple[int, int] | None = None) -> None:
        """Until something changed (a call answered, the set written) or ``timeout_s``. With ``on`` (follower,
        batch), an answer of that member for earlier batches only, all stored, does not wake it: nothing changed
        for a later batch (every send waits here at M > 1; woken by every answer, it was one wake-up per waiting
        send and answer, most of them for nothing)."""
        key, n = (-1, -1) if on is None else on
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        entry = (n, future)
        self._on.setdefault(key, []).append(entry)

        def expired() -> None:
            if not future.done():
                future.set_result(None)
                self._drop(key, entry)

        # a timer of the loop, not ``wait_for`` (a task per waiter) nor ``asyncio.timeout`` (three loop lookups
        # per send, each a getpid syscall on Python 3.11: ~3 % of the owner's CPU at R=2 M=2, profiled)
        timer = loop.call_later(timeout_s, expired)
        try:
            await future
        finally:
            timer.cancel()
            if future.cancelled():  # the send went away (woken or timed out, the entry is gone already)
                self._drop(key, entry)

    def _drop(self, key: int, entry: tuple[int, asyncio.Future[None]]) -> None:
        if entry in (waiting := self._on.get(key, [])):
            waiting.remove(entry)

    def _pulse(self) -> None:
        """Something changed for every waiter."""
        on, self._on = self._on, {}
        _wake(future for waiters in on.values() for _, future in waiters)

    def _answered(self, follower: int, done: int) -> None:
        """A member answered for batches up to ``done``, all stored: its waiters for those batches, and those
        waiting for any change, look again; its waiters for later batches wait on."""
        waiting = self._on.get(follower, [])
        self._on[follower] = [(n, future) for n, future in waiting if n > done]
        _wake([future for n, future in waiting if n <= done] + [future for _, future in self._on.pop(-1, [])])

    def changed(self, shipper: Shipper) -> None:
        """A shipper's call, probe or drop ended: join, grow or shrink accordingly."""
        f, recorded = shipper.follower, self.recorded()
        if f in recorded:
            if shipper.clean_from > self._ok_from.get(f, 1):  # a batch failed since it was seen in the set
                self._spawn(self.shrink([f]))
            else:  # stored there, nothing else changed: only the waiters it answered for have news
                self._answered(f, shipper.done)
                return
        elif f in self.joining:
            if not shipper.complete():
                del self.joining[f]
            elif shipper.done >= self.joining[f]:
                self._spawn(self._grow(shipper))
        elif shipper.complete():
            self.joining[f] = shipper.seq
            log.info("slot %d: replica %d caught up, joining the in-sync set", self._slot, f)
            if shipper.done >= shipper.seq:
                self._spawn(self._grow(shipper))
        self._pulse()

    async def shrink(self, followers: Iterable[int]) -> bool:
        """Remove ``followers`` from the set (and from those joining); True once the lease says so. Never
        below --min-insync-replicas: a send that would need that is refused instead, and members that hold
        every acknowledged message stay eligible to take over (Kafka's eligible leader replicas)."""
        gone = set(followers)
        for f in gone:
            self.joining.pop(f, None)
        if not gone & set(self.recorded()):
            return True
        floor = self._floor
        written = await self._leadership.record(
            self._slot, lambda now: kept if len(kept := tuple(f for f in now if f not in gone)) >= floor else now
        )
        out = written is not None and not gone & set(written)
        if out:
            log.warning("slot %d: in-sync replicas now %s (%s failed or lagged)", self._slot, written, sorted(gone))
        elif written is not None:  # kept: nothing is acknowledged without them, so they miss nothing acknowledged
            for f in gone & set(written):
                self._ok_from[f] = self.shippers[f].clean_from if f in self.shippers else 1
        self._pulse()
        return out

    async def _grow(self, shipper: Shipper) -> None:
        f = shipper.follower
        if f not in self.joining or not shipper.complete() or shipper.done < self.joining[f]:
            return
        ok_from = shipper.clean_from
        written = await self._leadership.record(self._slot, lambda now: (*now, f))
        if written is not None:
            self._ok_from[f] = ok_from
            self.joining.pop(f, None)
            if shipper.clean_from != ok_from:  # it failed while the lease was written: out again
                await self.shrink([f])
                return
            log.info("slot %d: in-sync replicas now %s", self._slot, written)
        self._pulse()

    def _spawn(self, work: Coroutine[Any, Any, object]) -> None:
        task = asyncio.get_running_loop().create_task(work, name=f"lmq-insync-{self._slot}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _wake(futures: Iterable[asyncio.Future[None]]) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)
