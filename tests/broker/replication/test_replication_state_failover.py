"""State rows through a real failover (docs/replication.md, "What is replicated"): broker processes on a real
kube-apiserver + etcd, --replicas 2, kill -9 of the owner and its data directory deleted. The new owner serves
a subscription made at the old one without the client subscribing again, and an MQTT client (paho-mqtt) finds
its persistent session with its queued QoS 1 messages, and a retained message, there."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import grpc
import raw_v2
from testing_mqtt import Peer
from waiting import eventually

from lmq_broker import model, testing
from lmq_broker.cluster import membership as mb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as service_grpc
from lmq_broker.replication import kube as kube_api
from lmq_broker.supervisor import free_ports
from lmq_operator import testing as kube_testing

PARENT, GROUP = raw_v2.PARENT, raw_v2.GROUP  # the bootstrap parent (LITE) and its group
LEASE_MS = 1500
SUBSCRIBER = "subscriber-1"


def start(tmp_path: Path, kube: kube_testing.KubeAPI, members: list[str], slot: int) -> testing.BrokerProcess:
    token = tmp_path / "token"
    token.write_text(kube.token)
    port = members[slot].rsplit(":", 1)[1]
    flags = ["--peers", ",".join(members), "--ordinal", str(slot), "--advertised-address", members[slot]]
    flags += ["--admin-access-key", "ak", "--admin-secret-key", "sk", "--flush-mode", "sync", "--mqtt-port", "0"]
    flags += ["--replicas", "2", "--lease-namespace", "default", "--lease-prefix", "state"]
    flags += ["--lease-duration-ms", str(LEASE_MS), "--kube-api-server", kube.server]
    flags += ["--kube-token-file", str(token), "--kube-ca-file", str(kube.ca_file)]
    return testing.start_broker(tmp_path / f"b{slot}", int(port), flags)


async def call(endpoint: str, method: str, request: object) -> object:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = service_grpc.MessagingServiceStub(channel)
        answer: object = await getattr(stub, method)(request, metadata=raw_v2.headers(SUBSCRIBER))
        return answer


def subscribe(endpoint: str, lite: str) -> int:
    request = spb.SyncLiteSubscriptionRequest(
        action=pb.PARTIAL_ADD, topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP), lite_topic_set=[lite]
    )
    reply = asyncio.run(call(endpoint, "SyncLiteSubscription", request))
    assert isinstance(reply, spb.SyncLiteSubscriptionResponse)
    return reply.status.code


def send(endpoint: str, lite: str, n: int) -> int:
    props = pb.SystemProperties(message_id=f"{lite}-{n}", message_type=pb.LITE, lite_topic=lite)
    msg = pb.Message(topic=pb.Resource(name=PARENT), body=f"{n}".encode(), system_properties=props)
    reply = asyncio.run(call(endpoint, "SendMessage", spb.SendMessageRequest(messages=[msg])))
    assert isinstance(reply, spb.SendMessageResponse)
    return reply.status.code


def received(endpoint: str) -> list[str]:
    async def run() -> list[str]:
        async with grpc.aio.insecure_channel(endpoint) as channel:
            stub = service_grpc.MessagingServiceStub(channel)
            frames = await raw_v2.poll(stub, SUBSCRIBER, wait_s=10)
        return [f.message.system_properties.message_id for f in frames if f.HasField("message")]

    return asyncio.run(run())


def test_kill_9_of_the_owner_and_its_disk_keeps_subscriptions_mqtt_sessions_and_retained_messages(
    tmp_path: Path, kube: kube_testing.KubeAPI
) -> None:
    members = [f"127.0.0.1:{p}" for p in free_ports("127.0.0.1", 2)]
    brokers = [start(tmp_path, kube, members, slot) for slot in (0, 1)]
    api = kube_api.ApiServer(kube.server, kube.token, kube.ca_file, "default")
    membership = mb.Membership.parse(",".join(members))
    mine = [f"s{i}" for i in range(1000) if mb.owner(membership, model.QueueId.lmq(PARENT, f"s{i}").topic) == 0]
    lite, queued, kept = mine[0], f"{PARENT}/{mine[1]}", f"{PARENT}/{mine[2]}"
    peers: list[Peer] = []

    def held_by(slot: int) -> bool:
        got = api.get("state-slot-0")
        return got is not None and got.holder.startswith(f"slot-{slot}/")

    def shadowed(kind: str) -> bool:
        return raw_v2.metric(brokers[1], "lmq_replication_state_rows", kind=kind, slot="0") >= 1

    try:
        eventually(lambda: held_by(0), "the owner holds its lease")
        assert subscribe(members[0], lite) == pb.OK
        session = Peer(brokers[0].mqtt_port, "session-1", clean=False)
        peers.append(session)
        assert session.subscribe((queued, 1)) == [1]
        session.disconnect()
        publisher = Peer(brokers[0].mqtt_port, "publisher")
        peers.append(publisher)
        publisher.publish(kept, b"retained", 1, True)
        for n in range(3):
            publisher.publish(queued, f"queued-{n}".encode(), 1)
        publisher.disconnect()
        for kind in ("sub", "mqtt-sessions", "mqtt-retained"):
            eventually(lambda kind=kind: shadowed(kind), f"the follower's {kind} rows of slot 0")  # type: ignore[misc]
        brokers[0].kill()
        shutil.rmtree(tmp_path / "b0")  # the disk is gone too
        eventually(lambda: held_by(1), "the follower took the lease", timeout_s=30)
        eventually(lambda: "slot 0 taken over" in brokers[1].log(), "its state rows installed")
        resumed = Peer(brokers[1].mqtt_port, "session-1", clean=False)
        peers.append(resumed)
        assert resumed.connack == (True, "Success")  # the session is there
        assert [m.payload for m in resumed.wait_count(3)] == [b"queued-0", b"queued-1", b"queued-2"]
        reader = Peer(brokers[1].mqtt_port, "reader")
        peers.append(reader)
        reader.subscribe((kept, 1))
        assert [(m.payload, m.retain) for m in reader.wait_count(1)] == [(b"retained", True)]
        # The old owner back on an empty disk, a follower now: sends of the slot are acknowledged again.
        brokers[0] = start(tmp_path, kube, members, 0)
        eventually(lambda: send(members[1], lite, 0) == pb.OK, "a send through the new owner acknowledged")
        assert set(received(members[1])) == {f"{lite}-0"}  # the subscriber, without subscribing again
    finally:
        for peer in peers:
            peer.disconnect()
        for b in brokers:
            if b.alive():
                b.stop()
