"""Fixtures: the admin service on a real grpc.aio server (port 0) over a real store.

``broker`` stands on the RocksDB-backed ``LmqStore`` in ``tmp_path``; ``memory_broker`` on the in-memory
twin, for quick cases of input validation.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lmq_broker.admin.testing import Broker, LoopThread, serve_admin
from lmq_broker.config import BrokerConfig, FlushMode, StoreConfig
from lmq_broker.storage import memory
from lmq_broker.storage import store as storage_store
from lmq_broker.storage.api import Store


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture
def broker_config(tmp_path: Path) -> BrokerConfig:
    return BrokerConfig(
        store=StoreConfig(data_dir=tmp_path / "data", flush_mode=FlushMode.ASYNC),
        broker_name="broker-test",
        port=0,
        default_client_quota=1500,
        default_ready_capacity=40,
    )


@pytest.fixture
def lmq_store(broker_config: BrokerConfig) -> Iterator[Store]:
    store = storage_store.open_store(broker_config.store)
    yield store
    store.close()


@pytest.fixture
def broker(loop_thread: LoopThread, lmq_store: Store, broker_config: BrokerConfig) -> Iterator[Broker]:
    served = serve_admin(loop_thread, lmq_store, broker_config)
    yield served
    served.close()


@pytest.fixture
def memory_broker(loop_thread: LoopThread, broker_config: BrokerConfig) -> Iterator[Broker]:
    served = serve_admin(loop_thread, memory.MemoryStore(), broker_config)
    yield served
    served.close()


@pytest.fixture
def clock() -> memory.ManualClock:
    return memory.ManualClock()


@pytest.fixture
def clocked_broker(loop_thread: LoopThread, broker_config: BrokerConfig, clock: memory.ManualClock) -> Iterator[Broker]:
    """The admin service over an LmqStore whose store and consume times come from ``clock``."""
    store = storage_store.open_store(broker_config.store, clock)
    served = serve_admin(loop_thread, store, broker_config)
    yield served
    served.close()
    store.close()
