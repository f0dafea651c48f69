"""Failover with broker processes on a real kube-apiserver + etcd (docs/replication.md): two brokers with
--replicas 2, sends through the owner, kill -9 of the owner and its data directory deleted (disk loss): the
follower takes the slot's lease and holds every acknowledged message. Prints the failover time."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from raw_v2 import metric
from waiting import eventually, eventually_async

from lmq_broker import model, testing
from lmq_broker.admin.client import AdminClient
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
        # the premise: a follower in sync (reconciled). Acknowledged sends do not imply it: a follower whose
        # channel to the owner was still backing off from a connect before the owner listened kept failing its
        # reconciles while the sends went on (on a quiet host the 200 sends end within that), and one never in
        # sync does not take the slot over
        eventually(lambda: metric(brokers[1], "lmq_replication_in_sync", slot="0") == 1, "the follower in sync")
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


GROUP = "executor-group"  # the bootstrap lite group
CONSUMER = protocol_testing.Client.headers("c1", "PYTHON", "5.1.2")
PROCESSING_S = 0.02  # the consumer's work per message: slower than the producer, so a backlog waits at the kill
# The producer waits while this many sends are not received yet: the consumer (about 16 messages a second, one
# long poll at the follower per round) drains the backlog in a few seconds after the failover. Unbounded, a
# quiet host's producer ran 500 ahead, and draining that in order outlasted the final wait (nothing was lost).
MAX_BACKLOG = 40


@dataclass
class Tally:
    sent: list[str] = field(default_factory=list)  # acknowledged sends, by message id
    sent_at: dict[str, float] = field(default_factory=dict)  # message id -> when its send was acknowledged
    killed_at: float = 0.0  # when the owner was killed
    diagnosis: str = ""  # what the brokers said of the topics when a send was not received
    assigned: list[str] = field(default_factory=list)  # the consumer's last assignments
    steps: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=60))  # its last steps
    received: list[tuple[str, float, str]] = field(default_factory=list)  # (message id, when, from which broker)
    acked: dict[str, float] = field(default_factory=dict)  # message id -> when its ack was answered OK
    stop_producing: asyncio.Event = field(default_factory=asyncio.Event)
    stop_consuming: asyncio.Event = field(default_factory=asyncio.Event)


async def produce(access: str, lites: list[str], tally: Tally) -> None:
    """Steady sends through the access broker, a new message after each answer (a refused one is not retried:
    only acknowledged sends must be delivered), at most ``MAX_BACKLOG`` ahead of the consumer."""
    async with grpc.aio.insecure_channel(access) as channel:
        for n in itertools.count():
            while len(tally.sent) - len(tally.received) >= MAX_BACKLOG and not tally.stop_producing.is_set():
                await asyncio.sleep(0.01)
            if tally.stop_producing.is_set():
                return
            lite = lites[n % len(lites)]
            try:
                reply = await send_one(channel, lite, n)
            except grpc.aio.AioRpcError:
                continue
            if reply.status.code == pb.OK:
                tally.sent.append(f"{lite}-{n}")
                tally.sent_at[f"{lite}-{n}"] = time.monotonic()
            else:
                await asyncio.sleep(0.05)  # a client's retry backoff


async def consume(access: str, tally: Tally) -> None:
    """A push consumer with lmq's v2 stubs: its assignments asked of the access broker (again after a failed
    receive, as the official clients do on their next scan), a receive loop over them, each message acked."""
    group, parent = pb.Resource(name=GROUP), pb.Resource(name=PARENT)
    channels: dict[str, grpc.aio.Channel] = {}
    assigned: list[str] = []
    try:
        while not tally.stop_consuming.is_set():
            if not assigned:
                assigned = tally.assigned = await assignments(channels, access)
                step(tally, f"assigned {assigned}")
            for endpoint in list(assigned):
                stub: service_grpc.MessagingServiceAsyncStub = service_grpc.MessagingServiceStub(
                    channel_of(channels, endpoint)
                )
                request = spb.ReceiveMessageRequest(
                    group=group, message_queue=pb.MessageQueue(topic=parent), batch_size=8
                )
                request.invisible_duration.FromSeconds(5)
                request.long_polling_timeout.FromMilliseconds(300)
                try:
                    frames = [f async for f in stub.ReceiveMessage(request, metadata=CONSUMER, timeout=3)]
                except grpc.aio.AioRpcError as exc:
                    assigned = []  # that broker is gone: ask for the assignments again
                    step(tally, f"receive at {endpoint}: {exc.code().name}")
                    break
                step(tally, f"receive at {endpoint}: {sum(f.HasField('message') for f in frames)} messages")
                for frame in frames:
                    if frame.HasField("message"):
                        await handle(stub, frame.message, endpoint, tally)
    finally:
        for channel in channels.values():
            await channel.close(None)


def step(tally: Tally, what: str) -> None:
    tally.steps.append(f"{time.monotonic() - tally.killed_at:.2f} {what}")


def channel_of(channels: dict[str, grpc.aio.Channel], endpoint: str) -> grpc.aio.Channel:
    if endpoint not in channels:
        channels[endpoint] = grpc.aio.insecure_channel(endpoint)
    return channels[endpoint]


async def assignments(channels: dict[str, grpc.aio.Channel], access: str) -> list[str]:
    stub = service_grpc.MessagingServiceStub(channel_of(channels, access))
    request = spb.QueryAssignmentRequest(topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP))
    try:
        reply = await stub.QueryAssignment(request, metadata=CONSUMER, timeout=3)
    except grpc.aio.AioRpcError:
        return []
    out = []
    for assignment in reply.assignments:
        first = assignment.message_queue.broker.endpoints.addresses[0]
        out.append(f"{first.host}:{first.port}")
    return out


async def handle(
    stub: service_grpc.MessagingServiceAsyncStub, message: pb.Message, endpoint: str, tally: Tally
) -> None:
    props = message.system_properties
    tally.received.append((props.message_id, time.monotonic(), endpoint))
    await asyncio.sleep(PROCESSING_S)
    entry = spb.AckMessageEntry(
        message_id=props.message_id, receipt_handle=props.receipt_handle, lite_topic=props.lite_topic
    )
    request = spb.AckMessageRequest(group=pb.Resource(name=GROUP), topic=pb.Resource(name=PARENT), entries=[entry])
    try:
        reply = await stub.AckMessage(request, metadata=CONSUMER, timeout=5)
    except grpc.aio.AioRpcError:
        return  # not acked: delivered again (at-least-once)
    if reply.status.code == pb.OK:
        tally.acked[props.message_id] = time.monotonic()


async def subscribe(access: str, lites: list[str]) -> None:
    async with grpc.aio.insecure_channel(access) as channel:
        stub = service_grpc.MessagingServiceStub(channel)
        request = spb.SyncLiteSubscriptionRequest(
            action=pb.PARTIAL_ADD, topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP), lite_topic_set=lites
        )
        reply = await stub.SyncLiteSubscription(request, metadata=CONSUMER, timeout=5)
        assert reply.status.code == pb.OK, reply.status.message


async def wait_for(check: Callable[[], object], what: str, timeout_s: float = 30) -> None:
    """``eventually`` while the producer and the consumer run on this loop."""
    await eventually_async(check, what, timeout_s, interval_s=0.02)


def test_a_consumer_keeps_receiving_from_the_new_holder_after_kill_9_of_the_owner(
    tmp_path: Path, kube: kube_testing.KubeAPI
) -> None:
    """R=2, a steady producer and a consumer acking, both through the broker that survives (a Service's pick);
    the topics live on the other one, which is killed with its disk. The consumer keeps receiving from the new
    holder; no acknowledged send is lost, nothing acked is delivered again."""
    members = [f"127.0.0.1:{p}" for p in free_ports("127.0.0.1", 2)]
    brokers = [start(tmp_path, kube, members, slot, prefix="consumers") for slot in (0, 1)]  # leases of its own
    api = kube_api.ApiServer(kube.server, kube.token, kube.ca_file, "default")
    membership = mb.Membership.parse(",".join(members))
    lites = [f"t{i}" for i in range(1000) if mb.owner(membership, model.QueueId.lmq(PARENT, f"t{i}").topic) == 0][:4]
    access = members[1]

    def holder_is(slot: int) -> bool:
        got = api.get("consumers-slot-0")
        return got is not None and got.holder.startswith(f"slot-{slot}/")

    async def run() -> tuple[Tally, float]:
        tally = Tally()
        await subscribe(access, lites)
        tasks = [asyncio.create_task(produce(access, lites, tally)), asyncio.create_task(consume(access, tally))]
        try:
            await wait_for(lambda: len(tally.acked) >= 20, "the consumer acked 20 messages")
            await wait_for(lambda: len(tally.sent) - len(tally.received) >= 10, "a backlog at the owner")
            brokers[0].kill()
            killed = tally.killed_at = time.monotonic()
            shutil.rmtree(tmp_path / "b0")  # its disk is gone too
            await wait_for(
                lambda: any(at > killed and where == access for _, at, where in tally.received),
                "a delivery from the new holder",
            )
            first = min(at for _, at, where in tally.received if at > killed and where == access) - killed
            restart = functools.partial(start, tmp_path, kube, members, 0, prefix="consumers")
            brokers[0] = await asyncio.to_thread(restart)  # a follower, on an empty disk
            before = len(tally.sent)
            await wait_for(lambda: len(tally.sent) >= before + 20, "sends acknowledged again")
            tally.stop_producing.set()
            with contextlib.suppress(AssertionError):  # the asserts below name what was not received, and when sent
                await wait_for(lambda: set(tally.sent) <= {m for m, _, _ in tally.received}, "every send received")
            if not set(tally.sent) <= {m for m, _, _ in tally.received}:
                tally.diagnosis = await asyncio.to_thread(diagnose, brokers, lites)
                asking: dict[str, grpc.aio.Channel] = {}
                now = await assignments(asking, access)
                await asking[access].close(None)
                tally.diagnosis += f"\nconsumer: assigned {tally.assigned} (asked now: {now})"
                tally.diagnosis += "\nits last steps (s after kill -9):\n" + "\n".join(tally.steps)
        finally:
            tally.stop_producing.set()
            tally.stop_consuming.set()
            await asyncio.gather(*tasks)
        return tally, first

    try:
        eventually(lambda: holder_is(0), "the owner holds its lease")
        tally, first_s = asyncio.run(run())
        assert holder_is(1)
    finally:
        for b in brokers:
            if b.alive():
                b.stop()
    received = [m for m, _, _ in tally.received]
    lost = set(tally.sent) - set(received)
    again = [m for m, at, _ in tally.received if m in tally.acked and tally.acked[m] < at]
    print(
        f"\nconsumer failover: first delivery from the new holder {first_s:.2f} s after kill -9 (lease {LEASE_MS} ms);"
        f" {len(tally.sent)} sends acknowledged, {len(received)} deliveries ({len(received) - len(set(received))}"
        f" repeated), {len(tally.acked)} acked, {len(lost)} lost, {len(again)} acked ones delivered again"
    )
    assert not lost, f"{missing(tally, lost)}\n{tally.diagnosis}"
    assert not again


def diagnose(brokers: list[testing.BrokerProcess], lites: list[str]) -> str:
    """Each live broker's view of the topics: end, the group's commit point, subscribed clients."""
    lines = []
    for n, broker in enumerate(brokers):
        if not broker.alive():
            continue
        with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
            for lite in lites:
                try:
                    got = admin.describe_lite_topic(PARENT, lite)
                except Exception as exc:
                    lines.append(f"broker {n} {lite}: {exc}")
                    continue
                lines.append(f"broker {n} {lite}: end {got.meta.max_offset} min {got.meta.min_offset} commit "
                             f"{dict(got.group_offsets)} clients {got.subscribed_clients}")  # fmt: skip
    return "\n".join(lines)


def missing(tally: Tally, lost: set[str]) -> str:
    """Per lite topic: how many of its acknowledged sends were not received, when the first and the last of
    them were sent (s after kill -9), and how many of its sends after the kill were received."""
    lines = []
    for lite in sorted({m.rsplit("-", 1)[0] for m in lost}):
        gone = sorted(tally.sent_at[m] - tally.killed_at for m in lost if m.rsplit("-", 1)[0] == lite)
        after = [
            m for m, at, _ in tally.received if m.startswith(f"{lite}-") and tally.sent_at.get(m, 0) > tally.killed_at
        ]
        lines.append(f"{lite}: {len(gone)} not received, sent {gone[0]:.2f}..{gone[-1]:.2f} s after kill -9; "
                     f"{len(after)} of its sends after the kill received")  # fmt: skip
    return "; ".join(lines)


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
        # the premise: a follower in sync (reconciled, state rows fetched), so it may take the slot over
        eventually(lambda: metric(brokers[1], "lmq_replication_in_sync", slot="0") == 1, "the follower in sync")
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
    # every acknowledged one, in order; only the send of 103, retried until acknowledged, may be stored more than
    # once (a refused attempt can still have been stored: at-least-once for a send that failed)
    assert list(dict.fromkeys(m for m in owner if m in acked)) == acked
    assert [m for m in owner if m in acked and m != f"{lite}-103"] == [m for m in acked if m != f"{lite}-103"]
    assert set(owner) <= {*acked, *retried}
    assert owner[20:23] == retried  # at the offsets the old owner had used for what it cut


def test_a_follower_whose_reconcile_failed_is_in_sync_again_on_its_own_and_takes_over(
    tmp_path: Path, kube: kube_testing.KubeAPI
) -> None:
    """The follower, back on an empty disk, is still a member of the in-sync set (no copy failed there: no send
    came since) but holds nothing: only a reconcile brings the slot's messages back, and its reconciles fail
    (a failpoint: as a call timing out under load would). Once they can succeed it is in sync again with no new
    send, on its own retries, and takes the slot over after kill -9 of the owner with every acknowledged
    message."""
    members = [f"127.0.0.1:{p}" for p in free_ports("127.0.0.1", 2)]
    fail = tmp_path / "fail-reconcile"  # while it exists, every reconcile the follower tries fails
    failpoint = {replication_setup.FAILPOINT_RECONCILE_ENV: str(fail)}
    brokers = [start(tmp_path, kube, members, s, prefix="reconcile", env=failpoint if s else None) for s in (0, 1)]
    api = kube_api.ApiServer(kube.server, kube.token, kube.ca_file, "default")
    membership = mb.Membership.parse(",".join(members))
    lite = next(f"c{i}" for i in range(1000) if mb.owner(membership, model.QueueId.lmq(PARENT, f"c{i}").topic) == 0)

    def held_by(slot: int) -> kube_api.Lease | None:
        got = api.get("reconcile-slot-0")
        return got if got is not None and got.holder.startswith(f"slot-{slot}/") else None

    def in_sync() -> bool:
        return metric(brokers[1], "lmq_replication_in_sync", slot="0") == 1

    def failed() -> float:
        return metric(brokers[1], "lmq_replication_reconciles_total", result="failed")

    try:
        eventually(lambda: held_by(0), "the owner holds its lease")
        acked = asyncio.run(send_all(members[0], lite, 0, 50))
        assert len(acked) == 50
        eventually(in_sync, "the follower in sync")
        fail.touch()
        brokers[1].kill()
        shutil.rmtree(tmp_path / "b1")
        brokers[1] = start(tmp_path, kube, members, 1, prefix="reconcile", env=failpoint)
        eventually(lambda: failed() >= 3, "the follower's reconciles failed and were tried again")
        assert not in_sync()
        assert metric(brokers[1], "lmq_replication_copied_total") == 0  # no send since: no copy brought anything
        failures = failed()
        fail.unlink()
        allowed = time.monotonic()
        eventually(in_sync, "the follower in sync again with no new send", timeout_s=15)
        back_s = time.monotonic() - allowed
        assert metric(brokers[1], "lmq_replication_reconciles_total", result="ok") >= 1
        brokers[0].kill()
        killed = time.monotonic()
        eventually(lambda: held_by(1), "the follower took the lease", timeout_s=30)
        print(
            f"\nreconcile: in sync {back_s:.2f} s after its reconciles could succeed again ({failures:.0f} failed "
            f"before); lease taken {time.monotonic() - killed:.2f} s after kill -9 (lease {LEASE_MS} ms)"
        )
    finally:
        for b in brokers:
            if b.alive():
                b.stop()
    assert held(tmp_path / "b1", lite) == acked  # every acknowledged message, once and in order


async def receive_some(
    endpoint: str,
    lite: str,
    want: int,
    *,
    ack_from: int = 0,
    batch: int = 8,
    wait_s: float = 10,
    acked: list[str] | None = None,
) -> list[str]:
    """Subscribe ``lite`` at ``endpoint`` (no offset option: the group's commit point as stored there) and
    receive until ``want`` messages came (or ``wait_s``), ``batch`` at most a call, invisible for 60 s; ack only
    those whose body (the send's number) is ``ack_from`` or more (their ids to ``acked`` when answered OK). The
    ids received, in order."""
    group, parent = pb.Resource(name=GROUP), pb.Resource(name=PARENT)
    got: list[str] = []
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = service_grpc.MessagingServiceStub(channel)
        sync = spb.SyncLiteSubscriptionRequest(action=pb.PARTIAL_ADD, topic=parent, group=group, lite_topic_set=[lite])
        assert (await stub.SyncLiteSubscription(sync, metadata=CONSUMER)).status.code == pb.OK
        request = spb.ReceiveMessageRequest(
            group=group, message_queue=pb.MessageQueue(topic=parent), batch_size=min(batch, want - len(got))
        )
        request.invisible_duration.FromSeconds(60)
        request.long_polling_timeout.FromSeconds(1)
        deadline = time.monotonic() + wait_s
        while len(got) < want and time.monotonic() < deadline:
            request.batch_size = min(batch, want - len(got))
            frames = [f async for f in stub.ReceiveMessage(request, metadata=CONSUMER, timeout=5)]
            messages = [f.message for f in frames if f.HasField("message")]
            got += [m.system_properties.message_id for m in messages]
            props = [m.system_properties for m in messages if int(m.body) >= ack_from]
            entries = [
                spb.AckMessageEntry(message_id=p.message_id, receipt_handle=p.receipt_handle, lite_topic=lite)
                for p in props
            ]
            if entries:  # answered or refused alike: what counts is what the follower stored
                ack = spb.AckMessageRequest(group=group, topic=parent, entries=entries)
                reply = await stub.AckMessage(ack, metadata=CONSUMER)
                if acked is not None and reply.status.code == pb.OK:
                    acked += [e.message_id for e in entries]
    return got


@dataclass
class Two:
    """Two broker processes with --replicas 2, leases of their own (``prefix``), and a lite topic of slot 0."""

    tmp_path: Path
    kube: kube_testing.KubeAPI
    prefix: str
    members: list[str]
    brokers: list[testing.BrokerProcess]
    lite: str
    api: kube_api.ApiServer

    @classmethod
    def start(
        cls, tmp_path: Path, kube: kube_testing.KubeAPI, prefix: str, follower_env: dict[str, str] | None = None
    ) -> Two:
        """Started; returns once broker 0 holds slot 0's lease and broker 1 is in sync with it."""
        members = [f"127.0.0.1:{p}" for p in free_ports("127.0.0.1", 2)]
        brokers = [start(tmp_path, kube, members, s, prefix=prefix, env=follower_env if s else None) for s in (0, 1)]
        membership = mb.Membership.parse(",".join(members))
        lite = next(
            f"{prefix}{i}"
            for i in range(1000)
            if mb.owner(membership, model.QueueId.lmq(PARENT, f"{prefix}{i}").topic) == 0
        )
        api = kube_api.ApiServer(kube.server, kube.token, kube.ca_file, "default")
        two = cls(tmp_path, kube, prefix, members, brokers, lite, api)
        try:
            eventually(lambda: two.held_by(0), "broker 0 holds its lease")
            eventually(lambda: two.in_sync(1), "broker 1 in sync")
        except BaseException:
            two.stop()
            raise
        return two

    def held_by(self, slot: int) -> kube_api.Lease | None:
        got = self.api.get(f"{self.prefix}-slot-0")
        return got if got is not None and got.holder.startswith(f"slot-{slot}/") else None

    def in_sync(self, slot: int) -> bool:
        return metric(self.brokers[slot], "lmq_replication_in_sync", slot="0") == 1

    def restart(self, slot: int) -> None:
        self.brokers[slot] = start(self.tmp_path, self.kube, self.members, slot, prefix=self.prefix)

    def stop(self) -> None:
        for b in self.brokers:
            if b.alive():
                b.stop()


def test_an_ack_of_a_record_the_follower_lacks_never_skips_what_the_new_owner_stores_there(
    tmp_path: Path, kube: kube_testing.KubeAPI
) -> None:
    """A consumer at the owner acks, above a message it holds unacked, a message whose send was refused (stored
    at the owner only: its copy lost on the way). The commit copy reaches the follower, which lacks that offset.
    After kill -9 of the owner the follower takes over and stores a new send at that offset, acknowledged once
    the old owner rejoined (its record cut): the consumer must receive it. Before the fix the follower stored the
    acked offset past its end as it came, and the new owner passed the acknowledged send over as acked."""
    lose = tmp_path / "lose-copies"  # while it exists, the follower loses every copy of messages sent to it
    two = Two.start(tmp_path, kube, "ackgap", {replication_setup.FAILPOINT_ENV: str(lose)})
    members, brokers, lite = two.members, two.brokers, two.lite
    try:
        assert asyncio.run(send_all(members[0], lite, 0, 2)) == [f"{lite}-0", f"{lite}-1"]  # offsets 0 and 1
        lose.touch()
        assert send_once(members[0], lite, 2).status.code == pb.INTERNAL_ERROR  # offset 2: at the owner only
        # offset 0 received and held unacked; 1 and 2 acked above it: the commit point 0, acked {1, 2}
        assert asyncio.run(receive_some(members[0], lite, 3, ack_from=1)) == [f"{lite}-{n}" for n in range(3)]
        eventually(
            lambda: (
                metric(brokers[1], "lmq_replication_commits_stored_total", handouts="yes")
                + metric(brokers[1], "lmq_replication_commits_stored_total", handouts="no")
                + metric(brokers[1], "lmq_replication_copies_refused_total", reason="out_of_sync")
                >= 1
            ),
            "the acks' commit copy reached the follower",
        )
        brokers[0].kill()
        lose.unlink()
        eventually(lambda: two.held_by(1), "the follower took the lease", timeout_s=30)
        two.restart(0)  # back on its disk: its offset 2 is cut
        eventually(lambda: two.in_sync(0), "the old owner in sync")
        reply = send_once(members[1], lite, 3)
        assert reply.status.code == pb.OK, reply.status.message  # stored at offset 2 at the new owner
        received = asyncio.run(receive_some(members[1], lite, 2))
    finally:
        two.stop()
    assert held(tmp_path / "b1", lite) == [f"{lite}-{n}" for n in (0, 1, 3)]
    assert f"{lite}-3" in received, received  # the acknowledged send at the offset the old owner's ack named


def test_a_broker_that_holds_a_slot_again_serves_its_consumers_from_the_commit_points_copied_meanwhile(
    tmp_path: Path, kube: kube_testing.KubeAPI
) -> None:
    """Broker 1 holds slot 0 (a failover) and a consumer acks 5 messages there; broker 1 is paused (SIGSTOP)
    past its lease, broker 0 takes the slot back and the consumer acks the other 5 there (their commit copies
    stored at broker 1); kill -9 of broker 0: broker 1 holds the slot again. Nothing acked may be delivered
    again. Before the fix broker 1 served the group from the commit point it remembered from its own holding
    (its cache: "this broker is the only writer of offsets"), not from its store: the 5 acked at broker 0 came
    again."""
    two = Two.start(tmp_path, kube, "pingpong")
    members, brokers, lite = two.members, two.brokers, two.lite
    try:
        assert len(asyncio.run(send_all(members[0], lite, 0, 10))) == 10
        brokers[0].kill()  # its disk kept
        eventually(lambda: two.held_by(1), "broker 1 took the lease", timeout_s=30)
        two.restart(0)
        eventually(lambda: two.in_sync(0), "broker 0 back in sync")
        acked: list[str] = []
        first = asyncio.run(receive_some(members[1], lite, 5, batch=5, acked=acked))
        assert first == acked == [f"{lite}-{n}" for n in range(5)]  # acked at broker 1: its commit point 5
        os.kill(brokers[1].process.pid, signal.SIGSTOP)  # a pause longer than its lease
        try:
            eventually(lambda: two.held_by(0), "broker 0 took the lease back", timeout_s=30)
        finally:
            os.kill(brokers[1].process.pid, signal.SIGCONT)
        eventually(lambda: two.in_sync(1), "broker 1 in sync with broker 0's epoch")
        second = asyncio.run(receive_some(members[0], lite, 5, acked=acked))
        assert second == acked[5:] == [f"{lite}-{n}" for n in range(5, 10)]  # acked at broker 0: on broker 1 too
        brokers[0].kill()
        eventually(lambda: two.held_by(1), "broker 1 holds the slot again", timeout_s=30)
        again = asyncio.run(receive_some(members[1], lite, 10, wait_s=4))
    finally:
        two.stop()
    assert again == [], f"acked messages delivered again: {again}"


class Steady:
    """Sends to one lite topic through one broker, one after another (3 s each at most), in a thread of its
    own; the ids acknowledged, in order."""

    def __init__(self, endpoint: str, lite: str) -> None:
        self.acked: list[str] = []
        self._endpoint, self._lite = endpoint, lite
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="steady-sender")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the sender did not stop"

    async def _run(self) -> None:
        async with grpc.aio.insecure_channel(self._endpoint) as channel:
            for n in itertools.count():
                if self._stop.is_set():
                    return
                try:
                    reply = await asyncio.wait_for(send_one(channel, self._lite, n), 3)
                except (grpc.aio.AioRpcError, TimeoutError):
                    await asyncio.sleep(0.05)
                    continue
                if reply.status.code == pb.OK:
                    self.acked.append(f"{self._lite}-{n}")


def acknowledged(endpoint: str, lite: str, n: int) -> bool:
    """One send answered OK (False when refused, or when the broker cannot be reached: just restarted)."""
    try:
        return send_once(endpoint, lite, n).status.code == pb.OK
    except grpc.aio.AioRpcError:
        return False


def test_kill_9_of_the_follower_then_of_the_owner_under_sends_loses_no_acknowledged_message(
    tmp_path: Path, kube: kube_testing.KubeAPI
) -> None:
    """A double fault with both disks kept: the follower killed -9 while copies are under way, the owner right
    after. The follower back first must not take the slot over (it is not reconciled with a live holder: the
    copies it missed are on the owner only), so the slot refuses sends; the owner back on its disk holds its
    lease again, the follower catches up, and both hold every acknowledged message once, in order."""
    two = Two.start(tmp_path, kube, "double")
    members, brokers, lite = two.members, two.brokers, two.lite
    try:
        sender = Steady(members[0], lite)
        try:
            eventually(lambda: len(sender.acked) >= 30, "30 sends acknowledged")
            brokers[1].kill()  # copies under way
            brokers[0].kill()
        finally:
            sender.stop()
        acked = list(sender.acked)
        two.restart(1)
        until = time.monotonic() + 2 * LEASE_MS / 1000 + 1  # the owner's lease expired meanwhile
        while time.monotonic() < until:
            assert two.held_by(1) is None, "the follower took the slot over without the copies it missed"
            assert not acknowledged(members[1], lite, 10_000)
            time.sleep(0.2)
        two.restart(0)
        eventually(lambda: acknowledged(members[0], lite, 10_001), "sends acknowledged again")
        acked.append(f"{lite}-10001")
        eventually(lambda: two.in_sync(1), "the follower in sync")
        lease = two.held_by(0)
        assert lease is not None and lease.transitions == 0  # the owner kept its slot, in its epoch
    finally:
        two.stop()
    for slot in (0, 1):
        found = held(tmp_path / f"b{slot}", lite)
        # every acknowledged message once, in order; besides them only sends that were refused (or unanswered)
        assert [m for m in found if m in acked] == acked, slot
    assert held(tmp_path / "b0", lite) == held(tmp_path / "b1", lite)
