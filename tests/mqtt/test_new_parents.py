"""A parent topic created after a filter was made (issue 27; MQTT 3.1.1 and 5.0 section 4.7: ``#`` and ``+``
match every topic, whichever parent keeps it): the live sessions whose filters can match it reach into it,
without reconnecting, and get what is published there from then on. A broker process and paho-mqtt clients;
the parent is made through the admin API as the operator or ``lmq-admin`` makes it."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from paho.mqtt.enums import MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
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


def _persistent(protocol: MQTTProtocolVersion) -> dict[str, object]:
    """A session that outlives its connection (3.1.1: clean session 0; 5.0: an expiry interval)."""
    if protocol != MQTTProtocolVersion.MQTTv5:
        return {"clean": False, "protocol": protocol}
    props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    props.SessionExpiryInterval = 600
    return {"clean": False, "protocol": protocol, "properties": props}


@PROTOCOLS
def test_4_7_an_exact_filter_made_before_its_parent_existed_gets_its_topic_there(
    broker: BrokerProcess, connect: Connect, protocol: MQTTProtocolVersion
) -> None:
    """Section 4.7 (a filter without wildcards matches its topic): ``<parent>/x`` subscribed while no such
    parent existed, its topic kept in the default parent then; once the parent exists its topic is kept there
    and still reaches the session, each message once."""
    parent = f"New{next(_names)}"
    subscriber = connect(broker.mqtt_port, protocol=protocol)
    assert subscriber.subscribe((f"{parent}/x", 1)) == [1]
    publisher = connect(broker.mqtt_port, protocol=protocol)
    publisher.publish(f"{parent}/x", b"before")  # kept in the default parent
    assert subscriber.wait_count(1)[0].payload == b"before"
    _create(broker, parent)
    publisher.publish(f"{parent}/x", b"after")  # at once: no wait for the session to follow
    assert _held_there(broker, parent, "x") == 1
    assert [m.payload for m in subscriber.wait_count(2)] == [b"before", b"after"]
    assert len(subscriber.quiet()) == 2  # each once


@PROTOCOLS
def test_4_7_a_persistent_session_away_when_its_exact_filters_parent_came_gets_both_sides(
    broker: BrokerProcess, connect: Connect, protocol: MQTTProtocolVersion
) -> None:
    """MQTT-3.1.2-5 (3.1.1) / 4.1 (5.0): a persistent session keeps its subscriptions, and the QoS 1 messages
    matching them while it is away are delivered when it comes back. ``<parent>/x`` was made before the parent
    existed; while the session is away one message is kept in the default parent, the parent is created, one is
    kept there: it gets both, once each; after UNSUBSCRIBE neither side delivers."""
    parent = f"New{next(_names)}"
    client_id = f"keep{next(_names)}"
    first = connect(broker.mqtt_port, client_id, **_persistent(protocol))
    assert first.subscribe((f"{parent}/x", 1)) == [1]
    first.disconnect()
    publisher = connect(broker.mqtt_port, protocol=protocol)
    publisher.publish(f"{parent}/x", b"in the default parent")
    _create(broker, parent)
    publisher.publish(f"{parent}/x", b"in the new parent")
    assert _held_there(broker, parent, "x") == 1
    again = connect(broker.mqtt_port, client_id, **_persistent(protocol))
    got = again.wait_count(2)
    assert sorted(m.payload for m in got) == [b"in the default parent", b"in the new parent"]
    assert len(again.quiet()) == 2
    again.client.unsubscribe(f"{parent}/x")
    assert again.subscribe(("other/only", 1)) == [1]  # after the UNSUBACK (one connection: in order)
    publisher.publish(f"{parent}/x", b"not for it")
    publisher.publish("other/only", b"for it")
    assert again.wait_count(3)[-1].payload == b"for it"
    assert len(again.quiet()) == 3


@PROTOCOLS
@pytest.mark.parametrize("topic_filter", ["#", "+/x", "{parent}/#", "{parent}/x"])
def test_mqtt5_4_8_2_a_share_made_before_its_parent_existed_reaches_it(
    broker: BrokerProcess, connect: Connect, protocol: MQTTProtocolVersion, topic_filter: str
) -> None:
    """Section 4.8.2 with a parent made later: each message of the new parent goes to one member of the share."""
    parent = f"New{next(_names)}"
    share = f"$share/g{next(_names)}/{topic_filter.format(parent=parent)}"
    members = [connect(broker.mqtt_port, protocol=protocol) for _ in range(2)]
    for member in members:
        assert member.subscribe((share, 1)) == [1]
    _create(broker, parent)
    publisher = connect(broker.mqtt_port, protocol=protocol)
    for n in range(6):
        publisher.publish(f"{parent}/x", b"m%d" % n)
    assert _held_there(broker, parent, "x") == 6

    def total(_: Peer) -> bool:
        return sum(len(m.messages()) for m in members) >= 6

    members[0].wait(total, "6 messages among the members")
    got = sorted(r.payload for m in members for r in m.quiet())
    assert got == sorted(b"m%d" % n for n in range(6))  # each to one member, once


@PROTOCOLS
def test_mqtt5_4_8_2_a_persistent_member_away_when_its_exact_shares_parent_came_gets_both_sides(
    broker: BrokerProcess, connect: Connect, protocol: MQTTProtocolVersion
) -> None:
    """A persistent session's share ``$share/g/<parent>/x`` joined before the parent existed (stored with it,
    4.8.2): while it is away one message is kept in the default parent, the parent is created, one is kept
    there; back, the member gets both, once each."""
    parent = f"New{next(_names)}"
    client_id = f"member{next(_names)}"
    share = f"$share/g{next(_names)}/{parent}/x"
    first = connect(broker.mqtt_port, client_id, **_persistent(protocol))
    assert first.subscribe((share, 1)) == [1]
    first.disconnect()
    publisher = connect(broker.mqtt_port, protocol=protocol)
    publisher.publish(f"{parent}/x", b"in the default parent")
    _create(broker, parent)
    publisher.publish(f"{parent}/x", b"in the new parent")
    assert _held_there(broker, parent, "x") == 1
    again = connect(broker.mqtt_port, client_id, **_persistent(protocol))
    again.wait_count(2)
    assert sorted(m.payload for m in again.quiet()) == [b"in the default parent", b"in the new parent"]  # once each
