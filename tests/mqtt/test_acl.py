"""Access control for MQTT (``--acl``), with paho-mqtt against a broker process: a CONNECT must name a user
and its secret; PUBLISH and SUBSCRIBE are checked per lite topic and filter; refusals carry the MQTT codes."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Callable, Iterator

import pytest
from paho.mqtt.enums import MQTTProtocolVersion
from testing_mqtt import Peer

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.admin.results import AclEntry
from lmq_broker.testing import BrokerProcess, start_broker

V5 = MQTTProtocolVersion.MQTTv5
ALICE, BOB, CAROL = ("alice", "alice-secret-1"), ("bob", "bob-secret-1"), ("carol", "carol-secret-1")
NOT_AUTHORIZED, FAILURE = 0x87, 0x80


@pytest.fixture(scope="module")
def acl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    process = start_broker(tmp_path_factory.mktemp("acl") / "data", extra_args=["--mqtt-port", "0", "--acl"])
    with AdminClient(process.admin_endpoint, timeout_s=10, **process.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic("chat", model.MessageType.LITE))
        for name, secret in (ALICE, BOB, CAROL):
            admin.put_user(name, secret)
        admin.put_acl([AclEntry("alice", "Lite:chat/a-*", ("Pub", "Sub"))])
        admin.put_acl([AclEntry("bob", "Lite:chat/b-*", ("Pub", "Sub"))])
        # topics of no named parent live in the default parent under their escaped names (docs/mqtt.md)
        admin.put_acl([AclEntry("carol", "Lite:mqtt-default/sensors_*", ("Pub", "Sub"))])
    yield process
    assert process.stop() == 0, process.log()[-4000:]


def refused(broker: BrokerProcess, user: str, action: str) -> float:
    with urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.search(rf'^lmq_acl_refused_total\{{action="{action}",user="{user}"\}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_connect_needs_a_user_and_its_secret(acl_broker: BrokerProcess, connect: Callable[..., Peer]) -> None:
    port = acl_broker.mqtt_port
    assert connect(port, auth=ALICE, protocol=V5).accepted
    assert connect(port, auth=ALICE).accepted  # 3.1.1
    wrong = connect(port, auth=("alice", "not-her-secret"), protocol=V5)
    assert wrong.connack is not None and wrong.connack[1] == "Bad user name or password"  # 0x86
    assert not connect(port, protocol=V5).accepted  # no user at all
    old = connect(port, auth=("mallory", "whatever-1"))
    assert old.connack is not None and old.connack[1] == "Bad user name or password"  # 3.1.1: return code 4


def test_publish_to_another_tenants_topic_is_not_authorized_and_not_delivered(
    acl_broker: BrokerProcess, connect: Callable[..., Peer]
) -> None:
    port = acl_broker.mqtt_port
    bob = connect(port, auth=BOB, protocol=V5)
    assert bob.subscribe(("chat/b-inbox/#", 1)) == [1]
    alice = connect(port, auth=ALICE, protocol=V5)
    before = refused(acl_broker, "alice", "Pub")
    assert alice.publish("chat/b-inbox/1", b"intrusion") == NOT_AUTHORIZED
    assert refused(acl_broker, "alice", "Pub") == before + 1
    assert alice.publish("chat/a-outbox/1", b"mine") == 0  # her own: stored
    assert bob.publish("chat/b-inbox/1", b"legit") == 0
    assert [m.payload for m in bob.wait_count(1)] == [b"legit"]
    assert [m.payload for m in bob.quiet(0.5)] == [b"legit"]  # the refused one never arrives


def test_subscribe_is_checked_per_filter(acl_broker: BrokerProcess, connect: Callable[..., Peer]) -> None:
    port = acl_broker.mqtt_port
    alice = connect(port, auth=ALICE, protocol=V5)
    granted = alice.subscribe(("chat/a-1/#", 1), ("chat/b-1/#", 1), ("chat/#", 1))
    assert granted == [1, NOT_AUTHORIZED, NOT_AUTHORIZED]  # a filter wider than her prefix is refused too
    old = connect(port, auth=ALICE)  # 3.1.1: 0x80 failure
    assert old.subscribe(("chat/b-1/#", 1), ("chat/a-2", 1)) == [FAILURE, 1]
    bob = connect(port, auth=BOB, protocol=V5)
    assert bob.publish("chat/b-1/x", b"for bob only") == 0
    assert alice.quiet(0.5) == []


def test_a_3_1_1_publish_refused_closes_the_connection(acl_broker: BrokerProcess, connect: Callable[..., Peer]) -> None:
    alice = connect(acl_broker.mqtt_port, auth=ALICE)
    info = alice.client.publish("chat/b-1/x", b"intrusion", qos=1)
    alice.wait(lambda p: p.disconnected, "the broker closing the connection")
    assert not info.is_published()


def test_topics_of_the_default_parent_are_checked_by_their_mapped_names(
    acl_broker: BrokerProcess, connect: Callable[..., Peer]
) -> None:
    """A topic no named parent holds is stored in the default parent: publish and subscribe are checked there
    (a wildcard filter reaches into every parent, and reads only those the user may read)."""
    port = acl_broker.mqtt_port
    carol = connect(port, auth=CAROL, protocol=V5)
    alice = connect(port, auth=ALICE, protocol=V5)
    assert carol.subscribe(("sensors/#", 1), ("other/#", 1)) == [1, NOT_AUTHORIZED]
    assert alice.subscribe(("sensors/#", 1)) == [NOT_AUTHORIZED]
    assert alice.subscribe(("chat/a-9/#", 1)) == [1]  # her parent's part; the default parent's is left out
    before = refused(acl_broker, "alice", "Pub")
    assert alice.publish("sensors/room1/temp", b"forged") == NOT_AUTHORIZED
    assert refused(acl_broker, "alice", "Pub") == before + 1
    assert alice.publish("TopicA", b"nowhere of hers") == NOT_AUTHORIZED
    assert carol.publish("sensors/room1/temp", b"21.5") == 0
    assert [(m.topic, m.payload) for m in carol.wait_count(1)] == [("sensors/room1/temp", b"21.5")]


def test_a_parent_created_later_is_reached_only_where_the_user_may_read(
    acl_broker: BrokerProcess, connect: Callable[..., Peer]
) -> None:
    """A ``#`` subscription follows parents created after it (docs/mqtt.md, "Topic mapping") as a SUBSCRIBE
    would reach into them: only those the user's policies let it read."""
    with AdminClient(acl_broker.admin_endpoint, timeout_s=10, **acl_broker.admin_keys) as admin:
        admin.put_user("dave", "dave-secret-1")
        admin.put_user("erin", "erin-secret-1")
        admin.put_acl([AclEntry("dave", "Lite:mqtt-default/*", ("Sub",)), AclEntry("dave", "Lite:opened/*", ("Sub",))])
        admin.put_acl([AclEntry("erin", "Lite:opened/*", ("Pub",)), AclEntry("erin", "Lite:closed/*", ("Pub",))])
    port = acl_broker.mqtt_port
    dave = connect(port, auth=("dave", "dave-secret-1"), protocol=V5)
    assert dave.subscribe(("#", 1)) == [1]
    with AdminClient(acl_broker.admin_endpoint, timeout_s=10, **acl_broker.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic("closed", model.MessageType.LITE))
        admin.put_parent_topic(model.ParentTopic("opened", model.MessageType.LITE))
    erin = connect(port, auth=("erin", "erin-secret-1"), protocol=V5)
    assert erin.publish("closed/x", b"not for dave") == 0
    assert erin.publish("opened/x", b"for dave") == 0
    assert [(m.topic, m.payload) for m in dave.wait_count(1)] == [("opened/x", b"for dave")]
    assert [m.payload for m in dave.quiet(0.5)] == [b"for dave"]
