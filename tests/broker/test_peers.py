"""Two whole brokers (app.Broker, real ports, real stores) in this process as a cluster: routes, forwarded
sends, split subscriptions, a dead owner. The official client through one access endpoint: tests/e2e."""

from __future__ import annotations

import asyncio
import functools
import io
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from google.protobuf.duration_pb2 import Duration

from lmq_broker import app, errors, model
from lmq_broker.admin import cli
from lmq_broker.admin.client import AdminClient
from lmq_broker.cluster import membership as mb
from lmq_broker.dispatch import testing as dispatch_testing
from lmq_broker.protocol import auth, peers
from lmq_broker.protocol import testing as protocol_testing
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.storage import store as lmq_store
from lmq_broker.supervisor import free_ports

PARENT, GROUP = "P", "G"
KEYS = ("cluster-ak", "cluster-sk")
pytestmark = pytest.mark.asyncio


class Cluster:
    def __init__(self, brokers: list[app.Broker], clients: list[protocol_testing.Client]) -> None:
        self.brokers = brokers
        self.clients = clients
        first = brokers[0].config
        self.membership = mb.Membership.parse(first.peers)
        self.signed = bool(first.access_key)

    def owner(self, lite: str) -> int:
        return mb.owner(self.membership, model.QueueId.lmq(PARENT, lite).topic)

    def lites_of(self, slot: int, count: int, prefix: str = "t") -> list[str]:
        return [f"{prefix}-{i}" for i in range(10_000) if self.owner(f"{prefix}-{i}") == slot][:count]

    def headers(self, client_id: str = "client-1", language: str = "PYTHON") -> tuple[tuple[str, str], ...]:
        out = protocol_testing.Client.headers(client_id, language, "5.1.2")
        return out + auth.sign_metadata(*KEYS, datetime.now(UTC)) if self.signed else out

    def holds(self, slot: int, lite: str) -> bool:
        store = self.brokers[slot].store
        assert store is not None
        return store.lite_topic(PARENT, lite) is not None


def message(lite: str, n: int = 0) -> pb.Message:
    return pb.Message(
        topic=pb.Resource(name=PARENT),
        body=f"{lite}/{n}".encode(),
        system_properties=pb.SystemProperties(
            message_id=f"{lite}-{n}", message_type=pb.LITE, lite_topic=lite, body_encoding=pb.IDENTITY
        ),
    )


async def start_cluster(tmp_path: Path, size: int, *, admin_port: bool = False, **overrides: object) -> Cluster:
    """``admin_port``: as pods do, each broker on a host of its own (127.0.0.<slot + 1>) with the same client port
    and the same --admin-port on every one."""
    if admin_port:
        port, admin = free_ports("127.0.0.1", 2)
        hosts = [(f"127.0.0.{slot + 1}", port) for slot in range(size)]
        overrides = {**overrides, "admin_port": admin}
    else:
        hosts = [("127.0.0.1", p) for p in free_ports("127.0.0.1", size)]
    members = ",".join(f"{host}:{p}" for host, p in hosts)
    brokers = []
    for slot, (host, port) in enumerate(hosts):
        config = dispatch_testing.config_for(
            tmp_path / f"b{slot}",
            host=host,
            port=port,
            metrics_port=-1,
            peers=members,
            ordinal=slot,
            admin_access_key="admin-ak",
            admin_secret_key="admin-sk",
            **overrides,
        )
        store = lmq_store.open_store(config.store)
        store.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
        store.put_group(model.LiteGroup(GROUP, PARENT))
        broker = app.Broker(config, store=store)
        await broker.start()
        brokers.append(broker)
    clients = [protocol_testing.connect(b.endpoint, b.store) for b in brokers if b.store is not None]
    return Cluster(brokers, clients)


async def stop_cluster(cluster: Cluster) -> None:
    for client in cluster.clients:
        await client.close()
    for broker in cluster.brokers:
        if broker.ready:
            await broker.stop(grace_s=0.2)


@pytest_asyncio.fixture(params=["open", "signed"])
async def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Cluster]:
    if request.param == "signed":
        started = await start_cluster(tmp_path, 2, access_key=KEYS[0], secret_key=KEYS[1])
    else:
        started = await start_cluster(tmp_path, 2)
    yield started
    await stop_cluster(started)


async def test_routes_and_assignments_list_every_broker_identically(cluster: Cluster) -> None:
    routes, assignments = [], []
    for client in cluster.clients:
        route = await client.stub.QueryRoute(
            spb.QueryRouteRequest(topic=pb.Resource(name=PARENT)), metadata=cluster.headers()
        )
        assert route.status.code == pb.OK
        routes.append(
            [(q.broker.name, q.broker.endpoints.addresses[0].port, q.permission) for q in route.message_queues]
        )
        found = await client.stub.QueryAssignment(
            spb.QueryAssignmentRequest(topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP)),
            metadata=cluster.headers(),
        )
        assert found.status.code == pb.OK
        assignments.append([a.message_queue.SerializeToString() for a in found.assignments])
    ports = [b.port for b in cluster.brokers]
    assert routes[0] == [("broker-0", ports[0], pb.READ_WRITE), ("broker-1", ports[1], pb.READ_WRITE)]
    assert routes[1] == routes[0]
    assert len(assignments[0]) == 2 and assignments[1] == assignments[0]


async def test_a_batch_is_stored_on_the_owners_and_answered_in_order(cluster: Cluster) -> None:
    mine, theirs = cluster.lites_of(0, 3), cluster.lites_of(1, 3)
    batch = [message(lite, n) for n in range(2) for lite in mine + theirs]
    reply = await cluster.clients[0].stub.SendMessage(
        spb.SendMessageRequest(messages=batch), metadata=cluster.headers()
    )
    assert reply.status.code == pb.OK, reply.status
    assert [e.message_id for e in reply.entries] == [m.system_properties.message_id for m in batch]
    assert [e.offset for e in reply.entries] == [0] * 6 + [1] * 6  # each topic's own offsets, from its owner
    for lite in mine:
        assert cluster.holds(0, lite) and not cluster.holds(1, lite)
    for lite in theirs:
        assert cluster.holds(1, lite) and not cluster.holds(0, lite)
    forwarded = cluster.brokers[0].metrics.registry.get_sample_value("lmq_forwarded_messages_total")
    assert forwarded == 6


async def test_concurrent_sends_to_one_owner_share_forward_calls(cluster: Cluster) -> None:
    theirs = cluster.lites_of(1, 50)
    sends = [
        cluster.clients[0].stub.SendMessage(
            spb.SendMessageRequest(messages=[message(lite)]), metadata=cluster.headers()
        )
        for lite in theirs
    ]
    replies = await asyncio.gather(*sends)
    assert all(r.status.code == pb.OK and len(r.entries) == 1 for r in replies), {r.status.message for r in replies}
    assert all(cluster.holds(1, lite) for lite in theirs)
    registry = cluster.brokers[0].metrics.registry
    assert registry.get_sample_value("lmq_forwarded_messages_total") == 50
    calls = registry.get_sample_value("lmq_forward_calls_total")
    assert calls is not None and calls < 50  # batched per owner per loop tick


async def test_concurrent_mixed_batches_are_answered_each_in_its_own_order(cluster: Cluster) -> None:
    """Forwarded parts of several requests share forward calls; each request's answer has its own entries."""
    mine, theirs = cluster.lites_of(0, 20, "c"), cluster.lites_of(1, 20, "c")
    batches = [
        [message(lite, n) for lite in (mine[n], theirs[n], theirs[(n + 1) % 20], mine[(n + 2) % 20])] for n in range(20)
    ]
    stub = cluster.clients[0].stub
    replies = await asyncio.gather(
        *(stub.SendMessage(spb.SendMessageRequest(messages=b), metadata=cluster.headers()) for b in batches)
    )
    offsets = set()
    for batch, reply in zip(batches, replies, strict=True):
        assert reply.status.code == pb.OK, reply.status
        assert [e.message_id for e in reply.entries] == [m.system_properties.message_id for m in batch]
        assert all(e.status.code == pb.OK for e in reply.entries)
        offsets |= {(m.system_properties.lite_topic, e.offset) for m, e in zip(batch, reply.entries, strict=True)}
    assert offsets == {(lite, n) for lite in mine + theirs for n in range(2)}  # every topic got 0 and 1, once each
    assert all(cluster.holds(1, lite) and not cluster.holds(0, lite) for lite in theirs)
    calls = cluster.brokers[0].metrics.registry.get_sample_value("lmq_forward_calls_total")
    assert calls is not None and calls < 20  # batched per owner per loop tick


async def test_a_batch_whose_forwarded_part_is_refused_answers_multiple_results(cluster: Cluster) -> None:
    mine, theirs = cluster.lites_of(0, 2, "r"), cluster.lites_of(1, 2, "r")
    bad = message(theirs[1])
    bad.body = b""
    batch = [message(mine[0]), message(theirs[0]), message(mine[1]), bad]
    reply = await cluster.clients[0].stub.SendMessage(
        spb.SendMessageRequest(messages=batch), metadata=cluster.headers()
    )
    assert reply.status.code == pb.MULTIPLE_RESULTS, reply.status
    assert [e.status.code for e in reply.entries] == [pb.OK, pb.MESSAGE_BODY_EMPTY, pb.OK, pb.MESSAGE_BODY_EMPTY]
    assert [reply.entries[i].message_id for i in (0, 2)] == [
        batch[0].system_properties.message_id,
        batch[2].system_properties.message_id,
    ]
    assert cluster.holds(0, mine[0]) and cluster.holds(0, mine[1])
    assert not cluster.holds(1, theirs[0]) and not cluster.holds(1, theirs[1])  # the owner's part: all or nothing


async def test_an_invalid_message_in_a_shared_batch_fails_only_its_own_send(cluster: Cluster) -> None:
    theirs = cluster.lites_of(1, 5)
    bad = message(theirs[0])
    bad.topic.name = "NO_SUCH_TOPIC"
    bad.system_properties.lite_topic = theirs[0]
    requests = [spb.SendMessageRequest(messages=[message(lite)]) for lite in theirs[1:]]
    stub = cluster.clients[0].stub
    replies = await asyncio.gather(
        stub.SendMessage(spb.SendMessageRequest(messages=[bad]), metadata=cluster.headers()),
        *(stub.SendMessage(r, metadata=cluster.headers()) for r in requests),
    )
    assert replies[0].status.code == pb.TOPIC_NOT_FOUND
    assert all(r.status.code == pb.OK for r in replies[1:])
    assert all(cluster.holds(1, lite) for lite in theirs[1:])


async def test_a_forwarded_send_is_stored_where_it_arrives(cluster: Cluster) -> None:
    theirs = cluster.lites_of(1, 1)[0]
    headers = (*cluster.headers(), (peers.FORWARDED, "1"))
    reply = await cluster.clients[0].stub.SendMessage(
        spb.SendMessageRequest(messages=[message(theirs)]), metadata=headers
    )
    assert reply.status.code == pb.OK
    assert cluster.holds(0, theirs) and not cluster.holds(1, theirs)  # never passed on a second time


async def test_a_dead_owner_fails_the_send_and_nothing_is_stored(cluster: Cluster) -> None:
    theirs, mine = cluster.lites_of(1, 1)[0], cluster.lites_of(0, 1)[0]
    await cluster.brokers[1].stop(grace_s=0.1)
    stub = cluster.clients[0].stub
    reply = await stub.SendMessage(spb.SendMessageRequest(messages=[message(theirs)]), metadata=cluster.headers())
    assert reply.status.code == pb.INTERNAL_ERROR
    assert "nothing was stored" in reply.status.message
    assert not cluster.holds(0, theirs)
    reply = await stub.SendMessage(spb.SendMessageRequest(messages=[message(mine)]), metadata=cluster.headers())
    assert reply.status.code == pb.OK  # this broker's own topics keep flowing


async def sync_on(
    cluster: Cluster, at: int, action: int, names: list[str], language: str = "PYTHON", *, client_id: str = "client-1"
) -> None:
    reply = await cluster.clients[at].stub.SyncLiteSubscription(
        spb.SyncLiteSubscriptionRequest(
            action=action,  # type: ignore[arg-type]
            topic=pb.Resource(name=PARENT),
            group=pb.Resource(name=GROUP),
            lite_topic_set=names,
        ),
        metadata=cluster.headers(client_id, language),
    )
    assert reply.status.code == pb.OK, reply.status


def subscribed(cluster: Cluster, slot: int, names: list[str]) -> set[str]:
    dispatcher = cluster.brokers[slot].dispatcher
    assert dispatcher is not None
    return {lite for lite in names if dispatcher.subscribers(model.QueueId.lmq(PARENT, lite))}


async def test_subscriptions_sent_to_every_broker_are_applied_once_each(cluster: Cluster) -> None:
    """Java and Go send SyncLiteSubscription to every route endpoint: each copy is applied only where it lands
    and only for the topics that broker owns (no fan-out of the fan-out)."""
    mine, theirs = cluster.lites_of(0, 2), cluster.lites_of(1, 2)
    everything = mine + theirs
    await sync_on(cluster, 0, pb.PARTIAL_ADD, everything, "JAVA")
    assert (subscribed(cluster, 0, everything), subscribed(cluster, 1, everything)) == (set(mine), set())
    await sync_on(cluster, 1, pb.PARTIAL_ADD, everything, "JAVA")
    assert subscribed(cluster, 1, everything) == set(theirs)
    await sync_on(cluster, 0, pb.COMPLETE_ADD, [mine[0], theirs[0]], "GOLANG")
    assert (subscribed(cluster, 0, everything), subscribed(cluster, 1, everything)) == ({mine[0]}, set(theirs))


async def test_subscriptions_are_split_by_owner(cluster: Cluster) -> None:
    mine, theirs = cluster.lites_of(0, 2), cluster.lites_of(1, 2)
    everything = mine + theirs

    def both() -> tuple[set[str], set[str]]:
        return subscribed(cluster, 0, everything), subscribed(cluster, 1, everything)

    await sync_on(cluster, 0, pb.PARTIAL_ADD, everything)
    assert both() == (set(mine), set(theirs))
    await sync_on(cluster, 0, pb.PARTIAL_REMOVE, [theirs[0]])
    assert both()[1] == {theirs[1]}
    await sync_on(cluster, 0, pb.COMPLETE_ADD, mine[:1])  # a complete set per broker: the other's becomes empty
    assert both() == ({mine[0]}, set())
    await sync_on(cluster, 0, pb.COMPLETE_REMOVE, [])
    assert both() == (set(), set())


@pytest.mark.parametrize("admin_port", [False, True], ids=["admin-on-the-client-port", "admin-port"])
async def test_a_topic_created_before_a_scale_up_stays_on_its_broker(tmp_path: Path, admin_port: bool) -> None:
    """Broker 0 of a 2-slot ring now runs in a 3-slot ring (history 2): topics that moved to slot 2 but that
    an older owner already holds are still written there; new ones go to slot 2. The brokers ask each other
    which one holds a topic over the admin service: with --admin-port, on the peer's admin port."""
    grown = await start_cluster(tmp_path, 3, ring_history="2", admin_port=admin_port)
    try:
        two = mb.Membership.parse(",".join(grown.membership.members[:2]))
        moved = [
            f"m-{i}" for i in range(5000)
            if grown.owner(f"m-{i}") == 2 and mb.owner(two, model.QueueId.lmq(PARENT, f"m-{i}").topic) == 1
        ][:4]  # fmt: skip
        old, new = moved[:2], moved[2:]
        stub = grown.clients[1].stub
        for lite in old:  # as the 2-slot ring stored them: on slot 1 (a forwarded call is stored where it lands)
            headers = (*grown.headers(), (peers.FORWARDED, "1"))
            await stub.SendMessage(spb.SendMessageRequest(messages=[message(lite)]), metadata=headers)
        for access in grown.clients:
            for lite in moved:
                reply = await access.stub.SendMessage(
                    spb.SendMessageRequest(messages=[message(lite, 1)]), metadata=grown.headers()
                )
                assert reply.status.code == pb.OK, reply.status
        for lite in old:
            assert grown.holds(1, lite) and not grown.holds(2, lite) and not grown.holds(0, lite)
        for lite in new:
            assert grown.holds(2, lite) and not grown.holds(1, lite) and not grown.holds(0, lite)
    finally:
        await stop_cluster(grown)


# --- membership changes while the brokers run (admin GetCluster/SetCluster) ----------------------------------
def admin_of(broker: app.Broker) -> AdminClient:
    return AdminClient(broker.endpoint, timeout_s=10, access_key="admin-ak", secret_key="admin-sk")


async def set_everywhere(cluster: Cluster, order: list[int], members: tuple[str, ...], sizes: tuple[int, ...]) -> None:
    for slot in order:
        with admin_of(cluster.brokers[slot]) as admin:
            _, changed = await asyncio.to_thread(admin.set_cluster, members, sizes)
        assert changed


async def route_of(cluster: Cluster, at: int) -> list[tuple[int, int]]:
    route = await cluster.clients[at].stub.QueryRoute(
        spb.QueryRouteRequest(topic=pb.Resource(name=PARENT)), metadata=cluster.headers()
    )
    assert route.status.code == pb.OK
    return [(q.broker.endpoints.addresses[0].port, q.permission) for q in route.message_queues]


async def send_via(cluster: Cluster, at: int, lite: str, n: int) -> None:
    reply = await cluster.clients[at].stub.SendMessage(
        spb.SendMessageRequest(messages=[message(lite, n)]), metadata=cluster.headers()
    )
    assert reply.status.code == pb.OK, reply.status


def stored(cluster: Cluster, slot: int, lite: str) -> int:
    store = cluster.brokers[slot].store
    assert store is not None
    meta = store.lite_topic(PARENT, lite)
    return 0 if meta is None else meta.max_offset


async def test_scale_down_while_running_drains_hands_over_and_sheds(tmp_path: Path) -> None:
    """3 -> 2 over the admin service: slot 2 takes no new topic, keeps an undrained one (order), hands it over
    once drained (its consumers already subscribed at the new owner), is removed only when drained, then only
    forwards; a restarted broker keeps the membership it was given."""
    cluster = await start_cluster(tmp_path, 3)
    try:
        members = cluster.membership.members
        with admin_of(cluster.brokers[0]) as admin:
            info = await asyncio.to_thread(admin.cluster)
        assert (info.members, info.ring_sizes, info.slot, info.source) == (members, (3,), 0, "flags")
        held, fresh = cluster.lites_of(2, 4)[:2], cluster.lites_of(2, 4)[2:]
        two = mb.Membership(members[:2], (2,))
        today = {lite: mb.owner(two, model.QueueId.lmq(PARENT, lite).topic) for lite in held + fresh}
        for lite in held:
            await send_via(cluster, 0, lite, 0)
        await sync_on(cluster, 0, pb.PARTIAL_ADD, [held[1], fresh[0]], client_id="before")
        assert subscribed(cluster, 2, held + fresh) == {held[1], fresh[0]}
        assert not subscribed(cluster, today[fresh[0]], fresh)
        await set_everywhere(cluster, [2, 0, 1], members, (3, 2))  # the leaving one first
        for _ in range(100):  # a subscription to a topic not created yet is made where it will be created
            if subscribed(cluster, today[fresh[0]], fresh):
                break
            await asyncio.sleep(0.05)
        assert subscribed(cluster, today[fresh[0]], fresh) == {fresh[0]}
        assert not subscribed(cluster, today[held[1]], held)  # a held one moves with its topic
        ports = [b.port for b in cluster.brokers]
        assert await route_of(cluster, 1) == [(ports[0], pb.READ_WRITE), (ports[1], pb.READ_WRITE), (ports[2], pb.READ)]
        for lite in fresh:  # a new topic never lands on the leaving broker
            await send_via(cluster, 0, lite, 0)
            assert stored(cluster, 2, lite) == 0 and stored(cluster, today[lite], lite) == 1
        await send_via(cluster, 1, held[0], 1)  # undrained: stays where its first message is (order)
        assert stored(cluster, 2, held[0]) == 2 and stored(cluster, today[held[0]], held[0]) == 0
        await sync_on(cluster, 0, pb.PARTIAL_ADD, held[:1])
        assert subscribed(cluster, 2, held) == set(held)
        assert subscribed(cluster, today[held[0]], held) == {held[0]}  # consumers wait at the new owner too
        with admin_of(cluster.brokers[0]) as admin, pytest.raises(errors.Conflict, match="undrained"):
            await asyncio.to_thread(admin.set_cluster, members[:2], (3, 2))
        leaving_store = cluster.brokers[2].store
        assert leaving_store is not None
        for lite in held:  # its consumers have consumed everything there
            leaving_store.commit_offset(model.QueueId.lmq(PARENT, lite), GROUP, stored(cluster, 2, lite))
        for lite in held:  # drained: handed over to today's owner
            await send_via(cluster, 0, lite, 5)
            assert stored(cluster, today[lite], lite) == 1
        assert [stored(cluster, 2, lite) for lite in held] == [2, 1]
        moved = cluster.brokers[today[held[1]]].dispatcher
        assert moved is not None and moved.subscribers(model.QueueId.lmq(PARENT, held[1])) == ["before"]
        with admin_of(cluster.brokers[2]) as admin:
            info = await asyncio.to_thread(functools.partial(admin.cluster, with_undrained=True))
        assert (info.leaving, info.undrained_messages, info.drained) == (True, 0, True)
        await set_everywhere(cluster, [0, 1, 2], members[:2], (3, 2))  # removed: the leaving one last
        assert await route_of(cluster, 0) == [(ports[0], pb.READ_WRITE), (ports[1], pb.READ_WRITE)]
        assert await route_of(cluster, 2) == await route_of(cluster, 0)
        await send_via(cluster, 2, held[1], 6)  # no member any more: it only forwards
        assert stored(cluster, 2, held[1]) == 1 and stored(cluster, today[held[1]], held[1]) == 2
        config = cluster.brokers[0].config
        await cluster.brokers[0].stop(grace_s=0.1)
        cluster.brokers[0] = restarted = app.Broker(config)
        await restarted.start()
        with admin_of(restarted) as admin:
            info = await asyncio.to_thread(admin.cluster)
        assert (info.members, info.ring_sizes, info.slot, info.source) == (members[:2], (2,), 0, "admin")
    finally:
        await stop_cluster(cluster)


async def test_membership_changes_are_checked(tmp_path: Path) -> None:
    cluster = await start_cluster(tmp_path, 2)
    try:
        members = cluster.membership.members
        with admin_of(cluster.brokers[0]) as admin:
            with pytest.raises(errors.Conflict, match="not leaving"):
                await asyncio.to_thread(admin.set_cluster, members[:1], (1,))  # removed without draining first
            with pytest.raises(errors.Conflict, match="keep their endpoints"):
                await asyncio.to_thread(admin.set_cluster, (members[1], members[0]), (2,))
            with pytest.raises(errors.InvalidArgument):
                await asyncio.to_thread(admin.set_cluster, (*members, "no-port"), (3,))
            info, changed = await asyncio.to_thread(admin.set_cluster, members, (2,))
            assert not changed and info.source == "flags"
    finally:
        await stop_cluster(cluster)


async def test_lmq_admin_cluster_get_and_set_everywhere(tmp_path: Path) -> None:
    cluster = await start_cluster(tmp_path, 2)
    try:
        members = cluster.membership.members
        keys = ["--access-key", "admin-ak", "--secret-key", "admin-sk", "--output", "json"]

        async def lmq_admin(at: int, *args: str) -> tuple[int, Any, str]:
            out, err = io.StringIO(), io.StringIO()
            argv = ["--endpoint", members[at], *keys, *args]
            code = await asyncio.to_thread(cli.main, argv, out, err)
            return code, json.loads(out.getvalue()) if code == 0 else None, err.getvalue()

        code, got, _ = await lmq_admin(1, "cluster", "get")
        assert (code, got["members"], got["slot"], got["leaving"], got["undrained_messages"]) == (
            0, list(members), 1, False, -1
        )  # fmt: skip
        code, rows, _ = await lmq_admin(0, "cluster", "set", "--peers", ",".join(members), "--ring-history", "2",
                                        "--ring-size", "1", "--everywhere")  # fmt: skip
        assert code == 0
        assert [(r["endpoint"], r["slot"], r["changed"], r["leaving"]) for r in rows] == [
            (members[1], 1, True, True), (members[0], 0, True, False)
        ]  # fmt: skip
        code, got, _ = await lmq_admin(1, "cluster", "get", "--undrained")
        shown = (got["ring_sizes"], got["undrained_messages"], got["drained"], got["source"])
        assert shown == ([2, 1], 0, True, "admin")
        code, rows, _ = await lmq_admin(0, "cluster", "set", "--peers", members[0], "--ring-history", "2,1",
                                        "--everywhere")  # fmt: skip
        assert [(r["endpoint"], r["slot"]) for r in rows] == [(members[0], 0), (members[1], -1)]
        assert cluster.brokers[0].cluster is not None and cluster.brokers[0].cluster.peers is None  # alone again
        code, _, err = await lmq_admin(0, "cluster", "set", "--peers", f"{members[0]},{members[1]}", "--slot", "5")
        assert code == 1 and "slot 5" in err
    finally:
        await stop_cluster(cluster)


async def test_a_receipt_handle_can_only_send_settlements_to_members(cluster: Cluster) -> None:
    """Handles of messages gathered from another broker name it ("via <endpoint> <handle>"): a forged one
    naming any other address is refused, never called."""
    stub = cluster.clients[0].stub
    ack = await stub.AckMessage(
        spb.AckMessageRequest(
            group=pb.Resource(name=GROUP),
            topic=pb.Resource(name=PARENT),
            entries=[spb.AckMessageEntry(message_id="m", receipt_handle="via 10.0.0.1:22 r2 x")],
        ),
        metadata=cluster.headers(),
    )
    assert ack.status.code == pb.INVALID_RECEIPT_HANDLE
    member = cluster.membership.members[1]
    change = await stub.ChangeInvisibleDuration(
        spb.ChangeInvisibleDurationRequest(
            group=pb.Resource(name=GROUP),
            topic=pb.Resource(name=PARENT),
            receipt_handle=f"via {member} r2 forged",
            invisible_duration=Duration(seconds=5),
        ),
        metadata=cluster.headers(),
    )
    assert change.status.code == pb.INVALID_RECEIPT_HANDLE  # the member itself refuses what it never handed out
