"""NotifyClientTermination ends only the caller's own client: a real grpc.aio server, two connections.

The victim's Telemetry stream runs on one channel; a second channel (its own connection: gRPC would
otherwise share one TCP connection between channels of a process) names the victim's client id.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from lmq_broker import app
from lmq_broker.protocol.connections import Connections
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc
from lmq_broker.protocol.testing import Client

PARENT = "AGENT_TASK_NS"
GROUP = "executor-group"
H = Client.headers
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)
SETTINGS = pb.Settings(
    client_type=pb.LITE_PUSH_CONSUMER,
    subscription=pb.Subscription(
        group=pb.Resource(name=GROUP), subscriptions=[pb.SubscriptionEntry(topic=pb.Resource(name=PARENT))]
    ),
)


def subscribed(broker: app.Broker, client_id: str) -> set[str]:
    assert broker.dispatcher is not None
    state = broker.dispatcher.registry.get(client_id)
    return set() if state is None else {name.rsplit("$", 1)[1] for name in state.lite_topics}


async def subscribe(stub: service_pb2_grpc.MessagingServiceAsyncStub, client_id: str, *lites: str) -> None:
    request = spb.SyncLiteSubscriptionRequest(
        action=pb.PARTIAL_ADD,
        topic=pb.Resource(name=PARENT),
        group=pb.Resource(name=GROUP),
        lite_topic_set=list(lites),
    )
    reply = await stub.SyncLiteSubscription(request, metadata=H(client_id))
    assert reply.status.code == pb.OK, reply.status


async def terminate(stub: service_pb2_grpc.MessagingServiceAsyncStub, client_id: str) -> pb.Status:
    reply = await stub.NotifyClientTermination(spb.NotifyClientTerminationRequest(), metadata=H(client_id))
    return reply.status


@pytest.mark.asyncio
async def test_another_connection_cannot_end_a_client_and_the_client_itself_can(
    client: Client, broker: app.Broker
) -> None:
    done = asyncio.Event()

    async def commands() -> AsyncIterator[spb.TelemetryCommand]:
        yield spb.TelemetryCommand(settings=SETTINGS)
        await done.wait()  # the stream stays open, as a running consumer's does

    stream = client.stub.Telemetry(commands(), metadata=H("victim"))
    first = await stream.read()
    assert isinstance(first, spb.TelemetryCommand) and first.status.code == pb.OK
    await subscribe(client.stub, "victim", "a", "b")
    try:
        async with grpc.aio.insecure_channel(client.endpoint, options=OWN_CONNECTION) as other:
            refused = await terminate(service_pb2_grpc.MessagingServiceStub(other), "victim")
        assert refused.code == pb.FORBIDDEN == 40300
        assert "only the client itself" in refused.message
        assert subscribed(broker, "victim") == {"a", "b"}  # nothing ended

        assert (await terminate(client.stub, "victim")).code == pb.OK  # over its own connection, as today
        assert subscribed(broker, "victim") == set()
    finally:
        done.set()
        stream.cancel()


@pytest.mark.asyncio
async def test_a_client_without_an_open_stream_is_ended_as_before(client: Client, broker: app.Broker) -> None:
    await subscribe(client.stub, "streamless", "a")
    async with grpc.aio.insecure_channel(client.endpoint, options=OWN_CONNECTION) as other:
        assert (await terminate(service_pb2_grpc.MessagingServiceStub(other), "streamless")).code == pb.OK
    assert subscribed(broker, "streamless") == set()


def test_connections_count_streams_per_peer() -> None:
    connections = Connections()
    assert connections.owns("c", "ipv4:1.2.3.4:5")  # no stream: nothing to protect
    connections.opened("c", "ipv4:10.0.0.1:100")
    connections.opened("c", "ipv4:10.0.0.1:100")
    assert connections.owns("c", "ipv4:10.0.0.1:100")
    assert not connections.owns("c", "ipv4:10.0.0.2:100")
    connections.closed("c", "ipv4:10.0.0.1:100")
    assert connections.peers_of("c") == ("ipv4:10.0.0.1:100",)
    connections.closed("c", "ipv4:10.0.0.1:100")
    assert connections.peers_of("c") == ()
    assert connections.owns("c", "ipv4:10.0.0.2:100")
    connections.closed("c", "never-opened")  # harmless
