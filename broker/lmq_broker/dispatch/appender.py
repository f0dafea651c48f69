"""Feeds SendMessage appends to the store: small ones on the event loop, the rest on one thread.

A hop to a thread and back costs two thread wake-ups and a loop wake-up, more CPU on a small VM than
appending one message, and its latency lands on every send. So while the thread has nothing pending, a
request of a few messages is queued on the loop and every such request of one loop pass is appended by
one callback at the end of the pass (one group commit, no thread). That blocks the loop for the append,
fsync included in ``sync`` mode, so it is only done while those appends are quick: the appender averages
how long its inline appends held the loop and, above ``INLINE_MAX_BLOCK_S`` (a slow disk), uses the
thread, letting one small request through inline at most once per ``PROBE_INTERVAL_S`` to notice when the
disk is quick again. The loop never waits for another writer either: ``try_begin`` refuses at once and the
group goes to the thread. An inline group is one ``try_begin`` (the store keeps its requests apart: an
invalid one fails alone), its fsync and its ``finish``, all on the loop.

Order: a request bound for the thread takes the small requests of the same pass along, ahead of it, and
the rest of the pass follows it there, so requests of one pass are stored in the order they reached
``append``. Requests that overlap in time
across passes (a small one inline while an earlier one waits on the thread) may be stored in either
order, as RocketMQ allows for sends whose replies are not awaited; a producer that waits for each reply,
as FIFO producers do, is stored in its order. Holding later sends back until the thread is idle would
keep a busy broker on the thread path for good.

On the thread, every request waiting when it comes round goes into one ``store.append`` (one fsync), and
all their callers are resumed with one loop wake-up. A combined append is atomic in the store; if it fails,
each request is retried alone so the error reaches only the request that caused it.

Running the fsync on a thread while the loop goes on (and the next group gathers) was tried and measured:
with the official client, neither the send rate nor the round trip of other calls improved, and the two
thread wake-ups per group cost appends on the loop about 15 % of their rate.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final, NamedTuple

from lmq_broker import model
from lmq_broker.storage.api import PendingAppend, Store, complete

INLINE_MAX_MESSAGES: Final = 32  # a request this small is appended on the loop
INLINE_GROUP_MAX_MESSAGES: Final = 256  # bounds one inline group (a few ms of loop time)
INLINE_MAX_BLOCK_S: Final = 0.002  # inline appends slower than this on average (a slow disk): use the thread
PROBE_INTERVAL_S: Final = 1.0  # while on the thread for slowness, one inline append this often to re-measure
_EWMA_WEIGHT: Final = 0.05  # ~20 appends: a slow disk is slow every time, a stall of this VM's disk is a spike

_Future = asyncio.Future[list[model.AppendResult]]
_Item = tuple[Sequence[model.NewMessage], _Future]
_Outcome = tuple[_Future, list[model.AppendResult] | BaseException]
_STOP = None


class AppendStats(NamedTuple):
    loop_commits: int  # group commits run on the event loop
    thread_commits: int  # group commits run on the appender thread
    inline_seconds: float  # moving average of how long an inline commit held the loop


class Appender:
    def __init__(
        self,
        store: Store,
        loop: asyncio.AbstractEventLoop,
        *,
        inline_max_messages: int = INLINE_MAX_MESSAGES,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._store = store
        self._loop = loop
        self._timer = timer
        self._inline_max = inline_max_messages
        self._inline: list[_Item] = []
        self._inline_count = 0
        self._inline_armed = False
        self._thread_pass = False  # a request of this loop pass went to the thread: the rest of the pass follows
        self._stopping = False
        self._probe_at = 0.0
        self.inline_s = 0.0
        self.loop_commits = 0
        self.thread_commits = 0
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="lmq-appender", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> AppendStats:
        return AppendStats(self.loop_commits, self.thread_commits, self.inline_s)

    async def append(self, messages: Sequence[model.NewMessage]) -> list[model.AppendResult]:
        future: _Future = self._loop.create_future()
        if self._stopping or self._goes_inline(len(messages)):
            self._inline.append((messages, future))
            self._inline_count += len(messages)
            if not self._inline_armed:
                self._inline_armed = True
                self._loop.call_soon(self._commit_inline)  # after every handler ready in this pass
        else:
            self._to_thread([*self._take_inline(), (messages, future)])
            if not self._thread_pass:
                self._thread_pass = True
                self._loop.call_soon(self._end_thread_pass)
        return await future

    async def aclose(self) -> None:
        """Finish what is queued and stop the thread. From here on, appends run on the loop (blocking it:
        only the last few of a shutdown)."""
        self._stopping = True  # set on the loop: no append can be put on the queue after the stop below
        self._queue.put(_STOP)
        await asyncio.to_thread(self._thread.join)

    # --- on the loop ----------------------------------------------------------------------------------------
    def _goes_inline(self, n: int) -> bool:
        if n > self._inline_max or self._thread_pass or self._inline_count + n > INLINE_GROUP_MAX_MESSAGES:
            return False
        if self.inline_s <= INLINE_MAX_BLOCK_S:
            return True
        now = self._timer()
        if now < self._probe_at or self._inline:
            return False
        self._probe_at = now + PROBE_INTERVAL_S  # a probe: this one request measures the store again
        return True

    def _end_thread_pass(self) -> None:
        self._thread_pass = False

    def _take_inline(self) -> list[_Item]:
        group, self._inline = self._inline, []
        self._inline_count = 0
        return group

    def _to_thread(self, items: list[_Item]) -> None:
        for item in items:
            self._queue.put(item)

    def _commit_inline(self) -> None:
        self._inline_armed = False
        group = self._take_inline()
        if not group:
            return  # a request bound for the thread took the group along
        started = self._timer()
        try:
            pending = self._store.try_begin([messages for messages, _ in group])
        except Exception as e:  # the store is closed or broken: every request of the group hears it
            _settle([(future, e) for _, future in group])
            return
        if pending is None:  # another writer holds the store: do not wait for it here
            if self._stopping:  # the thread is gone or going: wait for the other writer here after all
                _settle(_commit(group, self._store.append))
            else:
                self._to_thread(group)
            return
        outcomes = _finish(pending, len(group))
        self.loop_commits += 1
        held = self._timer() - started
        if self.inline_s > INLINE_MAX_BLOCK_S and held <= INLINE_MAX_BLOCK_S:
            self.inline_s = held  # a quick probe after slow appends ends the slow spell at once
        else:
            self.inline_s += (held - self.inline_s) * _EWMA_WEIGHT  # single spikes are smoothed out
        _settle([(future, outcome) for (_, future), outcome in zip(group, outcomes, strict=True)])

    def _settle_thread(self, outcomes: list[_Outcome]) -> None:
        self.thread_commits += 1
        _settle(outcomes)

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
                outcomes = _commit(batch, self._store.append)
                self._loop.call_soon_threadsafe(self._settle_thread, outcomes)


def _commit(
    batch: list[_Item], append: Callable[[Sequence[model.NewMessage]], list[model.AppendResult]]
) -> list[_Outcome]:
    """Append ``batch`` as one call (``append`` waits for a writer that holds the store); one outcome per item.
    A failed combined append is retried item by item, so the error stays with the request that caused it."""
    if len(batch) == 1:
        messages, future = batch[0]
        try:
            return [(future, append(messages))]
        except Exception as exc:
            return [(future, exc)]
    combined = [m for messages, _ in batch for m in messages]
    try:
        results = append(combined)
    except Exception:
        return [outcome for single in batch for outcome in _commit([single], append)]
    out: list[_Outcome] = []
    start = 0
    for messages, future in batch:
        out.append((future, results[start : start + len(messages)]))
        start += len(messages)
    return out


def _finish(pending: PendingAppend, n: int) -> list[list[model.AppendResult] | BaseException]:
    """fsync (when the store needs it) and finish a pending append of ``n`` requests: one outcome each."""
    try:
        return complete(pending)
    except Exception as e:  # a bug, not a store error (those are outcomes): still, every caller hears it
        return [e] * n


def _settle(outcomes: list[_Outcome]) -> None:
    for future, outcome in outcomes:
        if future.done():  # the caller went away (cancelled): the messages are stored all the same
            continue
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
