"""Fixtures of the in-broker expiry's tests: a real dispatcher over both stores (the RocksDB + segments store in
tmp_path, and its in-memory twin), on a manual clock that is the store's clock and the dispatcher's wall clock:
time is moved, never waited for. The parents and settings are in tests/support/expiring.py."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from expiring import EXPIRATION_MIN, NEVER

from lmq_broker import model
from lmq_broker.dispatch import testing as dispatch_testing
from lmq_broker.dispatch.dispatcher import Dispatcher
from lmq_broker.dispatch.testing import GROUP, PARENT, Lite
from lmq_broker.storage import memory
from lmq_broker.storage import store as lmq_store
from lmq_broker.storage.api import Store


@pytest.fixture
def clock() -> memory.ManualClock:
    return memory.ManualClock()


@pytest.fixture(params=["lmq", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path, clock: memory.ManualClock) -> Iterator[Store]:
    config = dispatch_testing.config_for(tmp_path / "data").store
    opened: Store = (
        lmq_store.open_store(config, clock) if request.param == "lmq" else memory.MemoryStore(config, clock=clock)
    )
    yield opened
    opened.close()


@pytest_asyncio.fixture
async def lite(store: Store, clock: memory.ManualClock, tmp_path: Path) -> AsyncIterator[Lite]:
    store.put_parent_topic(model.ParentTopic(PARENT, expiration_minutes=EXPIRATION_MIN))
    store.put_parent_topic(model.ParentTopic(NEVER))
    store.put_group(model.LiteGroup(GROUP, PARENT))
    dispatcher = Dispatcher(store, dispatch_testing.config_for(tmp_path / "unused"), clock=clock, wall_clock=clock)
    await dispatcher.start()
    yield Lite(dispatcher, store, clock)
    await dispatcher.close()
