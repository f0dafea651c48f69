"""MQTT in a cluster of two whole brokers (app.Broker, real ports and stores, in this process): a publish through
a broker that does not own its lite topic is stored at the owner before it is acknowledged, wills and QoS 0
too; an owner that cannot be reached means no acknowledgement. A session subscribes at every broker and gets
the other brokers' messages (acknowledged there once its client acknowledged them), their retained messages,
and keeps its subscriptions across an owner's restart. Raw sockets speak MQTT through our codec."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import mqtt_brokers
import pytest
import pytest_asyncio

from lmq_broker import app, errors, model
from lmq_broker.admin.client import AdminClient
from lmq_broker.cluster import membership as mb
from lmq_broker.dispatch import saved_subscriptions
from lmq_broker.mqtt import codec, mapping, topics
from lmq_broker.mqtt.connection import group_of
from lmq_broker.mqtt.properties import Properties, Reason
from lmq_broker.protocol import status
from lmq_broker.protocol import testing as protocol_testing
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb

PARENT = "P"
WAIT_S = 10.0
pytestmark = pytest.mark.asyncio


class Pair:
    def __init__(self, brokers: list[app.Broker]) -> None:
        self.brokers = brokers
        self.membership = mb.Membership.parse(brokers[0].config.peers)

    def owner(self, lite: str) -> int:
        return mb.owner(self.membership, model.QueueId.lmq(PARENT, lite).topic)

    def lite_of(self, slot: int, prefix: str = "t") -> str:
        return next(f"{prefix}-{i}" for i in range(10_000) if self.owner(f"{prefix}-{i}") == slot)

    def stored(self, slot: int, lite: str) -> list[model.StoredMessage]:
        store = self.brokers[slot].store
        assert store is not None
        return store.read(model.QueueId.lmq(PARENT, lite), 0, 100)

    def port(self, slot: int) -> int:
        return self.brokers[slot].mqtt_port

    def offset(self, slot: int, lite: str, client_id: str) -> int:
        """The committed offset of MQTT client ``client_id``'s group in ``lite`` at broker ``slot`` (its topics
        start at 0: 0 whether none is stored yet or hand-outs were recorded with nothing acknowledged)."""
        store = self.brokers[slot].store
        assert store is not None
        return store.get_offset(model.QueueId.lmq(PARENT, lite), group_of(client_id)) or 0

    async def restart(self, slot: int, *, crash: bool = False) -> None:
        """Stop broker ``slot`` and start it again on its ports and data; ``crash``: it comes back without the
        subscriptions it held (a graceful stop saves them, as kill -9 does not)."""
        config = self.brokers[slot].config
        await self.brokers[slot].stop(grace_s=0.1)
        if crash:
            (config.store.data_dir / saved_subscriptions.FILE_NAME).unlink(missing_ok=True)
        self.brokers[slot] = restarted = app.Broker(config)
        await restarted.start()


async def start_pair(tmp_path: Path, each: Sequence[dict[str, object]] = ({}, {})) -> Pair:
    """``each``: one broker per item, with these settings."""
    return Pair(await mqtt_brokers.start_brokers(tmp_path, PARENT, each))


async def stop_pair(pair: Pair) -> None:
    await mqtt_brokers.stop_brokers(pair.brokers)


@pytest_asyncio.fixture
async def pair(tmp_path: Path) -> AsyncIterator[Pair]:
    started = await start_pair(tmp_path)
    yield started
    await stop_pair(started)


class Raw:
    """One MQTT client on a socket: packets written with ``codec.encode``, read with ``codec.Decoder``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, level: int) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = codec.Decoder(level=level)
        self.pending: list[codec.Packet] = []

    @classmethod
    async def connect(
        cls,
        port: int,
        client_id: str,
        *,
        level: int = codec.LEVEL_3_1_1,
        will: codec.Will | None = None,
        clean: bool = True,
    ) -> Raw:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        props = Properties() if level == codec.LEVEL_5 else None
        if props is not None and not clean:
            props = Properties(session_expiry_s=600)
        if will is not None and level == codec.LEVEL_5:
            will = codec.Will(will.topic, will.payload, will.qos, will.retain, Properties())
        raw = cls(reader, writer, level)
        raw.send(codec.Connect(client_id, clean, keep_alive_s=60, will=will, level=level, properties=props))
        connack = await raw.next()
        assert isinstance(connack, codec.ConnAck) and connack.code == 0, connack
        return raw

    def send(self, packet: codec.Packet) -> None:
        self.writer.write(codec.encode(packet))

    async def next(self) -> codec.Packet | None:
        """The next packet from the broker; None once it closed the connection."""
        async with asyncio.timeout(WAIT_S):
            while not self.pending:
                data = await self.reader.read(65536)
                if not data:
                    return None
                self.pending += self.decoder.feed(data)
        return self.pending.pop(0)

    def publish(
        self, topic: str, payload: bytes, qos: int = 1, packet_id: int | None = 1, *, retain: bool = False
    ) -> None:
        props = Properties() if self.decoder.level == codec.LEVEL_5 else None
        self.send(
            codec.Publish(topic, payload, qos, retain=retain, packet_id=packet_id if qos else None, properties=props)
        )

    async def published(self, topic: str, payload: bytes, *, packet_id: int = 1, retain: bool = False) -> None:
        """Publish at QoS 1 and wait for the PUBACK."""
        self.publish(topic, payload, 1, packet_id, retain=retain)
        puback = await self.next()
        assert isinstance(puback, codec.PacketId) and (puback.kind, puback.packet_id) == (codec.PUBACK, packet_id)

    async def subscribe(self, *filters: str, qos: int = 1, packet_id: int = 1) -> codec.SubAck:
        props = Properties() if self.decoder.level == codec.LEVEL_5 else None
        self.send(codec.Subscribe(packet_id, tuple((f, qos) for f in filters), properties=props))
        suback = await self.next()
        assert isinstance(suback, codec.SubAck) and suback.packet_id == packet_id, suback
        return suback

    async def delivery(self) -> codec.Publish:
        packet = await self.next()
        assert isinstance(packet, codec.Publish), packet
        return packet

    def ack(self, delivered: codec.Publish) -> None:
        assert delivered.packet_id is not None
        self.send(codec.PacketId(codec.PUBACK, delivered.packet_id))

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


@pytest.mark.parametrize("level", [codec.LEVEL_3_1_1, codec.LEVEL_5])
async def test_a_qos1_publish_through_a_non_owner_is_stored_at_the_owner_before_its_puback(
    pair: Pair, level: int
) -> None:
    theirs = pair.lite_of(1)
    topic = f"{PARENT}/{theirs}"
    subscriber = await Raw.connect(pair.port(1), "sub", level=level)  # a consumer at the owner
    props = Properties() if level == codec.LEVEL_5 else None
    subscriber.send(codec.Subscribe(1, ((topic, 1),), properties=props))
    suback = await subscriber.next()
    assert isinstance(suback, codec.SubAck) and suback.codes == (1,)
    publisher = await Raw.connect(pair.port(0), "pub", level=level)
    publisher.publish(topic, b"hello", qos=1, packet_id=7)
    puback = await publisher.next()
    assert isinstance(puback, codec.PacketId) and puback.kind == codec.PUBACK and puback.packet_id == 7
    assert puback.reason == 0
    stored = pair.stored(1, theirs)  # at the owner when the PUBACK came
    assert [m.body for m in stored] == [b"hello"]
    assert pair.stored(0, theirs) == []
    if level == codec.LEVEL_5:
        assert stored[0].user_properties.get(mapping.CLIENT) == "pub"
    delivered = await subscriber.next()
    assert isinstance(delivered, codec.Publish) and (delivered.topic, delivered.payload) == (topic, b"hello")
    registry = pair.brokers[0].metrics.registry
    assert registry.get_sample_value("lmq_forwarded_messages_total") == 1
    await publisher.close()
    await subscriber.close()


async def test_mqtt_3_3_3_an_empty_publish_through_a_non_owner_is_stored_at_the_owner_and_delivered(
    pair: Pair,
) -> None:
    """3.1.1 / 5.0 section 3.3.3: a zero-length payload is valid; forwarded to its owner as a SendMessage, which
    takes an empty body from MQTT (``MQTT_EMPTY``) though it refuses one from a RocketMQ producer."""
    theirs = pair.lite_of(1)
    topic = f"{PARENT}/{theirs}"
    subscriber = await Raw.connect(pair.port(1), "sub-empty")
    assert (await subscriber.subscribe(topic)).codes == (1,)
    publisher = await Raw.connect(pair.port(0), "pub-empty")
    await publisher.published(topic, b"", packet_id=3)
    assert [m.body for m in pair.stored(1, theirs)] == [b""]
    delivered = await subscriber.delivery()
    assert (delivered.topic, delivered.payload) == (topic, b"")
    await publisher.close()
    await subscriber.close()


async def test_qos0_publishes_and_wills_through_a_non_owner_are_stored_at_the_owner(pair: Pair) -> None:
    theirs, mine = pair.lite_of(1), pair.lite_of(0)
    will_lite = pair.lite_of(1, "will")
    publisher = await Raw.connect(pair.port(0), "pub", will=codec.Will(f"{PARENT}/{will_lite}", b"gone", 1, False))
    publisher.publish(f"{PARENT}/{theirs}", b"zero", qos=0)
    publisher.publish(f"{PARENT}/{mine}", b"one", qos=1, packet_id=1)  # stored after the QoS 0 one
    puback = await publisher.next()
    assert isinstance(puback, codec.PacketId) and puback.kind == codec.PUBACK
    zero = pair.stored(1, theirs)
    assert [m.body for m in zero] == [b"zero"] and zero[0].user_properties.get(mapping.QOS) == "0"
    assert [m.body for m in pair.stored(0, mine)] == [b"one"]  # this broker's own topic stays here
    mqtt = pair.brokers[0].mqtt
    assert mqtt is not None
    connection = mqtt.owner("pub")
    assert connection is not None
    publisher.writer.transport.abort()  # no DISCONNECT: the will is published
    await asyncio.wait_for(connection.done.wait(), WAIT_S)
    assert [m.body for m in pair.stored(1, will_lite)] == [b"gone"]
    assert pair.stored(0, will_lite) == []
    await publisher.close()


async def test_an_owner_that_cannot_be_reached_gets_no_puback_over_311(pair: Pair) -> None:
    theirs, mine = pair.lite_of(1), pair.lite_of(0)
    await pair.brokers[1].stop(grace_s=0.1)
    publisher = await Raw.connect(pair.port(0), "pub")
    publisher.publish(f"{PARENT}/{theirs}", b"lost?", qos=1, packet_id=3)
    assert await publisher.next() is None  # closed: 3.1.1 has no negative PUBACK, and nothing was stored
    assert pair.stored(0, theirs) == []
    again = await Raw.connect(pair.port(0), "pub")  # this broker's own topics keep flowing
    again.publish(f"{PARENT}/{mine}", b"here", qos=1, packet_id=4)
    puback = await again.next()
    assert isinstance(puback, codec.PacketId) and puback.kind == codec.PUBACK and puback.packet_id == 4
    await again.close()
    await publisher.close()


async def test_an_owner_that_cannot_be_reached_ends_a_50_connection_with_0x80_and_no_puback(pair: Pair) -> None:
    theirs = pair.lite_of(1)
    await pair.brokers[1].stop(grace_s=0.1)
    publisher = await Raw.connect(pair.port(0), "pub5", level=codec.LEVEL_5)
    publisher.publish(f"{PARENT}/{theirs}", b"lost?", qos=1, packet_id=3)
    answer = await publisher.next()
    assert isinstance(answer, codec.Disconnect) and answer.reason == Reason.UNSPECIFIED_ERROR, answer
    assert await publisher.next() is None
    assert pair.stored(0, theirs) == []
    await publisher.close()


async def test_an_owners_refusal_reaches_a_50_publisher_as_its_reason_code(tmp_path: Path) -> None:
    pair = await start_pair(tmp_path, ({}, {"max_lite_topics_per_broker": 1}))
    try:
        first, second = pair.lite_of(1, "a"), pair.lite_of(1, "b")
        publisher = await Raw.connect(pair.port(0), "pub5", level=codec.LEVEL_5)
        publisher.publish(f"{PARENT}/{first}", b"one", qos=1, packet_id=1)
        publisher.publish(f"{PARENT}/{second}", b"two", qos=1, packet_id=2)  # over the owner's quota
        answers = [await publisher.next(), await publisher.next()]
        assert [(a.packet_id, a.reason) for a in answers if isinstance(a, codec.PacketId)] == [
            (1, Reason.SUCCESS),
            (2, Reason.QUOTA_EXCEEDED),
        ], answers
        assert [m.body for m in pair.stored(1, first)] == [b"one"] and pair.stored(1, second) == []
        publisher.publish(f"{PARENT}/{first}", b"three", qos=1, packet_id=3)  # the connection stays
        puback = await publisher.next()
        assert isinstance(puback, codec.PacketId) and (puback.packet_id, puback.reason) == (3, Reason.SUCCESS)
        await publisher.close()
    finally:
        await stop_pair(pair)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (pb.LITE_TOPIC_QUOTA_EXCEEDED, errors.LiteTopicQuotaExceeded),
        (pb.TOPIC_NOT_FOUND, errors.TopicNotFound),
        (pb.ILLEGAL_LITE_TOPIC, errors.InvalidLiteTopic),
        (pb.BAD_REQUEST, errors.InvalidArgument),
        (pb.ILLEGAL_MESSAGE_ID, errors.InvalidArgument),
        (pb.INTERNAL_ERROR, errors.BrokerUnavailable),
        (pb.MULTIPLE_RESULTS, errors.BrokerUnavailable),
    ],
)
async def test_an_owners_status_reads_back_as_the_error_it_stands_for(code: int, expected: type) -> None:
    found = status.error_of(pb.Status(code=code, message="why"))  # type: ignore[arg-type]
    assert type(found) is expected and found.message == "why"
    assert status.code_of(found) == code or expected in (errors.InvalidArgument, errors.BrokerUnavailable)


# --- subscribers across brokers ---------------------------------------------------------------------------------
async def eventually(check: Callable[[], bool], what: str) -> None:
    """Wait until ``check()`` holds (it reads state another task changes), at most ``WAIT_S``."""
    async with asyncio.timeout(WAIT_S):
        while not check():
            await asyncio.sleep(0.02)
    assert check(), what


def send_request(lite: str, body: bytes) -> spb.SendMessageRequest:
    return spb.SendMessageRequest(
        messages=[
            pb.Message(
                topic=pb.Resource(name=PARENT),
                body=body,
                system_properties=pb.SystemProperties(
                    message_id=body.decode(), message_type=pb.LITE, lite_topic=lite, body_encoding=pb.IDENTITY
                ),
            )
        ]
    )


@pytest.mark.parametrize("level", [codec.LEVEL_3_1_1, codec.LEVEL_5])
@pytest.mark.parametrize("kind", ["exact", "one level", "every level"])
async def test_a_subscriber_gets_the_messages_of_topics_another_broker_owns(pair: Pair, level: int, kind: str) -> None:
    theirs, mine = pair.lite_of(1, "room"), pair.lite_of(0, "room")
    topic_filter = {"exact": f"{PARENT}/{theirs}", "one level": f"{PARENT}/+", "every level": f"{PARENT}/#"}[kind]
    subscriber = await Raw.connect(pair.port(0), "sub", level=level)
    assert (await subscriber.subscribe(topic_filter)).codes == (1,)
    publisher = await Raw.connect(pair.port(1), "pub", level=level)  # through the owner's MQTT
    await publisher.published(f"{PARENT}/{theirs}", b"one", packet_id=1)
    await publisher.published(f"{PARENT}/{theirs}", b"two", packet_id=2)
    assert pair.stored(0, theirs) == [] and len(pair.stored(1, theirs)) == 2
    first, second = await subscriber.delivery(), await subscriber.delivery()
    assert [(p.topic, p.payload, p.qos, p.dup) for p in (first, second)] == [
        (f"{PARENT}/{theirs}", b"one", 1, False),
        (f"{PARENT}/{theirs}", b"two", 1, False),
    ]
    assert pair.offset(1, theirs, "sub") == 0  # nothing acknowledged at the owner before the client did
    subscriber.ack(first)
    await eventually(lambda: pair.offset(1, theirs, "sub") == 1, "the PUBACK reached the owner")
    subscriber.ack(second)
    await eventually(lambda: pair.offset(1, theirs, "sub") == 2, "the PUBACK reached the owner")
    if kind != "exact":  # this broker's own topics keep coming the usual way
        await publisher.published(f"{PARENT}/{mine}", b"here", packet_id=3)
        here = await subscriber.delivery()
        assert (here.topic, here.payload) == (f"{PARENT}/{mine}", b"here")
        subscriber.ack(here)
        await eventually(lambda: pair.offset(0, mine, "sub") == 1, "the PUBACK settled here")
    await publisher.close()
    await subscriber.close()


async def test_grpc_sends_reach_an_mqtt_subscriber_on_another_broker_in_order(pair: Pair) -> None:
    theirs = pair.lite_of(1)
    subscriber = await Raw.connect(pair.port(0), "sub")
    await subscriber.subscribe(f"{PARENT}/#", qos=0)
    clients = [protocol_testing.connect(b.endpoint, b.store) for b in pair.brokers if b.store is not None]
    try:
        for n in range(6):  # through the broker that does not own it (forwarded) and through its owner, in turn
            reply = await clients[n % 2].stub.SendMessage(
                send_request(theirs, f"m-{n}".encode()), metadata=protocol_testing.Client.headers("producer")
            )
            assert reply.status.code == pb.OK, reply
        got = [await subscriber.delivery() for _ in range(6)]
        assert [(p.topic, p.payload, p.qos) for p in got] == [
            (f"{PARENT}/{theirs}", f"m-{n}".encode(), 0) for n in range(6)
        ]
        await eventually(lambda: pair.offset(1, theirs, "sub") == 6, "QoS 0 deliveries settled at the owner")
    finally:
        for client in clients:
            await client.close()
        await subscriber.close()


@pytest.mark.parametrize("level", [codec.LEVEL_3_1_1, codec.LEVEL_5])
async def test_an_unacknowledged_message_of_another_broker_comes_again_with_dup(pair: Pair, level: int) -> None:
    theirs = pair.lite_of(1)
    subscriber = await Raw.connect(pair.port(0), "sub", level=level, clean=False)
    await subscriber.subscribe(f"{PARENT}/{theirs}")
    publisher = await Raw.connect(pair.port(1), "pub")
    await publisher.published(f"{PARENT}/{theirs}", b"keep me")
    first = await subscriber.delivery()
    assert (first.payload, first.dup) == (b"keep me", False)
    mqtt = pair.brokers[0].mqtt
    assert mqtt is not None
    connection = mqtt.owner("sub")
    assert connection is not None
    subscriber.writer.transport.abort()  # no PUBACK: its lease at the owner is given back
    await asyncio.wait_for(connection.done.wait(), WAIT_S)
    assert pair.offset(1, theirs, "sub") == 0
    again = await Raw.connect(pair.port(0), "sub", level=level, clean=False)
    second = await again.delivery()
    assert (second.topic, second.payload, second.dup) == (f"{PARENT}/{theirs}", b"keep me", True)
    again.ack(second)
    await eventually(lambda: pair.offset(1, theirs, "sub") == 1, "acknowledged at the owner")
    await again.close()
    await publisher.close()


@pytest.mark.parametrize("topic_filter", ["exact", f"{PARENT}/#"])
async def test_a_new_subscription_does_not_replay_another_brokers_backlog(pair: Pair, topic_filter: str) -> None:
    theirs = pair.lite_of(1)
    publisher = await Raw.connect(pair.port(1), "pub")
    await publisher.published(f"{PARENT}/{theirs}", b"before", packet_id=1)
    subscriber = await Raw.connect(pair.port(0), "sub")
    await subscriber.subscribe(f"{PARENT}/{theirs}" if topic_filter == "exact" else topic_filter)
    assert pair.offset(1, theirs, "sub") == 1  # the group starts at the owner's end, as it does here
    await publisher.published(f"{PARENT}/{theirs}", b"after", packet_id=2)
    delivered = await subscriber.delivery()
    assert delivered.payload == b"after"
    await publisher.close()
    await subscriber.close()


@pytest.mark.parametrize("level", [codec.LEVEL_3_1_1, codec.LEVEL_5])
async def test_retained_messages_held_by_another_broker_follow_the_suback(pair: Pair, level: int) -> None:
    theirs, other = pair.lite_of(1, "r"), pair.lite_of(0, "r")
    publisher = await Raw.connect(pair.port(1), "pub")
    await publisher.published(f"{PARENT}/{theirs}", b"kept there", packet_id=1, retain=True)
    await publisher.published(f"{PARENT}/{other}", b"older", packet_id=2, retain=True)  # kept on broker 1 too
    elsewhere = await Raw.connect(pair.port(0), "pub0")
    await elsewhere.published(f"{PARENT}/{other}", b"newer", packet_id=1, retain=True)  # and on broker 0: newest wins
    subscriber = await Raw.connect(pair.port(0), "sub", level=level)
    assert (await subscriber.subscribe(f"{PARENT}/#")).codes == (1,)  # the SUBACK comes first
    got = sorted([await subscriber.delivery(), await subscriber.delivery()], key=lambda p: p.topic)
    expected = sorted([(f"{PARENT}/{theirs}", b"kept there"), (f"{PARENT}/{other}", b"newer")])
    assert [(p.topic, p.payload) for p in got] == expected
    assert all(p.retain for p in got)
    for p in got:
        subscriber.ack(p)
    subscriber.send(codec.Bare(codec.PINGREQ))  # nothing else comes before the answer to a ping
    assert await subscriber.next() == codec.Bare(codec.PINGRESP)
    await subscriber.close()
    await elsewhere.close()
    await publisher.close()


async def test_unsubscribe_ends_the_subscription_at_the_other_broker(pair: Pair) -> None:
    theirs, mine = pair.lite_of(1), pair.lite_of(0)
    subscriber = await Raw.connect(pair.port(0), "sub")
    await subscriber.subscribe(f"{PARENT}/{theirs}", f"{PARENT}/{mine}")
    consumer = f"{group_of('sub')}@{PARENT}"
    owner = pair.brokers[1].dispatcher
    assert owner is not None
    lmq = model.QueueId.lmq(PARENT, theirs)
    assert owner.subscribers(lmq) == [consumer]
    subscriber.send(codec.Unsubscribe(2, (f"{PARENT}/{theirs}",)))
    unsuback = await subscriber.next()
    assert isinstance(unsuback, codec.PacketId) and unsuback.kind == codec.UNSUBACK
    assert owner.subscribers(lmq) == []  # ended there before the UNSUBACK
    publisher = await Raw.connect(pair.port(1), "pub")
    await publisher.published(f"{PARENT}/{theirs}", b"not for sub", packet_id=1)
    await publisher.published(f"{PARENT}/{mine}", b"for sub", packet_id=2)
    delivered = await subscriber.delivery()
    assert delivered.payload == b"for sub"
    assert pair.offset(1, theirs, "sub") == 0  # never delivered: nothing of it acknowledged there
    await publisher.close()
    await subscriber.close()


async def test_a_clean_session_that_ends_leaves_no_subscription_at_the_other_broker(pair: Pair) -> None:
    theirs = pair.lite_of(1)
    subscriber = await Raw.connect(pair.port(0), "sub")
    await subscriber.subscribe(f"{PARENT}/{theirs}", f"{PARENT}/+")
    owner = pair.brokers[1].dispatcher
    assert owner is not None
    consumer = f"{group_of('sub')}@{PARENT}"
    assert owner.subscribers(model.QueueId.lmq(PARENT, theirs)) == [consumer]
    mqtt = pair.brokers[0].mqtt
    assert mqtt is not None
    connection = mqtt.owner("sub")
    assert connection is not None
    subscriber.send(codec.Bare(codec.DISCONNECT))
    await asyncio.wait_for(connection.done.wait(), WAIT_S)
    assert owner.subscribers(model.QueueId.lmq(PARENT, theirs)) == []
    state = owner.registry.get(consumer)
    assert state is None or not state.patterns  # its wildcard filter is gone there too
    await subscriber.close()


async def test_a_subscription_outlives_its_owners_crash(pair: Pair) -> None:
    theirs = pair.lite_of(1)
    subscriber = await Raw.connect(pair.port(0), "sub")
    await subscriber.subscribe(f"{PARENT}/{theirs}")
    await pair.restart(1, crash=True)  # comes back without the subscriptions it held: given them again
    publisher = await Raw.connect(pair.port(1), "pub")
    await publisher.published(f"{PARENT}/{theirs}", b"after the crash")
    delivered = await subscriber.delivery()
    assert (delivered.topic, delivered.payload) == (f"{PARENT}/{theirs}", b"after the crash")
    subscriber.ack(delivered)
    await eventually(lambda: pair.offset(1, theirs, "sub") == 1, "acknowledged at the restarted owner")
    await publisher.close()
    await subscriber.close()


async def test_a_retained_clear_through_one_broker_outdates_what_another_holds(pair: Pair) -> None:
    theirs = pair.lite_of(1, "c")
    topic = f"{PARENT}/{theirs}"
    one = await Raw.connect(pair.port(1), "pub1")
    await one.published(topic, b"old", packet_id=1, retain=True)  # kept by broker 1
    kept = time.time_ns() // 1_000_000
    await eventually(lambda: time.time_ns() // 1_000_000 > kept, "the wall clock moved on")  # newer, not as new
    zero = await Raw.connect(pair.port(0), "pub0")
    await zero.published(topic, b"", packet_id=1, retain=True)  # cleared through broker 0: kept there as a clear
    for slot in (0, 1):
        subscriber = await Raw.connect(pair.port(slot), f"sub{slot}")
        await subscriber.subscribe(f"{PARENT}/#")
        subscriber.send(codec.Bare(codec.PINGREQ))  # the answer comes first: no retained message before it
        assert await subscriber.next() == codec.Bare(codec.PINGRESP)
        await subscriber.close()
    await one.published(topic, b"new", packet_id=2, retain=True)  # and a newer one outdates the clear
    subscriber = await Raw.connect(pair.port(0), "sub")
    await subscriber.subscribe(f"{PARENT}/+")
    delivered = await subscriber.delivery()
    assert (delivered.topic, delivered.payload, delivered.retain) == (topic, b"new", True)
    await subscriber.close()
    await zero.close()
    await one.close()


async def test_a_session_made_while_its_broker_ran_alone_subscribes_everywhere_once_it_has_peers(
    tmp_path: Path,
) -> None:
    """Broker 0 runs alone (a ring of one) when a session subscribes; then broker 1 joins it. The session's
    filters are made at broker 1 without the client asking, and broker 1's topics reach it."""
    each: list[dict[str, object]] = [{"ring_history": "1"}, {"ring_history": "1"}]
    pair = await start_pair(tmp_path, each)
    try:
        members = pair.membership.members
        for broker in pair.brokers:
            with AdminClient(broker.endpoint, timeout_s=10, access_key="admin-ak", secret_key="admin-sk") as admin:
                await asyncio.to_thread(functools.partial(admin.set_cluster, members[:1], (1,), force=True))
        mqtt = pair.brokers[0].mqtt
        assert mqtt is not None and mqtt.owners is not None and not mqtt.owners.active  # alone
        subscriber = await Raw.connect(pair.port(0), "sub")
        await subscriber.subscribe(f"{PARENT}/#")
        grown = mb.Membership(members, (1, 2))
        lite = next(f"j-{i}" for i in range(10_000) if mb.owner(grown, model.QueueId.lmq(PARENT, f"j-{i}").topic) == 1)
        for broker in pair.brokers:
            with AdminClient(broker.endpoint, timeout_s=10, access_key="admin-ak", secret_key="admin-sk") as admin:
                await asyncio.to_thread(admin.set_cluster, members, (1, 2))
        consumer = f"{group_of('sub')}@{PARENT}"
        joiner = pair.brokers[1].dispatcher
        assert joiner is not None
        await eventually(lambda: joiner.wildcards.registration(consumer) is not None, "subscribed at broker 1")
        publisher = await Raw.connect(pair.port(1), "pub")
        await publisher.published(f"{PARENT}/{lite}", b"at broker 1")
        assert [m.body for m in pair.stored(1, lite)] == [b"at broker 1"]
        delivered = await subscriber.delivery()
        assert (delivered.topic, delivered.payload) == (f"{PARENT}/{lite}", b"at broker 1")
        await publisher.close()
        await subscriber.close()
    finally:
        await stop_pair(pair)


async def test_three_brokers_each_deliver_their_topics_in_order_and_take_their_acks(tmp_path: Path) -> None:
    pair = await start_pair(tmp_path, ({}, {}, {}))
    try:
        lites = {slot: pair.lite_of(slot) for slot in (1, 2)}
        subscriber = await Raw.connect(pair.port(0), "sub", level=codec.LEVEL_5)
        await subscriber.subscribe(f"{PARENT}/#")
        broker = pair.brokers[0]
        assert broker.store is not None
        client = protocol_testing.connect(broker.endpoint, broker.store)
        try:
            for n in range(3):  # through broker 0, which owns neither: each forwarded to its owner
                for slot, lite in lites.items():
                    reply = await client.stub.SendMessage(
                        send_request(lite, f"{slot}-{n}".encode()), metadata=protocol_testing.Client.headers("p")
                    )
                    assert reply.status.code == pb.OK, reply
        finally:
            await client.close()
        got = []
        for _ in range(6):  # acknowledged as they come: a topic's next message follows its head's ack
            got.append(await subscriber.delivery())
            subscriber.ack(got[-1])
        for slot, lite in lites.items():
            assert [p.payload for p in got if p.topic == f"{PARENT}/{lite}"] == [
                f"{slot}-{n}".encode() for n in range(3)
            ]
        settled = {slot: functools.partial(pair.offset, slot, lite, "sub") for slot, lite in lites.items()}
        await eventually(lambda: all(offset() == 3 for offset in settled.values()), "each owner took its acks")
        await subscriber.close()
    finally:
        await stop_pair(pair)


def _hashed_topic_owned_by(pair: Pair, slot: int) -> tuple[str, str]:
    """A topic over the lite-name limit escaped (kept hashed in the default parent) whose owner is ``slot``,
    and its lite name."""
    default = pair.brokers[0].config.mqtt_default_parent
    for i in range(10_000):
        topic = f"long/{'x' * 70}/{i}"
        lite = topics.default_lite(topic)
        if mb.owner(pair.membership, model.QueueId.lmq(default, lite).topic) == slot:
            assert topics.is_hashed(lite)
            return topic, lite
    raise AssertionError("no such topic")


@pytest.mark.parametrize("level", [codec.LEVEL_3_1_1, codec.LEVEL_5])
@pytest.mark.parametrize("topic_filter", ["exact", "long/+/#", "#"])
async def test_a_hashed_topic_another_broker_owns_reaches_the_subscribers_here(
    pair: Pair, level: int, topic_filter: str
) -> None:
    topic, lite = _hashed_topic_owned_by(pair, 1)
    default = pair.brokers[1].config.mqtt_default_parent
    subscriber = await Raw.connect(pair.port(0), "sub", level=level)
    assert (await subscriber.subscribe(topic if topic_filter == "exact" else topic_filter)).codes == (1,)
    publisher = await Raw.connect(pair.port(1), "pub", level=level)  # through the owner's MQTT
    await publisher.published(topic, b"hashed there")
    owner = pair.brokers[1].store
    assert owner is not None and len(owner.read(model.QueueId.lmq(default, lite), 0, 10)) == 1
    delivered = await subscriber.delivery()
    assert (delivered.topic, delivered.payload) == (topic, b"hashed there")
    subscriber.ack(delivered)
    store = owner

    def acked() -> bool:
        return (store.get_offset(model.QueueId.lmq(default, lite), group_of("sub")) or 0) == 1

    await eventually(acked, "acknowledged at the owner")
    await publisher.close()
    await subscriber.close()


@pytest.mark.parametrize("level", [codec.LEVEL_3_1_1, codec.LEVEL_5])
@pytest.mark.parametrize("topic_filter", ["#", "+/+", "NEW/#"])
async def test_a_parent_created_after_the_subscribe_is_reached_at_every_broker(
    pair: Pair, level: int, topic_filter: str
) -> None:
    """Section 4.7 with a parent made later: created through broker 1's admin service (sent on to broker 0),
    its topics owned by either broker reach a session of broker 0 without a reconnect."""
    subscriber = await Raw.connect(pair.port(0), "sub", level=level)
    assert (await subscriber.subscribe(topic_filter)).codes == (1,)
    with AdminClient(pair.brokers[1].endpoint, timeout_s=10, access_key="admin-ak", secret_key="admin-sk") as admin:
        await asyncio.to_thread(admin.put_parent_topic, model.ParentTopic("NEW", model.MessageType.LITE))
    membership = pair.membership
    theirs, mine = (
        next(f"x-{i}" for i in range(10_000) if mb.owner(membership, model.QueueId.lmq("NEW", f"x-{i}").topic) == s)
        for s in (1, 0)
    )
    publisher = await Raw.connect(pair.port(1), "pub", level=level)
    await publisher.published(f"NEW/{theirs}", b"there", packet_id=1)
    await publisher.published(f"NEW/{mine}", b"here", packet_id=2)
    for slot, lite in ((1, theirs), (0, mine)):  # kept by the new parent at its owner
        store = pair.brokers[slot].store
        assert store is not None and len(store.read(model.QueueId.lmq("NEW", lite), 0, 10)) == 1
    got = sorted([await subscriber.delivery(), await subscriber.delivery()], key=lambda p: p.payload)
    assert [(p.topic, p.payload) for p in got] == [(f"NEW/{mine}", b"here"), (f"NEW/{theirs}", b"there")]
    for p in got:
        subscriber.ack(p)
    subscriber.send(codec.Bare(codec.PINGREQ))  # nothing else came (each once)
    assert await subscriber.next() == codec.Bare(codec.PINGRESP)
    await publisher.close()
    await subscriber.close()


@pytest.mark.parametrize("level", [codec.LEVEL_3_1_1, codec.LEVEL_5])
async def test_4_3_3_a_qos2_publish_resent_after_a_reconnect_is_stored_once_at_another_owner(
    pair: Pair, level: int
) -> None:
    """Section 4.3.3 in a cluster: a persistent session's QoS 2 publish through broker 0 of a topic broker 1
    owns, answered PUBREC; the client reconnects without having seen it and resends the PUBLISH (DUP): PUBREC
    again, one message at the owner (its row said it was stored: this broker cannot look in the owner's store)."""
    theirs = pair.lite_of(1)
    first = await Raw.connect(pair.port(0), "q2pub", level=level, clean=False)
    first.publish(f"{PARENT}/{theirs}", b"once", qos=2, packet_id=7)
    pubrec = await first.next()
    assert isinstance(pubrec, codec.PacketId) and (pubrec.kind, pubrec.packet_id) == (codec.PUBREC, 7), pubrec
    mqtt = pair.brokers[0].mqtt
    assert mqtt is not None
    connection = mqtt.owner("q2pub")
    assert connection is not None
    first.writer.transport.abort()
    await asyncio.wait_for(connection.done.wait(), WAIT_S)
    again = await Raw.connect(pair.port(0), "q2pub", level=level, clean=False)
    props = Properties() if level == codec.LEVEL_5 else None
    again.send(codec.Publish(f"{PARENT}/{theirs}", b"once", 2, dup=True, packet_id=7, properties=props))
    pubrec = await again.next()
    assert isinstance(pubrec, codec.PacketId) and (pubrec.kind, pubrec.packet_id) == (codec.PUBREC, 7), pubrec
    again.send(codec.PacketId(codec.PUBREL, 7, 0, props))
    pubcomp = await again.next()
    assert isinstance(pubcomp, codec.PacketId) and pubcomp.kind == codec.PUBCOMP, pubcomp
    assert [m.body for m in pair.stored(1, theirs)] == [b"once"] and pair.stored(0, theirs) == []
    await again.close()


def _new_parent_lites(pair: Pair) -> tuple[str, str]:
    """Lite names of a parent ``NEW`` that broker 1 and broker 0 own."""
    names = [f"x-{i}" for i in range(10_000)]
    owners = {n: mb.owner(pair.membership, model.QueueId.lmq("NEW", n).topic) for n in names[:200]}
    theirs, mine = (next(n for n, slot in owners.items() if slot == s) for s in (1, 0))
    return theirs, mine


async def _create_new(pair: Pair) -> None:
    with AdminClient(pair.brokers[1].endpoint, timeout_s=10, access_key="admin-ak", secret_key="admin-sk") as admin:
        await asyncio.to_thread(admin.put_parent_topic, model.ParentTopic("NEW", model.MessageType.LITE))


async def _each_once(subscriber: Raw, count: int) -> list[tuple[str, bytes]]:
    """``count`` deliveries (acknowledged), then nothing before the PINGRESP."""
    got = []
    for _ in range(count):
        delivered = await subscriber.delivery()
        subscriber.ack(delivered)
        got.append((delivered.topic, delivered.payload))
    subscriber.send(codec.Bare(codec.PINGREQ))
    assert await subscriber.next() == codec.Bare(codec.PINGRESP)
    return sorted(got)


@pytest.mark.parametrize("level", [codec.LEVEL_3_1_1, codec.LEVEL_5])
async def test_4_7_an_exact_filter_made_before_its_parent_existed_gets_its_topic_at_every_broker(
    pair: Pair, level: int
) -> None:
    """Section 4.7 with a parent made later: ``NEW/<lite>`` subscribed at broker 0 while no ``NEW`` existed (its
    topic kept in the default parent then) reaches the topic once ``NEW`` keeps it, whichever broker owns it."""
    theirs, mine = _new_parent_lites(pair)
    subscriber = await Raw.connect(pair.port(0), "sub", level=level)
    assert (await subscriber.subscribe(f"NEW/{theirs}", f"NEW/{mine}")).codes == (1, 1)
    publisher = await Raw.connect(pair.port(1), "pub", level=level)
    await publisher.published(f"NEW/{theirs}", b"before", packet_id=1)
    assert await _each_once(subscriber, 1) == [(f"NEW/{theirs}", b"before")]
    await _create_new(pair)
    await publisher.published(f"NEW/{theirs}", b"there", packet_id=2)
    await publisher.published(f"NEW/{mine}", b"here", packet_id=3)
    for slot, lite in ((1, theirs), (0, mine)):  # kept by the new parent at its owner
        store = pair.brokers[slot].store
        assert store is not None and len(store.read(model.QueueId.lmq("NEW", lite), 0, 10)) == 1
    assert await _each_once(subscriber, 2) == [(f"NEW/{mine}", b"here"), (f"NEW/{theirs}", b"there")]
    await publisher.close()
    await subscriber.close()


@pytest.mark.parametrize("level", [codec.LEVEL_3_1_1, codec.LEVEL_5])
async def test_4_7_a_persistent_session_away_when_its_exact_filters_parent_came_gets_both_sides_at_every_broker(
    pair: Pair, level: int
) -> None:
    """A persistent session (3.1.2.4 / 5.0 3.1.2.11) with ``NEW/<lite>`` made before ``NEW`` existed is away
    while one message per topic is kept in the default parent, ``NEW`` is created, and one more is kept there:
    back at broker 0 it gets all four, once each, from both brokers."""
    theirs, mine = _new_parent_lites(pair)
    first = await Raw.connect(pair.port(0), "sub", level=level, clean=False)
    assert (await first.subscribe(f"NEW/{theirs}", f"NEW/{mine}")).codes == (1, 1)
    mqtt = pair.brokers[0].mqtt
    assert mqtt is not None
    connection = mqtt.owner("sub")
    assert connection is not None
    await first.close()
    await asyncio.wait_for(connection.done.wait(), WAIT_S)
    publisher = await Raw.connect(pair.port(1), "pub", level=level)
    for n, lite in enumerate((theirs, mine)):
        await publisher.published(f"NEW/{lite}", b"default", packet_id=n + 1)
    await _create_new(pair)
    for n, lite in enumerate((theirs, mine)):
        await publisher.published(f"NEW/{lite}", b"named", packet_id=n + 3)
    again = await Raw.connect(pair.port(0), "sub", level=level, clean=False)
    expected = sorted((f"NEW/{lite}", body) for lite in (theirs, mine) for body in (b"default", b"named"))
    assert await _each_once(again, 4) == expected
    await publisher.close()
    await again.close()
