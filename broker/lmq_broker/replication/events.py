"""Waiting on asyncio events: the loops of this package sleep until told to stop or woken early."""

from __future__ import annotations

import asyncio
import contextlib


class Signal(asyncio.Event):
    """An ``asyncio.Event`` that ``nap`` waits on with no task of its own: setting it also resolves the futures of
    the naps waiting on it."""

    def __init__(self) -> None:
        super().__init__()
        self.listeners: list[asyncio.Future[None]] = []

    def set(self) -> None:
        super().set()
        listeners, self.listeners = self.listeners, []
        _resolve(*listeners)


async def first_of(*events: asyncio.Event) -> None:
    """Until one of ``events`` is set."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


async def nap(timeout_s: float, *events: asyncio.Event) -> None:
    """Until one of ``events`` is set or ``timeout_s`` passed. When every one is a ``Signal``: one future and one
    timer of the loop, no task (the state rows' look, ten a second, spent ~3 ms of CPU a second per broker on the
    tasks of ``wait_for`` and ``first_of``: bench/RESULTS.md, 2026-11-29); with a plain Event among them,
    ``first_of`` under ``wait_for`` (the plain twin)."""
    if any(event.is_set() for event in events):
        return
    signals = [event for event in events if isinstance(event, Signal)]
    if len(signals) != len(events):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(first_of(*events), timeout_s)
        return
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()
    for signal in signals:
        signal.listeners.append(future)
    timer = loop.call_later(timeout_s, _resolve, future)
    try:
        await future
    finally:
        timer.cancel()
        for signal in signals:
            if future in signal.listeners:
                signal.listeners.remove(future)


def _resolve(*futures: asyncio.Future[None]) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)
