"""The dispatcher's metadata copy (``Runtime.metadata``): a caller never gets a copy older than a change
announced before it asked, even when it arrives while another caller's reload is running."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from lmq_broker import model
from lmq_broker.dispatch.runtime import Runtime
from lmq_broker.dispatch.testing import config_for
from lmq_broker.storage import memory

pytestmark = pytest.mark.asyncio


async def test_a_caller_during_an_older_reload_waits_for_a_newer_copy(tmp_path: Path) -> None:
    store = memory.MemoryStore()
    runtime = Runtime(store, config_for(tmp_path / "unused"))
    await runtime.start()
    try:
        assert (await runtime.metadata()).parents == {}
        listed, gate = threading.Event(), threading.Event()
        plain_list = store.list_parent_topics

        def held_list() -> list[model.ParentTopic]:
            topics = plain_list()
            listed.set()
            assert gate.wait(10)
            return topics

        store.list_parent_topics = held_list  # type: ignore[method-assign]
        store.put_parent_topic(model.ParentTopic("FIRST"))
        runtime.metadata_changed()
        first = asyncio.create_task(runtime.metadata())
        assert await asyncio.to_thread(listed.wait, 10)  # the first reload has read, and holds
        store.put_parent_topic(model.ParentTopic("SECOND"))
        runtime.metadata_changed()
        second = asyncio.create_task(runtime.metadata())
        await asyncio.sleep(0)
        assert not second.done()  # it waits, rather than answering with the copy from before both changes
        gate.set()
        assert set((await first).parents) >= {"FIRST"}
        assert set((await second).parents) == {"FIRST", "SECOND"}
        assert set((await runtime.metadata()).parents) == {"FIRST", "SECOND"}
    finally:
        await runtime.stop_tasks()
        await runtime.close_executor()


async def test_a_failed_reload_is_retried_by_the_next_caller(tmp_path: Path) -> None:
    store = memory.MemoryStore()
    runtime = Runtime(store, config_for(tmp_path / "unused"))
    await runtime.start()
    try:
        plain_list = store.list_parent_topics
        failures = [OSError("index unreadable")]

        def flaky_list() -> list[model.ParentTopic]:
            if failures:
                raise failures.pop()
            return plain_list()

        store.list_parent_topics = flaky_list  # type: ignore[method-assign]
        store.put_parent_topic(model.ParentTopic("P"))
        runtime.metadata_changed()
        with pytest.raises(OSError, match="index unreadable"):
            await runtime.metadata()
        assert set((await runtime.metadata()).parents) == {"P"}
    finally:
        await runtime.stop_tasks()
        await runtime.close_executor()
