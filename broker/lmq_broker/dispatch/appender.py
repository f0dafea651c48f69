"""Feeds appends to the store: small ones on the event loop itself, large ones (and all of them while the
disk is slow) on one thread; either way, whatever queued up together goes to the store as ONE append.

A hop to a thread and back costs two thread wake-ups and a loop wake-up: on a 2-core VM each is a context
switch of tens of microseconds, more than a small append itself (~40 us of CPU, plus the fsync in ``sync``
mode, which releases the GIL). So a request of a few messages is queued on the loop and committed by one
callback at the end of the loop's current pass, together with every other small request of that pass: a
group commit with no thread in it. The loop is blocked for that append, fsync included, which is cheap on
a local disk and not on a slow one: the appender keeps a moving average of how long each append holds the
store (measured on whichever path ran it) and sends everything to the thread while that average is above
``INLINE_MAX_BLOCK_S``, so receives and acks keep flowing while a slow disk syncs. The loop also never waits
for another writer (retention, a reclaim batch): ``try_append`` refuses at once and the group goes to the
thread instead.

On the thread, every request waiting when it comes round goes into one ``store.append`` (one fsync), and
all their callers are resumed with one loop wake-up. A combined append is atomic in the store; if it fails,
each request is retried alone so the error reaches only the request that caused it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final

from lmq_broker import model
from lmq_broker.storage.api import Store

INLINE_MAX_MESSAGES: Final = 32  # a request this small is appended on the loop (when the disk is fast)
INLINE_GROUP_MAX_MESSAGES: Final = 256  # bounds one inline group: ~5 ms of loop time at most
INLINE_MAX_BLOCK_S: Final = 0.002  # appends slower than this (a slow disk's fsync) go to the thread
_EWMA_WEIGHT: Final = 0.2

_Future = asyncio.Future[list[model.AppendResult]]
_Item = tuple[Sequence[model.NewMessage], _Future]
_Outcome = tuple[_Future, list[model.AppendResult] | BaseException]
_STOP = None


class Appender:
    def __init__(
        self, store: Store, loop: asyncio.AbstractEventLoop, *, inline_max_messages: int = INLINE_MAX_MESSAGES
    ) -> None:
        self._store = store
        self._loop = loop
        self._inline_max = inline_max_messages
        self._inline: list[_Item] = []
        self._inline_count = 0
        self._inline_armed = False
        self._stopping = False
        self.append_s = 0.0  # moving average of how long one append holds the store
        self.inline_commits = 0
        self.thread_commits = 0
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="lmq-appender", daemon=True)
        self._thread.start()

    async def append(self, messages: Sequence[model.NewMessage]) -> list[model.AppendResult]:
        future: _Future = self._loop.create_future()
        n = len(messages)
        if self._stopping or (
            n <= self._inline_max
            and self._inline_count + n <= INLINE_GROUP_MAX_MESSAGES
            and self.append_s <= INLINE_MAX_BLOCK_S
        ):
            self._inline.append((messages, future))
            self._inline_count += n
            if not self._inline_armed:
                self._inline_armed = True
                self._loop.call_soon(self._commit_inline)  # after every handler ready in this pass
        else:
            self._queue.put((messages, future))
        return await future

    def close(self) -> None:
        """Finish what is queued, then stop the thread (blocking; any thread). Appends after this run on the
        loop, blocking it: only the last few of a shutdown."""
        self._stopping = True
        self._queue.put(_STOP)
        self._thread.join()

    # --- on the loop ----------------------------------------------------------------------------------------
    def _commit_inline(self) -> None:
        group, self._inline = self._inline, []
        self._inline_count = 0
        self._inline_armed = False
        started = time.perf_counter()
        outcomes, busy = _commit(group, self._store.try_append)
        if outcomes:
            self.inline_commits += 1
            self._observe(time.perf_counter() - started)
            _settle(outcomes)
        if busy and self._stopping:  # the thread is gone or going: wait for the other writer here after all
            outcomes, busy = _commit(busy, self._store.append)
            _settle(outcomes)
        for item in busy:  # another writer holds the store: do not wait for it here
            self._queue.put(item)

    def _settle_thread(self, outcomes: list[_Outcome], held_s: float) -> None:
        self.thread_commits += 1
        self._observe(held_s)
        _settle(outcomes)

    def _observe(self, held_s: float) -> None:
        self.append_s += (held_s - self.append_s) * _EWMA_WEIGHT

    # --- on the thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            batch: list[_Item] = []
            if first is _STOP:
                stopping = True
            else:
                batch.append(first)
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stopping = True
                else:
                    batch.append(item)
            if batch:
                started = time.perf_counter()
                outcomes, _ = _commit(batch, self._store.append)
                self._loop.call_soon_threadsafe(self._settle_thread, outcomes, time.perf_counter() - started)


def _commit(
    batch: list[_Item], append: Callable[[Sequence[model.NewMessage]], list[model.AppendResult] | None]
) -> tuple[list[_Outcome], list[_Item]]:
    """Append ``batch`` as one call; (outcomes, the items not attempted because the store was busy)."""
    if not batch:
        return [], []
    if len(batch) == 1:
        messages, future = batch[0]
        try:
            results = append(messages)
        except Exception as exc:
            return [(future, exc)], []
        return ([], batch) if results is None else ([(future, results)], [])
    combined = [m for messages, _ in batch for m in messages]
    try:
        results = append(combined)
    except Exception:
        outcomes: list[_Outcome] = []
        busy: list[_Item] = []
        for single in batch:  # retried alone: the error stays with the request that caused it
            done, refused = _commit([single], append)
            outcomes += done
            busy += refused
        return outcomes, busy
    if results is None:
        return [], batch
    out: list[_Outcome] = []
    start = 0
    for messages, future in batch:
        out.append((future, results[start : start + len(messages)]))
        start += len(messages)
    return out, []


def _settle(outcomes: list[_Outcome]) -> None:
    for future, outcome in outcomes:
        if future.done():  # the caller went away (cancelled): the messages are stored all the same
            continue
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
