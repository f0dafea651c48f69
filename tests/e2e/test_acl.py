"""Access control with the official Python client (``--acl``): two tenants share one LITE parent; each sends
and receives its own lite topics and is FORBIDDEN (40300) on the other's, where nothing is stored; a policy
change applies to the next call."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import grpc
import pytest
from acl_metrics import acl_refused
from rocketmq import ClientConfiguration, Credentials, LitePushConsumer, Message, Producer
from rocketmq.grpc_protocol import definition_pb2, service_pb2, service_pb2_grpc
from waiting import eventually

from lmq_broker import errors, model
from lmq_broker.admin.client import AdminClient
from lmq_broker.admin.results import AclEntry
from lmq_broker.protocol import auth
from lmq_broker.testing import BrokerProcess, Inbox, start_broker

PARENT = "shared"
ALICE, BOB = ("alice", "alice-secret-1"), ("bob", "bob-secret-1")


def lite(lite_topic: str, body: bytes) -> Any:
    m = Message()
    m.topic, m.lite_topic, m.body = PARENT, lite_topic, body
    return m


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    process = start_broker(tmp_path_factory.mktemp("acl") / "data", extra_args=["--acl"])
    with AdminClient(process.admin_endpoint, timeout_s=10, **process.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
        for tenant, (name, secret) in (("a", ALICE), ("b", BOB)):
            admin.put_group(model.LiteGroup(f"{tenant}-group", PARENT))
            admin.put_user(name, secret)
            admin.put_acl(
                [
                    AclEntry(name, f"Lite:{PARENT}/{tenant}-*", ("Pub", "Sub")),
                    AclEntry(name, f"Group:{tenant}-group", ("Sub",)),
                ]
            )
    yield process
    assert process.stop() == 0, process.log()[-4000:]


def raw_send(endpoint: str, lite_topic: str, keys: tuple[str, str]) -> Any:
    props = definition_pb2.SystemProperties(
        message_id=f"raw-{lite_topic}-{time.monotonic_ns()}", message_type=definition_pb2.LITE, lite_topic=lite_topic,
        body_encoding=definition_pb2.IDENTITY,
    )  # fmt: skip
    message = definition_pb2.Message(topic=definition_pb2.Resource(name=PARENT), body=b"x", system_properties=props)
    metadata = (("x-mq-client-id", "raw"), *auth.sign_metadata(*keys, datetime.now(UTC)))
    with grpc.insecure_channel(endpoint) as channel:
        stub = service_pb2_grpc.MessagingServiceStub(channel)
        return stub.SendMessage(service_pb2.SendMessageRequest(messages=[message]), metadata=metadata, timeout=10)


def test_tenants_use_their_own_lite_topics_and_are_forbidden_the_others(broker: BrokerProcess) -> None:
    alice = ClientConfiguration(broker.endpoint, Credentials(*ALICE))
    inbox = Inbox()
    consumer = LitePushConsumer(alice, "a-group", PARENT, inbox)
    consumer.startup()
    producer = Producer(alice, (PARENT,))
    producer.startup()
    try:
        consumer.subscribe_lite("a-session")
        producer.send(lite("a-session", b"hers"))
        assert inbox.wait_for(lambda i: i.bodies() == [b"hers"], 15)
        before = acl_refused(broker.metrics_url, "alice", "Pub")
        with pytest.raises(Exception, match="may not Pub on Lite:shared/b-session"):
            producer.send(lite("b-session", b"intrusion"))
        assert acl_refused(broker.metrics_url, "alice", "Pub") > before
        with pytest.raises(Exception, match="may not Sub on Lite:shared/b-session"):
            consumer.subscribe_lite("b-session")
    finally:
        producer.shutdown()
        consumer.shutdown()
    with AdminClient(broker.admin_endpoint, **broker.admin_keys) as admin, pytest.raises(errors.NotFound):
        admin.describe_lite_topic(PARENT, "b-session")  # nothing stored


def test_forbidden_is_40300_and_a_change_applies_to_the_next_call(broker: BrokerProcess) -> None:
    bob_sends = raw_send(broker.endpoint, "a-x", BOB)
    assert bob_sends.status.code == definition_pb2.FORBIDDEN == 40300
    assert "user bob may not Pub on Lite:shared/a-x" in bob_sends.status.message
    assert raw_send(broker.endpoint, "b-x", BOB).status.code == definition_pb2.OK
    with AdminClient(broker.admin_endpoint, **broker.admin_keys) as admin:
        admin.put_acl([AclEntry("bob", f"Lite:{PARENT}/b-x", ("Pub",), "Deny")])
        assert raw_send(broker.endpoint, "b-x", BOB).status.code == definition_pb2.FORBIDDEN  # deny wins, at once
        assert raw_send(broker.endpoint, "b-y", BOB).status.code == definition_pb2.OK
        admin.delete_acl("bob", f"Lite:{PARENT}/b-x", "Deny")
        assert raw_send(broker.endpoint, "b-x", BOB).status.code == definition_pb2.OK
        admin.put_user("bob", enabled=False)  # a disabled user cannot even sign in
        assert raw_send(broker.endpoint, "b-x", BOB).status.code == definition_pb2.UNAUTHORIZED
        admin.put_user("bob", enabled=True)  # its secret kept
        assert raw_send(broker.endpoint, "b-x", BOB).status.code == definition_pb2.OK
        assert raw_send(broker.endpoint, "b-x", ("bob", "wrong-secret")).status.code == definition_pb2.UNAUTHORIZED
        assert admin.describe_lite_topic(PARENT, "b-x").meta.max_offset == 3
        with pytest.raises(errors.NotFound):
            admin.describe_lite_topic(PARENT, "a-x")


def test_the_admin_pair_is_a_super_user(broker: BrokerProcess) -> None:
    keys = (broker.admin_keys["access_key"], broker.admin_keys["secret_key"])
    assert raw_send(broker.endpoint, "anything", keys).status.code == definition_pb2.OK


def test_taking_sub_away_ends_lite_subscriptions_made_before(broker: BrokerProcess) -> None:
    """Issue 29: a lite subscription made while allowed stops delivering once a policy change takes ``Sub``
    away (``acl put … Deny``), from that change on, not from the client's next sync; the others keep flowing."""
    alice = ClientConfiguration(broker.endpoint, Credentials(*ALICE))
    inbox = Inbox()
    consumer = LitePushConsumer(alice, "a-group", PARENT, inbox)
    consumer.startup()
    producer = Producer(alice, (PARENT,))
    producer.startup()
    denied = f"Lite:{PARENT}/a-revoked*"
    try:
        consumer.subscribe_lite("a-kept")
        consumer.subscribe_lite("a-revoked-1")
        producer.send(lite("a-revoked-1", b"before"))
        assert inbox.wait_for(lambda i: i.bodies() == [b"before"], 15)
        with AdminClient(broker.admin_endpoint, **broker.admin_keys) as admin:
            # Its ack first: one refused after the deny is retried for ever by this FIFO client (its shutdown then
            # hangs), so the deny must not overtake it.
            eventually(
                lambda: admin.describe_lite_topic(PARENT, "a-revoked-1").group_offsets.get("a-group", -1) == 1,
                "the message received before the deny acknowledged",
            )
            admin.put_acl([AclEntry("alice", denied, ("Sub",), "Deny")])
        assert eventually(lambda: "user alice: lite subscriptions of shared" in broker.log(), "the end logged")
        producer.send(lite("a-revoked-1", b"after the deny"))  # Pub is still hers
        producer.send(lite("a-kept", b"kept"))
        assert inbox.wait_for(lambda i: b"kept" in i.bodies(), 15)
        time.sleep(0.5)  # the revoked one would have come with or before it: one more look, then nothing else
        assert sorted(inbox.bodies()) == [b"before", b"kept"]
    finally:
        producer.shutdown()
        consumer.shutdown()
        with AdminClient(broker.admin_endpoint, **broker.admin_keys) as admin:
            admin.delete_acl("alice", denied, "Deny")
