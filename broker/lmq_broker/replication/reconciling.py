"""A follower's reconciling, tried again until it is in sync: the liveness half of "only an in-sync follower
takes a slot over".

A follower out of sync with a slot's holder (just started, the holder changed, a copy found it behind, a
batch of state rows missed, or its last reconcile failed: a call timed out under load, the holder refused)
cannot take the slot over, so if the holder dies then, nobody does until a replica with the data returns. So
it does not wait: falling out of sync wakes this loop at once, and a reconcile that fails or must be done
again (the holder changed meanwhile, a copy found it behind meanwhile) is tried again after a capped
exponential backoff with jitter (``Backoff``: 0.1 s doubling up to a third of the lease, each wait drawn
from its upper half), until the slot is in sync. One attempt per slot at a time, each slot on its own task
(a holder that does not answer delays no other slot). Counted in ``lmq_replication_reconciles_total{result}``
(``ok``, ``failed``: an error, ``again``: done but not counted); a failure is logged at WARNING, the
attempt that brings a slot back after failures at INFO.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Final

from prometheus_client import CollectorRegistry, Counter

from lmq_broker import errors
from lmq_broker.replication import events
from lmq_broker.replication.following import Follower
from lmq_broker.replication.leadership import Leadership

log = logging.getLogger(__name__)

BACKOFF_FIRST_S: Final = 0.1
RESULTS: Final = ("ok", "failed", "again")

Attempt = Callable[[int], Awaitable[bool]]  # slot -> True once in sync (``Replication._reconcile``)


class Backoff:
    """Capped exponential backoff with jitter: the n-th wait in a row is drawn from [c/2, c], c = min(cap,
    first * 2^(n-1)) (so followers that failed together do not retry together)."""

    def __init__(self, first_s: float, cap_s: float, draw: Callable[[], float] = random.random) -> None:
        self._first = first_s
        self._cap = max(first_s, cap_s)
        self._draw = draw
        self.failures = 0

    def next(self) -> float:
        self.failures += 1
        ceiling: float = min(self._cap, self._first * 2.0 ** min(self.failures - 1, 30))
        return ceiling * (0.5 + 0.5 * self._draw())


class Reconciler:
    def __init__(  # noqa: PLR0917 (the follower's doors and the test failpoint)
        self,
        leadership: Leadership,
        follower: Follower,
        attempt: Attempt,
        registry: CollectorRegistry,
        cap_s: float,
        failpoint: Callable[[], bool] | None = None,
    ) -> None:
        self._leadership = leadership
        self._follower = follower
        self._attempt = attempt
        self._cap_s = cap_s
        self._failpoint = failpoint  # tests: True while every attempt is to fail (as a timed-out call would)
        self._counts = Counter(
            "lmq_replication_reconciles",
            "A follower's reconciles with its slots' holders, by result (ok, failed: an error, again: retried)",
            ["result"],
            registry=registry,
        )
        for result in RESULTS:
            self._counts.labels(result)
        self._wake = events.Signal()
        follower.on_out_of_sync = lambda slot: self._wake.set()
        self._backoff: dict[int, Backoff] = {}  # slot out of sync -> its backoff
        self._due: dict[int, float] = {}  # slot -> monotonic time of its next attempt
        self._began: dict[int, float] = {}  # slot -> when its first attempt since it was last in sync began
        self._tasks: dict[int, asyncio.Task[None]] = {}

    async def run(self, stopping: asyncio.Event, each: Callable[[], None] = lambda: None) -> None:
        """Until ``stopping``: each turn calls ``each`` and starts an attempt for every slot out of sync whose
        time has come; a turn comes at least every ``cap_s``, and at once when a slot falls out of sync."""
        try:
            while not stopping.is_set():
                self._wake.clear()
                each()
                now = time.monotonic()
                for slot in self._leadership.mine:
                    self._consider(slot, now)
                waits = [due - now for slot, due in self._due.items() if slot not in self._tasks]
                timeout = max(0.0, min([self._cap_s, *waits]))
                await events.nap(timeout, stopping, self._wake)
        finally:
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _consider(self, slot: int, now: float) -> None:
        leadership = self._leadership
        epoch = leadership.epochs.get(slot)
        if leadership.holds(slot) or epoch is None or self._follower.in_sync(slot, epoch):
            self._backoff.pop(slot, None)
            self._due.pop(slot, None)
            self._began.pop(slot, None)
            return
        if slot in self._tasks or now < self._due.get(slot, 0.0):
            return
        self._began.setdefault(slot, now)
        self._tasks[slot] = asyncio.get_running_loop().create_task(self._once(slot), name=f"lmq-reconcile-{slot}")

    async def _once(self, slot: int) -> None:
        try:
            if self._failpoint is not None and self._failpoint():
                raise errors.BrokerUnavailable("the holder's answer did not come (failpoint)")
            done = await self._attempt(slot)
        except Exception as exc:  # a holder down, slow or refusing: tried again after the backoff
            self._retry(slot, "failed", exc)
        else:
            if done:
                self._done(slot)
            else:
                self._retry(slot, "again", None)
        finally:
            self._tasks.pop(slot, None)
            self._wake.set()

    def _done(self, slot: int) -> None:
        self._counts.labels("ok").inc()
        backoff = self._backoff.pop(slot, None)
        self._due.pop(slot, None)
        began = self._began.pop(slot, time.monotonic())
        if backoff is not None and backoff.failures:
            log.info(
                "slot %d: in sync again after %d attempts that failed or had to be repeated, %.2f s after the first",
                slot, backoff.failures, time.monotonic() - began,
            )  # fmt: skip

    def _retry(self, slot: int, result: str, exc: Exception | None) -> None:
        self._counts.labels(result).inc()
        backoff = self._backoff.get(slot)
        if backoff is None:
            backoff = self._backoff[slot] = Backoff(BACKOFF_FIRST_S, self._cap_s)
        wait_s = backoff.next()
        self._due[slot] = time.monotonic() + wait_s
        if exc is not None:
            tries = backoff.failures
            log.warning("slot %d: reconciling failed (attempt %d), tried again in %.2f s: %s", slot, tries, wait_s, exc)
        elif backoff.failures == 1:  # the holder changed, or a copy found it behind, meanwhile
            log.info("slot %d: reconciling to be done again, in %.2f s", slot, wait_s)
