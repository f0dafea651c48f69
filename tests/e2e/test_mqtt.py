"""MQTT meets RocketMQ on one broker: Debian's mosquitto-clients and paho-mqtt (3.1.1 and 5.0) on one side, the
official rocketmq-python-client 5.1.2 (Producer, LitePushConsumer) on the other, through the same lite topics;
MQTT 5 user properties and RocketMQ message properties are the same thing.

mosquitto_pub/mosquitto_sub come from ``make mqtt-clients`` (scripts/mqtt-clients-install.sh); without them
this suite fails, it does not skip.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from paho.mqtt.enums import MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from rocketmq import ClientConfiguration, Credentials, LitePushConsumer, Message, Producer
from testing_mqtt import Peer

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.testing import BrokerProcess, Inbox, start_broker

WAIT_S = 20.0


def mosquitto(program: str) -> str:
    path = shutil.which(program)
    if path is None:
        pytest.fail(f"{program} is not installed: run `make mqtt-clients` (Debian's mosquitto-clients)")
    return path


@pytest.fixture(scope="module")
def mqtt_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    process = start_broker(tmp_path_factory.mktemp("mqtt-e2e") / "data", extra_args=["--mqtt-port", "0"])
    yield process
    assert process.stop() == 0, process.log()[-4000:]


@pytest.fixture
def topic(mqtt_broker: BrokerProcess, unique: Callable[[str], str]) -> tuple[str, str]:
    """A LITE parent topic and a lite group of it, on the MQTT broker."""
    parent, group = unique("MQ"), unique("MG")
    with AdminClient(mqtt_broker.admin_endpoint, timeout_s=10, **mqtt_broker.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic(parent, model.MessageType.LITE))
        admin.put_group(model.LiteGroup(group, parent))
    return parent, group


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    started: list[Peer] = []
    yield started
    for peer in started:
        peer.client.loop_stop()
        peer.client.disconnect()


def config(broker: BrokerProcess) -> Any:
    return ClientConfiguration(broker.endpoint, Credentials(), request_timeout=5)


def test_mosquitto_pub_reaches_mosquitto_sub_through_a_wildcard(
    mqtt_broker: BrokerProcess, topic: tuple[str, str], tmp_path: Path
) -> None:
    parent, _ = topic
    port = str(mqtt_broker.mqtt_port)
    sub = subprocess.Popen(
        [mosquitto("mosquitto_sub"), "-h", "127.0.0.1", "-p", port, "-q", "1", "-t", f"{parent}/room/+", "-v",
         "-C", "3", "-W", "30", "-i", "mosq-sub"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _wait_for_log(mqtt_broker, "mosq-sub connected")
        time.sleep(0.3)  # its SUBSCRIBE follows the CONNACK
        for n, room in enumerate(["a", "b", "a"]):
            subprocess.run(
                [mosquitto("mosquitto_pub"), "-h", "127.0.0.1", "-p", port, "-q", "1", "-t", f"{parent}/room/{room}",
                 "-m", f"hello-{n}"],
                check=True, timeout=30, capture_output=True,
            )  # fmt: skip
        out, err = sub.communicate(timeout=40)
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.communicate(timeout=10)
    assert sub.returncode == 0, err
    assert out.splitlines() == [f"{parent}/room/a hello-0", f"{parent}/room/b hello-1", f"{parent}/room/a hello-2"]


def test_a_killed_mosquitto_sub_leaves_its_will_and_retained_messages_reach_it(
    mqtt_broker: BrokerProcess, topic: tuple[str, str], peers: list[Peer]
) -> None:
    parent, _ = topic
    port = mqtt_broker.mqtt_port
    watcher = Peer(port, "will-watcher")
    peers.append(watcher)
    watcher.subscribe((f"{parent}/presence/#", 1))
    subprocess.run(
        [mosquitto("mosquitto_pub"), "-h", "127.0.0.1", "-p", str(port), "-q", "1", "-r", "-t", f"{parent}/motd",
         "-m", "welcome"],
        check=True, timeout=30, capture_output=True,
    )  # fmt: skip
    doomed = subprocess.Popen(
        [mosquitto("mosquitto_sub"), "-h", "127.0.0.1", "-p", str(port), "-q", "1", "-t", f"{parent}/motd",
         "-i", "doomed", "--will-topic", f"{parent}/presence/doomed", "--will-payload", "offline", "--will-qos", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert doomed.stdout is not None
        assert doomed.stdout.readline().strip() == "welcome"  # the retained message, on subscribe
    finally:
        doomed.send_signal(signal.SIGKILL)  # no DISCONNECT: the broker sees the socket close
        doomed.communicate(timeout=10)
    (will,) = watcher.wait_count(1)
    assert (will.topic, will.payload) == (f"{parent}/presence/doomed", b"offline")


def test_the_rocketmq_producer_reaches_an_mqtt_subscriber(
    mqtt_broker: BrokerProcess, topic: tuple[str, str], clients: list[Any], peers: list[Peer]
) -> None:
    parent, _ = topic
    sub = Peer(mqtt_broker.mqtt_port, "from-rocketmq")
    peers.append(sub)
    assert sub.subscribe((f"{parent}/agent/#", 1)) == [1]
    producer = Producer(config(mqtt_broker), (parent,))
    producer.startup()
    clients.append(producer)
    for n, lite in enumerate(["agent_1", "agent_2_task", "agent_1"]):
        message = Message()
        message.topic, message.lite_topic, message.body = parent, lite, f"rocketmq-{n}".encode()
        producer.send(message)
    got = sub.wait_count(3)
    # in order per topic (MQTT 3.1.1 / 5.0 section 4.6); two topics' messages may interleave either way
    assert [(m.topic, m.payload, m.qos) for m in got if m.topic.endswith("/1")] == [
        (f"{parent}/agent/1", b"rocketmq-0", 1),
        (f"{parent}/agent/1", b"rocketmq-2", 1),
    ]
    assert [(m.topic, m.payload, m.qos) for m in got if m.topic.endswith("/task")] == [
        (f"{parent}/agent/2/task", b"rocketmq-1", 1)
    ]
    assert len(sub.quiet()) == 3


def test_an_mqtt_publish_reaches_a_lite_push_consumer(
    mqtt_broker: BrokerProcess, topic: tuple[str, str], clients: list[Any], peers: list[Peer]
) -> None:
    parent, group = topic
    inbox = Inbox()
    consumer = LitePushConsumer(config(mqtt_broker), group, parent, inbox)
    consumer.startup()
    clients.append(consumer)
    consumer.subscribe_lite("device-7_telemetry")
    pub = Peer(mqtt_broker.mqtt_port, "to-rocketmq")
    peers.append(pub)
    pub.publish(f"{parent}/device-7/telemetry", b"21.5C", qos=1)
    pub.publish(f"{parent}/device-7/telemetry", b"21.7C", qos=0)
    assert inbox.wait_for(lambda i: len(i.accepted) == 2, WAIT_S), inbox.bodies()
    assert [(m.lite_topic, m.body) for m in inbox.accepted] == [
        ("device-7_telemetry", b"21.5C"),
        ("device-7_telemetry", b"21.7C"),
    ]
    assert inbox.accepted[1].properties.get("MQTT_QOS") == "0"
    with AdminClient(mqtt_broker.admin_endpoint, timeout_s=10, **mqtt_broker.admin_keys) as admin:
        deadline = time.monotonic() + WAIT_S
        while admin.describe_lite_topic(parent, "device-7_telemetry").group_offsets.get(group) != 2:
            assert time.monotonic() < deadline, "the consumer's acks were not committed"
            time.sleep(0.05)


def test_mqtt_3_3_3_an_empty_publish_reaches_a_lite_push_consumer_as_an_empty_body(
    mqtt_broker: BrokerProcess, topic: tuple[str, str], clients: list[Any], peers: list[Peer]
) -> None:
    """MQTT 3.1.1 / 5.0 section 3.3.3: a zero-length payload is valid; the official consumer gets an empty body
    (a gRPC producer's empty body stays refused with MESSAGE_BODY_EMPTY)."""
    parent, group = topic
    inbox = Inbox()
    consumer = LitePushConsumer(config(mqtt_broker), group, parent, inbox)
    consumer.startup()
    clients.append(consumer)
    consumer.subscribe_lite("beacon")
    pub = Peer(mqtt_broker.mqtt_port, "empty-to-rocketmq")
    peers.append(pub)
    assert pub.publish(f"{parent}/beacon", b"", qos=1) == 0
    pub.publish(f"{parent}/beacon", b"after", qos=1)
    assert inbox.wait_for(lambda i: len(i.accepted) == 2, WAIT_S), inbox.bodies()
    assert [m.body for m in inbox.accepted] == [b"", b"after"]


def test_rocketmq_properties_reach_an_mqtt5_subscriber_as_user_properties(
    mqtt_broker: BrokerProcess, topic: tuple[str, str], clients: list[Any], peers: list[Peer]
) -> None:
    parent, _ = topic
    sub = Peer(mqtt_broker.mqtt_port, "v5-from-rocketmq", protocol=MQTTProtocolVersion.MQTTv5)
    peers.append(sub)
    assert sub.subscribe((f"{parent}/order/#", 1)) == [1]
    producer = Producer(config(mqtt_broker), (parent,))
    producer.startup()
    clients.append(producer)
    message = Message()
    message.topic, message.lite_topic, message.body = parent, "order_42", b"shipped"
    message.add_property("region", "eu-west")
    message.add_property("priority", "high")
    producer.send(message)
    (got,) = sub.wait_count(1)
    assert (got.topic, got.payload) == (f"{parent}/order/42", b"shipped")
    assert sorted(got.properties.UserProperty) == [("priority", "high"), ("region", "eu-west")]


def test_mqtt5_user_properties_reach_a_lite_push_consumer_as_message_properties(
    mqtt_broker: BrokerProcess, topic: tuple[str, str], clients: list[Any], peers: list[Peer]
) -> None:
    parent, group = topic
    inbox = Inbox()
    consumer = LitePushConsumer(config(mqtt_broker), group, parent, inbox)
    consumer.startup()
    clients.append(consumer)
    consumer.subscribe_lite("sensor-3")
    pub = Peer(mqtt_broker.mqtt_port, "v5-to-rocketmq", protocol=MQTTProtocolVersion.MQTTv5)
    peers.append(pub)
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.UserProperty = [("unit", "celsius"), ("site", "lab-2")]
    props.ContentType = "text/plain"
    assert pub.publish(f"{parent}/sensor-3", b"21.5", qos=1, properties=props) == 0
    assert inbox.wait_for(lambda i: len(i.accepted) == 1, WAIT_S), inbox.bodies()
    (m,) = inbox.accepted
    assert (m.lite_topic, m.body) == ("sensor-3", b"21.5")
    assert (m.properties["unit"], m.properties["site"]) == ("celsius", "lab-2")
    assert (m.properties["MQTT_CONTENT_TYPE"], m.properties["MQTT_CLIENT_ID"]) == ("text/plain", "v5-to-rocketmq")


def test_mosquitto_v5_clients_carry_user_properties(mqtt_broker: BrokerProcess, topic: tuple[str, str]) -> None:
    parent, _ = topic
    port = str(mqtt_broker.mqtt_port)
    sub = subprocess.Popen(
        [mosquitto("mosquitto_sub"), "-V", "mqttv5", "-h", "127.0.0.1", "-p", port, "-q", "1", "-t", f"{parent}/v5/+",
         "-F", "%t %p %P", "-C", "2", "-W", "30", "-i", "mosq5-sub"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _wait_for_log(mqtt_broker, "mosq5-sub connected")
        time.sleep(0.3)  # its SUBSCRIBE follows the CONNACK
        for n in range(2):
            subprocess.run(
                [mosquitto("mosquitto_pub"), "-V", "mqttv5", "-h", "127.0.0.1", "-p", port, "-q", "1",
                 "-t", f"{parent}/v5/{n}", "-m", f"hello-{n}", "-D", "publish", "user-property", "seq", str(n)],
                check=True, timeout=30, capture_output=True,
            )  # fmt: skip
        out, err = sub.communicate(timeout=40)
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.communicate(timeout=10)
    assert sub.returncode == 0, err
    assert out.splitlines() == [f"{parent}/v5/0 hello-0 seq:0", f"{parent}/v5/1 hello-1 seq:1"]
    full = f"{parent}-full"  # every topic has a lite topic: a parent that takes no more refuses one
    with AdminClient(mqtt_broker.admin_endpoint, timeout_s=10, **mqtt_broker.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic(full, model.MessageType.LITE, max_lite_topics=0))
    refused = subprocess.run(
        [mosquitto("mosquitto_pub"), "-V", "mqttv5", "-h", "127.0.0.1", "-p", port, "-q", "1",
         "-t", f"{full}/x", "-m", "lost?"],
        check=False, timeout=30, capture_output=True, text=True,
    )  # fmt: skip
    assert "Publish 1 failed: Quota exceeded" in refused.stderr, refused.stderr  # a negative PUBACK, and why:
    assert full in refused.stderr  # its reason string


def _wait_for_log(broker: BrokerProcess, text: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while text not in broker.log():
        assert time.monotonic() < deadline, f"{text!r} not in the broker log"
        time.sleep(0.05)


@pytest.mark.parametrize("version", ["mqttv311", "mqttv5"])
def test_4_3_3_mosquitto_qos2_publishes_reach_a_qos2_mosquitto_sub_exactly_once(
    mqtt_broker: BrokerProcess, topic: tuple[str, str], version: str
) -> None:
    """3.1.1 and 5.0 section 4.3.3: mosquitto_pub -q 2 completes the QoS 2 flow (it exits 0 only after each
    PUBCOMP), each message is stored once, and mosquitto_sub -q 2 gets each once (its QoS 2 flow with the
    broker completes, else it would not count the message toward -C)."""
    parent, _ = topic
    port = str(mqtt_broker.mqtt_port)
    client = f"mosq-q2-{version}"
    sub = subprocess.Popen(
        [mosquitto("mosquitto_sub"), "-h", "127.0.0.1", "-p", port, "-V", version, "-q", "2", "-t",
         f"{parent}/q2/+", "-v", "-C", "3", "-W", "30", "-i", client],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _wait_for_log(mqtt_broker, f"{client} connected")
        time.sleep(0.3)  # its SUBSCRIBE follows the CONNACK
        for n, room in enumerate(["a", "b", "a"]):
            subprocess.run(
                [mosquitto("mosquitto_pub"), "-h", "127.0.0.1", "-p", port, "-V", version, "-q", "2", "-t",
                 f"{parent}/q2/{room}", "-m", f"once-{n}"],
                check=True, timeout=30, capture_output=True,
            )  # fmt: skip
        out, err = sub.communicate(timeout=40)
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.communicate(timeout=10)
    assert sub.returncode == 0, err
    assert out.splitlines() == [f"{parent}/q2/a once-0", f"{parent}/q2/b once-1", f"{parent}/q2/a once-2"]
    with AdminClient(mqtt_broker.admin_endpoint, timeout_s=10, **mqtt_broker.admin_keys) as admin:
        assert admin.describe_lite_topic(parent, "q2_a").meta.max_offset == 2
        assert admin.describe_lite_topic(parent, "q2_b").meta.max_offset == 1
