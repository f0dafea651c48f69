"""Waiting on asyncio events: the loops of this package sleep until told to stop or woken early."""

from __future__ import annotations

import asyncio


async def first_of(*events: asyncio.Event) -> None:
    """Until one of ``events`` is set."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
