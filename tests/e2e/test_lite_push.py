"""LitePushConsumer and Producer (official client 5.1.2) against a real broker process."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from rocketmq import (
    FilterExpression,
    LiteSimpleConsumer,
    SimpleConsumer,
)
from rocketmq.v5.exception import (
    BadRequestException,
    LiteSubscriptionQuotaExceededException,
    LiteTopicQuotaExceededException,
)
from waiting import eventually

from lmq_broker import model, testing
from lmq_broker.admin.client import AdminClient
from lmq_broker.testing import BrokerProcess, Inbox, receive_some, start_broker, start_lite_simple_consumer

config = testing.client_config
producer = testing.started_producer
consumer = testing.started_lite_consumer
send = testing.send_lite


@pytest.fixture(scope="module", params=["grpcio", "native"])
def edge(request: pytest.FixtureRequest) -> str:
    """Every case with the module's broker runs on both edges (docs/design/native-edge.md): the native one must
    be built (`make native`, which `make test` runs); without it the broker refuses to start and these fail."""
    return str(request.param)


def committed(admin: AdminClient, topic: str, lite: str, group: str, want: int) -> None:
    eventually(
        lambda: admin.describe_lite_topic(topic, lite).group_offsets.get(group) == want,
        f"{lite}: offset {want} committed",
        interval_s=0.05,
    )


def test_many_lite_topics_all_received_once_and_acked(
    broker: BrokerProcess, admin: AdminClient, clients: list[Any], lite_group: Callable[..., tuple[str, str]]
) -> None:
    topic, group = lite_group()
    inbox = Inbox()
    c = consumer(broker, clients, group, topic, inbox)
    lites = [f"session-{i}" for i in range(40)]
    for lite in lites:
        c.subscribe_lite(lite)
    p = producer(broker, clients, topic)
    sent = {(lite, f"{lite}/{n}".encode()) for lite in lites for n in range(3)}
    for lite, body in sorted(sent):
        send(p, topic, lite, body)
    assert inbox.wait_for(lambda i: len(i.accepted) >= len(sent), 30), f"got {len(inbox.accepted)} of {len(sent)}"
    got = [(m.lite_topic, m.body) for m in inbox.accepted]
    assert sorted(got) == sorted(sent)  # every message, none twice
    per_topic: dict[str, list[bytes]] = {}
    for lite, body in got:
        per_topic.setdefault(lite, []).append(body)
    assert all(bodies == sorted(bodies) for bodies in per_topic.values())  # in order per lite topic
    assert {m.delivery_attempt for m in inbox.accepted} == {1}
    committed(admin, topic, lites[-1], group, 3)


def test_subscribe_lite_takes_effect_at_once(
    broker: BrokerProcess, clients: list[Any], lite_group: Callable[..., tuple[str, str]]
) -> None:
    """Python 5.1.2 sends subscribe_lite("session-1") as single characters; the broker joins them, so the
    message flows now rather than after the client's next full sync 30 s later."""
    topic, group = lite_group()
    inbox = Inbox()
    c = consumer(broker, clients, group, topic, inbox)
    started = time.monotonic()
    c.subscribe_lite("session-1")
    send(producer(broker, clients, topic), topic, "session-1", b"now")
    assert inbox.wait_for(lambda i: i.bodies() == [b"now"], 10)
    assert time.monotonic() - started < 10


def test_nack_is_redelivered_with_attempt_two(
    broker: BrokerProcess, clients: list[Any], lite_group: Callable[..., tuple[str, str]]
) -> None:
    topic, group = lite_group(fifo=False, retry=model.RetryPolicy(max_attempts=5, backoff_ms=(1000, 1000)))
    inbox = Inbox(accept=lambda m: m.delivery_attempt >= 2)
    c = consumer(broker, clients, group, topic, inbox)
    c.subscribe_lite("retry-me")
    send(producer(broker, clients, topic), topic, "retry-me", b"again")
    assert inbox.wait_for(lambda i: len(i.accepted) == 1, 20)
    assert [m.delivery_attempt for m in inbox.seen] == [1, 2]
    assert inbox.accepted[0].body == b"again"


def test_a_listener_slower_than_the_lease_gets_its_message_once(tmp_path: Any, clients: list[Any]) -> None:
    """The push consumer never renews a lease itself (auto_renew): the broker renews it while it is alive."""
    slice_s = 2
    args = ["--lease-renew-slice-ms", str(slice_s * 1000)]
    with start_broker(tmp_path / "data", extra_args=args) as quick:

        def slow(_message: Any) -> bool:
            time.sleep(3 * slice_s)  # three slices: the lease must be renewed twice meanwhile
            return True

        inbox = Inbox(accept=slow)
        c = consumer(quick, clients, "executor-group", "AGENT_TASK_NS", inbox)
        c.subscribe_lite("slow")
        send(producer(quick, clients, "AGENT_TASK_NS"), "AGENT_TASK_NS", "slow", b"take your time")
        assert inbox.wait_for(lambda i: len(i.accepted) == 1, 20)
        time.sleep(2 * slice_s)  # a redelivery of an expired lease would arrive within a slice
        assert [(m.body, m.delivery_attempt) for m in inbox.seen] == [(b"take your time", 1)]
        for client in clients:
            client.shutdown()
        clients.clear()


def test_fifo_group_retries_locally_then_forwards_to_the_dead_letter_queue(
    broker: BrokerProcess,
    admin: AdminClient,
    clients: list[Any],
    lite_group: Callable[..., tuple[str, str]],
    unique: Callable[[str], str],
) -> None:
    """The default lite path (fifo group): the client retries a failing message itself up to max_attempts,
    then calls ForwardMessageToDeadLetterQueue; the copy is readable from %DLQ%<group> with any consumer."""
    topic, group = lite_group(retry=model.RetryPolicy(max_attempts=2, backoff_ms=(100, 100)))
    assert admin.get_group(group).group.fifo
    inbox = Inbox(accept=lambda m: False)
    c = consumer(broker, clients, group, topic, inbox)
    c.subscribe_lite("poison")
    sent = send(producer(broker, clients, topic), topic, "poison", b"never consumed")
    assert inbox.wait_for(lambda i: len(i.seen) >= 2, 20)

    dlq = f"%DLQ%{group}"
    reader = SimpleConsumer(config(broker), unique("dlq-reader"), {dlq: FilterExpression()}, await_duration=5)
    reader.startup()
    clients.append(reader)
    (dead,) = receive_some(reader, 16)
    assert (dead.topic, dead.body, dead.message_id) == (dlq, b"never consumed", sent.message_id)
    assert dead.properties["__ORIGIN_TOPIC"] == topic
    assert dead.properties["__ORIGIN_LITE_TOPIC"] == "poison"
    reader.ack(dead)
    assert [m.body for m in inbox.seen] == [b"never consumed"] * 2  # max_attempts consumptions, then the DLQ
    committed(admin, topic, "poison", group, 1)  # the forwarded message settled


def test_unsubscribe_stops_delivery(
    broker: BrokerProcess, admin: AdminClient, clients: list[Any], lite_group: Callable[..., tuple[str, str]]
) -> None:
    topic, group = lite_group()
    inbox = Inbox()
    c = consumer(broker, clients, group, topic, inbox)
    c.subscribe_lite("kept")
    c.subscribe_lite("dropped")
    c.unsubscribe_lite("dropped")
    p = producer(broker, clients, topic)
    send(p, topic, "dropped", b"not for me")
    send(p, topic, "kept", b"for me")
    assert inbox.wait_for(lambda i: i.bodies() == [b"for me"], 15)
    dropped = admin.describe_lite_topic(topic, "dropped")
    assert list(dropped.subscribed_clients) == [] and group not in dropped.group_offsets
    assert dropped.meta.max_offset == 1  # stored, never delivered
    assert inbox.bodies() == [b"for me"]


def test_invalid_lite_topic_names_are_rejected(
    broker: BrokerProcess, clients: list[Any], lite_group: Callable[..., tuple[str, str]]
) -> None:
    topic, group = lite_group()
    c = consumer(broker, clients, group, topic, Inbox())
    with pytest.raises(BadRequestException) as raised:
        c.subscribe_lite("no spaces allowed")
    assert raised.value.code == 40020  # ILLEGAL_LITE_TOPIC
    p = producer(broker, clients, topic)
    with pytest.raises(BadRequestException) as refused:
        send(p, topic, "bad/name", b"x")
    assert refused.value.code == 40020  # ILLEGAL_LITE_TOPIC, from the broker (5.1.2 checks no charset itself)


def test_a_tag_or_key_with_a_control_character_is_refused_by_the_broker(
    broker: BrokerProcess, clients: list[Any], lite_group: Callable[..., tuple[str, str]]
) -> None:
    """The official client checks blank tags and '|' itself, not control characters: the broker refuses them as
    RocketMQ's proxy does (ILLEGAL_MESSAGE_TAG 40004, ILLEGAL_MESSAGE_KEY 40005), stores nothing, and the
    producer goes on sending."""
    from rocketmq import Message  # noqa: PLC0415 - only e2e interpreters load the client

    topic, _ = lite_group()
    p = producer(broker, clients, topic)
    for field, value, code in (("tag", "a\nb", 40004), ("keys", "k\x00", 40005)):
        m = Message()
        m.topic, m.lite_topic, m.body = topic, "controls", b"x"
        if field == "tag":
            m.tag = value
        else:
            m.keys = value
        with pytest.raises(BadRequestException) as refused:
            p.send(m)
        assert refused.value.code == code
    send(p, topic, "controls", b"fine")


def test_lite_topic_quota_reaches_the_producer(
    broker: BrokerProcess, admin: AdminClient, clients: list[Any], unique: Callable[[str], str]
) -> None:
    topic = unique("Q")
    admin.put_parent_topic(model.ParentTopic(topic, model.MessageType.LITE, max_lite_topics=1))
    p = producer(broker, clients, topic)
    send(p, topic, "first", b"x")
    with pytest.raises(LiteTopicQuotaExceededException):
        send(p, topic, "second", b"x")
    send(p, topic, "first", b"still fine")


def test_subscription_quota_reaches_the_consumer(tmp_path: Any, clients: list[Any]) -> None:
    """The client checks its group quota itself; the broker-wide limit is only known to the broker."""
    with start_broker(tmp_path / "data", extra_args=["--max-subscriptions-per-broker", "2"]) as small:
        c = consumer(small, clients, "executor-group", "AGENT_TASK_NS", Inbox())
        c.subscribe_lite("a")
        c.subscribe_lite("b")
        with pytest.raises(LiteSubscriptionQuotaExceededException):
            c.subscribe_lite("c")
        for client in clients:
            client.shutdown()
        clients.clear()


def test_lite_simple_consumer_receives_and_acks(
    broker: BrokerProcess, admin: AdminClient, clients: list[Any], lite_group: Callable[..., tuple[str, str]]
) -> None:
    topic, group = lite_group()
    c = LiteSimpleConsumer(topic, config(broker), group, await_duration=5)
    clients.append(c)
    start_lite_simple_consumer(c)
    c.subscribe_lite("simple-1")
    send(producer(broker, clients, topic), topic, "simple-1", b"pull me")
    (message,) = receive_some(c, 16)
    assert (message.lite_topic, message.body, message.delivery_attempt) == ("simple-1", b"pull me", 1)
    c.ack(message)
    assert admin.describe_lite_topic(topic, "simple-1").group_offsets[group] == 1


def test_a_fifo_lite_group_holds_back_later_messages_while_one_is_out(
    broker: BrokerProcess, clients: list[Any], lite_group: Callable[..., tuple[str, str]]
) -> None:
    """Issue 16: a second receive must not return f1 while f0 is leased; a nacked f0 comes back before f1."""
    topic, group = lite_group()
    c = LiteSimpleConsumer(topic, config(broker), group, await_duration=2)
    c.startup()
    clients.append(c)
    manager = c.__dict__.get("_LiteSimpleConsumer__subscription_manager")
    eventually(lambda: manager.lite_subscription_quota != 0, "the settings from the broker", interval_s=0.05)
    c.subscribe_lite("fifo-1")
    p = producer(broker, clients, topic)
    for body in (b"f0", b"f1"):
        send(p, topic, "fifo-1", body)
    (f0,) = receive_some(c, 1, wait_s=30)
    assert f0.body == b"f0"
    assert c.receive(1, 30) == []  # f1 waits while f0 is out
    c.change_invisible_duration(f0, 1)  # a nack
    got = receive_some(c, 16, wait_s=30)
    assert [(m.body, m.delivery_attempt) for m in got] == [(b"f0", 2), (b"f1", 1)]


def test_restart_resumes_without_loss_or_redelivery(tmp_path: Any, clients: list[Any]) -> None:
    """Graceful broker restart under a running consumer: what was acked is never seen again, what was sent
    while it was down arrives."""
    broker = start_broker(tmp_path / "data")
    try:
        inbox = Inbox()
        c = consumer(broker, clients, "executor-group", "AGENT_TASK_NS", inbox)
        c.subscribe_lite("durable")
        p = producer(broker, clients, "AGENT_TASK_NS")
        for n in range(5):
            send(p, "AGENT_TASK_NS", "durable", f"before-{n}".encode())
        assert inbox.wait_for(lambda i: len(i.accepted) == 5, 20)
        with AdminClient(broker.admin_endpoint, timeout_s=5, **broker.admin_keys) as admin:
            committed(admin, "AGENT_TASK_NS", "durable", "executor-group", 5)  # acks follow consume()
        broker = broker.restart()
        for n in range(5):
            testing.send_lite_after_restart(p, "AGENT_TASK_NS", "durable", f"after-{n}".encode())
        assert inbox.wait_for(lambda i: len(i.accepted) >= 10, 30), inbox.bodies()
        assert inbox.bodies() == [f"before-{n}".encode() for n in range(5)] + [f"after-{n}".encode() for n in range(5)]
    finally:
        for client in reversed(clients):
            client.shutdown()
        clients.clear()
        broker.stop()


def test_after_a_crash_the_group_resumes_after_its_last_ack(tmp_path: Any, clients: list[Any]) -> None:
    """SIGKILL: no subscription snapshot, no flush; committed offsets and stored messages survive, and a
    consumer of the group gets exactly what was not acknowledged."""
    broker = start_broker(tmp_path / "data")
    try:
        inbox = Inbox()
        c = consumer(broker, clients, "executor-group", "AGENT_TASK_NS", inbox)
        c.subscribe_lite("crash")
        p = producer(broker, clients, "AGENT_TASK_NS")
        for n in range(3):
            send(p, "AGENT_TASK_NS", "crash", f"acked-{n}".encode())
        assert inbox.wait_for(lambda i: len(i.accepted) == 3, 20)
        with AdminClient(broker.admin_endpoint, timeout_s=5, **broker.admin_keys) as admin:
            committed(admin, "AGENT_TASK_NS", "crash", "executor-group", 3)
        c.unsubscribe_lite("crash")
        for n in range(2):
            send(p, "AGENT_TASK_NS", "crash", f"pending-{n}".encode())  # acknowledged by the broker (stored)
        for client in reversed(clients):
            client.shutdown()
        clients.clear()
        broker.kill()
        broker = start_broker(tmp_path / "data", port=broker.port)
        after = Inbox()
        fresh = consumer(broker, clients, "executor-group", "AGENT_TASK_NS", after)
        fresh.subscribe_lite("crash")
        assert after.wait_for(lambda i: len(i.accepted) >= 2, 20), after.bodies()
        assert after.bodies() == [b"pending-0", b"pending-1"]
    finally:
        for client in reversed(clients):
            client.shutdown()
        clients.clear()
        broker.stop()
