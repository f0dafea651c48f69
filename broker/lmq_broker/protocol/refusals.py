"""Refusals a client caused (a topic that does not exist, a bad argument, a quota), logged at INFO so an
operator sees why a client fails even when the client reports it badly (the Python 5.1.2 client turns a
refused route into an ``AttributeError``): one line per distinct (method, code, message) per minute, with
the number of repeats since, never the call's headers or body (no secret reaches the log)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

log = logging.getLogger("lmq_broker.refused")
EVERY_S: Final = 60.0
MAX_KEYS: Final = 1024  # distinct refusals remembered; beyond it the oldest minute's are forgotten at once


class RefusalLog:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last: dict[tuple[str, int, str], tuple[float, int]] = {}  # key -> (logged at, repeats since)

    def note(self, method: str, code: int, message: str) -> bool:
        """Log this refusal unless the same one was logged within the minute; True when it was logged."""
        now = self._clock()
        key = (method, code, message)
        seen = self._last.get(key)
        if seen is not None and now - seen[0] < EVERY_S:
            self._last[key] = (seen[0], seen[1] + 1)
            return False
        if seen is None and len(self._last) >= MAX_KEYS:
            self._last = {k: v for k, v in self._last.items() if now - v[0] < EVERY_S}
            if len(self._last) >= MAX_KEYS:
                self._last.clear()
        repeats = f" (and {seen[1]} more like it in the last minute)" if seen is not None and seen[1] else ""
        log.info("refused %s: %d %s%s", method, code, message, repeats)
        self._last[key] = (now, 0)
        return True
