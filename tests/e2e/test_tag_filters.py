"""Tag filters with the official client (issue 16 item 3): a PushConsumer subscribed with a TAG expression
receives only the messages its expression takes, and a SQL92 subscription is answered UNSUPPORTED with a
message that says why (the client raises it from ``receive``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from rocketmq import ClientConfiguration, Credentials, FilterExpression, Message, Producer, PushConsumer, SimpleConsumer
from rocketmq.grpc_protocol import FilterType
from rocketmq.v5.exception import UnsupportedException

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.testing import BrokerProcess, Inbox

TAGS = ["created", "paid", "shipped", None]


def config(broker: BrokerProcess) -> Any:
    return ClientConfiguration(broker.endpoint, Credentials(), request_timeout=5)


def normal_topic(admin: AdminClient, name: str, queues: int) -> str:
    admin.put_parent_topic(model.ParentTopic(name, model.MessageType.NORMAL, queue_count=queues))
    return name


def barriers(producer: Any, topic: str, tag: str, count: int) -> list[bytes]:
    """``count`` messages with ``tag`` (one the consumers take), sent after everything they must not get: the
    producer's round robin puts them on every queue, where a message filtered out before them is passed first."""
    bodies = [f"barrier-{n}".encode() for n in range(count)]
    for body in bodies:
        m = Message()
        m.topic, m.body, m.tag = topic, body, tag
        producer.send(m)
    return bodies


def test_a_push_consumer_with_a_tag_expression_receives_only_matching_messages(
    broker: BrokerProcess, admin: AdminClient, clients: list[Any], unique: Callable[[str], str]
) -> None:
    topic = normal_topic(admin, unique("orders"), 2)
    inbox = Inbox()
    consumer = PushConsumer(config(broker), unique("billing"), inbox, {topic: FilterExpression("created || paid")})
    consumer.startup()
    clients.append(consumer)
    producer = Producer(config(broker), (topic,))
    producer.startup()
    clients.append(producer)
    wanted = []
    for n in range(40):
        m = Message()
        m.topic = topic
        m.body = f"order-{n}".encode()
        tag = TAGS[n % len(TAGS)]
        if tag is not None:
            m.tag = tag
        if tag in ("created", "paid"):
            wanted.append(m.body)
        producer.send(m)
    assert inbox.wait_for(lambda i: len(i.accepted) >= len(wanted), 30), len(inbox.accepted)
    wanted += barriers(producer, topic, "paid", 4)  # two per queue
    assert inbox.wait_for(lambda i: len(i.accepted) >= len(wanted), 30), len(inbox.accepted)
    assert sorted(inbox.bodies()) == sorted(wanted)
    assert {m.tag for m in inbox.accepted} == {"created", "paid"}


def test_a_single_tag_and_star_on_one_topic_in_two_groups(
    broker: BrokerProcess, admin: AdminClient, clients: list[Any], unique: Callable[[str], str]
) -> None:
    topic = normal_topic(admin, unique("events"), 1)
    shipped, everything = Inbox(), Inbox()
    for group, inbox, expression in [("shipping", shipped, "shipped"), ("audit", everything, "*")]:
        consumer = PushConsumer(config(broker), unique(group), inbox, {topic: FilterExpression(expression)})
        consumer.startup()
        clients.append(consumer)
    producer = Producer(config(broker), (topic,))
    producer.startup()
    clients.append(producer)
    for n, tag in enumerate(TAGS * 3):
        m = Message()
        m.topic = topic
        m.body = f"e-{n}".encode()
        if tag is not None:
            m.tag = tag
        producer.send(m)
    assert everything.wait_for(lambda i: len(i.accepted) >= 12, 30), len(everything.accepted)
    assert shipped.wait_for(lambda i: len(i.accepted) >= 3, 30), len(shipped.accepted)
    (last,) = barriers(producer, topic, "shipped", 1)  # one queue: both groups get it after all the others
    assert everything.wait_for(lambda i: last in [m.body for m in i.accepted], 30), len(everything.accepted)
    assert shipped.wait_for(lambda i: last in [m.body for m in i.accepted], 30), len(shipped.accepted)
    assert len(everything.accepted) == 13
    assert sorted(shipped.bodies()) == [b"barrier-0", b"e-10", b"e-2", b"e-6"]


def test_a_sql92_subscription_is_answered_unsupported(
    broker: BrokerProcess, admin: AdminClient, clients: list[Any], unique: Callable[[str], str]
) -> None:
    topic = normal_topic(admin, unique("jobs"), 1)
    sql = FilterExpression("amount > 10", FilterType.SQL)
    consumer = SimpleConsumer(config(broker), unique("sql-readers"), {topic: sql}, await_duration=2)
    consumer.startup()
    clients.append(consumer)
    with pytest.raises(UnsupportedException, match="SQL92"):
        consumer.receive(8, 15)
