"""The appender thread: requests that queue up while it is busy go to the store as one append, and a
failing request fails alone."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest

from lmq_broker import errors, model
from lmq_broker.dispatch.appender import Appender
from lmq_broker.dispatch.testing import lite_message
from lmq_broker.storage.api import Store

pytestmark = pytest.mark.asyncio


class GatedStore:
    """Holds the first append until released, and records the size of every append call."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls: list[int] = []

    def append(self, messages: Sequence[model.NewMessage]) -> list[model.AppendResult]:
        self.calls.append(len(messages))
        self.entered.set()
        self.gate.wait(10)
        return self.inner.append(messages)


async def test_queued_requests_share_one_append_and_errors_stay_with_their_request(store: Store) -> None:
    store.put_parent_topic(model.ParentTopic("P"))
    gated = GatedStore(store)
    appender = Appender(gated, asyncio.get_running_loop())  # type: ignore[arg-type]
    try:
        first = asyncio.ensure_future(appender.append([lite_message("a", message_id="1")]))
        await asyncio.to_thread(gated.entered.wait, 10)  # the thread is inside the first append
        good = asyncio.ensure_future(
            appender.append([lite_message("b", message_id="2"), lite_message("c", message_id="3")])
        )
        bad = asyncio.ensure_future(appender.append([lite_message("d", b"", message_id="4")]))
        also_good = asyncio.ensure_future(appender.append([lite_message("e", message_id="5")]))
        await asyncio.sleep(0)  # one loop turn: each task runs up to its queue.put
        gated.gate.set()
        assert [r.message_id for r in await first] == ["1"]
        assert [r.message_id for r in await good] == ["2", "3"]
        with pytest.raises(errors.BodyEmpty):
            await bad
        assert [r.message_id for r in await also_good] == ["5"]
        assert gated.calls[:2] == [1, 4]  # the first alone, then the three queued requests together
        assert gated.calls[2:] == [2, 1, 1]  # the combined append failed: each retried alone
        assert store.lite_topic(model.ParentTopic("P").name, "d") is None
        assert store.queue_offsets(model.QueueId.lmq("P", "e")) == (0, 1)
    finally:
        gated.gate.set()
        await asyncio.to_thread(appender.close)
