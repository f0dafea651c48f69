"""Access control across a cluster of two whole brokers in this process (real ports, real stores): a user
and its policies put through one broker reach the other; a send through one broker is decided there and
forwarded to the owner, which trusts its peer (signed with the admin pair, the peer header); a policy change
made through either broker applies on both from the next call."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from acl_testing import acl_cluster, admin_call
from waiting import eventually_async

from lmq_broker import app, model
from lmq_broker.cluster import membership as mb
from lmq_broker.protocol import auth
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as service_grpc
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as admin_pb

PARENT = "P"
ALICE = ("alice", "alice-secret-1")
pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def brokers(tmp_path: Path) -> AsyncIterator[list[app.Broker]]:
    async with acl_cluster(tmp_path, PARENT) as started:
        yield started


def lites_of(brokers: list[app.Broker], slot: int, prefix: str) -> list[str]:
    membership = mb.Membership.parse(brokers[0].config.peers)
    owned = (f"{prefix}-{i}" for i in range(1000))
    return [x for x in owned if mb.owner(membership, model.QueueId.lmq(PARENT, x).topic) == slot][:2]


async def send(broker: app.Broker, lites: list[str]) -> pb.Status:
    messages = [
        pb.Message(
            topic=pb.Resource(name=PARENT), body=lite.encode(),
            system_properties=pb.SystemProperties(message_id=f"m-{lite}", message_type=pb.LITE, lite_topic=lite),
        )
        for lite in lites
    ]  # fmt: skip
    headers = (("x-mq-client-id", "c1"), *auth.sign_metadata(*ALICE, datetime.now(UTC)))
    async with grpc.aio.insecure_channel(broker.endpoint) as channel:
        reply = await service_grpc.MessagingServiceStub(channel).SendMessage(
            spb.SendMessageRequest(messages=messages), metadata=headers
        )
    return reply.status


def holds(broker: app.Broker, lite: str) -> bool:
    assert broker.store is not None
    return broker.store.lite_topic(PARENT, lite) is not None


async def test_users_and_policies_reach_every_broker_and_forwarded_sends_are_decided_once(
    brokers: list[app.Broker],
) -> None:
    first, second = brokers
    await admin_call(first, "PutUser", admin_pb.PutUserRequest(user=admin_pb.User(name=ALICE[0], secret=ALICE[1])))
    entry = admin_pb.AclEntry(user="alice", resource=f"Lite:{PARENT}/a-*", actions=["Pub"])
    await admin_call(first, "PutAcl", admin_pb.PutAclRequest(entries=[entry]))
    for broker in brokers:  # sent on: both know alice and her entry
        assert broker.access is not None and broker.access.secret_of("alice") == ALICE[1]
    here, there = lites_of(brokers, 0, "a"), lites_of(brokers, 1, "a")
    assert (await send(first, here + there)).code == pb.OK  # the owner of ``there`` trusts its peer's copy
    assert all(holds(first, x) for x in here) and all(holds(second, x) for x in there)
    forbidden = lites_of(brokers, 1, "b")
    refused = await send(first, [*here, *forbidden])
    assert refused.code == pb.FORBIDDEN and "user alice may not Pub on Lite:P/b-" in refused.message
    assert not any(holds(second, x) or holds(first, x) for x in forbidden)  # nothing stored anywhere
    deny = admin_pb.AclEntry(user="alice", resource=f"Lite:{PARENT}/{there[0]}", actions=["Pub"], decision="Deny")
    await admin_call(second, "PutAcl", admin_pb.PutAclRequest(entries=[deny]))  # through the other broker
    assert (await send(first, [there[0]])).code == pb.FORBIDDEN  # applies on the first at once
    await admin_call(second, "DeleteUser", admin_pb.DeleteUserRequest(name="alice"))
    assert (await send(first, here)).code == pb.UNAUTHORIZED  # gone everywhere: she cannot sign in


async def sync_lite(broker: app.Broker, action: pb.LiteSubscriptionAction.ValueType, lites: list[str]) -> pb.Status:
    request = spb.SyncLiteSubscriptionRequest(
        action=action, topic=pb.Resource(name=PARENT), group=pb.Resource(name="a-group"), lite_topic_set=lites
    )
    headers = (("x-mq-client-id", "c1"), *auth.sign_metadata(*ALICE, datetime.now(UTC)))
    async with grpc.aio.insecure_channel(broker.endpoint) as channel:
        reply = await service_grpc.MessagingServiceStub(channel).SyncLiteSubscription(request, metadata=headers)
    return reply.status


async def test_taking_sub_away_ends_lite_subscriptions_at_every_broker(brokers: list[app.Broker]) -> None:
    """Issue 29: a lite subscription made through one broker, held at its owner, ends there too once a policy
    change (made through the other broker) takes Sub away; the allowed ones stay."""
    first, second = brokers
    await admin_call(first, "PutUser", admin_pb.PutUserRequest(user=admin_pb.User(name=ALICE[0], secret=ALICE[1])))
    await admin_call(first, "PutLiteGroup", admin_pb.PutLiteGroupRequest(group=admin_pb.LiteGroup(
        name="a-group", bind_topic=PARENT, consume_enabled=True)))  # fmt: skip
    entries = [
        admin_pb.AclEntry(user="alice", resource=f"Lite:{PARENT}/a-*", actions=["Sub"]),
        admin_pb.AclEntry(user="alice", resource="Group:a-group", actions=["Sub"]),
    ]
    await admin_call(first, "PutAcl", admin_pb.PutAclRequest(entries=entries))
    here, there = lites_of(brokers, 0, "a")[0], lites_of(brokers, 1, "a")[0]
    assert (await sync_lite(first, pb.PARTIAL_ADD, [here, there])).code == pb.OK
    assert there in (second.dispatcher.lite_topics_of("c1") or [])  # type: ignore[union-attr]
    deny = admin_pb.AclEntry(user="alice", resource=f"Lite:{PARENT}/{there}", actions=["Sub"], decision="Deny")
    await admin_call(second, "PutAcl", admin_pb.PutAclRequest(entries=[deny]))

    def ended() -> bool:
        assert first.dispatcher is not None and second.dispatcher is not None
        return there not in (second.dispatcher.lite_topics_of("c1") or []) and here in (
            first.dispatcher.lite_topics_of("c1") or []
        )

    await eventually_async(ended, "the revoked subscription ended at its owner")
