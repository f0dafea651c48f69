"""MQTT 3.1.1 and 5.0 conformance (issue 27, items 2, 6, 7; item 5: ``test_subscribe_race``), each against a
normative statement of the specifications, with paho-mqtt clients (and raw sockets where a client library
hides what the broker sent)."""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import time
import urllib.request
from collections.abc import Callable

import pytest
from paho.mqtt.enums import MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from raw_mqtt import Raw
from testing_mqtt import Peer

from lmq_broker.mqtt import codec, stats
from lmq_broker.mqtt.properties import NONE
from lmq_broker.testing import BrokerProcess

Connect = Callable[..., Peer]
V5 = MQTTProtocolVersion.MQTTv5


def test_mqtt_3_3_3_a_zero_length_payload_is_stored_and_delivered_3_1_1_and_5_0(
    broker: BrokerProcess, parent: str, connect: Connect
) -> None:
    """3.1.1 and 5.0 section 3.3.3: "It is valid for a PUBLISH Packet to contain a zero length payload"; only
    a retained one means "clear the retained message" (3.3.1.3). Both levels publish and receive one."""
    port = broker.mqtt_port
    old_sub, new_sub = connect(port), connect(port, protocol=V5)
    assert old_sub.subscribe((f"{parent}/empty/+", 1)) == [1]
    assert new_sub.subscribe((f"{parent}/empty/+", 1)) == [1]
    old_pub, new_pub = connect(port), connect(port, protocol=V5)
    assert old_pub.publish(f"{parent}/empty/a", b"", qos=1) == 0
    assert new_pub.publish(f"{parent}/empty/b", b"", qos=1) == 0  # PUBACK 0x00, not a refusal
    new_pub.publish(f"{parent}/empty/b", b"", qos=0)
    for sub in (old_sub, new_sub):
        got = sub.wait_count(3)
        assert sorted((m.topic, m.payload) for m in got) == [
            (f"{parent}/empty/a", b""), (f"{parent}/empty/b", b""), (f"{parent}/empty/b", b"")
        ]  # fmt: skip
    assert not old_pub.disconnected, "the 3.1.1 publisher's connection was dropped"


def _raw_v5(port: int, client_id: str) -> tuple[socket.socket, codec.Decoder]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    decoder = codec.Decoder(level=codec.LEVEL_5)
    sock.sendall(codec.encode(codec.Connect(client_id, True, 30, level=codec.LEVEL_5, properties=NONE)))
    while not (got := decoder.feed(sock.recv(65536))):
        pass
    assert isinstance(got[0], codec.ConnAck) and got[0].code == 0, got
    return sock, decoder


def _until_closed(sock: socket.socket, decoder: codec.Decoder) -> list[codec.Packet]:
    """Every packet the broker sent until it closed; a reset fails the test (what it sent unread is lost)."""
    out: list[codec.Packet] = []
    while data := sock.recv(65536):
        out += decoder.feed(data)
    sock.close()
    return out


def test_mqtt5_3_3_4_receive_maximum_exceeded_is_told_with_a_disconnect_0x93_not_a_reset(
    broker: BrokerProcess, parent: str
) -> None:
    """5.0 section 3.3.4 (MQTT-3.3.4-9) and 4.13.2: a client sending more QoS > 0 publishes than the broker's
    Receive Maximum gets DISCONNECT 0x93. The client goes on writing meanwhile: the broker must not close on
    that unread input (a reset would destroy the DISCONNECT before the client read it). The refusal is counted
    in ``lmq_mqtt_refused_total{reason="receive_maximum"}``."""
    before = _cap_refusals(broker, stats.RECEIVE_MAXIMUM)
    sock, decoder = _raw_v5(broker.mqtt_port, "over-receive-max")
    maximum = 256  # the CONNACK's Receive Maximum
    publishes = b"".join(
        codec.encode(codec.Publish(f"{parent}/rm", b"x", qos=2, packet_id=i, properties=NONE))
        for i in range(1, maximum + 2)
    )  # QoS 2 without PUBREL: each stays unacknowledged
    filler = codec.encode(codec.Publish(f"{parent}/rm", b"f" * 16384, properties=NONE)) * 64  # beyond what is read
    publishes += filler
    with contextlib.suppress(ConnectionError):
        sock.sendall(publishes)
    got = _until_closed(sock, decoder)
    last = got[-1]
    assert isinstance(last, codec.Disconnect) and last.reason == 0x93, got[-3:]
    assert _cap_refusals(broker, stats.RECEIVE_MAXIMUM) == before + 1


def _cap_refusals(broker: BrokerProcess, reason: str) -> float:
    with urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.search(rf'^lmq_mqtt_refused_total\{{reason="{reason}"\}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _refused_count(broker: BrokerProcess, reason: str) -> float:
    with urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.search(rf'^lmq_mqtt_publishes_refused_total\{{reason="{reason}"\}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _logged(broker: BrokerProcess, line: str) -> bool:
    return line in broker.log()


def test_mqtt_3_3_5_a_refused_311_publish_closes_the_connection_and_is_logged_and_counted(
    broker: BrokerProcess, full_parent: str, connect: Connect
) -> None:
    """3.1.1 section 3.3.5 (MQTT-3.3.5-2): a publish the server will not accept gets a positive PUBACK or the
    connection closed; 3.1.1 has no negative PUBACK, so closing is the client's only signal: the operator sees
    why at INFO (with the client id) and in ``lmq_mqtt_publishes_refused``."""
    before = _refused_count(broker, "quota_exceeded")
    full = full_parent  # every topic has a lite topic: a full parent is what refuses one
    bad = connect(broker.mqtt_port, "refused-311")
    bad.client.publish(f"{full}/x", b"secret-payload", qos=1)
    bad.wait(lambda p: p.disconnected, "the broker closing the connection")
    line = f"mqtt client refused-311: PUBLISH to '{full}/x' refused: "
    deadline = time.monotonic() + 10
    while not _logged(broker, line):
        assert time.monotonic() < deadline, broker.log()[-2000:]
        time.sleep(0.05)
    logged = next(t for t in broker.log().splitlines() if line in t)
    assert " INFO " in logged and "the connection is closed" in logged and "secret-payload" not in logged
    assert _refused_count(broker, "quota_exceeded") == before + 1


def test_mqtt5_3_4_2_a_refused_publish_gets_a_reason_code_keeps_the_connection_and_is_counted(
    broker: BrokerProcess, full_parent: str, connect: Connect
) -> None:
    """5.0 section 3.4.2.1: a PUBACK reason code (0x97 quota exceeded) tells the publisher why, and the
    connection stays; the refusal is logged at INFO with the client id and counted."""
    before = _refused_count(broker, "quota_exceeded")
    full = full_parent
    pub = connect(broker.mqtt_port, "refused-50", protocol=V5)
    assert pub.publish(f"{full}/y", b"x", qos=1) == 0x97
    assert not pub.disconnected
    assert _refused_count(broker, "quota_exceeded") == before + 1
    assert f"mqtt client refused-50: PUBLISH to '{full}/y' refused: " in broker.log()


def test_refusals_are_logged_at_most_20_a_second_and_the_rest_are_counted(caplog: pytest.LogCaptureFixture) -> None:
    """The refusal log is rate-limited: a client looping on a refused publish does not flood the broker log."""
    now = [100.0]
    refusals = stats.RefusalLog(clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger=stats.__name__):
        for _ in range(50):
            refusals.refused("looping", "PUBLISH", "t/x", "no such parent", "closed")
        now[0] += 1.0
        refusals.refused("looping", "PUBLISH", "t/x", "no such parent", "closed")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == stats.REFUSALS_LOGGED_PER_S + 1
    assert lines[-1].endswith("(30 more refusals not logged)")


def test_mqtt5_3_3_4_one_topic_flows_up_to_the_receive_maximum_not_batch_by_batch(
    broker: BrokerProcess, parent: str, connect: Connect
) -> None:
    """5.0 section 3.3.4 (MQTT-3.3.4-9) and 4.9: at most Receive Maximum QoS 1 deliveries are unacknowledged,
    and each PUBACK makes room for one more: a topic's next message does not wait until every earlier one
    is acknowledged. Order holds (section 4.6)."""
    port = broker.mqtt_port
    connect_props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    connect_props.ReceiveMaximum = 10
    sub = connect(port, protocol=V5, manual_ack=True, properties=connect_props)
    topic = f"{parent}/flow"
    assert sub.subscribe((topic, 1)) == [1]
    pub = connect(port)
    for i in range(30):
        pub.client.publish(topic, f"m{i}".encode(), qos=1)
    assert len(sub.wait_count(10)) == 10
    assert len(sub.quiet(0.5)) == 10  # the client's Receive Maximum: no more until a PUBACK
    first = sub.messages()[0]
    sub.client.ack(first.mid, 1)
    assert len(sub.wait_count(11)) == 11  # one PUBACK, one more: not after all 10 were acknowledged
    acked = 1
    while acked < 30:
        got = sub.wait_count(acked + 1)
        sub.client.ack(got[acked].mid, 1)
        acked += 1
    assert sub.payloads() == [f"m{i}".encode() for i in range(30)]


def test_4_9_one_topic_flows_up_to_the_in_flight_window_past_one_receive_batch(
    broker: BrokerProcess, parent: str, connect: Connect
) -> None:
    """The in-flight window (64 for 3.1.1) is wider than one receive batch (``--receive-batch-size``, 32): a
    topic's messages published at once all go out before any PUBACK. (A batch that took all it asked left the
    rest of the topic waiting for a PUBACK or the next publish: a client acknowledging after 40 messages never
    got them.)"""
    port = broker.mqtt_port
    sub = connect(port, manual_ack=True)
    topic = f"{parent}/window"
    assert sub.subscribe((topic, 1)) == [1]
    pub = Raw(port, "window-pub")
    for i in range(40):  # in one go: stored in one append
        pub.send(codec.Publish(topic, f"m{i}".encode(), qos=1, packet_id=i + 1))
    for i in range(40):
        pub.expect(codec.PUBACK, i + 1)
    pub.close()
    assert [m.payload for m in sub.wait_count(40)] == [f"m{i}".encode() for i in range(40)]
