"""QoS 2, exactly once both ways (issue 27 item 3), against MQTT 3.1.1 and 5.0 sections 4.3.3 (the QoS 2
flow), 4.4 (message delivery retry) and 3.9.3 (granted QoS): paho-mqtt clients for the flows a library
drives, raw sockets where the test must resend a PUBLISH with DUP, drop a connection between PUBREC and
PUBCOMP, or read a reason code the library hides. "Stored once" is read where it lives: the lite topic's
end offset (``lmq-admin lite-topic describe``)."""

from __future__ import annotations

import re
import signal
import sqlite3
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from paho.mqtt.enums import MQTTProtocolVersion
from raw_mqtt import Raw
from testing_mqtt import Peer

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.mqtt import codec, durable, exactly, stats
from lmq_broker.mqtt.properties import Reason
from lmq_broker.testing import BrokerProcess, start_broker

Connect = Callable[..., Peer]
V5 = MQTTProtocolVersion.MQTTv5
LEVELS = pytest.mark.parametrize("level", [codec.LEVEL_3_1_1, codec.LEVEL_5], ids=["3.1.1", "5.0"])
FOREVER = 0xFFFFFFFF


def stored(broker: BrokerProcess, parent: str, lite: str) -> int:
    """Messages the lite topic holds (its end offset)."""
    with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
        return admin.describe_lite_topic(parent, lite).meta.max_offset


def new_parent(broker: BrokerProcess, name: str) -> str:
    with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic(name, model.MessageType.LITE))
    return name


def refused_total(broker: BrokerProcess, reason: str) -> float:
    with urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.search(rf'^lmq_mqtt_refused_total\{{reason="{reason}"\}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _resent_after_restart(
    broker: BrokerProcess, client: str, *, level: int, topic: str, payload: bytes, packet_id: int
) -> BrokerProcess:
    """The broker started again on its data; ``client``'s persistent session resends its QoS 2 PUBLISH (DUP) and
    completes the flow (PUBREC, PUBREL, PUBCOMP). Returns the restarted broker."""
    port = broker.mqtt_port
    broker = start_broker(broker.data_dir, port=broker.port, extra_args=["--mqtt-port", str(port)])
    again = Raw(port, client, level=level, clean=False)
    assert again.session_present
    again.publish(topic, payload, packet_id, dup=True)
    again.expect(codec.PUBREC, packet_id)
    again.ack(codec.PUBREL, packet_id)
    again.expect(codec.PUBCOMP, packet_id)
    again.close()
    return broker


# --- with paho-mqtt --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", [MQTTProtocolVersion.MQTTv311, V5], ids=["3.1.1", "5.0"])
def test_4_3_3_qos2_publish_is_stored_once_and_delivered_exactly_once_at_qos2(
    broker: BrokerProcess, parent: str, connect: Connect, protocol: MQTTProtocolVersion
) -> None:
    """3.1.1 and 5.0 section 4.3.3: a QoS 2 publish completes PUBLISH/PUBREC/PUBREL/PUBCOMP (paho's publish
    returns its PUBCOMP's reason, 0), is stored once, and reaches a QoS 2 subscriber once, at QoS 2 (3.8.4,
    3.9.3: granted QoS 2), a QoS 1 one at QoS 1."""
    port = broker.mqtt_port
    two, one = connect(port, protocol=protocol), connect(port, protocol=protocol)
    assert two.subscribe((f"{parent}/x2", 2)) == [2]
    assert one.subscribe((f"{parent}/x2", 1)) == [1]
    pub = connect(port, protocol=protocol)
    for i in range(5):
        assert pub.publish(f"{parent}/x2", b"m%d" % i, qos=2) == 0
    assert [(m.payload, m.qos, m.dup) for m in two.wait_count(5)] == [(b"m%d" % i, 2, False) for i in range(5)]
    assert [(m.payload, m.qos) for m in one.wait_count(5)] == [(b"m%d" % i, 1) for i in range(5)]
    assert len(two.quiet()) == 5 and len(one.quiet()) == 5
    assert stored(broker, parent, "x2") == 5


# --- inbound, raw sockets ----------------------------------------------------------------------------------------
@LEVELS
def test_4_3_3_a_publish_resent_with_dup_before_pubrel_is_answered_pubrec_and_not_stored_again(
    broker: BrokerProcess, parent: str, level: int
) -> None:
    """Section 4.3.3 (method B): until its PUBREL, the packet id answers a resent PUBLISH (DUP) with PUBREC
    and nothing is stored; the PUBREL is answered PUBCOMP and releases the id, which a new message may use."""
    raw = Raw(broker.mqtt_port, f"dup-{level}", level=level)
    raw.publish(f"{parent}/d{level}", b"once", 7)
    raw.expect(codec.PUBREC, 7)
    raw.publish(f"{parent}/d{level}", b"once", 7, dup=True)
    raw.expect(codec.PUBREC, 7)
    raw.ack(codec.PUBREL, 7)
    raw.expect(codec.PUBCOMP, 7)
    raw.publish(f"{parent}/d{level}", b"twice", 7)  # the id is free again: a new message
    raw.expect(codec.PUBREC, 7)
    raw.ack(codec.PUBREL, 7)
    raw.expect(codec.PUBCOMP, 7)
    raw.close()
    assert stored(broker, parent, f"d{level}") == 2


@LEVELS
def test_4_3_3_a_publish_resent_after_a_reconnect_of_its_persistent_session_is_stored_once(
    broker: BrokerProcess, parent: str, level: int
) -> None:
    """Section 4.3.3 and 4.4: the packet ids awaiting PUBREL are session state. A client that lost its PUBREC
    with its connection resends the PUBLISH (DUP) on the resumed session: PUBREC, not stored again; its PUBREL
    is answered PUBCOMP (5.0: a second PUBREL then gets 0x92 Packet Identifier not found, 3.1.1 plain)."""
    client = f"resend-{level}"
    first = Raw(broker.mqtt_port, client, level=level, clean=False)
    first.publish(f"{parent}/r{level}", b"exactly once", 9)
    first.expect(codec.PUBREC, 9)
    first.close()  # no DISCONNECT: the connection is lost
    again = Raw(broker.mqtt_port, client, level=level, clean=False)
    assert again.session_present
    again.publish(f"{parent}/r{level}", b"exactly once", 9, dup=True)
    again.expect(codec.PUBREC, 9)
    again.ack(codec.PUBREL, 9)
    again.expect(codec.PUBCOMP, 9)
    again.ack(codec.PUBREL, 9)
    again.expect(codec.PUBCOMP, 9, Reason.PACKET_ID_NOT_FOUND if level == codec.LEVEL_5 else 0)
    again.close()
    assert stored(broker, parent, f"r{level}") == 1


@LEVELS
def test_4_3_3_a_publish_resent_after_a_broker_kill_9_and_restart_is_stored_once(tmp_path: Path, level: int) -> None:
    """Section 4.3.3 across a crash: SIGKILL after the PUBREC, a restart on the same data dir, the client
    resends the PUBLISH (DUP) on its persistent session: PUBREC, still one message, which a QoS 2
    subscriber's persistent session receives exactly once after the restart."""
    broker = start_broker(tmp_path / "data", extra_args=["--mqtt-port", "0"])
    try:
        parent = new_parent(broker, "K")
        port = broker.mqtt_port
        watcher = Raw(port, "watcher", level=level, clean=False)
        assert watcher.subscribe(f"{parent}/k", 2) == [2]
        watcher.close()
        first = Raw(port, "crash-pub", level=level, clean=False)
        first.publish(f"{parent}/k", b"survives", 3)
        first.expect(codec.PUBREC, 3)
        broker.kill()
        first.close()
        broker = _resent_after_restart(
            broker, "crash-pub", level=level, topic=f"{parent}/k", payload=b"survives", packet_id=3
        )
        assert stored(broker, parent, "k") == 1
        back = Raw(port, "watcher", level=level, clean=False)
        got = back.next()
        assert isinstance(got, codec.Publish) and (got.payload, got.qos) == (b"survives", 2), got
        assert got.packet_id is not None
        back.ack(codec.PUBREC, got.packet_id)
        back.expect(codec.PUBREL, got.packet_id)
        back.ack(codec.PUBCOMP, got.packet_id)
        back.send(codec.Bare(codec.PINGREQ))
        assert back.next() == codec.Bare(codec.PINGRESP)  # nothing else came before: delivered once
        back.close()
    finally:
        broker.stop()


@LEVELS
def test_4_3_3_a_pubrel_sent_after_a_broker_kill_9_and_restart_completes_the_flow_stored_once(
    tmp_path: Path, level: int
) -> None:
    """Section 4.3.3 across a crash, the client's other move: it had the PUBREC, so after the restart it sends
    only the PUBREL on its persistent session. The packet id is still awaiting it (the ``in`` row): PUBCOMP, 5.0
    with reason 0 (not 0x92 Packet Identifier not found); the message is stored once, and the id is free after
    (a PUBLISH under it then is a new message)."""
    broker = start_broker(tmp_path / "data", extra_args=["--mqtt-port", "0"])
    try:
        parent = new_parent(broker, "P")
        port = broker.mqtt_port
        first = Raw(port, "crash-rel", level=level, clean=False)
        first.publish(f"{parent}/p", b"once", 5)
        first.expect(codec.PUBREC, 5)
        broker.kill()
        first.close()
        broker = start_broker(broker.data_dir, port=broker.port, extra_args=["--mqtt-port", str(port)])
        again = Raw(port, "crash-rel", level=level, clean=False)
        assert again.session_present
        again.ack(codec.PUBREL, 5)
        again.expect(codec.PUBCOMP, 5)
        assert stored(broker, parent, "p") == 1
        again.published(f"{parent}/p", b"new", 5)
        again.close()
        assert stored(broker, parent, "p") == 2
    finally:
        broker.stop()


def test_3_1_1_qos2_publishes_awaiting_pubrel_over_the_cap_close_the_connection_and_are_counted(tmp_path: Path) -> None:
    """3.1.1 has no refusal for a PUBLISH but closing (MQTT-3.3.5-2): a client leaving more than
    ``--mqtt-max-qos2-inflight`` QoS 2 publishes awaiting PUBREL is closed, and the refusal counted in
    ``lmq_mqtt_refused_total{reason="qos2_inflight"}``; what it had stored stays stored once."""
    broker = start_broker(tmp_path / "data", extra_args=["--mqtt-port", "0", "--mqtt-max-qos2-inflight", "2"])
    try:
        parent = new_parent(broker, "C")
        raw = Raw(broker.mqtt_port, "greedy")
        for packet_id in (1, 2):
            raw.publish(f"{parent}/c", b"x", packet_id)
            raw.expect(codec.PUBREC, packet_id)
        raw.publish(f"{parent}/c", b"x", 1, dup=True)  # a resend is not a new one
        raw.expect(codec.PUBREC, 1)
        raw.publish(f"{parent}/c", b"over", 3)
        assert raw.closed() and raw.pending == []
        assert refused_total(broker, stats.QOS2_INFLIGHT) == 1
        assert stored(broker, parent, "c") == 2
        assert "QoS 2 publish refused: 2 QoS 2 publishes await their PUBREL" in broker.log()
    finally:
        broker.stop()


# --- outbound, raw sockets ---------------------------------------------------------------------------------------
@LEVELS
def test_4_4_a_reconnect_after_pubrec_resends_pubrel_not_the_publish_and_pubcomp_settles_it(
    broker: BrokerProcess, parent: str, level: int
) -> None:
    """Section 4.4 (MQTT-4.4.0-1): a QoS 2 delivery whose PUBREC came is released on the resumed session by a
    PUBREL with its original packet id, never a second PUBLISH; after the PUBCOMP nothing of it comes again
    (its message settled), and the next message flows."""
    client = f"out-{level}"
    sub = Raw(broker.mqtt_port, client, level=level, clean=False)
    assert sub.subscribe(f"{parent}/o{level}", 2) == [2]
    pub = Raw(broker.mqtt_port, f"out-pub-{level}", level=level)
    pub.publish(f"{parent}/o{level}", b"one", 1)
    pub.expect(codec.PUBREC, 1)
    got = sub.next()
    assert isinstance(got, codec.Publish) and (got.payload, got.qos, got.dup) == (b"one", 2, False), got
    assert got.packet_id is not None
    sub.ack(codec.PUBREC, got.packet_id)
    sub.expect(codec.PUBREL, got.packet_id)
    sub.close()  # lost before its PUBCOMP
    back = Raw(broker.mqtt_port, client, level=level, clean=False)
    assert back.session_present
    back.expect(codec.PUBREL, got.packet_id)  # the first packet after the CONNACK
    back.ack(codec.PUBCOMP, got.packet_id)
    pub.publish(f"{parent}/o{level}", b"two", 2)
    pub.expect(codec.PUBREC, 2)
    nxt = back.next()
    assert isinstance(nxt, codec.Publish) and (nxt.payload, nxt.dup) == (b"two", False), nxt
    pub.close()
    back.close()


def test_4_3_3_a_publish_resent_after_a_kill_9_whose_row_is_damaged_is_stored_not_dropped(tmp_path: Path) -> None:
    """The packet id's row names the message a resend is looked for by (``exactly``). A row whose text no longer
    reads (a damaged ``mqtt.sqlite3`` cell) was taken for a row whose message is known stored: the resend of a
    publish killed before its append was answered PUBREC and never stored. It is stored now (at least once: the
    broker cannot tell whether it was), and logged."""
    broker = start_broker(
        tmp_path / "data", extra_args=["--mqtt-port", "0"], env={"LMQ_TEST_KILL_AT": exactly.RECORDED}
    )
    try:
        parent = new_parent(broker, "W")
        port = broker.mqtt_port
        first = Raw(port, "window-pub", level=codec.LEVEL_3_1_1, clean=False)
        first.publish(f"{parent}/w", b"once", 5)
        assert broker.process.wait(timeout=30) == -signal.SIGKILL  # killed itself after the row, before the append
        assert first.closed() and first.pending == []  # no PUBREC came
        rows = sqlite3.connect(broker.data_dir / durable.FILE_NAME)
        try:
            with rows:
                assert rows.execute("UPDATE qos2 SET message = '[\"m' WHERE direction = ?", (durable.INBOUND,)).rowcount
        finally:
            rows.close()
        broker = _resent_after_restart(
            broker, "window-pub", level=codec.LEVEL_3_1_1, topic=f"{parent}/w", payload=b"once", packet_id=5
        )
        assert stored(broker, parent, "w") == 1
    finally:
        broker.stop()


@LEVELS
@pytest.mark.parametrize("point", [exactly.RECORDED, exactly.APPENDED])
def test_4_3_3_a_publish_resent_after_a_kill_9_at_its_append_is_stored_once(
    tmp_path: Path, level: int, point: str
) -> None:
    """Section 4.3.3 across a crash in the window between the packet id's row and the message's append
    (``exactly``): the broker kills itself (SIGKILL, ``LMQ_TEST_KILL_AT``) after the batch's rows were written
    and before its append (``RECORDED``), or after the append and before the PUBREC (``APPENDED``). The client,
    which got no PUBREC, resends the PUBLISH (DUP) on its persistent session after the restart: PUBREC, one
    message stored either way, which a QoS 2 subscriber's persistent session receives once."""
    broker = start_broker(tmp_path / "data", extra_args=["--mqtt-port", "0"], env={"LMQ_TEST_KILL_AT": point})
    try:
        parent = new_parent(broker, "W")
        port = broker.mqtt_port
        watcher = Raw(port, "window-watcher", level=level, clean=False)
        assert watcher.subscribe(f"{parent}/w", 2) == [2]
        watcher.close()
        first = Raw(port, "window-pub", level=level, clean=False)
        first.publish(f"{parent}/w", b"once", 5)
        assert broker.process.wait(timeout=30) == -signal.SIGKILL  # killed itself at ``point``
        assert first.closed() and first.pending == []  # no PUBREC came
        broker = _resent_after_restart(
            broker, "window-pub", level=level, topic=f"{parent}/w", payload=b"once", packet_id=5
        )
        assert stored(broker, parent, "w") == 1
        back = Raw(port, "window-watcher", level=level, clean=False)
        got = back.next()
        assert isinstance(got, codec.Publish) and (got.payload, got.qos) == (b"once", 2), got
        assert got.packet_id is not None
        back.ack(codec.PUBREC, got.packet_id)
        back.expect(codec.PUBREL, got.packet_id)
        back.ack(codec.PUBCOMP, got.packet_id)
        back.send(codec.Bare(codec.PINGREQ))
        assert back.next() == codec.Bare(codec.PINGRESP)  # nothing else came before: delivered once
        back.close()
    finally:
        broker.stop()


@LEVELS
def test_4_4_after_a_broker_kill_9_between_pubrec_and_pubcomp_the_session_gets_pubrel_and_not_the_message_again(
    tmp_path: Path, level: int
) -> None:
    """Section 4.4 across a crash: SIGKILL after the subscriber's PUBREC (PUBREL sent, no PUBCOMP), a restart on
    the same data dir: the resumed session gets the PUBREL with the original packet id, and the message (its
    lease died with the process, so the broker hands it out again) is not sent a second time: the next
    message published is the next PUBLISH the subscriber reads."""
    broker = start_broker(tmp_path / "data", extra_args=["--mqtt-port", "0"])
    try:
        parent = new_parent(broker, "R")
        port = broker.mqtt_port
        sub = Raw(port, "crash-sub", level=level, clean=False)
        assert sub.subscribe(f"{parent}/s", 2) == [2]
        pub = Raw(port, "crash-sub-pub", level=level)
        pub.publish(f"{parent}/s", b"first", 1)
        pub.expect(codec.PUBREC, 1)
        pub.close()
        got = sub.next()
        assert isinstance(got, codec.Publish) and got.payload == b"first" and got.packet_id is not None
        sub.ack(codec.PUBREC, got.packet_id)
        sub.expect(codec.PUBREL, got.packet_id)
        broker.kill()
        sub.close()
        broker = start_broker(broker.data_dir, port=broker.port, extra_args=["--mqtt-port", str(port)])
        back = Raw(port, "crash-sub", level=level, clean=False)
        assert back.session_present
        back.expect(codec.PUBREL, got.packet_id)
        back.ack(codec.PUBCOMP, got.packet_id)
        pub = Raw(port, "crash-sub-pub", level=level)
        pub.publish(f"{parent}/s", b"second", 1)
        pub.expect(codec.PUBREC, 1)
        pub.close()
        nxt = back.next()
        assert isinstance(nxt, codec.Publish) and (nxt.payload, nxt.dup) == (b"second", False), nxt
        back.close()
    finally:
        broker.stop()


@LEVELS
def test_4_3_3_a_delivery_without_pubrec_comes_again_with_dup_after_a_reconnect(
    broker: BrokerProcess, parent: str, level: int
) -> None:
    """Section 4.3.3/4.4: a QoS 2 PUBLISH the client never answered with PUBREC is not settled: the resumed
    session gets it again, DUP set (never lost)."""
    client = f"norec-{level}"
    sub = Raw(broker.mqtt_port, client, level=level, clean=False)
    assert sub.subscribe(f"{parent}/n{level}", 2) == [2]
    pub = Raw(broker.mqtt_port, f"norec-pub-{level}", level=level)
    pub.publish(f"{parent}/n{level}", b"keep", 1)
    pub.expect(codec.PUBREC, 1)
    pub.close()
    got = sub.next()
    assert isinstance(got, codec.Publish) and got.payload == b"keep"
    sub.close()
    back = Raw(broker.mqtt_port, client, level=level, clean=False)
    again = back.next()
    assert isinstance(again, codec.Publish) and (again.payload, again.qos, again.dup) == (b"keep", 2, True), again
    back.close()


def test_mqtt5_4_3_3_pubrec_with_an_error_code_ends_the_flow_and_an_unknown_one_gets_pubrel_0x92(
    broker: BrokerProcess, parent: str
) -> None:
    """5.0 section 4.3.3 (MQTT-4.3.3-4): a PUBREC with a reason code of 0x80 or more ends the flow (no PUBREL;
    the message is not delivered again); section 3.6.2.1: a PUBREC for a packet id not in flight is answered
    PUBREL 0x92 Packet Identifier not found."""
    sub = Raw(broker.mqtt_port, "refuser", level=codec.LEVEL_5, clean=False)
    assert sub.subscribe(f"{parent}/e", 2) == [2]
    pub = Raw(broker.mqtt_port, "refuser-pub", level=codec.LEVEL_5)
    pub.publish(f"{parent}/e", b"unwanted", 1)
    pub.expect(codec.PUBREC, 1)
    got = sub.next()
    assert isinstance(got, codec.Publish) and got.packet_id is not None
    sub.ack(codec.PUBREC, got.packet_id, Reason.UNSPECIFIED_ERROR)
    sub.ack(codec.PUBREC, 999)
    sub.expect(codec.PUBREL, 999, Reason.PACKET_ID_NOT_FOUND)  # and no PUBREL for the refused one before it
    sub.close()
    back = Raw(broker.mqtt_port, "refuser", level=codec.LEVEL_5, clean=False)
    back.send(codec.Bare(codec.PINGREQ))
    assert back.next() == codec.Bare(codec.PINGRESP)  # the refused message did not come again
    pub.close()
    back.close()


def test_4_4_a_flow_completed_on_a_resumed_session_is_not_released_again_on_the_next(
    broker: BrokerProcess, parent: str
) -> None:
    """A QoS 2 delivery released (PUBREC came) when its connection ended is settled then; the resumed session's
    PUBCOMP completes it: its packet id is forgotten, so the session's next reconnect gets no PUBREL for it (its
    row used to keep the message id and wait for the message to come again, which it never does: a PUBREL on
    every reconnect, the id never free)."""
    sub = Raw(broker.mqtt_port, "twice-sub", clean=False)
    assert sub.subscribe(f"{parent}/t", 2) == [2]
    pub = Raw(broker.mqtt_port, "twice-pub")
    pub.published(f"{parent}/t", b"one", 1)
    got = sub.next()
    assert isinstance(got, codec.Publish) and got.payload == b"one" and got.packet_id is not None, got
    sub.ack(codec.PUBREC, got.packet_id)
    sub.expect(codec.PUBREL, got.packet_id)
    sub.close()  # lost before its PUBCOMP
    back = Raw(broker.mqtt_port, "twice-sub", clean=False)
    back.expect(codec.PUBREL, got.packet_id)
    back.ack(codec.PUBCOMP, got.packet_id)
    back.send(codec.Bare(codec.PINGREQ))
    assert back.next() == codec.Bare(codec.PINGRESP)  # the PUBCOMP handled
    back.close()
    again = Raw(broker.mqtt_port, "twice-sub", clean=False)
    assert again.session_present
    pub.published(f"{parent}/t", b"two", 2)
    nxt = again.next()  # no PUBREL before it
    assert isinstance(nxt, codec.Publish) and nxt.payload == b"two", nxt
    again.close()
    pub.close()


def test_4_3_3_a_broker_kill_9_at_a_deliverys_pubcomp_does_not_hand_its_message_out_again(tmp_path: Path) -> None:
    """The PUBCOMP of a QoS 2 delivery settles its message before its packet id's row is forgotten: the broker
    killed between the two (``COMPLETED``) resends a PUBREL after the restart, never the message as a new
    PUBLISH (the row used to go first: the message, unsettled, came again, delivered twice)."""
    broker = start_broker(
        tmp_path / "data", extra_args=["--mqtt-port", "0"], env={"LMQ_TEST_KILL_AT": exactly.COMPLETED}
    )
    try:
        parent = new_parent(broker, "C")
        port = broker.mqtt_port
        sub = Raw(port, "comp-sub", clean=False)
        assert sub.subscribe(f"{parent}/c", 2) == [2]
        pub = Raw(port, "comp-pub")
        pub.published(f"{parent}/c", b"first", 1)
        pub.close()
        got = sub.next()
        assert isinstance(got, codec.Publish) and got.payload == b"first" and got.packet_id is not None, got
        sub.ack(codec.PUBREC, got.packet_id)
        sub.expect(codec.PUBREL, got.packet_id)
        sub.ack(codec.PUBCOMP, got.packet_id)
        assert broker.process.wait(timeout=30) == -signal.SIGKILL  # killed itself at ``COMPLETED``
        sub.close()
        broker = start_broker(broker.data_dir, port=broker.port, extra_args=["--mqtt-port", str(port)])
        back = Raw(port, "comp-sub", clean=False)
        assert back.session_present
        back.expect(codec.PUBREL, got.packet_id)  # the row kept: released again, answered
        back.ack(codec.PUBCOMP, got.packet_id)
        pub = Raw(port, "comp-pub")
        pub.published(f"{parent}/c", b"second", 2)
        pub.close()
        nxt = back.next()
        assert isinstance(nxt, codec.Publish) and nxt.payload == b"second", nxt
        back.close()
    finally:
        broker.stop()
