"""QoS 2 delivery in a cluster across a kill -9 of the session's broker (MQTT 3.1.1 and 5.0 sections 4.3.3 and
4.4): two broker processes with ``--peers``; the subscriber's broker is killed between the subscriber's PUBREC
and its PUBCOMP for a message another broker owns. After the restart the session gets the PUBREL again and
not the message: the owner hands it out again once its lease ran out, and the session settles it there
unsent, recognised by its message id. Raw sockets speak MQTT through our codec."""

from __future__ import annotations

import dataclasses
import re
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from raw_mqtt import Raw
from waiting import eventually

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.cluster import membership as mb
from lmq_broker.mqtt import codec, exactly
from lmq_broker.mqtt.properties import NONE
from lmq_broker.protocol import auth
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2, admin_pb2_grpc
from lmq_broker.supervisor import free_ports
from lmq_broker.testing import SHARED_ADMIN_ENV, SHARED_ADMIN_KEYS, BrokerProcess, start_broker

PARENT = "Q2"
WAIT_S = 30.0
LEASE_MS = 1000  # the owner's lease of a delivery: not renewed (``--lease-renew-max-ms 0``), so it runs out soon
LEVELS = pytest.mark.parametrize("level", [codec.LEVEL_3_1_1, codec.LEVEL_5], ids=["3.1.1", "5.0"])


def acks(broker: BrokerProcess) -> float:
    """Messages acknowledged at ``broker`` through AckMessage (an MQTT session settles another broker's so)."""
    with urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.search(r"^lmq_acks_total (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def start_cluster(
    tmp_path: Path, started: list[BrokerProcess], first_env: dict[str, str] | None = None, lease_ms: int = LEASE_MS
) -> None:
    """Two brokers into ``started`` (broker 0 with ``first_env`` added), and the parent ``PARENT``."""
    ports = free_ports("127.0.0.1", 2)
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    for i, port in enumerate(ports):
        args = ["--peers", peers, "--ordinal", str(i), "--mqtt-port", "0"]
        args += ["--lease-renew-slice-ms", str(lease_ms), "--lease-renew-max-ms", "0"]
        env = {**SHARED_ADMIN_ENV, **(first_env if i == 0 and first_env else {})}
        started.append(start_broker(tmp_path / f"b{i}", port=port, extra_args=args, env=env))
    with AdminClient(started[0].endpoint, timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
        admin.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))  # sent on to broker 1


def refused(broker: BrokerProcess, reason: str) -> float:
    """MQTT publishes ``broker`` refused with ``reason`` (``lmq_mqtt_publishes_refused``)."""
    with urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.search(rf'^lmq_mqtt_publishes_refused_total\{{reason="{reason}"\}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[BrokerProcess]]:
    started: list[BrokerProcess] = []
    try:
        start_cluster(tmp_path, started)
        yield started
    finally:
        for broker in started:
            broker.stop()


def owned_by(cluster: list[BrokerProcess], slot: int) -> str:
    """A lite topic of ``PARENT`` that broker ``slot`` owns."""
    membership = mb.Membership.parse(",".join(f"127.0.0.1:{b.port}" for b in cluster))
    owned = (f"k-{i}" for i in range(10_000))
    return next(lite for lite in owned if mb.owner(membership, model.QueueId.lmq(PARENT, lite).topic) == slot)


def stored(broker: BrokerProcess, lite: str) -> int:
    """Messages the lite topic holds at ``broker`` (its end offset)."""
    with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
        return admin.describe_lite_topic(PARENT, lite).meta.max_offset


def closed(raw: Raw) -> bool:
    """The broker closed the connection having sent no PUBREC (5.0: a DISCONNECT at most)."""
    while True:
        try:
            data = raw.sock.recv(65536)
        except ConnectionResetError:
            data = b""
        if not data:
            return not any(isinstance(p, codec.PacketId) for p in raw.pending)
        raw.pending += raw.decoder.feed(data)


@LEVELS
def test_4_3_3_a_publish_resent_after_a_kill_9_between_its_append_at_another_owner_and_its_mark_is_stored_once(
    tmp_path: Path, level: int
) -> None:
    """Section 4.3.3 in a cluster: the publisher's broker appends a QoS 2 publish at the lite topic's owner (the
    other broker), then kills itself (``LMQ_TEST_KILL_AT``, ``exactly.APPENDED``) before marking its row stored
    and before the PUBREC. After the restart, a resend (DUP) while the owner is down is not answered (the
    connection closes: the owner cannot tell whether it holds it); once the owner is back, the resend is looked
    for there, found, and answered PUBREC: the owner holds the message once."""
    started: list[BrokerProcess] = []
    try:
        start_cluster(tmp_path, started, {"LMQ_TEST_KILL_AT": exactly.APPENDED})
        session, owner = started
        theirs = owned_by(started, 1)
        pub = Raw(session.mqtt_port, "q2-resend", level, clean=False)
        props = NONE if pub.v5 else None
        pub.send(codec.Publish(f"{PARENT}/{theirs}", b"once", 2, packet_id=7, properties=props))
        assert session.process.wait(timeout=WAIT_S) == -signal.SIGKILL  # killed itself after the append
        assert closed(pub)  # no PUBREC came
        pub.close()
        assert stored(owner, theirs) == 1
        session = started[0] = dataclasses.replace(session, env=SHARED_ADMIN_ENV).restart()  # no failpoint now
        owner.stop()
        again = Raw(session.mqtt_port, "q2-resend", level, clean=False)
        assert again.session_present
        again.send(codec.Publish(f"{PARENT}/{theirs}", b"once", 2, dup=True, packet_id=7, properties=props))
        assert closed(again)  # the owner cannot be asked: not answered, not stored
        again.close()
        assert refused(session, "unspecified_error") == 1  # counted (and logged at INFO)
        owner = started[1] = owner.restart()
        last = Raw(session.mqtt_port, "q2-resend", level, clean=False)
        last.send(codec.Publish(f"{PARENT}/{theirs}", b"once", 2, dup=True, packet_id=7, properties=props))
        last.expect(codec.PUBREC, 7)
        last.ack(codec.PUBREL, 7)
        last.expect(codec.PUBCOMP, 7)
        last.close()
        assert stored(owner, theirs) == 1  # once
    finally:
        for broker in started:
            broker.stop()


@LEVELS
def test_4_4_a_kill_9_of_the_sessions_broker_after_pubrec_does_not_send_another_brokers_message_again(
    cluster: list[BrokerProcess], level: int
) -> None:
    theirs = owned_by(cluster, 1)
    session, owner = cluster
    port = session.mqtt_port
    sub = Raw(port, "q2-sub", level, clean=False)
    sub.send(codec.Subscribe(1, ((f"{PARENT}/{theirs}", 2),), NONE if sub.v5 else None))
    suback = sub.next()
    assert isinstance(suback, codec.SubAck) and suback.codes == (2,), suback
    pub = Raw(owner.mqtt_port, "q2-pub", level, clean=True)
    pub.published(f"{PARENT}/{theirs}", b"first", 1)  # stored at the owner, broker 1
    got = sub.next()
    assert isinstance(got, codec.Publish) and (got.payload, got.qos) == (b"first", 2), got
    assert got.packet_id is not None
    sub.ack(codec.PUBREC, got.packet_id)
    sub.expect(codec.PUBREL, got.packet_id)  # its id is recorded (with the message id) before this
    session.kill()
    sub.close()
    session = cluster[0] = session.restart()  # same data dir and ports
    back = Raw(port, "q2-sub", level, clean=False)
    assert back.session_present
    back.expect(codec.PUBREL, got.packet_id)  # MQTT-4.4.0-1: the PUBREL again, not the PUBLISH
    back.ack(codec.PUBCOMP, got.packet_id)
    # the owner hands "first" out again once its lease ran out: settled there (acknowledged) without a PUBLISH
    eventually(lambda: acks(owner) == 1, "the message handed out again is settled at the owner", WAIT_S)
    pub.published(f"{PARENT}/{theirs}", b"second", 2)
    nxt = back.next()
    assert isinstance(nxt, codec.Publish) and (nxt.payload, nxt.dup) == (b"second", False), nxt
    assert nxt.packet_id is not None
    back.ack(codec.PUBREC, nxt.packet_id)
    back.expect(codec.PUBREL, nxt.packet_id)
    back.ack(codec.PUBCOMP, nxt.packet_id)
    eventually(lambda: acks(owner) == 2, "the second settled at the owner", WAIT_S)
    back.send(codec.Bare(codec.PINGREQ))
    assert back.next() == codec.Bare(codec.PINGRESP)  # nothing else came: "first" exactly once
    back.close()
    pub.close()


@LEVELS
def test_4_4_a_pubcomp_whose_settling_at_the_owner_fails_keeps_the_row_and_the_message_is_not_sent_again(
    tmp_path: Path, level: int
) -> None:
    """A QoS 2 delivery of another broker's message: its PUBCOMP comes while that owner is down, so it cannot be
    settled there. Its packet id's row stays (it went before the settling, which failed silently), and the
    message, handed out again once the owner is back, is recognised by its message id and settled there unsent:
    exactly once (it came again as a new PUBLISH). Once settled the row goes: a reconnect gets no PUBREL."""
    started: list[BrokerProcess] = []
    try:
        start_cluster(tmp_path, started, lease_ms=10_000)  # not handed out again while the owner is up
        theirs = owned_by(started, 1)
        session, owner = started
        sub = Raw(session.mqtt_port, "down-sub", level, clean=False)
        assert sub.subscribe(f"{PARENT}/{theirs}", 2) == [2]
        pub = Raw(owner.mqtt_port, "down-pub", level)
        pub.published(f"{PARENT}/{theirs}", b"first", 1)  # stored at the owner, broker 1
        pub.close()
        got = sub.next()
        assert isinstance(got, codec.Publish) and (got.payload, got.qos) == (b"first", 2), got
        assert got.packet_id is not None
        sub.ack(codec.PUBREC, got.packet_id)
        sub.expect(codec.PUBREL, got.packet_id)
        owner.kill()
        sub.ack(codec.PUBCOMP, got.packet_id)  # settled at the owner, which does not answer
        sub.send(codec.Bare(codec.PINGREQ))
        assert sub.next() == codec.Bare(codec.PINGRESP)
        owner = started[1] = owner.restart()  # same data dir and ports: "first" not settled there
        eventually(lambda: acks(owner) == 1, "the message handed out again is settled at the owner", WAIT_S)
        pub = Raw(owner.mqtt_port, "down-pub", level)
        pub.published(f"{PARENT}/{theirs}", b"second", 2)
        nxt = sub.next()
        assert isinstance(nxt, codec.Publish) and (nxt.payload, nxt.dup) == (b"second", False), nxt  # not "first"
        assert nxt.packet_id is not None
        sub.ack(codec.PUBREC, nxt.packet_id)
        sub.expect(codec.PUBREL, nxt.packet_id)
        sub.ack(codec.PUBCOMP, nxt.packet_id)
        eventually(lambda: acks(owner) == 2, "the second settled at the owner", WAIT_S)
        sub.close()
        back = Raw(session.mqtt_port, "down-sub", level, clean=False)
        assert back.session_present
        back.send(codec.Bare(codec.PINGREQ))
        assert back.next() == codec.Bare(codec.PINGRESP)  # no PUBREL: both rows forgotten once settled
        back.close()
        pub.close()
    finally:
        for broker in started:
            broker.stop()


def test_4_4_another_brokers_qos1_delivery_without_puback_comes_again_under_its_packet_id(tmp_path: Path) -> None:
    """MQTT-4.4.0-1 in a cluster: a QoS 1 delivery of a message another broker owns, not acknowledged when the
    connection ends, is given back there and, handed out again to the resumed session, goes under the packet id
    it had, DUP set; its PUBACK settles it there."""
    cluster: list[BrokerProcess] = []
    try:
        start_cluster(tmp_path, cluster, lease_ms=10_000)  # not handed out again while the first connection lives
        _resent_there(cluster)
    finally:
        for broker in cluster:
            broker.stop()


def _resent_there(cluster: list[BrokerProcess]) -> None:
    theirs = owned_by(cluster, 1)
    session, owner = cluster
    sub = Raw(session.mqtt_port, "q1-sub", clean=False)
    assert sub.subscribe(f"{PARENT}/{theirs}", 1) == [1]
    pub = Raw(owner.mqtt_port, "q1-pub")
    for packet_id, body in ((1, b"done"), (2, b"owed")):
        pub.send(codec.Publish(f"{PARENT}/{theirs}", body, qos=1, packet_id=packet_id))
        pub.expect(codec.PUBACK, packet_id)
    pub.close()
    got = {p.payload: p for p in (sub.next(), sub.next()) if isinstance(p, codec.Publish)}
    done, owed = got[b"done"], got[b"owed"]
    assert done.packet_id is not None and owed.packet_id not in (None, done.packet_id), got
    sub.ack(codec.PUBACK, done.packet_id)
    eventually(lambda: acks(owner) == 1, "the first settled at the owner", WAIT_S)
    sub.close()
    back = Raw(session.mqtt_port, "q1-sub", clean=False)
    again = back.next()
    assert isinstance(again, codec.Publish), again
    assert (again.payload, again.dup, again.packet_id) == (b"owed", True, owed.packet_id), again
    back.ack(codec.PUBACK, owed.packet_id)
    eventually(lambda: acks(owner) == 2, "the second settled at the owner", WAIT_S)
    back.close()


def test_looking_for_a_resent_publish_is_a_peers_call_only(cluster: list[BrokerProcess]) -> None:
    """``MqttFindMessage`` reads a lite topic for another broker: the admin pair alone (no peer header) is refused."""
    broker = cluster[1]
    request = admin_pb2.MqttFindMessageRequest(parent=PARENT, lite=owned_by(cluster, 1), message_id="X")
    signed = auth.sign_metadata(broker.admin_access_key, broker.admin_secret_key, auth.utc_now())
    with grpc.insecure_channel(broker.admin_endpoint) as channel, pytest.raises(grpc.RpcError) as refused:
        admin_pb2_grpc.LmqAdminStub(channel).MqttFindMessage(request, metadata=signed, timeout=10)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
