"""Leases with injected time: ordered hand-out, acks moving the commit point, redelivery and suspend."""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable
from typing import TypeVar

import pytest

from lmq_broker import errors, model
from lmq_broker.dispatch.leases import LeaseKey, LeaseTable, Pick, QueueLeases, Receipt, Renewal, over_suspend_cap
from lmq_broker.storage import keys, ranges

T = TypeVar("T")

KEY = LeaseKey("%LMQ%$p$t", 0, "g")


def lease_all(table: LeaseTable, state: QueueLeases, picks: list[Pick], now: int, invisible: int) -> list[Receipt]:
    receipts = []
    for pick in picks:
        lease_id = table.new_lease_id()
        state.lease(pick, now, invisible, lease_id, "c")
        receipts.append(Receipt(table.incarnation, KEY.topic, KEY.queue, pick.offset, lease_id))
    table.watch(KEY, now + invisible)
    return receipts


def test_ordered_queue_hands_out_nothing_while_its_head_is_leased() -> None:
    table = LeaseTable("inc")
    state = table.open(KEY, committed=0, ordered=True)
    picks = state.picks(now_ms=0, limit=2)
    assert picks == [Pick(0, 1, False), Pick(1, 1, False)]
    lease_all(table, state, picks, 0, 1000)
    assert state.picks(now_ms=10, limit=5) == []
    assert state.blocked(10)
    assert not state.has_ready(10, max_offset=5)


def test_acks_move_the_commit_point_over_the_acknowledged_prefix() -> None:
    table = LeaseTable("inc")
    state = table.open(KEY, committed=0, ordered=True)
    r0, r1, r2 = lease_all(table, state, state.picks(0, 3), 0, 1000)
    assert table.ack(KEY, r1, 0)  # out of order: 0 still out, 1 is acked above the commit point
    assert (state.committed, tuple(state.acked_above())) == (0, (1,))
    assert table.ack(KEY, r0, 0)
    assert (state.committed, tuple(state.acked_above())) == (2, ())
    assert table.ack(KEY, r2, 0)
    assert state.committed == 3
    assert state.idle
    assert state.picks(5, 1) == [Pick(3, 1, False)]
    assert not table.ack(KEY, r2, 0)  # twice: accepted, nothing to persist


def test_expired_lease_is_redelivered_first_with_the_next_attempt() -> None:
    table = LeaseTable("inc")
    state = table.open(KEY, committed=0, ordered=True)
    lease_all(table, state, state.picks(0, 1), now=0, invisible=1000)
    assert state.picks(999, 5) == []
    assert table.due(999) == []
    assert table.due(1000) == [KEY]
    assert state.picks(1000, 3) == [Pick(0, 2, True), Pick(1, 1, False), Pick(2, 1, False)]


def test_change_invisible_counts_an_attempt_unless_suspended() -> None:
    table = LeaseTable("inc")
    state = table.open(KEY, committed=0, ordered=True)
    (r0,) = lease_all(table, state, state.picks(0, 1), 0, 60_000)
    nacked, lease = table.change(KEY, r0, now_ms=100, invisible_ms=500, suspend=False)
    assert lease.visible_at_ms == 600
    assert state.picks(600, 1) == [Pick(0, 2, True)]
    with pytest.raises(errors.InvalidReceiptHandle):
        table.change(KEY, r0, 100, 500, suspend=True)  # superseded handle
    _, lease = table.change(KEY, nacked, now_ms=200, invisible_ms=300, suspend=True)
    assert state.picks(500, 1) == [Pick(0, 1, True, 300)]  # suspended: same attempt again, 300 ms suspended


def test_the_handle_of_an_earlier_delivery_settles_nothing_once_the_message_went_out_again() -> None:
    """A slow consumer's lease runs out and the message goes out again (to it or to another consumer): the first
    handle neither acks nor changes it, the second delivery stays out, and its own handle settles it."""
    table = LeaseTable("inc")
    state = table.open(KEY, committed=0, ordered=True)
    (first,) = lease_all(table, state, state.picks(0, 1), 0, 1000)
    (second,) = lease_all(table, state, state.picks(1000, 1), 1000, 1000)
    for late in (lambda: table.ack(KEY, first, 1500), lambda: table.change(KEY, first, 1500, 5000, suspend=False)):
        with pytest.raises(errors.InvalidReceiptHandle, match="no longer the current lease"):
            late()
    assert state.entries[0].visible_at_ms == 2000 and state.committed == 0 and state.picks(1500, 1) == []
    assert table.ack(KEY, second, 1500) and state.committed == 1


def test_a_handle_whose_invisible_time_ran_out_is_expired_and_its_message_stays_due() -> None:
    """Expired, not delivered again yet: refused all the same (as RocketMQ's proxy refuses an expired handle);
    the message is handed out again, and a handle changed in time (a nack) supersedes the one before it."""
    table = LeaseTable("inc")
    state = table.open(KEY, committed=0, ordered=True)
    (r0,) = lease_all(table, state, state.picks(0, 1), 0, 1000)
    for late in (lambda: table.ack(KEY, r0, 1000), lambda: table.change(KEY, r0, 1000, 5000, suspend=False)):
        with pytest.raises(errors.InvalidReceiptHandle, match="expired"):
            late()
    assert state.committed == 0 and state.picks(1000, 1) == [Pick(0, 2, True)]
    (r1,) = lease_all(table, state, state.picks(1000, 1), 1000, 1000)
    r2, _ = table.change(KEY, r1, 1500, 3000, suspend=False)
    with pytest.raises(errors.InvalidReceiptHandle, match="no longer the current lease"):
        table.ack(KEY, r1, 1600)
    assert table.ack(KEY, r2, 4499) and state.committed == 1
    assert not table.ack(KEY, r1, 9000)  # settled: an ack of it is answered OK, whichever handle


def test_suspended_time_adds_up_over_hand_outs_and_past_the_cap_the_lease_ends_at_once() -> None:
    table = LeaseTable("inc")
    state = table.open(KEY, committed=0, ordered=True)
    (r0,) = lease_all(table, state, state.picks(0, 1), 0, 60_000)
    _, lease = table.change(KEY, r0, now_ms=100, invisible_ms=600, suspend=True, max_suspend_ms=1_000)
    assert lease.visible_at_ms == 700  # within the cap: suspended as asked
    (pick,) = state.picks(700, 1)
    assert pick == Pick(0, 1, True, 600)
    (r1,) = lease_all(table, state, [pick], 700, 60_000)
    _, lease = table.change(KEY, r1, now_ms=800, invisible_ms=500, suspend=True, max_suspend_ms=1_000)
    assert (lease.visible_at_ms, lease.suspended_ms) == (800, 1_100)  # over the cap: visible now
    (pick,) = state.picks(800, 1)
    assert over_suspend_cap(pick.suspended_ms, 1_000) and not over_suspend_cap(pick.suspended_ms, -1)


def test_unordered_queue_skips_leased_messages_within_a_window() -> None:
    table = LeaseTable("inc", window=3)
    state = table.open(KEY, committed=0, ordered=False)
    (r0,) = lease_all(table, state, state.picks(0, 1), 0, 1000)
    picks = state.picks(10, 10)
    assert [p.offset for p in picks] == [1, 2]  # window of 3 in flight
    lease_all(table, state, picks, 10, 1000)
    assert state.picks(20, 10) == []
    assert not state.blocked(20)
    table.ack(KEY, r0, 0)
    assert [p.offset for p in state.picks(30, 10)] == [3]


def test_skip_to_forgets_offsets_retention_removed() -> None:
    table = LeaseTable("inc")
    state = table.open(KEY, committed=0, ordered=True)
    lease_all(table, state, state.picks(0, 2), 0, 10)
    state.skip_to(5)
    assert state.committed == 5 and state.entries == {}
    assert state.picks(100, 1) == [Pick(5, 1, False)]


def test_receipt_handles_round_trip_and_reject_garbage() -> None:
    receipt = Receipt("abc", "%LMQ%$p$t", 0, 42, 7)
    assert Receipt.decode(receipt.encode()) == receipt
    for bad in ["", "r2", "r2 abc t 0 x 7", "r1 abc t 0 1 7", "r2 abc t -1 1 7", "r2  t 0 1 7"]:
        with pytest.raises(errors.InvalidReceiptHandle):
            Receipt.decode(bad)


def test_handles_of_another_incarnation_are_rejected() -> None:
    before = LeaseTable("before")
    old = before.seal(Receipt("before", KEY.topic, 0, 0, 1), "g")
    table = LeaseTable("now")
    with pytest.raises(errors.InvalidReceiptHandle, match="earlier broker incarnation"):
        table.resolve(old, "g")
    receipt, key = table.resolve(table.seal(Receipt("now", KEY.topic, 0, 0, 1), "g"), "g")
    assert key == KEY and receipt.offset == 0


def test_handles_cannot_be_forged_nor_used_by_another_group() -> None:
    table = LeaseTable("inc")
    handle = table.receipt(LeaseKey("%LMQ%$p$t", 0, "victim"), 3, 9)
    assert table.resolve(handle, "victim")[1] == LeaseKey("%LMQ%$p$t", 0, "victim")
    body = handle.rpartition(" ")[0]
    forged = [
        body,  # no tag
        f"{body} {'0' * 32}",  # a made-up tag
        handle.replace(" 3 9 ", " 4 9 "),  # the next offset, with the tag of another
        table.receipt(LeaseKey("%LMQ%$p$t", 0, "attacker"), 3, 9),  # a real handle of another group
    ]
    for bad in forged:
        with pytest.raises(errors.InvalidReceiptHandle):
            table.resolve(bad, "victim")
    with pytest.raises(errors.InvalidReceiptHandle):
        table.resolve(handle, "attacker")  # the victim's handle, presented as another group's


def test_ack_of_a_never_delivered_offset_is_invalid() -> None:
    table = LeaseTable("inc")
    state = table.open(KEY, committed=0, ordered=True)
    lease_all(table, state, state.picks(0, 1), 0, 1000)
    with pytest.raises(errors.InvalidReceiptHandle):
        table.ack(KEY, Receipt("inc", KEY.topic, 0, 9, 1), 0)


def test_renewal_extends_each_auto_renew_lease_ahead_of_its_own_expiry() -> None:
    table = LeaseTable("inc")
    state = table.open(KEY, committed=0, ordered=False)
    renewal = Renewal(slice_ms=1000, ahead_ms=200, holds=lambda holder, key: holder == "alive")
    early, late, gone = state.picks(now_ms=0, limit=3)
    a = state.lease(early, 0, 1000, table.new_lease_id(), "alive", renew_until_ms=10_000)
    b = state.lease(late, 500, 1000, table.new_lease_id(), "alive", renew_until_ms=10_000)
    c = state.lease(gone, 0, 1000, table.new_lease_id(), "dead", renew_until_ms=10_000)
    table.watch(KEY, LeaseTable.watch_at(a, renewal.ahead_ms))
    table.watch(KEY, LeaseTable.watch_at(b, renewal.ahead_ms))
    assert table.due(800, renewal) == []
    assert (a.visible_at_ms, b.visible_at_ms, c.visible_at_ms) == (1800, 1500, 1000)  # b is not due yet
    assert table.due(1000, renewal) == [KEY]  # the dead holder's lease expires on time
    table.due(1300, renewal)
    assert (a.visible_at_ms, b.visible_at_ms, c.visible_at_ms) == (1800, 2300, 1000)
    picks = state.picks(now_ms=1300, limit=5)
    assert picks[0] == Pick(gone.offset, 2, True) and not {early.offset, late.offset} & {p.offset for p in picks}


def test_renewal_stops_at_the_lease_deadline() -> None:
    table = LeaseTable("inc")
    state = table.open(KEY, committed=0, ordered=True)
    renewal = Renewal(slice_ms=1000, ahead_ms=200, holds=lambda holder, key: True)
    (pick,) = state.picks(now_ms=0, limit=1)
    lease = state.lease(pick, 0, 1000, table.new_lease_id(), "c", renew_until_ms=1500)
    table.watch(KEY, LeaseTable.watch_at(lease, renewal.ahead_ms))
    assert table.due(800, renewal) == [] and lease.visible_at_ms == 1500
    assert table.due(1499, renewal) == []
    assert table.due(1500, renewal) == [KEY]
    assert state.picks(now_ms=1500, limit=1) == [Pick(0, 2, True)]


def test_seeded_acks_stay_settled_and_the_gaps_between_are_handed_out_again() -> None:
    table = LeaseTable("inc")
    state = table.open(KEY, committed=3, ordered=False)
    state.seed((2, 5, 7))  # 2 is below the commit point: ignored
    assert state.acked_above() == (5, 7) and state.handed == 8
    picks = state.picks(now_ms=0, limit=10)
    assert [p.offset for p in picks] == [3, 4, 6, 8, 9, 10, 11, 12, 13, 14]
    assert all(p.attempt == 1 and not p.redelivery for p in picks)
    for pick in state.picks(0, 3):
        state.lease(pick, 0, 1000, 1, "c")
    assert state.ack(3) is True and state.committed == 4
    assert state.ack(4) is True and state.committed == 6  # over the seeded 5
    assert state.ack(6) is True and (state.committed, tuple(state.acked_above())) == (8, ())


def test_gone_offsets_are_settled_without_skipping_earlier_pending_ones() -> None:
    state = LeaseTable("inc").open(KEY, committed=0, ordered=True)
    assert state.settle_gone(2, 4) is False  # 0 and 1 are still to be handed out
    assert [p.offset for p in state.picks(0, 10)] == [0, 1, 4, 5, 6, 7, 8, 9, 10, 11]
    for pick in state.picks(0, 2):
        state.lease(pick, 0, 1000, 1, "c")
    state.ack(1)
    assert state.ack(0) is True and state.committed == 4 and state.acked_above() == ()
    assert state.settle_gone(4, 6) is True and state.committed == 6


# --- settled offsets are runs: a lost segment of millions of offsets costs one run -----------------------

HOLE = 2_000_000
FAST_S = 0.05


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    """``fn``'s result and the CPU time this thread spent in it: a walk of the hole's two million offsets would
    take far more than ``FAST_S``, while a busy host (other suites, other workers) moves wall-clock time, not this."""
    start = time.thread_time()
    out = fn()
    return out, time.thread_time() - start


def test_a_two_million_offset_hole_settles_commits_and_seeds_as_one_run() -> None:
    table = LeaseTable("inc")
    state = table.open(KEY, committed=0, ordered=False)
    (r0,) = lease_all(table, state, [Pick(0, 1, False)], 0, 30_000)  # in flight at the commit point
    tracemalloc.start()
    try:
        moved, settle_s = _timed(lambda: state.settle_gone(1, HOLE + 1))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not moved and state.committed == 0 and len(state.entries) == 1
    assert settle_s < FAST_S and peak < 64 * 1024
    acked, above_s = _timed(state.acked_above)
    value, encode_s = _timed(lambda: keys.encode_acked(state.committed, acked))
    assert acked.runs == ((1, HOLE + 1),) and len(acked) == HOLE and len(value) < 32
    assert above_s < FAST_S and encode_s < FAST_S
    (committed, restored), decode_s = _timed(lambda: keys.decode_acked(value))
    fresh = QueueLeases(committed, ordered=False, window=1024)
    _, seed_s = _timed(lambda: fresh.seed(restored))
    assert decode_s < FAST_S and seed_s < FAST_S and fresh.acked_above() == acked
    assert fresh.picks(0, 3) == [Pick(0, 1, False), Pick(HOLE + 1, 1, False), Pick(HOLE + 2, 1, False)]
    # the window counts leases out, not the span: one lease out leaves room for 1023 more
    assert len(state.picks(0, 2000)) == 1023 and state.picks(0, 1)[0].offset == HOLE + 1
    assert table.ack(KEY, r0, 0) and state.committed == HOLE + 1 and state.idle  # one jump over the hole
    assert state.acked_above() == ()


def test_the_commit_point_jumps_a_gone_range_once_the_leases_before_it_are_settled() -> None:
    table = LeaseTable("inc")
    state = table.open(KEY, committed=0, ordered=True)
    r0, r1 = lease_all(table, state, state.picks(0, 2), 0, 1000)
    assert not state.settle_gone(5, 1_000_005)  # a hole ahead, 2..4 not handed out yet: pending
    assert state.picks(0, 10) == []  # ordered: the head is out
    assert table.ack(KEY, r1, 0) and state.committed == 0
    assert table.ack(KEY, r0, 0) and state.committed == 2
    assert state.picks(0, 4) == [Pick(2, 1, False), Pick(3, 1, False), Pick(4, 1, False), Pick(1_000_005, 1, False)]
    assert state.acked_above().runs == ((5, 1_000_005),)


def test_acks_above_a_stuck_head_merge_into_runs() -> None:
    table = LeaseTable("inc")
    state = table.open(KEY, committed=0, ordered=False)
    receipts = lease_all(table, state, state.picks(0, 1000), 0, 1000)
    for r in receipts[1:]:
        table.ack(KEY, r, 0)
    assert state.acked_above().runs == ((1, 1000),) and len(state.entries) == 1
    assert state.has_ready(0, max_offset=2000)  # 999 settled: room for more
    table.ack(KEY, receipts[0], 0)
    assert state.committed == 1000 and state.idle


def test_seed_skips_what_lies_below_the_commit_point_and_clip_forgets_above_a_lowered_end() -> None:
    state = QueueLeases(10, ordered=True, window=1024)
    state.seed(ranges.OffsetRanges(((3, 12), (15, 20))))
    assert state.committed == 12 and state.acked_above().runs == ((15, 20),) and state.handed == 20
    state.lease(Pick(12, 1, False), 0, 1000, 1, "c")
    state.clip(13, 2)  # a rebuilt index ends the queue at 13: 15..19 will be new messages
    assert state.acked_above() == () and state.handed == 13 and list(state.entries) == [12]


def test_acked_values_encode_runs_and_read_the_former_bitmap() -> None:
    acked = ranges.OffsetRanges.of([7, 3, 4, 5, 9, 1000, 1001])
    assert acked.runs == ((3, 6), (7, 8), (9, 10), (1000, 1002))
    assert list(acked) == [3, 4, 5, 7, 9, 1000, 1001] and acked[3] == 7 and acked[-1] == 1001 and 1000 in acked
    assert keys.decode_acked(keys.encode_acked(2, acked)) == (2, acked)
    assert tuple(keys.decode_acked(keys.encode_acked(2, (4, 7, 9)))[1]) == (4, 7, 9)
    legacy = keys.U64.pack(2) + bytes([0b00100101, 0xFF, 0x01])  # bits 0, 2, 5, 8..16: offsets 3, 5, 8, 11..19
    committed, decoded = keys.decode_acked(legacy)
    assert (committed, tuple(decoded)) == (2, (3, 5, 8, *range(11, 20)))
    with pytest.raises(errors.InvalidArgument):
        keys.encode_acked(5, (5, 6))


def test_an_acked_value_over_the_cap_is_refused_not_cut_short() -> None:
    many = ranges.OffsetRanges((2 * i + 1, 2 * i + 2) for i in range(keys.ACKED_MAX_RUNS + 1))
    with pytest.raises(errors.InvalidArgument):
        keys.encode_acked(0, many)
    fits = ranges.OffsetRanges(many.runs[: keys.ACKED_MAX_RUNS])
    value = keys.encode_acked(0, fits)
    assert len(value) <= keys.ACKED_MAX_BYTES and keys.decode_acked(value) == (0, fits)


# --- delivery attempts that survive a restart (``QueueLeases.handouts``, ``seed``) -------------------------------


def test_handouts_cost_nothing_while_every_message_goes_out_once() -> None:
    table = LeaseTable("inc")
    state = table.open(KEY, committed=5, ordered=True)
    assert state.handouts() == model.NO_HANDOUTS
    receipts = lease_all(table, state, state.picks(0, 3), 0, 1000)
    assert state.handouts() == model.Handouts(8) and state.counts == {}
    table.ack(KEY, receipts[0], 0)
    assert state.handouts() == model.Handouts(8)  # 6 and 7 are out: delivered once
    table.ack(KEY, receipts[1], 0)
    table.ack(KEY, receipts[2], 0)
    assert state.committed == 8 and state.handouts() == model.NO_HANDOUTS


def test_redeliveries_and_suspends_are_counted_and_seeded_back_after_a_restart() -> None:
    table = LeaseTable("inc")
    state = table.open(KEY, committed=0, ordered=False)
    r0, r1, r2, _ = lease_all(table, state, state.picks(0, 4), 0, 1000)
    table.change(KEY, r0, 0, 0, suspend=False)  # a nack: counted
    lease_all(table, state, [p for p in state.picks(0, 4) if p.offset == 0], 0, 1000)  # attempt 2
    table.change(KEY, r1, 0, 5000, suspend=True)  # suspended: its next hand-out repeats attempt 1
    table.ack(KEY, r2, 0)
    saved = state.handouts()
    assert saved == model.Handouts(4, ((0, 2), (1, 0)))
    assert keys.decode_progress(keys.encode_acked(state.committed, state.acked_above(), saved))[2] == saved

    after = LeaseTable("inc2").open(KEY, committed=0, ordered=False)  # the restarted broker
    after.seed(state.acked_above(), saved)
    assert after.picks(0, 4) == [Pick(0, 3, True), Pick(1, 1, False), Pick(3, 2, True), Pick(4, 1, False)]


def test_a_suspend_after_redeliveries_repeats_the_attempt_across_a_restart() -> None:
    table = LeaseTable("inc")
    state = table.open(KEY, committed=0, ordered=True)
    for attempt in (1, 2, 3):
        (pick,) = state.picks(attempt * 10_000, 1)
        assert pick.attempt == attempt
        (receipt,) = lease_all(table, state, [pick], attempt * 10_000, 1000)
    table.change(KEY, receipt, 30_000, 60_000, suspend=True)
    after = LeaseTable("inc2").open(KEY, committed=0, ordered=True)
    after.seed((), state.handouts())
    assert after.picks(0, 1) == [Pick(0, 3, True)]


def test_seeded_handouts_stop_at_the_queue_end_and_skip_settled_offsets() -> None:
    state = LeaseTable("inc").open(KEY, committed=2, ordered=True)
    state.seed((4,), model.Handouts(9, ((1, 5), (3, 4), (4, 7), (6, 0))), end=6)  # the log lost 6..8
    assert state.counts == {3: 4} and state.delivered == 6 and state.handed == 6
    assert state.picks(0, 7) == [
        Pick(2, 2, True), Pick(3, 5, True), Pick(5, 2, True), *(Pick(o, 1, False) for o in range(6, 10))
    ]  # fmt: skip


def test_an_old_record_without_handouts_hands_pending_offsets_out_as_first_attempts() -> None:
    legacy_runs = keys.U64.pack(2 | keys.ACKED_RANGES_FLAG) + bytes([2, 1])  # acked 4, as written before
    assert keys.decode_progress(legacy_runs) == (2, ranges.OffsetRanges(((4, 5),)), model.NO_HANDOUTS)
    legacy_bitmap = keys.U64.pack(2) + bytes([0b10])  # bit 1: offset 4
    assert keys.decode_progress(legacy_bitmap) == (2, ranges.OffsetRanges(((4, 5),)), model.NO_HANDOUTS)
    state = LeaseTable("inc").open(KEY, committed=2, ordered=True)
    _, acked, handouts = keys.decode_progress(legacy_runs)
    state.seed(acked, handouts)
    assert state.picks(0, 2) == [Pick(2, 1, False), Pick(3, 1, False)]


def test_handout_values_round_trip_and_bad_ones_are_refused() -> None:
    handouts = model.Handouts(300, ((10, 0), (11, 5), (299, 17)))
    value = keys.encode_acked(7, (20, 21, 400), handouts)
    assert keys.decode_progress(value) == (7, ranges.OffsetRanges(((20, 22), (400, 401))), handouts)
    assert keys.decode_acked(value) == (7, ranges.OffsetRanges(((20, 22), (400, 401))))
    assert keys.decode_progress(keys.encode_acked(7, (), model.Handouts(7))) == (7, ranges.EMPTY, model.NO_HANDOUTS)
    for bad in (
        model.Handouts(7, ((7, 2),)),  # counts without a mark above the commit point
        model.Handouts(10, ((6, 2),)),  # below the commit point
        model.Handouts(10, ((10, 2),)),  # at the mark
        model.Handouts(10, ((8, 2), (8, 3))),  # not ascending
        model.Handouts(10, ((8, -1),)),
        model.Handouts(5000, tuple((o, 2) for o in range(7, 7 + keys.HANDOUTS_MAX_COUNTS + 1))),
    ):
        with pytest.raises(errors.InvalidArgument):
            keys.encode_acked(7, (), bad)
    most = model.Handouts(5000, tuple((o, 2**40) for o in range(7, 7 + keys.HANDOUTS_MAX_COUNTS)))
    many = ranges.OffsetRanges((6000 + 2 * i + 1, 6000 + 2 * i + 2) for i in range(keys.ACKED_MAX_RUNS))
    assert len(keys.encode_acked(7, many, most)) <= keys.ACKED_MAX_BYTES


def test_counts_past_the_cap_keep_the_lowest_offsets() -> None:
    state = LeaseTable("inc").open(KEY, committed=0, ordered=False)
    total = keys.HANDOUTS_MAX_COUNTS + 10
    state.window = total
    for pick in state.picks(0, total):
        state.lease(Pick(pick.offset, 2, True), 0, 1000, 1, "c")
    saved = state.handouts()
    assert saved.mark == total and len(saved.counts) == keys.HANDOUTS_MAX_COUNTS
    assert saved.counts[-1] == (keys.HANDOUTS_MAX_COUNTS - 1, 2)
    after = LeaseTable("inc2").open(KEY, committed=0, ordered=False)
    after.window = total
    after.seed((), saved)
    assert {p.attempt for p in after.picks(0, total)} == {3, 2}  # the ones past the cap: delivered once


def test_settling_clipping_and_dropping_forget_or_reset_counts() -> None:
    table = LeaseTable("inc")
    state = table.open(KEY, committed=0, ordered=False)
    for pick in state.picks(0, 6):
        state.lease(Pick(pick.offset, 3, True), 0, 1000, 1, "c")
    assert state.counts == dict.fromkeys(range(6), 3)
    state.settle_gone(1, 2)
    state.skip_to(1)
    state.drop_leases([3], table.next_lease_id)  # another message at 3 now: never delivered
    state.clip(5, table.next_lease_id)
    assert state.counts == {2: 3, 3: 0, 4: 3} and state.delivered == 5
    assert [(p.offset, p.attempt) for p in state.picks(2_000, 5)] == [(2, 4), (3, 1), (4, 4), (5, 1), (6, 1)]
