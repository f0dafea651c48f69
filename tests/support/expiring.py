"""What the in-broker expiry's tests (tests/broker/admin) share with their fixtures (its conftest.py): a lite
parent ``P`` whose topics expire after ``EXPIRATION_MIN`` minutes, a parent ``NEVER`` whose topics never do, and
the expiry's settings for one pass at a time."""

from __future__ import annotations

from typing import Final

from lmq_broker.admin import expiry
from lmq_broker.dispatch.testing import Lite

MINUTE: Final = 60_000
EXPIRATION_MIN: Final = 60
NEVER: Final = "NEVER"  # a parent whose lite topics never expire
SETTINGS: Final = expiry.Settings(interval_ms=1000, batch=1000, step_pause_ms=0, min_age_ms=15 * MINUTE)


async def sent_and_expired(lite: Lite, *names: str) -> None:
    """A message to each of ``names`` (of ``P``), then the clock past their expiration."""
    for name in names:
        await lite.send(name)
    lite.clock.advance(EXPIRATION_MIN * MINUTE + 1)
