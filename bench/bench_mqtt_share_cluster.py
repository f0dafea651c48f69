"""A shared subscription across the brokers of a cluster against one subscriber reading every broker, in the
same run: how fast ``--count`` QoS 1 messages, published through both brokers to topics both own, reach

* ``plain``: one MQTT 5.0 session on broker 0 subscribed to ``P/+`` (it pulls broker 1's topics from there);
* ``share``: two members of ``$share/g/P/+``, one on each broker (each leases from both owners).

Two whole brokers (``app.Broker``, real ports and stores) in this process, raw MQTT through the codec; the
members acknowledge each delivery as it comes. Figures: messages per second from the first publish to the last
delivery, for each, and share ÷ plain; each message is checked to arrive once.

    python bench/bench_mqtt_share_cluster.py            # 2,000 messages over 16 topics
    python bench/bench_mqtt_share_cluster.py --quick    # 300
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from lmq_broker import app, model
from lmq_broker.cluster import membership as mb
from lmq_broker.dispatch import testing as dispatch_testing
from lmq_broker.mqtt import codec
from lmq_broker.mqtt.properties import Properties
from lmq_broker.storage import store as lmq_store
from lmq_broker.supervisor import free_ports

PARENT = "P"
TOPICS = 16


def figure(name: str, value: float, unit: str) -> None:
    print(f"FIGURE {name}: {value:,.2f} {unit}", flush=True)


class Raw:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = codec.Decoder(level=codec.LEVEL_5)
        self.pending: list[codec.Packet] = []

    @classmethod
    async def connect(cls, port: int, client_id: str) -> Raw:
        raw = cls(*await asyncio.open_connection("127.0.0.1", port))
        raw.send(codec.Connect(client_id, True, keep_alive_s=60, level=codec.LEVEL_5, properties=Properties()))
        assert isinstance(await raw.next(), codec.ConnAck)
        return raw

    def send(self, packet: codec.Packet) -> None:
        self.writer.write(codec.encode(packet))

    async def next(self) -> codec.Packet:
        async with asyncio.timeout(60):
            while not self.pending:
                data = await self.reader.read(1 << 16)
                if not data:
                    raise ConnectionError("closed")
                self.pending += self.decoder.feed(data)
        return self.pending.pop(0)

    async def close(self) -> None:
        self.writer.close()


async def start(tmp: Path) -> list[app.Broker]:
    ports = free_ports("127.0.0.1", 2)
    members = ",".join(f"127.0.0.1:{p}" for p in ports)
    brokers = []
    for slot, port in enumerate(ports):
        config = dispatch_testing.config_for(
            tmp / f"b{slot}", host="127.0.0.1", port=port, metrics_port=-1, mqtt_port=0, peers=members,
            ordinal=slot, admin_access_key="admin-ak", admin_secret_key="admin-sk",
        )  # fmt: skip
        store = lmq_store.open_store(config.store)
        store.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
        broker = app.Broker(config, store=store)
        await broker.start()
        brokers.append(broker)
    return brokers


def topics_of(brokers: Sequence[app.Broker], round_: str) -> list[str]:
    membership = mb.Membership.parse(brokers[0].config.peers)
    names = (f"{round_}-{i}" for i in range(100_000))
    by_slot: dict[int, list[str]] = {0: [], 1: []}
    for name in names:
        slot = mb.owner(membership, model.QueueId.lmq(PARENT, name).topic)
        if len(by_slot[slot]) < TOPICS // 2:
            by_slot[slot].append(name)
        if all(len(v) == TOPICS // 2 for v in by_slot.values()):
            return [f"{PARENT}/{n}" for v in by_slot.values() for n in v]
    raise AssertionError("unreachable")


async def read_all(readers: Sequence[Raw], count: int) -> list[tuple[str, bytes]]:
    got: list[tuple[str, bytes]] = []
    done = asyncio.Event()

    async def read(raw: Raw) -> None:
        while not done.is_set():
            packet = await raw.next()
            if isinstance(packet, codec.Publish):
                assert packet.packet_id is not None
                raw.send(codec.PacketId(codec.PUBACK, packet.packet_id))
                got.append((packet.topic, packet.payload))
                if len(got) >= count:
                    done.set()

    tasks = [asyncio.ensure_future(read(r)) for r in readers]
    await done.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return got


async def publish_all(brokers: Sequence[app.Broker], topics: list[str], count: int, tag: str) -> set[tuple[str, bytes]]:
    publishers = [await Raw.connect(b.mqtt_port, f"pub-{tag}-{i}") for i, b in enumerate(brokers)]
    sent = set()
    window = 50
    for start in range(0, count, window):  # pipelined, 50 unacknowledged at a time per publisher pair
        batch = range(start, min(count, start + window))
        for n in batch:
            topic, payload = topics[n % len(topics)], f"{tag}-{n}".encode()
            publishers[n % 2].send(codec.Publish(topic, payload, 1, packet_id=n % 60000 + 1, properties=Properties()))
            sent.add((topic, payload))
        for n in batch:
            ack = await publishers[n % 2].next()
            assert isinstance(ack, codec.PacketId) and ack.kind == codec.PUBACK, ack
    for publisher in publishers:
        await publisher.close()
    return sent


async def one(brokers: Sequence[app.Broker], mode: str, count: int) -> float:
    topics = topics_of(brokers, mode)
    if mode == "plain":
        readers = [await Raw.connect(brokers[0].mqtt_port, "plain")]
        filters = [f"{PARENT}/+"]
    else:
        readers = [await Raw.connect(b.mqtt_port, f"member-{i}") for i, b in enumerate(brokers)]
        filters = [f"$share/g/{PARENT}/+"] * 2
    for raw, topic_filter in zip(readers, filters, strict=True):
        raw.send(codec.Subscribe(1, ((topic_filter, 1),), properties=Properties()))
        assert isinstance(await raw.next(), codec.SubAck)
    began = time.perf_counter()
    receiving = asyncio.ensure_future(read_all(readers, count))
    sent = await publish_all(brokers, topics, count, mode)
    got = await receiving
    took = time.perf_counter() - began
    assert sorted(got) == sorted(sent), f"{mode}: {len(got)} delivered, {len(set(got) & sent)} of {len(sent)} sent"
    for raw in readers:
        await raw.close()
    return count / took


async def main(count: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        brokers = await start(Path(tmp))
        try:
            plain = await one(brokers, "plain", count)
            share = await one(brokers, "share", count)
        finally:
            for broker in brokers:
                await broker.stop(grace_s=0.2)
    figure("plain subscriber across 2 brokers", plain, "msg/s")
    figure("share, a member on each of 2 brokers", share, "msg/s")
    figure("share ÷ plain", share / plain, "")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    asyncio.run(main(300 if args.quick else args.count))
