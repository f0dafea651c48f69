"""Shared subscriptions (MQTT 5.0 section 4.8.2; taken from 3.1.1 clients too, as common brokers do) and
subscription identifiers (5.0 sections 3.8.2.1.2, 3.3.2.3.8), with paho-mqtt against a broker process."""

from __future__ import annotations

import functools
import re
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from paho.mqtt.enums import MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from testing_mqtt import Peer, Received

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.testing import BrokerProcess, start_broker

Connect = Callable[..., Peer]
V5 = MQTTProtocolVersion.MQTTv5
V311 = MQTTProtocolVersion.MQTTv311
PROTOCOLS = pytest.mark.parametrize("protocol", [V5, V311], ids=["5.0", "3.1.1"])


def ids(**values: Any) -> Properties:
    p = Properties(PacketTypes.SUBSCRIBE)  # type: ignore[no-untyped-call]
    for name, value in values.items():
        setattr(p, name, value)
    return p


def sub_ids(m: Received) -> list[int]:
    found: list[int] = getattr(m.properties, "SubscriptionIdentifier", []) if m.properties is not None else []
    return sorted(found)


def kill(peer: Peer) -> None:
    """The client's process dies: its socket closes without DISCONNECT, nothing it holds is acknowledged."""
    peer.client.loop_stop()
    sock = peer.client.socket()
    assert sock is not None
    sock.close()


@PROTOCOLS
def test_mqtt5_4_8_2_each_message_goes_to_one_member_of_a_share(
    broker: BrokerProcess, parent: str, connect: Connect, protocol: MQTTProtocolVersion
) -> None:
    """Section 4.8.2: a message matching a shared subscription goes to one of its sessions; a non-shared
    subscription to the same topics still gets every message, and a share of another name is another share."""
    port = broker.mqtt_port
    a, b = connect(port, protocol=protocol), connect(port, protocol=protocol)
    other, plain = connect(port, protocol=protocol), connect(port, protocol=protocol)
    assert a.subscribe((f"$share/work/{parent}/job/+", 1)) == [1]
    assert b.subscribe((f"$share/work/{parent}/job/+", 1)) == [1]
    assert other.subscribe((f"$share/audit/{parent}/job/+", 1)) == [1]
    assert plain.subscribe((f"{parent}/job/+", 1)) == [1]
    pub = connect(port)
    sent = {(f"{parent}/job/{n % 4}", f"m{n}".encode()) for n in range(40)}
    for topic, payload in sorted(sent):
        pub.publish(topic, payload)
    a.wait(lambda _: len(a.messages()) + len(b.messages()) >= 40, "40 messages between the members")
    got_a, got_b = [(m.topic, m.payload) for m in a.quiet()], [(m.topic, m.payload) for m in b.messages()]
    assert not set(got_a) & set(got_b), "a message went to both members"
    assert sorted(got_a + got_b) == sorted(sent)  # each once, under its own topic name (no $share prefix)
    assert sorted((m.topic, m.payload) for m in other.wait_count(40)) == sorted(sent)
    assert sorted((m.topic, m.payload) for m in plain.wait_count(40)) == sorted(sent)


@PROTOCOLS
def test_mqtt5_4_8_2_an_unacknowledged_message_goes_to_another_member_when_its_member_dies(
    broker: BrokerProcess, parent: str, connect: Connect, protocol: MQTTProtocolVersion
) -> None:
    """Section 4.8.2: a QoS 1 message sent to a member whose session ends before the PUBACK may be sent to
    another member; while the first is connected (and holds it unacknowledged) the others do not get it."""
    port = broker.mqtt_port
    share = f"$share/workers/{parent}/task/+"
    holder = connect(port, protocol=protocol, manual_ack=True)  # never acknowledges
    assert holder.subscribe((share, 1)) == [1]
    pub = connect(port)
    pub.publish(f"{parent}/task/1", b"the job")
    assert [m.payload for m in holder.wait_count(1)] == [b"the job"]
    other = connect(port, protocol=protocol)
    assert other.subscribe((share, 1)) == [1]  # joins a share with a member: its offsets, no start at the end
    assert other.quiet(1.0) == []  # leased to the holder, which is connected: not sent twice
    kill(holder)
    got = other.wait_count(1)
    assert [(m.topic, m.payload, m.qos) for m in got] == [(f"{parent}/task/1", b"the job", 1)]
    assert got[0].dup  # sent before (MQTT-3.3.1-1 allows DUP on a resend to another session)
    pub.publish(f"{parent}/task/2", b"next")
    assert [m.payload for m in other.wait_count(2)] == [b"the job", b"next"]


@PROTOCOLS
def test_mqtt5_4_8_2_shares_follow_the_topic_space_of_ordinary_filters(
    broker: BrokerProcess, parent: str, connect: Connect, protocol: MQTTProtocolVersion
) -> None:
    """Section 4.8.2 with 4.7: a share's filter is any topic filter, as an ordinary subscription's: a first level
    naming no parent (the default parent's topics), a first-level '+' or '#' reaching every parent. Each share
    gets each message it matches once, across its two members."""
    port = broker.mqtt_port
    tag = f"space{protocol.value}"
    topics = [f"{tag}/room1/temp", tag, f"{parent}/{tag}", f"x/{tag}"]
    shares = {f"$share/g/{tag}/#": topics[:2], f"$share/h/+/{tag}": topics[2:], "$share/k/#": topics}
    pairs: dict[str, tuple[Peer, ...]] = {}
    for share in shares:
        pairs[share] = (connect(port, protocol=protocol), connect(port, protocol=protocol))
        assert [member.subscribe((share, 1)) for member in pairs[share]] == [[1], [1]]
    pub = connect(port)
    for topic in topics:
        for n in range(3):
            pub.publish(topic, f"{topic}-{n}".encode())
    for share, matched in shares.items():
        members = pairs[share]
        expected = sorted((t, f"{t}-{n}".encode()) for t in matched for n in range(3))
        members[0].wait(functools.partial(received_all, members, topics, len(expected)), f"{share}: all")
        members[0].quiet()
        assert sorted(got(members, topics)) == expected, share


def received_all(members: tuple[Peer, ...], topics: list[str], count: int, _: Peer) -> bool:
    return len(got(members, topics)) >= count


def got(members: tuple[Peer, ...], topics: list[str]) -> list[tuple[str, bytes]]:
    """What ``members`` received of ``topics`` (messages the other tests published on the broker left out)."""
    return [(m.topic, m.payload) for peer in members for m in peer.messages() if m.topic in topics]


@PROTOCOLS
def test_mqtt5_4_8_2_no_retained_messages_for_a_shared_subscription(
    broker: BrokerProcess, parent: str, connect: Connect, protocol: MQTTProtocolVersion
) -> None:
    """Section 4.8.2 / 3.3.1.3: retained messages are not sent to a session for its shared subscription."""
    port = broker.mqtt_port
    pub = connect(port)
    pub.publish(f"{parent}/state/x", b"retained", retain=True)
    plain, member = connect(port, protocol=protocol), connect(port, protocol=protocol)
    assert plain.subscribe((f"{parent}/state/+", 1)) == [1]
    assert [(m.payload, m.retain) for m in plain.wait_count(1)] == [(b"retained", True)]
    assert member.subscribe((f"$share/s/{parent}/state/+", 1)) == [1]
    pub.publish(f"{parent}/state/x", b"live")
    assert [(m.payload, m.retain) for m in member.wait_count(1)] == [(b"live", False)]
    assert len(member.quiet()) == 1


def test_mqtt5_4_8_2_invalid_share_names_and_unsubscribe_codes(
    broker: BrokerProcess, parent: str, connect: Connect
) -> None:
    """MQTT-4.8.2-1/-2: a ShareName is one or more characters without '/', '+', '#', followed by '/' and a
    filter: else SUBACK 0x8F (5.0, section 3.9.3) / 0x80 (3.1.1). UNSUBACK (5.0 section 3.11.3): 0x00 for a
    share held, 0x11 for one not held."""
    port = broker.mqtt_port
    bad = ["$share//x", f"$share/+/{parent}/x", "$share/#", "$share/g", "$share/g/"]  # $share/g/nope/x: default parent
    v5, v311 = connect(port, protocol=V5), connect(port)
    assert v5.subscribe(*[(f, 1) for f in bad]) == [0x8F] * len(bad)
    assert v311.subscribe(*[(f, 1) for f in bad]) == [0x80] * len(bad)
    assert v5.subscribe((f"$share/g/{parent}/u", 1)) == [1]
    codes: list[int] = []
    done = v5.changed

    def on_unsubscribe(_c: Any, _u: Any, _mid: int, reasons: list[Any], _p: Any) -> None:
        with done:
            codes.extend(r.value for r in reasons)
            done.notify_all()

    v5.client.on_unsubscribe = on_unsubscribe
    v5.client.unsubscribe([f"$share/g/{parent}/u", f"$share/h/{parent}/u"])
    v5.wait(lambda _: len(codes) == 2, "UNSUBACK")
    assert codes == [0x00, 0x11]


def test_mqtt5_3_8_2_1_2_subscription_identifiers_are_sent_with_each_matching_publish(
    broker: BrokerProcess, parent: str, connect: Connect
) -> None:
    """Sections 3.8.2.1.2 and 3.3.2.3.8: a PUBLISH carries the identifiers of every subscription it matched
    (one property each), none for a subscription without; retained and shared deliveries too."""
    port = broker.mqtt_port
    pub = connect(port)
    pub.publish(f"{parent}/id/r", b"kept", retain=True)
    sub = connect(port, protocol=V5)
    assert sub.subscribe((f"{parent}/id/+", 1), properties=ids(SubscriptionIdentifier=7)) == [1]
    assert [(m.payload, m.retain, sub_ids(m)) for m in sub.wait_count(1)] == [(b"kept", True, [7])]
    assert sub.subscribe((f"{parent}/id/x", 1), properties=ids(SubscriptionIdentifier=268_435_455)) == [1]
    assert sub.subscribe((f"{parent}/id/x/#", 1)) == [1]  # no identifier: adds none
    assert sub.subscribe((f"$share/ids/{parent}/id/s", 1), properties=ids(SubscriptionIdentifier=9)) == [1]
    pub.publish(f"{parent}/id/x", b"both")
    pub.publish(f"{parent}/id/y", b"one")
    pub.publish(f"{parent}/id/s", b"shared")
    got = sorted((m.payload, sub_ids(m)) for m in sub.wait_count(5)[1:])
    # the shared subscription's copy is a delivery of its own (section 4.8.2), with its own identifier
    assert got == [(b"both", [7, 268_435_455]), (b"one", [7]), (b"shared", [7]), (b"shared", [9])]
    assert len(sub.quiet()) == 5


def test_mqtt5_3_8_2_1_2_a_persistent_session_keeps_its_subscription_identifiers(
    broker: BrokerProcess, parent: str, connect: Connect
) -> None:
    """Section 3.8.2.1.2: the identifier is part of the subscription, so a resumed session (section 4.1) sends
    it on what it gets after the reconnect; a SUBSCRIBE without one replaces it by none (3.8.4)."""
    port = broker.mqtt_port
    expiry = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    expiry.SessionExpiryInterval = 300
    away = connect(port, "ids-away", protocol=V5, clean=False, properties=expiry)
    assert away.subscribe((f"{parent}/back/+", 1), properties=ids(SubscriptionIdentifier=42)) == [1]
    assert away.subscribe((f"$share/back/{parent}/back/s", 1), properties=ids(SubscriptionIdentifier=43)) == [1]
    away.disconnect()
    pub = connect(port)
    pub.publish(f"{parent}/back/x", b"while away")
    back = connect(port, "ids-away", protocol=V5, clean=False, properties=expiry)
    assert back.connack is not None and back.connack[0]  # session present
    got = back.wait_count(1)
    assert [(m.payload, sub_ids(m)) for m in got] == [(b"while away", [42])]
    pub.publish(f"{parent}/back/s", b"to the share")  # one copy for the subscription, one for the share
    assert sorted(sub_ids(m) for m in back.wait_count(3)[1:]) == [[42], [43]]
    assert back.subscribe((f"{parent}/back/+", 1)) == [1]  # replaced: no identifier now
    pub.publish(f"{parent}/back/y", b"after")
    assert [(m.payload, sub_ids(m)) for m in back.wait_count(4)[3:]] == [(b"after", [])]


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    flags = ["--mqtt-port", "0", "--mqtt-max-shares-per-client", "1", "--mqtt-max-share-members", "2"]
    process = start_broker(Path(tmp_path_factory.mktemp("shares")) / "data", extra_args=flags)
    with AdminClient(process.admin_endpoint, timeout_s=10, **process.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic("Capped", model.MessageType.LITE))
    yield process
    assert process.stop() == 0, process.log()[-4000:]


def refused(broker: BrokerProcess, reason: str) -> float:
    with urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.search(rf'^lmq_mqtt_refused_total\{{reason="{reason}"\}} (\S+)$', text, re.MULTILINE)
    assert found is not None, f"lmq_mqtt_refused_total{{{reason}}} not exported"
    return float(found.group(1))


def test_the_share_caps_refuse_in_the_suback_and_are_counted(capped: BrokerProcess, connect: Connect) -> None:
    """--mqtt-max-shares-per-client and --mqtt-max-share-members: SUBACK 0x97 quota exceeded (5.0, section
    3.9.3) / 0x80 (3.1.1), counted in lmq_mqtt_refused_total{reason}; the same share again is no new share."""
    port = capped.mqtt_port
    one = connect(port, protocol=V5)
    assert one.subscribe(("$share/a/Capped/x", 1)) == [1]
    assert one.subscribe(("$share/a/Capped/x", 0)) == [0]  # the same share: updated, not a second one
    assert one.subscribe(("$share/b/Capped/x", 1)) == [0x97]
    assert connect(port).subscribe(("$share/a/Capped/x", 1)) == [1]  # the share's second member
    assert connect(port, protocol=V5).subscribe(("$share/a/Capped/x", 1)) == [0x97]
    assert connect(port).subscribe(("$share/a/Capped/x", 1)) == [0x80]
    assert refused(capped, "shares_per_client") == 1
    assert refused(capped, "share_members") == 2


def test_mqtt5_3_8_2_1_2_identifiers_and_shares_of_a_persistent_session_survive_a_broker_restart(
    tmp_path: Path, connect: Connect, parent_topic: Callable[[BrokerProcess], str]
) -> None:
    """Section 4.1 (session state: the subscriptions) with section 3.8.2.1.2: after a broker restart the resumed
    session's subscription and its share still carry their identifiers; the share delivers what was published
    to it while its only member was away (its group's offsets, not a start at the end)."""
    broker = start_broker(tmp_path / "data", extra_args=["--mqtt-port", "0"])
    try:
        parent = parent_topic(broker)
        port = broker.mqtt_port
        expiry = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        expiry.SessionExpiryInterval = 3600
        away = connect(port, "ids-restart", protocol=V5, clean=False, properties=expiry)
        assert away.subscribe((f"{parent}/r/own", 1), properties=ids(SubscriptionIdentifier=11)) == [1]
        assert away.subscribe((f"$share/r/{parent}/r/pool", 1), properties=ids(SubscriptionIdentifier=12)) == [1]
        away.disconnect()
        pub = connect(port)
        pub.publish(f"{parent}/r/pool", b"queued for the share")
        pub.disconnect()
        broker = broker.restart()
        back = connect(port, "ids-restart", protocol=V5, clean=False, properties=expiry)
        assert back.connack is not None and back.connack[0]
        assert [(m.payload, sub_ids(m)) for m in back.wait_count(1)] == [(b"queued for the share", [12])]
        connect(port).publish(f"{parent}/r/own", b"own")
        assert [(m.payload, sub_ids(m)) for m in back.wait_count(2)[1:]] == [(b"own", [11])]
    finally:
        broker.stop()
