"""Waiting on the other brokers of a cluster without leasing there (``AwaitLiteReady``, ``cluster.readiness``):
whole brokers (app.Broker, real ports and stores) in this process. A waiting LiteSimpleConsumer and a waiting
MQTT session get another broker's message at once, an idle one costs each other broker O(1) calls per long
poll, a wait cut off leases nothing, and the caps refuse clearly."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import raw_h2
from google.protobuf.duration_pb2 import Duration
from waiting import eventually_async

from lmq_broker import app, model
from lmq_broker.cluster import gathering, readiness
from lmq_broker.cluster import membership as mb
from lmq_broker.dispatch import delivery
from lmq_broker.dispatch import testing as dispatch_testing
from lmq_broker.mqtt import codec
from lmq_broker.mqtt.connection import group_of
from lmq_broker.protocol import testing as protocol_testing
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as admin_pb
from lmq_broker.storage import store as lmq_store
from lmq_broker.supervisor import free_ports

PARENT, GROUP, CLIENT = "P", "G", "lsc-1"
WAIT_S = 10.0
FAST_S = 0.15  # "at once": well under the 200 ms the polling took
pytestmark = pytest.mark.asyncio


class Cluster:
    def __init__(self, brokers: list[app.Broker], clients: list[protocol_testing.Client]) -> None:
        self.brokers = brokers
        self.clients = clients
        self.membership = mb.Membership.parse(brokers[0].config.peers)

    def lite_of(self, slot: int, prefix: str = "t") -> str:
        return next(
            f"{prefix}-{i}"
            for i in range(10_000)
            if mb.owner(self.membership, model.QueueId.lmq(PARENT, f"{prefix}-{i}").topic) == slot
        )

    def waits(self, slot: int) -> delivery.ReadyWaits:
        dispatcher = self.brokers[slot].dispatcher
        assert dispatcher is not None
        return dispatcher.deliverer.ready_waits

    def in_flight(self, slot: int) -> int:
        dispatcher = self.brokers[slot].dispatcher
        assert dispatcher is not None
        return dispatcher.in_flight()

    def hidden(self, slot: int) -> int:
        """Messages broker ``slot`` has out and still invisible (leased, their invisible time not run out)."""
        dispatcher = self.brokers[slot].dispatcher
        assert dispatcher is not None
        now = dispatcher.clock()
        states = dispatcher.leases._states.values()
        return sum(1 for s in states for lease in s.entries.values() if lease.visible_at_ms > now)

    def receives(self, slot: int) -> int:
        """ReceiveMessage calls broker ``slot`` answered (any outcome)."""
        total = 0.0
        for family in self.brokers[slot].metrics.registry.collect():
            for sample in family.samples:
                if sample.name == "lmq_rpc_total" and sample.labels.get("method") == "ReceiveMessage":
                    total += sample.value
        return int(total)

    def calls(self, slot: int) -> int:
        """Calls broker ``slot`` answered for clients of the others: receives and waits."""
        return self.receives(slot) + self.waits(slot).started


async def start_cluster(tmp_path: Path, size: int) -> Cluster:
    hosts = free_ports("127.0.0.1", size)
    members = ",".join(f"127.0.0.1:{p}" for p in hosts)
    brokers = []
    for slot, port in enumerate(hosts):
        config = dispatch_testing.config_for(
            tmp_path / f"b{slot}",
            host="127.0.0.1",
            port=port,
            metrics_port=-1,
            mqtt_port=0,
            peers=members,
            ordinal=slot,
            admin_access_key="admin-ak",
            admin_secret_key="admin-sk",
        )
        store = lmq_store.open_store(config.store)
        store.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
        store.put_group(model.LiteGroup(GROUP, PARENT))
        broker = app.Broker(config, store=store)
        await broker.start()
        brokers.append(broker)
    clients = [protocol_testing.connect(b.endpoint, b.store) for b in brokers if b.store is not None]
    return Cluster(brokers, clients)


@pytest_asyncio.fixture
async def two(tmp_path: Path) -> AsyncIterator[Cluster]:
    cluster = await start_cluster(tmp_path, 2)
    yield cluster
    await stop(cluster)


@pytest_asyncio.fixture
async def three(tmp_path: Path) -> AsyncIterator[Cluster]:
    cluster = await start_cluster(tmp_path, 3)
    yield cluster
    await stop(cluster)


async def stop(cluster: Cluster) -> None:
    for client in cluster.clients:
        await client.close()
    for broker in cluster.brokers:
        if broker.ready:
            await broker.stop(grace_s=0.2)


def headers(client_id: str = CLIENT) -> tuple[tuple[str, str], ...]:
    return protocol_testing.Client.headers(client_id, "JAVA", "5.1.2")


async def lite_simple_consumer(cluster: Cluster, lites: list[str], client_id: str = CLIENT) -> None:
    """A LiteSimpleConsumer at broker 0 (its heartbeat says so) subscribed to ``lites``."""
    stub = cluster.clients[0].stub
    beat = await stub.Heartbeat(
        spb.HeartbeatRequest(group=pb.Resource(name=GROUP), client_type=pb.LITE_SIMPLE_CONSUMER),
        metadata=headers(client_id),
    )
    assert beat.status.code == pb.OK, beat.status
    reply = await stub.SyncLiteSubscription(
        spb.SyncLiteSubscriptionRequest(
            action=pb.PARTIAL_ADD, topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP), lite_topic_set=lites
        ),
        metadata=headers(client_id),
    )
    assert reply.status.code == pb.OK, reply.status


async def receive(cluster: Cluster, poll_s: int, client_id: str = CLIENT, invisible_s: int = 30) -> list[pb.Message]:
    """One long-polled ReceiveMessage at broker 0."""
    request = spb.ReceiveMessageRequest(
        group=pb.Resource(name=GROUP),
        message_queue=pb.MessageQueue(topic=pb.Resource(name=PARENT)),
        batch_size=16,
        invisible_duration=Duration(seconds=invisible_s),
        long_polling_timeout=Duration(seconds=poll_s),
    )
    call = cluster.clients[0].stub.ReceiveMessage(request, metadata=headers(client_id), timeout=poll_s + 5)
    return [frame.message async for frame in call if frame.HasField("message")]


async def send(cluster: Cluster, lite: str, body: bytes) -> None:
    message = pb.Message(
        topic=pb.Resource(name=PARENT),
        body=body,
        system_properties=pb.SystemProperties(
            message_id=body.decode(), message_type=pb.LITE, lite_topic=lite, body_encoding=pb.IDENTITY
        ),
    )
    reply = await cluster.clients[0].stub.SendMessage(spb.SendMessageRequest(messages=[message]), metadata=headers())
    assert reply.status.code == pb.OK, reply.status


def await_ready_call(
    cluster: Cluster, at: int, client_id: str = CLIENT, timeout_ms: int = 5_000, *, peer: bool = True
) -> grpc.aio.UnaryUnaryCall[admin_pb.AwaitLiteReadyRequest, admin_pb.AwaitLiteReadyResponse]:
    """Broker 0 asks broker ``at`` to wait for ``client_id`` (``peer`` False: the admin pair only)."""
    assert cluster.brokers[0].cluster is not None
    peers = cluster.brokers[0].cluster.peers
    assert peers is not None
    member = cluster.membership.members[at]
    stub, metadata = peers.admin(member, readiness.METHOD)
    if not peer:
        metadata = tuple(h for h in metadata if h[0] != "x-lmq-peer")
    request = admin_pb.AwaitLiteReadyRequest(client_id=client_id, group=GROUP, parent=PARENT, timeout_ms=timeout_ms)
    return stub.AwaitLiteReady(request, metadata=metadata, timeout=timeout_ms / 1000 + 5)


# --- the wait itself ------------------------------------------------------------------------------------------
async def test_a_wait_answers_ready_once_the_client_has_work_there_and_leases_nothing(two: Cluster) -> None:
    theirs = two.lite_of(1)
    await lite_simple_consumer(two, [theirs])
    call = await_ready_call(two, 1)
    await eventually_async(lambda: two.waits(1).total == 1, "the wait is parked at broker 1")
    assert not call.done()
    await send(two, theirs, b"m-1")
    assert (await call).ready
    assert (two.in_flight(1), two.waits(1).total, two.waits(1).ready) == (0, 0, 1)  # told, nothing leased
    got = await receive(two, 1)  # taken at once: it was not hidden by the wait
    assert [m.body for m in got] == [b"m-1"]


async def test_a_wait_with_nothing_there_answers_not_ready_at_its_timeout(two: Cluster) -> None:
    await lite_simple_consumer(two, [two.lite_of(1)])
    started = time.monotonic()
    reply = await await_ready_call(two, 1, timeout_ms=300)
    assert not reply.ready and time.monotonic() - started >= 0.3
    assert two.waits(1).total == 0


async def test_a_wait_cut_off_by_its_caller_leases_nothing(two: Cluster) -> None:
    theirs = two.lite_of(1)
    await lite_simple_consumer(two, [theirs])
    call = await_ready_call(two, 1)
    await eventually_async(lambda: two.waits(1).total == 1, "the wait is parked at broker 1")
    call.cancel()  # the client went away: broker 0 ends its waits
    await eventually_async(lambda: two.waits(1).total == 0, "the cut wait ended at broker 1")
    await send(two, theirs, b"m-1")
    assert two.in_flight(1) == 0
    assert [m.body for m in await receive(two, 1)] == [b"m-1"]


async def test_a_wait_ends_not_ready_when_its_broker_stops_and_leases_nothing(two: Cluster) -> None:
    await lite_simple_consumer(two, [two.lite_of(1)])
    call = await_ready_call(two, 1, timeout_ms=30_000)
    await eventually_async(lambda: two.waits(1).total == 1, "the wait is parked at broker 1")
    dispatcher = two.brokers[1].dispatcher
    assert dispatcher is not None
    dispatcher.begin_drain()  # shutdown begins
    assert not (await call).ready
    assert (two.in_flight(1), two.waits(1).total) == (0, 0)


async def test_waits_beyond_the_caps_are_refused_and_counted(two: Cluster) -> None:
    await lite_simple_consumer(two, [two.lite_of(1)])
    await lite_simple_consumer(two, [two.lite_of(1)], client_id="lsc-2")
    waits = two.waits(1)
    waits.per_client_cap, waits.total_cap = 1, 2
    first = await_ready_call(two, 1)
    await eventually_async(lambda: waits.total == 1, "the first wait is parked")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await await_ready_call(two, 1)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "too many waits parked for client lsc-1" in (refused.value.details() or "")
    second = await_ready_call(two, 1, "lsc-2")
    await eventually_async(lambda: waits.total == 2, "another client's wait is parked")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await await_ready_call(two, 1, "lsc-3")
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "in all (2, at most 2)" in (
        refused.value.details() or ""
    )
    assert (waits.refused, waits.total) == (2, 2)
    first.cancel()
    second.cancel()


async def test_a_wait_is_a_peers_call_only(two: Cluster) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await await_ready_call(two, 1, peer=False)  # the admin pair, no peer header
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert two.waits(1).started == 0


# --- a LiteSimpleConsumer gathering through broker 0 ----------------------------------------------------------
async def test_a_waiting_lite_simple_consumer_gets_another_brokers_message_at_once(three: Cluster) -> None:
    theirs = [three.lite_of(1), three.lite_of(2)]
    await lite_simple_consumer(three, theirs)
    for n, lite in enumerate(theirs):
        slot = n + 1
        waiting = asyncio.ensure_future(receive(three, 20))
        await eventually_async(lambda: three.waits(1).total == 1 and three.waits(2).total == 1, "waits parked")
        sent = time.monotonic()
        await send(three, lite, f"m-{n}".encode())
        got = await waiting
        took = time.monotonic() - sent
        assert [m.body for m in got] == [f"m-{n}".encode()]
        assert took < FAST_S, f"the message of broker {slot} took {took * 1000:.0f} ms"
        assert three.in_flight(slot) == 1  # leased there by the receive, for the client to ack
        await eventually_async(lambda: three.waits(1).total == 0 and three.waits(2).total == 0, "the waits ended")


async def test_an_idle_lite_simple_consumer_costs_each_other_broker_o1_calls_per_long_poll(three: Cluster) -> None:
    await lite_simple_consumer(three, [three.lite_of(1), three.lite_of(2)])
    before = [three.calls(slot) for slot in (1, 2)]
    started = time.monotonic()
    assert await receive(three, 3) == []
    assert time.monotonic() - started >= 2.0  # it did wait out its poll (less the deadline margin)
    made = [three.calls(slot) - b for slot, b in zip((1, 2), before, strict=True)]
    assert all(1 <= n <= 3 for n in made), made  # a receive without waiting, one parked wait (was: one per 200 ms)
    assert (three.in_flight(1), three.in_flight(2)) == (0, 0)


async def test_a_consumer_whose_receive_is_cut_off_leaves_nothing_hidden(three: Cluster) -> None:
    theirs = three.lite_of(1)
    await lite_simple_consumer(three, [theirs])
    waiting = asyncio.ensure_future(receive(three, 20))
    await eventually_async(lambda: three.waits(1).total == 1, "the wait is parked at broker 1")
    waiting.cancel()  # the client gives up its call
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    await eventually_async(lambda: three.waits(1).total == 0, "broker 0 ended its wait at broker 1")
    await send(three, theirs, b"m-1")
    assert three.in_flight(1) == 0
    assert [m.body for m in await receive(three, 1)] == [b"m-1"]


@pytest.mark.parametrize("in_transit", [False, True])
async def test_a_consumer_whose_call_is_cut_mid_reply_gets_what_was_gathered_again_at_once(
    three: Cluster, in_transit: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gathered here and at broker 1, then the client resets its call before the reply is written (it reads
    nothing, window 0): what broker 0 had not written is visible again at once, at both brokers, not after its
    30 s invisible time (before 2026-11-30 every one of them stayed leased). ``in_transit``: the call is cut
    while broker 1's reply is still on its way to broker 0 (after broker 1 leased the messages): that reply is
    read to its end and given back too (a fresh clone's run at load 6 cut it there; those stayed leased)."""
    arrived = asyncio.Event()
    if in_transit:
        there = gathering._Gather.there

        async def slow_there(self: gathering._Gather, endpoint: str, batch: int) -> list[pb.Message] | None:
            got = await there(self, endpoint, batch)
            if got:
                arrived.set()
                await asyncio.sleep(1.0)  # still on its way when the client resets
            return got

        monkeypatch.setattr(gathering._Gather, "there", slow_there)
    lites = [three.lite_of(0), three.lite_of(1)]
    await lite_simple_consumer(three, lites)
    big = [
        pb.Message(
            topic=pb.Resource(name=PARENT), body=b"x" * 300_000,
            system_properties=pb.SystemProperties(message_id=f"cut-{i}", message_type=pb.LITE, lite_topic=lites[i % 2]),
        )
        for i in range(8)
    ]  # fmt: skip
    sent = await three.clients[0].stub.SendMessage(spb.SendMessageRequest(messages=big), metadata=headers())
    assert sent.status.code == pb.OK, sent.status
    request = spb.ReceiveMessageRequest(
        group=pb.Resource(name=GROUP), message_queue=pb.MessageQueue(topic=pb.Resource(name=PARENT)), batch_size=16,
        invisible_duration=Duration(seconds=30), long_polling_timeout=Duration(seconds=5),
    )  # fmt: skip
    with raw_h2.Connection(three.brokers[0].port, window=0) as raw:  # never read: this test's loop runs the brokers
        raw.open(1, "ReceiveMessage", headers())
        raw.send(1, request.SerializeToString())
        await eventually_async(lambda: three.in_flight(0) == 4 and three.in_flight(1) == 4, "all 8 gathered")
        if in_transit:
            await asyncio.wait_for(arrived.wait(), 10)
        else:
            await asyncio.sleep(0.5)  # being written, as far as the window lets
        raw.reset(1)
    # given back at once, not after their 30 s: broker 1's by ChangeInvisibleDuration calls of their own. A lite
    # topic delivers in order, so a receive made while some of its messages were still leased got the ones before
    # them only, the rest waiting behind those (a fresh clone's run: 6 of 8): receive once all are back
    started = time.monotonic()
    await eventually_async(lambda: three.hidden(0) == 0 and three.hidden(1) == 0, "all 8 given back")
    assert time.monotonic() - started < 5
    again = list[pb.Message]()
    while len(again) < 8 and time.monotonic() - started < 5:
        again += await receive(three, 1)
    assert sorted(m.system_properties.message_id for m in again) == [f"cut-{i}" for i in range(8)]


async def test_a_stale_handle_gathered_from_another_broker_settles_nothing_there(two: Cluster) -> None:
    """The message of broker 1 came through broker 0 (a "via" handle), its invisible time ran out and it came
    again: the first handle's ack and invisibility change, which broker 0 forwards to broker 1, are refused
    there (INVALID_RECEIPT_HANDLE, per entry) and the second delivery stays out; its own handle settles it.
    Before 2026-11-30 broker 1 answered the stale ack OK and settled the second delivery with it."""
    theirs = two.lite_of(1)
    await lite_simple_consumer(two, [theirs])
    await send(two, theirs, b"m-1")
    (first,) = await receive(two, 5, invisible_s=1)
    assert first.system_properties.receipt_handle.startswith(gathering.VIA)
    again: list[pb.Message] = []
    while not again:  # once its invisible time ran out, at broker 1
        again = await receive(two, 5)
    assert again[0].system_properties.message_id == "m-1" and again[0].system_properties.delivery_attempt == 2
    stub, group, topic = two.clients[0].stub, pb.Resource(name=GROUP), pb.Resource(name=PARENT)

    async def ack(handle: str) -> spb.AckMessageResponse:
        entry = spb.AckMessageEntry(message_id="m-1", receipt_handle=handle, lite_topic=theirs)
        return await stub.AckMessage(spb.AckMessageRequest(group=group, topic=topic, entries=[entry]),
                                     metadata=headers())  # fmt: skip

    stale = await ack(first.system_properties.receipt_handle)
    assert [e.status.code for e in stale.entries] == [pb.INVALID_RECEIPT_HANDLE], stale
    assert "no longer the current lease" in stale.entries[0].status.message
    change = await stub.ChangeInvisibleDuration(
        spb.ChangeInvisibleDurationRequest(
            group=group, topic=topic, receipt_handle=first.system_properties.receipt_handle,
            invisible_duration=Duration(seconds=1), message_id="m-1", lite_topic=theirs,
        ),
        metadata=headers(),
    )  # fmt: skip
    assert change.status.code == pb.INVALID_RECEIPT_HANDLE, change.status
    assert two.in_flight(1) == 1  # the second delivery is still out
    current = await ack(again[0].system_properties.receipt_handle)
    assert current.status.code == pb.OK, current.status
    assert two.in_flight(1) == 0


async def test_a_broker_that_is_down_is_asked_again_after_a_pause_and_the_others_still_serve(three: Cluster) -> None:
    theirs = three.lite_of(1)
    await lite_simple_consumer(three, [theirs, three.lite_of(2)])
    await three.brokers[2].stop(grace_s=0.1)
    cluster = three.brokers[0].cluster
    assert cluster is not None
    waits = readiness.Readiness(lambda: cluster.peers, CLIENT, GROUP, PARENT)
    try:
        started = time.monotonic()
        assert not await waits.wait([three.membership.members[2]], 2.5, park_s=0.1)
        assert time.monotonic() - started >= 2.5
        assert 1 <= waits.calls <= 3, waits.calls  # failed asks are repeated after readiness.RETRY_S, no loop
    finally:
        waits.close()
    waiting = asyncio.ensure_future(receive(three, 20))
    await eventually_async(lambda: three.waits(1).total == 1, "the wait is parked at broker 1")
    sent = time.monotonic()
    await send(three, theirs, b"m-1")
    assert [m.body for m in await waiting] == [b"m-1"]
    assert time.monotonic() - sent < FAST_S


# --- an MQTT session at broker 0 ------------------------------------------------------------------------------
class MqttSession:
    """One MQTT 3.1.1 client on a socket."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = codec.Decoder(level=codec.LEVEL_3_1_1)
        self.pending: list[codec.Packet] = []

    @classmethod
    async def subscribed(cls, cluster: Cluster, client_id: str, topic_filter: str) -> MqttSession:
        session = cls(*await asyncio.open_connection("127.0.0.1", cluster.brokers[0].mqtt_port))
        session.send(codec.Connect(client_id, True, keep_alive_s=60, level=codec.LEVEL_3_1_1))
        assert isinstance(await session.next(), codec.ConnAck)
        session.send(codec.Subscribe(1, ((topic_filter, 1),)))
        assert isinstance(await session.next(), codec.SubAck)
        return session

    def send(self, packet: codec.Packet) -> None:
        self.writer.write(codec.encode(packet))

    async def next(self) -> codec.Packet:
        async with asyncio.timeout(WAIT_S):
            while not self.pending:
                data = await self.reader.read(65536)
                assert data, "the broker closed the connection"
                self.pending += self.decoder.feed(data)
        return self.pending.pop(0)

    async def delivery(self) -> codec.Publish:
        packet = await self.next()
        assert isinstance(packet, codec.Publish), packet
        return packet

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


# A session's ``PARENT/#`` reads two parents: PARENT and the default parent, which keeps the topics under
# ``PARENT/`` that PARENT cannot hold (docs/mqtt.md, "Topic mapping"): a delivery loop, and a parked wait at
# each other broker, per parent.
MQTT_LOOPS = 2


def parked(cluster: Cluster, count: int) -> bool:
    return cluster.waits(1).total == count and cluster.waits(2).total == count


def offset(cluster: Cluster, slot: int, lite: str, client_id: str) -> int | None:
    store = cluster.brokers[slot].store
    assert store is not None
    return store.get_offset(model.QueueId.lmq(PARENT, lite), group_of(client_id))


async def test_a_waiting_mqtt_subscriber_gets_each_other_brokers_message_at_once(three: Cluster) -> None:
    session = await MqttSession.subscribed(three, "sub", f"{PARENT}/#")
    await eventually_async(lambda: parked(three, MQTT_LOOPS), "waits parked there")
    for n, slot in enumerate((1, 2, 1)):
        lite = three.lite_of(slot)
        sent = time.monotonic()
        await send(three, lite, f"m-{n}".encode())
        delivered = await session.delivery()
        took = time.monotonic() - sent
        assert (delivered.topic, delivered.payload) == (f"{PARENT}/{lite}", f"m-{n}".encode())
        assert took < FAST_S, f"the message of broker {slot} took {took * 1000:.0f} ms"
        assert delivered.packet_id is not None
        session.send(codec.PacketId(codec.PUBACK, delivered.packet_id))
        settled = functools.partial(offset, three, slot, lite, "sub")
        await eventually_async(lambda: settled() == n // 2 + 1, "the PUBACK settled at the owner")  # noqa: B023
    await session.close()


async def test_an_idle_mqtt_session_costs_each_other_broker_o1_calls(three: Cluster) -> None:
    session = await MqttSession.subscribed(three, "idle", f"{PARENT}/#")
    await eventually_async(lambda: parked(three, MQTT_LOOPS), "waits parked there")
    before = [three.calls(slot) for slot in (1, 2)]
    await asyncio.sleep(3.0)  # idle: what it costs over this time is the point
    made = [three.calls(slot) - b for slot, b in zip((1, 2), before, strict=True)]
    assert made == [0, 0], made  # the parked waits last 30 s (was: 15 receives each in 3 s)
    await session.close()


async def test_an_mqtt_session_that_ends_ends_its_waits_and_leases_nothing(three: Cluster) -> None:
    session = await MqttSession.subscribed(three, "gone", f"{PARENT}/#")
    await eventually_async(lambda: parked(three, MQTT_LOOPS), "waits parked there")
    await session.close()
    await eventually_async(lambda: three.waits(1).total == 0 and three.waits(2).total == 0, "the waits ended there")
    assert (three.in_flight(1), three.in_flight(2)) == (0, 0)
