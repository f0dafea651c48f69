"""Fixtures of the storage suites: a fake clock, store factories (LmqStore and MemoryStore), messages."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lmq_broker import config, model
from lmq_broker.storage import api
from lmq_broker.storage import memory as memory_mod
from lmq_broker.storage import store as store_mod


@pytest.fixture
def clock() -> memory_mod.ManualClock:
    return memory_mod.ManualClock()


@pytest.fixture
def store_config(tmp_path: Path) -> Callable[..., config.StoreConfig]:
    def make(**overrides: object) -> config.StoreConfig:
        return config.StoreConfig.model_validate({"data_dir": tmp_path / "data", **overrides})

    return make


@pytest.fixture
def open_lmq(
    store_config: Callable[..., config.StoreConfig], clock: memory_mod.ManualClock
) -> Iterator[Callable[..., store_mod.LmqStore]]:
    """Open an LmqStore on the test's data dir (config overrides as keywords); closed at teardown."""
    opened: list[store_mod.LmqStore] = []

    def make(state_cache_entries: int = store_mod.STATE_CACHE_ENTRIES, **overrides: object) -> store_mod.LmqStore:
        s = store_mod.LmqStore(store_config(**overrides), clock, state_cache_entries=state_cache_entries)
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()


@pytest.fixture(params=["lmq", "memory"])
def make_store(
    request: pytest.FixtureRequest,
    store_config: Callable[..., config.StoreConfig],
    open_lmq: Callable[..., store_mod.LmqStore],
    clock: memory_mod.ManualClock,
) -> Callable[..., api.Store]:
    """A factory of either implementation: the contract suite runs once per implementation."""

    def make(**overrides: object) -> api.Store:
        if request.param == "lmq":
            return open_lmq(**overrides)
        return memory_mod.MemoryStore(store_config(**overrides), clock)

    return make


@pytest.fixture
def store(make_store: Callable[..., api.Store]) -> api.Store:
    return make_store()


@pytest.fixture
def msg() -> Callable[..., model.NewMessage]:
    """A LITE message of ``parent``/``lite`` dispatched to the parent's queue 0 and the LMQ."""
    ids = itertools.count()

    def make(
        parent: str = "P",
        lite: str | None = "a",
        body: bytes = b"hello",
        *,
        parent_queue: bool = True,
        **kw: object,
    ) -> model.NewMessage:
        queues: list[model.QueueId] = []
        if parent_queue:
            queues.append(model.QueueId(parent, 0))
        if lite is not None:
            queues.append(model.QueueId.lmq(parent, lite))
        fields: dict[str, object] = {
            "message_id": f"m{next(ids):06d}",
            "topic": parent,
            "body": body,
            "queues": tuple(queues),
            "lite_topic": lite,
            "message_type": model.MessageType.LITE if lite else model.MessageType.NORMAL,
        }
        fields.update(kw)
        return model.NewMessage(**fields)  # type: ignore[arg-type]

    return make
