"""Consumers follow the lease: when a slot's lease moves to another broker, the subscriptions this broker keeps
for the clients that call it (``cluster.fanout``'s intents) to that slot's topics are made at the new holder.

Sends, routes and assignments follow the holder by themselves (``cluster.owners.serving``); a subscription is
state at the broker that delivers, so the new holder must be told who consumes the slot's topics. Every broker
reads every slot's lease each renewal interval, and each gives the new holder the part of the intents it keeps
(``Fanout.repush``: PARTIAL_ADD, idempotent), the new holder itself included. A push that fails is tried again
at the next interval. The new holder then delivers from the consumer group's commit point, which the old owner
copied to it (``copies``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

Serving = Callable[[int], int]  # slot -> the slot whose broker holds its lease
Repush = Callable[[int], Awaitable[tuple[int, int]]]  # slot -> (lite topics made there, not made)


class Handover:
    def __init__(self, serving: Serving, slots: int, repush: Repush) -> None:
        self._serving = serving
        self._repush = repush
        self._last = list(range(slots))  # each slot serves itself until a lease says otherwise
        self._due: set[int] = set()  # holders still to be given their new slots' subscriptions
        self._task: asyncio.Task[None] | None = None
        self.pushed = 0  # lite topics and patterns made at new holders

    def resize(self, slots: int) -> None:
        """Another ring: a new slot serves itself until a lease says otherwise; a removed one is no longer
        checked."""
        self._last = self._last[:slots] + list(range(len(self._last), slots))

    def check(self) -> None:
        """Compare each slot's holder with the last check; a changed one gets its subscriptions (in a task)."""
        now = [self._serving(slot) for slot in range(len(self._last))]
        for slot, (was, holder) in enumerate(zip(self._last, now, strict=True)):
            if was != holder:
                log.info("slot %d is served by slot %d now: its consumers' subscriptions are made there", slot, holder)
                self._due.add(holder)
        self._last = now
        if self._due and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._push(), name="lmq-handover")

    async def run(self, stopping: asyncio.Event, interval_s: float) -> None:
        while not stopping.is_set():
            self.check()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), interval_s)

    async def _push(self) -> None:
        for holder in sorted(self._due):
            self._due.discard(holder)
            try:
                pushed, failed = await self._repush(holder)
            except Exception as exc:  # the holder does not answer yet: tried again at the next check
                log.warning("subscriptions not given to slot %d yet: %s", holder, exc)
                self._due.add(holder)
                continue
            self.pushed += pushed
            if failed:
                self._due.add(holder)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
