"""Subscriptions saved at shutdown come back once, on the next start."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmq_broker import model
from lmq_broker.dispatch import snapshot
from lmq_broker.dispatch.testing import GROUP, PARENT, Lite

pytestmark = pytest.mark.asyncio


async def test_save_and_take_round_trip_and_skip_damage(tmp_path: Path) -> None:
    path = tmp_path / snapshot.FILE_NAME
    records = [snapshot.ClientRecord("c1", 5, "g", "P", ("%LMQ%$P$a", "%LMQ%$P$b"))]
    snapshot.save(records, path)
    with path.open("a") as damaged:
        damaged.write('{"client": "half\n')
    assert snapshot.take(path) == records
    assert not path.exists()
    assert snapshot.take(path) == []


async def test_restored_clients_receive_what_their_topics_hold(lite: Lite) -> None:
    await lite.send("t1", b"waiting")
    lmq = model.QueueId.lmq(PARENT, "t1").topic
    lite.dispatcher.restore_subscriptions([snapshot.ClientRecord("back", 5, GROUP, PARENT, (lmq,))])
    assert "back" in lite.dispatcher.subscribers(model.QueueId.lmq(PARENT, "t1"))
    lite.dispatcher.tick()  # the catch-up pass it scheduled
    for _ in range(100):
        got = await lite.receive("back")
        if got:
            break
        await lite.dispatcher.run(lambda: None)  # let the background catch-up task reach the store
    assert [d.message.body for d in got] == [b"waiting"]


async def test_a_record_over_a_lower_limit_is_skipped(lite: Lite) -> None:
    lite.dispatcher.registry.max_pairs = 1
    lite.dispatcher.restore_subscriptions(
        [
            snapshot.ClientRecord("fits", 5, GROUP, PARENT, ("%LMQ%$P$a",)),
            snapshot.ClientRecord("too-many", 5, GROUP, PARENT, ("%LMQ%$P$b", "%LMQ%$P$c")),
        ]
    )
    assert lite.dispatcher.subscription_count() == 1
