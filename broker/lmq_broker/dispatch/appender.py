"""One thread that feeds appends to the store, batching whatever queued up while it was busy.

Sends arrive on the event loop and ``store.append`` blocks (an fsync in sync mode), so appends must run
off the loop. A thread-pool hop per request costs a submit, a thread wake-up and a loop wake-up each, and
only shares an fsync if the store's own group commit catches the overlap. Here every request waiting
when the thread comes round goes into ONE ``store.append`` (one fsync), and all their callers are resumed
with ONE loop wake-up. A batch is atomic in the store; if it fails, each request is retried alone so the
error reaches only the request that caused it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Sequence

from lmq_broker import model
from lmq_broker.storage.api import Store

_Item = tuple[Sequence[model.NewMessage], "asyncio.Future[list[model.AppendResult]]"]
_STOP = None


class Appender:
    def __init__(self, store: Store, loop: asyncio.AbstractEventLoop) -> None:
        self._store = store
        self._loop = loop
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="lmq-appender", daemon=True)
        self._thread.start()

    async def append(self, messages: Sequence[model.NewMessage]) -> list[model.AppendResult]:
        future: asyncio.Future[list[model.AppendResult]] = self._loop.create_future()
        self._queue.put((messages, future))
        return await future

    def close(self) -> None:
        """Finish what is queued, then stop the thread (blocking)."""
        self._queue.put(_STOP)
        self._thread.join()

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
                self._loop.call_soon_threadsafe(_settle, self._append(batch))

    def _append(
        self, batch: list[_Item]
    ) -> list[tuple[asyncio.Future[list[model.AppendResult]], list[model.AppendResult] | BaseException]]:
        if len(batch) == 1:
            messages, future = batch[0]
            try:
                return [(future, self._store.append(messages))]
            except Exception as exc:
                return [(future, exc)]
        combined = [m for messages, _ in batch for m in messages]
        try:
            results = self._store.append(combined)
        except Exception:
            return [item for single in batch for item in self._append([single])]
        out: list[tuple[asyncio.Future[list[model.AppendResult]], list[model.AppendResult] | BaseException]] = []
        start = 0
        for messages, future in batch:
            out.append((future, results[start : start + len(messages)]))
            start += len(messages)
        return out


def _settle(
    outcomes: list[tuple[asyncio.Future[list[model.AppendResult]], list[model.AppendResult] | BaseException]],
) -> None:
    for future, outcome in outcomes:
        if future.done():  # the caller went away (cancelled): the messages are stored all the same
            continue
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
