"""The appender: small requests of one loop pass are appended on the loop as one group; large ones, and
all of them while the store is busy or slow, go to its thread, where requests that queue up while it is
busy go to the store as one append; a failing request fails alone on either path."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import pytest

from lmq_broker import errors, model
from lmq_broker.dispatch import appender as appender_mod
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
    appender = Appender(gated, asyncio.get_running_loop(), inline_max_messages=0)  # type: ignore[arg-type]
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


class RecordingStore:
    """Passes appends through, recording (path, thread, size) of each; can refuse or slow them down."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.calls: list[tuple[str, int, int]] = []
        self.refuse = 0  # refuse this many try_append calls (another writer holds the store)
        self.delay_s = 0.0  # each append takes at least this long (a slow disk's fsync)

    def append(self, messages: Sequence[model.NewMessage]) -> list[model.AppendResult]:
        self.calls.append(("thread", threading.get_ident(), len(messages)))
        time.sleep(self.delay_s)
        return self.inner.append(messages)

    def try_append(self, messages: Sequence[model.NewMessage]) -> list[model.AppendResult] | None:
        if self.refuse:
            self.refuse -= 1
            return None
        self.calls.append(("inline", threading.get_ident(), len(messages)))
        time.sleep(self.delay_s)
        return self.inner.try_append(messages)


def burst(appender: Appender, lites: str, first_id: int = 0) -> list[asyncio.Future[list[model.AppendResult]]]:
    """One request per lite topic, all started in the same loop pass."""
    return [
        asyncio.ensure_future(appender.append([lite_message(lite, message_id=str(first_id + i))]))
        for i, lite in enumerate(lites)
    ]


async def test_small_requests_of_one_loop_pass_are_one_append_on_the_loop(store: Store) -> None:
    store.put_parent_topic(model.ParentTopic("P"))
    recording = RecordingStore(store)
    appender = Appender(recording, asyncio.get_running_loop())  # type: ignore[arg-type]
    try:
        requests = burst(appender, "abc")
        bad = asyncio.ensure_future(appender.append([lite_message("d", b"", message_id="bad")]))
        assert [[r.message_id for r in await f] for f in requests] == [["0"], ["1"], ["2"]]
        with pytest.raises(errors.BodyEmpty):
            await bad
        loop_thread = threading.get_ident()
        # one combined try (it failed on the empty body), then each request alone: all on the loop's thread
        assert recording.calls == [("inline", loop_thread, 4)] + [("inline", loop_thread, 1)] * 4
        assert (appender.inline_commits, appender.thread_commits) == (1, 0)
        assert store.queue_offsets(model.QueueId.lmq("P", "c")) == (0, 1)
        assert store.lite_topic("P", "d") is None
    finally:
        await asyncio.to_thread(appender.close)


async def test_large_requests_and_refused_groups_go_to_the_thread(store: Store) -> None:
    store.put_parent_topic(model.ParentTopic("P"))
    recording = RecordingStore(store)
    appender = Appender(recording, asyncio.get_running_loop())  # type: ignore[arg-type]
    try:
        large = [lite_message("big", message_id=f"L{i}") for i in range(appender_mod.INLINE_MAX_MESSAGES + 1)]
        assert len(await appender.append(large)) == len(large)
        recording.refuse = 1
        assert [[r.message_id for r in await f] for f in burst(appender, "ab")] == [["0"], ["1"]]
        loop_thread = threading.get_ident()
        paths = [(path, thread == loop_thread, n) for path, thread, n in recording.calls]
        assert paths == [("thread", False, len(large)), ("thread", False, 2)]  # refused inline: one thread append
        assert (appender.inline_commits, appender.thread_commits) == (0, 2)
    finally:
        await asyncio.to_thread(appender.close)


async def test_slow_appends_keep_small_requests_off_the_loop_until_the_store_is_fast_again(store: Store) -> None:
    store.put_parent_topic(model.ParentTopic("P"))
    recording = RecordingStore(store)
    appender = Appender(recording, asyncio.get_running_loop())  # type: ignore[arg-type]
    try:
        recording.delay_s = appender_mod.INLINE_MAX_BLOCK_S * 5
        sent = 0
        while appender.thread_commits == 0:  # each slow inline append raises the average until the thread takes over
            assert sent < 50, "slow appends never moved off the loop"
            await appender.append([lite_message("a", message_id=str(sent))])
            sent += 1
        assert appender.append_s > appender_mod.INLINE_MAX_BLOCK_S
        recording.delay_s = 0.0
        inline_before = appender.inline_commits
        while appender.inline_commits == inline_before:  # fast appends on the thread bring the average down
            assert sent < 200, "fast appends never came back to the loop"
            await appender.append([lite_message("a", message_id=str(sent))])
            sent += 1
        assert store.queue_offsets(model.QueueId.lmq("P", "a")) == (0, sent)
    finally:
        await asyncio.to_thread(appender.close)
