"""Resend a request the broker refused because it is fenced, as the official clients do.

A renewal late on a loaded host (the test lease is 1.5 s, the fence closes 1 s after a renewal began) refuses
before anything is stored, so calling again is safe; any other reply is returned as it is."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

from waiting import TIMEOUT_S

FENCED: Final = "does not hold the lease of slot"
RETRY_S: Final = 0.05


async def unfenced(call: Callable[[], Awaitable[Any]], retry: bool = True) -> Any:
    """``call()``'s reply, called again while it is refused as fenced (at most ``TIMEOUT_S``)."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        reply = await call()
        if not retry or FENCED not in reply.status.message or time.monotonic() >= deadline:
            return reply
        await asyncio.sleep(RETRY_S)
