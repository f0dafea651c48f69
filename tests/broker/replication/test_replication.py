"""Replication (docs/replication.md) on a real kube-apiserver + etcd: two whole brokers (app.Broker, real
ports, real stores) with --replicas 2 hold one Lease per slot; copies, fencing and the in-sync rule. The kill -9
and disk-loss failover with broker processes: tests/broker/replication/test_replication_failover.py."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import json
import shutil
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from fencing import unfenced
from google.protobuf.duration_pb2 import Duration
from waiting import TIMEOUT_S, eventually_async

from lmq_broker import app, errors, model
from lmq_broker.admin import expiry, reclaiming
from lmq_broker.admin.client import AdminClient
from lmq_broker.cluster import local_hop, trust
from lmq_broker.cluster import membership as mb
from lmq_broker.cluster import setup as cluster_setup
from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch import metadata, offsets, settlement
from lmq_broker.dispatch import testing as dispatch_testing
from lmq_broker.protocol import testing as protocol_testing
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.replication import following, sockets, streams, wire
from lmq_broker.replication import kube as kube_api
from lmq_broker.replication import setup as replication
from lmq_broker.storage import store as lmq_store
from lmq_broker.storage.api import Store
from lmq_broker.supervisor import free_ports
from lmq_operator import testing

PARENT, GROUP = "P", "G"
MQTT_GROUP = metadata.MQTT_GROUP_PREFIX + "session-1"  # an MQTT session's implicit group
LEASE_MS = 1500
_prefixes = itertools.count()


def lease_flags(kube: testing.KubeAPI, tmp_path: Path) -> dict[str, object]:
    token = tmp_path / "token"
    token.write_text(kube.token)
    return {
        "lease_namespace": "default",
        "lease_prefix": f"t{next(_prefixes)}",
        "lease_duration_ms": LEASE_MS,
        "kube_api_server": kube.server,
        "kube_token_file": token,
        "kube_ca_file": kube.ca_file,
    }


class Pair:
    def __init__(self, brokers: list[app.Broker], clients: list[protocol_testing.Client]) -> None:
        self.brokers = brokers
        self.clients = clients
        self.membership = mb.Membership.parse(brokers[0].config.peers)

    def lite_of(self, slot: int, prefix: str = "t") -> str:
        return next(f"{prefix}-{i}" for i in range(10_000) if self.owner(f"{prefix}-{i}") == slot)

    def owner(self, lite: str) -> int:
        return mb.owner(self.membership, model.QueueId.lmq(PARENT, lite).topic)

    def leadership(self, slot: int) -> Any:
        repl = self.brokers[slot].replication
        assert repl is not None
        return repl.leadership

    def stored(self, slot: int, lite: str) -> int:
        store = self.brokers[slot].store
        assert store is not None
        return store.queue_offsets(model.QueueId.lmq(PARENT, lite))[1]

    async def close(self) -> None:
        for client in self.clients:
            await client.close()
        for broker in self.brokers:
            if broker.ready:
                await broker.stop(grace_s=0.2)

    async def send(self, slot: int, lite: str, n: int, *, retry_fenced: bool = True) -> Any:
        """The reply to a send; one refused because the broker was fenced is sent again, as the official
        clients do, unless ``retry_fenced`` is False (a test of the fence)."""
        body = f"{lite}/{n}".encode()
        props = pb.SystemProperties(message_id=f"{lite}-{n}", message_type=pb.LITE, lite_topic=lite)
        msg = pb.Message(topic=pb.Resource(name=PARENT), body=body, system_properties=props)
        headers = protocol_testing.Client.headers("client-1", "PYTHON", "5.1.2")
        request = spb.SendMessageRequest(messages=[msg])
        return await unfenced(lambda: self.clients[slot].stub.SendMessage(request, metadata=headers), retry_fenced)


async def start_broker(config: BrokerConfig) -> app.Broker:
    store = lmq_store.open_store(config.store)
    store.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
    store.put_group(model.LiteGroup(GROUP, PARENT))
    broker = app.Broker(config, store=store)
    await broker.start()
    return broker


async def start_pair(tmp_path: Path, **overrides: object) -> Pair:
    return await start_ring(tmp_path, 2, overrides)


async def start_ring(tmp_path: Path, brokers_n: int, overrides: dict[str, object]) -> Pair:
    """``brokers_n`` brokers with --replicas 2, once every slot's lease is held."""
    hosts = [("127.0.0.1", p) for p in free_ports("127.0.0.1", brokers_n)]
    members = ",".join(f"{h}:{p}" for h, p in hosts)
    brokers = []
    for slot, (host, port) in enumerate(hosts):
        config = dispatch_testing.config_for(
            tmp_path / f"b{slot}",
            host=host,
            port=port,
            metrics_port=-1,
            peers=members,
            ordinal=slot,
            advertised_address=f"{host}:{port}",
            admin_access_key="admin-ak",
            admin_secret_key="admin-sk",
            replicas=2,
            **overrides,
        )
        brokers.append(await start_broker(config))
    pair = Pair(brokers, [protocol_testing.connect(b.endpoint, b.store) for b in brokers if b.store is not None])
    held = lambda: all(pair.leadership(s).epoch(s) is not None for s in range(brokers_n))  # noqa: E731
    await eventually_async(held, "every lease held")
    return pair


@pytest_asyncio.fixture
async def pair(kube: testing.KubeAPI, tmp_path: Path) -> AsyncIterator[Pair]:
    started = await start_pair(tmp_path, **lease_flags(kube, tmp_path))
    yield started
    await started.close()


def refused(broker: app.Broker, reason: str) -> float:
    value = broker.metrics.registry.get_sample_value("lmq_replication_refused_total", {"reason": reason})
    return value or 0.0


@pytest.mark.asyncio
async def test_an_acknowledged_send_is_stored_on_the_follower_at_the_owners_offsets(pair: Pair) -> None:
    lite = pair.lite_of(0)
    for n in range(20):
        reply = await pair.send(0, lite, n)
        assert reply.status.code == pb.OK, reply.status.message
        assert reply.entries[0].offset == n
    assert pair.stored(0, lite) == 20
    assert pair.stored(1, lite) == 20  # acknowledged only once the follower had it: no waiting needed
    store = pair.brokers[1].store
    assert store is not None
    copies = store.read(model.QueueId.lmq(PARENT, lite), 0, 100)
    assert [m.body for m in copies] == [f"{lite}/{n}".encode() for n in range(20)]
    assert [m.message_id for m in copies] == [f"{lite}-{n}" for n in range(20)]


@pytest.mark.asyncio
async def test_too_few_in_sync_replicas_fail_the_send_retriably(pair: Pair) -> None:
    lite = pair.lite_of(0)
    assert (await pair.send(0, lite, 0)).status.code == pb.OK
    await pair.brokers[1].stop(grace_s=0.1)
    reply = await pair.send(0, lite, 1)
    assert reply.status.code == pb.INTERNAL_ERROR  # the official clients retry it
    assert "not enough in-sync replicas of slot 0: 1 of 2" in reply.status.message
    assert refused(pair.brokers[0], "insync") == 1


@pytest.mark.asyncio
async def test_an_owner_whose_lease_was_taken_acknowledges_nothing(pair: Pair, kube: testing.KubeAPI) -> None:
    lite = pair.lite_of(0)
    got = await sent_and_received(pair, lite, 1)
    leadership = pair.leadership(0)
    api = kube_api.ApiServer(kube.server, kube.token, kube.ca_file, "default")
    lease = api.get(leadership.name(0))
    assert lease is not None
    taken = api.write(lease, "someone-else", lease.transitions + 1, 60)  # an operator's forced failover
    await eventually_async(lambda: leadership.epoch(0) is None, "the owner fenced")
    reply = await pair.send(0, lite, 1, retry_fenced=False)
    assert reply.status.code == pb.INTERNAL_ERROR
    assert "does not hold the lease of slot 0" in reply.status.message
    assert refused(pair.brokers[0], "fenced") >= 1
    assert pair.stored(0, lite) == 1  # refused before it was stored
    acked = await ack(pair, lite, got, retry_fenced=False)  # nor does it take an ack (the new owner delivers it again)
    assert acked.status.code == pb.INTERNAL_ERROR
    assert "does not hold the lease of slot 0" in acked.status.message
    # The follower has seen the new epoch too: a copy of the old one is refused there.
    follower = pair.brokers[1].replication
    assert follower is not None and follower.follower is not None
    await eventually_async(lambda: pair.leadership(1).epochs.get(0) == taken.transitions, "the new epoch seen")
    with pytest.raises(errors.Fenced):
        await follower.follower.accept(wire.encode(0, taken.transitions - 1, [], []))


@pytest.mark.asyncio
async def test_a_deposed_owner_changes_no_consumer_state(pair: Pair, kube: testing.KubeAPI) -> None:
    """ChangeInvisibleDuration and ForwardMessageToDeadLetterQueue are settlements too: refused like an ack."""
    lite = pair.lite_of(0)
    got = await sent_and_received(pair, lite, 2)
    leadership = pair.leadership(0)
    api = kube_api.ApiServer(kube.server, kube.token, kube.ca_file, "default")
    lease = api.get(leadership.name(0))
    assert lease is not None
    api.write(lease, "someone-else", lease.transitions + 1, 60)  # an operator's forced failover
    await eventually_async(lambda: leadership.epoch(0) is None, "the owner fenced")
    before = refused(pair.brokers[0], "fenced")
    group, parent = pb.Resource(name=GROUP), pb.Resource(name=PARENT)
    nack = spb.ChangeInvisibleDurationRequest(
        group=group, topic=parent, receipt_handle=got[0].receipt_handle, message_id=got[0].message_id
    )
    nack.invisible_duration.FromMilliseconds(1000)
    changed = await pair.clients[0].stub.ChangeInvisibleDuration(nack, metadata=CONSUMER)
    assert changed.status.code == pb.INTERNAL_ERROR  # the official clients retry it (at the new owner)
    assert "does not hold the lease of slot 0" in changed.status.message
    forward = spb.ForwardMessageToDeadLetterQueueRequest(
        group=group, topic=parent, receipt_handle=got[1].receipt_handle, message_id=got[1].message_id
    )
    forwarded = await pair.clients[0].stub.ForwardMessageToDeadLetterQueue(forward, metadata=CONSUMER)
    assert forwarded.status.code == pb.INTERNAL_ERROR
    assert "does not hold the lease of slot 0" in forwarded.status.message
    assert refused(pair.brokers[0], "fenced") == before + 2
    store = pair.brokers[0].store
    assert store is not None
    assert store.queue_offsets(model.QueueId(f"%DLQ%{GROUP}", 0))[1] == 0  # no dead letter stored either


@pytest.mark.asyncio
async def test_a_normal_topics_message_is_served_once_by_the_broker_it_was_sent_to_whoever_holds_its_slot(
    pair: Pair, kube: testing.KubeAPI
) -> None:
    """A NORMAL topic is stored where it arrives, each broker its own queues (docs/scale-out.md), at R > 1 too:
    its messages are not copied. They were, into the follower's own queue of the same name, which it served as
    well: a consumer group got each message from both brokers (acked at one, delivered again by the other).
    And a broker whose slot another holds (a failover) still takes and serves its own NORMAL queues."""
    queue = model.QueueId("N", 0)
    dispatchers = [b.dispatcher for b in pair.brokers]
    for broker, dispatcher in zip(pair.brokers, dispatchers, strict=True):
        assert broker.store is not None and dispatcher is not None
        broker.store.put_parent_topic(model.ParentTopic("N", model.MessageType.NORMAL, queue_count=1))
        dispatcher.metadata_changed()
    owner = dispatchers[0]
    assert owner is not None

    async def received(slot: int) -> list[tuple[str, str]]:
        dispatcher = dispatchers[slot]
        assert dispatcher is not None
        got = await dispatcher.receive_normal("c", "ng", "N", batch=8, invisible_ms=60_000, poll_ms=0)
        return [(d.message.message_id, d.receipt_handle) for d in got]

    await owner.send([model.NewMessage("n-1", "N", b"x", (queue,))])
    assert await received(1) == []
    assert [m for m, _ in await received(0)] == ["n-1"]
    follower, replication_1 = pair.brokers[1].store, pair.brokers[1].replication
    assert follower is not None and follower.queue_offsets(queue)[1] == 0
    assert replication_1 is not None and replication_1.follower is not None
    older = model.NewMessage("n-0", "N", b"z", (queue,), epoch=1)  # an older owner's copy of one: passed over
    copy = wire.encode(0, pair.leadership(0).epoch(0) or 0, [older], [model.AppendResult("n-0", (queue,), (0,), 1)])
    assert await replication_1.follower.accept(copy) == {}
    assert follower.queue_offsets(queue)[1] == 0
    leadership = pair.leadership(0)
    take_lease(kube, leadership.name(0), "someone-else")
    await eventually_async(lambda: leadership.epoch(0) is None, "broker 0 fenced")
    await owner.send([model.NewMessage("n-2", "N", b"y", (queue,))])
    ((message_id, handle),) = await received(0)
    assert message_id == "n-2"
    await owner.ack("ng", handle)


@pytest.mark.asyncio
async def test_one_list_reads_the_leases_of_this_release_only(pair: Pair, kube: testing.KubeAPI) -> None:
    leadership = pair.leadership(0)
    api = kube_api.ApiServer(kube.server, kube.token, kube.ca_file, "default")
    api.create(f"x{next(_prefixes)}-slot-0", "someone-else", 60)  # another release in the same namespace
    prefix = leadership.name(0).removesuffix("0")
    found = {lease.name: lease for lease in api.list_named(prefix)}
    assert sorted(found) == [leadership.name(0), leadership.name(1)]
    assert found[leadership.name(0)].holder == leadership.identity
    assert found[leadership.name(1)].holder == pair.leadership(1).identity
    assert all(lease.resource_version and lease.transitions == 0 for lease in found.values())


CONSUMER = protocol_testing.Client.headers("c1", "PYTHON", "5.1.2")


async def subscribe(client: protocol_testing.Client, lite: str) -> None:
    group, parent = pb.Resource(name=GROUP), pb.Resource(name=PARENT)
    subscribed = await client.stub.SyncLiteSubscription(
        spb.SyncLiteSubscriptionRequest(action=pb.PARTIAL_ADD, topic=parent, group=group, lite_topic_set=[lite]),
        metadata=CONSUMER,
    )
    assert subscribed.status.code == pb.OK


async def sent_and_received(pair: Pair, lite: str, count: int) -> list[Any]:
    """Subscribe at the owner, send ``count`` messages, receive them: their system properties."""
    client, group, parent = pair.clients[0], pb.Resource(name=GROUP), pb.Resource(name=PARENT)
    await subscribe(client, lite)
    for n in range(count):
        assert (await pair.send(0, lite, n)).status.code == pb.OK
    request = spb.ReceiveMessageRequest(
        group=group, message_queue=pb.MessageQueue(topic=parent), batch_size=32, auto_renew=True
    )
    got: list[Any] = []
    deadline = time.monotonic() + TIMEOUT_S
    while len(got) < count and time.monotonic() < deadline:  # a late renewal may fence a hand-out: receive again
        frames = [f async for f in client.stub.ReceiveMessage(request, metadata=CONSUMER, timeout=10)]
        got += [f.message.system_properties for f in frames if f.HasField("message")]
    assert [p.message_id for p in got] == [f"{lite}-{n}" for n in range(count)]
    return got


async def ack(pair: Pair, lite: str, got: list[Any], *, retry_fenced: bool = True) -> Any:
    entries = [
        spb.AckMessageEntry(message_id=p.message_id, receipt_handle=p.receipt_handle, lite_topic=lite) for p in got
    ]
    request = spb.AckMessageRequest(group=pb.Resource(name=GROUP), topic=pb.Resource(name=PARENT), entries=entries)
    return await unfenced(lambda: pair.clients[0].stub.AckMessage(request, metadata=CONSUMER), retry_fenced)


@pytest.mark.asyncio
async def test_a_consumers_commit_point_reaches_the_follower(pair: Pair) -> None:
    lite = pair.lite_of(0)
    got = await sent_and_received(pair, lite, 3)
    assert (await ack(pair, lite, got)).status.code == pb.OK
    queue = model.QueueId.lmq(PARENT, lite)
    follower = pair.brokers[1].store
    assert follower is not None
    await eventually_async(lambda: follower.get_offset(queue, GROUP) == 3, "the commit point on the follower")


async def restart(pair: Pair, slot: int) -> None:
    """Stop a broker and start it again on its data directory (its disk kept)."""
    old = pair.brokers[slot]
    if old.ready:
        await old.stop(grace_s=0.1)
    pair.brokers[slot] = await start_broker(old.config)


@pytest.mark.asyncio
async def test_a_follower_that_missed_copies_catches_up_before_the_next_send_is_acknowledged(pair: Pair) -> None:
    lite = pair.lite_of(0)
    for n in range(5):
        assert (await pair.send(0, lite, n)).status.code == pb.OK
    await pair.brokers[1].stop(grace_s=0.1)
    reply = await pair.send(0, lite, 5)
    assert "not enough in-sync replicas" in reply.status.message
    assert reply.status.code == pb.INTERNAL_ERROR  # stored on the owner, not acknowledged: the client retries
    await restart(pair, 1)
    reply = await pair.send(0, lite, 6)
    assert reply.status.code == pb.OK, reply.status.message
    assert pair.stored(1, lite) == pair.stored(0, lite) == 7  # the unacknowledged one too: at-least-once
    store = pair.brokers[1].store
    assert store is not None
    copies = store.read(model.QueueId.lmq(PARENT, lite), 0, 100)
    assert [m.message_id for m in copies] == [f"{lite}-{n}" for n in range(7)]


@pytest.mark.asyncio
async def test_asynchronous_replication_acknowledges_alone_and_the_copies_follow(
    kube: testing.KubeAPI, tmp_path: Path
) -> None:
    pair = await start_pair(tmp_path, min_insync_replicas=1, **lease_flags(kube, tmp_path))
    try:
        lite = pair.lite_of(0)
        await pair.brokers[1].stop(grace_s=0.1)
        for n in range(5):
            assert (await pair.send(0, lite, n)).status.code == pb.OK  # no follower: acknowledged all the same
        await restart(pair, 1)
        assert (await pair.send(0, lite, 5)).status.code == pb.OK
        await eventually_async(lambda: pair.stored(1, lite) == 6, "the follower caught up")
    finally:
        await pair.close()


@pytest.mark.asyncio
async def test_a_follower_back_on_an_empty_disk_fetches_every_topic_before_it_is_in_sync(pair: Pair) -> None:
    """... with the consumers' commit points: taking over without them it would deliver acked messages again."""
    quiet, busy = pair.lite_of(0, "quiet"), pair.lite_of(0, "busy")
    for n in range(5):
        assert (await pair.send(0, busy, n)).status.code == pb.OK
    got = await sent_and_received(pair, quiet, 5)
    assert (await ack(pair, quiet, got[:3])).status.code == pb.OK
    await pair.brokers[1].stop(grace_s=0.1)
    shutil.rmtree(pair.brokers[1].config.store.data_dir)  # its disk is lost
    await restart(pair, 1)
    replication = pair.brokers[1].replication
    assert replication is not None and replication.follower is not None
    follower, epoch = replication.follower, pair.leadership(0).epoch(0)
    assert epoch is not None
    # No send since: only reconciling can bring the topics back, and a takeover needs it.
    await eventually_async(lambda: follower.in_sync(0, epoch), "the follower reconciled")
    assert pair.stored(1, quiet) == pair.stored(1, busy) == 5
    store = pair.brokers[1].store
    assert store is not None and store.get_offset(model.QueueId.lmq(PARENT, quiet), GROUP) == 3


@pytest.mark.asyncio
async def test_an_owner_restarted_on_its_disk_keeps_its_lease_and_epoch(pair: Pair) -> None:
    lite = pair.lite_of(0)
    assert (await pair.send(0, lite, 0)).status.code == pb.OK
    epoch = pair.leadership(0).epoch(0)
    await restart(pair, 0)
    await pair.clients[0].close()
    pair.clients[0] = protocol_testing.connect(pair.brokers[0].endpoint, pair.brokers[0].store)  # type: ignore[arg-type]
    await eventually_async(lambda: pair.leadership(0).epoch(0) is not None, "the lease renewed")
    assert pair.leadership(0).epoch(0) == epoch
    assert (await pair.send(0, lite, 1)).status.code == pb.OK
    assert pair.stored(1, lite) == 2


def test_more_than_one_replica_needs_leases(tmp_path: Path) -> None:
    config = dispatch_testing.config_for(tmp_path, replicas=2, peers="a:1,b:2", ordinal=0)
    with pytest.raises(errors.InvalidArgument, match="needs --lease-namespace"):
        replication.check(config)
    with pytest.raises(errors.InvalidArgument, match="exceeds --replicas"):
        replication.check(dispatch_testing.config_for(tmp_path, replicas=2, min_insync_replicas=3))
    # Between 1 and R is accepted: the in-sync set recorded with the lease keeps it safe (test_replication_insync).
    replication.check(dispatch_testing.config_for(tmp_path, replicas=3, min_insync_replicas=2, lease_namespace="n"))


def test_followers_are_on_other_pods() -> None:
    assert replication.followers_of(0, 6, 2, 3) == [2, 4]  # 3 pods of 2 processes: same process, next pods
    assert replication.followers_of(5, 6, 2, 2) == [1]
    with pytest.raises(errors.InvalidArgument, match="at least 3 pods"):
        replication.followers_of(0, 4, 2, 3)


def test_a_ring_with_a_history_starts_with_replicas_only_while_every_topic_records_its_slot() -> None:
    grown = mb.Membership.parse("a:1,b:2,c:3", "2")
    leaving = mb.Membership(("a:1", "b:2", "c:3"), (3, 2))
    with pytest.raises(errors.InvalidArgument, match="needs every lite topic to record its slot"):
        replication.one_ring(2, grown, "lite topic x was stored without its slot")
    replication.one_ring(2, grown, "")  # every topic names its slot: the grown ring's replica sets follow it
    replication.one_ring(2, leaving, "")  # a scale-down under way: its replica sets follow it
    with pytest.raises(errors.InvalidArgument, match="needs every lite topic to record its slot"):
        replication.one_ring(2, leaving, "lite topic x was stored without its slot")
    for why in ("", "lite topic x was stored without its slot"):
        replication.one_ring(1, leaving, why)  # at R = 1 as before
        replication.one_ring(2, mb.Membership.parse("a:1,b:2,c:3"), why)  # no history: today's ring is right


@pytest.mark.asyncio
async def test_a_replicated_ring_changes_only_in_its_safe_shapes_and_only_while_every_topic_records_its_slot(
    pair: Pair,
) -> None:
    """SetCluster with a shrunk ring removed at once, or slots marked leaving on top of a grown ring, is refused
    at R = 2, force or not, on every broker (a scale-down marks the last slots leaving first: tested with the
    drain, ``test_a_drained_topic_of_a_leaving_slot_goes_on_at_its_new_owner_where_it_ended``); a grown ring is
    refused while a lite topic of the broker's store names no slot on its last record (a copy from an owner of
    an older version, here), and GetCluster says why; the same ring at a new epoch (the operator numbering it)
    is taken. The leases and sends go on."""
    members = pair.membership.members
    for broker in pair.brokers:
        repl = broker.replication
        assert repl is not None
        with AdminClient(broker.endpoint, timeout_s=10, access_key="admin-ak", secret_key="admin-sk") as admin:
            assert (await asyncio.to_thread(admin.cluster)).ring_fixed == ""
            with pytest.raises(errors.Conflict, match=r"is not leaving: shrink the ring first"):  # as at R = 1
                await asyncio.to_thread(admin.set_cluster, members[:1], (1,))
            grown_leaving = ((*members, "127.0.0.1:1"), (2, 3, 2))
            for ring, sizes, force in ((members[:1], (1,), True), (*grown_leaving, True), (*grown_leaving, False)):
                with pytest.raises(errors.Conflict, match=r"a replicated ring grows, or shrinks by marking"):
                    await asyncio.to_thread(admin.set_cluster, ring, sizes, force=force)
            repl.stamps.note([dispatch_testing.lite_message("old", b"x", parent=PARENT, message_id="old-0")])
            info = await asyncio.to_thread(admin.cluster)
            assert "stored without its slot" in info.ring_fixed
            with pytest.raises(errors.Conflict, match=r"cannot change: .* stored without its slot"):
                await asyncio.to_thread(admin.set_cluster, (*members, "127.0.0.1:1"), (2, 3))
            assert (info.members, info.ring_sizes) == (members, (2,))
            info, changed = await asyncio.to_thread(admin.set_cluster, members, (2,), epoch=info.epoch + 5)
            assert changed and (info.members, info.ring_sizes) == (members, (2,))
    for slot in (0, 1):
        assert pair.leadership(slot).epoch(slot) is not None
        reply = await pair.send(slot, pair.lite_of(slot), 0)
        assert reply.status.code == pb.OK, reply.status


@pytest.mark.asyncio
async def test_the_owner_and_its_follower_record_each_topics_slot(pair: Pair) -> None:
    """A send of a topic of each slot is stored on both replicas with that slot recorded on the record (the
    topic's slot from then on, whatever the ring: docs/replication.md, *Changing the ring*, step 1), and each
    broker files the topic under it."""
    for slot in (0, 1):
        lite = pair.lite_of(slot, prefix="r")
        reply = await pair.send(slot, lite, 0)
        assert reply.status.code == pb.OK, reply.status
        for broker in pair.brokers:
            store, repl = broker.store, broker.replication
            assert store is not None and repl is not None
            topic = model.QueueId.lmq(PARENT, lite).topic
            queue = model.QueueId(topic, 0)
            await eventually_async(functools.partial(lambda s, q: s.queue_offsets(q)[1] == 1, store, queue), "copy")
            (record,) = store.read(queue, 0, 1)
            assert (record.slot, record.message_id) == (slot, f"{lite}-0")
            assert repl.slots.slot_of_topic(topic) == slot  # on the follower too (it was its own slot's)
            assert repl.slots.followed_slot(topic) == slot


@pytest.mark.asyncio
async def test_a_broker_counts_undrained_only_the_topics_of_its_own_slot_not_its_copies(pair: Pair) -> None:
    """A leaving broker waits until its undrained count is 0 (docs/scale-out.md): at R = 2 it counts the topics
    of its own slot by the slot their records name, not its copies of the slots it follows, which drain at
    their holders (else a leaving follower would read as undrained for as long as the slots it follows take
    sends). Three sends of a slot-0 topic and two of a slot-1 topic, group G bound and consuming nothing:
    GetCluster and GetBrokerInfo count 3 at broker 0 and 2 at broker 1, each holding all five."""
    sent = {0: 3, 1: 2}
    for slot, count in sent.items():
        lite = pair.lite_of(slot, prefix="u")
        for n in range(count):
            assert (await pair.send(slot, lite, n)).status.code == pb.OK
        for held in (0, 1):
            stored = functools.partial(lambda h, lt, c: pair.stored(h, lt) == c, held, lite, count)
            await eventually_async(stored, "on both replicas")
    for slot, broker in enumerate(pair.brokers):
        with AdminClient(broker.endpoint, timeout_s=10, access_key="admin-ak", secret_key="admin-sk") as admin:
            info = await asyncio.to_thread(admin.cluster, with_undrained=True)
            assert info.undrained_messages == sent[slot], (slot, info)
            assert (await asyncio.to_thread(admin.broker_info)).undrained_messages == sent[slot]


def test_a_copy_reads_back_as_it_was_written() -> None:
    m = dispatch_testing.lite_message("x", b"\x00body", message_id="id-1")
    result = model.AppendResult("id-1", m.queues, (7,), 0)
    copy = wire.decode(wire.encode(3, 9, [m, m], [result, result]))
    assert (copy.slot, copy.epoch, copy.messages, copy.offsets) == (3, 9, [m, m], [(7,), (7,)])
    with pytest.raises(errors.InvalidArgument):
        wire.decode(wire.encode(3, 9, [m], [result]) + b"x")


def take_lease(kube: testing.KubeAPI, name: str, holder: str) -> kube_api.Lease:
    """A forced failover, as a person or an operator makes one: the lease written to ``holder``."""
    api = kube_api.ApiServer(kube.server, kube.token, kube.ca_file, "default")
    lease = api.get(name)
    assert lease is not None
    return api.write(lease, holder, lease.transitions + 1, 60)


async def receive(client: protocol_testing.Client, poll_ms: int = 300) -> list[Any]:
    """One receive of the consumer ``c1``, long-polling ``poll_ms`` at most: the frames."""
    request = spb.ReceiveMessageRequest(
        group=pb.Resource(name=GROUP), message_queue=pb.MessageQueue(topic=pb.Resource(name=PARENT)), batch_size=32
    )
    request.invisible_duration.FromMilliseconds(30_000)
    request.long_polling_timeout.FromMilliseconds(poll_ms)
    return [f async for f in client.stub.ReceiveMessage(request, metadata=CONSUMER, timeout=10)]


@pytest.mark.asyncio
async def test_a_deposed_owner_hands_nothing_out(pair: Pair, kube: testing.KubeAPI) -> None:
    lite = pair.lite_of(0)
    await subscribe(pair.clients[0], lite)
    for n in range(3):
        assert (await pair.send(0, lite, n)).status.code == pb.OK
    leadership = pair.leadership(0)
    take_lease(kube, leadership.name(0), "someone-else")
    await eventually_async(lambda: leadership.epoch(0) is None, "the owner fenced")
    before = refused(pair.brokers[0], "fenced_receive")
    frames = await receive(pair.clients[0])
    assert [f.status.code for f in frames if f.HasField("status")] == [pb.MESSAGE_NOT_FOUND]
    assert not [f for f in frames if f.HasField("message")]  # three were waiting: none leased, no attempt counted
    assert refused(pair.brokers[0], "fenced_receive") > before
    store = pair.brokers[0].store
    assert store is not None
    handouts = store.get_handouts(model.QueueId.lmq(PARENT, lite), GROUP)
    assert handouts.mark == 0


async def assignments(client: protocol_testing.Client) -> list[str]:
    request = spb.QueryAssignmentRequest(topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP))
    reply = await client.stub.QueryAssignment(request, metadata=CONSUMER)
    return [address(a.message_queue.broker) for a in reply.assignments]


def address(broker: pb.Broker) -> str:
    first = broker.endpoints.addresses[0]
    return f"{first.host}:{first.port}"


@pytest.mark.asyncio
async def test_consumers_follow_the_lease_to_its_new_holder(pair: Pair, kube: testing.KubeAPI) -> None:
    """The follower is handed the owner's lease: routes and assignments name it alone, the consumer's subscription
    (kept by the broker it called, the old owner) is made there, and it delivers from the copied commit point."""
    lite, later = pair.lite_of(0), pair.lite_of(0, "later")
    got = await sent_and_received(pair, lite, 3)
    assert (await ack(pair, lite, got[:2])).status.code == pb.OK
    follower = pair.brokers[1].store
    assert follower is not None
    await eventually_async(lambda: follower.get_offset(model.QueueId.lmq(PARENT, lite), GROUP) == 2, "commit copied")
    for n in range(3, 5):
        assert (await pair.send(0, lite, n)).status.code == pb.OK
    take_lease(kube, pair.leadership(0).name(0), pair.leadership(1).identity)
    await eventually_async(lambda: pair.leadership(0).epoch(0) is None, "the old owner fenced")
    await eventually_async(lambda: pair.leadership(1).epoch(0) is not None, "the new holder renews it")
    holder = pair.brokers[1].endpoint
    for client in pair.clients:
        await until(functools.partial(_assigned, client, [holder]), "assignments name the holder alone")
    routes = await pair.clients[0].stub.QueryRoute(
        spb.QueryRouteRequest(topic=pb.Resource(name=PARENT)), metadata=CONSUMER
    )
    writable = {address(q.broker) for q in routes.message_queues if q.permission == pb.READ_WRITE}
    assert writable == {holder}  # the old owner, asked, is listed READ only (its own route's first queue)
    delivered: list[str] = []

    async def received_rest() -> bool:
        frames = await receive(pair.clients[1], poll_ms=100)
        delivered.extend(f.message.system_properties.message_id for f in frames if f.HasField("message"))
        return len(delivered) >= 3

    await until(received_rest, "the new holder delivers")
    # the one not acked again (at-least-once), the two acked never
    assert delivered == [f"{lite}-{n}" for n in range(2, 5)]
    # A subscription made after the failover, through the old owner, is made at the holder.
    parent, group = pb.Resource(name=PARENT), pb.Resource(name=GROUP)
    sync = spb.SyncLiteSubscriptionRequest(action=pb.PARTIAL_ADD, topic=parent, group=group, lite_topic_set=[later])
    assert (await pair.clients[0].stub.SyncLiteSubscription(sync, metadata=CONSUMER)).status.code == pb.OK
    queue = model.QueueId.lmq(PARENT, later)
    dispatchers = [b.dispatcher for b in pair.brokers]
    assert dispatchers[0] is not None and dispatchers[1] is not None
    assert "c1" in dispatchers[1].subscribers(queue)
    assert "c1" not in dispatchers[0].subscribers(queue)


async def routed(client: protocol_testing.Client) -> list[tuple[str, int]]:
    reply = await client.stub.QueryRoute(spb.QueryRouteRequest(topic=pb.Resource(name=PARENT)), metadata=CONSUMER)
    assert reply.status.code == pb.OK
    return [(address(q.broker), q.permission) for q in reply.message_queues]


@pytest.mark.asyncio
async def test_a_route_names_the_broker_asked_first_and_only_lease_holders(pair: Pair, kube: testing.KubeAPI) -> None:
    """A LiteSimpleConsumer receives from the first route queue only: the broker it asked (which gathers from the
    others for it) comes first, so after a failover it keeps calling a live broker rather than the dead owner."""
    ends = [b.endpoint for b in pair.brokers]
    assert await routed(pair.clients[0]) == [(ends[0], pb.READ_WRITE), (ends[1], pb.READ_WRITE)]
    assert await routed(pair.clients[1]) == [(ends[1], pb.READ_WRITE), (ends[0], pb.READ_WRITE)]
    assert sorted(await assignments(pair.clients[1])) == sorted(ends)
    take_lease(kube, pair.leadership(0).name(0), pair.leadership(1).identity)
    await eventually_async(lambda: pair.leadership(1).epoch(0) is not None, "the new holder renews it")
    holder_alone: list[tuple[str, int]] = [(ends[1], pb.READ_WRITE)]
    await until(functools.partial(_routed, pair.clients[1], holder_alone), "routes name the holder alone")
    # The deposed one holds no lease: where it is asked, it comes first READ (a LiteSimpleConsumer reading its
    # first readable queue keeps calling it, and it gathers from the holder); producers write to the holder alone.
    asked_first = [(ends[0], int(pb.READ)), *holder_alone]
    await until(functools.partial(_routed, pair.clients[0], asked_first), "the asked one READ first")
    for client in pair.clients:  # push consumers are assigned the holder alone
        await until(functools.partial(_assigned, client, [ends[1]]), "assignments name the holder alone")


async def _routed(client: protocol_testing.Client, expected: list[tuple[str, int]]) -> bool:
    return await routed(client) == expected


async def _assigned(client: protocol_testing.Client, expected: list[str]) -> bool:
    return await assignments(client) == expected


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 10) -> None:
    """``eventually_async`` for a check that calls a broker."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await check():
        assert loop.time() < deadline, f"not within {timeout_s:g} s: {what}"
        await asyncio.sleep(0.05)


async def subscribe_at_latest(client: protocol_testing.Client, lite: str) -> Any:
    """SyncLiteSubscription with OffsetOption MAX: the group starts at the lite topic's end (an offset reset)."""
    request = spb.SyncLiteSubscriptionRequest(action=pb.PARTIAL_ADD, topic=pb.Resource(name=PARENT),
                                              group=pb.Resource(name=GROUP), lite_topic_set=[lite])  # fmt: skip
    request.offset_option.CopyFrom(pb.OffsetOption(policy=pb.OffsetOption.MAX))
    return await client.stub.SyncLiteSubscription(request, metadata=CONSUMER)


@pytest.mark.asyncio
async def test_an_offset_reset_too_few_in_sync_replicas_stored_is_refused_and_one_retried_is_answered(
    pair: Pair,
) -> None:
    """A subscription's OffsetOption is an offset reset: told OK, its caller trusts a start a takeover would keep.
    With the follower stopped (R = M = 2) it waits for the in-sync set, bounded, then is refused retriably (the
    reset stays written at the owner); the retry once the follower is back is answered and the follower holds it."""
    lite = pair.lite_of(0)
    for n in range(2):
        assert (await pair.send(0, lite, n)).status.code == pb.OK
    await pair.brokers[1].stop(grace_s=0.1)
    began = time.monotonic()
    refused_reset = await subscribe_at_latest(pair.clients[0], lite)
    waited_s = time.monotonic() - began
    assert refused_reset.status.code == pb.INTERNAL_ERROR  # the official clients retry it
    assert "offset reset is not stored by enough in-sync replicas" in refused_reset.status.message
    assert "not enough in-sync replicas of slot 0" in refused_reset.status.message
    assert waited_s >= settlement.RESET_COPY_WAIT_S - 0.5  # it waited for the set first
    await restart(pair, 1)
    retried = await subscribe_at_latest(pair.clients[0], lite)
    assert retried.status.code == pb.OK, retried.status.message
    store = pair.brokers[1].store
    assert store is not None
    assert store.get_offset(model.QueueId.lmq(PARENT, lite), GROUP) == 2  # stored before the answer


@pytest.mark.asyncio
async def test_an_offset_reset_whose_slot_was_lost_while_it_waited_for_the_set_is_refused(pair: Pair) -> None:
    """The slot's lease lost while the reset waited for the in-sync set (``Slots.committed`` copies nothing for a
    slot this broker does not hold: made so from the second copy on): refused as not in force, never answered
    OK while the slot's new holder never had it."""
    lite = pair.lite_of(0)
    for n in range(2):
        assert (await pair.send(0, lite, n)).status.code == pb.OK
    dispatcher = pair.brokers[0].dispatcher
    assert dispatcher is not None
    committed = dispatcher.settlement.committed
    assert committed is not None
    copies = 0

    def lost_after_the_first(*point: Any) -> Any:
        nonlocal copies
        copies += 1
        return committed(*point) if copies == 1 else None

    dispatcher.settlement.committed = lost_after_the_first
    await pair.brokers[1].stop(grace_s=0.1)  # the first copy fails for too few in-sync replicas: retried
    with pytest.raises(errors.Fenced, match="not in force"):
        await dispatcher.reset_offsets(GROUP, PARENT, [lite], offsets.OffsetReset(offsets.OffsetPolicy.MAX))
    assert copies >= 2


@pytest.mark.asyncio
async def test_an_mqtt_start_at_the_end_the_followers_missed_is_answered_and_copied_once_one_is_back(
    pair: Pair,
) -> None:
    """An MQTT SUBSCRIBE's start at the end (``copy_later``) is not refused for too few in-sync replicas (that
    would drop the session's new filters): it is answered after the bounded wait and its commit point copied
    again in the background, the point the store holds then, until the follower stored it."""
    lite = pair.lite_of(0)
    for n in range(3):
        assert (await pair.send(0, lite, n)).status.code == pb.OK
    dispatcher = pair.brokers[0].dispatcher
    assert dispatcher is not None
    await pair.brokers[1].stop(grace_s=0.1)
    latest = offsets.OffsetReset(offsets.OffsetPolicy.MAX)
    await dispatcher.reset_offsets(MQTT_GROUP, PARENT, [lite], latest, copy_later=True)
    assert dispatcher.settlement.uncopied == 1
    with pytest.raises(errors.NotEnoughReplicas, match="offset reset is not stored"):  # without: refused
        await dispatcher.reset_offsets(GROUP, PARENT, [lite], latest)
    await restart(pair, 1)
    store = pair.brokers[1].store
    assert store is not None
    queue = model.QueueId.lmq(PARENT, lite)
    await eventually_async(lambda: store.get_offset(queue, MQTT_GROUP) == 3, "the reset copied once it was back")
    await eventually_async(lambda: dispatcher.settlement.uncopied == 0, "nothing left to copy again")


@pytest.mark.asyncio
async def test_an_ack_is_answered_once_the_follower_has_its_commit_point(pair: Pair) -> None:
    """A follower that takes over never delivers again what was acked: the ack waits for the commit copy."""
    lite = pair.lite_of(0)
    queue = model.QueueId.lmq(PARENT, lite)
    got = await sent_and_received(pair, lite, 3)
    assert (await ack(pair, lite, got[:1])).status.code == pb.OK
    follower = pair.brokers[1].store
    assert follower is not None
    assert follower.get_offset(queue, GROUP) == 1  # no waiting: it was there before the answer
    await pair.brokers[1].stop(grace_s=0.1)
    refused_ack = await ack(pair, lite, got[1:2])
    assert refused_ack.status.code == pb.INTERNAL_ERROR  # the official clients retry it
    assert "not enough in-sync replicas of slot 0 stored the ack" in refused_ack.status.message
    await restart(pair, 1)
    retried = await ack(pair, lite, got[1:2])
    assert retried.status.code == pb.OK, retried.status.message
    store = pair.brokers[1].store
    assert store is not None
    assert store.get_offset(queue, GROUP) == 2


@pytest.mark.asyncio
async def test_an_ack_with_a_stale_handle_moves_the_commit_point_neither_at_the_owner_nor_at_the_follower(
    pair: Pair,
) -> None:
    """The message's invisible time ran out and it was delivered again: the owner refuses the first delivery's
    handle (INVALID_RECEIPT_HANDLE), so no commit point is made of it, here or at the follower; the second
    delivery's ack is copied as any other. Before 2026-11-30 the stale ack settled the second delivery."""
    lite = pair.lite_of(0)
    queue = model.QueueId.lmq(PARENT, lite)
    await subscribe(pair.clients[0], lite)
    assert (await pair.send(0, lite, 0)).status.code == pb.OK
    deliveries: list[Any] = []
    deadline = time.monotonic() + TIMEOUT_S
    while len(deliveries) < 2 and time.monotonic() < deadline:  # the second once the first one's second ran out
        request = spb.ReceiveMessageRequest(
            group=pb.Resource(name=GROUP), message_queue=pb.MessageQueue(topic=pb.Resource(name=PARENT)),
            batch_size=1, invisible_duration=Duration(seconds=30 if deliveries else 1),
        )  # fmt: skip
        frames = [f async for f in pair.clients[0].stub.ReceiveMessage(request, metadata=CONSUMER, timeout=10)]
        deliveries += [f.message.system_properties for f in frames if f.HasField("message")]
    first, second = deliveries
    assert first.message_id == second.message_id and second.delivery_attempt == 2
    stale = await ack(pair, lite, [first])
    assert [e.status.code for e in stale.entries] == [pb.INVALID_RECEIPT_HANDLE], stale
    owner, follower = pair.brokers[0].store, pair.brokers[1].store
    assert owner is not None and follower is not None
    assert not owner.get_offset(queue, GROUP) and not follower.get_offset(queue, GROUP)
    assert (await ack(pair, lite, [second])).status.code == pb.OK
    assert owner.get_offset(queue, GROUP) == follower.get_offset(queue, GROUP) == 1


@pytest.mark.asyncio
async def test_a_follower_answers_a_commit_point_past_its_end_with_its_ends(pair: Pair) -> None:
    """A commit copy that overtook its messages is clamped to the follower's end (never skips records it may
    deliver after a takeover) and answered with that end: the owner does not count it as stored."""
    lite = pair.lite_of(0)
    assert (await pair.send(0, lite, 0)).status.code == pb.OK
    replication_1 = pair.brokers[1].replication
    epoch = pair.leadership(0).epoch(0)
    assert replication_1 is not None and replication_1.follower is not None and epoch is not None
    queue = model.QueueId.lmq(PARENT, lite)
    answer = await replication_1.follower.accept(wire.encode(0, epoch, [], [], [wire.Commit(queue, GROUP, 5, ())]))
    assert answer == {queue.topic: 1}
    store = pair.brokers[1].store
    assert store is not None and store.get_offset(queue, GROUP) == 1
    assert await replication_1.follower.accept(wire.encode(0, epoch, [], [], [wire.Commit(queue, GROUP, 1, ())])) == {}


async def two_sent(pair: Pair) -> tuple[following.Follower, int, model.QueueId, Store]:
    """Two sends to a lite topic of slot 0 acknowledged: broker 1's follower, the epoch, the queue, its store."""
    lite = pair.lite_of(0)
    assert (await pair.send(0, lite, 0)).status.code == pb.OK
    assert (await pair.send(0, lite, 1)).status.code == pb.OK
    replication_1 = pair.brokers[1].replication
    epoch = pair.leadership(0).epoch(0)
    assert replication_1 is not None and replication_1.follower is not None and epoch is not None
    store = pair.brokers[1].store
    assert store is not None
    return replication_1.follower, epoch, model.QueueId.lmq(PARENT, lite), store


@pytest.mark.asyncio
async def test_a_follower_stores_hand_outs_with_a_commit_point_and_trims_those_past_its_end(pair: Pair) -> None:
    """A commit copy's hand-outs (delivery attempts) are stored with its point; hand-outs of records the
    follower has not stored yet are trimmed to its end, the point itself is stored (answered {}, not clamped)."""
    follower, epoch, queue, store = await two_sent(pair)
    counted = wire.Commit(queue, GROUP, 0, (), model.Handouts(2, ((1, 3),)))
    assert await follower.accept(wire.encode(0, epoch, [], [], [counted])) == {}
    assert store.get_handouts(queue, GROUP) == model.Handouts(2, ((1, 3),))
    ahead = wire.Commit(queue, GROUP, 1, (), model.Handouts(9, ((1, 4), (7, 2))))
    assert await follower.accept(wire.encode(0, epoch, [], [], [ahead])) == {}
    assert store.get_offset(queue, GROUP) == 1
    assert store.get_handouts(queue, GROUP) == model.Handouts(2, ((1, 4),))


@pytest.mark.asyncio
async def test_a_follower_stores_only_the_acked_offsets_below_its_end_and_answers_with_its_ends(pair: Pair) -> None:
    """Offsets acked above a commit point that lie at or past the follower's end name records it never got (a
    send refused, its copy lost): they are not stored (the new owner would pass over what it stores there next),
    and the copy is answered with the end, as a clamped point is: the owner does not count it as stored."""
    follower, epoch, queue, store = await two_sent(pair)
    past = wire.Commit(queue, GROUP, 0, (1, 2, 3))
    assert await follower.accept(wire.encode(0, epoch, [], [], [past])) == {queue.topic: 2}
    assert store.get_offset(queue, GROUP) == 0
    assert list(store.get_acked(queue, GROUP)) == [1]
    within = wire.Commit(queue, GROUP, 0, (1,))
    assert await follower.accept(wire.encode(0, epoch, [], [], [within])) == {}


async def over_the_socket(repl: replication.Replication, endpoint: str, data: bytes) -> dict[str, int]:
    """A copy over the follower's copy socket (``sockets``), once the owner's link to it is open."""
    assert repl.sockets is not None
    link = repl.sockets.link(endpoint, replication.CALL_TIMEOUT_S)
    await eventually_async(link.ready, "the copy socket open")
    answer = await link.send(data)
    return json.loads(answer) if answer else {}


async def both_ways(repl: replication.Replication, endpoint: str, data: bytes) -> list[object]:
    """A copy's answer over the follower's copy socket, its stream, then a unary call (the plain twins): answers,
    or the refusal's text after the transport's name."""
    out: list[object] = []
    for send in (functools.partial(over_the_socket, repl), repl.send_stream, repl.send_unary):
        try:
            out.append(await send(endpoint, data))
        except errors.BrokerUnavailable as exc:
            out.append(exc.message.split(": ", 1)[1])
    return out


@pytest.mark.asyncio
async def test_a_copy_gets_the_same_answer_over_the_socket_the_stream_and_a_unary_call(pair: Pair) -> None:
    """The copy socket against its plain twins: the same copies (stored, repeated, behind, of a foreign slot, of
    another message, of an older epoch) get the same answers and store alike."""
    lite = pair.lite_of(0)
    assert (await pair.send(0, lite, 0)).status.code == pb.OK
    repl, epoch = pair.brokers[0].replication, pair.leadership(0).epoch(0)
    assert repl is not None and epoch is not None
    endpoint, queue = pair.brokers[1].endpoint, model.QueueId.lmq(PARENT, lite)

    def copy(message_id: str, offset: int, slot: int = 0) -> bytes:
        m = dispatch_testing.lite_message(lite, b"body", parent=PARENT, message_id=message_id)
        return wire.encode(slot, epoch, [m], [model.AppendResult(message_id, m.queues, (offset, offset), 0)])

    assert await both_ways(repl, endpoint, copy(f"{lite}-0", 0)) == [{}, {}, {}]  # stored there: passed over
    ways: list[Callable[[str, bytes], Awaitable[dict[str, int]]]] = [
        functools.partial(over_the_socket, repl),
        repl.send_stream,
        repl.send_unary,
    ]
    for n, send in enumerate(ways):
        assert await send(endpoint, copy(f"new-{n}", 1 + n)) == {} and pair.stored(1, lite) == 2 + n
        assert await send(endpoint, copy(f"new-{n}", 1 + n)) == {} and pair.stored(1, lite) == 2 + n  # again
    assert await both_ways(repl, endpoint, copy("later", 9)) == [{queue.topic: 4}] * 3  # behind: its ends
    foreign = await both_ways(repl, endpoint, copy("x", 4, slot=7))
    assert len(set(foreign)) == 1 and "FAILED_PRECONDITION this broker is no replica of slot 7" in str(foreign[0])
    assert (  # of the same epoch: the holder deleted the topic and created it again, not expired here yet
        await both_ways(repl, endpoint, copy("other", 0))
        == [f"FAILED_PRECONDITION slot 0: {queue.topic} {following.RECREATED} (offset 0)"] * 3
    )
    pair.leadership(1).epochs[0] = epoch + 1  # the follower saw a newer holder: this owner is deposed
    stale = await both_ways(repl, endpoint, copy("stale", 4))
    assert stale == [f"FAILED_PRECONDITION slot 0 is at epoch {epoch + 1}: a copy of epoch {epoch} is refused"] * 3
    assert pair.stored(1, lite) == 4


@pytest.mark.asyncio
async def test_a_copy_in_either_layout_gets_the_same_answer_and_is_stored_alike(pair: Pair) -> None:
    lite = pair.lite_of(0)
    assert (await pair.send(0, lite, 0)).status.code == pb.OK
    repl, epoch, store = pair.brokers[0].replication, pair.leadership(0).epoch(0), pair.brokers[1].store
    assert repl is not None and epoch is not None and store is not None
    endpoint, queue = pair.brokers[1].endpoint, model.QueueId.lmq(PARENT, lite)
    sent: list[model.NewMessage] = []

    def copy(encode: Callable[..., bytes], message_id: str, offset: int) -> bytes:
        m = dataclasses.replace(
            dispatch_testing.lite_message(lite, message_id.encode(), parent=PARENT, message_id=message_id, tag="é"),
            keys=("key",),
            user_properties={"k": "v\u00fc"},
            epoch=epoch,
        )
        sent.append(m)
        return encode(0, epoch, [m], [model.AppendResult(message_id, m.queues, (offset, offset), 0)])

    for offset, encode in ((1, wire.encode), (2, wire.encode_json)):
        assert await repl.send(endpoint, copy(encode, f"{encode.__name__}-{offset}", offset)) == {}
    ahead = [await repl.send(endpoint, copy(encode, "later", 9)) for encode in (wire.encode, wire.encode_json)]
    assert ahead == [{queue.topic: 3}] * 2
    fields = [(m.message_id, m.body, m.tag, m.keys, m.user_properties, m.epoch) for m in store.read(queue, 1, 5)]
    assert fields == [(m.message_id, m.body, m.tag, m.keys, m.user_properties, m.epoch) for m in sent[:2]]


@pytest.mark.asyncio
async def test_a_follower_of_an_older_version_gets_json_copies(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """A follower without the binary stream, which cannot read the binary layout (as a broker before it): the
    owner's copies reach it in JSON and sends are acknowledged, none refused on the way."""
    owner, older = pair.brokers[0].replication, pair.brokers[1].replication
    assert owner is not None and older is not None and older.follower is not None
    older.methods -= {replication.STREAM_BINARY, replication.COPY_SOCKET}
    accept, layouts = older.follower.accept, []

    async def json_only(data: bytes) -> dict[str, int]:
        layouts.append("binary" if wire.is_binary(data) else "json")
        if wire.is_binary(data):
            raise errors.InvalidArgument("unreadable replica copy: Expecting value")  # what it would answer
        return await accept(data)

    monkeypatch.setattr(older.follower, "accept", json_only)
    assert owner.sockets is not None
    for link in owner.copy_links.values():  # a binary stream a probe opened before: the next copy opens another
        await link.close()
    for socket_link in owner.sockets.links.values():  # and its copy socket: asked again, it has none
        await socket_link.close()
    lite, endpoint = pair.lite_of(0), pair.brokers[1].endpoint
    for n in range(3):
        reply = await pair.send(0, lite, n, retry_fenced=False)
        assert reply.status.code == pb.OK, reply.status.message
    assert pair.stored(1, lite) == 3 and set(layouts) == {"json"}
    assert owner.copy_links[endpoint].unimplemented and owner.json_links[endpoint].is_open
    assert refused(pair.brokers[0], "insync") == 0


def copies_refused(broker: app.Broker, reason: str) -> float:
    value = broker.metrics.registry.get_sample_value("lmq_replication_copies_refused_total", {"reason": reason})
    return value or 0.0


async def hello_and_copy(port: int, hello: bytes, copy: bytes) -> bytes:
    """What a copy socket sends back first to a connection that says ``hello`` and then sends ``copy`` (b"":
    closed)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(local_hop.frame(0, hello) + local_hop.frame(1, copy))
        await writer.drain()
        async with asyncio.timeout(TIMEOUT_S):
            return await reader.read(65536)
    finally:
        writer.close()


@pytest.mark.asyncio
async def test_a_copy_socket_connection_without_a_valid_hello_is_closed_unread_and_counted(pair: Pair) -> None:
    """The copy socket admits peers only, as the copy calls do: a hello that is no peer header of the cluster's
    secret (forged, of another method, none, too long) closes the connection before its copy is read, counted as
    ``not_peer``; the owner's own hello is served. Nothing stored from the refused ones."""
    lite = pair.lite_of(0)
    assert (await pair.send(0, lite, 0)).status.code == pb.OK
    owner, follower = pair.brokers[0].replication, pair.brokers[1].replication
    epoch = pair.leadership(0).epoch(0)
    assert owner is not None and follower is not None and follower.sockets is not None and epoch is not None
    port = follower.sockets.port
    assert port is not None
    m = dispatch_testing.lite_message(lite, b"x", parent=PARENT, message_id="intruder")
    copy = wire.encode(0, epoch, [m], [model.AppendResult("intruder", m.queues, (1, 1), 0)])
    before = copies_refused(pair.brokers[1], "not_peer")
    now_ms = int(time.time() * 1000)
    for hello in (
        b"",
        trust.header(b"another secret", sockets.HELLO, 0, now_ms)[1].encode(),
        trust.header(owner._secret, replication.METHOD, 0, now_ms)[1].encode(),  # a call's header, not a hello
        b"x" * (local_hop.HELLO_MAX_BYTES + 1),  # more than a hello: not buffered
    ):
        assert await hello_and_copy(port, hello, copy) == b""
    assert copies_refused(pair.brokers[1], "not_peer") == before + 4
    assert pair.stored(1, lite) == 1
    answer = await hello_and_copy(port, owner._hello().encode(), copy)  # the owner's hello: served
    assert answer == local_hop.frame(1, bytes((streams.STORED,))) and pair.stored(1, lite) == 2


@pytest.mark.asyncio
async def test_copies_take_the_socket_and_the_stream_while_it_is_closed(pair: Pair) -> None:
    """Sends acknowledged whichever way their copies go: over the socket once open, over the gRPC stream while it
    is not (the follower restarting: its socket closed, opened again in the background)."""
    owner = pair.brokers[0].replication
    assert owner is not None and owner.sockets is not None
    lite, endpoint = pair.lite_of(0), pair.brokers[1].endpoint
    assert (await pair.send(0, lite, 0)).status.code == pb.OK
    link = owner.sockets.link(endpoint, replication.CALL_TIMEOUT_S)
    await eventually_async(link.ready, "the copy socket open")
    for n in range(1, 4):
        assert (await pair.send(0, lite, n)).status.code == pb.OK
    assert pair.stored(1, lite) == 4 and link.is_open
    config = pair.brokers[1].config
    await pair.brokers[1].stop(grace_s=0.1)
    await eventually_async(lambda: not link.is_open, "the owner saw its socket close")
    pair.brokers[1] = await start_broker(config)
    await eventually_async(lambda: pair.leadership(1).epoch(1) is not None, "broker 1 back")
    for n in range(4, 8):
        reply = await pair.send(0, lite, n)
        assert reply.status.code == pb.OK, reply.status.message
    assert pair.stored(1, lite) == 8
    await eventually_async(link.ready, "the copy socket open again")
    assert (await pair.send(0, lite, 8)).status.code == pb.OK and pair.stored(1, lite) == 9


@pytest.mark.asyncio
async def test_a_replica_stream_without_a_peer_header_is_refused_and_a_failed_one_opened_again(pair: Pair) -> None:
    endpoint = pair.brokers[1].endpoint
    channel = grpc.aio.insecure_channel(endpoint)
    try:
        unsigned = channel.stream_stream(replication.STREAM, None, None)
        forged = streams.Link(endpoint, lambda: unsigned(None), 2.0)
        with pytest.raises(errors.BrokerUnavailable, match="PERMISSION_DENIED"):
            await forged.send(b"")
        await forged.close()
    finally:
        await channel.close(None)
    lite = pair.lite_of(0)
    assert (await pair.send(0, lite, 0)).status.code == pb.OK
    repl = pair.brokers[0].replication
    assert repl is not None and repl.copy_links[endpoint].is_open
    config = pair.brokers[1].config
    await pair.brokers[1].stop(grace_s=0.1)
    await eventually_async(lambda: not repl.copy_links[endpoint].is_open, "the owner saw its stream fail")
    pair.brokers[1] = await start_broker(config)
    await eventually_async(lambda: pair.leadership(1).epoch(1) is not None, "broker 1 back")
    reply = await pair.send(0, lite, 1)  # over a new stream
    assert reply.status.code == pb.OK, reply.status.message
    assert pair.stored(1, lite) == 2 and repl.copy_links[endpoint].is_open


def test_the_lease_api_answers_alike_on_kept_connections_and_reopens_one_the_apiserver_closed(
    kube: testing.KubeAPI,
) -> None:
    outcomes, closing = [], []
    for keep in (True, False):
        api = kube_api.ApiServer(kube.server, kube.token, kube.ca_file, "default", keep_alive=keep)
        closing.append(api)
        name = f"keep-{str(keep).lower()}-slot-0"
        missing = api.get(name)
        created = api.create(name, "a", 5, (0, 1))
        renewed = api.write(created, "a", 0, 5, (0,))
        with pytest.raises(kube_api.Conflict):
            api.write(created, "b", 1, 5)  # its resourceVersion is gone
        listed = api.list_named(f"keep-{str(keep).lower()}-")
        seen = [(x.holder, x.transitions, x.duration_s, x.in_sync) for x in (created, renewed, *listed)]
        outcomes.append((missing, seen, api.opened))
    assert outcomes[0][:2] == outcomes[1][:2] == (None, [("a", 0, 5, (0, 1)), ("a", 0, 5, (0,)), ("a", 0, 5, (0,))])
    assert (outcomes[0][2], outcomes[1][2]) == (1, 5)  # one connection kept, against one per call
    kept = kube_api.ApiServer(kube.server, kube.token, kube.ca_file, "default", keep_alive=True)
    closing.append(kept)
    try:
        assert kept.get("keep-true-slot-0") is not None
        kept._idle[0].sock.shutdown(socket.SHUT_RDWR)  # as the apiserver closing it while idle
        assert kept.get("keep-true-slot-0") is not None and kept.opened == 2
    finally:
        for api in closing:
            api.close()


async def start_joining(ring: Pair, tmp_path: Path, port: int = 0, **more: object) -> tuple[mb.Membership, app.Broker]:
    """The ring of ``ring`` grown by one broker, and that broker started as the operator starts a new pod: the
    grown ring and its history from its flags, the lease settings of the others."""
    port = port or free_ports("127.0.0.1", 1)[0]
    grown = ring.membership.grown(f"127.0.0.1:{port}")
    first = ring.brokers[0].config
    joining = await start_broker(
        dispatch_testing.config_for(
            tmp_path / f"b{len(ring.brokers)}",
            host="127.0.0.1",
            port=port,
            metrics_port=-1,
            peers=",".join(grown.members),
            ring_history=",".join(str(size) for size in grown.sizes[:-1]),
            ordinal=len(ring.brokers),
            advertised_address=f"127.0.0.1:{port}",
            admin_access_key="admin-ak",
            admin_secret_key="admin-sk",
            replicas=2,
            **{k: getattr(first, k) for k in ("lease_namespace", "lease_prefix", "lease_duration_ms")},
            **{k: getattr(first, k) for k in ("kube_api_server", "kube_token_file", "kube_ca_file")},
            **more,
        )
    )
    return grown, joining


@pytest.mark.asyncio
async def test_a_grown_ring_moves_a_slots_follower_only_once_the_new_one_is_in_the_set(
    pair: Pair, tmp_path: Path
) -> None:
    """Ring change steps 2-4 (docs/replication.md, *Changing the ring with R > 1*), R = 2, a ring of 2 grown to
    3. The grown membership is applied to the running brokers directly (``Peers.apply``, what SetCluster does
    after its refusal, which stays until steps 5-7 are built). Slot 1's replicas become the union of the old
    ring's (1, 0) and the new one's (1, 2): its holder copies to the new broker too, whose probe catches it up
    and records it in the slot's in-sync set; then the holder writes the set without the old follower and stops
    copying there, and the old follower stops following the slot, keeping what it stored. Every acknowledged
    message is on the new ring's replicas once, in order, at the owner's offsets, its slot recorded."""
    lite = pair.lite_of(1)
    for n in range(3):
        assert (await pair.send(1, lite, n)).status.code == pb.OK
    grown, third = await start_joining(pair, tmp_path)
    try:
        for slot, broker in enumerate(pair.brokers):
            assert broker.cluster is not None and broker.cluster.peers is not None
            broker.cluster.peers.apply(grown, slot)
        holder, old = pair.leadership(1), pair.leadership(0)
        assert holder.replica_sets == [[0, 1], [1, 2, 0], [2, 0]]  # the union, until the new follower is in
        await eventually_async(lambda: holder.in_sync(1) == (1, 2), "the new follower in, the old one out")
        await eventually_async(lambda: 1 not in old.mine and old.replica_sets[1] == [1, 2], "old follower left")
        repl = pair.brokers[1].replication
        assert repl is not None
        await eventually_async(lambda: list(repl.slots.owners()[1].followers) == [2], "no copies to the old one")
        for n in range(3, 6):
            assert (await pair.send(1, lite, n)).status.code == pb.OK
        queue = model.QueueId.lmq(PARENT, lite)
        for store, sent in ((pair.brokers[1].store, 6), (third.store, 6), (pair.brokers[0].store, 3)):
            assert store is not None
            stored = [(m.offset, m.message_id, m.slot) for m in store.read(queue, 0, 100)]
            assert stored == [(n, f"{lite}-{n}", 1) for n in range(sent)]
    finally:
        await third.stop(grace_s=0.2)


@pytest.mark.asyncio
async def test_a_slot_a_failover_gave_to_an_old_replica_moves_to_the_grown_rings_replicas_by_release(
    kube: testing.KubeAPI, pair: Pair, tmp_path: Path
) -> None:
    """Ring change step 5 in a scale-up, R = 2, a ring of 2 grown to 3 through each broker's membership change:
    broker 0 holds slot 1 (a failover), which the ring of 3 does not give slot 1 (its replicas become (1, 2)),
    so its holder cannot narrow the set. Once both new-ring replicas are in the set, broker 0 releases the
    lease; one of them takes it at its next tick and narrows the set to (1, 2); broker 0 never takes it back.
    Every acknowledged message of slot 1, before and after, is on the final replicas once, in order."""
    (port,) = free_ports("127.0.0.1", 1)
    lite = next(
        f"s-{i}"
        for i in range(10_000)
        if mb.candidates(pair.membership.grown(f"127.0.0.1:{port}"), lmq_of(f"s-{i}")) == (1,)
        and pair.owner(f"s-{i}") == 1
    )
    old = pair.leadership(0)
    await eventually_async(lambda: pair.leadership(1).in_sync(1) == (0, 1), "slot 1's follower in the set")
    take_lease(kube, pair.leadership(1).name(1), old.identity)
    await eventually_async(lambda: old.epoch(1) is not None, "broker 0 holds slot 1 (a failover)")
    await eventually_async(lambda: old.in_sync(1) == (0, 1), "broker 1 probed back into the set")
    for n in range(3):
        assert (await pair.send(0, lite, n)).status.code == pb.OK
    grown, third = await start_joining(pair, tmp_path, port)
    try:
        for slot, broker in enumerate(pair.brokers):
            assert broker.cluster is not None
            await broker.cluster.change(cluster_setup.Place(grown, slot, cluster_setup.ADMIN))
        await eventually_async(lambda: old.releases == 1, "broker 0 released slot 1 once both new replicas were in")
        assert third.replication is not None
        new = [pair.leadership(1), third.replication.leadership]
        taker = await eventually_async(lambda: next((n for n in new if n.epoch(1) is not None), None), "taken")
        assert taker is not None
        await eventually_async(lambda: taker.in_sync(1) == (1, 2), "the set narrowed to the new ring's replicas")
        other, epoch = (third if taker is new[0] else pair.brokers[1]).replication, taker.epoch(1)
        assert other is not None and other.follower is not None and epoch is not None
        follower = other.follower
        await eventually_async(lambda: follower.in_sync(1, epoch), "the other new replica reconciled with the taker")
        assert not old.holds(1) and old.releases == 1
        assert third.store is not None
        pair.clients.append(protocol_testing.connect(third.endpoint, third.store))
        for n in range(3, 6):  # through the taker (clients are routed to the holder)
            assert (await pair.send(1 if taker is new[0] else 2, lite, n)).status.code == pb.OK
        queue = model.QueueId.lmq(PARENT, lite)
        for store in (pair.brokers[1].store, third.store):
            assert store is not None
            stored = [(m.offset, m.message_id, m.slot) for m in store.read(queue, 0, 100)]
            assert stored == [(n, f"{lite}-{n}", 1) for n in range(6)]
    finally:
        await third.stop(grace_s=0.2)


@pytest.mark.asyncio
async def test_a_removed_pod_hands_the_slot_it_holds_over_and_the_slot_keeps_every_message(
    kube: testing.KubeAPI, tmp_path: Path
) -> None:
    """Ring change steps 2-5, R = 2, a ring of 3 shrunk to 2 (slot 2 leaving), the membership applied to the
    running brokers directly (``Peers.apply``; SetCluster refuses it until steps 6-7 are built). Broker 2 holds
    slot 1's lease (taken by force, as after a failover). Slot 1's replicas become the union (1, 0, 2), so
    broker 0 (its follower in the ring of 2) is probed into the set; broker 2, being removed, releases the
    lease, and a broker that stays, in the set and in sync, takes it at its next tick without waiting for it
    to expire; broker 2 then leaves the set. Every acknowledged message of slot 1 is on its final replicas
    once, in order; broker 2 never takes the slot back."""
    ring = await start_ring(tmp_path, 3, lease_flags(kube, tmp_path))
    try:
        lite = ring.lite_of(1)
        for n in range(3):
            assert (await ring.send(1, lite, n)).status.code == pb.OK
        leaving = ring.leadership(2)
        await eventually_async(lambda: ring.leadership(1).in_sync(1) == (1, 2), "slot 1's follower in the set")
        take_lease(kube, ring.leadership(1).name(1), leaving.identity)
        await eventually_async(lambda: leaving.epoch(1) is not None, "broker 2 holds slot 1 (a failover)")
        await eventually_async(lambda: leaving.in_sync(1) == (1, 2), "broker 1 probed back into the set")
        why: dict[str, list[str]] = {}
        for n in range(3, 6):  # a view of the holder not yet at the taken lease refuses with "try again"
            await sent_until_acknowledged(ring, 2, lite, n, why)
        shrunk = ring.membership.shrunk(2)
        for slot, broker in enumerate(ring.brokers):
            assert broker.cluster is not None and broker.cluster.peers is not None
            broker.cluster.peers.apply(shrunk, slot)
        await eventually_async(lambda: leaving.releases == 1, "slot 1 released by the pod being removed")
        released = time.monotonic()
        staying = [ring.leadership(0), ring.leadership(1)]
        taker = await eventually_async(
            lambda: next((s for s in staying if s.epoch(1) is not None), None), "slot 1 taken by a pod that stays"
        )
        assert taker is not None
        took_s = time.monotonic() - released
        print(f"slot 1 taken {took_s:.2f} s after its release (lease {LEASE_MS} ms)")
        assert took_s < LEASE_MS / 1000  # at its next tick: not after the lease's expiry
        await eventually_async(lambda: taker.in_sync(1) == (0, 1), "the new ring's replicas in, broker 2 out")
        assert sum(s.takeovers for s in staying) == 1
        for n in range(6, 9):
            await sent_until_acknowledged(ring, 1, lite, n, why)
        queue = model.QueueId.lmq(PARENT, lite)
        for store, sent in ((ring.brokers[0].store, 9), (ring.brokers[1].store, 9), (ring.brokers[2].store, 6)):
            assert store is not None
            stored = [(m.offset, m.message_id) for m in store.read(queue, 0, 100)]
            stored_once_or_retried(stored, [f"{lite}-{n}" for n in range(sent)], why)
        assert not leaving.holds(1) and leaving.holds(2)  # its own (leaving) slot stays with it
    finally:
        await ring.close()


async def set_cluster_everywhere(ring: Pair, members: Sequence[str], sizes: Sequence[int], epoch: int) -> None:
    """SetCluster at every broker of ``ring``, as the operator tells them."""
    for broker in ring.brokers:
        with AdminClient(broker.endpoint, timeout_s=10, access_key="admin-ak", secret_key="admin-sk") as admin:
            await asyncio.to_thread(admin.set_cluster, members, sizes, epoch=epoch)


async def handed_over(ring: Pair, leaving: int) -> None:
    """Until broker ``leaving`` counts nothing undrained (its consumed topics taken over)."""
    deadline = time.monotonic() + TIMEOUT_S
    with AdminClient(ring.brokers[leaving].endpoint, timeout_s=10, access_key="admin-ak", secret_key="admin-sk") as a:
        while (await asyncio.to_thread(a.cluster, with_undrained=True)).undrained_messages:
            assert time.monotonic() < deadline, "not handed over"
            await asyncio.sleep(0.1)


async def sent_until_acknowledged(
    ring: Pair, via: int, lite: str, n: int, why: dict[str, list[str]] | None = None
) -> int:
    """Send ``lite``'s message ``n`` through broker ``via`` until it is acknowledged, as the clients retry a
    send refused with "try again"; the refusals it took (their texts into ``why``, by message id)."""
    refusals = 0
    deadline = time.monotonic() + TIMEOUT_S
    while (reply := await ring.send(via, lite, n)).status.code != pb.OK:
        assert "try again" in reply.status.message and time.monotonic() < deadline, reply.status
        refusals += 1
        if why is not None:
            why.setdefault(f"{lite}-{n}", []).append(reply.status.message)
        await asyncio.sleep(0.05)
    return refusals


def stored_once_or_retried(stored: list[tuple[int, str]], sent: list[str], why: dict[str, list[str]]) -> None:
    """``stored`` (offset, message id) holds every acknowledged message of ``sent``, in order, at offsets 0, 1,
    ...; a message is there more than once only if a send of it was refused in a way that may follow its store
    (too few replicas in sync, the lease lost meanwhile: at-least-once, docs/replication.md), never after a
    refusal that says nothing was stored."""
    assert [offset for offset, _ in stored] == list(range(len(stored))), stored
    ids = [message_id for _, message_id in stored]
    assert [i for k, i in enumerate(ids) if k == 0 or ids[k - 1] != i] == sent, (ids, why)
    for twice in {i for i in ids if ids.count(i) > 1}:
        refused = why.get(twice, [])
        assert refused and not all("nothing was stored" in text for text in refused), (twice, refused)


@pytest.mark.asyncio
async def test_a_drained_topic_of_a_leaving_slot_goes_on_at_its_new_owner_where_it_ended(
    kube: testing.KubeAPI, tmp_path: Path
) -> None:
    """Scale-down at R = 2, a ring of 3 to 2 (docs/replication.md, *Changing the ring with R > 1*): SetCluster
    marks slot 2 leaving on every broker. Two topics of slot 2 (three sends each, consumed: drained), one owned
    in the ring of 2 by slot 0 (broker 0, slot 2's follower, holds its copies), one by slot 1 (broker 1 holds
    nothing of it). The next send of each, through any broker, is handed over by slot 2's holder and taken
    over by the new owner where the topic ends (offset 3), its commit point with it: each new owner's replicas
    hold the topic's messages once, in order, at the same offsets, the later ones recording the new slot, and
    its commit point (copied to a follower that lacked the topic once its messages are there). Before,
    the first was fenced at broker 0 for ever (its copy named slot 2, whose lease it does not hold) and the
    second stored afresh at offset 0 by broker 1, where broker 0 held slot 2's copies: refused until broker 1
    had stored three more, after which the two replicas of slot 1 held different messages at offsets 0-2. Nobody
    sends to them while slot 2 is leaving at first: the leaving broker hands both over all the same (until then
    it counts each undrained: removed before, a topic would meet the same fate at its next send), then counts
    nothing, and the slot is removed by SetCluster."""
    ring = await start_ring(tmp_path, 3, lease_flags(kube, tmp_path))
    try:
        members = ring.membership.members
        shrunk = ring.membership.shrunk(2)
        lites: dict[int, str] = {}  # new owner -> a topic of slot 2
        for i in range(10_000):
            lite, topic = f"d-{i}", model.QueueId.lmq(PARENT, f"d-{i}").topic
            if ring.owner(lite) == 2 and len(lites) < 2:
                lites.setdefault(mb.owner(shrunk, topic), lite)
        for lite in lites.values():
            for n in range(3):
                assert (await ring.send(2, lite, n)).status.code == pb.OK
            await eventually_async(functools.partial(lambda lt: ring.stored(0, lt) == 3, lite), "copied to broker 0")
            holder = ring.brokers[2].store
            assert holder is not None
            holder.commit_offset(model.QueueId.lmq(PARENT, lite), GROUP, 3)  # consumed: drained
        epoch = max(b.cluster.membership.epoch for b in ring.brokers if b.cluster is not None) + 1
        await set_cluster_everywhere(ring, members, shrunk.sizes, epoch)
        marked = time.monotonic()
        await handed_over(ring, 2)  # consumed, nobody sends: handed over all the same, then nothing undrained
        print(f"both consumed topics handed over {time.monotonic() - marked:.2f} s after slot 2 was marked leaving")
        for new, lite in lites.items():
            assert (repl := ring.brokers[new].replication) is not None
            assert repl.slots.slot_of_topic(model.QueueId.lmq(PARENT, lite).topic) == new
            for replica in (0, 1):  # the new slot's replicas hold it as it was, before any new send
                assert ring.stored(replica, lite) == 3
        refused_sends = {}
        for lite in lites.values():
            refused_sends[lite] = [await sent_until_acknowledged(ring, via, lite, 3 + via) for via in (2, 0, 1)]
        print(f"sends refused per topic, through brokers 2, 0, 1: {refused_sends}")
        for new, lite in lites.items():
            queue = model.QueueId.lmq(PARENT, lite)
            want = [f"{lite}-{n}" for n in range(3)] + [f"{lite}-{3 + via}" for via in (2, 0, 1)]
            for replica in (0, 1):
                store = ring.brokers[replica].store
                assert store is not None
                ids = functools.partial(lambda s, q: [m.message_id for m in s.read(q, 0, 100)], store, queue)
                await eventually_async(functools.partial(lambda i, w: i() == w, ids, want), f"{lite} on {replica}")
                stored = store.read(queue, 0, 100)
                assert [(m.offset, m.slot) for m in stored] == [(k, 2 if k < 3 else new) for k in range(6)]
            for replica in (0, 1):  # the commit point came along, to the new slot's follower too
                store = ring.brokers[replica].store
                assert store is not None
                point = functools.partial(lambda s, q: (s.get_offset(q, GROUP) or 0) >= 3, store, queue)
                await eventually_async(point, f"{lite}'s commit point on broker {replica}")
        with AdminClient(ring.brokers[2].endpoint, timeout_s=10, access_key="admin-ak", secret_key="admin-sk") as a:
            assert (await asyncio.to_thread(a.cluster, with_undrained=True)).undrained_messages == 0
        await set_cluster_everywhere(ring, members[:2], (2,), epoch + 1)
        for lite in lites.values():
            assert await sent_until_acknowledged(ring, 0, lite, 10) >= 0
    finally:
        await ring.close()


@pytest.mark.asyncio
async def test_a_topic_taken_over_idle_is_sent_to_after_its_slot_was_removed_and_forgotten(
    kube: testing.KubeAPI, tmp_path: Path
) -> None:
    """Scale-down at R = 2, a ring of 3 to 2: a consumed topic of slot 2 is taken over idle by its owner in the
    ring of 2 (no send: its last record still names slot 2), then slot 2 is removed. The take-over is
    remembered in memory only, so the staying brokers are made to forget it (as a restart, or their full cache
    of recorded slots, does): a record naming a slot the ring no longer has is filed by today's ring, so the
    next send is acknowledged and stored after the topic's end on its new replicas. Before, every send failed
    with an internal error (the removed slot had no replicas) for ever."""
    ring = await start_ring(tmp_path, 3, lease_flags(kube, tmp_path))
    try:
        members = ring.membership.members
        shrunk = ring.membership.shrunk(2)
        lite = next(f"i-{i}" for i in range(10_000) if ring.owner(f"i-{i}") == 2)
        queue = model.QueueId.lmq(PARENT, lite)
        new = mb.owner(shrunk, queue.topic)
        for n in range(3):
            assert (await ring.send(2, lite, n)).status.code == pb.OK
        holder = ring.brokers[2].store
        assert holder is not None
        holder.commit_offset(queue, GROUP, 3)  # consumed: drained
        epoch = max(b.cluster.membership.epoch for b in ring.brokers if b.cluster is not None) + 1
        await set_cluster_everywhere(ring, members, shrunk.sizes, epoch)
        await handed_over(ring, 2)  # consumed, nobody sends: taken over all the same
        await set_cluster_everywhere(ring, members[:2], (2,), epoch + 1)
        for broker in ring.brokers[:2]:
            assert broker.replication is not None
            broker.replication.slots._recorded.clear()  # forgotten: a restart, or the cache emptied when full
            assert broker.replication.slots.followed_slot(queue.topic) == new
        assert (taker := ring.brokers[new].replication) is not None
        assert taker.slots.slot_of_topic(queue.topic) == new
        assert await sent_until_acknowledged(ring, 0, lite, 3) >= 0
        want = [(0, 2), (1, 2), (2, 2), (3, new)]
        for replica in (0, 1):
            store = ring.brokers[replica].store
            assert store is not None
            read = functools.partial(lambda s: [(m.offset, m.slot) for m in s.read(queue, 0, 100)], store)
            await eventually_async(functools.partial(lambda r: r() == want, read), f"{lite} on broker {replica}")
    finally:
        await ring.close()


@pytest.mark.asyncio
async def test_a_release_at_one_in_sync_replica_waits_for_the_copies_queued_to_the_taker(
    kube: testing.KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At --min-insync-replicas 1 sends and commit points are answered before their copies are stored: a release
    (step 5 of a ring change) writes the lease for the taker only once what is still queued for the in-sync set
    was stored there. The follower's disk made slow (each copy's append 0.3 s later) keeps them queued; a lease
    of 6 s lets the release wait up to 3 s (half a lease at most: then the lease would expire meanwhile)."""
    flags = {**lease_flags(kube, tmp_path), "lease_duration_ms": 6000}
    pair = await start_pair(tmp_path, min_insync_replicas=1, **flags)
    try:
        lite = pair.lite_of(0)
        queue = model.QueueId.lmq(PARENT, lite)
        await eventually_async(lambda: pair.leadership(0).in_sync(0) == (0, 1), "the follower in slot 0's set")
        follower = pair.brokers[1].dispatcher
        assert follower is not None
        append = follower.ingest.append_copy

        async def slow(messages: Any) -> Any:
            await asyncio.sleep(0.3)
            return await append(messages)

        monkeypatch.setattr(follower.ingest, "append_copy", slow)
        for n in range(5):
            assert (await pair.send(0, lite, n)).status.code == pb.OK  # answered alone: its copy queued
        owner = pair.brokers[0].dispatcher
        assert owner is not None
        await owner.reset_offsets(GROUP, PARENT, [lite], offsets.OffsetReset(offsets.OffsetPolicy.MAX))
        assert pair.stored(1, lite) < 5  # still on its way
        repl = pair.brokers[0].replication
        assert repl is not None
        assert await repl.release(0)
        assert pair.stored(1, lite) == 5  # every acknowledged send at the taker before the lease said released
        store = pair.brokers[1].store
        assert store is not None
        assert store.get_offset(queue, GROUP) == 5  # and the commit point
    finally:
        await pair.close()


@pytest.mark.asyncio
async def test_a_topic_placed_by_the_older_ring_keeps_its_slots_copies_across_two_failovers(
    kube: testing.KubeAPI, tmp_path: Path
) -> None:
    """The fact-3 trace of docs/replication.md (*Why a ring change is more than SetCluster at R > 1*), R = 2,
    --min-insync-replicas 1, a ring of 2 grown to 3 through the brokers' own membership change
    (``Cluster.change``: taken, every topic of the brokers' stores names its slot). Topic T is
    placed on slot 1 by the ring of 2; today's ring hashes it to slot 2. Broker 1 dies; broker 2 takes slot 1
    and, holding slot 2 as well, stores T's next sends; they must be filed under slot 1 (its records say so),
    so when broker 1 returns, its reconcile and the holder's probe of slot 1 bring them back, and after broker
    2 dies broker 1 serves every acknowledged message of T. Filed under slot 2 (today's ring) they were not:
    broker 1 was in sync without them, and they were lost with broker 2."""
    ring = await start_ring(tmp_path, 2, {**lease_flags(kube, tmp_path), "min_insync_replicas": 1})
    try:
        (port,) = free_ports("127.0.0.1", 1)
        grown = ring.membership.grown(f"127.0.0.1:{port}")
        name = next(n for n in (f"f-{i}" for i in range(10_000)) if mb.candidates(grown, lmq_of(n)) == (2, 1))
        assert (await ring.send(1, name, 0)).status.code == pb.OK  # placed on slot 1 by the ring of 2
        third = (await start_joining(ring, tmp_path, port, min_insync_replicas=1))[1]
        assert third.store is not None
        ring.brokers.append(third)
        ring.clients.append(protocol_testing.connect(third.endpoint, third.store))
        for slot, broker in enumerate(ring.brokers):
            assert broker.cluster is not None
            await broker.cluster.change(cluster_setup.Place(grown, slot, cluster_setup.ADMIN))
        await eventually_async(lambda: ring.leadership(1).in_sync(1) == (1, 2), "slot 1: the new ring's replicas")
        for n in range(1, 4):  # through broker 2: placed on slot 1, whose holder stores it
            assert (await ring.send(2, name, n)).status.code == pb.OK
        await eventually_async(lambda: reconciled(third, 1), "broker 2 reconciled with slot 1's holder")
        await ring.brokers[1].stop(grace_s=0.1)  # pod 1 dies: broker 2 takes slot 1 over
        await eventually_async(lambda: ring.leadership(2).epoch(1) is not None, "broker 2 took slot 1")
        for n in range(4, 7):  # stored by broker 2, which holds slot 2 too
            assert (await ring.send(2, name, n)).status.code == pb.OK
        assert third.replication is not None and third.replication.slots.slot_of_topic(lmq_of(name)) == 1
        ring.brokers[1] = await start_broker(ring.brokers[1].config)  # pod 1 back on its disk
        await eventually_async(lambda: ring.leadership(2).in_sync(1) == (1, 2), "broker 1 back in slot 1's set")
        await eventually_async(lambda: reconciled(ring.brokers[1], 1), "broker 1 reconciled with broker 2")
        await ring.brokers[2].stop(grace_s=0.1)  # pod 2 dies: broker 1 takes slot 1 back
        await eventually_async(lambda: ring.leadership(1).epoch(1) is not None, "broker 1 took slot 1 back")
        store = ring.brokers[1].store
        assert store is not None
        held = [(m.offset, m.message_id, m.slot) for m in store.read(model.QueueId(lmq_of(name), 0), 0, 100)]
        assert held == [(n, f"{name}-{n}", 1) for n in range(7)]
    finally:
        await ring.close()


def reconciled(broker: app.Broker, slot: int) -> bool:
    """``broker`` fetched every lite topic's end of ``slot`` from its holder at the current epoch (a takeover
    needs it, as much as a place in the in-sync set)."""
    repl = broker.replication
    if repl is None or repl.follower is None:
        return False
    epoch = repl.leadership.epochs.get(slot)
    return epoch is not None and repl.follower.in_sync(slot, epoch)


def lmq_of(lite: str) -> str:
    return model.QueueId.lmq(PARENT, lite).topic


# --- a lite topic reclaimed while replicated ----------------------------------------------------------------
# Each broker deletes its own expired copy (the in-broker expiry, the reclaim job's CompareAndDelete on each
# broker), so the owner and its follower delete a topic at different moments. A send that re-creates the topic at
# the owner (offset 0 again) while the follower still holds the old one must be stored on both, never after the
# old records.
MIN_AGE_MS = 300  # --lite-ttl-min-age-ms of both brokers; their own passes are off (--lite-ttl-interval-ms 0)


@pytest_asyncio.fixture
async def expiring_pair(kube: testing.KubeAPI, tmp_path: Path) -> AsyncIterator[Pair]:
    started = await start_pair(
        tmp_path, lite_ttl_interval_ms=0, lite_ttl_min_age_ms=MIN_AGE_MS, **lease_flags(kube, tmp_path)
    )
    for slot in (0, 1):
        expiring(started, slot, 0)
    yield started
    await started.close()


def expiring(pair: Pair, slot: int, minutes: int) -> None:
    """The parent's expiration as broker ``slot`` holds it (0: idle past the minimum age is expired; -1: never)."""
    broker = pair.brokers[slot]
    assert broker.store is not None and broker.dispatcher is not None
    broker.store.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE, expiration_minutes=minutes))
    broker.dispatcher.metadata_changed()


async def idle(pair: Pair, lite: str) -> None:
    """Until both brokers' copies of ``lite`` are idle for the minimum age."""

    def both() -> bool:
        now = int(time.time() * 1000)
        metas = [b.store.lite_topic(PARENT, lite) for b in pair.brokers if b.store is not None]
        return all(m is not None and expiry.is_expired(m, now, 0, MIN_AGE_MS) for m in metas)

    await eventually_async(both, f"{lite} idle at both brokers")


async def reclaim(pair: Pair, slot: int, lite: str) -> None:
    """What the reclaimer does at broker ``slot``: compare-and-delete with the values it read."""
    broker = pair.brokers[slot]
    assert broker.store is not None and broker.dispatcher is not None
    meta = broker.store.lite_topic(PARENT, lite)
    assert meta is not None
    rows = reclaiming.Rows([PARENT], [lite], [meta.max_offset], [meta.last_store_ms], [meta.last_consume_ms])
    outcomes = await reclaiming.compare_and_delete(
        broker.store, broker.dispatcher, rows, require_no_subscribers=False, dry_run=False
    )
    assert outcomes == [reclaiming.Outcome.DELETED]


def bodies(pair: Pair, slot: int, lite: str) -> list[bytes]:
    store = pair.brokers[slot].store
    assert store is not None
    return [m.body for m in store.read(model.QueueId.lmq(PARENT, lite), 0, 100)]


@pytest.mark.asyncio
async def test_a_topic_the_owner_reclaimed_and_a_send_re_created_is_stored_on_the_follower_too(
    expiring_pair: Pair,
) -> None:
    pair = expiring_pair
    lite = pair.lite_of(0)
    for n in range(3):
        assert (await pair.send(0, lite, n)).status.code == pb.OK
    assert pair.stored(1, lite) == 3
    await idle(pair, lite)

    await reclaim(pair, 0, lite)  # the owner's pass came first; the follower's has not run yet
    reply = await pair.send(0, lite, 3)

    assert reply.status.code == pb.OK, reply.status.message  # before: not enough in-sync replicas
    assert reply.entries[0].offset == 0
    assert bodies(pair, 0, lite) == [f"{lite}/3".encode()]
    assert bodies(pair, 1, lite) == [f"{lite}/3".encode()]  # acknowledged: the follower has it, at offset 0
    for n in range(4, 7):
        assert (await pair.send(0, lite, n)).status.code == pb.OK
    assert bodies(pair, 1, lite) == bodies(pair, 0, lite) == [f"{lite}/{n}".encode() for n in range(3, 7)]


@pytest.mark.asyncio
async def test_a_follower_whose_copy_of_a_re_created_topic_is_not_expired_refuses_it_and_never_mixes_the_two(
    expiring_pair: Pair,
) -> None:
    """The follower's copy does not expire (its parent says never there): it refuses every copy of the topic
    (sends are not acknowledged: too few in-sync replicas) rather than append the new records after the old ones
    (before: from the owner's offset 3 on, the follower held the three deleted messages at 0-2 and the new ones
    after them, and counted as in sync); once its copy expires, it is deleted and fetched again from 0."""
    pair = expiring_pair
    lite = pair.lite_of(0)
    for n in range(3):
        assert (await pair.send(0, lite, n)).status.code == pb.OK
    await idle(pair, lite)
    expiring(pair, 1, -1)
    await reclaim(pair, 0, lite)

    for n in range(3, 8):  # a client retrying: each send is stored at the owner, none acknowledged
        assert (await pair.send(0, lite, n)).status.code != pb.OK
    assert bodies(pair, 1, lite) == [f"{lite}/{n}".encode() for n in range(3)]  # the old records, nothing more

    expiring(pair, 1, 0)

    async def acknowledged() -> bool:
        reply = await pair.send(0, lite, 8)
        return bool(reply.status.code == pb.OK)

    await until(acknowledged, "a send acknowledged once the follower's copy expired")
    assert bodies(pair, 1, lite) == bodies(pair, 0, lite)
    assert bodies(pair, 0, lite)[0] == f"{lite}/3".encode()
