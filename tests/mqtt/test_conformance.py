"""MQTT 3.1.1 and 5.0 conformance (issue 27, items 2, 6, 7; item 5: ``test_subscribe_race``), each against a
normative statement of the specifications, with paho-mqtt clients (and raw sockets where a client library
hides what the broker sent)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable

from paho.mqtt.enums import MQTTProtocolVersion

from lmq_broker.mqtt import codec
from lmq_broker.mqtt.properties import NONE
from lmq_broker.testing import BrokerProcess
from lmq_broker.testing_mqtt import Peer

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
    that unread input (a reset would destroy the DISCONNECT before the client read it)."""
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
