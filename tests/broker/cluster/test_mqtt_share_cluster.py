"""Shared subscriptions (MQTT 5.0 section 4.8.2) across the brokers of a cluster: whole brokers (app.Broker, real
ports and stores) in this process, members connected to different brokers, raw MQTT through our codec.

A share is one lite group whose offsets and leases live at each topic's owner; a member reads its own broker's
topics and pulls the others' through their owners, so each message is leased to one member wherever the members
are connected, and a member's unacknowledged QoS 1 message goes back to the owner (and to another member) when
its connection ends."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import mqtt_brokers
import pytest
import pytest_asyncio

from lmq_broker import app, model
from lmq_broker.admin.client import AdminClient
from lmq_broker.cluster import membership as mb
from lmq_broker.dispatch import saved_subscriptions
from lmq_broker.mqtt import codec, shares, topics
from lmq_broker.mqtt.properties import Properties

PARENT = "P"
WAIT_S = 10.0
pytestmark = pytest.mark.asyncio


class Cluster:
    def __init__(self, brokers: list[app.Broker]) -> None:
        self.brokers = brokers
        self.membership = mb.Membership.parse(brokers[0].config.peers)

    def lite_of(self, slot: int, prefix: str = "t") -> str:
        """A lite topic of ``PARENT`` broker ``slot`` owns."""
        owned = (f"{prefix}-{i}" for i in range(10_000))
        return next(lite for lite in owned if mb.owner(self.membership, model.QueueId.lmq(PARENT, lite).topic) == slot)

    def port(self, slot: int) -> int:
        return self.brokers[slot].mqtt_port

    def offset(self, slot: int, lite: str, group: str) -> int:
        store = self.brokers[slot].store
        assert store is not None
        return store.get_offset(model.QueueId.lmq(PARENT, lite), group) or 0

    async def restart(self, slot: int) -> None:
        """Broker ``slot`` stops and comes back on its ports and data without the subscriptions it held."""
        config = self.brokers[slot].config
        await self.brokers[slot].stop(grace_s=0.1)
        (config.store.data_dir / saved_subscriptions.FILE_NAME).unlink(missing_ok=True)
        self.brokers[slot] = restarted = app.Broker(config)
        await restarted.start()


async def start_cluster(tmp_path: Path, size: int) -> Cluster:
    return Cluster(await mqtt_brokers.start_brokers(tmp_path, PARENT, [{}] * size))


async def stop_cluster(cluster: Cluster) -> None:
    await mqtt_brokers.stop_brokers(cluster.brokers)


@pytest_asyncio.fixture
async def pair(tmp_path: Path) -> AsyncIterator[Cluster]:
    started = await start_cluster(tmp_path, 2)
    yield started
    await stop_cluster(started)


class Raw:
    """One MQTT client on a socket, packets written with ``codec.encode`` and read with ``codec.Decoder``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, level: int) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = codec.Decoder(level=level)
        self.pending: list[codec.Packet] = []
        self.connack: codec.ConnAck | None = None

    @classmethod
    async def connect(cls, port: int, client_id: str, *, level: int = codec.LEVEL_5) -> Raw:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        raw = cls(reader, writer, level)
        props = Properties() if level == codec.LEVEL_5 else None
        raw.send(codec.Connect(client_id, True, keep_alive_s=60, level=level, properties=props))
        connack = await raw.next()
        assert isinstance(connack, codec.ConnAck) and connack.code == 0, connack
        raw.connack = connack
        return raw

    @property
    def props(self) -> Properties | None:
        return Properties() if self.decoder.level == codec.LEVEL_5 else None

    def send(self, packet: codec.Packet) -> None:
        self.writer.write(codec.encode(packet))

    async def next(self, timeout_s: float = WAIT_S) -> codec.Packet | None:
        """The next packet from the broker; None once it closed the connection."""
        async with asyncio.timeout(timeout_s):
            while not self.pending:
                data = await self.reader.read(65536)
                if not data:
                    return None
                self.pending += self.decoder.feed(data)
        return self.pending.pop(0)

    async def subscribe(self, topic_filter: str, qos: int = 1) -> tuple[int, ...]:
        self.send(codec.Subscribe(1, ((topic_filter, qos),), properties=self.props))
        suback = await self.next()
        assert isinstance(suback, codec.SubAck), suback
        return suback.codes

    async def published(self, topic: str, payload: bytes, packet_id: int) -> None:
        """A QoS 1 publish, acknowledged."""
        self.send(codec.Publish(topic, payload, 1, packet_id=packet_id, properties=self.props))
        puback = await self.next()
        assert isinstance(puback, codec.PacketId) and (puback.kind, puback.packet_id) == (codec.PUBACK, packet_id)

    async def published2(self, topic: str, payload: bytes, packet_id: int) -> None:
        """A QoS 2 publish, its flow completed (PUBREC, PUBREL, PUBCOMP)."""
        self.send(codec.Publish(topic, payload, 2, packet_id=packet_id, properties=self.props))
        assert await self.next() == codec.PacketId(codec.PUBREC, packet_id, properties=self.props)
        self.send(codec.PacketId(codec.PUBREL, packet_id))
        assert await self.next() == codec.PacketId(codec.PUBCOMP, packet_id, properties=self.props)

    async def delivery(self) -> codec.Publish:
        packet = await self.next()
        assert isinstance(packet, codec.Publish), packet
        return packet

    def ack(self, delivered: codec.Publish, kind: int = codec.PUBACK) -> None:
        assert delivered.packet_id is not None
        self.send(codec.PacketId(kind, delivered.packet_id))

    async def quiet(self) -> list[codec.Publish]:
        """What comes before the answer to a PINGREQ (acknowledged at QoS 1)."""
        self.send(codec.Bare(codec.PINGREQ))
        extra = []
        while (packet := await self.next()) != codec.Bare(codec.PINGRESP):
            assert isinstance(packet, codec.Publish), packet
            extra.append(packet)
            self.ack(packet)
        return extra

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()

    def kill(self) -> None:
        """The client dies: no DISCONNECT, nothing it holds acknowledged."""
        self.writer.transport.abort()


async def collect(members: Sequence[Raw], count: int) -> list[list[codec.Publish]]:
    """Read (and acknowledge at QoS 1) what each member gets until ``count`` came in all."""
    got: list[list[codec.Publish]] = [[] for _ in members]
    enough = asyncio.Event()

    async def read(i: int) -> None:
        while not enough.is_set():
            packet = await members[i].next(timeout_s=60)
            assert isinstance(packet, codec.Publish), packet
            members[i].ack(packet)
            got[i].append(packet)
            if sum(map(len, got)) >= count:
                enough.set()

    readers = [asyncio.ensure_future(read(i)) for i in range(len(members))]
    try:
        async with asyncio.timeout(WAIT_S * 2):
            await enough.wait()
    finally:
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    for task in readers:
        if not task.cancelled() and task.exception() is not None:
            raise AssertionError(task.exception())
    return got


async def eventually(check: object, what: str) -> None:
    assert callable(check)
    async with asyncio.timeout(WAIT_S):
        while not check():
            await asyncio.sleep(0.02)


async def publish_everywhere(cluster: Cluster, lites: Sequence[str], per_topic: int) -> set[tuple[str, bytes]]:
    """``per_topic`` messages to each of ``lites``, through every broker in turn; what was sent."""
    publishers = [await Raw.connect(cluster.port(slot), f"pub-{slot}") for slot in range(len(cluster.brokers))]
    sent: set[tuple[str, bytes]] = set()
    for n in range(per_topic):
        for i, lite in enumerate(lites):
            publisher = publishers[(n + i) % len(publishers)]
            topic, payload = f"{PARENT}/{lite}", f"{lite}-{n}".encode()
            await publisher.published(topic, payload, packet_id=n * len(lites) + i + 1)
            sent.add((topic, payload))
    for publisher in publishers:
        await publisher.close()
    return sent


@pytest.mark.parametrize("size", [2, 3])
async def test_mqtt5_4_8_2_members_on_different_brokers_each_get_distinct_messages(tmp_path: Path, size: int) -> None:
    """Section 4.8.2: each message a share's filter matches goes to one member, wherever the members are
    connected and whichever broker the message was published through or is stored at; CONNACK leaves Shared
    Subscription Available out (available, 5.0 section 3.2.2.3.15)."""
    cluster = await start_cluster(tmp_path, size)
    try:
        members = [await Raw.connect(cluster.port(slot), f"member-{slot}") for slot in range(size)]
        for member in members:
            assert member.connack is not None and member.connack.properties is not None
            assert member.connack.properties.shared_subscription_available is None
            assert await member.subscribe(f"$share/g/{PARENT}/+") == (1,)
        lites = [cluster.lite_of(slot, f"s{k}") for slot in range(size) for k in range(2)]
        sent = await publish_everywhere(cluster, lites, per_topic=5)
        got = await collect(members, len(sent))
        for member in members:
            got[members.index(member)] += await member.quiet()
        everything = [(p.topic, p.payload) for part in got for p in part]
        assert sorted(everything) == sorted(sent), "each message once, across the members"
        group = shares.group_of("g", f"{PARENT}/+")
        for slot in range(size):  # acknowledged at each owner, in the share's group
            for k in range(2):
                lite = cluster.lite_of(slot, f"s{k}")
                await eventually(lambda s=slot, t=lite: cluster.offset(s, t, group) == 5, f"{lite} settled")
        for member in members:
            assert await member.quiet() == []
            await member.close()
    finally:
        await stop_cluster(cluster)


async def owned_by(cluster: Cluster, slots: Sequence[int]) -> list[str]:
    return [cluster.lite_of(slot, f"u{i}") for i, slot in enumerate(slots)]


@pytest.mark.parametrize("level", [codec.LEVEL_3_1_1, codec.LEVEL_5])
async def test_mqtt5_4_8_2_a_qos1_message_a_member_left_unacknowledged_goes_to_a_member_on_another_broker(
    pair: Cluster, level: int
) -> None:
    """Section 4.8.2: a QoS 1 message whose member's connection ends before its PUBACK goes to another member
    (DUP set), here one connected to the other broker, for topics either broker owns."""
    first = await Raw.connect(pair.port(0), "first", level=level)
    await first.subscribe(f"$share/w/{PARENT}/#")
    lites = await owned_by(pair, [0, 1, 1])
    sent = await publish_everywhere(pair, lites, per_topic=1)
    held = [await first.delivery() for _ in sent]  # not acknowledged
    assert sorted((p.topic, p.payload) for p in held) == sorted(sent)
    second = await Raw.connect(pair.port(1), "second", level=level)
    await second.subscribe(f"$share/w/{PARENT}/#")
    assert await second.quiet() == []  # held by the first member while it is connected
    first.kill()
    again = (await collect([second], len(sent)))[0]
    assert sorted((p.topic, p.payload) for p in again) == sorted(sent)
    assert all(p.dup for p in again)
    assert await second.quiet() == []
    await second.close()


async def test_mqtt5_4_8_2_a_share_outlives_its_owners_restart(pair: Cluster) -> None:
    """The member's broker keeps the share's subscription as an intent: an owner that restarted without the
    subscriptions it held gets it again, and its messages reach the member."""
    theirs = pair.lite_of(1, "r")
    member = await Raw.connect(pair.port(0), "member")
    await member.subscribe(f"$share/g/{PARENT}/{theirs}")
    await pair.restart(1)
    publisher = await Raw.connect(pair.port(1), "pub")
    await publisher.published(f"{PARENT}/{theirs}", b"after the restart", packet_id=1)
    delivered = await member.delivery()
    assert (delivered.topic, delivered.payload) == (f"{PARENT}/{theirs}", b"after the restart")
    member.ack(delivered)
    group = shares.group_of("g", f"{PARENT}/{theirs}")
    await eventually(lambda: pair.offset(1, theirs, group) == 1, "acknowledged at the restarted owner")
    await publisher.close()
    await member.close()


async def test_mqtt5_4_8_2_a_qos2_share_message_reaches_exactly_one_member(pair: Cluster) -> None:
    """Section 4.8.2 with QoS 2 (granted, 3.9.3): a member whose connection ends after its PUBREC has the
    message (settled at its owner, never sent to another member: MQTT-4.8.2-5); one whose connection ends before
    any PUBREC did not acknowledge it, and it goes to one other member (DUP), here on the other broker."""
    received, unreceived = pair.lite_of(1, "q"), pair.lite_of(0, "q")
    first = await Raw.connect(pair.port(0), "first")
    assert await first.subscribe(f"$share/q/{PARENT}/+", qos=2) == (2,)
    publisher = await Raw.connect(pair.port(1), "pub")
    await publisher.published2(f"{PARENT}/{received}", b"has it", packet_id=1)
    await publisher.published2(f"{PARENT}/{unreceived}", b"lost with the connection", packet_id=2)
    got = {p.topic: p for p in [await first.delivery(), await first.delivery()]}
    assert {t: (p.payload, p.qos) for t, p in got.items()} == {
        f"{PARENT}/{received}": (b"has it", 2),
        f"{PARENT}/{unreceived}": (b"lost with the connection", 2),
    }
    first.ack(got[f"{PARENT}/{received}"], codec.PUBREC)
    assert isinstance(pubrel := await first.next(), codec.PacketId) and pubrel.kind == codec.PUBREL
    second = await Raw.connect(pair.port(1), "second")
    assert await second.subscribe(f"$share/q/{PARENT}/+", qos=2) == (2,)
    first.kill()  # no PUBCOMP for the one, no PUBREC for the other
    group = shares.group_of("q", f"{PARENT}/+")
    await eventually(lambda: pair.offset(1, received, group) == 1, "the PUBREC'd delivery settled at its owner")
    again = await second.delivery()
    assert (again.topic, again.payload, again.qos, again.dup) == (
        f"{PARENT}/{unreceived}",
        b"lost with the connection",
        2,
        True,
    )
    second.ack(again, codec.PUBREC)
    assert await second.next() == codec.PacketId(codec.PUBREL, again.packet_id or 0, properties=Properties())
    second.ack(again, codec.PUBCOMP)
    await eventually(lambda: pair.offset(0, unreceived, group) == 1, "completed by the second member")
    assert await second.quiet() == []
    await second.close()
    await publisher.close()


async def test_mqtt5_4_8_2_a_new_share_starts_at_the_end_of_every_brokers_topics(pair: Cluster) -> None:
    """A share nobody reads starts at the end of its topics on every broker, as any new subscription (what they
    held was published before it): ``P/+`` reaches the default parent and ``P``, and the first part made at the
    other broker must not count as a member reading the second there."""
    mine, theirs = pair.lite_of(0, "b"), pair.lite_of(1, "b")
    publisher = await Raw.connect(pair.port(1), "pub")
    for n, lite in enumerate((mine, theirs)):
        await publisher.published(f"{PARENT}/{lite}", b"before the share", packet_id=n + 1)
    member = await Raw.connect(pair.port(0), "member")
    assert await member.subscribe(f"$share/g/{PARENT}/+") == (1,)
    await publisher.published(f"{PARENT}/{theirs}", b"after", packet_id=3)
    delivered = await member.delivery()
    assert (delivered.topic, delivered.payload) == (f"{PARENT}/{theirs}", b"after")
    member.ack(delivered)
    assert await member.quiet() == []
    await member.close()
    await publisher.close()


async def test_mqtt5_4_8_2_a_member_that_unsubscribes_leaves_the_share_on_every_broker(pair: Cluster) -> None:
    """UNSUBSCRIBE (section 3.10.4) of a share: the member ends there and at the other broker, so everything the
    share matches afterwards goes to the members left, whichever broker owns it."""
    leaving, staying = await Raw.connect(pair.port(0), "leaving"), await Raw.connect(pair.port(1), "staying")
    for member in (leaving, staying):
        assert await member.subscribe(f"$share/g/{PARENT}/+") == (1,)
    leaving.send(codec.Unsubscribe(2, (f"$share/g/{PARENT}/+",), properties=Properties()))
    unsuback = await leaving.next()
    assert isinstance(unsuback, codec.UnsubAck) and unsuback.codes == (0,), unsuback
    lites = await owned_by(pair, [0, 0, 1, 1])
    sent = await publish_everywhere(pair, lites, per_topic=3)
    got = (await collect([staying], len(sent)))[0]
    assert sorted((p.topic, p.payload) for p in got) == sorted(sent)
    assert await leaving.quiet() == []
    await leaving.close()
    await staying.close()


def owned_in(cluster: Cluster, parent: str, slot: int, prefix: str) -> str:
    """A lite topic of ``parent`` broker ``slot`` owns."""
    owned = (f"{prefix}-{i}" for i in range(10_000))
    return next(t for t in owned if mb.owner(cluster.membership, model.QueueId.lmq(parent, t).topic) == slot)


@pytest.mark.parametrize("topic_filter", ["#", "+/+", "NEW/#"])
async def test_mqtt5_4_8_2_a_share_made_before_its_parent_existed_reaches_it_at_every_broker(
    pair: Cluster, topic_filter: str
) -> None:
    """Section 4.8.2 with a parent made later (through broker 1's admin service, sent on to broker 0): members
    on both brokers, made before ``NEW`` existed, get its messages, each message once among them, whichever
    broker owns its topic."""
    members = [await Raw.connect(pair.port(slot), f"member-{slot}") for slot in (0, 1)]
    for member in members:
        assert await member.subscribe(f"$share/g/{topic_filter}") == (1,)
    with AdminClient(pair.brokers[1].endpoint, timeout_s=10, access_key="admin-ak", secret_key="admin-sk") as admin:
        await asyncio.to_thread(admin.put_parent_topic, model.ParentTopic("NEW", model.MessageType.LITE))
    lites = [owned_in(pair, "NEW", slot, f"n{k}") for slot in (0, 1) for k in range(2)]
    publisher = await Raw.connect(pair.port(1), "pub")
    sent = set()
    for n in range(3):
        for i, lite in enumerate(lites):
            await publisher.published(f"NEW/{lite}", f"{lite}-{n}".encode(), packet_id=n * len(lites) + i + 1)
            sent.add((f"NEW/{lite}", f"{lite}-{n}".encode()))
    for slot, lite in ((0, lites[0]), (1, lites[2])):  # kept by the new parent at its owner
        store = pair.brokers[slot].store
        assert store is not None and len(store.read(model.QueueId.lmq("NEW", lite), 0, 10)) == 3
    got = await collect(members, len(sent))
    for i, member in enumerate(members):
        got[i] += await member.quiet()
    assert sorted((p.topic, p.payload) for part in got for p in part) == sorted(sent), "each once, among them"
    await publisher.close()
    for member in members:
        await member.close()


@pytest.mark.parametrize("topic_filter", ["#", "long/#"])
async def test_mqtt5_4_8_2_a_hashed_topic_another_broker_owns_reaches_one_share_member(
    pair: Cluster, topic_filter: str
) -> None:
    """A topic kept under a hashed name in the default parent (over the lite-name limit escaped) that the other
    broker owns: the share's members here take it from there (their parts there hold the hashed names' filter
    too), each message once among them."""
    default = pair.brokers[0].config.mqtt_default_parent
    topic = next(
        t
        for t in (f"long/{'x' * 70}/{i}" for i in range(10_000))
        if mb.owner(pair.membership, model.QueueId.lmq(default, topics.default_lite(t)).topic) == 1
    )
    assert topics.is_hashed(topics.default_lite(topic))
    members = [await Raw.connect(pair.port(0), f"member-{k}") for k in range(2)]
    for member in members:
        assert await member.subscribe(f"$share/h/{topic_filter}") == (1,)
    publisher = await Raw.connect(pair.port(1), "pub")  # through the owner's MQTT
    for n in range(4):
        await publisher.published(topic, b"hashed %d" % n, packet_id=n + 1)
    got = await collect(members, 4)
    for i, member in enumerate(members):
        got[i] += await member.quiet()
    assert sorted((p.topic, p.payload) for part in got for p in part) == [(topic, b"hashed %d" % n) for n in range(4)]
    await publisher.close()
    for member in members:
        await member.close()
