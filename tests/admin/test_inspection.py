"""Describe and page lite topics, list clients, group lag and broker figures, through AdminClient."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmq_broker import errors, model
from lmq_broker.admin import inspection
from lmq_broker.admin.testing import Broker


def _orders_with_groups(broker: Broker, *groups: str) -> None:
    admin = broker.client()
    admin.put_parent_topic(model.ParentTopic("orders"))
    for group in groups:
        admin.put_group(model.LiteGroup(group, bind_topic="orders"))


def test_describe_lite_topic_shows_offsets_of_bound_groups_and_subscribers(broker: Broker) -> None:
    _orders_with_groups(broker, "g1", "g2")
    broker.send("orders", "s1", count=3)
    broker.consume("orders", "s1", "g1", 2)
    broker.consume("orders", "s1", "unbound", 1)  # a group of another parent is not shown
    broker.subscribe("orders", "s1", "client-a", "client-b")

    described = broker.client().describe_lite_topic("orders", "s1")

    assert (described.meta.parent, described.meta.lite) == ("orders", "s1")
    assert (described.meta.min_offset, described.meta.max_offset) == (0, 3)
    assert described.meta.last_store_ms > 0
    assert described.meta.last_consume_ms > 0
    assert dict(described.group_offsets) == {"g1": 2}
    assert described.subscribed_clients == ("client-a", "client-b")


def test_describe_refuses_bad_names_and_reports_missing_topics(memory_broker: Broker) -> None:
    admin = memory_broker.client()
    with pytest.raises(errors.InvalidLiteTopic, match="lite"):
        admin.describe_lite_topic("orders", "no spaces")
    with pytest.raises(errors.NotFound, match="'s9' of 'orders' not found"):
        admin.describe_lite_topic("orders", "s9")


def test_list_lite_topics_pages_within_a_parent(broker: Broker) -> None:
    for lite in ("a", "b", "c", "d", "e"):
        broker.send("orders", lite)
    broker.send("other", "z")
    broker.subscribe("orders", "b", "client-1")
    admin = broker.client()

    pages, cursor = [], ""
    while True:
        page = admin.list_lite_topics("orders", start_after=cursor, limit=2)
        pages.append([t.meta.lite for t in page.topics])
        cursor = page.next_start_after
        if not cursor:
            break

    assert pages == [["a", "b"], ["c", "d"], ["e"]]
    first = admin.list_lite_topics("orders", limit=2)
    assert [t.subscriber_count for t in first.topics] == [0, 1]
    assert first.next_start_after == "b"


def test_list_lite_topics_across_parents_uses_parent_dollar_lite_keys(broker: Broker) -> None:
    for parent, lite in (("a", "x"), ("a", "y"), ("b", "x")):
        broker.send(parent, lite)
    admin = broker.client()

    first = admin.list_lite_topics(limit=2)
    rest = admin.list_lite_topics(start_after=first.next_start_after, limit=2)

    assert [(t.meta.parent, t.meta.lite) for t in first.topics] == [("a", "x"), ("a", "y")]
    assert first.next_start_after == "a$y"
    assert [(t.meta.parent, t.meta.lite) for t in rest.topics] == [("b", "x")]
    assert rest.next_start_after == ""


def test_list_lite_topics_limit_bounds(memory_broker: Broker) -> None:
    admin = memory_broker.client()
    for i in range(3):
        memory_broker.send("orders", f"s{i}")
    assert len(admin.list_lite_topics("orders", limit=0).topics) == 3  # 0 asks for the default page
    with pytest.raises(errors.InvalidArgument, match="limit"):
        admin.list_lite_topics("orders", limit=inspection.PAGE_MAX + 1)


def test_list_clients_reads_the_live_view(memory_broker: Broker) -> None:
    memory_broker.connect("c1", "g1", "orders", subscriptions=3)
    memory_broker.connect("c2", "g2", "orders", subscriptions=1)
    admin = memory_broker.client()

    every = admin.list_clients()
    of_g2 = admin.list_clients("g2")

    assert [(c.client_id, c.group, c.subscription_count) for c in every] == [("c1", "g1", 3), ("c2", "g2", 1)]
    assert [c.client_id for c in of_g2] == ["c2"]
    assert of_g2[0].client_type == 5


def test_group_lag_counts_committed_and_subscribed_topics_of_the_group(broker: Broker) -> None:
    _orders_with_groups(broker, "g", "idle")
    broker.send("orders", "committed", count=3)
    broker.consume("orders", "committed", "g", 1)  # 2 to go
    broker.send("orders", "subscribed", count=2)
    broker.connect("client-g", "g", "orders", subscriptions=1)
    broker.subscribe("orders", "subscribed", "client-g")  # never committed: both messages to go
    broker.send("orders", "strangers", count=5)  # neither committed nor subscribed by g
    broker.send("orders", "done", count=4)
    broker.consume("orders", "done", "g", 4)
    admin = broker.client()

    info = admin.get_group("g")
    groups = {g.group.name: g for g in admin.list_groups()}

    assert info.lag == 4
    assert (info.client_count, info.subscription_count) == (1, 1)
    assert groups["g"].lag == 4
    assert groups["idle"].lag == 0
    assert groups["idle"].client_count == 0


def test_group_lag_walks_past_one_batch(broker: Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inspection, "WALK_BATCH", 2)
    _orders_with_groups(broker, "g")
    for i in range(5):
        broker.send("orders", f"s{i}", count=2)
        broker.consume("orders", f"s{i}", "g", 1)

    assert broker.client().get_group("g").lag == 5


def test_broker_info_counts_and_undrained_messages(broker: Broker) -> None:
    _orders_with_groups(broker, "g")
    broker.send("orders", "drained", count=3)
    broker.consume("orders", "drained", "g", 3)
    broker.send("orders", "pending", count=2)  # g has not consumed it
    broker.send("orphans", "x", count=4)  # a parent without groups: nobody will drain it
    broker.connect("c1", "g", "orders", subscriptions=1)
    broker.subscribe("orders", "pending", "c1")
    broker.store.flush()

    info = broker.client().broker_info()
    quick = broker.client().broker_info(with_undrained=False)

    assert info.broker_name == "broker-test"
    assert info.version
    assert (info.parent_topic_count, info.group_count, info.lite_topic_count) == (1, 1, 3)
    assert (info.subscription_count, info.client_count) == (1, 1)
    assert info.stored_bytes > 0
    assert info.undrained_messages == 6
    assert quick.undrained_messages == -1
    assert quick.lite_topic_count == 3


def test_undrained_is_zero_once_every_group_consumed_everything(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inspection, "WALK_BATCH", 2)
    _orders_with_groups(broker, "g1", "g2")
    for i in range(5):
        broker.send("orders", f"s{i}", count=2)
        broker.consume("orders", f"s{i}", "g1", 2)
    admin = broker.client()
    assert admin.broker_info().undrained_messages == 10  # g2 has consumed nothing

    for i in range(5):
        broker.consume("orders", f"s{i}", "g2", 2)

    assert admin.broker_info().undrained_messages == 0


def test_disk_usage_sums_files_below_a_folder(tmp_path: Path) -> None:
    root = tmp_path / "d"
    (root / "sub").mkdir(parents=True)
    (root / "a").write_bytes(b"x" * 10)
    (root / "sub" / "b").write_bytes(b"y" * 32)
    assert inspection.disk_usage(root) == 42
    assert inspection.disk_usage(root / "missing") == 0
