"""A stopping owner on the local hop (``cluster.local_hop.HopServer.close``), in one process over a real Unix
socket: the request it was serving when the stop began is answered with the owner's own reply, and one that
arrives after is refused as a stopping gRPC server refuses (nothing stored, try again), not left unanswered."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from lmq_broker.cluster import local_hop
from lmq_broker.protocol.admission import Admission
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.metrics import Metrics

pytestmark = pytest.mark.asyncio

SECRET = b"closing-test-secret"
TARGET = "127.0.0.1:7001"  # the owner's member endpoint: its socket is <dir>/7001.sock


def request(lite: str) -> bytes:
    props = pb.SystemProperties(message_id=lite, message_type=pb.LITE, lite_topic=lite)
    message = pb.Message(topic=pb.Resource(name="P"), body=b"x", system_properties=props)
    return spb.SendMessageRequest(messages=[message]).SerializeToString()


async def test_a_stopping_owner_answers_what_it_serves_and_refuses_what_comes_after(tmp_path: Path) -> None:
    directory = tmp_path / "hop"
    path = local_hop.socket_path(directory, TARGET)
    assert path is not None
    serving, release = asyncio.Event(), asyncio.Event()
    stored: list[str] = []

    async def send(req: spb.SendMessageRequest, data: bytes) -> spb.SendMessageResponse:
        assert spb.SendMessageRequest.FromString(data) == req  # the bytes it was decoded from
        serving.set()
        await release.wait()
        stored.append(req.messages[0].system_properties.lite_topic)
        return spb.SendMessageResponse(status=pb.Status(code=pb.OK, message="stored"))

    metrics = Metrics(CollectorRegistry())
    server = local_hop.HopServer(path, SECRET, send, Admission(0), metrics, metrics.registry)
    await server.start()
    hop = local_hop.Hop(directory, SECRET, lambda: 1, "127.0.0.1:7000")
    try:
        first = asyncio.ensure_future(hop.call(TARGET, request("before"), 10))
        await asyncio.wait_for(serving.wait(), 10)
        closing = asyncio.ensure_future(server.close())
        await asyncio.sleep(0)  # the stop has begun: it waits for the send under way
        assert not closing.done()

        after = spb.SendMessageResponse.FromString(await hop.call(TARGET, request("after"), 10))
        assert after.status.code == pb.INTERNAL_ERROR
        assert "stopping" in after.status.message and "nothing was stored" in after.status.message

        release.set()
        answered = spb.SendMessageResponse.FromString(await first)
        assert (answered.status.code, answered.status.message) == (pb.OK, "stored")
        await asyncio.wait_for(closing, 10)
        assert stored == ["before"]  # the refused one never reached the store
        assert not path.exists()
    finally:
        release.set()
        await hop.close()
        await server.close()


async def test_a_member_of_another_pod_on_a_siblings_port_is_not_reached_over_the_local_hop(tmp_path: Path) -> None:
    """Every pod of a StatefulSet uses the same ports and sockets are named by port: pod 1's process on 7001
    must not be taken for this pod's sibling on 7001 (its forward would reach a broker that does not own it)."""
    directory = tmp_path / "hop"
    directory.mkdir()
    path = local_hop.socket_path(directory, "lmq-0.lmq:7001")
    assert path is not None
    path.touch()  # this pod's sibling on 7001 listens
    hop = local_hop.Hop(directory, SECRET, lambda: 1, "lmq-0.lmq:7000")
    try:
        assert hop.reaches("lmq-0.lmq:7001")
        assert not hop.reaches("lmq-1.lmq:7001")
        with pytest.raises(FileNotFoundError, match="no sibling"):
            await hop.call("lmq-1.lmq:7001", b"x", 1)
    finally:
        await hop.close()
