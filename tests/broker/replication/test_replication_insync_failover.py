"""Three replicas, --min-insync-replicas 2, with broker processes on a real kube-apiserver + etcd
(docs/replication.md, "In-sync replicas"): a follower stopped (SIGSTOP) is recorded out of the slot's in-sync
set and sends go on; the owner killed, the stale follower declines the expired lease and the in-sync one takes
it, holding every acknowledged message; the stale one then catches up and joins again."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
from pathlib import Path

import grpc
from partitions import held
from waiting import eventually

from lmq_broker import model, testing
from lmq_broker.cluster import membership as mb
from lmq_broker.protocol import testing as protocol_testing
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as service_grpc
from lmq_broker.replication import kube as kube_api
from lmq_broker.supervisor import free_ports
from lmq_operator import testing as kube_testing

PARENT = "AGENT_TASK_NS"  # the bootstrap parent (LITE)
LEASE_MS = 1500
HEADERS = protocol_testing.Client.headers("client-1", "PYTHON", "5.1.2")


def start(tmp_path: Path, kube: kube_testing.KubeAPI, members: list[str], slot: int) -> testing.BrokerProcess:
    token = tmp_path / "token"
    token.write_text(kube.token)
    flags = ["--peers", ",".join(members), "--ordinal", str(slot), "--advertised-address", members[slot]]
    flags += ["--admin-access-key", "ak", "--admin-secret-key", "sk", "--flush-mode", "sync"]
    flags += ["--replicas", "3", "--min-insync-replicas", "2", "--lease-namespace", "default"]
    flags += ["--lease-prefix", "insync", "--lease-duration-ms", str(LEASE_MS), "--kube-api-server", kube.server]
    flags += ["--kube-token-file", str(token), "--kube-ca-file", str(kube.ca_file)]
    return testing.start_broker(tmp_path / f"b{slot}", int(members[slot].rsplit(":", 1)[1]), flags)


async def send_range(endpoint: str, lite: str, first: int, count: int) -> list[str]:
    """Send one by one; the ids acknowledged."""
    acked: list[str] = []
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = service_grpc.MessagingServiceStub(channel)
        for n in range(first, first + count):
            props = pb.SystemProperties(message_id=f"{lite}-{n}", message_type=pb.LITE, lite_topic=lite)
            msg = pb.Message(topic=pb.Resource(name=PARENT), body=f"{n}".encode(), system_properties=props)
            reply = await stub.SendMessage(spb.SendMessageRequest(messages=[msg]), metadata=HEADERS, timeout=10)
            if reply.status.code == pb.OK:
                acked.append(f"{lite}-{n}")
    return acked


def test_with_one_follower_stale_the_in_sync_one_takes_over_and_no_acknowledged_message_is_lost(
    tmp_path: Path, kube: kube_testing.KubeAPI
) -> None:
    members = [f"127.0.0.1:{p}" for p in free_ports("127.0.0.1", 3)]
    brokers = [start(tmp_path, kube, members, slot) for slot in range(3)]
    owner, in_sync, stale = brokers
    api = kube_api.ApiServer(kube.server, kube.token, kube.ca_file, "default")
    membership = mb.Membership.parse(",".join(members))
    lite = next(f"t{i}" for i in range(1000) if mb.owner(membership, model.QueueId.lmq(PARENT, f"t{i}").topic) == 0)

    def lease() -> kube_api.Lease:
        got = api.get("insync-slot-0")
        assert got is not None
        return got

    stopped: list[testing.BrokerProcess] = []

    def pause(broker: testing.BrokerProcess) -> None:
        os.kill(broker.pid, signal.SIGSTOP)
        stopped.append(broker)

    def resume(broker: testing.BrokerProcess) -> None:
        os.kill(broker.pid, signal.SIGCONT)
        stopped.remove(broker)

    try:
        eventually(lambda: lease().in_sync == (0, 1, 2), "both followers probed into the in-sync set")
        acked = asyncio.run(send_range(members[0], lite, 0, 30))
        assert len(acked) == 30
        pause(stale)  # it stops answering: recorded out of the set, sends go on with the owner and broker 1
        more = asyncio.run(send_range(members[0], lite, 30, 30))
        assert more == [f"{lite}-{n}" for n in range(30, 60)]
        acked += more
        assert lease().in_sync == (0, 1)
        owner.kill()
        pause(in_sync)  # for a while the stale follower is the only candidate alive
        resume(stale)
        eventually(lambda: "not in its in-sync set (0, 1)" in stale.log(), "the stale follower declined the lease")
        assert lease().holder.startswith("slot-0/")
        resume(in_sync)
        eventually(lambda: lease().holder.startswith("slot-1/"), "broker 1 took over")
        taken = lease()
        assert taken.transitions == 1
        assert taken.in_sync in {(0, 1), (0, 1, 2)}  # not below 2: the deposed owner stays (until a send fails it)
        # Broker 1 alone is below --min-insync-replicas 2 until broker 2 caught up and joined again; then the
        # dead owner fails a copy and leaves the set.
        attempts = itertools.count(60)  # a new id each try: a refused one may be stored, and is no duplicate
        acked += eventually(lambda: asyncio.run(send_range(members[1], lite, next(attempts), 1)), "a send via 1")
        assert lease().in_sync == (1, 2)
    finally:
        for b in stopped:
            os.kill(b.pid, signal.SIGCONT)
        for b in brokers:
            if b.alive():
                b.stop()
    for slot in (1, 2):
        found = held(tmp_path / f"b{slot}", lite)
        # Every acknowledged message, once and in order (sends refused and retried are the only others).
        assert [m for m in found if m in acked] == acked, slot
