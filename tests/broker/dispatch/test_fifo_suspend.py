"""FIFO groups on NORMAL topics and lite topics (no next message while an earlier one is out, retries
included), and the cap on the time a message may spend suspended before it is dead-lettered."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmq_broker import __main__ as cli
from lmq_broker import model
from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch.dispatcher import Delivery
from lmq_broker.dispatch.testing import GROUP, PARENT, Lite, config_for
from lmq_broker.storage import memory

pytestmark = pytest.mark.asyncio

TOPIC = "orders"  # a NORMAL topic with one queue
FIFO_GROUP = "fifo-readers"
DLQ = model.QueueId(f"%DLQ%{GROUP}", 0)


async def fifo_normal(lite: Lite, *, fifo: bool = True) -> None:
    lite.store.put_parent_topic(model.ParentTopic(TOPIC, model.MessageType.NORMAL, queue_count=1))
    lite.put_group(model.LiteGroup(FIFO_GROUP, TOPIC, fifo=fifo, retry=model.RetryPolicy(max_attempts=5)))


async def send_normal(lite: Lite, *bodies: bytes) -> None:
    for body in bodies:
        message = model.NewMessage(
            message_id=f"n-{next(lite.ids)}", topic=TOPIC, body=body, queues=(model.QueueId(TOPIC, 0),),
            message_type=model.MessageType.FIFO, message_group="g1",
        )  # fmt: skip
        await lite.dispatcher.send([message])


async def receive_normal(lite: Lite, batch: int = 1, invisible_ms: int = 10_000) -> list[Delivery]:
    return await lite.dispatcher.receive_normal(
        "c1", FIFO_GROUP, TOPIC, batch=batch, invisible_ms=invisible_ms, poll_ms=0
    )


def bodies(got: list[Delivery]) -> list[bytes]:
    return [d.message.body for d in got]


async def test_a_fifo_group_gets_nothing_of_a_normal_queue_while_an_earlier_message_is_leased(lite: Lite) -> None:
    await fifo_normal(lite)
    await send_normal(lite, b"f0", b"f1")
    assert bodies(await receive_normal(lite)) == [b"f0"]
    assert await receive_normal(lite) == []  # f1 waits for f0


async def test_a_nacked_fifo_message_of_a_normal_queue_comes_back_before_later_ones(lite: Lite) -> None:
    await fifo_normal(lite)
    await send_normal(lite, b"f0", b"f1", b"f2")
    (d0,) = await receive_normal(lite)
    await lite.dispatcher.change_invisible(FIFO_GROUP, d0.receipt_handle, 1_000)
    assert await receive_normal(lite) == []  # still invisible: nothing behind it goes out
    lite.clock.advance(1_000)
    lite.dispatcher.tick()
    (again,) = await receive_normal(lite)
    assert (again.message.body, again.attempt) == (b"f0", 2)
    await lite.dispatcher.ack(FIFO_GROUP, again.receipt_handle)
    assert bodies(await receive_normal(lite, batch=32)) == [b"f1", b"f2"]


async def test_a_batch_of_a_fifo_group_stops_at_a_message_still_out(lite: Lite) -> None:
    await fifo_normal(lite)
    await send_normal(lite, b"f0", b"f1", b"f2")
    got = await receive_normal(lite, batch=32, invisible_ms=5_000)
    assert bodies(got) == [b"f0", b"f1", b"f2"]
    await lite.dispatcher.change_invisible(FIFO_GROUP, got[0].receipt_handle, 1_000)  # f0 nacked, f1 f2 still out
    lite.clock.advance(1_000)
    lite.dispatcher.tick()
    assert bodies(await receive_normal(lite, batch=32)) == [b"f0"]


async def test_a_group_that_is_not_fifo_reads_a_normal_queue_unordered(lite: Lite) -> None:
    await fifo_normal(lite, fifo=False)
    await send_normal(lite, b"f0", b"f1")
    assert bodies(await receive_normal(lite)) == [b"f0"]
    assert bodies(await receive_normal(lite)) == [b"f1"]


async def test_a_nacked_lite_message_comes_back_before_later_ones(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    for body in (b"f0", b"f1"):
        await lite.send("t1", body)
    (d0,) = await lite.receive("c1", batch=1)
    assert await lite.receive("c1", batch=1) == []  # the report: f1 must not go out while f0 is
    await lite.dispatcher.change_invisible(GROUP, d0.receipt_handle, 1_000)
    assert await lite.receive("c1", batch=1) == []
    lite.clock.advance(1_000)
    lite.dispatcher.tick()
    got = await lite.receive("c1", batch=32)
    assert [(d.message.body, d.attempt) for d in got] == [(b"f0", 2), (b"f1", 1)]


# --- the suspend cap ---------------------------------------------------------------------------------------


async def suspended_lite(tmp_path: Path, cap_ms: int) -> Lite:
    store = memory.MemoryStore(config_for(tmp_path / "data").store)
    clock = memory.ManualClock(1_000_000)
    return await Lite.start(store, clock, config_for(tmp_path / "unused", max_suspend_ms=cap_ms))


async def suspend(lite: Lite, d: Delivery, ms: int) -> Delivery | None:
    """Suspend ``d`` for ``ms``, let it expire, and receive what comes next on t1."""
    await lite.dispatcher.change_invisible(GROUP, d.receipt_handle, ms, suspend=True)
    lite.clock.advance(ms)
    lite.dispatcher.tick()
    got = await lite.receive("c1", batch=1)
    return got[0] if got else None


async def test_suspends_beyond_the_cap_dead_letter_the_message(tmp_path: Path) -> None:
    lite = await suspended_lite(tmp_path, cap_ms=5_000)
    try:
        await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
        await lite.send("t1", b"stuck")
        await lite.send("t1", b"next")
        (d,) = await lite.receive("c1", batch=1)
        for _ in range(2):  # twice 2 s suspended: within the 5 s cap, and no attempt counted
            again = await suspend(lite, d, 2_000)
            assert again is not None and again.message.body == b"stuck" and again.attempt == 1
            d = again
        after = await suspend(lite, d, 2_000)  # 6 s in all: over the cap
        assert after is not None and after.message.body == b"next"
        assert [m.body for m in lite.store.read(DLQ, 0, 10)] == [b"stuck"]
        assert lite.committed("t1") == 1
    finally:
        await lite.dispatcher.close()


async def test_a_nack_does_not_count_towards_the_suspend_cap(tmp_path: Path) -> None:
    lite = await suspended_lite(tmp_path, cap_ms=5_000)
    try:
        await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
        await lite.send("t1", b"m")
        (d,) = await lite.receive("c1", batch=1)
        await lite.dispatcher.change_invisible(GROUP, d.receipt_handle, 6_000)  # a nack, not a suspend
        lite.clock.advance(6_000)
        lite.dispatcher.tick()
        (again,) = await lite.receive("c1", batch=1)
        assert (again.message.body, again.attempt) == (b"m", 2)
        assert lite.store.read(DLQ, 0, 10) == []
    finally:
        await lite.dispatcher.close()


def serve_config(argv: list[str], env: dict[str, str]) -> BrokerConfig:
    return cli.config_from(cli.build_parser().parse_args(["serve", *argv]), env)


async def test_the_suspend_cap_defaults_to_a_day_and_is_set_by_flag_or_variable() -> None:
    assert serve_config([], {}).max_suspend_ms == 24 * 3600 * 1000
    assert serve_config([], {"LMQ_MAX_SUSPEND_MS": "-1"}).max_suspend_ms == -1
    assert serve_config(["--max-suspend-ms", "60000"], {"LMQ_MAX_SUSPEND_MS": "-1"}).max_suspend_ms == 60_000
