"""Access control in a ``serve --acl --processes 2`` pod (real processes, the local hop's sockets, the native edge):
every port of the pod decides as the access port does. A user allowed on ``a-*`` but not ``b-*`` is FORBIDDEN on
``b-*`` at the pod's port and at each process's own port, for a topic the process owns and one its sibling owns
(forwarded), with or without a forged peer header, and nothing is stored; admin calls without the admin pair are
refused at every port; a subscription made through the pod's port reaches the owning process with its user, so
another user naming that client id at the owner itself is FORBIDDEN while its user receives there."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

import grpc
import pytest
from pods import Pod, start_pod

from lmq_broker import errors, model
from lmq_broker.admin.client import AdminClient
from lmq_broker.admin.results import AclEntry
from lmq_broker.protocol import auth
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as sg
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as admin_pb
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2_grpc as admin_grpc
from lmq_broker.testing import SHARED_ADMIN_ENV, SHARED_ADMIN_KEYS

PARENT: Final = "ACL_POD"
GROUP: Final = "together"
ALICE, BOB = ("alice", "alice-secret-1"), ("bob", "bob-secret-1")


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[Pod]:
    started = start_pod(tmp_path / "data", PARENT, ["--acl"], {**SHARED_ADMIN_ENV, "LMQ_CLUSTER_SECRET": "acl-pod-s"})
    try:
        with AdminClient(started.broker.endpoint, timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
            admin.put_group(model.LiteGroup(GROUP, PARENT))
            for (name, secret), prefix in ((ALICE, "a"), (BOB, "b")):
                admin.put_user(name, secret)
                admin.put_acl(
                    [
                        AclEntry(name, f"Lite:{PARENT}/{prefix}-*", ("Pub", "Sub")),
                        AclEntry(name, f"Group:{GROUP}", ("Sub",)),
                    ]
                )
        yield started
    finally:
        started.broker.stop()


def signed(keys: tuple[str, str], client_id: str, *more: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    return (("x-mq-client-id", client_id), *more, *auth.sign_metadata(*keys, datetime.now(UTC)))


def send(endpoint: str, lite: str, *more: tuple[str, str]) -> int:
    props = pb.SystemProperties(message_id=f"m-{lite}", message_type=pb.LITE, lite_topic=lite)
    message = pb.Message(topic=pb.Resource(name=PARENT), body=lite.encode(), system_properties=props)
    with grpc.insecure_channel(endpoint) as channel:
        reply = sg.MessagingServiceStub(channel).SendMessage(
            spb.SendMessageRequest(messages=[message]), metadata=signed(ALICE, "alice-p", *more), timeout=10
        )
    return reply.status.code


def receive(endpoint: str, keys: tuple[str, str], client_id: str) -> tuple[int, list[str]]:
    request = spb.ReceiveMessageRequest(
        group=pb.Resource(name=GROUP), message_queue=pb.MessageQueue(topic=pb.Resource(name=PARENT)), batch_size=8
    )
    request.invisible_duration.seconds = 30
    request.long_polling_timeout.seconds = 3
    with grpc.insecure_channel(endpoint) as channel:
        frames = list(
            sg.MessagingServiceStub(channel).ReceiveMessage(request, metadata=signed(keys, client_id), timeout=15)
        )
    codes = [f.status.code for f in frames if f.HasField("status")]
    return codes[0], [f.message.system_properties.lite_topic for f in frames if f.HasField("message")]


def test_every_port_of_a_pod_decides_as_its_access_port(pod: Pod) -> None:
    ports = [pod.broker.endpoint, *pod.endpoints]
    forged = ("x-lmq-peer", f"1;{int(time.time() * 1000)};{'ab' * 32}")
    allowed = [pod.owned_by(slot, "a", 1)[0] for slot in (0, 1)]
    refused = [pod.owned_by(slot, "b", 1)[0] for slot in (0, 1)]
    for endpoint in ports:
        for lite in allowed:
            assert send(endpoint, lite) == pb.OK
        for lite in refused:
            assert (send(endpoint, lite), send(endpoint, lite, forged)) == (pb.FORBIDDEN, pb.FORBIDDEN)
    for slot, endpoint in enumerate(pod.endpoints):
        with AdminClient(endpoint, timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
            assert admin.describe_lite_topic(PARENT, allowed[slot]).meta.max_offset == 3
            with pytest.raises(errors.NotFound):
                admin.describe_lite_topic(PARENT, refused[slot])  # stored nowhere
        with grpc.insecure_channel(endpoint) as channel:
            stub = admin_grpc.LmqAdminStub(channel)
            for headers, code in (
                ((), grpc.StatusCode.UNAUTHENTICATED),
                (signed(ALICE, "x")[1:], grpc.StatusCode.PERMISSION_DENIED),
            ):
                with pytest.raises(grpc.RpcError) as refusal:
                    stub.ListUsers(admin_pb.ListUsersRequest(), metadata=headers, timeout=10)
                assert refusal.value.code() == code


def test_a_subscription_made_through_the_pods_port_is_its_users_at_the_owning_process(pod: Pod) -> None:
    lite = pod.owned_by(1, "a-own", 1)[0]
    subscribing = spb.SyncLiteSubscriptionRequest(
        action=pb.PARTIAL_ADD, topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP), lite_topic_set=[lite]
    )
    with grpc.insecure_channel(pod.broker.endpoint) as channel:
        reply = sg.MessagingServiceStub(channel).SyncLiteSubscription(
            subscribing, metadata=signed(ALICE, "alice-1"), timeout=10
        )
    assert reply.status.code == pb.OK
    assert send(pod.broker.endpoint, lite) == pb.OK
    owner = pod.endpoints[1]
    assert receive(owner, BOB, "alice-1") == (pb.FORBIDDEN, [])
    assert receive(owner, ALICE, "alice-1") == (pb.OK, [lite])
