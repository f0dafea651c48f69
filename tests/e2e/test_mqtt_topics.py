"""Any MQTT topic, as an application written for any broker uses them (issue 27 item 1): topics whose first
level names no parent live in the default parent (``--mqtt-default-parent``, made at start), escaped level by
level; ``#`` and ``+`` match across every parent, and never a ``$`` topic at the first level (MQTT 3.1.1 and 5.0
section 4.7.2, MQTT-4.7.2-1). paho-mqtt and Debian's mosquitto-clients on the MQTT side, the official
LitePushConsumer reading the mapped lite topic on the other (docs/mqtt.md "Topic mapping")."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from paho.mqtt.enums import MQTTProtocolVersion
from rocketmq import ClientConfiguration, Credentials, LitePushConsumer
from testing_mqtt import Peer

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.mqtt import topics
from lmq_broker.testing import BrokerProcess, Inbox, start_broker

WAIT_S = 20.0
DEFAULT = "mqtt-default"  # --mqtt-default-parent's default


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    process = start_broker(tmp_path_factory.mktemp("mqtt-topics") / "data", extra_args=["--mqtt-port", "0"])
    yield process
    assert process.stop() == 0, process.log()[-4000:]


@pytest.fixture
def admin(broker: BrokerProcess) -> Iterator[AdminClient]:
    with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as client:
        yield client


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    started: list[Peer] = []
    yield started
    for peer in started:
        peer.client.loop_stop()
        peer.client.disconnect()


@pytest.fixture
def connect(broker: BrokerProcess, peers: list[Peer]) -> Callable[..., Peer]:
    def make(client_id: str, **options: Any) -> Peer:
        peer = Peer(broker.mqtt_port, client_id, **options)
        peers.append(peer)
        return peer

    return make


@pytest.mark.parametrize("protocol", [MQTTProtocolVersion.MQTTv311, MQTTProtocolVersion.MQTTv5])
def test_mqtt_4_7_topics_of_no_parent_and_wildcards_across_parents(
    broker: BrokerProcess, admin: AdminClient, connect: Callable[..., Peer], protocol: MQTTProtocolVersion
) -> None:
    """``sensors/room1/temp``, ``TopicA``, ``/TopicA`` and a named parent's topic: ``#`` gets them all, ``+/+``
    the two-level ones, ``sensors/+/temp`` its one; ``$SYS/x`` only reaches ``$SYS/#`` (MQTT-4.7.2-1)."""
    v = protocol.value
    named = f"Named{v}"
    admin.put_parent_topic(model.ParentTopic(named, model.MessageType.LITE))
    every, two, one, dollar = (connect(f"{name}-{v}", protocol=protocol) for name in ("hash", "two", "one", "sys"))
    pub = connect(f"pub-{v}", protocol=protocol)
    assert every.subscribe(("#", 1)) == [1]
    assert two.subscribe(("+/+", 1)) == [1]
    assert one.subscribe(("sensors/+/temp", 1)) == [1]
    assert dollar.subscribe(("$SYS/#", 1)) == [1]
    published = ["$SYS/x", "sensors/room1/temp", "TopicA", "/TopicA", f"{named}/a", "TopicA/B"]
    for n, topic in enumerate(published):
        assert pub.publish(topic, f"m{n}".encode()) == 0
    assert [(m.topic, m.payload) for m in dollar.wait_count(1)] == [("$SYS/x", b"m0")]
    assert [(m.topic, m.payload) for m in one.wait_count(1)] == [("sensors/room1/temp", b"m1")]
    got = {(m.topic, m.payload) for m in every.wait_count(5)}
    assert got == {(t, f"m{n}".encode()) for n, t in enumerate(published) if n}
    got = {(m.topic, m.payload) for m in two.wait_count(3)}
    assert got == {("/TopicA", b"m3"), (f"{named}/a", b"m4"), ("TopicA/B", b"m5")}
    # $SYS/x was stored first (its PUBACK came before the next publish): a session wrongly taking it would have
    # written it before zz/end, which is written after everything the session was handed before it
    assert pub.publish("zz/end", b"last") == 0
    for peer in (every, two):
        peer.wait(lambda p: any(m.topic == "zz/end" for m in p.received), "zz/end")
    assert [m.topic for m in every.messages()].count("$SYS/x") == 0
    assert len(two.messages()) == 4 and len(one.messages()) == 1 and len(dollar.messages()) == 1


def test_a_long_unicode_topic_is_hashed_and_delivered_under_its_own_name(connect: Callable[..., Peer]) -> None:
    """Over 64 bytes escaped: a hashed lite topic, and the subscriber still gets the exact topic (and only the
    filters that match it take it)."""
    topic = "buildings/Zürich-Nord/" + "étage-" * 8 + "/temp"
    assert topics.is_hashed(topics.default_lite(topic))
    sub, other = connect("long-sub"), connect("long-other")
    assert sub.subscribe(("buildings/+/#", 1)) == [1]
    assert other.subscribe(("elsewhere/#", 1)) == [1]
    assert connect("long-pub").publish(topic, b"19.5") == 0
    assert [(m.topic, m.payload) for m in sub.wait_count(1)] == [(topic, b"19.5")]
    assert connect("long-pub2").publish("elsewhere/x", b"mark") == 0
    assert [m.topic for m in other.wait_count(1)] == ["elsewhere/x"]  # the hashed one passed it over


def test_a_lite_push_consumer_reads_a_default_parent_topic_by_its_mapped_name(
    broker: BrokerProcess, admin: AdminClient, connect: Callable[..., Peer]
) -> None:
    group = "default-readers"
    admin.put_group(model.LiteGroup(group, DEFAULT))
    inbox = Inbox()
    consumer = LitePushConsumer(ClientConfiguration(broker.endpoint, Credentials(), request_timeout=5), group,
                                DEFAULT, inbox)  # fmt: skip
    consumer.startup()
    try:
        consumer.subscribe_lite("sensors_lab_temp")  # sensors/lab/temp, escaped (here: unchanged)
        consumer.subscribe_lite("_TopicC")  # /TopicC
        consumer.subscribe_lite("a-20b_-C3-A9")  # "a b/é"
        pub = connect("to-lite-push")
        pub.publish("sensors/lab/temp", b"21.5")
        pub.publish("/TopicC", b"c")
        pub.publish("a b/é", b"e")
        assert inbox.wait_for(lambda i: len(i.accepted) == 3, WAIT_S), inbox.bodies()
        assert sorted((m.lite_topic, m.body) for m in inbox.accepted) == [
            ("_TopicC", b"c"),
            ("a-20b_-C3-A9", b"e"),
            ("sensors_lab_temp", b"21.5"),
        ]
    finally:
        consumer.shutdown()


def test_mosquitto_clients_with_topics_of_no_parent(broker: BrokerProcess) -> None:
    """mosquitto_sub ``+/+`` (3.1.1) and ``#`` (5.0) against mosquitto_pub: ``/TopicA`` and ``TopicA/B`` reach
    ``+/+``; ``sensors/room1/temp`` does not; ``$SYS/x`` reaches neither."""
    port = str(broker.mqtt_port)

    def start(*args: str) -> subprocess.Popen[str]:
        common = ["-h", "127.0.0.1", "-p", port, "-q", "1", "-v", "-W", "30"]
        return subprocess.Popen(["mosquitto_sub", *common, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)  # fmt: skip

    subs = {"+/+": start("-t", "+/+", "-C", "2", "-i", "mosq-two"), "#": start("-V", "mqttv5", "-t", "#", "-C", "3",
                                                                           "-i", "mosq-all")}  # fmt: skip
    try:
        for client_id in ("mosq-two", "mosq-all"):
            _wait_for_log(broker, f"mqtt client {client_id} connected")
        time.sleep(0.3)  # its SUBSCRIBE follows the CONNACK
        for topic in ("$SYS/x", "sensors/room1/temp", "/TopicA", "TopicA/B"):
            subprocess.run(
                ["mosquitto_pub", "-h", "127.0.0.1", "-p", port, "-q", "1", "-t", topic, "-m", f"via-{topic}"],
                check=True, timeout=30, capture_output=True,
            )  # fmt: skip
        outs = {name: sub.communicate(timeout=40) for name, sub in subs.items()}
    finally:
        for sub in subs.values():
            if sub.poll() is None:
                sub.kill()
                sub.communicate(timeout=10)
    assert all(sub.returncode == 0 for sub in subs.values()), outs
    assert sorted(outs["+/+"][0].splitlines()) == ["/TopicA via-/TopicA", "TopicA/B via-TopicA/B"]
    assert sorted(outs["#"][0].splitlines()) == [
        "/TopicA via-/TopicA",
        "TopicA/B via-TopicA/B",
        "sensors/room1/temp via-sensors/room1/temp",
    ]


def _wait_for_log(broker: BrokerProcess, text: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while text not in broker.log():
        assert time.monotonic() < deadline, f"{text!r} not in the broker log"
        time.sleep(0.05)


def test_mqtt_3_3_1_retained_messages_of_any_topic_keep_their_topic_and_the_dollar_rule(
    connect: Callable[..., Peer],
) -> None:
    """Retained messages in the default parent: a hashed topic's comes back under its own name; ``#`` is not
    sent ``$SYS/…``'s (sent in lite-name order, ``-24SYS…`` would come first), ``$SYS/#`` is."""
    long = "retained/" + "ü" * 40
    pub = connect("ret-pub")
    for topic, payload in ((long, b"L"), ("$SYS/retained", b"S"), ("retained/short", b"s")):
        assert pub.publish(topic, payload, retain=True) == 0
    every = connect("ret-all")
    assert every.subscribe(("#", 1)) == [1]
    assert {(m.topic, m.payload, m.retain) for m in every.wait_count(2)} == {
        (long, b"L", True),
        ("retained/short", b"s", True),
    }
    dollar = connect("ret-sys")
    assert dollar.subscribe(("$SYS/#", 1)) == [1]
    assert [(m.topic, m.payload) for m in dollar.wait_count(1)] == [("$SYS/retained", b"S")]
