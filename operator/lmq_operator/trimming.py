"""Giving freed memory back to the system, every few seconds.

A burst of resources (a GitOps sync of thousands) allocates and frees a lot of memory in a short time. CPython
frees it to glibc's malloc, which keeps it mapped: freed chunks inside the heap are returned to the system only
by ``malloc_trim``, never on their own (only the heap's top is). Measured with ``bench/bench_operator.py`` at
10,000 ParentTopics (bench/RESULTS.md). Where the C library is not glibc (``malloc_trim`` missing), this does
nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


def _malloc_trim() -> Callable[[], object] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


async def run(interval_s: float) -> None:
    """Trim every ``interval_s`` seconds, forever (a no-op loop's cost where there is nothing to trim)."""
    trim = _malloc_trim()
    if trim is None:
        log.info("no malloc_trim in this C library: freed memory stays with the allocator")
        return
    while True:
        await asyncio.sleep(interval_s)
        trim()
