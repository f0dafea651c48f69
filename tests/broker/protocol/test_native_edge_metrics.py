"""The native edge's own counters (``lmq_edge_*``, protocol/native_metrics.py, native/edge/src/stats.rs) on a
real broker process, scraped from its /metrics: connections accepted and open, a failed TLS handshake, a call
the client cancelled, a deadline ended natively (and a grpc-timeout too long to be one), a request refused natively,
request messages and bytes, accepts failing past the file descriptor limit. A
grpcio client enforces its own deadline and resets the stream at it (before the server's timer, which starts
later), so the native deadline is driven by a bare HTTP/2 client that sends ``grpc-timeout`` and just waits."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import raw_h2
from raw_v2 import PARENT, connection, headers, metric, parked, poll
from waiting import eventually, eventually_async

from lmq_broker import app
from lmq_broker.dispatch.testing import config_for
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc
from lmq_broker.testing import BrokerProcess, issue_certificate, start_broker


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    with start_broker(tmp_path / "data", extra_args=["--edge", "native", "--max-body-bytes", "65536"]) as started:
        yield started


def edge(broker: BrokerProcess, name: str, **labels: str) -> float:
    return metric(broker, f"lmq_edge_{name}", **labels)


@pytest.mark.asyncio
async def test_connections_calls_messages_and_bytes_are_counted(broker: BrokerProcess) -> None:
    assert edge(broker, "connections_open") == 0
    first, stub = connection(broker)
    second, other = connection(broker)
    async with first, second:
        query = spb.QueryRouteRequest(topic=pb.Resource(name=PARENT))
        for s in (stub, other):
            assert (await s.QueryRoute(query, metadata=headers("c"))).status.code == pb.OK
        assert edge(broker, "connections_open") == 2
        assert edge(broker, "connections_accepted_total") == 2
        assert edge(broker, "calls_total") == 2
        assert edge(broker, "request_messages_total") == 2
        sent = query.ByteSize() + 5  # one gRPC frame each way per call
        assert edge(broker, "received_bytes_total") == 2 * sent
        assert edge(broker, "sent_bytes_total") > 2 * 5
    await eventually_async(lambda: edge(broker, "connections_open") == 0, "both connections closed")
    assert edge(broker, "connections_accepted_total") == 2
    assert edge(broker, "calls_cancelled_total") == 0 and edge(broker, "deadlines_exceeded_total") == 0


@pytest.mark.asyncio
async def test_a_call_the_client_cancels_is_counted(broker: BrokerProcess) -> None:
    channel, stub = connection(broker)
    async with channel:
        held = asyncio.create_task(poll(stub, "c"))
        await parked(broker, 1)
        assert edge(broker, "calls_cancelled_total") == 0
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        await eventually_async(lambda: edge(broker, "calls_cancelled_total") == 1, "the reset stream counted")
        await parked(broker, 0)
    assert edge(broker, "deadlines_exceeded_total") == 0


@pytest.mark.asyncio
async def test_a_request_over_the_size_limit_is_refused_natively_and_counted(broker: BrokerProcess) -> None:
    channel, stub = connection(broker)
    async with channel:
        props = pb.SystemProperties(message_id="big", message_type=pb.LITE, lite_topic="t")
        message = pb.Message(
            topic=pb.Resource(name=PARENT), body=b"x" * (64 * 1024 * 1024 + 1), system_properties=props
        )
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.SendMessage(spb.SendMessageRequest(messages=[message]), metadata=headers("p"), timeout=30)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert edge(broker, "calls_refused_total", reason="message_too_large") == 1
    assert edge(broker, "calls_refused_total", reason="compressed") == 0
    assert edge(broker, "request_messages_total") == 0  # never handed to the broker


def test_a_deadline_ended_natively_is_counted(broker: BrokerProcess) -> None:
    # a Telemetry call that carries ``grpc-timeout`` and sends nothing more
    with raw_h2.Connection(broker.port) as raw:
        raw.open(1, "Telemetry", (("grpc-timeout", "300m"), ("x-mq-client-id", "raw")))
        eventually(lambda: edge(broker, "calls_total") == 1, "the call opened")
        eventually(lambda: edge(broker, "deadlines_exceeded_total") == 1, "the edge ended it at its deadline")
    assert edge(broker, "calls_cancelled_total") == 0  # ended by the deadline, not by the client
    eventually(lambda: metric(broker, "lmq_telemetry_streams") == 0, "its handler cancelled")


def test_a_timeout_of_more_than_eight_digits_is_no_deadline(broker: BrokerProcess) -> None:
    """grpc-timeout is at most 8 digits; a longer one is not a deadline (grpcio's edge serves it without one). Before
    2026-11-30 the native edge multiplied it out in 64 bits: 3381903080180084463 minutes wrapped to 4 seconds."""
    with raw_h2.Connection(broker.port) as raw:
        raw.open(1, "Telemetry", (("grpc-timeout", "3381903080180084463M"), ("x-mq-client-id", "raw")))
        eventually(lambda: metric(broker, "lmq_telemetry_streams") == 1, "the stream open")
        time.sleep(5.0)
        assert edge(broker, "deadlines_exceeded_total") == 0
        assert metric(broker, "lmq_telemetry_streams") == 1


def test_accepts_that_fail_for_want_of_file_descriptors_pause_and_the_edge_serves_once_they_are_free(
    tmp_path: Path,
) -> None:
    """Past the process's file descriptor limit the listener stays readable and each accept fails (EMFILE): the
    edge pauses 100 ms after each, rather than trying again at once (before 2026-11-30: a loop holding the edge's
    thread, ~30 % of a core here, thousands of failed accepts a second)."""
    flags, limit = ["--edge", "native"], 400
    with start_broker(tmp_path / "data", extra_args=flags, wrapper=["prlimit", f"--nofile={limit}"]) as broker:
        free = limit - len(list(Path(f"/proc/{broker.pid}/fd").iterdir()))
        started = time.monotonic()
        held = [raw_h2.Connection(broker.port) for _ in range(free + 20)]  # the last ones wait in the backlog
        time.sleep(2.0)  # nothing is scraped meanwhile: the metrics listener has no descriptor left either
        for connection in held:
            connection.sock.close()
        exhausted_s = time.monotonic() - started
        eventually(lambda: edge(broker, "connections_open") == 0, "the connections closed")
        failed = edge(broker, "accept_errors_total")
        assert 0 < failed <= 2 * exhausted_s / 0.1  # one per pause, with margin
        with grpc.insecure_channel(broker.endpoint) as channel:
            query = spb.QueryRouteRequest(topic=pb.Resource(name=PARENT))
            route = service_pb2_grpc.MessagingServiceStub(channel).QueryRoute(query, metadata=headers("c"), timeout=10)
        assert route.status.code == pb.OK


def test_tls_handshakes_that_fail_are_counted_and_good_ones_are_not(tmp_path: Path) -> None:
    pair = issue_certificate(tmp_path / "tls", "127.0.0.1")
    flags = ["--edge", "native", "--tls-cert", str(pair.cert), "--tls-key", str(pair.key)]
    with start_broker(tmp_path / "data", extra_args=flags) as broker:
        with socket.create_connection(("127.0.0.1", broker.port), timeout=10) as plain:
            plain.sendall(raw_h2.PREFACE)  # plaintext HTTP/2 on a TLS port: the handshake fails, the socket closes
            plain.recv(4096)  # the alert, or the close
            eventually(lambda: edge(broker, "tls_handshakes_failed_total") == 1, "the failed handshake counted")
        context = ssl.create_default_context(cafile=str(pair.ca))
        context.set_alpn_protocols(["h2"])
        raw = socket.create_connection(("127.0.0.1", broker.port), timeout=10)
        with raw, context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            assert tls.selected_alpn_protocol() == "h2"
            assert edge(broker, "connections_open") == 1
        eventually(lambda: edge(broker, "connections_open") == 0, "the TLS connection closed")
        assert edge(broker, "connections_accepted_total") == 2
        assert edge(broker, "tls_handshakes_failed_total") == 1
        asyncio.run(_route(broker.port, pair.ca.read_bytes()))
        assert edge(broker, "tls_handshakes_failed_total") == 1 and edge(broker, "calls_total") == 1


async def _route(port: int, ca: bytes) -> None:
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca)) as channel:
        stub = service_pb2_grpc.MessagingServiceStub(channel)
        reply = await stub.QueryRoute(spb.QueryRouteRequest(topic=pb.Resource(name=PARENT)), metadata=headers("c"))
        assert reply.status.code == pb.OK


async def _scrape_after_the_same_calls(tmp_path: Path, edge_kind: str) -> dict[str, float]:
    """The /metrics samples of an in-process broker on ``edge_kind`` after one route query and one send."""
    config = config_for(tmp_path / edge_kind, host="127.0.0.1", port=0, metrics_port=-1, edge=edge_kind)
    broker = app.Broker(config)
    await broker.start()
    try:
        async with grpc.aio.insecure_channel(broker.endpoint) as channel:
            stub = service_pb2_grpc.MessagingServiceStub(channel)
            assert (await stub.QueryRoute(spb.QueryRouteRequest(topic=pb.Resource(name=PARENT)))).status.code == pb.OK
            props = pb.SystemProperties(message_id="m1", message_type=pb.LITE, lite_topic="t1")
            message = pb.Message(topic=pb.Resource(name=PARENT), body=b"x", system_properties=props)
            sent = await stub.SendMessage(spb.SendMessageRequest(messages=[message]), metadata=headers("p"))
            assert sent.status.code == pb.OK
        text = broker._http_answer("/metrics")[2].decode()
    finally:
        await broker.stop(0.2)
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in samples}


@pytest.mark.asyncio
async def test_the_brokers_own_metrics_are_the_same_on_both_edges_and_only_native_adds_its_own(tmp_path: Path) -> None:
    grpcio = await _scrape_after_the_same_calls(tmp_path, "grpcio")
    native = await _scrape_after_the_same_calls(tmp_path, "native")
    assert not [name for name in grpcio if name.startswith("lmq_edge_")]
    assert native["lmq_edge_calls_total"] == 2 and native["lmq_edge_request_messages_total"] == 2
    shared = {name for name in native if not name.startswith("lmq_edge_")}
    assert shared == set(grpcio)  # the same families, labels and buckets
    counted = [n for n in shared if n.startswith(("lmq_rpc_total", "lmq_messages_in_total", "lmq_calls_refused_total"))]
    assert counted and {n: native[n] for n in counted} == {n: grpcio[n] for n in counted}
