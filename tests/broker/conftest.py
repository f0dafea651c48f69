"""Fixtures of the broker suite (our own v2 stubs; the official client lives in tests/e2e).

``store`` runs each dispatcher test on both implementations of the store contract: the in-memory twin
(speed) and the real LmqStore (segments + RocksDB) in ``tmp_path``. ``lite`` is a started dispatcher on a
manual clock with a LITE parent ``P`` and a lite group ``G``. ``client`` talks to a whole broker
(``app.Broker``: LmqStore, dispatcher, grpc.aio on a real port 0, admin service) run in this process.

The suite is split by the part of the broker that owns the behaviour: ``access/`` (users, policies, ACL),
``admin/`` (the in-broker expiry), ``cli/`` (``serve``, the helm test program, benchmark smoke runs),
``cluster/`` (ring, membership, peers, forwarding, cluster-wide MQTT and waits), ``dispatch/`` (the dispatcher
and its parts), ``durability/`` (kill -9, restarts, retention of a serving broker), ``memory/`` (bounded caches,
RSS and heap), ``protocol/`` (the v2 edge: server, conversion, admission, caps, fuzzing, TLS and signing).
Fixtures shared by several of them stay here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from lmq_broker import app
from lmq_broker.config import BrokerConfig, StoreConfig
from lmq_broker.dispatch import testing as dispatch_testing
from lmq_broker.protocol import testing as protocol_testing
from lmq_broker.storage import memory
from lmq_broker.storage import store as lmq_store
from lmq_broker.storage.api import Store


@pytest.fixture
def clock() -> memory.ManualClock:
    return memory.ManualClock(1_000_000)


@pytest.fixture
def store_config(tmp_path: Path) -> StoreConfig:
    return dispatch_testing.config_for(tmp_path / "data").store


@pytest.fixture(params=["memory", "lmq"])
def store(request: pytest.FixtureRequest, store_config: StoreConfig) -> Iterator[Store]:
    opened: Store = (
        memory.MemoryStore(store_config) if request.param == "memory" else lmq_store.open_store(store_config)
    )
    yield opened
    opened.close()


@pytest_asyncio.fixture
async def lite(store: Store, clock: memory.ManualClock, tmp_path: Path) -> AsyncIterator[dispatch_testing.Lite]:
    harness = await dispatch_testing.Lite.start(store, clock, dispatch_testing.config_for(tmp_path / "unused"))
    yield harness
    await harness.dispatcher.close()


@pytest.fixture
def server_config(request: pytest.FixtureRequest, tmp_path: Path) -> BrokerConfig:
    """A broker's settings; a test changes some by parametrizing ``server_config`` indirectly with a dict."""
    changes: dict[str, object] = getattr(request, "param", {})
    return dispatch_testing.config_for(tmp_path / "data", host="127.0.0.1", port=0, metrics_port=0, **changes)


@pytest_asyncio.fixture
async def broker(server_config: BrokerConfig) -> AsyncIterator[app.Broker]:
    served = app.Broker(server_config)
    await served.start()
    yield served
    await served.stop(grace_s=0.2)


@pytest_asyncio.fixture
async def client(broker: app.Broker) -> AsyncIterator[protocol_testing.Client]:
    assert broker.store is not None
    connected = protocol_testing.connect(broker.endpoint, broker.store, ca_cert=broker.config.tls_cert)
    yield connected
    await connected.close()
