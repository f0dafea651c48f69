"""paho-mqtt (a real MQTT 3.1.1 client) against a broker process: topics and filters, QoS, sessions,
retained messages and wills, all through the broker's store, ready set and offsets."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from testing_mqtt import Peer

from lmq_broker.admin.client import AdminClient
from lmq_broker.testing import BrokerProcess, start_broker

Connect = Callable[..., Peer]


def test_a_publish_reaches_exact_and_wildcard_subscribers_in_order(
    broker: BrokerProcess, parent: str, connect: Connect
) -> None:
    port = broker.mqtt_port
    exact, one, many = connect(port), connect(port), connect(port)
    assert exact.subscribe((f"{parent}/dev-1/cmd", 1)) == [1]
    assert one.subscribe((f"{parent}/+/cmd", 1)) == [1]
    assert many.subscribe((f"{parent}/dev-1/#", 1)) == [1]
    pub = connect(port)
    sent = [
        (f"{parent}/dev-1/cmd", b"1"),
        (f"{parent}/dev-2/cmd", b"2"),
        (f"{parent}/dev-1/cmd/x", b"3"),
        (f"{parent}/dev-1", b"4"),
        (f"{parent}/other", b"5"),
        (f"{parent}/dev-1/cmd", b"6"),
    ]
    for topic, payload in sent:
        pub.publish(topic, payload)
    assert [(m.topic, m.payload) for m in exact.wait_count(2)] == [sent[0], sent[5]]
    assert sorted((m.topic, m.payload) for m in one.wait_count(3)) == sorted([sent[0], sent[1], sent[5]])
    assert [(m.topic, m.payload) for m in many.wait_count(4) if m.topic.endswith("/cmd")] == [sent[0], sent[5]]
    assert sorted(m.payload for m in many.messages()) == [b"1", b"3", b"4", b"6"]
    assert len(exact.quiet()) == 2 and len(one.messages()) == 3 and len(many.messages()) == 4
    with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
        described = admin.describe_lite_topic(parent, "dev-1_cmd")  # the lite topic behind parent/dev-1/cmd
    assert described.meta.max_offset == 2


def test_qos_is_the_lower_of_the_publish_and_the_subscription(
    broker: BrokerProcess, parent: str, connect: Connect
) -> None:
    """3.1.1 section 3.8.4 (granted QoS) and 3.3.5: a message goes out at the lower of its publish QoS and the
    subscription's granted QoS; a QoS 2 subscription is granted QoS 2."""
    port = broker.mqtt_port
    at0, at1, at2 = connect(port), connect(port), connect(port)
    assert at0.subscribe((f"{parent}/q", 0)) == [0]
    assert at1.subscribe((f"{parent}/q", 1)) == [1]
    assert at2.subscribe((f"{parent}/q", 2)) == [2]
    pub = connect(port)
    pub.publish(f"{parent}/q", b"sent at 1", qos=1)
    pub.publish(f"{parent}/q", b"sent at 0", qos=0)
    pub.publish(f"{parent}/q", b"sent at 2", qos=2)  # stored once, answered PUBREC/PUBCOMP
    assert [(m.payload, m.qos) for m in at0.wait_count(3)] == [(b"sent at 1", 0), (b"sent at 0", 0), (b"sent at 2", 0)]
    assert [(m.payload, m.qos) for m in at1.wait_count(3)] == [(b"sent at 1", 1), (b"sent at 0", 0), (b"sent at 2", 1)]
    assert [(m.payload, m.qos) for m in at2.wait_count(3)] == [(b"sent at 1", 1), (b"sent at 0", 0), (b"sent at 2", 2)]
    assert len(at1.quiet()) == 3 and len(at2.quiet()) == 3


def test_a_new_subscription_starts_after_what_was_published_before_it(
    broker: BrokerProcess, parent: str, connect: Connect
) -> None:
    port = broker.mqtt_port
    pub = connect(port)
    pub.publish(f"{parent}/old/a", b"history")
    pub.publish(f"{parent}/old/b", b"history")
    sub = connect(port)
    sub.subscribe((f"{parent}/old/+", 1))
    pub.publish(f"{parent}/old/a", b"new")
    assert [m.payload for m in sub.wait_count(1)] == [b"new"]
    assert sub.quiet() == sub.messages()[:1]


def test_every_filter_is_granted_and_a_refused_publish_closes_the_connection(
    broker: BrokerProcess, parent: str, full_parent: str, connect: Connect
) -> None:
    port = broker.mqtt_port
    sub = connect(port)
    assert sub.subscribe(("#", 1), ("+/x", 1), ("no-such-parent/#", 1), (f"{parent}/ok", 1)) == [1, 1, 1, 1]
    bad = connect(port)
    bad.client.publish(f"{full_parent}/x", b"lost?", qos=1)  # its quota refuses it
    bad.wait(lambda p: p.disconnected, "the broker closing the connection")  # 3.1.1 has no negative PUBACK


def test_qos1_unacknowledged_is_delivered_again_with_dup_to_the_resumed_session(
    broker: BrokerProcess, parent: str, connect: Connect
) -> None:
    port = broker.mqtt_port
    first = connect(port, "resume-1", clean=False, manual_ack=True)
    first.subscribe((f"{parent}/job", 1))
    connect(port).publish(f"{parent}/job", b"do it")
    (got,) = first.wait_count(1)
    assert (got.payload, got.dup) == (b"do it", False)
    first.disconnect()  # no PUBACK sent
    again = connect(port, "resume-1", clean=False)
    assert again.connack == (True, "Success")
    (redelivered,) = again.wait_count(1)  # no SUBSCRIBE: the session kept it
    assert (redelivered.payload, redelivered.dup, redelivered.qos) == (b"do it", True, 1)
    again.disconnect()
    third = connect(port, "resume-1", clean=False)
    assert third.quiet(1.0) == []  # acknowledged by the second connection: settled


def test_a_clean_session_drops_what_the_persistent_one_held(
    broker: BrokerProcess, parent: str, connect: Connect
) -> None:
    port = broker.mqtt_port
    durable = connect(port, "clean-1", clean=False)
    durable.subscribe((f"{parent}/c", 1))
    durable.disconnect()
    pub = connect(port)
    pub.publish(f"{parent}/c", b"while away")
    clean = connect(port, "clean-1", clean=True)
    assert clean.connack == (False, "Success")
    pub.publish(f"{parent}/c", b"not subscribed")
    assert clean.quiet(1.0) == []
    clean.disconnect()
    back = connect(port, "clean-1", clean=False)
    assert back.connack == (False, "Success")  # the clean session ended the stored one


def test_retained_messages_are_delivered_on_subscribe_and_cleared_by_an_empty_one(
    broker: BrokerProcess, parent: str, connect: Connect
) -> None:
    port = broker.mqtt_port
    pub = connect(port)
    live = connect(port)
    live.subscribe((f"{parent}/state/#", 1))
    pub.publish(f"{parent}/state/a", b"a1", retain=True)
    pub.publish(f"{parent}/state/a", b"a2", retain=True)
    pub.publish(f"{parent}/state/b", b"b1", qos=0, retain=True)
    assert [(m.payload, m.retain) for m in live.wait_count(3)] == [(b"a1", False), (b"a2", False), (b"b1", False)]
    late = connect(port)
    late.subscribe((f"{parent}/state/+", 1))
    got = sorted((m.topic, m.payload, m.retain, m.qos) for m in late.wait_count(2))
    assert got == [(f"{parent}/state/a", b"a2", True, 1), (f"{parent}/state/b", b"b1", True, 0)]
    pub.publish(f"{parent}/state/a", b"", retain=True)
    later = connect(port)
    later.subscribe((f"{parent}/state/+", 1))
    assert [(m.payload, m.retain) for m in later.wait_count(1)] == [(b"b1", True)]
    assert len(later.quiet()) == 1
    assert len(live.quiet()) == 3  # the empty retained message is not a message


def test_one_subscribe_over_parents_with_and_without_retained_messages_gets_each_filters_own(
    broker: BrokerProcess, parent: str, connect: Connect, parent_topic: Callable[[BrokerProcess], str]
) -> None:
    """The SUBSCRIBE looks once per parent whether it holds retained messages: filters in a parent holding none
    send none, those in one holding some send theirs (here in one SUBSCRIBE, listed after and before)."""
    port = broker.mqtt_port
    empty = parent_topic(broker)
    pub = connect(port)
    pub.publish(f"{parent}/room/a", b"a", retain=True)
    pub.publish(f"{empty}/room/a", b"not retained")
    pub.publish(f"{parent}/room/b", b"b", retain=True)
    late = connect(port)
    wanted = [(f"{empty}/+/a", 1), (f"{parent}/+/a", 1), (f"{empty}/room/#", 1), (f"{parent}/room/b", 1)]
    assert late.subscribe(*wanted) == [1, 1, 1, 1]
    got = sorted((m.topic, m.payload, m.retain) for m in late.wait_count(2))
    assert got == [(f"{parent}/room/a", b"a", True), (f"{parent}/room/b", b"b", True)]
    assert len(late.quiet()) == 2


def test_a_will_is_published_when_a_client_vanishes_not_when_it_disconnects(
    broker: BrokerProcess, parent: str, connect: Connect
) -> None:
    port = broker.mqtt_port
    watcher = connect(port)
    watcher.subscribe((f"{parent}/status/+", 1))
    polite = connect(port, will=(f"{parent}/status/polite", b"gone", 1, False))
    polite.disconnect()
    lost = connect(port, keepalive=1, will=(f"{parent}/status/lost", b"lost", 1, True))
    lost.vanish()  # no PINGREQ any more: the broker gives up after 1.5 s
    (will,) = watcher.wait_count(1, timeout=10)
    assert (will.topic, will.payload) == (f"{parent}/status/lost", b"lost")
    assert watcher.quiet() == [will]
    late = connect(port)
    late.subscribe((f"{parent}/status/lost", 1))
    assert [(m.payload, m.retain) for m in late.wait_count(1)] == [(b"lost", True)]  # will retain flag


def test_a_second_connection_with_the_same_client_id_takes_over(
    broker: BrokerProcess, parent: str, connect: Connect
) -> None:
    port = broker.mqtt_port
    old = connect(port, "twin", clean=False)
    old.subscribe((f"{parent}/t", 1))
    new = connect(port, "twin", clean=False)
    old.wait(lambda p: p.disconnected, "the older connection closed")
    assert new.connack == (True, "Success")
    connect(port).publish(f"{parent}/t", b"for the new one")
    assert [m.payload for m in new.wait_count(1)] == [b"for the new one"]


def test_with_client_auth_the_access_key_pair_is_the_user_name_and_password(tmp_path: Path, connect: Connect) -> None:
    args = ["--mqtt-port", "0", "--access-key", "ak", "--secret-key", "sk"]
    with start_broker(tmp_path / "data", extra_args=args) as secured:
        anonymous = connect(secured.mqtt_port)
        assert anonymous.connack == (False, "Not authorized")
        wrong = connect(secured.mqtt_port, auth=("ak", "nope"))
        assert wrong.connack == (False, "Bad user name or password")
        right = connect(secured.mqtt_port, auth=("ak", "sk"))
        assert right.accepted
        right.disconnect()


def test_a_persistent_session_and_retained_messages_survive_a_broker_restart(
    tmp_path: Path, connect: Connect, parent_topic: Callable[[BrokerProcess], str]
) -> None:
    broker = start_broker(tmp_path / "data", extra_args=["--mqtt-port", "0"])
    try:
        parent = parent_topic(broker)
        port = broker.mqtt_port
        sub = connect(port, "survivor", clean=False)
        sub.subscribe((f"{parent}/jobs/#", 1))
        pub = connect(port)
        pub.publish(f"{parent}/jobs/1", b"before")
        assert [m.payload for m in sub.wait_count(1)] == [b"before"]
        time.sleep(0.3)  # its PUBACK reaches the broker
        sub.disconnect()
        for n in range(3):
            pub.publish(f"{parent}/jobs/{n}", f"while away {n}".encode())
        pub.publish(f"{parent}/config", b"kept", retain=True)
        pub.disconnect()
        broker = broker.restart()
        assert broker.mqtt_port == port
        back = connect(port, "survivor", clean=False)
        assert back.connack == (True, "Success")
        got = back.wait_count(3)
        assert sorted(m.payload for m in got) == [b"while away 0", b"while away 1", b"while away 2"]
        assert back.quiet() == got  # "before" was acknowledged before the restart
        fresh = connect(port)
        fresh.subscribe((f"{parent}/config", 1))
        assert [(m.payload, m.retain) for m in fresh.wait_count(1)] == [(b"kept", True)]
    finally:
        broker.stop()


def test_after_a_crash_a_persistent_session_gets_what_it_had_not_acknowledged(
    tmp_path: Path, connect: Connect, parent_topic: Callable[[BrokerProcess], str]
) -> None:
    """SIGKILL while a QoS 1 message is out without PUBACK: the leases die with the process, the offsets
    committed by PUBACKs survive, so exactly the unacknowledged message comes again."""
    broker = start_broker(tmp_path / "data", extra_args=["--mqtt-port", "0"])
    try:
        parent = parent_topic(broker)
        port = broker.mqtt_port
        sub = connect(port, "crashy", clean=False, manual_ack=True)
        sub.subscribe((f"{parent}/w", 1))
        pub = connect(port)
        pub.publish(f"{parent}/w", b"acked")
        (acked,) = sub.wait_count(1)
        sub.client.ack(acked.mid, acked.qos)
        time.sleep(0.3)
        pub.publish(f"{parent}/w", b"not acked")
        sub.wait_count(2)
        broker.kill()
        sub.client.loop_stop()
        broker = start_broker(broker.data_dir, port=broker.port, extra_args=["--mqtt-port", str(port)])
        back = connect(port, "crashy", clean=False)
        assert back.connack == (True, "Success")
        assert [m.payload for m in back.wait_count(1)] == [b"not acked"]
        assert len(back.quiet()) == 1
    finally:
        broker.stop()
