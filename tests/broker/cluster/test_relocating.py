"""What a leaving broker copies of its queues that are not lite topics (``cluster.relocating``), over a real
RocksDB store: NORMAL topics and dead letters from the lowest commit point, never a LITE parent's own queue nor
a deleted topic's, in batches bounded by messages and bytes."""

from __future__ import annotations

from pathlib import Path

from lmq_broker import model
from lmq_broker.cluster import relocating
from lmq_broker.config import StoreConfig
from lmq_broker.storage.store import open_store

N0, N1 = model.QueueId("orders", 0), model.QueueId("orders", 1)
DLQ = model.QueueId("%DLQ%billing", 0)


def normal(topic: str, queue: int, n: int, body: bytes = b"x") -> list[model.NewMessage]:
    return [model.NewMessage(f"{topic}-{queue}-{i}", topic, body, (model.QueueId(topic, queue),)) for i in range(n)]


def test_only_normal_topics_and_dead_letters_are_copied_from_the_lowest_commit_point(tmp_path: Path) -> None:
    store = open_store(StoreConfig(data_dir=tmp_path))
    try:
        store.put_parent_topic(model.ParentTopic("orders", model.MessageType.NORMAL, queue_count=2))
        store.put_parent_topic(model.ParentTopic("chat", model.MessageType.LITE))
        lite = model.NewMessage(
            "l0", "chat", b"x", (model.QueueId("chat", 0), model.QueueId.lmq("chat", "a")), "a", model.MessageType.LITE
        )  # indexed into the LITE parent's queue too (--index-parent-queue)
        store.append([*normal("orders", 0, 5), *normal("orders", 1, 3), *normal("%DLQ%billing", 0, 2), lite])
        store.append(normal("gone", 0, 4))  # a topic deleted since: no parent topic here
        store.commit_offset(N0, "g1", 3)
        store.commit_offset(N0, "g2", 2)
        store.commit_offset(N1, "g1", 3)  # consumed to its end
        store.commit_offset(N1, "g2", 3)
        assert relocating.pending(store) == [relocating.Pending(DLQ, 0, 2), relocating.Pending(N0, 2, 5)]
        assert relocating.undrained(store) == 5
        store.put_relocated(N0, 4)
        assert relocating.pending(store) == [relocating.Pending(DLQ, 0, 2), relocating.Pending(N0, 4, 5)]
    finally:
        store.close()


def test_a_group_that_consumed_another_queue_of_the_topic_here_keeps_what_it_has_not_consumed_of_this_one(
    tmp_path: Path,
) -> None:
    """A group with no commit point in a queue starts at its first message (``settlement``): g2 consumed queue 0
    here but never queue 1 (its consumers were down while queue 1 filled), so queue 1 is all to copy, even though
    g1 consumed it to its end. Before, only the groups with a point in that very queue counted: g1's end, and g2's
    three messages were left on the removed broker (found in a red-team review of the scale-down copy)."""
    store = open_store(StoreConfig(data_dir=tmp_path))
    try:
        store.put_parent_topic(model.ParentTopic("orders", model.MessageType.NORMAL, queue_count=2))
        store.append([*normal("orders", 0, 5), *normal("orders", 1, 3)])
        store.commit_offset(N0, "g1", 5)
        store.commit_offset(N0, "g2", 5)
        store.commit_offset(N1, "g1", 3)
        assert relocating.pending(store) == [relocating.Pending(N1, 0, 3)]
        store.commit_offset(N1, "g2", 1)
        assert relocating.pending(store) == [relocating.Pending(N1, 1, 3)]
        # a group whose consumers said they consume the topic (Telemetry) but that has no point here at all
        assert relocating.pending(store, {"orders": {"g3"}}) == [
            relocating.Pending(N0, 0, 5), relocating.Pending(N1, 0, 3)
        ]  # fmt: skip
        assert relocating.undrained(store, {"orders": {"g3"}, "other": {"g4"}}) == 8
    finally:
        store.close()


def test_a_batch_is_bounded_by_messages_and_bytes_and_holds_at_least_one(tmp_path: Path) -> None:
    store = open_store(StoreConfig(data_dir=tmp_path))
    try:
        store.append(normal("orders", 0, 600, b"y" * 100))
        job = relocating.Pending(N0, 10, 600)
        messages, after = relocating.batch(store, job, 1 << 20)
        assert (len(messages), messages[0].offset, after) == (relocating.BATCH_MESSAGES, 10, 510)
        messages, after = relocating.batch(store, job, 250)  # two bodies fit
        assert ([m.offset for m in messages], after) == ([10, 11], 12)
        messages, after = relocating.batch(store, job, 10)  # one, bigger than the bound
        assert ([m.offset for m in messages], after) == ([10], 11)
    finally:
        store.close()


def test_each_queue_goes_to_one_remaining_slot_and_then_the_next() -> None:
    first = [relocating.destination(model.QueueId("t", q), 3, 0) for q in range(50)]
    assert set(first) == {0, 1, 2}  # spread over today's ring
    assert [relocating.destination(model.QueueId("t", q), 3, 1) for q in range(50)] == [(s + 1) % 3 for s in first]
