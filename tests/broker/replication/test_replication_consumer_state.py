"""What a consumer depends on besides messages, commit points and sessions, through a real failover
(docs/replication.md, "What is replicated"): broker processes on a real kube-apiserver + etcd, --replicas 2,
kill -9 of the owner and its data directory deleted. The new owner hands a message out with the attempt it has
reached, publishes an MQTT will that was waiting for its delay once the delay is over, and does not deliver to an
MQTT session what was published before its subscription started at the topic's end."""

from __future__ import annotations

import asyncio
import json
import shutil
import struct
import time
from pathlib import Path

import grpc
import pytest
import raw_v2
from paho.mqtt.enums import MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from raw_mqtt import Raw
from testing_mqtt import Peer
from waiting import eventually

from lmq_broker import model, testing
from lmq_broker.admin.client import AdminClient
from lmq_broker.cluster import membership as mb
from lmq_broker.mqtt import codec
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as service_grpc
from lmq_broker.replication import kube as kube_api
from lmq_broker.replication import wire
from lmq_broker.supervisor import free_ports
from lmq_operator import testing as kube_testing

PARENT, GROUP = raw_v2.PARENT, raw_v2.GROUP  # the bootstrap parent (LITE) and its group
LEASE_MS = 1500
CONSUMER = "consumer-1"
WILL_DELAY_S = 15  # the will waits this long: past the failover (a lease of 1.5 s, the takeover) and the rejoin


class Pair:
    """Two brokers, R = 2, on the real apiserver, their leases under their own prefix."""

    def __init__(self, tmp_path: Path, kube: kube_testing.KubeAPI, prefix: str, min_insync: int = 2) -> None:
        self.tmp_path, self.kube, self.prefix, self.min_insync = tmp_path, kube, prefix, min_insync
        self.members = [f"127.0.0.1:{p}" for p in free_ports("127.0.0.1", 2)]
        self.brokers = [self.start(slot) for slot in (0, 1)]
        self.api = kube_api.ApiServer(kube.server, kube.token, kube.ca_file, "default")
        membership = mb.Membership.parse(",".join(self.members))
        topics = (f"t{i}" for i in range(1000))
        self.lites = [lite for lite in topics if mb.owner(membership, model.QueueId.lmq(PARENT, lite).topic) == 0]
        self.peers: list[Peer] = []

    def start(self, slot: int) -> testing.BrokerProcess:
        token = self.tmp_path / "token"
        token.write_text(self.kube.token)
        port = self.members[slot].rsplit(":", 1)[1]
        flags = ["--peers", ",".join(self.members), "--ordinal", str(slot)]
        flags += ["--advertised-address", self.members[slot], "--flush-mode", "sync", "--mqtt-port", "0"]
        flags += ["--admin-access-key", "ak", "--admin-secret-key", "sk", "--min-insync-replicas", str(self.min_insync)]
        flags += ["--replicas", "2", "--lease-namespace", "default", "--lease-prefix", self.prefix]
        flags += ["--lease-duration-ms", str(LEASE_MS), "--kube-api-server", self.kube.server]
        flags += ["--kube-token-file", str(token), "--kube-ca-file", str(self.kube.ca_file)]
        return testing.start_broker(self.tmp_path / f"b{slot}", int(port), flags)

    def held_by(self, slot: int) -> bool:
        got = self.api.get(f"{self.prefix}-slot-0")
        return got is not None and got.holder.startswith(f"slot-{slot}/")

    def shadowed(self, kind: str) -> bool:
        return raw_v2.metric(self.brokers[1], "lmq_replication_state_rows", kind=kind, slot="0") >= 1

    def in_sync(self) -> bool:
        """The follower is in slot 0's in-sync set (the lease says so) and in sync with its holder (it says so)."""
        got = self.api.get(f"{self.prefix}-slot-0")
        recorded = got is not None and got.in_sync == (0, 1)
        return recorded and raw_v2.metric(self.brokers[1], "lmq_replication_in_sync", slot="0") == 1

    def fail_over(self) -> None:
        """kill -9 of the owner of slot 0 and its disk gone: the follower (in its in-sync set) takes slot 0 over."""
        eventually(self.in_sync, "the follower in slot 0's in-sync set")
        self.brokers[0].kill()
        shutil.rmtree(self.tmp_path / "b0")
        eventually(lambda: self.held_by(1), "the follower took the lease", timeout_s=30)
        eventually(lambda: "slot 0 taken over" in self.brokers[1].log(), "its state rows installed")
        served = "slot 0 is served by slot 1 now"
        eventually(lambda: served in self.brokers[1].log(), "its consumers' subscriptions made there (handover)")

    def back(self) -> None:
        """The old owner back on an empty disk, a follower now: sends of slot 0 are acknowledged again (R = 2
        in sync), as a raw v2 send to another topic of the slot shows."""
        self.brokers[0] = self.start(0)
        eventually(lambda: _send(self.members[1], self.lites[-1], "probe") == pb.OK, "a send acknowledged again")

    def peer(self, slot: int, client_id: str, **options: object) -> Peer:
        peer = Peer(self.brokers[slot].mqtt_port, client_id, **options)  # type: ignore[arg-type]
        self.peers.append(peer)
        return peer

    def close(self) -> None:
        for peer in self.peers:
            peer.disconnect()
        for b in self.brokers:
            if b.alive():
                b.stop()


async def _call(endpoint: str, method: str, request: object) -> object:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = service_grpc.MessagingServiceStub(channel)
        answer: object = await getattr(stub, method)(request, metadata=raw_v2.headers(CONSUMER))
        return answer


def _send(endpoint: str, lite: str, message_id: str) -> int:
    props = pb.SystemProperties(message_id=message_id, message_type=pb.LITE, lite_topic=lite)
    message = pb.Message(topic=pb.Resource(name=PARENT), body=b"0", system_properties=props)
    sent = asyncio.run(_call(endpoint, "SendMessage", spb.SendMessageRequest(messages=[message])))
    assert isinstance(sent, spb.SendMessageResponse)
    return sent.status.code


def _subscribe(endpoint: str, lite: str, offset: pb.OffsetOption | None = None) -> int:
    request = spb.SyncLiteSubscriptionRequest(action=pb.PARTIAL_ADD, topic=pb.Resource(name=PARENT),
                                              group=pb.Resource(name=GROUP), lite_topic_set=[lite])  # fmt: skip
    if offset is not None:
        request.offset_option.CopyFrom(offset)
    answer = asyncio.run(_call(endpoint, "SyncLiteSubscription", request))
    assert isinstance(answer, spb.SyncLiteSubscriptionResponse)
    return answer.status.code


def _receive(endpoint: str) -> list[tuple[str, int]]:
    """(message id, delivery attempt) of one long poll, leased for 1 s (the message comes back once it ends)."""

    async def run() -> list[tuple[str, int]]:
        request = spb.ReceiveMessageRequest(
            group=pb.Resource(name=GROUP), message_queue=pb.MessageQueue(topic=pb.Resource(name=PARENT)), batch_size=8
        )
        request.invisible_duration.seconds = 1
        request.long_polling_timeout.seconds = 10
        async with grpc.aio.insecure_channel(endpoint) as channel:
            stub = service_grpc.MessagingServiceStub(channel)
            frames = [f async for f in stub.ReceiveMessage(request, metadata=raw_v2.headers(CONSUMER), timeout=30)]
        props = [f.message.system_properties for f in frames if f.HasField("message")]
        return [(p.message_id, p.delivery_attempt) for p in props]

    return asyncio.run(run())


def test_the_new_owner_hands_a_message_out_with_the_attempt_the_old_one_had_reached(
    tmp_path: Path, kube: kube_testing.KubeAPI
) -> None:
    pair = Pair(tmp_path, kube, "attempts")
    owner, follower = pair.members
    lite = pair.lites[0]
    stored = pair.brokers[1]

    def with_handouts() -> float:
        return raw_v2.metric(stored, "lmq_replication_commits_stored_total", handouts="yes")

    try:
        eventually(lambda: pair.held_by(0), "the owner holds its lease")
        assert _subscribe(owner, lite) == pb.OK
        assert _send(owner, lite, "m-0") == pb.OK
        eventually(lambda: pair.shadowed("sub"), "the follower's subscription rows of slot 0")
        assert with_handouts() == 0
        assert _receive(owner) == [("m-0", 1)]  # not acknowledged: back after its second
        eventually(lambda: _receive(owner) == [("m-0", 2)], "the second attempt")
        eventually(lambda: with_handouts() >= 2, "both hand-outs' attempts stored at the follower")
        pair.fail_over()
        eventually(lambda: _receive(follower) == [("m-0", 3)], "the third attempt, at the new owner")
    finally:
        pair.close()


def _will_properties(delay_s: int) -> tuple[Properties, Properties]:
    session = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    session.SessionExpiryInterval = 60
    will = Properties(PacketTypes.WILLMESSAGE)  # type: ignore[no-untyped-call]
    will.WillDelayInterval = delay_s
    return session, will


def test_a_will_waiting_for_its_delay_is_published_by_the_new_owner_once_the_delay_is_over(
    tmp_path: Path, kube: kube_testing.KubeAPI
) -> None:
    pair = Pair(tmp_path, kube, "wills")
    topic = f"{PARENT}/{pair.lites[0]}"
    session, delayed = _will_properties(WILL_DELAY_S)
    v5 = MQTTProtocolVersion.MQTTv5
    try:
        eventually(lambda: pair.held_by(0), "the owner holds its lease")
        dying = pair.peer(0, "dying-1", protocol=v5, keepalive=1, properties=session,
                          will=(topic, b"gone for good", 1, False, delayed))  # fmt: skip
        assert dying.connack == (False, "Success")
        gone_at = time.time()
        dying.vanish()  # no DISCONNECT: the owner gives up after 1.5 s and keeps the will for its delay
        eventually(lambda: pair.shadowed("mqtt-wills"), "the follower's will rows of slot 0")
        pair.fail_over()
        watcher = pair.peer(1, "watcher-1")
        watcher.subscribe((topic, 1))
        pair.back()  # R = 2 in sync again: the will's publish is acknowledged
        assert time.time() < gone_at + WILL_DELAY_S, "the failover outlasted the will's delay: nothing was tested"
        (will,) = watcher.wait_count(1, timeout=30)
        assert time.time() >= gone_at + WILL_DELAY_S  # not before its delay
        assert (will.topic, will.payload) == (topic, b"gone for good")
        assert len(watcher.quiet(1.0)) == 1  # once
    finally:
        pair.close()


def test_a_start_at_the_end_made_at_the_owner_holds_at_the_new_owner(
    tmp_path: Path, kube: kube_testing.KubeAPI
) -> None:
    """A consumer subscribing with OffsetOption MAX at the owner, and an MQTT session whose subscription started at
    the topic's end: neither gets the older messages from the new owner, only what is sent after. At
    --min-insync-replicas 1 (the new owner acknowledges alone): the reset's copy is not waited for there, so the
    test waits until the follower is in sync first and until it stored both starts. The follower's own start at
    the end (the MQTT session's broker asks every broker) leaves the slot it follows alone: its end may be
    behind the owner's."""
    pair = Pair(tmp_path, kube, "atend", min_insync=1)
    owner, follower = pair.members
    lite, mqtt_lite = pair.lites[0], pair.lites[1]
    topic = f"{PARENT}/{mqtt_lite}"
    try:
        eventually(lambda: pair.held_by(0), "the owner holds its lease")
        eventually(pair.in_sync, "the follower in sync (asynchronous: copies that outrun the messages are clamped)")
        for n in range(3):
            assert _send(owner, lite, f"old-{n}") == pb.OK
        latest = pb.OffsetOption(policy=pb.OffsetOption.MAX)
        assert _subscribe(owner, lite, latest) == pb.OK  # starts after old-2
        publisher = pair.peer(0, "publisher-1")
        for n in range(3):
            publisher.publish(topic, f"old-{n}".encode(), 1)
        late = pair.peer(0, "late-1", clean=False)
        assert late.subscribe((topic, 1)) == [1]  # starts at the topic's end: the three are older
        late.disconnect()
        follower_metric = pair.brokers[1]

        def stored() -> float:
            return raw_v2.metric(follower_metric, "lmq_replication_commits_stored_total", handouts="no")

        eventually(lambda: stored() >= 2, "both starts stored at the follower (not waited for at 1 in sync)")
        for kind in ("sub", "mqtt-sessions"):
            eventually(lambda kind=kind: pair.shadowed(kind), f"the follower's {kind} rows of slot 0")  # type: ignore[misc]
        pair.fail_over()
        resumed = pair.peer(1, "late-1", clean=False)
        assert resumed.connack == (True, "Success")
        pair.peer(1, "publisher-2").publish(topic, b"new", 1)
        assert [m.payload for m in resumed.wait_count(1)] == [b"new"]
        assert len(resumed.quiet(1.0)) == 1
        assert _send(follower, lite, "new-0") == pb.OK
        assert _receive(follower) == [("new-0", 1)]  # not old-0: the start after old-2 holds there
    finally:
        pair.close()


def test_a_persistent_sessions_subscription_is_on_the_follower_once_subscribed(
    tmp_path: Path, kube: kube_testing.KubeAPI
) -> None:
    """An MQTT SUBACK of a persistent session comes once its session row is on the in-sync follower: the owner
    killed -9 right after it (no wait for the rows, shipped every 100 ms otherwise), the session resumed at the
    new owner still holds its filter and gets what is published there. An MQTT client never subscribes again
    to a session it finds present: a filter missing there would strand every message sent to it."""
    pair = Pair(tmp_path, kube, "subrow", min_insync=1)
    topic = f"{PARENT}/{pair.lites[0]}"
    try:
        eventually(lambda: pair.held_by(0), "the owner holds its lease")
        eventually(pair.in_sync, "the follower in sync")
        kept = pair.peer(0, "kept-1", clean=False)
        assert kept.subscribe((topic, 1)) == [1]
        pair.fail_over()
        resumed = pair.peer(1, "kept-1", clean=False)
        assert resumed.connack == (True, "Success")
        pair.peer(1, "publisher-1").publish(topic, b"after", 1)
        assert [m.payload for m in resumed.wait_count(1)] == [b"after"]
    finally:
        pair.close()


@pytest.mark.parametrize("kind", ["retained", "qos2"])
def test_a_retained_message_and_a_qos2_packet_id_are_on_the_follower_once_answered(
    tmp_path: Path, kube: kube_testing.KubeAPI, kind: str
) -> None:
    """A retained publish's PUBACK, and a persistent session's QoS 2 PUBREC, come once their rows are on the
    in-sync follower: the owner killed -9 right after (rows are shipped every 100 ms otherwise), the new owner
    gives a new subscriber the retained message; and it answers the QoS 2 publish resent with DUP with PUBREC
    and stores it once (without its row it would store the resend as a new message)."""
    pair = Pair(tmp_path, kube, f"rows-{kind}", min_insync=1)
    topic = f"{PARENT}/{pair.lites[0]}"
    try:
        eventually(lambda: pair.held_by(0), "the owner holds its lease")
        eventually(pair.in_sync, "the follower in sync")
        if kind == "retained":
            pair.peer(0, "retainer").publish(topic, b"kept", 1, retain=True)  # its PUBACK awaited
            pair.fail_over()
            watcher = pair.peer(1, "watcher")
            assert watcher.subscribe((topic, 1)) == [1]
            (got,) = watcher.wait_count(1)
            assert (got.payload, got.retain) == (b"kept", True)
            return
        first = Raw(pair.brokers[0].mqtt_port, "exactly-1", clean=False)
        first.publish(topic, b"once", 5)
        first.expect(codec.PUBREC, 5)
        pair.fail_over()
        first.close()
        again = Raw(pair.brokers[1].mqtt_port, "exactly-1", clean=False)
        assert again.session_present
        again.publish(topic, b"once", 5, dup=True)
        again.expect(codec.PUBREC, 5)
        again.ack(codec.PUBREL, 5)
        again.expect(codec.PUBCOMP, 5)
        again.close()
        broker = pair.brokers[1]
        with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
            assert admin.describe_lite_topic(PARENT, pair.lites[0]).meta.max_offset == 1
    finally:
        pair.close()


def test_hand_outs_travel_in_a_key_of_their_own_that_an_older_broker_passes_over() -> None:
    """Mixed versions: a commit copy without hand-outs is what an older owner sends (byte for byte), and reads as
    none; one with them keeps its commits as an older follower reads them (five fields each) and adds a key."""
    queue = model.QueueId.lmq(PARENT, "t")
    plain = wire.Commit(queue, GROUP, 4, (6,))
    counted = wire.Commit(queue, "g2", 2, (), model.Handouts(5, ((3, 4),)))
    old = wire.encode_json(0, 1, [], [], [plain])  # the JSON layout, the one older brokers read
    assert b"handouts" not in old
    assert wire.decode(old).commits == [plain]
    data = wire.encode_json(0, 1, [], [], [plain, counted])
    (length,) = struct.unpack_from(">I", data)
    head = json.loads(data[4 : 4 + length])
    assert [len(c) for c in head["commits"]] == [5, 5]
    assert wire.decode(data).commits == [plain, counted]
    assert wire.decode(wire.as_json(wire.encode(0, 1, [], [], [plain, counted]))).commits == [plain, counted]
    assert wire.decode(wire.encode(0, 1, [], [], [plain, counted])).commits == [plain, counted]  # binary
