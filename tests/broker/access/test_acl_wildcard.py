"""Access control and wildcard lite groups (``--acl``): a wildcard group's client receives every lite topic of the
parent its lite patterns match (all of them without any), whatever set its COMPLETE_ADD carries, so that is what
its user must be allowed to read.

Before this, only the group and the carried set were checked: bob, with ``Sub`` on the wildcard group and on his
own ``b-*`` lite topics, registered with an empty set (or ``["b-x"]``) and received alice's ``a-secret`` (found in
the access-control audit; ``test_a_wildcard_registration_needs_sub_on_all_it_receives`` failed so)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
from acl_testing import start_acl_broker
from waiting import eventually

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.admin.results import AclEntry
from lmq_broker.protocol import auth
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as sg
from lmq_broker.testing import BrokerProcess

PARENT = "shared"
ALICE, BOB, CAROL = ("alice", "alice-secret-1"), ("bob", "bob-secret-1"), ("carol", "carol-secret-1")


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    process = start_acl_broker(tmp_path / "data", PARENT)
    with AdminClient(process.admin_endpoint, timeout_s=10, **process.admin_keys) as admin:
        admin.put_group(model.LiteGroup("wild", PARENT, wildcard=True))
        admin.put_group(model.LiteGroup("wild-b", PARENT, wildcard=True, lite_patterns=("b-*",)))
        for user in (ALICE, BOB, CAROL):
            admin.put_user(*user)
        admin.put_acl([AclEntry("alice", f"Lite:{PARENT}/a-*", ("Pub", "Sub"))])
        groups = ("Group:wild", "Group:wild-b")
        admin.put_acl(
            [AclEntry("bob", f"Lite:{PARENT}/b-*", ("Pub", "Sub")), *(AclEntry("bob", g, ("Sub",)) for g in groups)]
        )
        admin.put_acl([AclEntry("carol", f"Topic:{PARENT}", ("Sub",)), AclEntry("carol", "Group:wild", ("Sub",))])
    yield process
    assert process.stop() == 0, process.log()[-4000:]


def signed(keys: tuple[str, str], client_id: str) -> tuple[tuple[str, str], ...]:
    return (("x-mq-client-id", client_id), *auth.sign_metadata(*keys, datetime.now(UTC)))


def register(
    stub: sg.MessagingServiceStub, keys: tuple[str, str], client_id: str, group: str, lites: list[str]
) -> pb.Status:
    request = spb.SyncLiteSubscriptionRequest(
        action=pb.COMPLETE_ADD, topic=pb.Resource(name=PARENT), group=pb.Resource(name=group), lite_topic_set=lites
    )
    return stub.SyncLiteSubscription(request, metadata=signed(keys, client_id), timeout=10).status


def send(stub: sg.MessagingServiceStub, keys: tuple[str, str], lite: str, n: int) -> None:
    props = pb.SystemProperties(message_id=f"m-{lite}-{n}", message_type=pb.LITE, lite_topic=lite)
    message = pb.Message(topic=pb.Resource(name=PARENT), body=lite.encode(), system_properties=props)
    reply = stub.SendMessage(spb.SendMessageRequest(messages=[message]), metadata=signed(keys, "p"), timeout=10)
    assert reply.status.code == pb.OK, reply.status


def receive(stub: sg.MessagingServiceStub, keys: tuple[str, str], client_id: str, group: str, wait_s: int) -> list[str]:
    request = spb.ReceiveMessageRequest(
        group=pb.Resource(name=group), message_queue=pb.MessageQueue(topic=pb.Resource(name=PARENT)), batch_size=32
    )
    request.invisible_duration.seconds = 30
    request.long_polling_timeout.seconds = wait_s
    frames = list(stub.ReceiveMessage(request, metadata=signed(keys, client_id), timeout=wait_s + 10))
    return sorted(f.message.system_properties.lite_topic for f in frames if f.HasField("message"))


def test_a_wildcard_registration_needs_sub_on_all_it_receives(broker: BrokerProcess) -> None:
    with grpc.insecure_channel(broker.endpoint) as channel:
        stub = sg.MessagingServiceStub(channel)
        for lites in ([], ["b-x"]):  # the set a wildcard group ignores
            refused = register(stub, BOB, "bob-1", "wild", lites)
            assert refused.code == pb.FORBIDDEN and "may not Sub on Lite:shared/*" in refused.message, refused
        assert register(stub, BOB, "bob-2", "wild-b", []).code == pb.OK  # its patterns are within his prefix
        assert register(stub, CAROL, "carol-1", "wild", []).code == pb.OK  # she may read the whole parent
        send(stub, ALICE, "a-secret", 0)
        send(stub, BOB, "b-x", 0)
        assert receive(stub, BOB, "bob-1", "wild", 1) == []
        assert receive(stub, BOB, "bob-2", "wild-b", 5) == ["b-x"]
        eventually(lambda: receive(stub, CAROL, "carol-1", "wild", 2) == ["a-secret", "b-x"], "carol's wildcard")


def test_taking_sub_away_ends_a_wildcard_registration(broker: BrokerProcess) -> None:
    with grpc.insecure_channel(broker.endpoint) as channel:
        stub = sg.MessagingServiceStub(channel)
        assert register(stub, CAROL, "carol-1", "wild", []).code == pb.OK
        send(stub, ALICE, "a-1", 0)
        eventually(lambda: receive(stub, CAROL, "carol-1", "wild", 2) == ["a-1"], "carol's first message")
        with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
            assert admin.delete_acl("carol", f"Topic:{PARENT}") == 1
        eventually(lambda: "client carol-1, user carol: lite subscriptions of shared in group wild no longer allowed "
                   "ended" in broker.log(), "the registration ended")  # fmt: skip
        send(stub, ALICE, "a-2", 1)
        assert receive(stub, CAROL, "carol-1", "wild", 3) == []  # ended, as a COMPLETE_REMOVE
