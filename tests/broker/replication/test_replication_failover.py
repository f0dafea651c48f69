"""Failover with broker processes on a real kube-apiserver + etcd (docs/replication.md): two brokers with
--replicas 2, sends through the owner, kill -9 of the owner and its data directory deleted (disk loss): the
follower takes the slot's lease and holds every acknowledged message. Prints the failover time."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from waiting import eventually

from lmq_broker import model, testing
from lmq_broker.cluster import membership as mb
from lmq_broker.config import StoreConfig
from lmq_broker.protocol import testing as protocol_testing
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as service_grpc
from lmq_broker.replication import kube as kube_api
from lmq_broker.replication import setup as replication_setup
from lmq_broker.storage import store as lmq_store
from lmq_broker.supervisor import free_ports
from lmq_operator import testing as kube_testing

PARENT = "AGENT_TASK_NS"  # the bootstrap parent (LITE)
LEASE_MS = 1500
SENDS = 200


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[kube_testing.KubeAPI]:
    try:
        env = kube_testing.testenv(tmp_path_factory.mktemp("failover-testenv"))
        api = env.__enter__()
    except kube_testing.TestenvMissing as missing:
        pytest.fail(str(missing), pytrace=False)
    try:
        yield api
    finally:
        env.__exit__(None, None, None)


def start(
    tmp_path: Path,
    kube: kube_testing.KubeAPI,
    members: list[str],
    slot: int,
    *,
    prefix: str = "failover",
    env: dict[str, str] | None = None,
) -> testing.BrokerProcess:
    token = tmp_path / "token"
    token.write_text(kube.token)
    port = members[slot].rsplit(":", 1)[1]
    flags = ["--peers", ",".join(members), "--ordinal", str(slot), "--advertised-address", members[slot]]
    flags += ["--admin-access-key", "ak", "--admin-secret-key", "sk", "--flush-mode", "sync"]
    flags += ["--replicas", "2", "--lease-namespace", "default", "--lease-prefix", prefix]
    flags += ["--lease-duration-ms", str(LEASE_MS), "--kube-api-server", kube.server]
    flags += ["--kube-token-file", str(token), "--kube-ca-file", str(kube.ca_file)]
    return testing.start_broker(tmp_path / f"b{slot}", int(port), flags, env=env)


async def send_all(endpoint: str, lite: str, first: int = 0, count: int = SENDS) -> list[str]:
    """Send ``count`` messages one by one; the ids of those acknowledged."""
    acked: list[str] = []
    async with grpc.aio.insecure_channel(endpoint) as channel:
        for n in range(first, first + count):
            reply = await send_one(channel, lite, n)
            if reply.status.code == pb.OK:
                acked.append(f"{lite}-{n}")
    return acked


async def send_one(channel: grpc.aio.Channel, lite: str, n: int) -> spb.SendMessageResponse:
    headers = protocol_testing.Client.headers("client-1", "PYTHON", "5.1.2")
    props = pb.SystemProperties(message_id=f"{lite}-{n}", message_type=pb.LITE, lite_topic=lite)
    msg = pb.Message(topic=pb.Resource(name=PARENT), body=f"{n}".encode(), system_properties=props)
    stub = service_grpc.MessagingServiceStub(channel)
    reply: spb.SendMessageResponse = await stub.SendMessage(spb.SendMessageRequest(messages=[msg]), metadata=headers)
    return reply


def send_once(endpoint: str, lite: str, n: int) -> spb.SendMessageResponse:
    async def run() -> spb.SendMessageResponse:
        async with grpc.aio.insecure_channel(endpoint) as channel:
            return await send_one(channel, lite, n)

    return asyncio.run(run())


def held(data_dir: Path, lite: str) -> list[str]:
    store = lmq_store.LmqStore(StoreConfig(data_dir=data_dir))
    try:
        return [m.message_id for m in store.read(model.QueueId.lmq(PARENT, lite), 0, SENDS * 4)]
    finally:
        store.close()


def test_kill_9_of_the_owner_and_its_disk_loses_no_acknowledged_message_and_it_rejoins(
    tmp_path: Path, kube: kube_testing.KubeAPI
) -> None:
    members = [f"127.0.0.1:{p}" for p in free_ports("127.0.0.1", 2)]
    brokers = [start(tmp_path, kube, members, slot) for slot in (0, 1)]
    api = kube_api.ApiServer(kube.server, kube.token, kube.ca_file, "default")
    membership = mb.Membership.parse(",".join(members))
    lite = next(f"t{i}" for i in range(1000) if mb.owner(membership, model.QueueId.lmq(PARENT, f"t{i}").topic) == 0)

    def held_by(slot: int) -> kube_api.Lease | None:
        got = api.get("failover-slot-0")
        return got if got is not None and got.holder.startswith(f"slot-{slot}/") else None

    try:
        eventually(lambda: held_by(0), "the owner holds its lease")
        acked = asyncio.run(send_all(members[0], lite))
        assert len(acked) == SENDS
        brokers[0].kill()
        killed = time.monotonic()
        shutil.rmtree(tmp_path / "b0")  # the disk is gone too
        lease = eventually(lambda: held_by(1), "the follower took the lease", timeout_s=30)
        assert lease is not None
        failover_s = time.monotonic() - killed
        print(
            f"\nfailover: lease taken {failover_s:.2f} s after kill -9 (lease {LEASE_MS} ms), epoch {lease.transitions}"
        )
        assert lease.transitions == 1
        assert failover_s < LEASE_MS / 1000 + 5
        # The new owner takes the slot's sends, and refuses them while no other replica has them.
        reply = send_once(members[1], lite, SENDS)
        assert reply.status.code == pb.INTERNAL_ERROR
        assert "not enough in-sync replicas of slot 0: 1 of 2" in reply.status.message
        brokers[0] = start(tmp_path, kube, members, 0)  # back, on an empty disk: a follower of its own slot
        rejoined = time.monotonic()
        eventually(
            lambda: send_once(members[0], lite, SENDS + 1).status.code == pb.OK,
            "a send through the rejoined broker acknowledged",
        )
        print(f"rejoin: first send acknowledged {time.monotonic() - rejoined:.2f} s after the broker was ready again")
        acked.append(f"{lite}-{SENDS + 1}")
    finally:
        for b in brokers:
            if b.alive():
                b.stop()
    for slot in (1, 0):
        found = held(tmp_path / f"b{slot}", lite)
        # Every acknowledged message, in order; besides them only sends that were refused, and retried.
        assert list(dict.fromkeys(m for m in found if m in acked)) == acked, slot
        assert set(found) <= {*acked, f"{lite}-{SENDS}"}, slot


CONSUMER = protocol_testing.Client.headers("c1", "PYTHON", "5.1.2")


async def receive_all(endpoint: str, lite: str, want: int) -> list[str]:
    """Subscribe ``lite`` at ``endpoint`` and receive and ack until ``want`` messages came (or 10 s
    without any): the ids, in the order received."""
    group, parent = pb.Resource(name="executor-group"), pb.Resource(name=PARENT)  # bootstrapped
    got: list[str] = []
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = service_grpc.MessagingServiceStub(channel)
        sync = spb.SyncLiteSubscriptionRequest(
            action=pb.PARTIAL_ADD,
            topic=parent,
            group=group,
            lite_topic_set=[lite],
            offset_option=pb.OffsetOption(policy=pb.OffsetOption.MIN),  # from its first message
        )
        assert (await stub.SyncLiteSubscription(sync, metadata=CONSUMER)).status.code == pb.OK
        request = spb.ReceiveMessageRequest(
            group=group, message_queue=pb.MessageQueue(topic=parent), batch_size=32, auto_renew=True
        )
        deadline = time.monotonic() + 10
        while len(got) < want and time.monotonic() < deadline:
            frames = [f async for f in stub.ReceiveMessage(request, metadata=CONSUMER, timeout=5)]
            props = [f.message.system_properties for f in frames if f.HasField("message")]
            got += [p.message_id for p in props]
            entries = [
                spb.AckMessageEntry(message_id=p.message_id, receipt_handle=p.receipt_handle, lite_topic=lite)
                for p in props
            ]
            if entries:
                ack = spb.AckMessageRequest(group=group, topic=parent, entries=entries)
                assert (await stub.AckMessage(ack, metadata=CONSUMER)).status.code == pb.OK
    return got


def test_an_old_owner_back_on_its_disk_cuts_what_was_never_acknowledged_and_catches_up(
    tmp_path: Path, kube: kube_testing.KubeAPI
) -> None:
    members = [f"127.0.0.1:{p}" for p in free_ports("127.0.0.1", 2)]
    lose = tmp_path / "lose-copies"  # while it exists, the follower loses every copy sent to it
    failpoint = {replication_setup.FAILPOINT_ENV: str(lose)}
    brokers = [start(tmp_path, kube, members, s, prefix="rejoin", env=failpoint if s else None) for s in (0, 1)]
    api = kube_api.ApiServer(kube.server, kube.token, kube.ca_file, "default")
    membership = mb.Membership.parse(",".join(members))
    lite = next(f"r{i}" for i in range(1000) if mb.owner(membership, model.QueueId.lmq(PARENT, f"r{i}").topic) == 0)

    def held_by(slot: int) -> kube_api.Lease | None:
        got = api.get("rejoin-slot-0")
        return got if got is not None and got.holder.startswith(f"slot-{slot}/") else None

    try:
        eventually(lambda: held_by(0), "the owner holds its lease")
        acked = asyncio.run(send_all(members[0], lite, 0, 20))
        assert len(acked) == 20
        lose.touch()
        never = [f"{lite}-{n}" for n in range(20, 23)]  # stored by the owner only: refused
        for n in range(20, 23):
            reply = send_once(members[0], lite, n)
            assert reply.status.code == pb.INTERNAL_ERROR
            assert "not enough in-sync replicas of slot 0: 1 of 2" in reply.status.message
        brokers[0].kill()  # its disk is kept, with the three records nobody else has
        lose.unlink()
        eventually(lambda: held_by(1), "the follower took the lease", timeout_s=30)
        # The new owner stores sends at the offsets the old one had used (refused: no other replica yet).
        retried = [f"{lite}-{n}" for n in range(100, 103)]
        for n in range(100, 103):
            assert send_once(members[1], lite, n).status.code == pb.INTERNAL_ERROR
        brokers[0] = start(tmp_path, kube, members, 0, prefix="rejoin")  # back on its disk: a follower of its own slot
        eventually(lambda: send_once(members[1], lite, 103).status.code == pb.OK, "a send acknowledged again")
        acked.append(f"{lite}-103")
        acked += asyncio.run(send_all(members[1], lite, 104, 5))
        assert len(acked) == 26
        received = asyncio.run(receive_all(members[1], lite, len(acked) + len(retried)))
        assert not set(received) & set(never)  # what was cut is never delivered
        assert [m for m in dict.fromkeys(received) if m in acked] == acked
    finally:
        for b in brokers:
            if b.alive():
                b.stop()
    owner, rejoined = held(tmp_path / "b1", lite), held(tmp_path / "b0", lite)
    assert rejoined == owner  # the same records at the same offsets
    assert not set(owner) & set(never)
    assert [m for m in owner if m in acked] == acked  # every acknowledged one, once, in order
    assert set(owner) <= {*acked, *retried}
    assert owner[20:23] == retried  # at the offsets the old owner had used for what it cut
