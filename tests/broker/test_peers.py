"""Two whole brokers (app.Broker, real ports, real stores) in this process as a cluster: routes, forwarded
sends, split subscriptions, a dead owner. The official client through one access endpoint: tests/e2e."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import pytest_asyncio

from lmq_broker import app, model
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


async def sync_on(cluster: Cluster, at: int, action: int, names: list[str], language: str = "PYTHON") -> None:
    reply = await cluster.clients[at].stub.SyncLiteSubscription(
        spb.SyncLiteSubscriptionRequest(
            action=action,  # type: ignore[arg-type]
            topic=pb.Resource(name=PARENT),
            group=pb.Resource(name=GROUP),
            lite_topic_set=names,
        ),
        metadata=cluster.headers(language=language),
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
