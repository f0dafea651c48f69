"""Admission: at most ``--max-concurrent-calls`` calls execute at once; a call beyond that is answered at once.

Why this exists: grpc core keeps the calls that have arrived but that the Python server has not yet taken
(it takes them one at a time, on the event loop) in a backlog, and past 1,000 of them it refuses newcomers
with rising probability, every one past 3,000. A refused call reaches the client as a bare gRPC CANCELLED,
with nothing run, logged or counted here. ``server.options`` therefore raises that backlog limit (to 20,000
waiting calls), so that a burst reaches Python, and the cap is enforced here instead, where a refusal can
be said in the protocol's own words: the v2 status TOO_MANY_REQUESTS (the official clients raise
TooManyRequestsException), or gRPC RESOURCE_EXHAUSTED where a call has no status to carry it.

What counts against the cap is the work in hand, not calls that wait: unary calls (v2 and admin) and
admin streams hold a slot while they run. A ReceiveMessage long poll and a Telemetry stream are refused
when the broker is full, but once admitted hold no slot: they spend nearly all their life waiting
(20 s polls, telemetry streams for days), are bounded by caps of their own per client id and per
connection (``protocol.parking``), and a broker with a thousand idle consumers must still take sends
(RocketMQ likewise parks long polls apart from its request executors, and answers TOO_MANY_REQUESTS only
when that polling is full).

A counter, not a semaphore: every call runs on the one event loop, so admitting is an integer compare.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Final

log = logging.getLogger(__name__)

LOG_INTERVAL_S: Final = 10.0  # at most one overload warning per broker per this many seconds
REASON_OVERLOAD: Final = "overload"


def overloaded_message(limit: int) -> str:
    return f"broker is overloaded ({limit} calls already running); retry later"


class Admission:
    """The running-call count of one broker, its cap, and the refusals (counted and logged, rate-limited).

    ``refused`` is told each refusal (the ``lmq_calls_refused_total`` metric); ``clock`` is monotonic seconds.
    """

    def __init__(
        self,
        limit: int,
        refused: Callable[[str, str], None] = lambda rpc, reason: None,
        *,
        clock: Callable[[], float] = time.monotonic,
        log_interval_s: float = LOG_INTERVAL_S,
    ) -> None:
        self.limit = limit if limit > 0 else sys.maxsize  # 0: no cap
        self.running = 0
        self.message = overloaded_message(limit)
        self._refused = refused
        self._clock = clock
        self._log_interval_s = log_interval_s
        self._unlogged: Counter[str] = Counter()
        self._unlogged_since = 0.0
        self._logged_at: float | None = None
        self._flush: asyncio.TimerHandle | None = None

    def enter(self) -> bool:
        """Take a slot if one is free (then ``leave`` when the call ends)."""
        if self.running >= self.limit:
            return False
        self.running += 1
        return True

    def leave(self) -> None:
        self.running -= 1

    @property
    def full(self) -> bool:
        """Whether a call that holds no slot (a long poll, a telemetry stream) is refused now."""
        return self.running >= self.limit

    def refuse(self, rpc: str) -> None:
        """Record one refused call: the metric at once, the log line at most once per ``log_interval_s``
        (a refusal inside the interval is summarised by the next line, written when the interval ends)."""
        self._refused(rpc, REASON_OVERLOAD)
        now = self._clock()
        if not self._unlogged:
            self._unlogged_since = now
        self._unlogged[rpc] += 1
        if self._logged_at is None or now - self._logged_at >= self._log_interval_s:
            self._log(now)
        elif self._flush is None:
            self._schedule(self._log_interval_s - (now - self._logged_at))

    def close(self) -> None:
        """Write the summary still owed (at shutdown)."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if self._unlogged:
            self._log(self._clock())

    def _schedule(self, delay_s: float) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous test): the next refusal or close() writes the line
            return
        self._flush = loop.call_later(max(0.0, delay_s), self._flush_due)

    def _flush_due(self) -> None:
        self._flush = None
        if self._unlogged:
            self._log(self._clock())

    def _log(self, now: float) -> None:
        total = sum(self._unlogged.values())
        by_rpc = ", ".join(f"{rpc} {count}" for rpc, count in self._unlogged.most_common())
        log.warning(
            "overloaded: refused %d call%s in the last %.1f s (more than --max-concurrent-calls=%d running): %s",
            total,
            "" if total == 1 else "s",
            now - self._unlogged_since,
            self.limit,
            by_rpc,
        )
        self._unlogged.clear()
        self._logged_at = now
