"""Raw v2 calls on a real broker process with grpc.aio stubs, for the protocol suites (test_parked_caps.py,
test_native_edge.py): the official clients' headers, a connection of one's own, long polls, and the broker's
metrics read over HTTP."""

from __future__ import annotations

import urllib.request
from typing import TYPE_CHECKING, Final

import grpc
from waiting import eventually_async

from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc
from lmq_broker.testing import BrokerProcess

if TYPE_CHECKING:  # only in the type stubs
    from lmq_broker.protocol.gen.apache.rocketmq.v2.service_pb2_grpc import MessagingServiceAsyncStub as Stub

PARENT: Final = "AGENT_TASK_NS"
GROUP: Final = "executor-group"


def headers(client_id: str) -> tuple[tuple[str, str], ...]:
    return (("x-mq-client-id", client_id), ("x-mq-language", "JAVA"), ("x-mq-client-version", "5.0.8"))


def connection(broker: BrokerProcess) -> tuple[grpc.aio.Channel, Stub]:
    """A channel on a TCP connection of its own (channels to one target otherwise share one)."""
    channel = grpc.aio.insecure_channel(broker.endpoint, options=[("grpc.use_local_subchannel_pool", 1)])
    stub: Stub = service_pb2_grpc.MessagingServiceStub(channel)
    return channel, stub


def metric(broker: BrokerProcess, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=5) as response:
        lines = response.read().decode().splitlines()
    wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    for line in lines:
        if line.split(" ")[0] == wanted:
            return float(line.split(" ")[1])
    return 0.0


def poll_request(wait_s: int = 20) -> spb.ReceiveMessageRequest:
    request = spb.ReceiveMessageRequest(
        group=pb.Resource(name=GROUP), message_queue=pb.MessageQueue(topic=pb.Resource(name=PARENT)),
        batch_size=8, auto_renew=True,
    )  # fmt: skip
    request.long_polling_timeout.seconds = wait_s
    return request


async def poll(stub: Stub, client_id: str, wait_s: int = 20) -> list[spb.ReceiveMessageResponse]:
    return [frame async for frame in stub.ReceiveMessage(poll_request(wait_s), metadata=headers(client_id), timeout=30)]


def code_of(frames: list[spb.ReceiveMessageResponse]) -> str:
    return pb.Code.Name(next(frame.status.code for frame in frames if frame.HasField("status")))


async def parked(broker: BrokerProcess, count: int) -> None:
    await eventually_async(lambda: metric(broker, "lmq_parked_polls") == count, f"{count} parked polls")
