"""Per-client caps of the client port's connections and of the request bytes it holds (docs/security.md, "Resource
caps"), on a real broker process, driven by bare sockets and a bare HTTP/2 client (tests/support/raw_h2.py):

- connections open at once, in all (``--max-connections``, both edges) and from one IP address
  (``--max-connections-per-address``, the native edge): one past a cap is closed at its accept, counted, and the
  place of a connection that ended is taken again. Before 2026-11-30 there was no cap but the process's file
  descriptors (~33 KiB each with a stream open);
- request bytes of messages not yet whole (native edge), per connection and in all: the call whose bytes would
  pass a cap ends RESOURCE_EXHAUSTED and gives them back. Before 2026-11-30, 400 streams of one connection each
  sent half a MiB of a 60 MB message held ~200 MB, as much as was sent."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Final

import grpc
import pytest
import raw_h2
from raw_v2 import PARENT, headers, metric
from waiting import eventually

from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc
from lmq_broker.testing import BrokerProcess, start_broker

MiB: Final = 1024 * 1024
# --max-body-bytes 65536: a request message may be 64 MiB (the floor of 4 x --max-body-bytes), and so are the caps on
# partial request bytes at least (that message and a frame's slack), whatever the flags ask
LIMIT: Final = 64 * MiB
CAP: Final = LIMIT + 5 + 64 * 1024
CHUNK: Final = 4 * MiB  # sent of each partial message
ANNOUNCED: Final = 60_000_000  # each partial message's length, never reached


def still_serves(broker: BrokerProcess) -> None:
    with grpc.insecure_channel(broker.endpoint, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        stub = service_pb2_grpc.MessagingServiceStub(channel)
        query = spb.QueryRouteRequest(topic=pb.Resource(name=PARENT))
        assert stub.QueryRoute(query, metadata=headers("c"), timeout=10).status.code == pb.OK


def admitted(broker: BrokerProcess, source: str) -> socket.socket | None:
    """A TCP connection from ``source`` that the broker serves (its HTTP/2 SETTINGS came), or None: closed at once."""
    sock = socket.create_connection(("127.0.0.1", broker.port), timeout=10, source_address=(source, 0))
    sock.sendall(raw_h2.PREFACE + raw_h2.frame(raw_h2.SETTINGS, 0, 0, b""))
    try:
        head = sock.recv(9)
    except ConnectionResetError:
        head = b""
    if len(head) >= 4 and head[3] == raw_h2.SETTINGS:
        return sock
    sock.close()
    return None


def serves(broker: BrokerProcess, source: str) -> bool:
    sock = admitted(broker, source)
    if sock is None:
        return False
    sock.close()
    return True


@pytest.mark.parametrize("edge", ["native", "grpcio"])
def test_connections_past_the_caps_are_closed_at_their_accept(tmp_path: Path, edge: str) -> None:
    """Native: at most 4 in all, 2 from one address. grpcio's edge has no accept hook: its total alone is capped (grpc
    core's connection quota), per address nothing."""
    flags = ["--edge", edge, "--max-connections", "4", "--max-connections-per-address", "2", "--flush-mode", "async"]
    with start_broker(tmp_path / "data", extra_args=flags) as broker, ExitStack() as held:

        def keep(source: str) -> socket.socket | None:
            sock = admitted(broker, source)
            if sock is not None:
                held.callback(sock.close)
            return sock

        first = keep("127.0.0.1")
        assert first is not None and keep("127.0.0.1") is not None
        if edge == "native":
            assert keep("127.0.0.1") is None  # a third from one address
            assert keep("127.0.0.2") is not None and keep("127.0.0.3") is not None
        else:
            assert keep("127.0.0.1") is not None and keep("127.0.0.2") is not None
        assert keep("127.0.0.4") is None  # a fifth in all, from a fresh address
        if edge == "native":
            assert metric(broker, "lmq_edge_connections_refused_total", reason="connections_per_address") == 1
            assert metric(broker, "lmq_edge_connections_refused_total", reason="connections") == 1
        first.close()  # its place is taken again once the broker saw it end
        eventually(lambda: keep("127.0.0.1") is not None, "a connection in the place of one that ended")
        held.close()
        eventually(lambda: serves(broker, "127.0.0.5"), "connections once the others ended")
        still_serves(broker)
        assert broker.alive()


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """Both caps asked below the floor (1 byte): each is the floor, one message of the largest size."""
    flags = [
        "--edge", "native", "--max-body-bytes", "65536", "--flush-mode", "async",
        "--max-request-buffer-bytes", "1", "--max-request-buffer-bytes-per-connection", "1",
    ]  # fmt: skip
    with start_broker(tmp_path_factory.mktemp("caps") / "data", extra_args=flags) as started:
        yield started
        assert started.alive()


def partial(raw: raw_h2.Connection, streams: range) -> list[int]:
    """On each stream a SendMessage whose message says ANNOUNCED bytes and brings CHUNK of them; the streams the
    broker ended before their CHUNK was sent."""
    refused = []
    for stream in streams:
        raw.open(stream, "SendMessage", headers(f"slow-{stream}"))
        if not raw.write(stream, b"\x00" + struct.pack(">I", ANNOUNCED) + b"m" * CHUNK):
            refused.append(stream)
    return refused


def buffered(broker: BrokerProcess) -> float:
    return metric(broker, "lmq_edge_request_buffer_bytes")


def test_partial_request_bytes_past_the_per_connection_cap_end_their_call(native: BrokerProcess) -> None:
    streams = range(1, 2 * 20, 2)  # 20 x 4 MiB: 80 MiB on one connection, past the cap (64 MiB and a frame)
    with raw_h2.Connection(native.port) as raw:
        refused = partial(raw, streams)
        assert refused and refused[0] == 1 + 2 * (CAP // (CHUNK + 5))  # the first past the cap, and those after
        assert all(raw.ended.get(s) is None or s in refused for s in streams)
        assert buffered(native) <= CAP
        assert metric(native, "lmq_edge_calls_refused_total", reason="request_buffer") == len(refused)
        still_serves(native)
    eventually(lambda: buffered(native) == 0, "the connection's partial bytes given back")


def test_partial_request_bytes_past_the_broker_s_cap_end_their_call(native: BrokerProcess) -> None:
    """Two connections, each under its own cap, together past the broker's: the call that passes it is refused,
    and so is a client's whole send while the bytes are held."""
    before = metric(native, "lmq_edge_calls_refused_total", reason="request_buffer")
    with raw_h2.Connection(native.port) as one, raw_h2.Connection(native.port) as two:
        assert partial(one, range(1, 2 * 12, 2)) == []  # 48 MiB
        refused = partial(two, range(1, 2 * 6, 2))  # 24 MiB more, past 64 MiB in all
        assert refused and refused[0] == 1 + 2 * ((CAP - 12 * (CHUNK + 5)) // (CHUNK + 5))
        assert buffered(native) <= CAP
        with grpc.insecure_channel(native.endpoint) as channel:
            stub = service_pb2_grpc.MessagingServiceStub(channel)
            message = pb.Message(topic=pb.Resource(name=PARENT), body=b"b" * (CAP - 12 * CHUNK))
            with pytest.raises(grpc.RpcError) as crowded:
                stub.SendMessage(spb.SendMessageRequest(messages=[message]), metadata=headers("p"), timeout=10)
        assert crowded.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, crowded.value
        assert "past the broker's cap" in (crowded.value.details() or "")
        assert metric(native, "lmq_edge_calls_refused_total", reason="request_buffer") == before + len(refused) + 1
    eventually(lambda: buffered(native) == 0, "the connections' partial bytes given back")
    still_serves(native)


def settled(broker: BrokerProcess) -> float:
    """``buffered`` once two readings a moment apart agree (the bytes sent are all read)."""
    readings = [buffered(broker)]

    def still() -> bool:
        readings.append(buffered(broker))
        return readings[-1] == readings[-2]

    eventually(still, "the partial request bytes held settled", interval_s=0.3)
    return readings[-1]


def test_one_address_holds_at_most_its_share_of_the_broker_s_partial_request_bytes(tmp_path: Path) -> None:
    """The broker's cap (160 MiB here) with each connection's at its floor (64 MiB and a frame): four connections
    from one address, each under its own cap, hold at most a quarter of the broker's cap together (never below the
    floor), so another address still has room. Before, they held all 160 MiB and every call of every other client
    was refused RESOURCE_EXHAUSTED for as long as they trickled (found in a red-team review of the caps)."""
    flags = [
        "--edge", "native", "--max-body-bytes", "65536", "--flush-mode", "async",
        "--max-request-buffer-bytes", str(160 * MiB), "--max-request-buffer-bytes-per-connection", "1",
    ]  # fmt: skip
    with start_broker(tmp_path / "data", extra_args=flags) as broker, ExitStack() as held:
        hostile = [held.enter_context(raw_h2.Connection(broker.port, source="127.0.0.1")) for _ in range(4)]
        refused = [partial(raw, range(1, 2 * 14, 2)) for raw in hostile]  # 56 MiB on each
        assert settled(broker) <= CAP
        assert refused[0] == [] and refused[1] and refused[3] == list(range(1, 2 * 14, 2))
        with raw_h2.Connection(broker.port, source="127.0.0.2") as other:
            assert partial(other, range(1, 2 * 8, 2)) == []  # 32 MiB from another address
        still_serves(broker)
        held.close()
        eventually(lambda: buffered(broker) == 0, "the connections' partial bytes given back")
        assert broker.alive()
