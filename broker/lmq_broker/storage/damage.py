"""Damage the store found and stepped over: counted, logged at a bounded rate, never silent.

A record that fails its CRC when read, a record quarantined by recovery, the messages of a missing segment:
each is skipped so that the rest of its queue keeps flowing, and each is reported here. The counts are read
by the broker's metrics; the log says what was skipped and where, at most ``LOG_PER_INTERVAL`` lines per
``INTERVAL_S`` (a damaged segment can hold millions of records).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Final

log = logging.getLogger("lmq_broker.storage")

INTERVAL_S: Final = 60.0
LOG_PER_INTERVAL: Final = 20


class Skips:
    """Counts by kind (``corrupt_read``, ``quarantined``, ``lost``) and a rate-limited ERROR line each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self._window = 0.0
        self._logged = 0
        self._suppressed = 0

    def total(self, kind: str) -> int:
        return self.counts.get(kind, 0)

    def report(self, kind: str, what: str, count: int = 1) -> None:
        now = time.monotonic()
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + count
            if now - self._window >= INTERVAL_S:
                if self._suppressed:
                    log.error("storage damage: %d more reports in the last interval not logged", self._suppressed)
                self._window, self._logged, self._suppressed = now, 0, 0
            if self._logged >= LOG_PER_INTERVAL:
                self._suppressed += 1
                return
            self._logged += 1
        log.error("storage damage (%s, %d skipped): %s", kind, count, what)
