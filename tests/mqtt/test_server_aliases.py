"""MQTT 5.0 outbound topic aliases (section 3.3.2.3.4) and the server's keep alive cap (sections 3.1.2.10,
3.2.2.3.14): raw sockets, since a client library resolves aliases and hides what the broker sent."""

from __future__ import annotations

import re
import socket
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace

import pytest
from testing_mqtt import Peer

from lmq_broker.mqtt import aliases, codec, stats
from lmq_broker.mqtt.codec import ConnectCode
from lmq_broker.mqtt.properties import NONE, Properties
from lmq_broker.testing import BrokerProcess, start_broker


def _connect(
    port: int, client_id: str, level: int, keep_alive_s: int = 30, props: Properties | None = None
) -> tuple[socket.socket, codec.Decoder, codec.ConnAck]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    decoder = codec.Decoder(level=level)
    v5 = level == codec.LEVEL_5
    connect = codec.Connect(client_id, True, keep_alive_s, level=level, properties=(props or NONE) if v5 else None)
    sock.sendall(codec.encode(connect))
    while not (got := decoder.feed(sock.recv(65536))):
        pass
    assert isinstance(got[0], codec.ConnAck), got
    return sock, decoder, got[0]


def _read(sock: socket.socket, decoder: codec.Decoder, count: int) -> list[codec.Packet]:
    out: list[codec.Packet] = []
    while len(out) < count:
        data = sock.recv(65536)
        assert data, f"closed after {out}"
        out += decoder.feed(data)
    return out


def _subscribe(sock: socket.socket, decoder: codec.Decoder, topic_filter: str) -> None:
    sock.sendall(codec.encode(codec.Subscribe(1, ((topic_filter, 1),), properties=NONE)))
    (suback,) = _read(sock, decoder, 1)
    assert isinstance(suback, codec.SubAck) and suback.codes == (1,), suback


def _received(sock: socket.socket, decoder: codec.Decoder, count: int) -> list[codec.Publish]:
    """``count`` PUBLISH packets, each acknowledged."""
    got: list[codec.Publish] = []
    for packet in _read(sock, decoder, count):
        assert isinstance(packet, codec.Publish), packet
        assert packet.packet_id is not None
        sock.sendall(codec.encode(codec.PacketId(codec.PUBACK, packet.packet_id, properties=NONE)))
        got.append(packet)
    return got


def test_outbound_aliases_reuse_the_least_recently_used_one_when_full() -> None:
    """Section 3.3.2.3.4: the sender may rebind an alias by sending the name with it; ours rebinds the least
    recently used one, and only once the PUBLISH went out."""
    kept = aliases.Outbound(2)
    assert kept.choose("a") == (1, True)
    assert kept.choose("a") == (1, True)  # not sent yet: still unbound
    kept.sent("a", 1, True)
    assert kept.choose("a") == (1, False)
    kept.sent("b", *kept.choose("b"))
    kept.sent("a", *kept.choose("a"))  # a used after b: b is the least recently used
    assert kept.choose("c") == (2, True)
    kept.sent("c", 2, True)
    assert kept.choose("b") == (1, True)  # b lost its alias; a (used before c) gives up 1
    assert aliases.Outbound(0).choose("a") == (None, True)
    assert aliases.Outbound(10_000).choose("x") == (1, True)
    many = aliases.Outbound(10_000)
    for i in range(aliases.MAX + 5):
        many.sent(f"t{i}", *many.choose(f"t{i}"))
    assert many.choose("new") == (6, True)  # at most MAX, whatever the client allows


def test_mqtt5_3_3_2_3_4_a_subscriber_allowing_topic_aliases_gets_them_and_every_topic_resolves(
    broker: BrokerProcess, parent: str
) -> None:
    """5.0 section 3.3.2.3.4 (MQTT-3.3.2-8/10/12): with a Topic Alias Maximum of 2 the subscriber's PUBLISH
    packets carry aliases between 1 and 2, a topic's later packets carry an empty name, and resolving them as
    a client must (the last name sent with each alias) gives back every message's real topic."""
    props = replace(NONE, topic_alias_max=2)
    sock, decoder, _ = _connect(broker.mqtt_port, "alias-sub", codec.LEVEL_5, props=props)
    _subscribe(sock, decoder, f"{parent}/al/+")
    pub = Peer(broker.mqtt_port, "alias-pub")
    try:
        topics = ["a", "a", "b", "a", "c", "c", "b", "a", "a", "c"]
        for i, name in enumerate(topics):
            assert pub.publish(f"{parent}/al/{name}", f"{name}{i}".encode(), qos=1) == 0
        got = _received(sock, decoder, len(topics))
    finally:
        pub.client.loop_stop()
        pub.client.disconnect()
        sock.close()
    bound: dict[int, str] = {}
    resolved = []
    for p in got:
        assert p.properties is not None
        alias = p.properties.topic_alias
        assert alias in (1, 2), p
        if p.topic:
            bound[alias] = p.topic
        resolved.append((bound[alias], p.payload))
    assert sorted(resolved) == sorted((f"{parent}/al/{n}", f"{n}{i}".encode()) for i, n in enumerate(topics))
    assert sum(1 for p in got if not p.topic) >= 3, "a topic sent again in a row travels as its alias alone"


def test_mqtt5_3_3_2_3_4_no_alias_is_sent_to_a_client_that_allows_none(broker: BrokerProcess, parent: str) -> None:
    """MQTT-3.3.2-9: a client that sent no Topic Alias Maximum (0) is never sent an alias."""
    sock, decoder, _ = _connect(broker.mqtt_port, "no-alias-sub", codec.LEVEL_5)
    _subscribe(sock, decoder, f"{parent}/na/+")
    pub = Peer(broker.mqtt_port, "no-alias-pub")
    try:
        for i in range(3):
            assert pub.publish(f"{parent}/na/x", f"m{i}".encode(), qos=1) == 0
        got = _received(sock, decoder, 3)
    finally:
        pub.client.loop_stop()
        pub.client.disconnect()
        sock.close()
    assert [(p.topic, p.properties.topic_alias if p.properties else None) for p in got] == [
        (f"{parent}/na/x", None)
    ] * 3


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """A broker holding keep alives to 2 s at most."""
    data = tmp_path_factory.mktemp("keepalive") / "data"
    process = start_broker(data, extra_args=["--mqtt-port", "0", "--mqtt-max-keep-alive-s", "2"])
    yield process
    assert process.stop() == 0, process.log()[-4000:]


def test_mqtt5_3_2_2_3_14_a_keep_alive_over_the_cap_or_none_is_answered_with_server_keep_alive(
    capped: BrokerProcess,
) -> None:
    """5.0 section 3.2.2.3.14 (MQTT-3.2.2-21): the CONNACK's Server Keep Alive tells a client asking more than
    --mqtt-max-keep-alive-s, or none, what it is held to; a client asking less is told nothing."""
    for asked, told in ((120, 2), (0, 2), (1, None), (2, None)):
        sock, _, connack = _connect(capped.mqtt_port, f"ka-{asked}", codec.LEVEL_5, keep_alive_s=asked)
        sock.close()
        assert connack.code == 0 and connack.properties is not None
        assert connack.properties.server_keep_alive_s == told, asked


@pytest.mark.parametrize("level", [codec.LEVEL_5, codec.LEVEL_3_1_1])
def test_mqtt_3_1_2_10_a_client_asking_no_keep_alive_is_held_to_the_cap(capped: BrokerProcess, level: int) -> None:
    """3.1.1 and 5.0 section 3.1.2.10 (MQTT-3.1.2-24): a connection silent for one and a half keep alive
    periods is closed; a client asking none (0) is held to --mqtt-max-keep-alive-s, so a silent one does not
    hold its socket for ever (5.0: DISCONNECT 0x8D keep alive timeout first)."""
    sock, decoder, connack = _connect(capped.mqtt_port, f"silent-{level}", level, keep_alive_s=0)
    assert connack.code == 0
    started = time.monotonic()
    got: list[codec.Packet] = []
    while data := sock.recv(65536):
        got += decoder.feed(data)
    sock.close()
    assert time.monotonic() - started >= 2.5  # not before 1.5 periods (3 s, less timer slack)
    if level == codec.LEVEL_5:
        assert [p.reason for p in got if isinstance(p, codec.Disconnect)] == [0x8D], got


def test_mqtt_3_1_1_a_keep_alive_over_the_cap_is_refused_and_counted(capped: BrokerProcess) -> None:
    """3.1.1 cannot be told another keep alive (it has no Server Keep Alive): asking more than
    --mqtt-max-keep-alive-s is refused with return code 0x02, as the common brokers do, and counted in
    ``lmq_mqtt_refused_total{reason="keep_alive"}``."""
    before = _refusals(capped)
    sock, _, connack = _connect(capped.mqtt_port, "ka-over", codec.LEVEL_3_1_1, keep_alive_s=60)
    sock.close()
    assert connack.code == ConnectCode.IDENTIFIER_REJECTED
    assert _refusals(capped) == before + 1


def _refusals(broker: BrokerProcess) -> float:
    with urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.search(rf'^lmq_mqtt_refused_total\{{reason="{stats.KEEP_ALIVE}"\}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0
