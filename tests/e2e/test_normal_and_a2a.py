"""NORMAL topics with PushConsumer/SimpleConsumer, and an A2A request/reply over rocketmq-a2a (requests as
NORMAL messages, replies as LITE messages), all with the official client against a broker process."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from rocketmq import ClientConfiguration, Credentials, FilterExpression, Message, Producer, PushConsumer, SimpleConsumer
from rocketmq_a2a.common import rocketmq_util
from rocketmq_a2a.server.echo_executor import DefaultEchoAgentExecutor
from rocketmq_a2a.server.request_handler import StandaloneRequestHandler
from rocketmq_a2a.server.rocketmq_agent_server import AgentServerConfig, RocketMQAgentServer

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.testing import BrokerProcess, Inbox, receive_some

NAMESPACE = "a2a"  # rocketmq-a2a needs one; lmq keeps one name space and echoes the namespace field


@pytest.fixture
def normal_topic(admin: AdminClient, unique: Callable[[str], str]) -> Callable[[str, int], str]:
    """Create a NORMAL topic through the admin service of the running broker; returns its name."""

    def create(prefix: str, queues: int) -> str:
        name = unique(prefix)
        put = admin.put_parent_topic(model.ParentTopic(name, model.MessageType.NORMAL, queue_count=queues))
        assert put.created and put.value.queue_count == queues
        return name

    return create


def config(broker: BrokerProcess) -> Any:
    return ClientConfiguration(broker.endpoint, Credentials(), request_timeout=5)


def test_push_consumer_on_a_normal_topic(
    broker: BrokerProcess,
    normal_topic: Callable[[str, int], str],
    clients: list[Any],
    unique: Callable[[str], str],
) -> None:
    topic = normal_topic("orders", 2)  # two queues: the consumer must read both
    inbox = Inbox()
    consumer = PushConsumer(config(broker), unique("order-readers"), inbox, {topic: FilterExpression()})
    consumer.startup()
    clients.append(consumer)
    producer = Producer(config(broker), (topic,))
    producer.startup()
    clients.append(producer)
    for n in range(20):
        m = Message()
        m.topic = topic
        m.body = f"order-{n}".encode()
        m.tag = "created"
        producer.send(m)
    assert inbox.wait_for(lambda i: len(i.accepted) >= 20, 30), len(inbox.accepted)
    assert sorted(inbox.bodies()) == sorted(f"order-{n}".encode() for n in range(20))
    assert {m.tag for m in inbox.accepted} == {"created"}


def test_simple_consumer_on_a_normal_topic(
    broker: BrokerProcess,
    normal_topic: Callable[[str, int], str],
    clients: list[Any],
    unique: Callable[[str], str],
) -> None:
    topic = normal_topic("jobs", 1)
    consumer = SimpleConsumer(config(broker), unique("job-takers"), {topic: FilterExpression()}, await_duration=5)
    consumer.startup()
    clients.append(consumer)
    producer = Producer(config(broker), (topic,))
    producer.startup()
    clients.append(producer)
    m = Message()
    m.topic = topic
    m.body = b"job"
    producer.send(m)
    (job,) = receive_some(consumer, 8)
    assert job.body == b"job" and job.delivery_attempt == 1
    consumer.ack(job)
    assert consumer.receive(8, 15) == []


def test_a2a_request_reply_round_trip(
    broker: BrokerProcess,
    admin: AdminClient,
    normal_topic: Callable[[str, int], str],
    unique: Callable[[str], str],
) -> None:
    biz_topic = normal_topic("WeatherAgentTask", 1)
    reply_topic, reply_group = unique("WorkerAgentResponse"), unique("CID_HOST_AGENT_LITE")
    server_topic, server_group = unique("WorkerAgentResponseServer"), unique("CID_HOST_AGENT_LITE_SERVER")
    for topic, group in ((reply_topic, reply_group), (server_topic, server_group)):
        admin.put_parent_topic(model.ParentTopic(topic, model.MessageType.LITE))
        admin.put_group(model.LiteGroup(group, topic))
    agent = RocketMQAgentServer(
        AgentServerConfig(
            biz_topic=biz_topic,
            biz_consumer_group=unique("WeatherAgentTaskConsumerGroup"),
            work_agent_response_topic=server_topic,
            work_agent_response_group_id=server_group,
            agent_name="weather",
        ),
        StandaloneRequestHandler(executor=DefaultEchoAgentExecutor()),
        broker.endpoint,
        "",
        "",
        NAMESPACE,
    )
    agent.start()
    producer = consumer = None
    try:
        lite_topic = uuid.uuid4().hex
        producer = rocketmq_util.get_or_create_producer(NAMESPACE, broker.endpoint, "", "", biz_topic)
        consumer = rocketmq_util.get_or_create_lite_push_consumer(
            NAMESPACE, broker.endpoint, "", "", reply_topic, reply_group, lite_topic
        )
        request = {
            "jsonrpc": "2.0",
            "id": "1",
            "method": "message/send",
            "params": {"message": {"role": "user", "parts": [{"type": "text", "text": "weather in Hangzhou?"}]}},
        }
        request_id = rocketmq_util._next_request_id()
        rocketmq_util.register_response_waiter(NAMESPACE, request_id)
        rocketmq_util.send_rocketmq_request(
            request_body=request,
            agent_topic=biz_topic,
            lite_topic=lite_topic,
            work_agent_response_topic=reply_topic,
            producer=producer,
            request_id=request_id,
        )
        reply = json.loads(rocketmq_util.get_result(request_id, NAMESPACE, timeout_seconds=30))
        text = json.dumps(reply)
        assert "Echo: weather in Hangzhou?" in text, text
    finally:
        agent.stop()
        if consumer is not None:
            rocketmq_util.remove_cached_lite_push_consumer(NAMESPACE, reply_topic, consumer)
            consumer.shutdown()
        if producer is not None:
            rocketmq_util.remove_cached_producer(NAMESPACE, biz_topic, producer)
            producer.shutdown()


def test_acks_after_an_unacked_message_survive_a_crash(tmp_path: Any, clients: list[Any]) -> None:
    """Issue 12 item 6: 49 of 50 received messages acked, the first one not; SIGKILL; after the restart the
    group gets only the one it did not acknowledge (before: all 50 came back)."""
    from lmq_broker.testing import start_broker  # noqa: PLC0415

    broker = start_broker(tmp_path / "data")
    try:
        with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
            admin.put_parent_topic(model.ParentTopic("ledger", model.MessageType.NORMAL, queue_count=1))
        producer = Producer(config(broker), ("ledger",))
        producer.startup()
        clients.append(producer)
        for n in range(50):
            m = Message()
            m.topic = "ledger"
            m.body = f"entry-{n}".encode()
            producer.send(m)
        consumer = SimpleConsumer(config(broker), "auditors", {"ledger": FilterExpression()}, await_duration=5)
        consumer.startup()
        clients.append(consumer)
        got: list[Any] = []
        while len(got) < 50:
            batch = receive_some(consumer, 32)
            assert batch, f"only {len(got)} of 50 received"
            got += batch
        assert sorted(m.body for m in got) == sorted(f"entry-{n}".encode() for n in range(50))
        unacked = next(m for m in got if m.body == b"entry-0")
        for m in got:
            if m is not unacked:
                consumer.ack(m)
        for client in reversed(clients):
            client.shutdown()
        clients.clear()
        broker.kill()
        broker = broker.restart()
        again = SimpleConsumer(config(broker), "auditors", {"ledger": FilterExpression()}, await_duration=5)
        again.startup()
        clients.append(again)
        (redelivered,) = receive_some(again, 32, timeout_s=30)
        assert redelivered.body == b"entry-0"
        again.ack(redelivered)
        assert again.receive(32, 5) == []
    finally:
        for client in reversed(clients):
            client.shutdown()
        clients.clear()
        broker.stop()
