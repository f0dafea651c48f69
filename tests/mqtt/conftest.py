"""Fixtures of the MQTT suite: a broker process with ``--mqtt-port 0`` and paho-mqtt clients
(``testing_mqtt.Peer``, tests/support), closed after each test."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from testing_mqtt import Peer

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.testing import BrokerProcess, start_broker

_ids = itertools.count()


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    started: list[Peer] = []
    yield started
    for peer in started:
        peer.client.loop_stop()
        peer.client.disconnect()


@pytest.fixture
def connect(peers: list[Peer]) -> Callable[..., Peer]:
    """``connect(port, client_id=None, **Peer options)``: a connected paho client, closed after the test."""

    def make(port: int, client_id: str | None = None, **options: Any) -> Peer:
        peer = Peer(port, client_id or f"c{next(_ids)}", **options)
        peers.append(peer)
        return peer

    return make


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    process = start_broker(tmp_path_factory.mktemp("mqtt") / "data", extra_args=["--mqtt-port", "0"])
    yield process
    assert process.stop() == 0, process.log()[-4000:]


def create_parent(broker: BrokerProcess) -> str:
    topic = f"P{next(_ids)}"
    with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic(topic, model.MessageType.LITE))
    return topic


@pytest.fixture
def full_parent(broker: BrokerProcess) -> str:
    """A fresh LITE parent topic that takes no lite topic (``max_lite_topics`` 0): a publish there is refused."""
    topic = f"Full{next(_ids)}"
    with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic(topic, model.MessageType.LITE, max_lite_topics=0))
    return topic


@pytest.fixture
def parent_topic() -> Callable[[BrokerProcess], str]:
    """``parent_topic(broker)``: a fresh LITE parent topic on that broker."""
    return create_parent


@pytest.fixture
def parent(broker: BrokerProcess) -> str:
    return create_parent(broker)
