"""Lite topic patterns through the official rocketmq-python-client 5.1.2 (``subscribe_lite("session-*")``),
against a real broker process: the client checks only length and blankness, so a pattern reaches the broker
as written (one character per entry, joined like any 5.1.2 name)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from rocketmq.v5.exception import BadRequestException, LiteSubscriptionQuotaExceededException
from waiting import eventually

from lmq_broker.admin.client import AdminClient
from lmq_broker.testing import (
    BrokerProcess,
    Inbox,
    send_lite,
    send_lite_after_restart,
    start_broker,
    started_lite_consumer,
    started_producer,
)


def send(p: Any, topic: str, lite: str, body: bytes | None = None) -> None:
    send_lite(p, topic, lite, body or lite.encode())


def lites_of(inbox: Inbox) -> list[str]:
    return sorted(m.lite_topic for m in inbox.accepted)


def barrier(p: Any, topic: str, inbox: Inbox, lite: str, body: bytes | None = None) -> None:
    """A message on ``lite`` (a topic the consumer takes), sent after everything it must not get, has come:
    anything unwanted would have been handed out with it or before it."""
    send(p, topic, lite, body)
    assert inbox.wait_for(lambda i: lite in [m.lite_topic for m in i.accepted], 20), lites_of(inbox)


def committed(admin: AdminClient, topic: str, lite: str, group: str, want: int) -> None:
    eventually(
        lambda: admin.describe_lite_topic(topic, lite).group_offsets.get(group) == want,
        f"{lite}: offset {want} committed",
        interval_s=0.05,
    )


def test_patterns_receive_matching_new_lite_topics_only(
    broker: BrokerProcess, admin: AdminClient, clients: list[Any], lite_group: Callable[..., tuple[str, str]]
) -> None:
    topic, group = lite_group()
    inbox = Inbox()
    c = started_lite_consumer(broker, clients, group, topic, inbox)
    for pattern in ("session-*", "dev/+/cmd", "all/#"):
        c.subscribe_lite(pattern)
    p = started_producer(broker, clients, topic)
    matching = ["session-1", "session-2_x", "dev_7_cmd", "all", "all_a_b"]
    for lite in ["session", "sessions-1", "dev_7_cmd_x", "dev_7", "alls", "other", *matching]:
        send(p, topic, lite)
    assert inbox.wait_for(lambda i: len(i.accepted) >= len(matching), 20), lites_of(inbox)
    barrier(p, topic, inbox, "session-last")
    assert lites_of(inbox) == sorted([*matching, "session-last"])
    assert {m.body for m in inbox.accepted} == {lite.encode() for lite in [*matching, "session-last"]}
    committed(admin, topic, "session-1", group, 1)
    assert group not in admin.describe_lite_topic(topic, "other").group_offsets  # stored, never delivered


def test_unsubscribing_a_pattern_stops_delivery(
    broker: BrokerProcess, clients: list[Any], lite_group: Callable[..., tuple[str, str]]
) -> None:
    topic, group = lite_group()
    inbox = Inbox()
    c = started_lite_consumer(broker, clients, group, topic, inbox)
    c.subscribe_lite("a-*")
    c.subscribe_lite("b/#")
    p = started_producer(broker, clients, topic)
    send(p, topic, "a-1")
    assert inbox.wait_for(lambda i: lites_of(i) == ["a-1"], 20)
    c.unsubscribe_lite("a-*")
    send(p, topic, "a-2")
    send(p, topic, "b_1")
    assert inbox.wait_for(lambda i: len(i.accepted) >= 2, 20), lites_of(inbox)
    barrier(p, topic, inbox, "b_2")
    assert lites_of(inbox) == ["a-1", "b_1", "b_2"]


def test_a_restarted_consumer_resumes_from_the_group_offsets(
    broker: BrokerProcess, admin: AdminClient, clients: list[Any], lite_group: Callable[..., tuple[str, str]]
) -> None:
    """Messages waiting in matching topics (new ones among them) are found when the pattern is registered."""
    topic, group = lite_group()
    first = Inbox()
    c = started_lite_consumer(broker, clients, group, topic, first)
    c.subscribe_lite("job-*")
    p = started_producer(broker, clients, topic)
    for n in range(3):
        send(p, topic, "job-1", f"old-{n}".encode())
    assert first.wait_for(lambda i: len(i.accepted) == 3, 20)
    committed(admin, topic, "job-1", group, 3)
    c.shutdown()
    clients.remove(c)
    for lite, body in (("job-1", b"new-0"), ("job-2", b"new-1"), ("nojob", b"never")):
        send(p, topic, lite, body)
    second = Inbox()
    started_lite_consumer(broker, clients, group, topic, second).subscribe_lite("job-*")
    assert second.wait_for(lambda i: len(i.accepted) >= 2, 20), second.bodies()
    barrier(p, topic, second, "job-3", b"new-2")
    assert sorted(second.bodies()) == [b"new-0", b"new-1", b"new-2"]


def test_malformed_patterns_are_refused_as_illegal_lite_topics(
    broker: BrokerProcess, clients: list[Any], lite_group: Callable[..., tuple[str, str]]
) -> None:
    topic, group = lite_group()
    c = started_lite_consumer(broker, clients, group, topic, Inbox())
    for bad in ("a*b", "a/#/c", "a+/b"):
        with pytest.raises(BadRequestException) as raised:
            c.subscribe_lite(bad)
        assert raised.value.code == 40020  # ILLEGAL_LITE_TOPIC


def test_a_pattern_counts_against_the_quota_and_survives_a_broker_restart(tmp_path: Any, clients: list[Any]) -> None:
    """The broker-wide limit (which the client cannot check itself) refuses the third subscription with
    LITE_SUBSCRIPTION_QUOTA_EXCEEDED; after a graceful restart the pattern still takes new topics and what
    was acked before is not seen again."""
    broker = start_broker(tmp_path / "data", extra_args=["--max-subscriptions-per-broker", "2"])
    try:
        inbox = Inbox()
        c = started_lite_consumer(broker, clients, "executor-group", "AGENT_TASK_NS", inbox)
        c.subscribe_lite("s-*")
        c.subscribe_lite("named")
        with pytest.raises(LiteSubscriptionQuotaExceededException) as refused:
            c.subscribe_lite("t-*")
        assert refused.value.code == 42902
        p = started_producer(broker, clients, "AGENT_TASK_NS")
        send(p, "AGENT_TASK_NS", "s-1", b"before")
        send(p, "AGENT_TASK_NS", "t-1", b"not subscribed")
        assert inbox.wait_for(lambda i: len(i.accepted) >= 1, 20)
        with AdminClient(broker.admin_endpoint, timeout_s=5, **broker.admin_keys) as admin:
            committed(admin, "AGENT_TASK_NS", "s-1", "executor-group", 1)
        broker = broker.restart()
        send_lite_after_restart(p, "AGENT_TASK_NS", "s-2", b"after")
        assert inbox.wait_for(lambda i: len(i.accepted) >= 2, 40), inbox.bodies()
        barrier(p, "AGENT_TASK_NS", inbox, "s-3", b"last")
        bodies = inbox.bodies()
        assert bodies[0] == b"before" and sorted(bodies[1:]) == [b"after", b"last"]
    finally:
        for client in reversed(clients):
            client.shutdown()
        clients.clear()
        broker.stop()


def test_a_wildcard_group_with_patterns_receives_the_matching_lite_topics_only(
    broker: BrokerProcess, clients: list[Any], lite_group: Callable[..., tuple[str, str]]
) -> None:
    """Group-level patterns (LiteGroup ``litePatterns``): the client registers with ``subscribe_lite_all()``
    and gets only the lite topics of the group's patterns, waiting ones included."""
    topic, group = lite_group(wildcard=True, lite_patterns=("order-*", "eu/+"))
    p = started_producer(broker, clients, topic)
    send(p, topic, "order-0")  # waiting before the client registers
    inbox = Inbox()
    c = started_lite_consumer(broker, clients, group, topic, inbox)
    c.subscribe_lite_all()
    matching = ["order-0", "order-1", "eu_fr"]
    for lite in ["orders", "eu_fr_x", "us_ny", "order-1", "eu_fr"]:
        send(p, topic, lite)
    assert inbox.wait_for(lambda i: len(i.accepted) >= len(matching), 20), lites_of(inbox)
    barrier(p, topic, inbox, "order-2")
    assert lites_of(inbox) == sorted([*matching, "order-2"])
