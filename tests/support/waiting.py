"""Wait on an event, not on time: ``eventually`` (threads, subprocesses) and ``eventually_async`` (a loop that
must keep running while the test waits) look at a condition until it holds or a deadline passes.

The condition returns something truthy when it holds; that value is returned, so a test can wait for and take
a result in one step (``reply = eventually(lambda: poll(), "the reply")``). Exceptions named in ``ignoring``
count as "not yet" (state read while another task builds it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Final, TypeVar

T = TypeVar("T")

TIMEOUT_S: Final = 20.0


def _failed(what: str, timeout_s: float, last: object) -> AssertionError:
    return AssertionError(f"not within {timeout_s:g} s: {what} (last seen: {last!r})")


def eventually(
    check: Callable[[], T],
    what: str,
    timeout_s: float = TIMEOUT_S,
    interval_s: float = 0.01,
    ignoring: tuple[type[Exception], ...] = (),
) -> T:
    """``check()``'s first truthy value, looked at every ``interval_s``; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        try:
            last = result = check()
            if result:
                return result
        except ignoring as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise _failed(what, timeout_s, last)
        time.sleep(interval_s)


async def eventually_async(
    check: Callable[[], T],
    what: str,
    timeout_s: float = TIMEOUT_S,
    interval_s: float = 0.01,
    ignoring: tuple[type[Exception], ...] = (),
) -> T:
    """``eventually`` that yields to the running loop between looks (the state comes from its other tasks)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last: object = None
    while True:
        try:
            last = result = check()
            if result:
                return result
        except ignoring as exc:
            last = exc
        if loop.time() >= deadline:
            raise _failed(what, timeout_s, last)
        await asyncio.sleep(interval_s)
