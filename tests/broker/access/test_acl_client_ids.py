"""Access control and client ids (``--acl``): a client id whose lite subscriptions one user made is that user's,
and an MQTT session's consumer is no v2 user's.

Deliveries follow the client id's lite subscriptions, not the caller's rights: before this, a user with ``Sub`` on
a group it shares with another user (each with a lite prefix of its own, ``Group:together`` for both) received
the other's lite topics by naming the other's client id in ``x-mq-client-id``, and could change or end its
subscriptions (found in the access-control audit; these tests failed with bob receiving alice's message). Now
such calls are FORBIDDEN (40300), at the broker the client calls and at the owner of the lite topic, which a
cluster's forwarded calls tell whose client id it is (``x-lmq-on-behalf-of``, believed only from the admin pair).
Likewise a v2 user with ``Sub`` on ``Group:*`` received (and took away) an MQTT session's messages by naming the
session's group (``%MQTT%<client id>``) and consumer id (``<group>@<parent>``), and could put a lite group of that
name (rebinding or stopping the session's deliveries): MQTT groups are granted by no rule, only super users have them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from acl_metrics import acl_refused
from acl_testing import acl_cluster, admin_call, start_acl_broker
from testing_mqtt import Peer

from lmq_broker import app, errors, model
from lmq_broker.admin.client import AdminClient
from lmq_broker.admin.results import AclEntry
from lmq_broker.cluster import membership as mb
from lmq_broker.protocol import auth
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as sg
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as admin_pb
from lmq_broker.testing import BrokerProcess

PARENT, GROUP = "shared", "together"
ALICE, BOB = ("alice", "alice-secret-1"), ("bob", "bob-secret-1")
Headers = tuple[tuple[str, str], ...]
EVERY_GROUP = ("Sub", "Create", "Update", "Delete", "Get", "List")


def signed(keys: tuple[str, str], client_id: str, *more: tuple[str, str]) -> Headers:
    return (("x-mq-client-id", client_id), *more, *auth.sign_metadata(*keys, datetime.now(UTC)))


def sync(action: pb.LiteSubscriptionAction.ValueType, lites: list[str]) -> spb.SyncLiteSubscriptionRequest:
    return spb.SyncLiteSubscriptionRequest(
        action=action, topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP), lite_topic_set=lites
    )


def sending(lite: str) -> spb.SendMessageRequest:
    props = pb.SystemProperties(message_id=f"m-{lite}", message_type=pb.LITE, lite_topic=lite)
    message = pb.Message(topic=pb.Resource(name=PARENT), body=f"for {lite}".encode(), system_properties=props)
    return spb.SendMessageRequest(messages=[message])


def receiving(wait_s: int) -> spb.ReceiveMessageRequest:
    request = spb.ReceiveMessageRequest(
        group=pb.Resource(name=GROUP), message_queue=pb.MessageQueue(topic=pb.Resource(name=PARENT)), batch_size=32
    )
    request.invisible_duration.seconds = 30
    request.long_polling_timeout.seconds = wait_s
    return request


def outcome(frames: list[spb.ReceiveMessageResponse]) -> tuple[int, list[str]]:
    """The status a receive answered and the lite topics of the messages it handed out."""
    codes = [f.status.code for f in frames if f.HasField("status")]
    return codes[0], [f.message.system_properties.lite_topic for f in frames if f.HasField("message")]


def policies(user: str, prefix: str) -> list[AclEntry]:
    return [AclEntry(user, f"Lite:{PARENT}/{prefix}-*", ("Pub", "Sub")), AclEntry(user, f"Group:{GROUP}", ("Sub",))]


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    process = start_acl_broker(tmp_path / "data", PARENT)
    with AdminClient(process.admin_endpoint, timeout_s=10, **process.admin_keys) as admin:
        admin.put_group(model.LiteGroup(GROUP, PARENT))
        for (name, secret), prefix in ((ALICE, "a"), (BOB, "b")):
            admin.put_user(name, secret)
            admin.put_acl(policies(name, prefix))
    yield process
    assert process.stop() == 0, process.log()[-4000:]


def test_another_users_client_id_is_forbidden_and_takes_nothing_of_it(broker: BrokerProcess) -> None:
    with grpc.insecure_channel(broker.endpoint) as channel:
        stub = sg.MessagingServiceStub(channel)
        assert stub.SyncLiteSubscription(sync(pb.PARTIAL_ADD, ["a-secret"]), metadata=signed(ALICE, "alice-1"),
                                         timeout=10).status.code == pb.OK  # fmt: skip
        assert stub.SendMessage(sending("a-secret"), metadata=signed(ALICE, "alice-p"), timeout=10).status.code == pb.OK
        before = acl_refused(broker.metrics_url, "bob", "Sub")
        # bob names alice's client id (a forged on-behalf header changes nothing: he is no super user)
        for extra in ((), (("x-lmq-on-behalf-of", "alice"),)):
            frames = list(stub.ReceiveMessage(receiving(1), metadata=signed(BOB, "alice-1", *extra), timeout=15))
            code, got = outcome(frames)
            assert (code, got) == (pb.FORBIDDEN, []), frames
            assert "user bob may not use client id alice-1" in frames[0].status.message
        for action, lites in ((pb.PARTIAL_ADD, ["b-x"]), (pb.COMPLETE_REMOVE, [])):
            reply = stub.SyncLiteSubscription(sync(action, lites), metadata=signed(BOB, "alice-1"), timeout=10)
            assert reply.status.code == pb.FORBIDDEN, reply.status
        ending = spb.NotifyClientTerminationRequest(group=pb.Resource(name=GROUP))
        ended = stub.NotifyClientTermination(ending, metadata=signed(BOB, "alice-1"), timeout=10)
        assert ended.status.code == pb.FORBIDDEN, ended.status
        beating = spb.HeartbeatRequest(group=pb.Resource(name=GROUP), client_type=pb.LITE_SIMPLE_CONSUMER)
        beat = stub.Heartbeat(beating, metadata=signed(BOB, "alice-1"), timeout=10)  # would change her client's type
        assert beat.status.code == pb.FORBIDDEN, beat.status
        # nor her Telemetry stream (her notices, and what ends with her stream)
        with pytest.raises(grpc.RpcError) as stream:
            list(stub.Telemetry(iter(()), metadata=signed(BOB, "alice-1"), timeout=10))
        assert stream.value.code() == grpc.StatusCode.PERMISSION_DENIED, stream.value
        assert acl_refused(broker.metrics_url, "bob", "Sub") >= before + 7
        # alice's subscription and message are untouched: nothing was leased to bob
        code, got = outcome(list(stub.ReceiveMessage(receiving(5), metadata=signed(ALICE, "alice-1"), timeout=20)))
        assert (code, got) == (pb.OK, ["a-secret"])
        # bob's own client id is his
        reply = stub.SyncLiteSubscription(sync(pb.PARTIAL_ADD, ["b-x"]), metadata=signed(BOB, "bob-1"), timeout=10)
        assert reply.status.code == pb.OK


# --- a cluster: the owner of the lite topic is told whose client id it is ------------------------------------


@pytest_asyncio.fixture
async def brokers(tmp_path: Path) -> AsyncIterator[list[app.Broker]]:
    async with acl_cluster(tmp_path, PARENT) as started:
        yield started


@pytest.mark.asyncio
async def test_the_owner_of_a_lite_topic_refuses_another_users_client_id(brokers: list[app.Broker]) -> None:
    """alice subscribes through the first broker to a lite topic the second owns (her subscription reaches it
    forwarded, signed by the admin pair); bob then asks the second broker itself under her client id."""
    first, second = brokers
    group = admin_pb.LiteGroup(name=GROUP, bind_topic=PARENT, consume_enabled=True)
    await admin_call(first, "PutLiteGroup", admin_pb.PutLiteGroupRequest(group=group))
    for (name, secret), prefix in ((ALICE, "a"), (BOB, "b")):
        await admin_call(first, "PutUser", admin_pb.PutUserRequest(user=admin_pb.User(name=name, secret=secret)))
        entries = [
            admin_pb.AclEntry(user=e.user, resource=e.resource, actions=e.actions) for e in policies(name, prefix)
        ]
        await admin_call(first, "PutAcl", admin_pb.PutAclRequest(entries=entries))
    membership = mb.Membership.parse(first.config.peers)
    there = next(
        x for x in (f"a-{i}" for i in range(1000)) if mb.owner(membership, model.QueueId.lmq(PARENT, x).topic) == 1
    )
    async with grpc.aio.insecure_channel(first.endpoint) as one, grpc.aio.insecure_channel(second.endpoint) as two:
        via_first, at_owner = sg.MessagingServiceStub(one), sg.MessagingServiceStub(two)
        reply = await via_first.SyncLiteSubscription(sync(pb.PARTIAL_ADD, [there]), metadata=signed(ALICE, "alice-1"))
        assert reply.status.code == pb.OK
        assert second.dispatcher is not None and second.dispatcher.subscriber("alice-1") == "alice"
        # saved with her address, not the first broker's: rules naming networks are checked there as hers
        assert first.dispatcher is not None
        assert second.dispatcher.subscription_owner("alice-1") == first.dispatcher.subscription_owner("alice-1")
        assert (await via_first.SendMessage(sending(there), metadata=signed(ALICE, "alice-p"))).status.code == pb.OK
        forged = (("x-lmq-on-behalf-of", "alice"), ("x-lmq-peer", "1;0;00"))
        for extra in ((), forged):
            frames = [f async for f in at_owner.ReceiveMessage(receiving(1), metadata=signed(BOB, "alice-1", *extra))]
            assert outcome(frames) == (pb.FORBIDDEN, []), frames
        frames = [f async for f in at_owner.ReceiveMessage(receiving(5), metadata=signed(ALICE, "alice-1"))]
        assert outcome(frames) == (pb.OK, [there])  # hers, and nothing of it was leased to bob
        # a LiteSimpleConsumer's receives gather from every broker: alice-2 subscribes at the owner itself, which
        # the first broker never hears of; bob makes the first gather for him under her id (his heartbeat says
        # LiteSimpleConsumer), and the owner, told it is bob's call, refuses; hers through the first get it
        there2 = next(
            x for x in (f"a-g{i}" for i in range(1000)) if mb.owner(membership, model.QueueId.lmq(PARENT, x).topic) == 1
        )
        reply = await at_owner.SyncLiteSubscription(sync(pb.PARTIAL_ADD, [there2]), metadata=signed(ALICE, "alice-2"))
        assert reply.status.code == pb.OK
        assert (await via_first.SendMessage(sending(there2), metadata=signed(ALICE, "alice-p"))).status.code == pb.OK
        beating = spb.HeartbeatRequest(group=pb.Resource(name=GROUP), client_type=pb.LITE_SIMPLE_CONSUMER)
        for keys in (BOB, ALICE):
            beat = await via_first.Heartbeat(beating, metadata=signed(keys, "alice-2"))
            assert beat.status.code == pb.OK, beat.status
            frames = [f async for f in via_first.ReceiveMessage(receiving(2), metadata=signed(keys, "alice-2"))]
            assert outcome(frames)[1] == ([there2] if keys == ALICE else []), frames


# --- an MQTT session's consumer ---------------------------------------------------------------------------------


@pytest.fixture
def mqtt_broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    process = start_acl_broker(tmp_path / "data", PARENT, "--mqtt-port", "0")
    with AdminClient(process.admin_endpoint, timeout_s=10, **process.admin_keys) as admin:
        admin.put_user(*ALICE)
        admin.put_user(*BOB)
        admin.put_acl([AclEntry("alice", f"Lite:{PARENT}/a-*", ("Pub", "Sub"))])
        admin.put_acl([AclEntry("bob", f"Lite:{PARENT}/b-*", ("Pub", "Sub")), AclEntry("bob", "Group:*", EVERY_GROUP)])
    yield process
    assert process.stop() == 0, process.log()[-4000:]


def test_an_mqtt_sessions_group_is_no_v2_users_even_with_every_group(mqtt_broker: BrokerProcess) -> None:
    """bob may do anything on every group; alice's MQTT session ``am`` is group ``%MQTT%am``, consumer
    ``%MQTT%am@shared``: bob's receives under them are FORBIDDEN, his admin put of that group (which would rebind
    or stop her session's deliveries) PERMISSION_DENIED, and alice gets every message she subscribed to."""
    alice = Peer(mqtt_broker.mqtt_port, "am", auth=ALICE)
    try:
        assert alice.accepted
        assert alice.subscribe((f"{PARENT}/a-x", 1)) == [1]
        group, consumer = "%MQTT%am", f"%MQTT%am@{PARENT}"
        with grpc.insecure_channel(mqtt_broker.endpoint) as channel:
            stub = sg.MessagingServiceStub(channel)
            request = receiving(1)
            request.group.name = group
            frames = list(stub.ReceiveMessage(request, metadata=signed(BOB, consumer), timeout=15))
            assert outcome(frames) == (pb.FORBIDDEN, []), frames
            assert "user bob may not Sub on Group:%MQTT%am" in frames[0].status.message
            subscribing = sync(pb.PARTIAL_ADD, ["b-x"])
            subscribing.group.name = group
            reply = stub.SyncLiteSubscription(subscribing, metadata=signed(BOB, consumer), timeout=10)
            assert reply.status.code == pb.FORBIDDEN, reply.status
        with AdminClient(mqtt_broker.admin_endpoint, timeout_s=10, access_key=BOB[0], secret_key=BOB[1]) as admin:
            with pytest.raises(errors.Forbidden, match="may not Create on Group:%MQTT%am"):
                admin.put_group(model.LiteGroup(group, PARENT, consume_enabled=False))
            assert "%MQTT%am" not in {g.group.name for g in admin.list_groups()}
            admin.put_group(model.LiteGroup("b-group", PARENT))  # his other rights on groups stand
        with grpc.insecure_channel(mqtt_broker.endpoint) as channel:
            stub = sg.MessagingServiceStub(channel)
            for i in range(5):
                assert alice.publish(f"{PARENT}/a-x", b"%d" % i) == 0
        alice.wait_count(5)
        assert sorted(alice.payloads()) == [b"0", b"1", b"2", b"3", b"4"]
    finally:
        alice.client.loop_stop()
        alice.client.disconnect()
