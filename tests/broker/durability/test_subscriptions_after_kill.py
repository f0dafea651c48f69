"""Lite subscriptions survive SIGKILL (issue 25 item 4, where the killed owner was also the clients' access
broker, so no other broker kept their intents): the running broker writes them to its data dir whenever they
change (``--subscriptions-save-interval-ms``), and the restarted broker delivers a waiting message to the
subscribed client without any call from it but its receive."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
from waiting import eventually

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.dispatch import saved_subscriptions
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as sg
from lmq_broker.testing import BrokerProcess, start_broker

PARENT, GROUP, CLIENT = "SAVED", "saved-group", "saved-consumer"
HEADERS = (("x-mq-client-id", CLIENT), ("x-mq-language", "JAVA"), ("x-mq-client-version", "5.0.8"))


def subscriptions_of(broker: BrokerProcess) -> int:
    with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
        return sum(c.subscription_count for c in admin.list_clients(GROUP))


async def subscribe(endpoint: str, lites: list[str]) -> None:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = sg.MessagingServiceStub(channel)
        sync = spb.SyncLiteSubscriptionRequest(
            action=pb.PARTIAL_ADD, topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP), lite_topic_set=lites
        )
        assert (await stub.SyncLiteSubscription(sync, metadata=HEADERS)).status.code == pb.OK


async def send_then_receive(endpoint: str, lite: str) -> list[bytes]:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = sg.MessagingServiceStub(channel)
        props = pb.SystemProperties(message_id=f"m-{lite}", message_type=pb.LITE, lite_topic=lite)
        message = pb.Message(topic=pb.Resource(name=PARENT), body=lite.encode(), system_properties=props)
        reply = await stub.SendMessage(spb.SendMessageRequest(messages=[message]), metadata=HEADERS)
        assert reply.status.code == pb.OK, reply.status
        request = spb.ReceiveMessageRequest(
            group=pb.Resource(name=GROUP), message_queue=pb.MessageQueue(topic=pb.Resource(name=PARENT)), batch_size=8
        )
        request.invisible_duration.seconds = 60
        request.long_polling_timeout.FromMilliseconds(5000)
        frames = [f async for f in stub.ReceiveMessage(request, metadata=HEADERS, timeout=15)]
        return [f.message.body for f in frames if f.HasField("message")]


def test_subscriptions_come_back_after_sigkill_without_the_client_syncing(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    broker = start_broker(data_dir, extra_args=["--no-bootstrap", "--subscriptions-save-interval-ms", "200"])
    try:
        with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
            admin.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
            admin.put_group(model.LiteGroup(GROUP, PARENT))
        lites = [f"session-{i}" for i in range(20)]
        asyncio.run(subscribe(broker.endpoint, lites))
        saved = data_dir / saved_subscriptions.FILE_NAME
        eventually(
            lambda: any(r.client_id == CLIENT for r in saved_subscriptions.load(saved)),
            "the running broker wrote the subscriptions",
        )
        broker.kill()
        broker = broker.restart()
        assert subscriptions_of(broker) == 20  # at readiness, before any call of the client
        assert asyncio.run(send_then_receive(broker.endpoint, "session-7")) == [b"session-7"]
    finally:
        broker.stop()


def test_with_saving_off_a_sigkill_loses_them_until_the_client_syncs(tmp_path: Path) -> None:
    """The control: what the save buys (0 restored subscriptions without it)."""
    data_dir = tmp_path / "data"
    broker = start_broker(data_dir, extra_args=["--no-bootstrap", "--subscriptions-save-interval-ms", "0"])
    try:
        with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
            admin.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
            admin.put_group(model.LiteGroup(GROUP, PARENT))
        asyncio.run(subscribe(broker.endpoint, ["session-0"]))
        assert subscriptions_of(broker) == 1
        broker.kill()
        broker = broker.restart()
        assert subscriptions_of(broker) == 0
    finally:
        broker.stop()
