"""The in-broker expiry's schedule (``expiry.run``): when passes run, what a failing pass or an unhealthy store
does to the next one, and how a stop ends it. Intervals of a few milliseconds of real time (the pass itself is
tested on a manual clock in test_expiry.py)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from lmq_broker import errors, model
from lmq_broker.admin import expiry
from lmq_broker.dispatch.api import StaticLiveView
from lmq_broker.dispatch.testing import until
from lmq_broker.storage import memory

pytestmark = pytest.mark.asyncio


class FlakyStore(memory.MemoryStore):
    """The in-memory store, whose parent list fails while ``failures`` last and whose health is settable."""

    def __init__(self, clock: memory.ManualClock) -> None:
        super().__init__(clock=clock)
        self.failures = 0
        self.trouble: str | None = None
        self.listed = 0
        self.asked = 0  # health checks: one per interval

    def list_parent_topics(self) -> list[model.ParentTopic]:
        self.listed += 1
        if self.failures:
            self.failures -= 1
            raise errors.StorageError("disk on fire")
        return super().list_parent_topics()

    def health(self) -> str | None:
        self.asked += 1
        return self.trouble


def fill(store: FlakyStore, clock: memory.ManualClock) -> None:
    store.put_parent_topic(model.ParentTopic("P", expiration_minutes=0))
    store.append([_message("old")])
    clock.advance(10)


def _message(lite: str) -> model.NewMessage:
    return model.NewMessage(
        message_id=lite,
        topic="P",
        body=b"x",
        queues=(model.QueueId("P", 0), model.QueueId.lmq("P", lite)),
        lite_topic=lite,
        message_type=model.MessageType.LITE,
    )


async def test_a_failed_pass_is_logged_and_the_next_one_runs(caplog: pytest.LogCaptureFixture) -> None:
    clock = memory.ManualClock()
    store = FlakyStore(clock)
    fill(store, clock)
    store.failures = 1
    reports: list[expiry.Report] = []
    stopping = asyncio.Event()
    settings = expiry.Settings(interval_ms=5, batch=10, step_pause_ms=0, min_age_ms=0)
    caplog.set_level(logging.INFO, logger=expiry.__name__)

    running = asyncio.create_task(
        expiry.run(store, StaticLiveView(store=store), settings, clock, stopping, on_pass=reports.append)
    )
    await until(lambda: bool(reports))
    stopping.set()
    await asyncio.wait_for(running, 5)

    assert store.lite_topic("P", "old") is None
    assert reports[0].deleted == 1
    assert any("expiry pass failed" in r.getMessage() for r in caplog.records)
    assert any("lite-topic expiry: 1 pass(es)" in r.getMessage() for r in caplog.records)


async def test_no_pass_while_the_store_cannot_serve() -> None:
    clock = memory.ManualClock()
    store = FlakyStore(clock)
    fill(store, clock)
    store.trouble = "index rebuild"
    reports: list[expiry.Report] = []
    stopping = asyncio.Event()
    settings = expiry.Settings(interval_ms=2, batch=10, step_pause_ms=0, min_age_ms=0)

    running = asyncio.create_task(
        expiry.run(store, StaticLiveView(store=store), settings, clock, stopping, on_pass=reports.append)
    )
    await until(lambda: store.asked >= 5)  # five intervals went by
    assert (reports, store.listed) == ([], 0)
    store.trouble = None
    await until(lambda: bool(reports))
    stopping.set()
    await asyncio.wait_for(running, 5)
    assert store.lite_topic("P", "old") is None


async def test_the_first_pass_waits_for_the_minimum_age_and_a_stop_ends_the_wait() -> None:
    clock = memory.ManualClock()
    store = FlakyStore(clock)
    stopping = asyncio.Event()
    settings = expiry.Settings(interval_ms=1, batch=10, step_pause_ms=0, min_age_ms=3_600_000)

    running = asyncio.create_task(
        expiry.run(store, StaticLiveView(store=store), settings, clock, stopping, on_pass=lambda r: None)
    )
    # A twin with no minimum age on the same interval: five of its passes, many intervals of the first.
    twin = FlakyStore(clock)
    passes: list[expiry.Report] = []
    no_age = expiry.Settings(interval_ms=1, batch=10, step_pause_ms=0, min_age_ms=0)
    metronome = asyncio.create_task(
        expiry.run(twin, StaticLiveView(store=twin), no_age, clock, stopping, on_pass=passes.append)
    )
    await until(lambda: len(passes) >= 5)
    assert (store.asked, store.listed) == (0, 0)  # an hour to go
    stopping.set()
    await asyncio.wait_for(asyncio.gather(running, metronome), 1)
