"""Delivery attempts across kill -9, with real parts: a broker process on a data dir, raw v2 calls over gRPC
(our own stubs, as a LiteSimpleConsumer makes them), SIGKILL and a restart on the same data dir.

What the broker persisted is read from its meta RocksDB, opened read-only beside the running broker, so the
kill comes once the background hand-out write is in (``settlement.HANDOUT_WRITE_DELAY_MS`` after the receive).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from waiting import eventually

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as sg
from lmq_broker.storage import keys, rocks
from lmq_broker.testing import BrokerProcess, start_broker

PARENT, GROUP, LITE = "ATTEMPTS", "attempts-group", "job-1"
HEADERS = (("x-mq-client-id", "attempts-consumer"), ("x-mq-language", "JAVA"), ("x-mq-client-version", "5.0.8"))
READER = (("x-mq-client-id", "dlq-reader"), *HEADERS[1:])  # a client belongs to one group


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[list[BrokerProcess]]:
    """The broker in a one-item list: each restart replaces it."""
    running = [start_broker(tmp_path / "data", extra_args=["--no-bootstrap"])]
    with AdminClient(running[0].admin_endpoint, timeout_s=10, **running[0].admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
        retry = model.RetryPolicy(max_attempts=3, backoff_ms=(1000,))
        admin.put_group(model.LiteGroup(GROUP, PARENT, retry=retry))
    yield running
    running[0].stop()


def handouts_on_disk(data_dir: Path) -> model.Handouts:
    """What the meta store holds of the group's hand-outs in the lite topic (read-only, beside the broker)."""
    db = rocks.Rocks(data_dir / "meta", 1 << 20, read_only=True)
    try:
        qkey = keys.parse_queue(keys.lmq_topic(PARENT, LITE), 0).qkey
        value = db.get(keys.acked_key(qkey, GROUP))
        return model.NO_HANDOUTS if value is None else keys.decode_progress(value)[2]
    finally:
        db.close()


def wait_on_disk(data_dir: Path, want: model.Handouts) -> None:
    eventually(lambda: handouts_on_disk(data_dir) == want, f"the meta store holds {want}")


async def send(stub: sg.MessagingServiceAsyncStub, body: bytes) -> None:
    props = pb.SystemProperties(message_id=f"m-{body.decode()}", message_type=pb.LITE, lite_topic=LITE)
    message = pb.Message(topic=pb.Resource(name=PARENT), body=body, system_properties=props)
    reply = await stub.SendMessage(spb.SendMessageRequest(messages=[message]), metadata=HEADERS)
    assert reply.status.code == pb.OK, reply.status


async def receive(
    stub: sg.MessagingServiceAsyncStub, topic: str = PARENT, group: str = GROUP, poll_ms: int = 3000
) -> list[pb.Message]:
    if topic == PARENT:  # the subscription is memory only: after a kill the client syncs again
        sync = spb.SyncLiteSubscriptionRequest(
            action=pb.PARTIAL_ADD, topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP), lite_topic_set=[LITE]
        )
        assert (await stub.SyncLiteSubscription(sync, metadata=HEADERS)).status.code == pb.OK
    request = spb.ReceiveMessageRequest(
        group=pb.Resource(name=group), message_queue=pb.MessageQueue(topic=pb.Resource(name=topic)), batch_size=8
    )
    request.invisible_duration.seconds = 600  # nothing comes back by lease expiry within the test
    request.long_polling_timeout.FromMilliseconds(poll_ms)
    headers = HEADERS if group == GROUP else READER
    frames = [f async for f in stub.ReceiveMessage(request, metadata=headers, timeout=poll_ms / 1000 + 10)]
    return [f.message for f in frames if f.HasField("message")]


async def one_round(endpoint: str, *, first: bool) -> list[pb.Message]:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = sg.MessagingServiceStub(channel)
        if first:
            await send(stub, b"poison")
        got = await receive(stub)
        if not got:
            with contextlib.suppress(grpc.aio.AioRpcError):
                got = await receive(stub, poll_ms=500)  # a receive that dead-lettered comes back empty once
        return got


def test_an_unacked_message_comes_back_after_each_sigkill_with_its_next_attempt_then_goes_to_the_dlq(
    broker: list[BrokerProcess], tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    for attempt in (1, 2, 3):  # the group allows 3 attempts
        (message,) = asyncio.run(one_round(broker[0].endpoint, first=attempt == 1))
        assert (message.body, message.system_properties.delivery_attempt) == (b"poison", attempt)
        wait_on_disk(data_dir, model.Handouts(1, () if attempt == 1 else ((0, attempt),)))
        broker[0].kill()
        broker[0] = broker[0].restart()

    async def after_the_last_attempt(endpoint: str) -> tuple[list[pb.Message], list[pb.Message]]:
        async with grpc.aio.insecure_channel(endpoint) as channel:
            stub = sg.MessagingServiceStub(channel)
            lite = await receive(stub, poll_ms=1000)
            dead = await receive(stub, topic=f"%DLQ%{GROUP}", group="dlq-reader")
            return lite, dead

    lite, dead = asyncio.run(after_the_last_attempt(broker[0].endpoint))
    assert lite == []  # a 4th attempt would pass the group's 3: dead-lettered instead
    assert [m.body for m in dead] == [b"poison"]
    assert dead[0].user_properties["__ORIGIN_LITE_TOPIC"] == LITE
    wait_on_disk(data_dir, model.NO_HANDOUTS)  # settled: the commit point passed it
