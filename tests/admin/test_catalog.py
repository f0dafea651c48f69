"""Parent topics, lite groups and quotas through AdminClient, against a real server and store."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from lmq_broker import errors, model
from lmq_broker.admin import convert, reclaiming
from lmq_broker.admin.testing import Broker
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as pb
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2_grpc


# --- parent topics ------------------------------------------------------------------------------------------
def test_put_parent_topic_is_an_idempotent_upsert(broker: Broker) -> None:
    admin = broker.client()
    topic = model.ParentTopic("orders", expiration_minutes=60, max_lite_topics=1000)

    first = admin.put_parent_topic(topic)
    again = admin.put_parent_topic(topic)

    assert (first.value, first.created) == (topic, True)
    assert (again.value, again.created) == (topic, False)
    assert broker.live.metadata_changes == 1  # an unchanged put is not a change
    changed = admin.put_parent_topic(model.ParentTopic("orders", expiration_minutes=30))
    assert not changed.created
    assert broker.live.metadata_changes == 2
    info = admin.get_parent_topic("orders")
    assert info.topic.expiration_minutes == 30
    assert info.lite_topic_count == 0


@pytest.mark.parametrize(
    ("topic", "field"),
    [
        (model.ParentTopic("has space"), "topic.name"),
        (model.ParentTopic("a$b"), "topic.name"),
        (model.ParentTopic(""), "topic.name"),
        (model.ParentTopic("t", message_type=model.MessageType.FIFO), "topic.message_type"),
        (model.ParentTopic("t", message_type=model.MessageType.TRANSACTION), "topic.message_type"),
        (model.ParentTopic("t", queue_count=2), "topic.queue_count"),  # a LITE parent has one queue
        (model.ParentTopic("t", model.MessageType.NORMAL, queue_count=65), "topic.queue_count"),
        (model.ParentTopic("t", model.MessageType.NORMAL, queue_count=-1), "topic.queue_count"),
        (model.ParentTopic("t", model.MessageType.NORMAL, expiration_minutes=60), "topic.expiration_minutes"),
        (model.ParentTopic("t", model.MessageType.NORMAL, max_lite_topics=10), "topic.max_lite_topics"),
        (model.ParentTopic("t", expiration_minutes=43_201), "topic.expiration_minutes"),
        (model.ParentTopic("t", expiration_minutes=-2), "topic.expiration_minutes"),
        (model.ParentTopic("t", max_lite_topics=-2), "topic.max_lite_topics"),
    ],
)
def test_invalid_parent_topic_is_refused_naming_the_field(
    memory_broker: Broker, topic: model.ParentTopic, field: str
) -> None:
    admin = memory_broker.client()
    with pytest.raises(errors.InvalidArgument) as raised:
        admin.put_parent_topic(topic)
    assert raised.value.message.startswith(field)
    assert raised.value.fields["code"] == "INVALID_ARGUMENT"
    assert admin.list_parent_topics() == []
    assert memory_broker.live.metadata_changes == 0


def test_unsupported_message_type_names_the_supported_ones(memory_broker: Broker) -> None:
    with pytest.raises(errors.InvalidArgument) as raised:
        memory_broker.client().put_parent_topic(model.ParentTopic("t", model.MessageType.DELAY))
    assert raised.value.message == "topic.message_type: DELAY is not supported; use LITE (5) or NORMAL (1)"


def test_normal_topic_is_stored_with_its_queue_count(broker: Broker) -> None:
    admin = broker.client()
    topic = model.ParentTopic("jobs", model.MessageType.NORMAL, queue_count=4)

    put = admin.put_parent_topic(topic)

    assert (put.value, put.created) == (topic, True)
    assert admin.get_parent_topic("jobs").topic == topic
    assert broker.store.get_parent_topic("jobs") == topic
    assert broker.live.metadata_changes == 1
    assert admin.put_parent_topic(model.ParentTopic("one", model.MessageType.NORMAL, queue_count=1)).created
    assert admin.put_parent_topic(model.ParentTopic("max", model.MessageType.NORMAL, queue_count=64)).created
    assert {t.topic.name: t.topic.queue_count for t in admin.list_parent_topics()} == {"jobs": 4, "one": 1, "max": 64}


def test_unset_queue_count_and_message_type_mean_one_lite_queue(memory_broker: Broker) -> None:
    with grpc.insecure_channel(memory_broker.endpoint) as channel:  # a caller that leaves the fields unset
        stub = admin_pb2_grpc.LmqAdminStub(channel)
        lite = stub.PutParentTopic(pb.PutParentTopicRequest(topic=pb.ParentTopic(name="orders")), timeout=10)
        normal = pb.ParentTopic(
            name="jobs", message_type=int(model.MessageType.NORMAL), expiration_minutes=-1, max_lite_topics=-1
        )
        plain = stub.PutParentTopic(pb.PutParentTopicRequest(topic=normal), timeout=10)

    assert (lite.topic.message_type, lite.topic.queue_count) == (int(model.MessageType.LITE), 1)
    assert (plain.topic.message_type, plain.topic.queue_count) == (int(model.MessageType.NORMAL), 1)
    assert memory_broker.store.get_parent_topic("jobs") == model.ParentTopic("jobs", model.MessageType.NORMAL)


def test_queue_count_and_message_type_survive_the_wire_both_ways() -> None:
    topic = model.ParentTopic("jobs", model.MessageType.NORMAL, queue_count=7)
    assert convert.parent_topic_from_pb(convert.parent_topic_to_pb(topic)) == topic
    assert convert.parent_topic_to_pb(topic).queue_count == 7


def test_normal_topic_queues_may_grow_but_not_shrink(broker: Broker) -> None:
    admin = broker.client()
    admin.put_parent_topic(model.ParentTopic("jobs", model.MessageType.NORMAL, queue_count=2))

    grown = admin.put_parent_topic(model.ParentTopic("jobs", model.MessageType.NORMAL, queue_count=8))
    assert (grown.created, grown.value.queue_count) == (False, 8)
    changes = broker.live.metadata_changes
    with pytest.raises(errors.Conflict, match=r"topic\.queue_count can only grow") as raised:
        admin.put_parent_topic(model.ParentTopic("jobs", model.MessageType.NORMAL, queue_count=3))

    assert raised.value.fields["code"] == "FAILED_PRECONDITION"
    assert admin.get_parent_topic("jobs").topic.queue_count == 8
    assert broker.live.metadata_changes == changes


@pytest.mark.parametrize(
    ("first", "then"),
    [(model.MessageType.LITE, model.MessageType.NORMAL), (model.MessageType.NORMAL, model.MessageType.LITE)],
)
def test_message_type_of_an_existing_topic_is_immutable(
    broker: Broker, first: model.MessageType, then: model.MessageType
) -> None:
    admin = broker.client()
    admin.put_parent_topic(model.ParentTopic("t", first))

    with pytest.raises(errors.Conflict, match=r"topic\.message_type is immutable") as raised:
        admin.put_parent_topic(model.ParentTopic("t", then))

    assert raised.value.fields["code"] == "FAILED_PRECONDITION"
    assert f"is {first.name}, not {then.name}" in raised.value.message
    assert admin.get_parent_topic("t").topic.message_type is first
    assert broker.live.metadata_changes == 1
    admin.delete_parent_topic("t")  # deleting and re-creating is the way to change it
    assert admin.put_parent_topic(model.ParentTopic("t", then)).created


def test_expiration_bounds_are_accepted(memory_broker: Broker) -> None:
    admin = memory_broker.client()
    assert admin.put_parent_topic(model.ParentTopic("never", expiration_minutes=-1)).created
    assert admin.put_parent_topic(model.ParentTopic("month", expiration_minutes=43_200)).created


def test_missing_parent_topic_is_not_found(broker: Broker) -> None:
    with pytest.raises(errors.TopicNotFound, match="'nope' not found"):
        broker.client().get_parent_topic("nope")


def test_list_parent_topics_counts_lite_topics(broker: Broker) -> None:
    admin = broker.client()
    admin.put_parent_topic(model.ParentTopic("a"))
    admin.put_parent_topic(model.ParentTopic("b"))
    broker.send("a", "s1")
    broker.send("a", "s2", count=3)

    listed = {info.topic.name: info.lite_topic_count for info in admin.list_parent_topics()}

    assert listed == {"a": 2, "b": 0}


def test_parent_topic_with_lite_topics_is_deleted_only_with_purge(broker: Broker) -> None:
    admin = broker.client()
    admin.put_parent_topic(model.ParentTopic("orders"))
    for lite in ("s1", "s2", "s3"):
        broker.send("orders", lite, count=2)
    changes = broker.live.metadata_changes

    with pytest.raises(errors.Conflict, match="still has 3 lite topics"):
        admin.delete_parent_topic("orders")
    assert admin.get_parent_topic("orders").lite_topic_count == 3
    assert broker.live.metadata_changes == changes

    purged = admin.delete_parent_topic("orders", purge_lite_topics=True)

    assert (purged.deleted, purged.lite_topics_deleted) == (True, 3)
    assert broker.store.lite_topic_count("orders") == 0
    assert sorted(broker.live.forgotten) == [model.QueueId.lmq("orders", s) for s in ("s1", "s2", "s3")]
    assert broker.live.metadata_changes == changes + 1
    with pytest.raises(errors.TopicNotFound):
        admin.get_parent_topic("orders")
    again = admin.delete_parent_topic("orders", purge_lite_topics=True)
    assert (again.deleted, again.lite_topics_deleted) == (False, 0)


def test_purge_walks_lite_topics_in_batches_and_finishes_an_interrupted_purge(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reclaiming, "DELETE_BATCH", 2)
    admin = broker.client()
    admin.put_parent_topic(model.ParentTopic("orders"))
    for i in range(7):
        broker.send("orders", f"s{i}")
    broker.store.delete_parent_topic("orders")  # as if a purge had stopped after deleting the parent

    purged = admin.delete_parent_topic("orders", purge_lite_topics=True)

    assert (purged.deleted, purged.lite_topics_deleted) == (False, 7)
    assert broker.store.lite_topic_count("orders") == 0
    assert len(broker.live.forgotten) == 7


def test_deleting_an_absent_parent_topic_reports_false(memory_broker: Broker) -> None:
    deletion = memory_broker.client().delete_parent_topic("ghost")
    assert (deletion.deleted, deletion.lite_topics_deleted) == (False, 0)
    assert memory_broker.live.metadata_changes == 0


# --- lite groups --------------------------------------------------------------------------------------------
def test_group_needs_an_existing_lite_bind_topic(broker: Broker) -> None:
    admin = broker.client()
    group = model.LiteGroup("g", bind_topic="orders")
    with pytest.raises(errors.TopicNotFound, match=r"group\.bind_topic"):
        admin.put_group(group)
    assert admin.list_groups() == []

    admin.put_parent_topic(model.ParentTopic("orders"))
    put = admin.put_group(group)

    assert (put.value, put.created) == (group, True)
    assert not admin.put_group(group).created


def test_group_cannot_bind_a_normal_topic(broker: Broker) -> None:
    admin = broker.client()
    admin.put_parent_topic(model.ParentTopic("jobs", model.MessageType.NORMAL))

    with pytest.raises(errors.Conflict, match="topic 'jobs' is NORMAL, not LITE") as raised:
        admin.put_group(model.LiteGroup("g", bind_topic="jobs"))

    assert raised.value.fields["code"] == "FAILED_PRECONDITION"
    assert admin.list_groups() == []


def test_group_bind_topic_is_immutable(broker: Broker) -> None:
    admin = broker.client()
    admin.put_parent_topic(model.ParentTopic("a"))
    admin.put_parent_topic(model.ParentTopic("b"))
    admin.put_group(model.LiteGroup("g", bind_topic="a"))

    with pytest.raises(errors.Conflict, match="immutable") as raised:
        admin.put_group(model.LiteGroup("g", bind_topic="b"))

    assert raised.value.fields["code"] == "FAILED_PRECONDITION"
    assert admin.get_group("g").group.bind_topic == "a"


def test_group_unset_numbers_take_the_broker_defaults(memory_broker: Broker) -> None:
    admin = memory_broker.client()
    admin.put_parent_topic(model.ParentTopic("orders"))

    put = admin.put_group(
        model.LiteGroup(
            "g",
            bind_topic="orders",
            model=model.SubscriptionModel.EXCLUSIVE,
            client_quota=0,
            ready_capacity=0,
            retry=model.RetryPolicy(max_attempts=0, backoff_ms=()),
            fifo=False,
        )
    )

    assert put.value.client_quota == memory_broker.config.default_client_quota == 1500
    assert put.value.ready_capacity == memory_broker.config.default_ready_capacity == 40
    assert put.value.retry == model.RetryPolicy()
    assert put.value.model is model.SubscriptionModel.EXCLUSIVE
    assert put.value.fifo is False
    assert admin.get_group("g").group == put.value


@pytest.mark.parametrize(
    ("group", "field"),
    [
        (model.LiteGroup("bad name", "orders"), "group.name"),
        (model.LiteGroup("g", "bad topic"), "group.bind_topic"),
        (model.LiteGroup("g", "orders", ready_capacity=9), "group.ready_capacity"),
        (model.LiteGroup("g", "orders", client_quota=-1), "group.client_quota"),
        (model.LiteGroup("g", "orders", retry=model.RetryPolicy(max_attempts=-3)), "group.retry.max_attempts"),
        (model.LiteGroup("g", "orders", retry=model.RetryPolicy(backoff_ms=(1000, 0))), "group.retry.backoff_ms[1]"),
        (model.LiteGroup("g", "orders", lite_patterns=("s-*",)), "group.lite_patterns"),  # not a wildcard group
        (model.LiteGroup("g", "orders", wildcard=True, lite_patterns=("s-*", "a*b")), "group.lite_patterns[1]"),
        (model.LiteGroup("g", "orders", wildcard=True, lite_patterns=("x" * 64 + "*",)), "group.lite_patterns[0]"),
    ],
)
def test_invalid_group_is_refused_naming_the_field(memory_broker: Broker, group: model.LiteGroup, field: str) -> None:
    admin = memory_broker.client()
    admin.put_parent_topic(model.ParentTopic("orders"))
    with pytest.raises(errors.InvalidArgument) as raised:
        admin.put_group(group)
    assert raised.value.message.startswith(field)
    assert admin.list_groups() == []


def test_a_wildcard_groups_patterns_are_stored_and_changed(broker: Broker) -> None:
    admin = broker.client()
    admin.put_parent_topic(model.ParentTopic("orders"))
    group = model.LiteGroup("g", "orders", wildcard=True, lite_patterns=("session-*", "dev/+/cmd", "all/#"))
    assert admin.put_group(group).value.lite_patterns == group.lite_patterns
    assert admin.get_group("g").group.lite_patterns == group.lite_patterns
    admin.put_group(dataclasses.replace(group, lite_patterns=()))
    assert admin.get_group("g").group.lite_patterns == ()


def test_missing_group_and_idempotent_group_delete(broker: Broker) -> None:
    admin = broker.client()
    with pytest.raises(errors.GroupNotFound):
        admin.get_group("g")
    admin.put_parent_topic(model.ParentTopic("orders"))
    admin.put_group(model.LiteGroup("g", bind_topic="orders"))
    changes = broker.live.metadata_changes

    assert admin.delete_group("g") is True
    assert admin.delete_group("g") is False
    assert broker.live.metadata_changes == changes + 1
    with pytest.raises(errors.GroupNotFound):
        admin.get_group("g")


# --- quotas -------------------------------------------------------------------------------------------------
def test_quotas_put_list_delete(broker: Broker) -> None:
    admin = broker.client()
    scopes = ["broker", "parent:orders", "namespace:team-a"]
    for scope in scopes:
        assert admin.put_quota(model.Quota(scope, max_lite_topics=10)).created
    assert not admin.put_quota(model.Quota("broker", max_lite_topics=10)).created
    updated = admin.put_quota(model.Quota("broker", max_lite_topics=20, max_send_rate=100))
    assert (updated.created, updated.value.max_send_rate) == (False, 100)

    assert sorted(q.scope for q in admin.list_quotas()) == sorted(scopes)
    assert broker.live.metadata_changes == 4
    assert admin.delete_quota("parent:orders") is True
    assert admin.delete_quota("parent:orders") is False
    assert broker.live.metadata_changes == 5
    assert sorted(q.scope for q in admin.list_quotas()) == ["broker", "namespace:team-a"]


@pytest.mark.parametrize(
    ("quota", "field"),
    [
        (model.Quota("cluster"), "quota.scope"),
        (model.Quota("parent:"), "quota.scope"),
        (model.Quota("topic:orders"), "quota.scope"),
        (model.Quota("parent:bad name"), "quota.scope"),
        (model.Quota("broker", max_lite_topics=-5), "quota.max_lite_topics"),
        (model.Quota("broker", max_subscriptions_per_client=-2), "quota.max_subscriptions_per_client"),
        (model.Quota("broker", max_send_rate=-9), "quota.max_send_rate"),
    ],
)
def test_invalid_quota_is_refused_naming_the_field(memory_broker: Broker, quota: model.Quota, field: str) -> None:
    admin = memory_broker.client()
    with pytest.raises(errors.InvalidArgument) as raised:
        admin.put_quota(quota)
    assert raised.value.message.startswith(field)
    assert admin.list_quotas() == []
