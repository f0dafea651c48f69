"""MQTT 3.1.1 / 5.0 section 3.8.4: a subscription is in place by the time its SUBACK is sent. An in-process
broker, so that a publish can be made to land exactly inside the making of a subscription (deterministic, not
a timing lottery); real sockets and a real store."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Final

import pytest
import pytest_asyncio

from lmq_broker import app, model
from lmq_broker.dispatch import offsets
from lmq_broker.dispatch import testing as dispatch_testing
from lmq_broker.mqtt import codec
from lmq_broker.storage import store as lmq_store

pytestmark = pytest.mark.asyncio
PARENT: Final = "race"
WAIT_S: Final = 10.0


@pytest_asyncio.fixture
async def broker(tmp_path: Path) -> AsyncIterator[app.Broker]:
    config = dispatch_testing.config_for(tmp_path / "b", host="127.0.0.1", port=0, metrics_port=-1, mqtt_port=0)
    store = lmq_store.open_store(config.store)
    store.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
    started = app.Broker(config, store=store)
    await started.start()
    yield started
    await started.stop(grace_s=0.2)


class Client:
    """A 3.1.1 client on a socket, packets from our codec."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = codec.Decoder()
        self.pending: list[codec.Packet] = []

    @classmethod
    async def connect(cls, port: int, client_id: str) -> Client:
        client = cls(*await asyncio.open_connection("127.0.0.1", port))
        client.writer.write(codec.encode(codec.Connect(client_id, True, 60)))
        assert isinstance(await client.next(), codec.ConnAck)
        return client

    async def next(self) -> codec.Packet:
        async with asyncio.timeout(WAIT_S):
            while not self.pending:
                data = await self.reader.read(65536)
                assert data, "closed by the broker"
                self.pending += self.decoder.feed(data)
        return self.pending.pop(0)

    async def published(self, topic: str, payload: bytes, packet_id: int) -> None:
        self.writer.write(codec.encode(codec.Publish(topic, payload, 1, packet_id=packet_id)))
        ack = await self.next()
        assert isinstance(ack, codec.PacketId) and ack.packet_id == packet_id, ack

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


async def test_mqtt_3_8_4_a_publish_during_the_subscribe_and_after_the_suback_is_delivered(
    broker: app.Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3.8.4: "the Server MUST ... start sending PUBLISH packets matching the new Subscription" once it sends
    the SUBACK. The topic holds messages (a new subscription skips them: MQTT delivers what is published after
    it, plus retained); a publish stored while the subscription is being made (after the broker read the
    topic's end, before it moved the session's start there) is delivered, and so is one after the SUBACK. The
    old code moved the start to the end as it was at that moment: the publish in between was skipped."""
    dispatcher = broker.dispatcher
    assert dispatcher is not None
    pub = await Client.connect(broker.mqtt_port, "publisher")
    sub = await Client.connect(broker.mqtt_port, "subscriber")
    topic = f"{PARENT}/room/1"
    await pub.published(topic, b"before", 1)
    reset = dispatcher.reset_offsets

    async def publish_first(
        group: str,
        parent: str,
        lites: Sequence[str],
        option: offsets.OffsetReset,
        ends: Sequence[int] | None = None,
        **options: bool,
    ) -> None:
        await pub.published(topic, b"during", 2)  # the race, made to happen every time
        await reset(group, parent, lites, option, ends, **options)

    monkeypatch.setattr(dispatcher, "reset_offsets", publish_first)
    sub.writer.write(codec.encode(codec.Subscribe(1, ((topic, 1),))))
    assert isinstance(await sub.next(), codec.SubAck)
    monkeypatch.undo()
    await pub.published(topic, b"after", 3)
    got = []
    for _ in range(2):
        packet = await sub.next()
        assert isinstance(packet, codec.Publish), packet
        got.append(packet.payload)
        assert packet.packet_id is not None
        sub.writer.write(codec.encode(codec.PacketId(codec.PUBACK, packet.packet_id)))
    assert got == [b"during", b"after"]  # not "before": stored before the subscription
    await pub.close()
    await sub.close()
