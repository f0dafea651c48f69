"""Access control on the v2 calls the e2e tests reach only through the official client's start: Telemetry
settings (a consumer's group and topics), ReceiveMessage and QueryAssignment, on a whole broker in this process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from lmq_broker import app, model
from lmq_broker.access import document, policy
from lmq_broker.dispatch import testing as dispatch_testing
from lmq_broker.protocol import auth
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as service_grpc

PARENT = "P"
ALICE = ("alice", "alice-secret-1")
pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def broker(tmp_path: Path) -> AsyncIterator[app.Broker]:
    config = dispatch_testing.config_for(
        tmp_path / "data", host="127.0.0.1", port=0, metrics_port=-1, acl=True,
        admin_access_key="admin-ak", admin_secret_key="admin-sk",
    )  # fmt: skip
    started = app.Broker(config)
    await started.start()
    assert started.store is not None and started.access is not None
    started.store.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
    for name in ("a-group", "b-group"):
        started.store.put_group(model.LiteGroup(name, PARENT))
    started.dispatcher.metadata_changed()  # type: ignore[union-attr]
    allowed = (
        policy.Entry("alice", "Group:a-group", (policy.Action.SUB,)),
        policy.Entry("alice", f"Lite:{PARENT}/a-*", (policy.Action.SUB,)),
    )
    started.access.load(document.Document((policy.User(*ALICE),), allowed))
    yield started
    await started.stop(0.2)


def headers(keys: tuple[str, str] | None = ALICE) -> tuple[tuple[str, str], ...]:
    base = (("x-mq-client-id", "c1"), ("x-mq-language", "JAVA"), ("x-mq-client-version", "5.0.8"))
    return base if keys is None else (*base, *auth.sign_metadata(*keys, datetime.now(UTC)))


async def first_frame(
    stub: service_grpc.MessagingServiceAsyncStub, group: str, keys: tuple[str, str] | None
) -> pb.Status:
    settings = pb.Settings(
        client_type=pb.LITE_PUSH_CONSUMER,
        subscription=pb.Subscription(
            group=pb.Resource(name=group), subscriptions=[pb.SubscriptionEntry(topic=pb.Resource(name=PARENT))]
        ),
    )
    done = asyncio.Event()

    async def commands() -> AsyncIterator[spb.TelemetryCommand]:
        yield spb.TelemetryCommand(settings=settings)
        await done.wait()

    stream = stub.Telemetry(commands(), metadata=headers(keys))
    try:
        frame = await stream.read()
        assert isinstance(frame, spb.TelemetryCommand)
        return frame.status
    finally:
        done.set()
        stream.cancel()


async def test_settings_receive_and_assignment_need_sub_on_the_group(broker: app.Broker) -> None:
    async with grpc.aio.insecure_channel(broker.endpoint) as channel:
        stub = service_grpc.MessagingServiceStub(channel)
        assert (await first_frame(stub, "a-group", ALICE)).code == pb.OK
        refused = await first_frame(stub, "b-group", ALICE)
        assert refused.code == pb.FORBIDDEN and "user alice may not Sub on Group:b-group" in refused.message
        with pytest.raises(grpc.aio.AioRpcError) as unsigned:
            await first_frame(stub, "a-group", None)
        assert unsigned.value.code() == grpc.StatusCode.UNAUTHENTICATED
        queue = pb.MessageQueue(topic=pb.Resource(name=PARENT))
        for group, code in (("a-group", pb.OK), ("b-group", pb.FORBIDDEN)):
            request = spb.QueryAssignmentRequest(topic=pb.Resource(name=PARENT), group=pb.Resource(name=group))
            assert (await stub.QueryAssignment(request, metadata=headers())).status.code == code
            receive = spb.ReceiveMessageRequest(group=pb.Resource(name=group), message_queue=queue, batch_size=1)
            receive.long_polling_timeout.seconds = 0
            receive.long_polling_timeout.nanos = 0
            frames = [f async for f in stub.ReceiveMessage(receive, metadata=headers())]
            statuses = [f.status.code for f in frames if f.HasField("status")]
            assert (code == pb.FORBIDDEN) == (statuses == [pb.FORBIDDEN]), statuses
    assert broker.access is not None and broker.access.refused[("alice", "Sub")] == 3
