"""Access control and a broker restart (``--acl``, issue 29): the lite subscriptions a restart restores from the
data dir carry the user that made them and are checked against the rules as they are at the start, before the
client's next sync: a user whose ``Sub`` was taken away while the broker was down receives nothing of it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
from waiting import eventually

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.admin.results import AclEntry
from lmq_broker.config import StoreConfig
from lmq_broker.dispatch import saved_subscriptions
from lmq_broker.protocol import auth
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as sg
from lmq_broker.storage import store as lmq_store
from lmq_broker.testing import BrokerProcess, start_broker

PARENT, GROUP, CLIENT = "chat", "c-group", "carol-1"
CAROL = ("carol", "carol-secret-1")


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    process = start_broker(tmp_path / "data", extra_args=["--acl"])
    with AdminClient(process.admin_endpoint, timeout_s=10, **process.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
        admin.put_group(model.LiteGroup(GROUP, PARENT))
        admin.put_user(*CAROL)
        admin.put_acl(
            [AclEntry("carol", f"Lite:{PARENT}/c-*", ("Pub", "Sub")), AclEntry("carol", f"Group:{GROUP}", ("Sub",))]
        )
    yield process
    process.stop()


def signed() -> tuple[tuple[str, str], ...]:
    return (("x-mq-client-id", CLIENT), *auth.sign_metadata(*CAROL, datetime.now(UTC)))


def subscribe(stub: sg.MessagingServiceStub, lites: list[str]) -> None:
    request = spb.SyncLiteSubscriptionRequest(
        action=pb.PARTIAL_ADD, topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP), lite_topic_set=lites
    )
    assert stub.SyncLiteSubscription(request, metadata=signed(), timeout=10).status.code == pb.OK


def send(stub: sg.MessagingServiceStub, lite: str) -> None:
    props = pb.SystemProperties(message_id=f"m-{lite}", message_type=pb.LITE, lite_topic=lite)
    message = pb.Message(topic=pb.Resource(name=PARENT), body=lite.encode(), system_properties=props)
    reply = stub.SendMessage(spb.SendMessageRequest(messages=[message]), metadata=signed(), timeout=10)
    assert reply.status.code == pb.OK, reply.status


def receive(stub: sg.MessagingServiceStub, wait_s: int) -> list[str]:
    """The lite topics of the messages one ReceiveMessage hands out (long polling up to ``wait_s``)."""
    request = spb.ReceiveMessageRequest(
        group=pb.Resource(name=GROUP), message_queue=pb.MessageQueue(topic=pb.Resource(name=PARENT)), batch_size=32
    )
    request.invisible_duration.seconds = 30
    request.long_polling_timeout.seconds = wait_s
    frames = list(stub.ReceiveMessage(request, metadata=signed(), timeout=wait_s + 10))
    return [f.message.system_properties.lite_topic for f in frames if f.HasField("message")]


def deny_while_down(data_dir: Path, resource: str) -> None:
    """A policy change the stopped broker finds at its start (as one made through a peer of its cluster, or the
    operator's, would be): written into its meta store."""
    store = lmq_store.open_store(StoreConfig(data_dir=data_dir))
    try:
        doc = json.loads(store.get_access() or "{}")
        doc["entries"].append({"user": "carol", "resource": resource, "actions": ["Sub"], "decision": "Deny"})
        store.put_access(json.dumps(doc))
    finally:
        store.close()


def test_subscriptions_restored_at_a_restart_are_checked_against_the_rules_then(broker: BrokerProcess) -> None:
    with grpc.insecure_channel(broker.endpoint) as channel:
        subscribe(sg.MessagingServiceStub(channel), ["c-kept", "c-secret-1"])
    assert broker.stop() == 0, broker.log()[-4000:]
    saved = saved_subscriptions.load(broker.data_dir / saved_subscriptions.FILE_NAME)
    assert [(r.client_id, r.owner[0], sorted(r.lmqs)) for r in saved] == [
        (CLIENT, "carol", sorted(model.QueueId.lmq(PARENT, x).topic for x in ("c-kept", "c-secret-1")))
    ]
    deny_while_down(broker.data_dir, f"Lite:{PARENT}/c-secret*")
    again = broker.restart()
    try:
        assert "lite subscriptions of chat in group c-group no longer allowed ended" in again.log()  # before serving
        with grpc.insecure_channel(again.endpoint) as channel:
            stub = sg.MessagingServiceStub(channel)
            send(stub, "c-secret-1")  # Pub is still hers
            send(stub, "c-kept")
            got: list[str] = []

            def kept_received() -> bool:
                got.extend(receive(stub, 5))
                return "c-kept" in got

            eventually(kept_received, "the kept one received")
            got += receive(stub, 1)  # one more look: the forbidden one would have come with or before it
        assert got == ["c-kept"]
    finally:
        again.stop()
