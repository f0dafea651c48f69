"""The in-broker expiry of idle lite topics (``admin.expiry``) over a real dispatcher and both stores (the
RocksDB + segments store in tmp_path, and its in-memory twin), on a manual clock that is the store's clock and
the dispatcher's wall clock: time is moved, never waited for (fixtures: conftest.py)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from expiring import EXPIRATION_MIN, MINUTE, NEVER, SETTINGS, sent_and_expired

from lmq_broker import model
from lmq_broker.admin import expiry, reclaiming
from lmq_broker.dispatch import testing as dispatch_testing
from lmq_broker.dispatch.testing import GROUP, PARENT, Lite, until
from lmq_broker.storage.testing import another_writer

pytestmark = pytest.mark.asyncio


async def expire(lite: Lite, settings: expiry.Settings = SETTINGS) -> expiry.Report:
    return await expiry.run_pass(lite.store, lite.dispatcher, settings, lite.clock)


def exists(lite: Lite, name: str, parent: str = PARENT) -> bool:
    return lite.store.lite_topic(parent, name) is not None


# --- the rule -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("idle_ms", "expiration_min", "min_age_ms", "expected"),
    [
        (60 * MINUTE, 60, 15 * MINUTE, False),  # idle must be above the expiration, as in the reclaim job
        (60 * MINUTE + 1, 60, 15 * MINUTE, True),
        (15 * MINUTE - 1, 0, 15 * MINUTE, False),  # below the minimum age whatever the expiration
        (15 * MINUTE, 0, 15 * MINUTE, True),
        (1, 0, 0, True),
        (0, 0, 0, False),
    ],
)
async def test_the_rule_is_the_reclaim_jobs(idle_ms: int, expiration_min: int, min_age_ms: int, expected: bool) -> None:
    now = 10_000 * MINUTE
    meta = model.LiteTopicMeta("p", "l", now - idle_ms - 5, now - idle_ms, now - idle_ms - 1, 0, 1)
    assert expiry.is_expired(meta, now, expiration_min, min_age_ms) is expected


# --- what expires -------------------------------------------------------------------------------------------
async def test_an_idle_topic_past_its_parents_expiration_is_deleted_and_an_active_one_kept(lite: Lite) -> None:
    await lite.send("idle")
    await lite.send("forever", parent=NEVER)
    await lite.send("consumed")
    await lite.send("written")
    lite.clock.advance(EXPIRATION_MIN * MINUTE)
    await lite.send("written")
    lite.store.commit_offset(model.QueueId.lmq(PARENT, "consumed"), GROUP, 1)
    lite.clock.advance(1)

    report = await expire(lite)

    assert not exists(lite, "idle")
    assert exists(lite, "written") and exists(lite, "consumed") and exists(lite, "forever", NEVER)
    assert (report.parents, report.scanned, report.expired, report.deleted) == (1, 3, 1, 1)  # NEVER is not read
    assert lite.store.lite_topic_count(PARENT) == 2

    lite.clock.advance(EXPIRATION_MIN * MINUTE)  # now the other two are idle as long: they go on the next pass
    report = await expire(lite)
    assert (report.expired, report.deleted) == (2, 2)
    assert lite.store.lite_topic_count(PARENT) == 0
    assert exists(lite, "forever", NEVER)


async def test_never_a_topic_younger_than_the_minimum_age_even_with_expiration_zero(lite: Lite) -> None:
    lite.store.put_parent_topic(model.ParentTopic(PARENT, expiration_minutes=0))
    await lite.send("young")
    lite.clock.advance(SETTINGS.min_age_ms - 1)
    assert (await expire(lite)).expired == 0
    assert exists(lite, "young")
    lite.clock.advance(1)
    assert (await expire(lite)).deleted == 1
    assert not exists(lite, "young")


async def test_a_pass_reads_the_index_in_bounded_steps_with_a_pause_between_them(lite: Lite) -> None:
    names = [f"t{i:02d}" for i in range(10)]
    for name in names:
        await lite.send(name)
    lite.clock.advance(EXPIRATION_MIN * MINUTE + 1)
    await lite.send("t04")  # one stays
    pauses: list[float] = []
    steps: list[expiry.Report] = []

    async def pause(seconds: float) -> None:
        pauses.append(seconds)

    settings = expiry.Settings(interval_ms=1000, batch=3, step_pause_ms=7, min_age_ms=0)
    report = await expiry.run_pass(lite.store, lite.dispatcher, settings, lite.clock, pause=pause, on_step=steps.append)

    assert (report.scanned, report.expired, report.deleted) == (10, 9, 9)
    assert pauses == [0.007] * 3  # four steps of at most 3 rows (3+3+3+1): a pause between two steps
    # each step told as it ended, and the pass is their sum
    assert [(s.scanned, s.deleted) for s in steps] == [(3, 3), (3, 2), (3, 3), (1, 1)]
    assert (sum(s.scanned for s in steps), sum(s.deleted for s in steps)) == (report.scanned, report.deleted)
    assert [m.lite for m in lite.store.scan_lite_topics(PARENT)] == ["t04"]


async def test_a_cpu_share_stretches_the_pause_after_a_step_to_its_cost() -> None:
    paced = expiry.Settings(interval_ms=1000, batch=1000, step_pause_ms=20, min_age_ms=0, cpu_share=0.01)
    assert paced.pause_s(spent_s=0.005, took_s=0.008) == pytest.approx(0.5 - 0.008)  # 5 ms of CPU = 1 % of 0.5 s
    assert paced.pause_s(spent_s=0.0001, took_s=0.001) == pytest.approx(0.02)  # never under the step pause
    unpaced = expiry.Settings(interval_ms=1000, batch=1000, step_pause_ms=20, min_age_ms=0)
    assert unpaced.pause_s(spent_s=5.0, took_s=5.0) == pytest.approx(0.02)


async def test_a_pass_with_a_cpu_share_pauses_longer_than_its_step_pause(lite: Lite) -> None:
    lite.store.append([dispatch_testing.lite_message(f"t{i:02d}", message_id=f"m{i}") for i in range(9)])
    pauses: list[float] = []

    async def pause(seconds: float) -> None:
        pauses.append(seconds)

    settings = expiry.Settings(interval_ms=1000, batch=3, step_pause_ms=1, min_age_ms=0, cpu_share=1e-5)
    report = await expiry.run_pass(lite.store, lite.dispatcher, settings, lite.clock, pause=pause)

    assert report.scanned == 9 and report.expired == 0  # nothing idle yet: reads only
    assert len(pauses) == 3  # three full steps, then an empty one ends the parent
    assert all(p > 0.001 for p in pauses), pauses  # each step's CPU (> 10 ns) over 1e-5 of a core


async def test_deletes_go_in_small_chunks_paced_like_the_steps(lite: Lite) -> None:
    count = 2 * expiry.DELETE_CHUNK + 3
    lite.store.append([dispatch_testing.lite_message(f"t{i:03d}", message_id=f"m{i}") for i in range(count)])
    lite.clock.advance(EXPIRATION_MIN * MINUTE + 1)
    pauses: list[float] = []

    async def pause(seconds: float) -> None:
        pauses.append(seconds)
        assert lite.dispatcher.reclaims_in_flight() == 0  # between two delete calls, none is under way

    settings = expiry.Settings(interval_ms=1000, batch=1000, step_pause_ms=3, min_age_ms=0)
    report = await expiry.run_pass(lite.store, lite.dispatcher, settings, lite.clock, pause=pause)

    assert (report.scanned, report.expired, report.deleted) == (count, count, count)
    assert pauses == [0.003, 0.003]  # one step, three delete calls
    assert lite.store.lite_topic_count(PARENT) == 0


async def test_a_stopped_pass_ends_before_its_next_step(lite: Lite) -> None:
    for i in range(6):
        await lite.send(f"t{i}")
    lite.clock.advance(EXPIRATION_MIN * MINUTE + 1)
    steps: list[float] = []

    async def pause(seconds: float) -> None:
        steps.append(seconds)

    settings = expiry.Settings(interval_ms=1000, batch=2, step_pause_ms=1, min_age_ms=0)
    report = await expiry.run_pass(
        lite.store, lite.dispatcher, settings, lite.clock, stop=lambda: bool(steps), pause=pause
    )

    assert (report.scanned, report.deleted) == (2, 2)  # one step, then the stop
    assert lite.store.lite_topic_count(PARENT) == 4


# --- compare-and-delete: what happens between the selection and the delete -------------------------------
async def test_a_topic_written_or_consumed_between_selection_and_delete_is_kept(
    lite: Lite, monkeypatch: pytest.MonkeyPatch
) -> None:
    await sent_and_expired(lite, "written", "consumed", "idle")
    read_step = expiry._read_step

    def read_then_touch(*args: object, **kwargs: object) -> object:  # the worker thread, after the step's read
        step = read_step(*args, **kwargs)  # type: ignore[arg-type]
        assert sorted(m.lite for m in step.candidates) == ["consumed", "idle", "written"]
        lite.store.append([dispatch_testing.lite_message("written", message_id="late")])
        lite.store.commit_offset(model.QueueId.lmq(PARENT, "consumed"), GROUP, 1)
        return step

    monkeypatch.setattr(expiry, "_read_step", read_then_touch)
    report = await expire(lite)

    assert (report.expired, report.deleted, report.kept_changed) == (3, 1, 2)
    assert exists(lite, "written") and exists(lite, "consumed") and not exists(lite, "idle")
    written = lite.store.lite_topic(PARENT, "written")
    assert written is not None and written.max_offset == 2  # nothing of it was lost


async def test_a_subscription_made_while_the_delete_waits_for_the_store_keeps_the_topic(
    lite: Lite, monkeypatch: pytest.MonkeyPatch
) -> None:
    await lite.send("t1")
    await lite.send("t2")
    lite.clock.advance(EXPIRATION_MIN * MINUTE + 1)
    t1 = model.QueueId.lmq(PARENT, "t1")
    writer = another_writer(lite.store)
    read_step = expiry._read_step

    def read_then_hold_the_store(*args: object, **kwargs: object) -> object:
        step = read_step(*args, **kwargs)  # type: ignore[arg-type]
        writer.__enter__()  # from now on the pass's delete waits in a store thread for the write lock
        return step

    monkeypatch.setattr(expiry, "_read_step", read_then_hold_the_store)
    passing = asyncio.create_task(expire(lite))
    try:
        await until(lambda: lite.dispatcher.reclaims_in_flight() == 2)
        subscribing = asyncio.create_task(lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"]))
        await until(lambda: lite.dispatcher.subscriber_count(t1) == 1)
        assert not passing.done()
    finally:
        writer.__exit__(None, None, None)
    report = await asyncio.wait_for(passing, 10)
    await asyncio.wait_for(subscribing, 10)

    assert (report.deleted, report.kept_subscribed) == (1, 1)
    assert exists(lite, "t1") and not exists(lite, "t2")
    (got,) = await lite.receive("c1")  # the subscription is live and the message is still there
    assert got.message.lite_topic == "t1"


async def test_subscriptions_to_an_expired_topic_behave_as_after_a_reclaim(lite: Lite) -> None:
    await lite.send("gone", b"old")
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["gone", "kept"])
    (got,) = await lite.receive("c1")
    await lite.dispatcher.ack(GROUP, got.receipt_handle)
    lmq = model.QueueId.lmq(PARENT, "gone")
    assert lite.store.get_offset(lmq, GROUP) == 1
    lite.clock.advance(EXPIRATION_MIN * MINUTE + 1)

    report = await expire(lite)

    assert report.deleted == 1
    assert not exists(lite, "gone")
    assert lite.dispatcher.subscribers(lmq) == []  # dropped without notice, as RocketMQ and the reclaim job do
    assert lite.dispatcher.lite_topics_of("c1") == ["kept"]
    assert lite.store.get_offset(lmq, GROUP) is None  # the group's offset went with the topic
    # The client's next full sync re-adds it; a producer that sends again re-creates it from offset 0.
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["gone"])
    await lite.send("gone", b"new")
    (again,) = await lite.receive("c1")
    assert (again.message.body, again.message.offset) == (b"new", 0)


async def test_the_outcomes_are_the_reclaim_jobs(lite: Lite) -> None:
    """The pass and the job's CompareAndDelete are one code path: a row the job saw gone is NOT_FOUND too."""
    await lite.send("t1")
    lite.clock.advance(EXPIRATION_MIN * MINUTE + 1)
    meta = lite.store.lite_topic(PARENT, "t1")
    assert meta is not None
    assert lite.store.delete_lite_topic(PARENT, "t1", meta)
    outcomes = await expiry._delete(lite.store, lite.dispatcher, PARENT, [meta])
    assert outcomes == [reclaiming.Outcome.NOT_FOUND]


# --- the summary line ----------------------------------------------------------------------------------------
async def test_the_summary_line_is_rate_limited_and_carries_the_totals_since_the_last(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    summary = expiry.Summary(every_s=300, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger=expiry.__name__)

    assert summary.add(expiry.Report(passes=1, parents=2, scanned=10, expired=3, deleted=3))
    now[0] = 120
    assert not summary.add(expiry.Report(passes=1, parents=2, scanned=10, expired=1, deleted=1))
    now[0] = 299
    assert not summary.add(expiry.Report(passes=1, parents=2, scanned=10, kept_changed=1, expired=1))
    now[0] = 300
    assert summary.add(expiry.Report(passes=1, parents=2, scanned=10))

    lines = [r.getMessage() for r in caplog.records if r.name == expiry.__name__]
    assert len(lines) == 2
    assert "1 pass(es)" in lines[0] and "3 deleted" in lines[0]
    assert "3 pass(es)" in lines[1] and "30 topics read" in lines[1] and "1 deleted" in lines[1]
    assert "kept (changed 1, subscribed 0)" in lines[1]
