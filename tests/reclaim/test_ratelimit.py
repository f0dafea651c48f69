"""The delete rate bound, on a fake clock: sleeping advances time instead of waiting."""

from __future__ import annotations

import pytest

from lmq_reclaim.ratelimit import TokenBucket


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_long_run_rate_never_exceeds_the_limit() -> None:
    t = FakeTime()
    bucket = TokenBucket(rate=500, burst=500, clock=t.clock, sleep=t.sleep)
    start = t.now
    taken = 0
    for _ in range(40):
        bucket.acquire(250)
        taken += 250
    elapsed = t.now - start
    # The first burst is free; everything after it is paid at 500/s.
    assert elapsed >= (taken - 500) / 500 - 1e-9
    assert elapsed <= (taken - 500) / 500 + 1e-6
    assert bucket.waited_s == sum(t.slept)


def test_idle_time_refills_up_to_the_burst_only() -> None:
    t = FakeTime()
    bucket = TokenBucket(rate=100, burst=100, clock=t.clock, sleep=t.sleep)
    assert bucket.acquire(100) == 0.0
    t.now += 3600  # an hour idle still gives one burst, not 360 000 tokens
    assert bucket.acquire(100) == 0.0
    assert bucket.acquire(100) == 1.0


def test_a_batch_bigger_than_the_burst_waits_off_its_debt() -> None:
    t = FakeTime()
    bucket = TokenBucket(rate=10, burst=10, clock=t.clock, sleep=t.sleep)
    assert bucket.acquire(30) == 2.0  # 10 in the bucket, 20 more at 10/s
    assert bucket.acquire(10) == 1.0


def test_zero_rate_is_unlimited() -> None:
    t = FakeTime()
    bucket = TokenBucket(rate=0, burst=0, clock=t.clock, sleep=t.sleep)
    for _ in range(100):
        assert bucket.acquire(10_000) == 0.0
    assert t.slept == []


def test_a_negative_rate_is_refused_rather_than_unlimited() -> None:
    with pytest.raises(ValueError, match="rate must be >= 0"):
        TokenBucket(-1.0, burst=1.0)
