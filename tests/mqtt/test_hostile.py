"""Hostile or careless MQTT clients on raw sockets against a broker process: what they send is refused with
the specification's code, and what they leave unread is not kept for them without bound."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest
from testing_mqtt import Peer

from lmq_broker.mqtt import codec
from lmq_broker.mqtt.properties import NONE, Reason
from lmq_broker.testing import BrokerProcess

Connect = Callable[..., Peer]


def _connack(port: int, connect: codec.Connect) -> codec.Packet:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(codec.encode(connect))
        decoder = codec.Decoder(level=connect.level)
        while not (got := decoder.feed(sock.recv(65536))):
            pass
    return got[0]  # the socket closes unannounced: a will accepted would be published now


@pytest.mark.parametrize("topic", ["{}/w/#", "{}/+/x", "w/#"])
def test_mqtt_4_7_0_1_a_will_topic_with_a_wildcard_is_refused_and_never_published(
    broker: BrokerProcess, parent: str, connect: Connect, topic: str
) -> None:
    """MQTT-4.7.0-1: wildcards "MUST NOT be used within a Topic Name", and a will's topic is one: it is refused
    at CONNECT (5.0 ``0x90`` Topic Name invalid; 3.1.1 return code 5, as for any will never publishable)
    rather than accepted and, at the connection's end, published under a wildcard name that subscribers
    would receive (and, retained, every later subscriber)."""
    port, name = broker.mqtt_port, topic.format(parent)
    watcher = connect(port)
    assert watcher.subscribe((f"{parent}/#", 1), ("w/#", 1)) == [1, 1]
    will = codec.Will(name, b"bye", 1, True, NONE)
    answer = _connack(port, codec.Connect("will-5", will=will, level=codec.LEVEL_5, properties=NONE))
    assert isinstance(answer, codec.ConnAck) and answer.code == Reason.TOPIC_NAME_INVALID, answer
    answer = _connack(port, codec.Connect("will-3", will=codec.Will(name, b"bye", 1, True)))
    assert answer == codec.ConnAck(False, codec.ConnectCode.NOT_AUTHORIZED), answer
    watcher.publish(f"{parent}/w/mark", b"mark", qos=1)  # after the wills would have been published
    got = watcher.wait_count(1)
    assert [(m.topic, m.payload) for m in got] == [(f"{parent}/w/mark", b"mark")]
