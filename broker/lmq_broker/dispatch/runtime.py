"""What the parts of the dispatcher share and none of them owns: the store and the thread pool its blocking
calls run on, time and the one timer, background tasks, the metadata copy, and whether the broker is closing.

``ingest``, ``subscriptions``, ``delivery`` and ``settlement`` each hold this one object rather than reaching
into each other for these. Everything runs on one asyncio loop; nothing here is touched from the pool's
threads. Time is injected (``clock``, monotonic milliseconds) so tests drive expiry with a fake clock; the
timer calls ``on_timer`` (the dispatcher's ``tick``), which does whatever is due and arms the timer again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import ParamSpec, TypeVar

from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch import metadata
from lmq_broker.storage.api import Store

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")


def monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def epoch_ms() -> int:
    return time.time_ns() // 1_000_000


class Runtime:
    def __init__(
        self,
        store: Store,
        config: BrokerConfig,
        *,
        clock: Callable[[], int] = monotonic_ms,
        wall_clock: Callable[[], int] = epoch_ms,
        executor: concurrent.futures.Executor | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.clock = clock
        self.wall_clock = wall_clock
        self.rng = rng or random.Random()
        self._own_executor = executor is None
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="lmq-store")
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_timer: Callable[[], None] = lambda: None
        self.closed = False
        self.draining = False  # shutting down: long polls end, closing streams must not forget their clients
        self.snap = metadata.Metadata(config)
        # Metadata generations: every change bumps ``_changes``; ``_snap_gen`` is the generation the current copy
        # was read at (its load began after that many changes). A caller needs a copy at least as new as the
        # changes it could have seen committed, so one that arrives during an older reload waits for a newer one.
        self._changes = 1
        self._snap_gen = 0
        self._snap_reload: tuple[int, asyncio.Task[metadata.Metadata]] | None = None
        self.metadata_watchers: list[Callable[[], None]] = []  # told of each change (``Dispatcher.watch_metadata``)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0
        self._rr = 0
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.metadata()

    async def stop_tasks(self) -> None:
        """Closing: no timer, no background task from here on."""
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def close_executor(self) -> None:
        if self._own_executor:
            await asyncio.to_thread(self._executor.shutdown, True)

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run a blocking store call on the thread pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def spawn(self, coro: Awaitable[None]) -> None:
        async def wrapper() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("background dispatch task failed")

        def done(task: asyncio.Task[None]) -> None:
            self.tasks.discard(task)
            if isinstance(coro, Coroutine):
                coro.close()  # cancelled before it started (``stop_tasks``): not a "never awaited" warning

        task = asyncio.get_running_loop().create_task(wrapper())
        self.tasks.add(task)
        task.add_done_callback(done)

    def next_round_robin(self) -> int:
        self._rr += 1
        return self._rr

    # --- the timer ------------------------------------------------------------------------------------------
    def arm(self, at_ms: int) -> None:
        """Have ``on_timer`` called at ``at_ms`` (or earlier, if it is armed for earlier already)."""
        if self.loop is None or self.closed:
            return
        if self._timer is not None and self._timer_at <= at_ms:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at_ms
        self._timer = self.loop.call_later(max(0, at_ms - self.clock()) / 1000, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self.on_timer()

    # --- metadata -------------------------------------------------------------------------------------------
    async def metadata(self) -> metadata.Metadata:
        """The current metadata, reloaded first if it changed since it was read. Never older than a change
        announced before the call: no caller sees a committed change undone."""
        want = self._changes
        while self._snap_gen < want:
            if self._snap_reload is None:
                task = asyncio.get_running_loop().create_task(self.run(metadata.Metadata.load, self.store, self.config))
                self._snap_reload = (self._changes, task)
            gen, reload = self._snap_reload
            try:
                snap = await asyncio.shield(reload)
            finally:
                if self._snap_reload is not None and self._snap_reload[1] is reload and reload.done():
                    self._snap_reload = None  # a failed load is retried by the next caller
            if gen > self._snap_gen:
                self.snap, self._snap_gen = snap, gen
        return self.snap

    def metadata_changed(self) -> None:
        self._changes += 1
        for watcher in self.metadata_watchers:
            watcher()
