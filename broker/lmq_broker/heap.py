"""The C heap of a long-running broker: hand freed memory back to the OS.

A broker's allocations come in waves (a backlog of bodies, index write buffers, gRPC frames). CPython's
small-object arenas are returned when empty, but larger blocks go through glibc's malloc, which keeps the
freed top of each heap and every arena a thread ever used; after a wave, RSS stays at its high-water mark
and a later wave lands in fragments of it, so RSS creeps upward although nothing leaks (measured by
``bench/bench_soak_rss.py``). Two glibc knobs bound that: fewer malloc arenas (set before threads start)
and a periodic ``malloc_trim(0)``, which releases free pages of every arena. On a C library without them
(musl, macOS) both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from typing import Final

log = logging.getLogger(__name__)

M_ARENA_MAX: Final = -8  # mallopt parameter number (glibc malloc.h)
_PAGE: Final = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not hasattr(libc, "malloc_trim") or not hasattr(libc, "mallopt"):
        return None
    return libc


_LIBC: Final = _glibc()


def supported() -> bool:
    return _LIBC is not None


def limit_arenas(count: int) -> bool:
    """At most ``count`` malloc arenas (call before threads start). Returns whether the C library took it."""
    if _LIBC is None or count <= 0:
        return False
    return bool(_LIBC.mallopt(ctypes.c_int(M_ARENA_MAX), ctypes.c_int(count)))


def resident_bytes() -> int:
    """This process's resident set (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def trim() -> int:
    """Release free heap pages to the OS (blocking: a few ms; run it on a thread). Returns the bytes by which
    the resident set shrank (0 when nothing was released or the C library has no malloc_trim)."""
    if _LIBC is None:
        return 0
    before = resident_bytes()
    _LIBC.malloc_trim(ctypes.c_size_t(0))
    return max(0, before - resident_bytes())
