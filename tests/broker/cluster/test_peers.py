"""Two whole brokers (app.Broker, real ports, real stores) in this process as a cluster: routes, forwarded
sends, split subscriptions, a dead owner. The official client through one access endpoint: tests/e2e."""

from __future__ import annotations

import asyncio
import functools
import io
import json
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from google.protobuf.duration_pb2 import Duration
from waiting import eventually_async

from lmq_broker import app, errors, model
from lmq_broker.admin import cli
from lmq_broker.admin.client import AdminClient
from lmq_broker.admin.results import ClusterInfo
from lmq_broker.cluster import forwarding, links, trust
from lmq_broker.cluster import membership as mb
from lmq_broker.dispatch import testing as dispatch_testing
from lmq_broker.protocol import auth
from lmq_broker.protocol import testing as protocol_testing
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as service_grpc
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as admin_pb
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2_grpc as admin_grpc
from lmq_broker.storage import store as lmq_store
from lmq_broker.supervisor import free_ports
from lmq_broker.testing import issue_certificate

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


async def start_cluster(
    tmp_path: Path, size: int, *, admin_port: bool = False, each: Sequence[dict[str, object]] = (), **overrides: object
) -> Cluster:
    """``admin_port``: as pods do, each broker on a host of its own (127.0.0.<slot + 1>) with the same client port
    and the same --admin-port on every one. ``each``: more settings per slot."""
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
            **(each[slot] if each else {}),
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
    # the cases change a client's set and check how it is split: each full sync as sent (no grace for a partial
    # change answered just before it, which test_full_sync_grace.py covers)
    if request.param == "signed":
        started = await start_cluster(tmp_path, 2, access_key=KEYS[0], secret_key=KEYS[1], full_sync_grace_ms=0)
    else:
        started = await start_cluster(tmp_path, 2, full_sync_grace_ms=0)
    yield started
    await stop_cluster(started)


async def test_routes_list_every_broker_the_one_asked_first_and_assignments_every_broker(cluster: Cluster) -> None:
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
    assert routes[1] == routes[0][::-1]  # a LiteSimpleConsumer keeps receiving from the broker it asked
    assert len(assignments[0]) == 2 and sorted(assignments[1]) == sorted(assignments[0])


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


async def test_a_client_send_with_the_mqtt_empty_marker_is_refused_before_it_is_forwarded(cluster: Cluster) -> None:
    """Only MQTT (here or through a peer's verified copy) may store an empty body; a client's marked message is
    refused at the access broker, nothing stored on either broker."""
    mine, theirs = cluster.lites_of(0, 1, "m"), cluster.lites_of(1, 1, "m")
    batch = [message(mine[0]), message(theirs[0])]
    for m in batch:
        m.body = b""
        m.user_properties[model.EMPTY_BODY_PROPERTY] = "1"
    reply = await cluster.clients[0].stub.SendMessage(
        spb.SendMessageRequest(messages=batch), metadata=cluster.headers()
    )
    assert reply.status.code == pb.ILLEGAL_MESSAGE_PROPERTY_KEY, reply.status
    assert not cluster.holds(0, mine[0]) and not cluster.holds(1, theirs[0])


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


def refused_headers(broker: app.Broker) -> float:
    value = broker.metrics.registry.get_sample_value("lmq_peer_header_refused_total", {"method": "SendMessage"})
    return value or 0.0


@pytest.mark.parametrize(
    "forged",
    [
        ("x-lmq-forwarded", "1"),  # the marker brokers once used
        (trust.HEADER, "1;0;" + "0" * 64),  # a peer header with a made-up signature
        trust.header(b"another cluster's secret", "/apache.rocketmq.v2.MessagingService/SendMessage", 1, 0),
    ],
)
async def test_a_client_supplied_peer_marker_never_changes_where_a_message_is_stored(
    cluster: Cluster, forged: tuple[str, str]
) -> None:
    theirs = cluster.lites_of(1, 1)[0]
    before = refused_headers(cluster.brokers[0])
    reply = await cluster.clients[0].stub.SendMessage(
        spb.SendMessageRequest(messages=[message(theirs)]), metadata=(*cluster.headers(), forged)
    )
    assert reply.status.code == pb.OK
    assert cluster.holds(1, theirs) and not cluster.holds(0, theirs)  # served as a client's send: at its owner
    counted = refused_headers(cluster.brokers[0]) - before
    assert counted == (0 if forged[0] == "x-lmq-forwarded" else 1)


async def test_a_peers_copy_for_a_topic_the_receiver_does_not_own_is_refused(cluster: Cluster) -> None:
    """Even a genuine peer header (the cluster secret) cannot place a topic on a broker that does not own it by
    its own view: the copy is refused whole and nothing is stored."""
    theirs, mine = cluster.lites_of(1, 1)[0], cluster.lites_of(0, 1)[0]
    config = cluster.brokers[0].config
    secret = trust.secret_of(config.cluster_secret, config.admin_secret_key)
    method = "/apache.rocketmq.v2.MessagingService/SendMessage"
    signed = (*cluster.headers(), trust.header(secret, method, cluster.membership.epoch, links.now_ms()))
    stub = cluster.clients[0].stub
    reply = await stub.SendMessage(spb.SendMessageRequest(messages=[message(mine), message(theirs)]), metadata=signed)
    assert reply.status.code == pb.INTERNAL_ERROR
    assert reply.status.message.startswith(forwarding.NOT_OWNER)
    assert not cluster.holds(0, theirs) and not cluster.holds(1, theirs) and not cluster.holds(0, mine)
    reply = await stub.SendMessage(spb.SendMessageRequest(messages=[message(mine)]), metadata=signed)
    assert reply.status.code == pb.OK and cluster.holds(0, mine)  # its own topic: stored, as a peer's copy


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
    """Go sends SyncLiteSubscription to every route endpoint: each copy is applied only where it lands and only
    for the topics that broker owns (no fan-out of the fan-out)."""
    mine, theirs = cluster.lites_of(0, 2), cluster.lites_of(1, 2)
    everything = mine + theirs
    await sync_on(cluster, 0, pb.PARTIAL_ADD, everything, "GOLANG")
    assert (subscribed(cluster, 0, everything), subscribed(cluster, 1, everything)) == (set(mine), set())
    await sync_on(cluster, 1, pb.PARTIAL_ADD, everything, "GOLANG")
    assert subscribed(cluster, 1, everything) == set(theirs)
    await sync_on(cluster, 0, pb.COMPLETE_ADD, [mine[0], theirs[0]], "GOLANG")
    assert (subscribed(cluster, 0, everything), subscribed(cluster, 1, everything)) == ({mine[0]}, set(theirs))


async def test_java_subscriptions_are_split_by_owner(cluster: Cluster) -> None:
    """Java 5.2.0 sends SyncLiteSubscription to its configured endpoint only, as Python does: split there."""
    mine, theirs = cluster.lites_of(0, 2), cluster.lites_of(1, 2)
    everything = mine + theirs
    await sync_on(cluster, 1, pb.PARTIAL_ADD, everything, "JAVA")
    assert (subscribed(cluster, 0, everything), subscribed(cluster, 1, everything)) == (set(mine), set(theirs))
    await sync_on(cluster, 1, pb.COMPLETE_ADD, [mine[0]], "JAVA")
    assert (subscribed(cluster, 0, everything), subscribed(cluster, 1, everything)) == ({mine[0]}, set())


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


def patterns_at(cluster: Cluster, slot: int, client_id: str = "client-1") -> set[str]:
    dispatcher = cluster.brokers[slot].dispatcher
    assert dispatcher is not None
    state = dispatcher.registry.get(client_id)
    return set(state.patterns) if state is not None else set()


async def send_to(cluster: Cluster, lites: list[str], n: int = 0) -> None:
    reply = await cluster.clients[0].stub.SendMessage(
        spb.SendMessageRequest(messages=[message(lite, n) for lite in lites]), metadata=cluster.headers()
    )
    assert reply.status.code == pb.OK, reply.status


async def taken(cluster: Cluster, slot: int, want: int, *, group: str = GROUP, quiet_s: float = 0.3) -> list[str]:
    """Receive and ack as client-1 at broker ``slot`` until ``want`` messages came and then ``quiet_s`` passed
    with none more; their bodies."""
    dispatcher = cluster.brokers[slot].dispatcher
    assert dispatcher is not None
    got: list[str] = []
    loop = asyncio.get_running_loop()
    deadline, quiet_until = loop.time() + 10, 0.0
    while loop.time() < deadline and (len(got) < want or loop.time() < quiet_until):
        for d in await dispatcher.receive_lite("client-1", group, PARENT, batch=32, invisible_ms=10_000, poll_ms=50):
            got.append(d.message.body.decode())
            await dispatcher.ack(group, d.receipt_handle)
        if len(got) >= want and not quiet_until:
            quiet_until = loop.time() + quiet_s
    return got


async def test_a_pattern_goes_to_every_broker_and_takes_each_ones_topics(cluster: Cluster) -> None:
    """PARTIAL_ADD of a pattern through one broker registers it on both: each finds its own waiting messages
    of matching topics and takes its matching arrivals, none of the others; PARTIAL_REMOVE ends it on both."""
    mine, theirs = cluster.lites_of(0, 2, "m"), cluster.lites_of(1, 2, "m")
    other = cluster.lites_of(0, 1, "o") + cluster.lites_of(1, 1, "o")
    await send_to(cluster, [mine[0], theirs[0], *other])  # waiting before anyone subscribes
    await sync_on(cluster, 0, pb.PARTIAL_ADD, ["m-*", other[1]])
    assert (patterns_at(cluster, 0), patterns_at(cluster, 1)) == ({"m-*"}, {"m-*"})
    assert subscribed(cluster, 0, other) == set() and subscribed(cluster, 1, other) == {other[1]}
    await send_to(cluster, [mine[1], theirs[1], other[0]])
    assert sorted(await taken(cluster, 0, 2)) == sorted(f"{lite}/0" for lite in mine)
    assert sorted(await taken(cluster, 1, 3)) == sorted(f"{lite}/0" for lite in [*theirs, other[1]])
    await sync_on(cluster, 0, pb.PARTIAL_REMOVE, ["m-*"])
    assert (patterns_at(cluster, 0), patterns_at(cluster, 1)) == (set(), set())
    await send_to(cluster, mine + theirs, 1)
    assert await taken(cluster, 0, 0) == [] and await taken(cluster, 1, 0) == []


async def test_full_syncs_carry_patterns_to_every_broker(cluster: Cluster) -> None:
    mine = cluster.lites_of(0, 1)
    await sync_on(cluster, 1, pb.COMPLETE_ADD, ["a/#", "b-*", *mine])
    assert (patterns_at(cluster, 0), patterns_at(cluster, 1)) == ({"a/#", "b-*"}, {"a/#", "b-*"})
    assert subscribed(cluster, 0, mine) == set(mine)
    await sync_on(cluster, 1, pb.COMPLETE_ADD, ["b-*"])  # a complete set: the other pattern goes everywhere
    assert (patterns_at(cluster, 0), patterns_at(cluster, 1)) == ({"b-*"}, {"b-*"})
    assert subscribed(cluster, 0, mine) == set()
    await sync_on(cluster, 1, pb.COMPLETE_REMOVE, [])
    assert (patterns_at(cluster, 0), patterns_at(cluster, 1)) == (set(), set())


async def test_patterns_sent_to_every_broker_are_applied_once_each(cluster: Cluster) -> None:
    """Go sends its copy to every endpoint: each registers the pattern where it lands only (Java calls one
    endpoint: its pattern goes everywhere from there)."""
    await sync_on(cluster, 0, pb.PARTIAL_ADD, ["job-*"], "GOLANG")
    assert (patterns_at(cluster, 0), patterns_at(cluster, 1)) == ({"job-*"}, set())
    await sync_on(cluster, 1, pb.PARTIAL_ADD, ["job-*"], "GOLANG")
    assert (patterns_at(cluster, 0), patterns_at(cluster, 1)) == ({"job-*"}, {"job-*"})
    await sync_on(cluster, 1, pb.PARTIAL_REMOVE, ["job-*"], "GOLANG")
    assert (patterns_at(cluster, 0), patterns_at(cluster, 1)) == ({"job-*"}, set())
    await sync_on(cluster, 1, pb.PARTIAL_REMOVE, ["job-*"], "JAVA")
    assert (patterns_at(cluster, 0), patterns_at(cluster, 1)) == (set(), set())


async def test_bad_patterns_are_refused_and_leave_no_broker_subscribed(cluster: Cluster) -> None:
    """A malformed pattern is refused at the access broker (40020); a pattern with a moving offset option is
    refused by every broker before anything is registered (a named topic beside it is not subscribed either)."""
    theirs = cluster.lites_of(1, 1)
    stub = cluster.clients[0].stub

    async def add(names: list[str], **fields: Any) -> int:
        reply = await stub.SyncLiteSubscription(
            spb.SyncLiteSubscriptionRequest(
                action=pb.PARTIAL_ADD, topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP),
                lite_topic_set=names, **fields,
            ),
            metadata=cluster.headers(),
        )  # fmt: skip
        return reply.status.code

    assert await add(["a*b", *theirs]) == pb.ILLEGAL_LITE_TOPIC
    assert await add(["s-*", *theirs], offset_option=pb.OffsetOption(policy=pb.OffsetOption.MIN)) == pb.ILLEGAL_OFFSET
    assert [patterns_at(cluster, slot) for slot in (0, 1)] == [set(), set()]
    assert subscribed(cluster, 1, theirs) == set()


async def test_a_pattern_counts_once_on_each_broker(tmp_path: Path) -> None:
    """Every broker counts a pattern as one subscription against its own limits: broker 1 (a limit of 2) takes
    a pattern and a topic it owns, and refuses a second pattern; the refusal is the client's answer."""
    # full_sync_grace_ms 0: the refused pattern, taken by broker 0 before broker 1 refused it, goes with the very
    # next full sync (with the grace, with the first one built after the refusal)
    limits: list[dict[str, object]] = [{}, {"max_subscriptions_per_broker": 2}]
    cluster = await start_cluster(tmp_path, 2, each=limits, full_sync_grace_ms=0)
    try:
        theirs = cluster.lites_of(1, 1)
        await sync_on(cluster, 0, pb.PARTIAL_ADD, ["s-*", *theirs])
        reply = await cluster.clients[0].stub.SyncLiteSubscription(
            spb.SyncLiteSubscriptionRequest(
                action=pb.PARTIAL_ADD, topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP),
                lite_topic_set=["t-*"],
            ),
            metadata=cluster.headers(),
        )  # fmt: skip
        assert reply.status.code == pb.LITE_SUBSCRIPTION_QUOTA_EXCEEDED, reply.status
        assert patterns_at(cluster, 1) == {"s-*"}
        await sync_on(cluster, 0, pb.COMPLETE_ADD, ["s-*", *theirs])  # the client's full sync: as it holds
        assert (patterns_at(cluster, 0), patterns_at(cluster, 1)) == ({"s-*"}, {"s-*"})
    finally:
        await stop_cluster(cluster)


async def test_group_patterns_of_a_wildcard_group_apply_on_every_broker(cluster: Cluster) -> None:
    """A wildcard group's ``litePatterns``: one COMPLETE_ADD through one broker registers the client on each,
    and each delivers its own matching topics, waiting ones included."""
    wild = model.LiteGroup("W", PARENT, wildcard=True, lite_patterns=("eu/+",))
    for broker in cluster.brokers:
        assert broker.store is not None and broker.dispatcher is not None
        broker.store.put_group(wild)
        broker.dispatcher.metadata_changed()
    mine, theirs = cluster.lites_of(0, 2, "eu_x"), cluster.lites_of(1, 2, "eu_x")
    others = cluster.lites_of(0, 1, "us_x") + cluster.lites_of(1, 1, "us_x")
    await send_to(cluster, [mine[0], theirs[0]])
    reply = await cluster.clients[0].stub.SyncLiteSubscription(
        spb.SyncLiteSubscriptionRequest(
            action=pb.COMPLETE_ADD, topic=pb.Resource(name=PARENT), group=pb.Resource(name="W"), lite_topic_set=[]
        ),
        metadata=cluster.headers(),
    )
    assert reply.status.code == pb.OK, reply.status
    await send_to(cluster, [mine[1], theirs[1], *others])
    assert sorted(await taken(cluster, 0, 2, group="W")) == sorted(f"{lite}/0" for lite in mine)
    assert sorted(await taken(cluster, 1, 2, group="W")) == sorted(f"{lite}/0" for lite in theirs)


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
        dispatcher = grown.brokers[1].dispatcher
        assert dispatcher is not None
        for lite in old:  # as the 2-slot ring stored them: on slot 1
            await dispatcher.send([dispatch_testing.lite_message(lite, message_id=f"{lite}-0")])
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
        with admin_of(cluster.brokers[slot]) as admin:  # not always "changed": a peer may have passed it on first
            info, _ = await asyncio.to_thread(admin.set_cluster, members, sizes)
        assert (info.members, info.ring_sizes) == (tuple(members), mb.of(members, sizes).sizes)


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


async def restarted(cluster: Cluster, slot: int) -> ClusterInfo:
    """Broker ``slot`` stopped and started again on its disk with its flags: its membership then."""
    config = cluster.brokers[slot].config
    await cluster.brokers[slot].stop(grace_s=0.1)
    cluster.brokers[slot] = broker = app.Broker(config)
    await broker.start()
    with admin_of(broker) as admin:
        return await asyncio.to_thread(admin.cluster)


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
        # a subscription to a topic not created yet is made where it will be created
        await eventually_async(lambda: subscribed(cluster, today[fresh[0]], fresh), "the fresh topic's subscription")
        assert subscribed(cluster, today[fresh[0]], fresh) == {fresh[0]}
        # a held one's consumers wait at today's owner too, as for a subscription made while its holder leaves:
        # the access broker gives its clients' subscriptions again by the new ring (``Watch.ring_changed``)
        await eventually_async(lambda: subscribed(cluster, today[held[1]], held) == {held[1]}, "the held topic's")
        ports = [b.port for b in cluster.brokers]
        assert await route_of(cluster, 1) == [(ports[1], pb.READ_WRITE), (ports[0], pb.READ_WRITE), (ports[2], pb.READ)]
        assert (await route_of(cluster, 2))[2] == (ports[2], pb.READ)  # the leaving one asked: in its place
        for lite in fresh:  # a new topic never lands on the leaving broker
            await send_via(cluster, 0, lite, 0)
            assert stored(cluster, 2, lite) == 0 and stored(cluster, today[lite], lite) == 1
        await send_via(cluster, 1, held[0], 1)  # undrained: stays where its first message is (order)
        assert stored(cluster, 2, held[0]) == 2 and stored(cluster, today[held[0]], held[0]) == 0
        await sync_on(cluster, 0, pb.PARTIAL_ADD, held[:1])
        assert subscribed(cluster, 2, held) == set(held)
        assert held[0] in subscribed(cluster, today[held[0]], held)  # consumers wait at the new owner too
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
        info = await restarted(cluster, 0)
        assert (info.members, info.ring_sizes, info.slot, info.source) == (members[:2], (2,), 0, "admin")
        # the removed broker, started again on its disk with the flags it had (a later scale-up brings its pod
        # back): a member from its flags, as a new pod is, not the membership it was removed by
        info = await restarted(cluster, 2)
        assert (info.members, info.slot, info.source) == (members, 2, "flags")
    finally:
        await stop_cluster(cluster)


async def two_of_three(tmp_path: Path) -> Cluster:
    """Three brokers started with the grown ring (2 -> 3), brokers 0 and 1 set to run the 2-slot ring: slot 2
    joins once they are told the grown one."""
    cluster = await start_cluster(tmp_path, 3, ring_history="2")
    members = cluster.membership.members
    for slot in (0, 1):
        with admin_of(cluster.brokers[slot]) as admin:
            await asyncio.to_thread(functools.partial(admin.set_cluster, members[:2], (2,), force=True))
    return cluster


async def test_a_broker_that_joins_gets_the_subscriptions_it_will_serve(tmp_path: Path) -> None:
    """Brokers 0 and 1 run a 2-slot ring, then learn that slot 2 joined: each copies to it every client's
    patterns and the subscriptions to not yet created topics that slot 2 now owns, without waiting for the
    clients' next full sync; a topic matching the pattern created there is delivered there."""
    cluster = await two_of_three(tmp_path)
    try:
        members = cluster.membership.members
        grown = mb.Membership(members, (2, 3))
        joiner = [f"j-{i}" for i in range(5000) if mb.owner(grown, model.QueueId.lmq(PARENT, f"j-{i}").topic) == 2]
        await sync_on(cluster, 0, pb.PARTIAL_ADD, ["p-*", *joiner[:2]])
        assert (patterns_at(cluster, 2), subscribed(cluster, 2, joiner)) == (set(), set())
        await set_everywhere(cluster, [0, 1], members, (2, 3))
        await eventually_async(  # each of the two copies what it holds
            lambda: (patterns_at(cluster, 2), subscribed(cluster, 2, joiner)) == ({"p-*"}, set(joiner[:2])),
            "the joiner holds the pattern and its topics",
        )
        matching = next(
            f"p-{i}" for i in range(5000) if mb.owner(grown, model.QueueId.lmq(PARENT, f"p-{i}").topic) == 2
        )
        await send_via(cluster, 0, matching, 0)
        assert stored(cluster, 2, matching) == 1
        assert await taken(cluster, 2, 1) == [f"{matching}/0"]
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
        code, rows, err0 = await lmq_admin(0, "cluster", "set", "--peers", members[0], "--ring-history", "2,1",
                                        "--everywhere")  # fmt: skip
        assert rows is not None, err0
        assert [(r["endpoint"], r["slot"]) for r in rows] == [(members[0], 0), (members[1], -1)]
        assert cluster.brokers[0].cluster is not None and cluster.brokers[0].cluster.peers is None  # alone again
        code, _, err = await lmq_admin(0, "cluster", "set", "--peers", f"{members[0]},{members[1]}", "--slot", "5")
        assert code == 1 and "slot 5" in err
    finally:
        await stop_cluster(cluster)


async def test_lmq_admin_cluster_set_everywhere_reaches_each_brokers_admin_port(tmp_path: Path) -> None:
    """Brokers with --admin-port (the chart's): --everywhere calls every member on its host at the admin port the
    first broker reports, not on the member (client) endpoint, where admin is refused."""
    cluster = await start_cluster(tmp_path, 2, admin_port=True)
    try:
        members = cluster.membership.members
        admin_port = cluster.brokers[0].admin_port
        keys = ["--access-key", "admin-ak", "--secret-key", "admin-sk", "--output", "json"]

        async def lmq_admin(*args: str) -> tuple[int, Any, str]:
            out, err = io.StringIO(), io.StringIO()
            argv = ["--endpoint", cluster.brokers[0].admin_endpoint, *keys, *args]
            code = await asyncio.to_thread(cli.main, argv, out, err)
            return code, json.loads(out.getvalue()) if code == 0 else None, err.getvalue()

        code, got, _ = await lmq_admin("cluster", "get")
        assert (code, got["admin_port"]) == (0, admin_port)
        peers_flag = ["--peers", ",".join(members), "--ring-history", "2"]
        code, rows, err = await lmq_admin("cluster", "set", *peers_flag, "--ring-size", "1", "--everywhere")
        assert code == 0, err
        assert [(r["endpoint"], r["slot"], r["changed"], r["leaving"]) for r in rows] == [
            (members[1], 1, True, True), (members[0], 0, True, False)
        ]  # fmt: skip
        code, _, err = await lmq_admin(
            "cluster", "set", *peers_flag, "--everywhere", "--admin-port", str(members[0]).rsplit(":")[1]
        )
        assert code == 1 and "not served on this port" in err  # told the client port: admin is refused there
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


# --- the external listener (--external-port): clients outside the cluster -----------------------------------
def broker_endpoints(reply: spb.QueryRouteResponse | spb.QueryAssignmentResponse) -> list[str]:
    queues = (
        [a.message_queue for a in reply.assignments]
        if isinstance(reply, spb.QueryAssignmentResponse)
        else list(reply.message_queues)
    )
    return [f"{q.broker.endpoints.addresses[0].host}:{q.broker.endpoints.addresses[0].port}" for q in queues]


async def routes_at(
    client: protocol_testing.Client, headers: tuple[tuple[str, str], ...]
) -> tuple[list[str], list[str]]:
    route = await client.stub.QueryRoute(spb.QueryRouteRequest(topic=pb.Resource(name=PARENT)), metadata=headers)
    found = await client.stub.QueryAssignment(
        spb.QueryAssignmentRequest(topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP)), metadata=headers
    )
    assert route.status.code == found.status.code == pb.OK
    return broker_endpoints(route), broker_endpoints(found)


async def test_the_external_listener_routes_to_external_addresses(tmp_path: Path) -> None:
    """Two brokers (127.0.0.1 and 127.0.0.2, as two pods) with the same external port: on it, routes and
    assignments name every broker by its external address, on the client port by its member endpoint. A send
    through the external listener is forwarded to its owner as any other; admin is not served there; a
    membership whose new member has no external address is refused."""
    external_port = free_ports("127.0.0.1", 1)[0]
    listed = ("lmq-0.example.com:9094", "lmq-1.example.com:9094")
    cluster = await start_cluster(tmp_path, 2, admin_port=True, external_port=external_port,
                                  external_addresses=",".join(listed))  # fmt: skip
    outside = [
        protocol_testing.connect(f"127.0.0.{slot + 1}:{external_port}", broker.store)
        for slot, broker in enumerate(cluster.brokers)
        if broker.store is not None
    ]
    try:
        members = list(cluster.membership.members)
        for slot in range(2):
            assert cluster.brokers[slot].external_port == external_port
            mine, others = [listed[slot]], [e for e in listed if e != listed[slot]]
            assert await routes_at(outside[slot], cluster.headers()) == (mine + others, mine + others)
            mine, others = [members[slot]], [e for e in members if e != members[slot]]
            assert await routes_at(cluster.clients[slot], cluster.headers()) == (mine + others, mine + others)
        lite = cluster.lites_of(1, 1)[0]
        reply = await outside[0].stub.SendMessage(
            spb.SendMessageRequest(messages=[message(lite)]), metadata=cluster.headers()
        )
        assert reply.status.code == pb.OK, reply.status
        assert cluster.holds(1, lite) and not cluster.holds(0, lite)
        admin_stub = admin_grpc.LmqAdminStub(outside[0].channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await admin_stub.GetCluster(admin_pb.GetClusterRequest())
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "external listener" in (refused.value.details() or "")
        admin = AdminClient(
            cluster.brokers[0].admin_endpoint, timeout_s=10, access_key="admin-ak", secret_key="admin-sk"
        )
        with admin, pytest.raises(errors.InvalidArgument, match="no external address for ring slot 2"):
            await asyncio.to_thread(admin.set_cluster, (*members, f"127.0.0.3:{external_port}"), (2, 3))
    finally:
        for client in outside:
            await client.close()
        await stop_cluster(cluster)


async def test_a_lone_broker_answers_the_external_listener_with_the_address_dialled(tmp_path: Path) -> None:
    """Alone (no peers) and with no external address given: on the external listener a route names the address
    the client dialled (a port-forward's, a load balancer's), never --advertised-host, the in-cluster name."""
    config = dispatch_testing.config_for(
        tmp_path / "b", host="127.0.0.1", port=0, metrics_port=-1, external_port=0, admin_anonymous=True,
        advertised_host="lmq-0.lmq-headless.mq.svc.cluster.local",
    )  # fmt: skip
    store = lmq_store.open_store(config.store)
    store.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
    store.put_group(model.LiteGroup(GROUP, PARENT))
    broker = app.Broker(config, store=store)
    await broker.start()
    inside = protocol_testing.connect(broker.endpoint, store)
    outside = protocol_testing.connect(f"127.0.0.1:{broker.external_port}", store)
    try:
        dialled = pb.Endpoints(scheme=pb.DOMAIN_NAME, addresses=[pb.Address(host="localhost", port=18081)])
        headers = protocol_testing.Client.headers()
        for client, expected in (
            (outside, "localhost:18081"),
            (inside, f"lmq-0.lmq-headless.mq.svc.cluster.local:{broker.port}"),
        ):
            route = await client.stub.QueryRoute(
                spb.QueryRouteRequest(topic=pb.Resource(name=PARENT), endpoints=dialled), metadata=headers
            )
            assert broker_endpoints(route) == [expected]
    finally:
        await inside.close()
        await outside.close()
        await broker.stop(grace_s=0.2)


# --- TLS between brokers -------------------------------------------------------------------------------------
@pytest.mark.parametrize("checked_name", [False, True], ids=["dialled-address", "server-name"])
async def test_brokers_call_each_other_over_tls_with_a_ca_signed_certificate(
    tmp_path: Path, checked_name: bool
) -> None:
    """Each broker serves a certificate of its own, signed by one CA (as while cert-manager renews the Secret
    the pods mount: for a while they serve different ones). A send forwarded to its owner and the owner
    look-up over admin check the peer against --tls-ca: either by the address dialled (the certificate names
    it) or, with --tls-server-name, by the one name the certificate carries."""
    names = ["lmq-broker.mq.svc"] if checked_name else ["lmq-broker.mq.svc", "127.0.0.1", "127.0.0.2"]
    first = issue_certificate(tmp_path / "tls", *names, tag="b0")
    second = issue_certificate(tmp_path / "tls", *names, ca=first, tag="b1")
    each: list[dict[str, object]] = [{"tls_cert": c.cert, "tls_key": c.key} for c in (first, second)]
    tls: dict[str, object] = {"tls_ca": first.ca}
    if checked_name:
        tls["tls_server_name"] = "lmq-broker.mq.svc"
    cluster = await start_cluster(tmp_path, 2, admin_port=True, ring_history="1", each=each, **tls)
    certificate = first
    for client in cluster.clients:
        await client.close()
    options = (("grpc.ssl_target_name_override", "lmq-broker.mq.svc"),)
    cluster.clients = []
    for broker in cluster.brokers:
        assert broker.store is not None
        channel = grpc.aio.secure_channel(
            broker.endpoint, grpc.ssl_channel_credentials(certificate.ca.read_bytes()), options=options
        )
        cluster.clients.append(
            protocol_testing.Client(channel, service_grpc.MessagingServiceStub(channel), broker.endpoint, broker.store)
        )
    try:
        # ring history 1 -> 2: a topic now owned by slot 1 may be held by slot 0, which slot 1 asks over admin
        lites = cluster.lites_of(1, 2) + cluster.lites_of(0, 2)
        for lite in lites:
            await send_via(cluster, 1 - cluster.owner(lite), lite, 0)
        for lite in lites:
            owner = cluster.owner(lite)
            assert cluster.holds(owner, lite) and not cluster.holds(1 - owner, lite)
    finally:
        await stop_cluster(cluster)


@pytest.mark.parametrize("code", [pb.INTERNAL_ERROR, pb.MULTIPLE_RESULTS])
async def test_a_batch_refused_after_it_was_stored_is_not_sent_again_request_by_request(
    cluster: Cluster, code: pb.Code.ValueType
) -> None:
    """Broker 1 stores a batch of sends broker 0 gathered for it, then answers a refusal (as a replicated owner
    fenced after storing, "nothing acknowledged", or a leaving broker whose parts had different results). Sending
    each request again on its own would store each a second time, acknowledged; each is refused instead (its
    client retries, at least once), and stored once."""
    theirs = cluster.lites_of(1, 4, "f")
    peers = cluster.brokers[0].cluster.peers if cluster.brokers[0].cluster is not None else None
    assert peers is not None
    forwarder = peers.forwarder
    real = forwarder._call_send  # the fault: a refusal after the owner stored the batch

    async def stored_then_refused(target: str, payload: bytes, count: int) -> Any:
        reply = await real(target, payload, count)
        if count > 1 and not isinstance(reply, BaseException):
            return spb.SendMessageResponse(status=pb.Status(code=code, message="refused after storing"))
        return reply

    forwarder._call_send = stored_then_refused  # type: ignore[method-assign]
    stub = cluster.clients[0].stub
    replies = await asyncio.gather(
        *(
            stub.SendMessage(spb.SendMessageRequest(messages=[message(lite)]), metadata=cluster.headers())
            for lite in theirs
        )
    )
    assert all(stored(cluster, 1, lite) == 1 for lite in theirs)  # each once
    refused = [r.status.message for r in replies if r.status.code != pb.OK]
    assert refused and all("refused after storing (sent with other sends" in m for m in refused), refused


async def test_a_consumed_topic_no_send_moved_before_its_broker_left_still_reaches_its_consumer(tmp_path: Path) -> None:
    """3 -> 2 at --replicas 1 with a topic of the leaving broker fully consumed and no send to it while its broker
    was leaving (nothing moved it): once that broker is removed, the topic's next message is stored at today's
    owner, and its consumer must be subscribed there already (a full sync of the official clients comes only
    every 30 s; an MQTT session never sends one). Before the fix its subscription stayed on the removed broker
    only: the message was stored where nobody read it."""
    cluster = await start_cluster(tmp_path, 3)
    try:
        members = cluster.membership.members
        lite = cluster.lites_of(2, 1, prefix="idle")[0]
        today = mb.owner(mb.Membership(members[:2], (2,)), model.QueueId.lmq(PARENT, lite).topic)
        await sync_on(cluster, 0, pb.PARTIAL_ADD, [lite])
        await send_via(cluster, 0, lite, 0)
        assert await taken(cluster, 2, 1) == [f"{lite}/0"]  # consumed and acknowledged at slot 2
        await set_everywhere(cluster, [2, 0, 1], members, (3, 2))  # slot 2 leaves; nobody sends to the topic
        # consumed: handed over without a send (its consumer subscribed at today's owner), and only then drained
        leaving = cluster.brokers[2].cluster
        assert leaving is not None and leaving.peers is not None
        handoff = leaving.peers.handoff
        await eventually_async(lambda: handoff.moved(model.QueueId.lmq(PARENT, lite).topic), "handed over")
        assert subscribed(cluster, today, [lite]) == {lite}
        with admin_of(cluster.brokers[2]) as admin:
            info = await asyncio.to_thread(functools.partial(admin.cluster, with_undrained=True))
        assert (info.undrained_messages, info.drained) == (0, True)
        await set_everywhere(cluster, [0, 1, 2], members[:2], (3, 2))  # removed: the leaving one last
        await send_via(cluster, 0, lite, 1)
        assert stored(cluster, today, lite) == 1
        assert await taken(cluster, today, 1) == [f"{lite}/1"]
    finally:
        await stop_cluster(cluster)


async def told_broker_0_last(cluster: Cluster, sizes: tuple[int, ...], lite: str, *, owner: int) -> None:
    """The ring ``sizes`` told to brokers 2 and 1, a client's subscription to ``lite`` made through broker 0 (not
    told yet, unless a peer passed the change on first: then the subscription goes by the new ring at once),
    then broker 0 told: the topic's first message is stored at ``owner``, where the subscription must be, and
    taken there."""
    members = cluster.membership.members
    await set_everywhere(cluster, [2, 1], members, sizes)
    await sync_on(cluster, 0, pb.PARTIAL_ADD, [lite])
    await set_everywhere(cluster, [0], members, sizes)
    await send_via(cluster, 1, lite, 0)
    assert stored(cluster, owner, lite) == 1
    await eventually_async(lambda: subscribed(cluster, owner, [lite]), "the subscription at the owner")
    assert await taken(cluster, owner, 1) == [f"{lite}/0"]


async def test_a_subscription_made_through_a_broker_not_told_of_a_joiner_yet_reaches_the_joiner(tmp_path: Path) -> None:
    """A ring growing 2 -> 3 is told to the brokers one by one. A client subscribes, through broker 0 that still
    has the old ring, to a topic not created yet whose owner was broker 1 (told already, its copies to the
    joiner made) and is now the joiner: broker 0 gives the subscription to broker 1 only. Once broker 0 is told,
    the topic's messages are stored at the joiner, which must have the subscription (the official clients' full
    sync comes only every 30 s; an MQTT session never sends one). Before the fix it had none."""
    cluster = await two_of_three(tmp_path)
    try:
        members = cluster.membership.members
        two, grown = mb.Membership(members[:2], (2,)), mb.Membership(members, (2, 3))
        lite = next(
            name
            for name in (f"late-{i}" for i in range(10_000))
            if mb.owner(two, model.QueueId.lmq(PARENT, name).topic) == 1
            and mb.owner(grown, model.QueueId.lmq(PARENT, name).topic) == 2
        )
        await told_broker_0_last(cluster, (2, 3), lite, owner=2)
    finally:
        await stop_cluster(cluster)


async def test_a_subscription_made_through_a_broker_not_told_of_a_leaving_one_yet_reaches_the_new_owner(
    tmp_path: Path,
) -> None:
    """The scale-down's twin of the joiner's case: slot 2 is marked leaving on brokers 2 and 1 (slot 2, told
    first, has copied what it held to today's owners); a subscription made through broker 0, not told yet, to a
    topic not created yet that slot 2 owned goes to slot 2 only. Once broker 0 is told, the topic's first message
    is stored at today's owner, broker 0 itself, which must have the subscription. Before the fix it had none
    whenever broker 0 had not learned the change from a peer before the subscription (most runs here)."""
    cluster = await start_cluster(tmp_path, 3)
    try:
        members = cluster.membership.members
        two = mb.Membership(members[:2], (2,))
        lite = next(
            name
            for name in cluster.lites_of(2, 100, prefix="gone")
            if mb.owner(two, model.QueueId.lmq(PARENT, name).topic) == 0
        )
        # broker 0 may learn the change from a peer before the subscription, or not
        await told_broker_0_last(cluster, (3, 2), lite, owner=0)
    finally:
        await stop_cluster(cluster)
