"""Receipt handles with the official Python client: a handle is good while its delivery is the message's current
one and its invisible time has not run out, as RocketMQ 5.x's proxy answers (docs/protocol.md, *Receipt
handles*). A slow consumer whose invisible time ran out can neither ack nor change the invisible time of the
message another consumer received again (INVALID_RECEIPT_HANDLE, BadRequestException in the client), and an
expired handle is refused even before the message went out again: the message is delivered again, not lost."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from rocketmq import ClientConfiguration, Credentials, FilterExpression, Message, Producer, SimpleConsumer
from rocketmq.v5.exception import BadRequestException

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.testing import BrokerProcess

INVISIBLE_S = 2  # the first consumer's invisible time: short, so that it runs out within the test


def config(broker: BrokerProcess) -> Any:
    return ClientConfiguration(broker.endpoint, Credentials(), request_timeout=5)


def one_message(broker: BrokerProcess, admin: AdminClient, clients: list[Any], topic: str, body: bytes) -> None:
    """A NORMAL topic of one queue holding one message."""
    admin.put_parent_topic(model.ParentTopic(topic, model.MessageType.NORMAL, queue_count=1))
    producer = Producer(config(broker), (topic,))
    producer.startup()
    clients.append(producer)
    m = Message()
    m.topic, m.body = topic, body
    producer.send(m)


def consumer(broker: BrokerProcess, clients: list[Any], group: str, topic: str) -> Any:
    c = SimpleConsumer(config(broker), group, {topic: FilterExpression()}, await_duration=2)
    c.startup()
    clients.append(c)
    return c


def past_invisible_time(received_at: float) -> None:
    """Let the invisible time of a delivery received at ``received_at`` (monotonic) run out, with a margin."""
    time.sleep(max(0.0, received_at + INVISIBLE_S + 0.5 - time.monotonic()))


def test_a_slow_consumer_cannot_settle_the_delivery_another_consumer_received_after_it(
    broker: BrokerProcess, admin: AdminClient, clients: list[Any], unique: Callable[[str], str]
) -> None:
    topic, group = unique("jobs"), unique("workers")
    one_message(broker, admin, clients, topic, b"job")
    slow, quick = consumer(broker, clients, group, topic), consumer(broker, clients, group, topic)
    (first,) = _receive(slow, INVISIBLE_S)
    again = _receive(quick, 30, timeout_s=30)[0]  # once the slow one's invisible time ran out
    assert again.message_id == first.message_id and again.delivery_attempt == 2
    with pytest.raises(BadRequestException, match="no longer the current lease"):
        slow.ack(first)  # before 2026-11-30: answered OK, and it settled the quick consumer's delivery
    with pytest.raises(BadRequestException, match="no longer the current lease"):
        slow.change_invisible_duration(first, 1)
    assert slow.receive(1, INVISIBLE_S) == []  # the quick consumer's delivery is still out: nothing came back
    quick.ack(again)
    assert slow.receive(1, INVISIBLE_S) == []


def test_an_expired_handle_is_refused_and_the_message_comes_again(
    broker: BrokerProcess, admin: AdminClient, clients: list[Any], unique: Callable[[str], str]
) -> None:
    topic, group = unique("jobs"), unique("workers")
    one_message(broker, admin, clients, topic, b"job")
    only = consumer(broker, clients, group, topic)
    received_at = time.monotonic()
    (first,) = _receive(only, INVISIBLE_S)
    past_invisible_time(received_at)
    with pytest.raises(BadRequestException, match="expired"):
        only.ack(first)  # not received again yet: refused all the same, as RocketMQ's proxy refuses it
    (again,) = _receive(only, 30)
    assert again.message_id == first.message_id and again.delivery_attempt == 2
    only.ack(again)
    assert only.receive(1, INVISIBLE_S) == []


def _receive(c: Any, invisible_s: int, timeout_s: float = 20.0) -> list[Any]:
    """One message (the topic's only one) with ``invisible_s``, received as soon as it is visible."""
    got: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while not got and time.monotonic() < deadline:
        got = c.receive(1, invisible_s)
    assert len(got) == 1, got
    return got
