"""MQTT in a cluster of two whole brokers (app.Broker, real ports and stores, in this process): a publish through
a broker that does not own its lite topic is stored at the owner before it is acknowledged, wills and QoS 0
too; an owner that cannot be reached means no acknowledgement. Raw sockets speak MQTT through our codec."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import pytest_asyncio

from lmq_broker import app, errors, model
from lmq_broker.cluster import membership as mb
from lmq_broker.dispatch import testing as dispatch_testing
from lmq_broker.mqtt import codec, mapping
from lmq_broker.mqtt.properties import Properties, Reason
from lmq_broker.protocol import status
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.storage import store as lmq_store
from lmq_broker.supervisor import free_ports

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


async def start_pair(tmp_path: Path, each: Sequence[dict[str, object]] = ({}, {})) -> Pair:
    ports = free_ports("127.0.0.1", 2)
    members = ",".join(f"127.0.0.1:{p}" for p in ports)
    brokers = []
    for slot, port in enumerate(ports):
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
            **each[slot],
        )
        store = lmq_store.open_store(config.store)
        store.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
        broker = app.Broker(config, store=store)
        await broker.start()
        brokers.append(broker)
    return Pair(brokers)


async def stop_pair(pair: Pair) -> None:
    for broker in pair.brokers:
        if broker.ready:
            await broker.stop(grace_s=0.2)


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
        cls, port: int, client_id: str, *, level: int = codec.LEVEL_3_1_1, will: codec.Will | None = None
    ) -> Raw:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        props = Properties() if level == codec.LEVEL_5 else None
        if will is not None and level == codec.LEVEL_5:
            will = codec.Will(will.topic, will.payload, will.qos, will.retain, Properties())
        raw = cls(reader, writer, level)
        raw.send(codec.Connect(client_id, keep_alive_s=60, will=will, level=level, properties=props))
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

    def publish(self, topic: str, payload: bytes, qos: int = 1, packet_id: int | None = 1) -> None:
        props = Properties() if self.decoder.level == codec.LEVEL_5 else None
        self.send(codec.Publish(topic, payload, qos, packet_id=packet_id if qos else None, properties=props))

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
