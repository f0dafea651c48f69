"""Subscriptions saved at shutdown come back once, on the next start."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmq_broker import model
from lmq_broker.dispatch import saved_subscriptions
from lmq_broker.dispatch.testing import GROUP, PARENT, Lite

pytestmark = pytest.mark.asyncio


async def test_save_and_take_round_trip_and_skip_damage(tmp_path: Path) -> None:
    path = tmp_path / saved_subscriptions.FILE_NAME
    records = [saved_subscriptions.ClientRecord("c1", 5, "g", "P", ("%LMQ%$P$a", "%LMQ%$P$b"))]
    saved_subscriptions.save(records, path)
    with path.open("a") as damaged:
        damaged.write('{"client": "half\n')
    assert saved_subscriptions.take(path) == records
    assert not path.exists()
    assert saved_subscriptions.take(path) == []


async def test_a_line_that_is_not_utf8_is_skipped_and_the_rest_restored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / saved_subscriptions.FILE_NAME
    first, second = (saved_subscriptions.ClientRecord(f"c{i}", 5, GROUP, PARENT, (f"%LMQ%$P$t{i}",)) for i in (1, 2))
    saved_subscriptions.save([first], path)
    with path.open("ab") as out:
        out.write(b'{"client": "\xff\xfe"}\n')
    kept = path.read_bytes()
    saved_subscriptions.save([second], tmp_path / "other")
    path.write_bytes(kept + (tmp_path / "other").read_bytes())
    assert saved_subscriptions.take(path) == [first, second]
    assert "1 damaged line(s) skipped" in caplog.text


async def test_restored_clients_receive_what_their_topics_hold(lite: Lite) -> None:
    await lite.send("t1", b"waiting")
    lmq = model.QueueId.lmq(PARENT, "t1").topic
    lite.dispatcher.restore_subscriptions([saved_subscriptions.ClientRecord("back", 5, GROUP, PARENT, (lmq,))])
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
            saved_subscriptions.ClientRecord("fits", 5, GROUP, PARENT, ("%LMQ%$P$a",)),
            saved_subscriptions.ClientRecord("too-many", 5, GROUP, PARENT, ("%LMQ%$P$b", "%LMQ%$P$c")),
        ]
    )
    assert lite.dispatcher.subscription_count() == 1
