"""Recently appended messages: a window is served only when every offset in it is known."""

from __future__ import annotations

import gc
import tracemalloc

from lmq_broker import model
from lmq_broker.dispatch.recent import ENTRY_OVERHEAD_BYTES, RecentMessages
from lmq_broker.dispatch.testing import lite_message

LMQ = model.QueueId.lmq("P", "t")
KEY = (LMQ.topic, 0)


def appended(recent: RecentMessages, offsets: range, body: bytes = b"x") -> None:
    messages = [lite_message("t", body, message_id=f"m{o}") for o in offsets]
    results = [model.AppendResult(f"m{o}", (model.QueueId("P", 0), LMQ), (o, o), 1000 + o) for o in offsets]
    recent.add(messages, results)


def test_window_is_served_from_memory_up_to_the_queue_end() -> None:
    recent = RecentMessages()
    appended(recent, range(3))
    assert recent.end(KEY) == 3
    window = recent.window(KEY, 1, 10)
    assert window is not None
    assert [(m.offset, m.message_id, m.store_timestamp_ms, m.queue) for m in window] == [
        (1, "m1", 1001, LMQ),
        (2, "m2", 1002, LMQ),
    ]
    assert recent.end(("P", 0)) is None  # a lite message's parent-queue entry is not kept


def test_unknown_queue_or_evicted_offset_means_ask_the_store() -> None:
    recent = RecentMessages(max_bytes=2 * (4 + ENTRY_OVERHEAD_BYTES) + 5)
    assert recent.window(KEY, 0, 1) is None
    appended(recent, range(4), body=b"abcd")  # room for two entries: the oldest are evicted
    assert recent.window(KEY, 0, 3) is None
    tail = recent.window(KEY, 2, 3)
    assert tail is not None and [m.offset for m in tail] == [2, 3]


def test_forgotten_queue_is_not_served_until_appended_again() -> None:
    recent = RecentMessages()
    appended(recent, range(2))
    recent.forget(KEY)
    assert recent.window(KEY, 0, 1) is None
    appended(recent, range(1), body=b"new")  # re-created: offsets restart
    window = recent.window(KEY, 0, 5)
    assert window is not None and [m.body for m in window] == [b"new"]


def test_queue_count_is_bounded() -> None:
    recent = RecentMessages(max_queues=2)
    for name in ("a", "b", "c"):
        q = model.QueueId.lmq("P", name)
        recent.add([lite_message(name)], [model.AppendResult("m", (q,), (0,), 1)])
    assert recent.end((model.QueueId.lmq("P", "a").topic, 0)) is None
    assert recent.end((model.QueueId.lmq("P", "c").topic, 0)) == 1


def test_only_the_queues_of_topics_with_readers_are_kept_and_others_forget_their_end() -> None:
    recent = RecentMessages()
    other = model.QueueId.lmq("P", "other")
    appended(recent, range(2))
    results = [
        model.AppendResult("a", (model.QueueId("P", 0), LMQ), (0, 2), 1),
        model.AppendResult("b", (model.QueueId("P", 0), other), (1, 0), 1),
    ]
    recent.add([lite_message("t"), lite_message("other")], results, readers={other.topic})
    assert recent.end(KEY) is None  # nobody reads it any more: its end is not tracked from here on
    assert recent.window(KEY, 0, 2) is None
    kept = recent.window((other.topic, 0), 0, 0)
    assert kept is not None and [m.message_id for m in kept] == ["m"]


def test_no_readers_keeps_nothing() -> None:
    recent = RecentMessages()
    messages = [lite_message("t", message_id=f"m{o}") for o in range(3)]
    results = [model.AppendResult(f"m{o}", (LMQ,), (o,), 1) for o in range(3)]
    recent.add(messages, results, readers=set())
    assert recent.end(KEY) is None and recent.window(KEY, 0, 2) is None


def test_entry_count_is_bounded() -> None:
    recent = RecentMessages(max_messages=3)
    appended(recent, range(10))
    assert recent.window(KEY, 0, 9) is None
    tail = recent.window(KEY, 7, 9)
    assert tail is not None and [m.offset for m in tail] == [7, 8, 9]


def test_a_flood_of_one_byte_messages_stays_within_the_byte_bound() -> None:
    """Bodies alone would let 1.5M one-byte messages in (issue 12: +861 MiB); the per-entry charge keeps
    the cache's real memory, as tracemalloc counts it, near its byte bound."""
    bound = 2 * 1024 * 1024
    recent = RecentMessages(max_bytes=bound, max_messages=10**9)
    gc.collect()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        for first in range(0, 100_000, 1000):
            appended(recent, range(first, first + 1000), body=b"1")
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert held < 1.5 * bound, f"{held / 1024 / 1024:.1f} MiB held for a {bound // 1024 // 1024} MiB bound"
    assert recent.end(KEY) == 100_000
