"""A parent topic created after a filter was made (issue 27; MQTT 3.1.1 and 5.0 section 4.7: ``#`` and ``+``
match every topic, whichever parent keeps it): the live sessions whose filters can match it reach into it,
without reconnecting, and get what is published there from then on. A broker process and paho-mqtt clients;
the parent is made through the admin API as the operator or ``lmq-admin`` makes it."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from paho.mqtt.enums import MQTTProtocolVersion
from testing_mqtt import Peer

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.testing import BrokerProcess

Connect = Callable[..., Peer]
PROTOCOLS = pytest.mark.parametrize(
    "protocol", [MQTTProtocolVersion.MQTTv311, MQTTProtocolVersion.MQTTv5], ids=["3.1.1", "5.0"]
)
_names = itertools.count()


def _create(broker: BrokerProcess, name: str) -> None:
    with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic(name, model.MessageType.LITE))


def _held_there(broker: BrokerProcess, parent: str, lite: str) -> int:
    with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
        return admin.describe_lite_topic(parent, lite).meta.max_offset


@PROTOCOLS
@pytest.mark.parametrize("topic_filter", ["#", "+/x", "{parent}/#", "{parent}/+"])
def test_4_7_a_filter_reaches_into_a_parent_created_after_its_subscribe(
    broker: BrokerProcess, connect: Connect, protocol: MQTTProtocolVersion, topic_filter: str
) -> None:
    parent = f"New{next(_names)}"
    subscriber = connect(broker.mqtt_port, protocol=protocol)
    assert subscriber.subscribe((topic_filter.format(parent=parent), 1)) == [1]
    _create(broker, parent)
    publisher = connect(broker.mqtt_port, protocol=protocol)
    publisher.publish(f"{parent}/x", b"in the new parent")  # at once: no wait for the session to follow
    assert _held_there(broker, parent, "x") == 1  # kept by the new (named) parent, not the default one
    got = subscriber.wait_count(1)
    assert [(m.topic, m.payload) for m in got] == [(f"{parent}/x", b"in the new parent")]
    publisher.publish(f"{parent}/x", b"and the next")
    assert [m.payload for m in subscriber.wait_count(2)] == [b"in the new parent", b"and the next"]
    assert len(subscriber.quiet()) == 2  # each once


def test_4_7_a_session_that_unsubscribed_does_not_reach_into_a_new_parent(
    broker: BrokerProcess, connect: Connect
) -> None:
    parent = f"New{next(_names)}"
    subscriber = connect(broker.mqtt_port)
    assert subscriber.subscribe(("#", 1)) == [1]
    subscriber.client.unsubscribe("#")
    assert subscriber.subscribe(("other/only", 1)) == [1]  # after the UNSUBACK (one connection: in order)
    _create(broker, parent)
    publisher = connect(broker.mqtt_port)
    publisher.publish(f"{parent}/x", b"not for it")
    publisher.publish("other/only", b"for it")
    assert [m.payload for m in subscriber.wait_count(1)] == [b"for it"]
    assert subscriber.payloads() == [b"for it"]
