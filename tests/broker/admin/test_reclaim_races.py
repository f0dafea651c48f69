"""Reclaims racing with live traffic, over a real dispatcher and both stores (RocksDB + segments in tmp_path,
and the in-memory twin) on a manual clock: a lite topic deleted by the in-broker expiry (the job's delete is the
same code) while a client still holds a receipt handle of it, then re-created by a producer from offset 0."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any

import pytest
from expiring import EXPIRATION_MIN, MINUTE, SETTINGS, sent_and_expired

from lmq_broker import errors, model
from lmq_broker.admin import expiry, reclaiming
from lmq_broker.dispatch import metadata
from lmq_broker.dispatch import testing as dispatch_testing
from lmq_broker.dispatch.testing import GROUP, PARENT, Lite, until
from lmq_broker.storage.testing import another_writer

pytestmark = pytest.mark.asyncio

HOUR_MS = 60 * MINUTE


def handed_out(lite: Lite, name: str) -> bool:
    """The hand-out of ``name``'s message is written (a few ms after the receive, on real time: it counts as a
    consume, so it must land before the manual clock moves on, or the topic is not idle)."""
    return lite.store.get_handouts(model.QueueId.lmq(PARENT, name), GROUP).mark > 0


async def reclaimed_while_out(lite: Lite) -> str:
    """``t`` gets a message that c1 receives for two hours (a slow consumer), then expires while it is out:
    returns the handle c1 still holds."""
    await lite.send("t", b"old")
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t"])
    (old,) = await lite.receive("c1", invisible_ms=2 * HOUR_MS)
    await until(lambda: handed_out(lite, "t"))
    lite.clock.advance(EXPIRATION_MIN * MINUTE + 1)
    report = await expiry.run_pass(lite.store, lite.dispatcher, SETTINGS, lite.clock)
    assert report.deleted == 1 and lite.store.lite_topic(PARENT, "t") is None
    return old.receipt_handle


async def test_a_handle_of_a_reclaimed_topic_does_not_ack_the_recreated_topics_message(lite: Lite) -> None:
    old_handle = await reclaimed_while_out(lite)
    await lite.dispatcher.add_lite("c2", GROUP, PARENT, ["t"])  # another member of the group (c1 is busy)
    await lite.send("t", b"new")  # re-created: offset 0 again
    (new,) = await lite.receive("c2", invisible_ms=10_000)  # c2 takes it...
    assert (new.message.body, new.message.offset) == (b"new", 0)

    await lite.dispatcher.ack(GROUP, old_handle)  # ...and c1's late ack of the deleted message comes in

    assert lite.committed("t") in (None, 0)  # the new message is not settled by it
    lite.clock.advance(10_001)  # c2 never acks (it crashed): the new message must come again
    lite.dispatcher.tick()
    again = await lite.receive("c2")
    assert [(d.message.body, d.message.offset) for d in again] == [(b"new", 0)]


async def test_a_handle_of_a_reclaimed_topic_does_not_dead_letter_the_recreated_topics_message(lite: Lite) -> None:
    old_handle = await reclaimed_while_out(lite)
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t"])
    await lite.send("t", b"new")
    (new,) = await lite.receive("c1", invisible_ms=10_000)
    assert new.message.offset == 0

    await lite.dispatcher.dead_letter(GROUP, old_handle)  # the client gives up on the deleted message, late

    assert lite.committed("t") in (None, 0)  # the new message was neither settled by it...
    assert lite.store.queue_offsets(model.QueueId(f"{metadata.DLQ_PREFIX}{GROUP}"))[1] == 0  # ...nor copied to the DLQ
    await lite.dispatcher.ack(GROUP, new.receipt_handle)
    assert lite.committed("t") == 1


async def test_a_handle_of_a_reclaimed_topic_is_refused_before_the_topic_comes_back(lite: Lite) -> None:
    old_handle = await reclaimed_while_out(lite)
    await lite.dispatcher.ack(GROUP, old_handle)  # the message went with its topic: nothing to settle
    assert lite.committed("t") is None and lite.store.lite_topic(PARENT, "t") is None
    with pytest.raises(errors.InvalidReceiptHandle):
        await lite.dispatcher.change_invisible(GROUP, old_handle, 1000)


async def test_an_ack_that_lands_between_the_delete_and_its_news_hides_nothing_of_the_recreated_topic(
    lite: Lite, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store deletes ``t`` in a worker thread; a send that waited for the store's lock meanwhile re-creates
    it at once (offset 0 again), and c1's ack of the old message comes in before the loop hears of the delete
    (its lease state, committed 0, is still there): the ack's commit point (1) must not become the new topic's
    (the new message would never be delivered)."""
    await lite.send("t", b"old")
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t"])
    (old,) = await lite.receive("c1", invisible_ms=2 * HOUR_MS)
    await until(lambda: handed_out(lite, "t"))
    lite.clock.advance(EXPIRATION_MIN * MINUTE + 1)
    deleted, go_on = threading.Event(), threading.Event()
    delete = lite.store.delete_lite_topics

    def delete_then_a_send_gets_the_lock(*args: Any, **kwargs: Any) -> list[bool]:  # the pass's worker thread
        done = delete(*args, **kwargs)
        lite.store.append([dispatch_testing.lite_message("t", b"new", message_id="new")])
        deleted.set()
        go_on.wait(10)
        return done

    monkeypatch.setattr(lite.store, "delete_lite_topics", delete_then_a_send_gets_the_lock)
    passing = asyncio.create_task(expiry.run_pass(lite.store, lite.dispatcher, SETTINGS, lite.clock))
    try:
        await until(deleted.is_set)
        acking = asyncio.create_task(lite.dispatcher.ack(GROUP, old.receipt_handle))
        await asyncio.sleep(0.05)  # as far as it goes before the loop hears of the delete
    finally:
        go_on.set()
    assert (await asyncio.wait_for(passing, 10)).deleted == 1
    await asyncio.wait_for(acking, 10)  # answered OK: its message went with its topic

    meta = lite.store.lite_topic(PARENT, "t")
    assert meta is not None and meta.max_offset == 1  # the re-created topic holds the new message...
    assert lite.committed("t") in (None, 0)  # ...which no commit point has passed
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t"])
    got = await lite.receive("c1")
    assert [(d.message.body, d.message.offset) for d in got] == [(b"new", 0)]


@pytest.mark.parametrize("store", ["lmq"], indirect=True)  # the in-memory twin's scans wait for its one lock too
async def test_a_commit_point_under_way_when_the_delete_begins_lands_first_and_keeps_the_topic(lite: Lite) -> None:
    """c1's ack is written on a store thread (another writer holds the store's write lock) when the pass marks
    ``t``: the delete waits for it, and the consume it records keeps the topic (KEPT_CHANGED) with its commit
    point. (Before, the delete and the commit raced for the lock; the delete first, a send re-creating the topic
    next, then the commit, and the new message was hidden behind the old commit point.)"""
    await lite.send("t", b"old")
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t"])
    (old,) = await lite.receive("c1", invisible_ms=2 * HOUR_MS)
    await until(lambda: handed_out(lite, "t"))
    lite.clock.advance(EXPIRATION_MIN * MINUTE + 1)
    writer = another_writer(lite.store)
    writer.__enter__()
    try:
        acking = asyncio.create_task(lite.dispatcher.ack(GROUP, old.receipt_handle))
        await asyncio.sleep(0.05)  # its commit waits for the store in a pool thread
        passing = asyncio.create_task(expiry.run_pass(lite.store, lite.dispatcher, SETTINGS, lite.clock))
        await until(lambda: lite.dispatcher.reclaims_in_flight() == 1)
    finally:
        writer.__exit__(None, None, None)
    report = await asyncio.wait_for(passing, 10)
    await asyncio.wait_for(acking, 10)

    assert (report.deleted, report.kept_changed) == (0, 1)
    assert lite.store.lite_topic(PARENT, "t") is not None and lite.committed("t") == 1


# --- a parent set to never expire after the topics were read ------------------------------------------------
async def test_a_parent_set_to_never_expire_during_a_pass_keeps_the_topics_not_deleted_yet(
    lite: Lite, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A paced pass over a large parent lasts hours: the policy it read at its start must not outlive a change."""
    await sent_and_expired(lite, "t1", "t2", "t3")
    read_step = expiry._read_step
    steps = 0

    def read_then_change_the_policy(*args: Any, **kwargs: Any) -> Any:
        nonlocal steps
        step = read_step(*args, **kwargs)
        steps += 1
        if steps == 1:  # the operator: these topics never expire from now on
            lite.store.put_parent_topic(model.ParentTopic(PARENT, expiration_minutes=-1))
        return step

    monkeypatch.setattr(expiry, "_read_step", read_then_change_the_policy)
    report = await expiry.run_pass(lite.store, lite.dispatcher, dataclasses.replace(SETTINGS, batch=1), lite.clock)

    assert report.deleted == 0 and report.kept_changed == 1  # t1 was read under the old policy, kept at its delete
    assert [m.lite for m in lite.store.scan_lite_topics(PARENT)] == ["t1", "t2", "t3"]


async def test_a_job_row_of_a_parent_set_to_never_expire_since_the_scan_is_kept(lite: Lite) -> None:
    await lite.send("t1")
    await lite.send("other", parent="Q")  # a parent this broker does not hold a policy for: deleted as before
    scanned = [m for p in (PARENT, "Q") for m in lite.store.scan_lite_topics(p)]
    lite.store.put_parent_topic(model.ParentTopic(PARENT, expiration_minutes=-1))
    rows = reclaiming.Rows(
        [m.parent for m in scanned],
        [m.lite for m in scanned],
        [m.max_offset for m in scanned],
        [m.last_store_ms for m in scanned],
        [m.last_consume_ms for m in scanned],
    )

    for dry_run in (True, False):
        outcomes = await reclaiming.compare_and_delete(
            lite.store, lite.dispatcher, rows, require_no_subscribers=False, dry_run=dry_run
        )
        expected = reclaiming.Outcome.WOULD_DELETE if dry_run else reclaiming.Outcome.DELETED
        assert outcomes == [reclaiming.Outcome.KEPT_CHANGED, expected]
    assert lite.store.lite_topic(PARENT, "t1") is not None and lite.store.lite_topic("Q", "other") is None
