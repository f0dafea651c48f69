"""Ring slots, membership and owner resolution (lmq_broker.cluster): pure values, no I/O."""

from __future__ import annotations

from collections import Counter

import pytest

from lmq_broker import errors
from lmq_broker.cluster import membership as mb
from lmq_broker.cluster import ring, trust

NAMES = [f"%LMQ%$AGENT_TASK_NS$session-{i}" for i in range(20_000)]


def test_jump_is_stable_and_in_range() -> None:
    for slots in (1, 2, 3, 7, 64):
        got = [ring.jump(ring.key_of(n), slots) for n in NAMES[:500]]
        assert all(0 <= s < slots for s in got)
        assert got == [ring.jump(ring.key_of(n), slots) for n in NAMES[:500]]
    assert ring.jump(0, 1) == 0
    with pytest.raises(ValueError):
        ring.jump(1, 0)


def test_known_slots_do_not_drift() -> None:
    """Pinned answers: every broker (any version, any process) must place a name on the same slot."""
    pinned = {name: ring.slot_of(name, 5) for name in ("%LMQ%$P$a", "%LMQ%$P$b", "%LMQ%$P$session-1")}
    again = {name: ring.jump(ring.key_of(name), 5) for name in pinned}
    assert pinned == again
    assert ring.key_of("%LMQ%$P$a") != ring.key_of("%LMQ%$P$b")


def test_jump_spreads_evenly() -> None:
    for slots in (2, 3, 4):
        counts = Counter(ring.slot_of(n, slots) for n in NAMES)
        expected = len(NAMES) / slots
        assert set(counts) == set(range(slots))
        assert all(abs(c - expected) < 0.05 * expected for c in counts.values()), counts


def test_growing_the_ring_moves_keys_only_onto_new_slots() -> None:
    for before, after in ((1, 2), (2, 3), (3, 4), (2, 4), (4, 6)):
        moved = 0
        for n in NAMES:
            old, new = ring.slot_of(n, before), ring.slot_of(n, after)
            if old != new:
                assert new >= before, f"{n} moved from {old} to old slot {new}"
                moved += 1
        share = moved / len(NAMES)
        assert abs(share - (after - before) / after) < 0.03


def test_slot_numbers_are_pod_major() -> None:
    assert [ring.slot_number(o, p, 2) for o in range(3) for p in range(2)] == list(range(6))
    with pytest.raises(ValueError):
        ring.slot_number(0, 2, 2)


def test_membership_parse_and_validation() -> None:
    m = mb.Membership.parse("a:1, b:2,c:3", "2")
    assert m.members == ("a:1", "b:2", "c:3")
    assert m.sizes == (2, 3)
    assert (m.size, m.epoch) == (3, 2)
    assert m.slot_of("b:2") == 1
    with pytest.raises(errors.InvalidArgument):
        m.slot_of("d:4")
    for peers, history in (("", ""), ("a:1,a:1", ""), ("a", ""), ("a:1,b:2", "3"), ("a:1,b:2", "x"), ("a:1", "0")):
        with pytest.raises(errors.InvalidArgument):
            mb.Membership.parse(peers, history)
    assert mb.Membership.single("x:1").grown("y:2") == mb.Membership(("x:1", "y:2"), (1, 2))


def test_single_member_owns_everything_without_look_up() -> None:
    m = mb.Membership.single("a:1")
    asked: list[int] = []

    def holds(slot: int) -> bool:
        asked.append(slot)
        return True

    assert all(mb.owner(m, n) == 0 for n in NAMES[:100])
    assert all(mb.resolve(m, n, holds) == 0 for n in NAMES[:100])
    assert asked == []


def test_candidates_after_scale_up() -> None:
    m = mb.Membership.parse("a:1,b:2,c:3", "2")
    unmoved = moved = 0
    for n in NAMES[:3000]:
        found = mb.candidates(m, n)
        assert found[0] == mb.owner(m, n) == ring.slot_of(n, 3)
        if len(found) == 1:
            unmoved += 1
        else:
            assert found == (2, ring.slot_of(n, 2))  # only keys that moved onto the new slot have a second candidate
            moved += 1
    assert moved and unmoved and moved < unmoved


def test_a_topic_stays_where_it_was_created() -> None:
    m = mb.Membership.parse("a:1,b:2,c:3", "2")
    name = next(n for n in NAMES if len(mb.candidates(m, n)) == 2)
    old = ring.slot_of(name, 2)
    asked: list[int] = []

    def held_by_old(slot: int) -> bool:
        asked.append(slot)
        return slot == old

    assert mb.resolve(m, name, held_by_old) == old  # created before the scale-up: stays
    assert asked == [old]
    assert mb.resolve(m, name, lambda _slot: False) == 2  # new topic: follows today's ring


def test_leaving_slot_takes_no_new_topics_and_keeps_what_it_holds_until_handed_over() -> None:
    """Part 1 sent a leaving slot's own topics to today's owner at once; a topic then had messages on two
    brokers at the same time (order lost). Now the leaving slot keeps a topic until it has drained it."""
    m = mb.Membership(("a:1", "b:2", "c:3"), (3, 2))  # scale-down 3 -> 2: slot 2 drains
    assert not m.writable(2) and m.writable(1)
    assert m.leaving(2) and not m.leaving(1) and list(m.leaving_slots) == [2]
    name = next(n for n in NAMES if ring.slot_of(n, 3) == 2)
    today = ring.slot_of(name, 2)
    assert mb.candidates(m, name) == (today, 2)
    assert mb.resolve(m, name, lambda _slot: False) == today  # a new topic never lands on the leaving slot
    assert mb.resolve(m, name, lambda slot: slot == 2) == 2  # held there and not drained yet: stays
    assert mb.resolve(m, name, lambda slot: slot in (2, today)) == today  # handed over already
    assert mb.subscribers_at(m, name, 2) == (2, today)  # consumers wait at today's owner too
    assert mb.subscribers_at(m, name, today) == (today,)


def test_scale_down_marks_then_sheds_the_tail() -> None:
    three = mb.Membership.parse("a:1,b:2,c:3", "2")
    leaving = three.shrunk(2)
    assert leaving.members == three.members and leaving.sizes == (2, 3, 2)
    assert three.shrunk(3) is three
    with pytest.raises(errors.InvalidArgument):
        three.shrunk(0)
    shed = leaving.shed()
    assert shed == mb.Membership(("a:1", "b:2"), (2,))  # the same ring (a later epoch)
    assert (three.epoch, leaving.epoch, shed.epoch) == (2, 3, 4)  # every change a new epoch, never back
    # a key the bigger ring never put on a removed slot keeps its slot: the capped history is exact
    assert all(ring.slot_of(n, 3) == ring.slot_of(n, 2) for n in NAMES[:2000] if ring.slot_of(n, 3) < 2)
    assert mb.of(("a:1", "b:2"), (1, 3, 4, 2)).sizes == (1, 2)
    assert mb.Membership.from_json(leaving.to_json()) == leaving
    with pytest.raises(errors.InvalidArgument):
        mb.Membership.from_json('{"members": ["a:1"]}')


def test_epochs_default_to_the_history_length_and_survive_json() -> None:
    grown = mb.Membership.parse("a:1,b:2,c:3", "1,2")
    assert grown.epoch == 3  # brokers started with the same flags agree without being told
    assert grown.at(9).epoch == 9 and grown.at(9) == grown  # equal rings, whatever their epochs
    assert mb.Membership.from_json(grown.at(9).to_json()).epoch == 9
    assert mb.Membership.from_json('{"members": ["a:1"], "sizes": [1]}').epoch == 1  # stored before epochs


def test_peer_headers_verify_only_with_the_secret_the_method_and_the_time() -> None:
    secret, method, now = trust.secret_of("", "admin-sk"), "/pkg.Service/SendMessage", 1_000_000
    assert secret and secret != trust.secret_of("", "other") and trust.secret_of("given", "admin-sk") == b"given"
    assert trust.secret_of("", "") == b""
    header = trust.header(secret, method, 7, now)
    assert trust.verify(secret, method, [header], now + 5_000) == (trust.PeerCall(7), True)
    assert trust.verify(secret, method, [("x-mq-client-id", "c")], now) == (None, False)
    refused = [
        trust.verify(b"another secret", method, [header], now),  # another cluster
        trust.verify(secret, "/pkg.Service/SyncLiteSubscription", [header], now),  # replayed on another method
        trust.verify(secret, method, [header], now + trust.MAX_SKEW_MS + 1),  # too old
        trust.verify(secret, method, [(trust.HEADER, header[1].replace("7;", "8;", 1))], now),  # epoch changed
        trust.verify(secret, method, [(trust.HEADER, "1")], now),  # not a header at all
        trust.verify(b"", method, [header], now),  # a broker with no secret trusts nobody
    ]
    assert refused == [(None, True)] * len(refused)
