"""Hostile and careless clients against a real broker process, on both edges (grpcio's and the native one): what a
gRPC library never sends, driven by a bare HTTP/2 client (tests/support/raw_h2.py). Each answer must be a proper
status, the broker must stay up and serve others, and what one connection holds must stay capped
(docs/security.md, "Resource caps"):

- streams opened and never sent on: beyond ``--max-streams-per-connection`` a connection's new streams are refused
  (before it, 20,000 such streams on one connection held ~190 MB on the native edge and ~440 MB on grpcio's);
- a long poll whose client stops reading and resets the stream while its messages are being written: the messages
  not written are visible again at once (before it, they stayed leased, an auto-renewed lease renewed for as long
  as the client lived, up to ``--lease-renew-max-ms``, 3 h, from a client that never saw them);
- a Telemetry frame that is not a TelemetryCommand: INVALID_ARGUMENT and nothing else (before it, an INTERNAL_ERROR
  frame came first and the broker logged an ERROR with a stack trace per such stream).
- a stream refused for its signature (client auth): UNAUTHENTICATED on both edges (before it, the native edge
  answered UNKNOWN and logged a stack trace per call).
- headers over 16 KiB: RESOURCE_EXHAUSTED on both edges, the connection serving on.

The broker's log must hold no stack trace at the end (the module's broker): before 2026-11-30 grpcio's edge logged an
ERROR with one (``ExecuteBatchError``) for each reply written to a call its client had reset, as the cut receive does.

Malformed bodies of the unary and server-streaming calls, missing fields and absurd values are in test_fuzz.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import raw_h2
from raw_v2 import GROUP, PARENT, headers, poll_request

from lmq_broker.protocol import auth
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2, admin_pb2_grpc
from lmq_broker.testing import BrokerProcess, start_broker

MAX_STREAMS = 64


@pytest.fixture(scope="module", params=["grpcio", "native"])
def broker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    flags = ["--edge", str(request.param), "--max-streams-per-connection", str(MAX_STREAMS), "--flush-mode", "async"]
    with start_broker(Path(tmp_path_factory.mktemp(str(request.param))) / "data", extra_args=flags) as started:
        yield started
        assert started.alive()
        assert "Traceback" not in started.log(), started.log()[-3000:]


@pytest.fixture
def stub(broker: BrokerProcess) -> Iterator[service_pb2_grpc.MessagingServiceStub]:
    with grpc.insecure_channel(broker.endpoint, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        yield service_pb2_grpc.MessagingServiceStub(channel)


def still_serves(stub: service_pb2_grpc.MessagingServiceStub) -> None:
    route = stub.QueryRoute(spb.QueryRouteRequest(topic=pb.Resource(name=PARENT)), metadata=headers("c"), timeout=10)
    assert route.status.code == pb.OK


def test_streams_past_the_per_connection_cap_are_refused(
    broker: BrokerProcess, stub: service_pb2_grpc.MessagingServiceStub
) -> None:
    opened = 3 * MAX_STREAMS
    with raw_h2.Connection(broker.port) as raw:
        while (got := raw.read()) is not None and not (got.kind == raw_h2.SETTINGS and not got.flags & raw_h2.ACK):
            pass  # the server's settings, acknowledged: from then on they bind the client
        assert got is not None
        cap = raw_h2.settings_of(got.payload).get(raw_h2.MAX_CONCURRENT_STREAMS)
        for i in range(opened):  # a send that never comes: each stream waits for its request
            raw.open(2 * i + 1, "SendMessage", headers(f"idle-{i}"))
        refused: set[int] = set()
        deadline = time.monotonic() + 20
        while len(refused) < opened - MAX_STREAMS and time.monotonic() < deadline:
            got = raw.read()
            assert got is not None, "the connection was closed"
            if got.kind == raw_h2.RST_STREAM and int.from_bytes(got.payload, "big") == raw_h2.REFUSED_STREAM:
                refused.add(got.stream)
        assert cap == MAX_STREAMS  # announced, as gRPC clients queue their calls under it
        assert refused == {2 * i + 1 for i in range(MAX_STREAMS, opened)}  # the first MAX_STREAMS are kept
        still_serves(stub)  # another connection is not held back by this one


def test_a_receive_cut_before_its_messages_were_written_gives_them_back(
    broker: BrokerProcess, stub: service_pb2_grpc.MessagingServiceStub
) -> None:
    lite, count = "cut-receive", 8
    sync = spb.SyncLiteSubscriptionRequest(
        action=pb.PARTIAL_ADD, topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP), lite_topic_set=[lite]
    )
    assert stub.SyncLiteSubscription(sync, metadata=headers("cut"), timeout=10).status.code == pb.OK
    props = [pb.SystemProperties(message_id=f"cut-{i}", message_type=pb.LITE, lite_topic=lite) for i in range(count)]
    big = [pb.Message(topic=pb.Resource(name=PARENT), body=b"x" * 300_000, system_properties=p) for p in props]
    assert (
        stub.SendMessage(spb.SendMessageRequest(messages=big), metadata=headers("p"), timeout=10).status.code == pb.OK
    )
    # A reader with no window at all: the reply waits (past the edge's buffers, 2.4 MB here) with every message
    # of the batch leased, auto-renewed; then the client resets the stream.
    with raw_h2.Connection(broker.port, window=0) as raw:
        raw.open(1, "ReceiveMessage", headers("cut"))
        raw.send(1, poll_request(wait_s=5).SerializeToString())
        while (got := raw.read()) is not None and got.kind != raw_h2.HEADERS:
            pass  # the reply's headers: the receive is under way
        time.sleep(1.0)  # its messages leased and being written
        raw.reset(1)
    started = time.monotonic()
    again = list(stub.ReceiveMessage(poll_request(wait_s=5), metadata=headers("cut"), timeout=15))
    bodies = [f.message.system_properties.message_id for f in again if f.HasField("message")]
    assert sorted(bodies) == sorted(p.message_id for p in props)
    assert time.monotonic() - started < 4  # at once, not after a lease (30 s, renewed)


def test_a_telemetry_frame_that_is_not_a_command_is_invalid_argument_and_nothing_else(broker: BrokerProcess) -> None:
    with grpc.insecure_channel(broker.endpoint) as channel:
        telemetry = channel.stream_stream(
            raw_h2.V2 + "Telemetry", request_serializer=None, response_deserializer=spb.TelemetryCommand.FromString
        )
        replies: list[spb.TelemetryCommand] = []
        with pytest.raises(grpc.RpcError) as ended:
            replies.extend(telemetry(iter([b"\x0a\xff"]), metadata=headers("junk"), timeout=10))
    assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid Telemetry message" in (ended.value.details() or "")
    assert replies == []  # no INTERNAL_ERROR frame first
    assert "Telemetry failed" not in broker.log()  # a client's garbage is not the broker's failure


@pytest.mark.parametrize("size", [20_000, 100_000])
def test_headers_over_16_kib_are_resource_exhausted_and_the_connection_serves_on(
    stub: service_pb2_grpc.MessagingServiceStub, size: int
) -> None:
    """grpcio's hard limit, on both edges (before 2026-11-30 the native edge answered HTTP 431, which clients report
    as UNKNOWN, and a larger block a GOAWAY that ended every call on the connection)."""
    query = spb.QueryRouteRequest(topic=pb.Resource(name=PARENT))
    with pytest.raises(grpc.RpcError) as refused:
        stub.QueryRoute(query, metadata=(*headers("big"), ("x-pad", "p" * size)), timeout=10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    assert "metadata size exceeds hard limit" in (refused.value.details() or "")
    still_serves(stub)


@pytest.mark.parametrize("edge", ["grpcio", "native"])
def test_streams_refused_for_their_signature_end_unauthenticated_on_both_edges(tmp_path: Path, edge: str) -> None:
    """An unsigned Telemetry stream (client auth on) and an admin scan signed with the client pair: gRPC
    UNAUTHENTICATED naming why. Before 2026-11-30 the native edge ended both UNKNOWN ("Unexpected TypeError") and
    logged a stack trace for each: the refusing handler was a coroutine where the edge iterates a generator."""
    flags = ["--edge", edge, "--access-key", "ak", "--secret-key", "sk-12345678", "--flush-mode", "async"]
    with start_broker(tmp_path / "data", extra_args=flags) as broker, grpc.insecure_channel(broker.endpoint) as channel:
        telemetry = service_pb2_grpc.MessagingServiceStub(channel).Telemetry
        settings = spb.TelemetryCommand(settings=pb.Settings(client_type=pb.PRODUCER))
        with pytest.raises(grpc.RpcError) as unsigned:
            list(telemetry(iter([settings]), metadata=headers("nobody"), timeout=10))
        assert unsigned.value.code() == grpc.StatusCode.UNAUTHENTICATED, unsigned.value
        assert "missing authorization header" in (unsigned.value.details() or "")
        scan = admin_pb2_grpc.LmqAdminStub(channel).ScanLiteTopics
        client_pair = auth.sign_metadata("ak", "sk-12345678", auth.utc_now())
        with pytest.raises(grpc.RpcError) as refused:
            list(scan(admin_pb2.ScanLiteTopicsRequest(parent=PARENT), metadata=client_pair, timeout=10))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value
        assert "admin key pair" in (refused.value.details() or "")
        assert "Traceback" not in broker.log()
