"""The one door for writes (``dispatch.ingest``): send quotas, arrivals coalesced per loop pass, and dead
letters woken like any other arrival."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from collections.abc import Set as AbstractSet
from pathlib import Path

import pytest
import pytest_asyncio

from lmq_broker import errors, model
from lmq_broker.dispatch import dead_letters, ingest, runtime
from lmq_broker.dispatch.dispatcher import Delivery
from lmq_broker.dispatch.testing import GROUP, PARENT, Lite, config_for, lite_message
from lmq_broker.storage import memory

pytestmark = pytest.mark.asyncio

DLQ = f"%DLQ%{GROUP}"


class Recorder:
    """The reading side as ingest sees it (``ingest.Readers``): records what it is told."""

    def __init__(self) -> None:
        self.arrivals: list[list[str]] = []

    def subscribed(self) -> AbstractSet[str]:
        return set()

    def arrived(self, topics: dict[str, None]) -> None:
        self.arrivals.append(list(topics))


Writes = tuple[ingest.Ingest, Recorder, memory.MemoryStore]


@pytest_asyncio.fixture
async def writes(tmp_path: Path, clock: memory.ManualClock) -> AsyncIterator[Writes]:
    store = memory.MemoryStore()
    rt = runtime.Runtime(store, config_for(tmp_path), clock=clock)
    await rt.start()
    door, recorder = ingest.Ingest(rt), Recorder()
    door.readers = recorder
    door.start(asyncio.get_running_loop())
    yield door, recorder, store
    await door.close()
    await rt.close_executor()


async def test_the_appends_of_one_loop_pass_reach_the_readers_once_in_the_order_written(
    writes: Writes,
) -> None:
    door, recorder, _ = writes
    await asyncio.gather(door.append([lite_message("a")]), door.append([lite_message("b"), lite_message("a")]))
    await asyncio.sleep(0)
    lmq = model.QueueId.lmq
    assert recorder.arrivals == [[PARENT, lmq(PARENT, "a").topic, lmq(PARENT, "b").topic]]


async def test_a_flush_hands_arrivals_over_before_the_pass_ends(writes: Writes) -> None:
    door, recorder, _ = writes
    door.notify_appended({"N": None})
    assert recorder.arrivals == []
    door.flush()
    assert recorder.arrivals == [["N"]]
    await asyncio.sleep(0)  # the flush scheduled for the end of the pass finds nothing more to tell
    assert recorder.arrivals == [["N"]]


async def test_a_dead_letter_is_an_arrival_and_kept_in_memory_for_its_readers(
    writes: Writes,
) -> None:
    door, recorder, store = writes
    await door.append([lite_message("a", b"poison")])
    (stored,) = store.read(model.QueueId.lmq(PARENT, "a"), 0, 1)
    await dead_letters.DeadLetters(door.append).store(GROUP, [stored])
    await asyncio.sleep(0)
    assert recorder.arrivals[-1] == [DLQ]
    cached = door.recent.window(model.QueueId(DLQ, 0), 0, 0)  # a normal topic: its messages are kept
    assert cached is not None
    (dead,) = cached
    assert dead.body == b"poison" and dead.user_properties["__ORIGIN_LITE_TOPIC"] == "a"


async def test_lite_topic_quota_per_parent_counts_only_new_topics(lite: Lite) -> None:
    lite.store.put_parent_topic(model.ParentTopic(PARENT, max_lite_topics=2))
    lite.dispatcher.metadata_changed()
    await lite.send("a")
    await lite.send("b")
    with pytest.raises(errors.LiteTopicQuotaExceeded):
        await lite.send("c")
    await lite.send("a")  # existing topics still take messages
    assert lite.store.lite_topic(PARENT, "c") is None


async def test_lite_topic_quota_per_broker(lite: Lite) -> None:
    lite.store.put_quota(model.Quota("broker", max_lite_topics=1))
    lite.dispatcher.metadata_changed()
    await lite.send("a")
    with pytest.raises(errors.LiteTopicQuotaExceeded):
        await lite.send("b")


async def test_send_rate_quota(lite: Lite) -> None:
    lite.store.put_quota(model.Quota(f"parent:{PARENT}", max_send_rate=2))
    lite.dispatcher.metadata_changed()
    await lite.send("a")
    await lite.send("a")
    with pytest.raises(errors.TooManyRequests):
        await lite.send("a")
    lite.clock.advance(1000)
    await lite.send("a")


async def test_broker_lite_topic_quota_counts_new_topics_across_parents(lite: Lite) -> None:
    lite.store.put_parent_topic(model.ParentTopic("Q"))
    lite.store.put_quota(model.Quota("broker", max_lite_topics=3))
    lite.dispatcher.metadata_changed()
    await lite.send("a")
    batch = [lite_message("b", message_id="x1"), lite_message("c", parent="Q", message_id="x2")]
    await lite.dispatcher.send(batch)  # 3 topics: at the limit
    over = [lite_message("a", message_id="x3"), lite_message("d", parent="Q", message_id="x4")]
    with pytest.raises(errors.LiteTopicQuotaExceeded):
        await lite.dispatcher.send(over)
    assert lite.store.lite_topic_count(None) == 3


# --- issue 16 item 4: dead letters wake readers of the DLQ as a send wakes readers of its topic ----------------


async def receive_dlq(lite: Lite, poll_ms: int = 0) -> list[Delivery]:
    return await lite.dispatcher.receive_normal(
        "r1", "dlq-readers", DLQ, batch=32, invisible_ms=60_000, poll_ms=poll_ms
    )


async def parked_dlq_receive(lite: Lite) -> asyncio.Task[list[Delivery]]:
    """A receive waiting on ``%DLQ%G``. One message was dead-lettered and consumed first, so the receive knows
    the DLQ queue's end and commit point and parks without a store read."""
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    await lite.send("t1", b"first")
    (given_up,) = await lite.receive("c1")
    await lite.dispatcher.dead_letter(GROUP, given_up.receipt_handle)
    (first,) = await receive_dlq(lite)
    await lite.dispatcher.ack("dlq-readers", first.receipt_handle)
    waiting = asyncio.create_task(receive_dlq(lite, poll_ms=60_000))
    await asyncio.sleep(0)  # let the receive park on the DLQ topic
    assert not waiting.done()
    return waiting


async def test_a_message_past_its_last_attempt_wakes_a_receive_waiting_on_the_dlq(lite: Lite) -> None:
    waiting = await parked_dlq_receive(lite)
    await lite.send("t1", b"poison")
    for attempt in (1, 2, 3):  # group G allows 3 attempts
        (d,) = await lite.receive("c1", invisible_ms=1_000)
        assert d.attempt == attempt and not waiting.done()
        lite.clock.advance(1_000)
        lite.dispatcher.tick()
    assert await lite.receive("c1") == []  # the fourth hand-out dead-letters it instead
    (got,) = await asyncio.wait_for(waiting, 5)  # woken: the poll itself would wait 60 s
    assert got.message.body == b"poison" and got.message.user_properties["__ORIGIN_LITE_TOPIC"] == "t1"


async def test_a_message_forwarded_to_the_dlq_wakes_a_receive_waiting_on_it(lite: Lite) -> None:
    waiting = await parked_dlq_receive(lite)
    await lite.send("t1", b"given-up")
    (d,) = await lite.receive("c1")
    await lite.dispatcher.dead_letter(GROUP, d.receipt_handle)
    (got,) = await asyncio.wait_for(waiting, 5)
    assert got.message.body == b"given-up"
