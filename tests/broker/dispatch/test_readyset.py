"""Ready set: deduplicated per client, bounded, overflow becomes a scheduled catch-up."""

from __future__ import annotations

from lmq_broker.dispatch.readyset import Offer, ReadySet


def test_offers_are_deduplicated_and_popped_in_order() -> None:
    ready = ReadySet()
    assert ready.offer("c", "a", 10, 0) is Offer.ADDED
    assert ready.offer("c", "b", 10, 0) is Offer.ADDED
    assert ready.offer("c", "a", 10, 0) is Offer.ALREADY
    assert ready.size("c") == 2
    assert ready.pop("c", 1) == ["a"]
    assert ready.pop("c", 5) == ["b"]
    assert ready.pop("c", 5) == []


def test_full_queue_schedules_a_catchup_instead_of_growing() -> None:
    ready = ReadySet(catchup_delay_ms=100)
    for i in range(3):
        assert ready.offer("c", f"t{i}", 3, now_ms=0) is Offer.ADDED
    assert ready.offer("c", "t3", 3, now_ms=0) is Offer.FULL
    assert ready.size("c") == 3
    assert ready.catchup_pending("c")
    assert ready.next_catchup_ms() == 100
    assert ready.due_catchups(99) == []
    assert ready.due_catchups(100) == ["c"]
    assert not ready.catchup_pending("c")
    assert ready.next_catchup_ms() is None


def test_earlier_catchup_request_wins_and_stale_entries_are_skipped() -> None:
    ready = ReadySet()
    ready.request_catchup("c", 500)
    ready.request_catchup("c", 200)
    ready.request_catchup("c", 900)
    assert ready.next_catchup_ms() == 200
    assert ready.due_catchups(1000) == ["c"]
    assert ready.due_catchups(1000) == []


def test_drop_client_returns_pending_topics_for_redispatch() -> None:
    ready = ReadySet()
    ready.offer("c", "a", 10, 0)
    ready.offer("c", "b", 10, 0)
    ready.request_catchup("c", 5)
    assert ready.drop_client("c") == ["a", "b"]
    assert ready.size("c") == 0
    assert ready.due_catchups(10) == []


def test_discard_topic_from_named_clients() -> None:
    ready = ReadySet()
    ready.offer("c1", "a", 10, 0)
    ready.offer("c2", "a", 10, 0)
    ready.offer("c2", "b", 10, 0)
    ready.discard("a", ["c1", "c2"])
    assert ready.total() == 1
    ready.discard_many("c2", ["b"])
    assert ready.total() == 0
