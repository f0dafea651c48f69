"""paho-mqtt speaking MQTT 5.0 to a broker process: properties through the store, reason codes where 3.1.1
could only close, session expiry, receive maximum, topic aliases, subscription options and will delay; 3.1.1
and 5.0 clients side by side on one listener."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

from paho.mqtt.enums import MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions
from testing_mqtt import Peer

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.mqtt import codec
from lmq_broker.mqtt.properties import NONE
from lmq_broker.mqtt.properties import Properties as PropertiesV
from lmq_broker.testing import BrokerProcess

Connect = Callable[..., Peer]
V5 = MQTTProtocolVersion.MQTTv5


def props(kind: int = PacketTypes.PUBLISH, **values: Any) -> Properties:
    p = Properties(kind)  # type: ignore[no-untyped-call]
    for name, value in values.items():
        setattr(p, name, value)
    return p


def v5(connect: Connect, port: int, client_id: str | None = None, **options: Any) -> Peer:
    return connect(port, client_id, protocol=V5, **options)


def test_the_connack_tells_the_limits_and_properties_travel_through_the_store(
    broker: BrokerProcess, parent: str, connect: Connect
) -> None:
    port = broker.mqtt_port
    sub = v5(connect, port)
    got = sub.connack_properties
    assert (got.ReceiveMaximum, got.TopicAliasMaximum) == (256, 64)
    # absent: both available (5.0 sections 3.2.2.3.12, 3.2.2.3.13)
    assert not hasattr(got, "SubscriptionIdentifierAvailable") and not hasattr(got, "SharedSubscriptionAvailable")
    assert got.MaximumPacketSize > 4 * 1024 * 1024
    old = connect(port)  # a 3.1.1 subscriber on the same listener gets the message, without properties
    assert sub.subscribe((f"{parent}/p/+", 1)) == [1]
    assert old.subscribe((f"{parent}/p/+", 1)) == [1]
    pub = v5(connect, port)
    sent = props(
        UserProperty=[("trace", "t-1"), ("tenant", "acme")],
        ContentType="application/json",
        PayloadFormatIndicator=1,
        ResponseTopic=f"{parent}/replies/1",
        CorrelationData=b"\x00\x01corr",
        MessageExpiryInterval=300,
    )
    assert pub.publish(f"{parent}/p/1", b'{"a": 1}', qos=1, properties=sent) == 0
    (m,) = sub.wait_count(1)
    assert (m.topic, m.payload) == (f"{parent}/p/1", b'{"a": 1}')
    p = m.properties
    assert p.UserProperty == [("trace", "t-1"), ("tenant", "acme")]
    assert (p.ContentType, p.PayloadFormatIndicator) == ("application/json", 1)
    assert (p.ResponseTopic, p.CorrelationData) == (f"{parent}/replies/1", b"\x00\x01corr")
    assert 295 <= p.MessageExpiryInterval <= 300  # what is left of it
    (m3,) = old.wait_count(1)
    assert (m3.payload, m3.properties) == (b'{"a": 1}', None)


def test_refusals_are_reason_codes_and_the_connection_stays(
    broker: BrokerProcess, parent: str, full_parent: str, connect: Connect
) -> None:
    port = broker.mqtt_port
    pub = v5(connect, port)
    assert pub.publish(f"{full_parent}/x", b"lost?") == 0x97  # quota exceeded
    assert pub.publish("no-such-parent/x", b"x") == 0  # every topic has a lite topic (the default parent's)
    assert pub.publish(f"{parent}/bad_level", b"x") == 0
    assert pub.publish(f"{parent}/empty", b"") == 0  # a zero-length payload is valid (section 3.3.3)
    assert pub.publish(f"{parent}/text", b"\xff\xfe", properties=props(PayloadFormatIndicator=1)) == 0x99
    assert pub.publish(f"{parent}/fine", b"stored") == 0
    assert not pub.disconnected
    sub = v5(connect, port)
    codes = sub.subscribe(("#", 1), ("no-such-parent/#", 1), (f"$share/+/{parent}/x", 1), (f"{parent}/ok", 2))
    assert codes == [1, 1, 0x8F, 2]  # QoS 2 is granted (3.9.3); a share name may not hold '+' (4.8.2)
    quiet = v5(connect, port)
    bad_text = props(PayloadFormatIndicator=1)
    quiet.client.publish(f"{parent}/x", b"\xff", qos=0, properties=bad_text)  # no answer to a QoS 0 publish
    quiet.wait(lambda p: p.disconnected, "the broker's DISCONNECT")
    assert quiet.disconnect_reason == 0x99


def test_a_parent_quota_refuses_with_quota_exceeded(broker: BrokerProcess, connect: Connect) -> None:
    parent = "Quota5"
    with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic(parent, model.MessageType.LITE, max_lite_topics=1))
    pub = v5(connect, broker.mqtt_port)
    assert pub.publish(f"{parent}/one", b"fits") == 0
    assert pub.publish(f"{parent}/two", b"a second lite topic") == 0x97
    assert pub.publish(f"{parent}/one", b"still fits") == 0


def test_session_expiry_keeps_the_session_for_its_interval_only(
    broker: BrokerProcess, parent: str, connect: Connect
) -> None:
    port = broker.mqtt_port
    pub = connect(port)
    expiring = props(PacketTypes.CONNECT, SessionExpiryInterval=2)
    first = v5(connect, port, "expiring-5", clean=True, properties=expiring)
    first.subscribe((f"{parent}/s", 1))
    first.disconnect()
    pub.publish(f"{parent}/s", b"while away")
    back = v5(connect, port, "expiring-5", clean=False, properties=expiring)
    assert back.connack == (True, "Success")
    assert [m.payload for m in back.wait_count(1)] == [b"while away"]
    back.disconnect()
    time.sleep(2.5)  # past the interval
    late = v5(connect, port, "expiring-5", clean=False, properties=expiring)
    assert late.connack == (False, "Success")
    late.disconnect()
    zero = v5(connect, port, "zero-5", clean=False)  # no interval: the session ends with the connection
    zero.subscribe((f"{parent}/s", 1))
    zero.disconnect()
    again = v5(connect, port, "zero-5", clean=False)
    assert again.connack == (False, "Success")


def test_the_receive_maximum_bounds_deliveries_waiting_for_pubacks(
    broker: BrokerProcess, parent: str, connect: Connect
) -> None:
    port = broker.mqtt_port
    sub = v5(connect, port, manual_ack=True, properties=props(PacketTypes.CONNECT, ReceiveMaximum=2))
    sub.subscribe((f"{parent}/rm/+", 1))
    pub = connect(port)
    for n in range(5):
        pub.publish(f"{parent}/rm/{n}", f"m{n}".encode())
    first = sub.wait_count(2)
    assert len(sub.quiet(1.0)) == 2  # two out, no PUBACK: nothing more
    for m in first:
        sub.client.ack(m.mid, m.qos)
    sub.wait_count(4)
    assert len(sub.quiet(0.5)) == 4
    for m in sub.messages()[2:]:
        sub.client.ack(m.mid, m.qos)
    assert sorted(m.payload for m in sub.wait_count(5)) == [b"m0", b"m1", b"m2", b"m3", b"m4"]


def test_topic_aliases_name_the_topic_of_later_publishes(broker: BrokerProcess, parent: str, connect: Connect) -> None:
    port = broker.mqtt_port
    sub = connect(port)
    sub.subscribe((f"{parent}/alias/#", 1))
    pub = v5(connect, port)
    assert pub.publish(f"{parent}/alias/a", b"1", properties=props(TopicAlias=3)) == 0
    assert pub.publish("", b"2", properties=props(TopicAlias=3)) == 0
    assert [(m.topic, m.payload) for m in sub.wait_count(2)] == [
        (f"{parent}/alias/a", b"1"),
        (f"{parent}/alias/a", b"2"),
    ]
    bad = v5(connect, port)
    bad.client.publish(f"{parent}/alias/b", b"x", qos=1, properties=props(TopicAlias=65))
    bad.wait(lambda p: p.disconnected, "the broker's DISCONNECT")
    assert bad.disconnect_reason == 0x94  # over the topic alias maximum


def test_subscription_options_no_local_retain_as_published_and_retain_handling(
    broker: BrokerProcess, parent: str, connect: Connect
) -> None:
    port = broker.mqtt_port
    me = v5(connect, port)
    assert me.subscribe((f"{parent}/o/+", SubscribeOptions(qos=1, noLocal=True))) == [1]
    keep = v5(connect, port)
    assert keep.subscribe((f"{parent}/o/+", SubscribeOptions(qos=1, retainAsPublished=True))) == [1]
    other = connect(port)
    me.publish(f"{parent}/o/mine", b"from me", retain=True)
    other.publish(f"{parent}/o/theirs", b"from another")
    assert [m.payload for m in me.wait_count(1)] == [b"from another"]
    assert [(m.payload, m.retain) for m in keep.wait_count(2)] == [(b"from me", True), (b"from another", False)]
    assert len(me.quiet(0.5)) == 1
    never = v5(connect, port)
    never.subscribe((f"{parent}/o/mine", SubscribeOptions(qos=1, retainHandling=2)))
    once = v5(connect, port)
    once.subscribe((f"{parent}/o/mine", SubscribeOptions(qos=1, retainHandling=1)))
    assert [(m.payload, m.retain) for m in once.wait_count(1)] == [(b"from me", True)]
    once.subscribe((f"{parent}/o/mine", SubscribeOptions(qos=1, retainHandling=1)))  # it exists: none again
    assert len(once.quiet(0.5)) == 1
    assert never.messages() == []


def test_a_packet_over_the_clients_maximum_size_is_not_sent(
    broker: BrokerProcess, parent: str, connect: Connect
) -> None:
    port = broker.mqtt_port
    small = v5(connect, port, properties=props(PacketTypes.CONNECT, MaximumPacketSize=128))
    small.subscribe((f"{parent}/big/+", 1))
    pub = connect(port)
    pub.publish(f"{parent}/big/1", b"x" * 200)
    pub.publish(f"{parent}/big/2", b"small")
    assert [m.payload for m in small.wait_count(1)] == [b"small"]
    assert len(small.quiet(0.5)) == 1


def test_will_delay_and_disconnect_with_will(broker: BrokerProcess, parent: str, connect: Connect) -> None:
    port = broker.mqtt_port
    watcher = connect(port)
    watcher.subscribe((f"{parent}/will/+", 1))
    session = props(PacketTypes.CONNECT, SessionExpiryInterval=60)
    after_2s = props(PacketTypes.WILLMESSAGE, WillDelayInterval=2)
    delayed = v5(connect, port, "delayed-5", keepalive=1, properties=session,
                 will=(f"{parent}/will/delayed", b"gone for good", 1, False, after_2s))  # fmt: skip
    delayed.vanish()  # the broker gives up after 1.5 s; the will waits 2 s more
    time.sleep(2.0)
    assert watcher.messages() == []
    (will,) = watcher.wait_count(1, timeout=10)
    assert (will.topic, will.payload) == (f"{parent}/will/delayed", b"gone for good")
    after_4s = props(PacketTypes.WILLMESSAGE, WillDelayInterval=4)
    back_soon = v5(connect, port, "back-5", keepalive=1, properties=session,
                   will=(f"{parent}/will/back", b"never", 1, False, after_4s))  # fmt: skip
    back_soon.vanish()
    time.sleep(2.0)
    v5(connect, port, "back-5", clean=False, properties=session)  # the session is back before the delay
    polite = v5(connect, port, will=(f"{parent}/will/asked", b"asked for", 1, False))
    polite.client.disconnect(ReasonCode(PacketTypes.DISCONNECT, "Disconnect with will message"))
    assert [m.payload for m in watcher.wait_count(2)][1] == b"asked for"
    assert len(watcher.quiet(3.0)) == 2  # "never" stayed unsent


def test_a_message_past_its_expiry_is_not_delivered(broker: BrokerProcess, parent: str, connect: Connect) -> None:
    port = broker.mqtt_port
    session = props(PacketTypes.CONNECT, SessionExpiryInterval=60)
    away = v5(connect, port, "expiry-5", properties=session)
    away.subscribe((f"{parent}/e", 1))
    away.disconnect()
    pub = v5(connect, port)
    pub.publish(f"{parent}/e", b"short-lived", properties=props(MessageExpiryInterval=1))
    pub.publish(f"{parent}/e", b"lasting")
    time.sleep(1.5)
    back = v5(connect, port, "expiry-5", clean=False, properties=session)
    assert back.connack == (True, "Success")
    assert [m.payload for m in back.wait_count(1)] == [b"lasting"]
    assert len(back.quiet(0.5)) == 1


class Raw:
    """A socket speaking bytes built by our codec: for what no well-behaved client sends."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.decoder = codec.Decoder(level=codec.LEVEL_5)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def packets(self) -> list[codec.Packet]:
        """Everything until the broker closes the connection."""
        out: list[codec.Packet] = []
        while data := self.sock.recv(65536):
            out += self.decoder.feed(data)
        self.sock.close()
        return out

    def close(self) -> None:
        self.sock.close()

    def connect(self, client_id: str, p: PropertiesV = NONE) -> codec.ConnAck:
        self.send(codec.encode(codec.Connect(client_id, True, 30, level=codec.LEVEL_5, properties=p)))
        while not (got := self.decoder.feed(self.sock.recv(65536))):
            pass
        (connack,) = got
        assert isinstance(connack, codec.ConnAck)
        return connack


def test_protocol_breaches_get_a_disconnect_with_their_reason_code(broker: BrokerProcess, parent: str) -> None:
    port = broker.mqtt_port
    topic = codec.encode(codec.Publish(f"{parent}/x", b"", properties=NONE))[2:-1]  # its length-prefixed name
    twice = b"\x0a" + b"\x02\x00\x00\x00\x01" * 2  # message expiry, twice
    duplicated = bytes((0x30, len(topic) + len(twice) + 1)) + topic + twice + b"x"
    cases = [
        (duplicated, 0x82),  # message expiry twice
        (bytes((0x30, 5, 0, 1, ord("t"), 1, 0x11)), 0x81),  # a property section cut short
        (codec.encode(codec.Auth()), 0x82),  # AUTH without an authentication method
        (codec.encode(codec.Connect("again", level=codec.LEVEL_5, properties=NONE)), 0x82),  # a second CONNECT
        (codec.encode(codec.Publish("", b"x", properties=PropertiesV(topic_alias=9))), 0x82),  # an alias never set
        # no local on a shared subscription (5.0 section 3.8.3.1, MQTT-3.8.3-4)
        (codec.encode(codec.Subscribe(1, ((f"$share/g/{parent}/x", 1 | codec.OPTION_NO_LOCAL),), NONE)), 0x82),
    ]
    for n, (data, code) in enumerate(cases):
        raw = Raw(port)
        assert raw.connect(f"raw-{n}").code == 0
        raw.send(data)
        got = raw.packets()
        assert got and isinstance(got[-1], codec.Disconnect), (n, got)
        assert got[-1].reason == code, (n, got[-1])
    assert "Traceback" not in broker.log()


def test_a_connect_the_broker_refuses_gets_a_connack_with_the_reason(broker: BrokerProcess) -> None:
    port = broker.mqtt_port
    enhanced = Raw(port)
    assert enhanced.connect("auth", PropertiesV(auth_method="SCRAM-SHA-1")).code == 0x8C  # bad authentication method
    enhanced.close()
    bad = Raw(port)
    bad.send(bytes((0x10, 16)) + b"\x00\x04MQTT\x05\x02\x00\x3c\x03\x21\x00\x00\x00\x01c")  # receive maximum 0
    (connack,) = bad.packets()
    assert isinstance(connack, codec.ConnAck) and connack.code == 0x82
    anonymous = Raw(port)
    assigned = anonymous.connect("").properties
    anonymous.close()
    assert assigned is not None and (assigned.assigned_client_id or "").startswith("auto-")
