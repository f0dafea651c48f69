"""Remembered signatures under ``--acl`` (issue 29): the broker checks each distinct signed header once
(``auth.Verifier``: a client repeats one header through the second it signs), and what it remembers never
admits what a fresh check would refuse: a wrong signature with the same date-time, a secret changed, a user
disabled or deleted, a date-time that has left the window. On a real broker process, changed through its admin
service; every call of a test repeats one header, as a client does within a second."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from waiting import eventually

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.admin.results import AclEntry
from lmq_broker.protocol import auth
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as sg
from lmq_broker.testing import BrokerProcess, start_broker

PARENT, GROUP = "chat", "a-group"
ALICE = ("alice", "alice-secret-1")
SKEW_S = 10  # --auth-max-skew-ms of the broker under test


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    process = start_broker(tmp_path / "data", extra_args=["--acl", "--auth-max-skew-ms", str(SKEW_S * 1000)])
    with AdminClient(process.admin_endpoint, timeout_s=10, **process.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
        admin.put_group(model.LiteGroup(GROUP, PARENT))
        admin.put_user(*ALICE)
        admin.put_acl(
            [AclEntry("alice", f"Lite:{PARENT}/a-*", ("Pub", "Sub")), AclEntry("alice", f"Group:{GROUP}", ("Sub",))]
        )
    yield process
    process.stop()


@pytest.fixture
def stub(broker: BrokerProcess) -> Iterator[sg.MessagingServiceStub]:
    with grpc.insecure_channel(broker.endpoint) as channel:
        yield sg.MessagingServiceStub(channel)


@pytest.fixture
def admin(broker: BrokerProcess) -> Iterator[AdminClient]:
    with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as client:
        yield client


def signed(access_key: str, secret_key: str, at: datetime) -> tuple[tuple[str, str], ...]:
    return (("x-mq-client-id", "alice-1"), *auth.sign_metadata(access_key, secret_key, at))


def route(stub: sg.MessagingServiceStub, headers: tuple[tuple[str, str], ...]) -> pb.Status:
    """A QueryRoute of the parent (alice may: Pub/Sub on lite topics of it), signed with ``headers``."""
    request = spb.QueryRouteRequest(topic=pb.Resource(name=PARENT))
    reply: spb.QueryRouteResponse = stub.QueryRoute(request, metadata=headers, timeout=10)
    return reply.status


def admitted(status: pb.Status) -> bool:
    assert status.code in (pb.OK, pb.UNAUTHORIZED), status  # nothing else may come of these calls
    return status.code == pb.OK


def test_a_remembered_signature_admits_no_other_signature_of_its_date_time(stub: sg.MessagingServiceStub) -> None:
    now = datetime.now(UTC)
    good = signed(*ALICE, now)
    assert admitted(route(stub, good)) and admitted(route(stub, good))  # the second one: remembered
    wrong = signed("alice", "not-her-secret", now)  # same user, same date-time: only the signature differs
    refused = route(stub, wrong)
    assert refused.code == pb.UNAUTHORIZED and "signature does not match" in refused.message
    assert not admitted(route(stub, wrong))  # a refusal remembered is a refusal
    unknown = signed("mallory", ALICE[1], now)  # alice's secret under another name: another signature
    assert "unknown access key" in route(stub, unknown).message
    earlier = (now - timedelta(seconds=1)).strftime(auth.DATE_TIME_FORMAT)
    moved = ((auth.DATE_TIME, earlier), (auth.AUTHORIZATION, dict(good)[auth.AUTHORIZATION]))
    assert not admitted(route(stub, moved))  # her signature of `now` is not one of a second earlier
    assert admitted(route(stub, good))


def test_a_changed_secret_a_disabled_or_deleted_user_ends_what_was_remembered(
    stub: sg.MessagingServiceStub, admin: AdminClient
) -> None:
    now = datetime.now(UTC)
    old = signed(*ALICE, now)
    assert admitted(route(stub, old)) and admitted(route(stub, old))
    admin.put_user("alice", "alice-secret-2")  # applied before the admin call returns
    assert not admitted(route(stub, old))
    new = signed("alice", "alice-secret-2", now)
    assert admitted(route(stub, new)) and admitted(route(stub, new))
    admin.put_user("alice", enabled=False)
    assert "unknown access key" in route(stub, new).message
    admin.put_user("alice", enabled=True)
    assert admitted(route(stub, new))
    admin.delete_user("alice")
    assert not admitted(route(stub, new))
    assert not admitted(route(stub, old))


def test_a_remembered_signature_ends_when_its_date_time_leaves_the_window(stub: sg.MessagingServiceStub) -> None:
    # Signed SKEW_S - 4 s ago: admitted now (and remembered), refused once the broker's clock has moved on by 4 s
    # more; the same header all along, as a client replaying it would send.
    header = signed(*ALICE, datetime.now(UTC) - timedelta(seconds=SKEW_S - 4))
    assert admitted(route(stub, header)) and admitted(route(stub, header))

    def refusal() -> pb.Status | None:
        status = route(stub, header)
        return None if admitted(status) else status

    refused = eventually(refusal, "the remembered header refused", 20)
    assert refused is not None and "from the broker's UTC clock" in refused.message
    future = signed(*ALICE, datetime.now(UTC) + timedelta(seconds=SKEW_S + 60))
    assert "from the broker's UTC clock" in route(stub, future).message
