"""A token bucket that bounds deletes per second against one broker.

Deletes go out in batches, so a caller takes ``n`` tokens at once. The bucket may go into debt for a
batch larger than what is in it and then waits the debt off: the long-run rate stays at ``rate`` and a
burst never exceeds ``burst`` + one batch. Time and sleeping are injected, so the rate is tested without
waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class TokenBucket:
    rate: float  # tokens per second; 0 means unlimited
    burst: float
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    _tokens: float = field(init=False)
    _last: float = field(init=False)
    waited_s: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        if not self.rate >= 0:  # NaN too: a negative rate is a mistake, not another way to say unlimited
            raise ValueError(f"rate must be >= 0 (0: unlimited), got {self.rate}")
        self._tokens = self.burst
        self._last = self.clock()

    def acquire(self, n: int) -> float:
        """Take ``n`` tokens, sleeping as long as needed; returns the seconds slept."""
        if self.rate == 0 or n <= 0:
            return 0.0
        now = self.clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= n
        if self._tokens >= 0:
            return 0.0
        wait = -self._tokens / self.rate
        self.sleep(wait)
        # The debt is paid by the time we wake: account for it here so the next refill starts from zero.
        self._last = now + wait
        self._tokens = 0.0
        self.waited_s += wait
        return wait
