"""The native edge (``serve --edge native``, docs/design/native-edge.md milestone 1) on a real broker process with
raw grpc.aio stubs: every kind of call passes through to the Python handlers (unary, server-streaming, the
bidirectional Telemetry, the admin service), deadlines and cancellations end calls on the native side, an
unknown method and an oversized request are refused with gRPC's codes, request messages are read ahead of a
slow handler only up to a bound, the access port is shared (SO_REUSEPORT) and the broker refuses to start when
the edge cannot serve it. TLS is tested on both edges in test_security.py. ``make test`` builds the module
(``make native``): without it these fail."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import pytest
from raw_v2 import GROUP, PARENT, code_of, connection, headers, metric, parked, poll, poll_request
from waiting import eventually_async

from lmq_broker.admin.client import AdminClient
from lmq_broker.protocol import native
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc
from lmq_broker.testing import BrokerProcess, start_broker

EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # the end of a stream (not in the stubs)

if TYPE_CHECKING:
    from lmq_broker.protocol.gen.apache.rocketmq.v2.service_pb2_grpc import MessagingServiceAsyncStub as Stub


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    with start_broker(tmp_path / "data", extra_args=["--edge", "native", "--max-body-bytes", "65536"]) as started:
        yield started


def test_the_native_edge_is_built() -> None:
    assert native.available(), native.MISSING  # `make native`: fails, never skips, when the module is missing


def lite_message(lite: str, body: bytes, message_id: str) -> pb.Message:
    props = pb.SystemProperties(message_id=message_id, message_type=pb.LITE, lite_topic=lite, body_encoding=pb.IDENTITY)
    return pb.Message(topic=pb.Resource(name=PARENT), body=body, system_properties=props)


async def subscribe(stub: Stub, client_id: str, lite: str) -> None:
    sync = spb.SyncLiteSubscriptionRequest(
        action=pb.PARTIAL_ADD, topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP), lite_topic_set=[lite]
    )
    assert (await stub.SyncLiteSubscription(sync, metadata=headers(client_id))).status.code == pb.OK


@pytest.mark.asyncio
async def test_sends_receives_and_acks_pass_through(broker: BrokerProcess) -> None:
    channel, stub = connection(broker)
    async with channel:
        route = await stub.QueryRoute(spb.QueryRouteRequest(topic=pb.Resource(name=PARENT)), metadata=headers("c"))
        assert route.status.code == pb.OK and route.message_queues
        await subscribe(stub, "c", "t1")
        messages = [lite_message("t1", f"body-{i}".encode(), f"m{i}") for i in range(3)]
        sent = await stub.SendMessage(spb.SendMessageRequest(messages=messages), metadata=headers("p"))
        assert sent.status.code == pb.OK and [e.message_id for e in sent.entries] == ["m0", "m1", "m2"]
        frames = await poll(stub, "c", wait_s=5)
        got = [f.message for f in frames if f.HasField("message")]
        assert [m.body for m in got] == [b"body-0", b"body-1", b"body-2"]
        entries = [
            spb.AckMessageEntry(
                message_id=m.system_properties.message_id, receipt_handle=m.system_properties.receipt_handle
            )
            for m in got
        ]
        ack = spb.AckMessageRequest(group=pb.Resource(name=GROUP), topic=pb.Resource(name=PARENT), entries=entries)
        acked = await stub.AckMessage(ack, metadata=headers("c"))
        assert acked.status.code == pb.OK and [e.status.code for e in acked.entries] == [pb.OK] * 3
    with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:  # admin on the same port
        assert admin.describe_lite_topic(PARENT, "t1").group_offsets[GROUP] == 3


@pytest.mark.asyncio
async def test_single_sends_of_many_clients_at_once_are_all_stored_in_order(broker: BrokerProcess) -> None:
    channel, stub = connection(broker)
    async with channel:

        async def send(i: int) -> int:
            request = spb.SendMessageRequest(messages=[lite_message(f"t{i % 4}", b"x" * 1024, f"m{i}")])
            return (await stub.SendMessage(request, metadata=headers(f"p{i % 8}"))).status.code

        assert await asyncio.gather(*(send(i) for i in range(256))) == [pb.OK] * 256
    with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
        assert sum(admin.describe_lite_topic(PARENT, f"t{n}").meta.max_offset for n in range(4)) == 256


@pytest.mark.asyncio
async def test_telemetry_streams_both_ways(broker: BrokerProcess) -> None:
    channel, stub = connection(broker)
    async with channel:
        settings = pb.Settings(
            client_type=pb.LITE_PUSH_CONSUMER,
            subscription=pb.Subscription(
                group=pb.Resource(name=GROUP), subscriptions=[pb.SubscriptionEntry(topic=pb.Resource(name=PARENT))]
            ),
        )
        outgoing: asyncio.Queue[spb.TelemetryCommand | None] = asyncio.Queue()

        async def commands() -> AsyncIterator[spb.TelemetryCommand]:
            while (command := await outgoing.get()) is not None:
                yield command

        stream = stub.Telemetry(commands(), metadata=headers("t"))
        for _ in range(2):  # each command is answered while the stream stays open
            await outgoing.put(spb.TelemetryCommand(settings=settings))
            reply = await asyncio.wait_for(stream.read(), 10)
            assert isinstance(reply, spb.TelemetryCommand) and reply.status.code == pb.OK
        await outgoing.put(None)  # the client's half-close ends the stream
        assert await asyncio.wait_for(stream.read(), 10) is EOF
        assert await stream.code() == grpc.StatusCode.OK


@pytest.mark.asyncio
async def test_a_stream_past_its_deadline_is_ended_and_its_handler_cancelled(broker: BrokerProcess) -> None:
    channel, stub = connection(broker)
    async with channel:
        stream = stub.Telemetry(metadata=headers("t"), timeout=1.5)  # type: ignore[call-arg]  # written below
        settings = pb.Settings(
            client_type=pb.LITE_PUSH_CONSUMER,
            subscription=pb.Subscription(
                group=pb.Resource(name=GROUP), subscriptions=[pb.SubscriptionEntry(topic=pb.Resource(name=PARENT))]
            ),
        )
        await stream.write(spb.TelemetryCommand(settings=settings))
        await asyncio.wait_for(stream.read(), 10)
        await eventually_async(lambda: metric(broker, "lmq_telemetry_streams") == 1, "the stream counted")
        assert await stream.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await eventually_async(lambda: metric(broker, "lmq_telemetry_streams") == 0, "the stream's handler ended")


@pytest.mark.asyncio
async def test_the_deadline_reaches_the_handler_and_ends_a_parked_poll(broker: BrokerProcess) -> None:
    channel, stub = connection(broker)
    async with channel:
        started = time.monotonic()
        call = stub.ReceiveMessage(poll_request(20), metadata=headers("c"), timeout=1)
        try:  # the handler answers just before the deadline (time_remaining), or the edge at it
            assert code_of([frame async for frame in call]) == "MESSAGE_NOT_FOUND"
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 5  # not the poll's own 20 s
        await parked(broker, 0)


@pytest.mark.asyncio
async def test_a_cancelled_poll_gives_its_place_back(broker: BrokerProcess) -> None:
    channel, stub = connection(broker)
    async with channel:
        held = asyncio.create_task(poll(stub, "c"))
        await parked(broker, 1)
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        await parked(broker, 0)
        assert code_of(await poll(stub, "c", wait_s=1)) == "MESSAGE_NOT_FOUND"


@pytest.mark.asyncio
async def test_unknown_methods_and_oversized_requests_are_refused(broker: BrokerProcess) -> None:
    channel, stub = connection(broker)
    async with channel:
        unknown = channel.unary_unary(
            "/apache.rocketmq.v2.MessagingService/NoSuchCall", request_serializer=bytes, response_deserializer=bytes
        )
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await unknown(b"", timeout=5)
        assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
        huge = spb.SendMessageRequest(messages=[lite_message("t", b"x" * (64 * 1024 * 1024 + 1), "big")])
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.SendMessage(huge, metadata=headers("p"), timeout=30)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await poll(stub, "c", wait_s=0)  # the connection still serves
    assert metric(broker, "lmq_parked_polls") == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("edge", ["grpcio", "native"])
async def test_compressed_requests_are_inflated_on_both_edges_up_to_the_size_limit(tmp_path: Path, edge: str) -> None:
    """A client that compresses its requests (grpc-encoding gzip or deflate) is served alike on both edges: the
    message stored is the inflated one, and one that inflates past the size limit (64 MiB here) is refused with
    RESOURCE_EXHAUSTED though its compressed bytes are far below it."""
    with start_broker(tmp_path / "data", extra_args=["--edge", edge]) as started:
        channel, stub = connection(started)
        async with channel:
            await subscribe(stub, "c", "zipped")
        bodies = {grpc.Compression.Gzip: b"g" * 300_000, grpc.Compression.Deflate: b"d" * 300_000}
        for compression, body in bodies.items():
            async with grpc.aio.insecure_channel(started.endpoint, compression=compression) as zipped:
                zstub: Stub = service_pb2_grpc.MessagingServiceStub(zipped)
                request = spb.SendMessageRequest(messages=[lite_message("zipped", body, f"m-{compression.name}")])
                assert (await zstub.SendMessage(request, metadata=headers("p"), timeout=30)).status.code == pb.OK
                huge = spb.SendMessageRequest(messages=[lite_message("zipped", bytes(64 * 1024 * 1024 + 1), "big")])
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await zstub.SendMessage(huge, metadata=headers("p"), timeout=30)
                assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, raised.value
        channel, stub = connection(started)
        async with channel:
            frames = await poll(stub, "c", wait_s=5)
        assert sorted(f.message.body for f in frames if f.HasField("message")) == sorted(bodies.values())


def serve(tmp_path: Path, *flags: str, hide_module: bool = False) -> subprocess.CompletedProcess[str]:
    hide = "sys.modules['lmq_edge'] = None; " if hide_module else ""  # as if never built: ImportError
    code = f"import sys; {hide}from lmq_broker.__main__ import main; sys.exit(main(sys.argv[1:]))"
    argv = ["serve", "--data-dir", str(tmp_path / "data"), "--port", "0", "--metrics-port", "-1", *flags]
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60, check=False)


def test_without_the_module_the_broker_refuses_to_start_naming_make_native(tmp_path: Path) -> None:
    done = serve(tmp_path, "--edge", "native", hide_module=True)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [native.MISSING]
    assert not (tmp_path / "data").exists()  # nothing created


@pytest.mark.asyncio
async def test_left_at_its_default_without_the_module_the_broker_serves_on_grpcio_and_says_why(tmp_path: Path) -> None:
    """The native edge is the default; where it is not built (`make run` without Rust) ``serve`` falls back to
    grpcio's edge and logs why, instead of refusing as with ``--edge native`` (above). A real process whose
    ``import lmq_edge`` fails, with neither ``--edge`` nor ``LMQ_EDGE``."""
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "lmq_edge.py").write_text("raise ImportError('as if never built')\n")
    path = os.pathsep.join(p for p in (str(hidden), os.environ.get("PYTHONPATH", "")) if p)
    with start_broker(tmp_path / "data", env={"PYTHONPATH": path}, wrapper=["env", "-u", "LMQ_EDGE"]) as started:
        channel, stub = connection(started)
        async with channel:
            route = await stub.QueryRoute(spb.QueryRouteRequest(topic=pb.Resource(name=PARENT)), metadata=headers("c"))
            assert route.status.code == pb.OK and route.message_queues
        said = [line for line in started.log().splitlines() if " WARNING " in line and native.FALLBACK in line]
        assert len(said) == 1, started.log()[-4000:]


def test_a_tls_pair_that_does_not_load_refuses_the_start(tmp_path: Path) -> None:
    (tmp_path / "c.pem").write_text("x")
    (tmp_path / "k.pem").write_text("x")
    done = serve(
        tmp_path, "--edge", "native", "--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem")
    )
    assert done.returncode != 0
    assert f"TLS certificate {tmp_path / 'c.pem'}" in done.stderr.strip().splitlines()[-1]


def test_the_shared_port_takes_several_listeners_and_a_private_one_refuses_a_second() -> None:
    """--processes: every process of a pod listens on the access port (SO_REUSEPORT); its own port stays its own."""
    servers = [native.lmq_edge.Server(1 << 20, 8) for _ in range(4)]
    try:
        shared = servers[0].listen("127.0.0.1", 0, True)
        assert servers[1].listen("127.0.0.1", shared, True) == shared
        private = servers[2].listen("127.0.0.1", 0, False)
        with pytest.raises(OSError):
            servers[3].listen("127.0.0.1", private, False)
        with pytest.raises(OSError):  # nor may a shared listener join a private port
            servers[3].listen("127.0.0.1", private, True)
    finally:
        for server in servers:
            server.close()


UNREAD = 4  # --max-unread-requests of the server below
MESSAGES = 64  # of 64 KiB: 4 MiB, past the stream's 1 MiB HTTP/2 window and the bound


@pytest.mark.asyncio
async def test_request_messages_are_read_ahead_of_a_slow_handler_up_to_the_bound() -> None:
    """Back-pressure: past the bound the native side stops reading the stream, so the client's writes wait
    (HTTP/2 flow control) instead of the broker buffering what the handler has not asked for."""
    release = asyncio.Event()
    contexts: list[native.Context] = []

    async def count(requests: AsyncIterator[bytes], context: native.Context) -> bytes:
        contexts.append(context)
        await release.wait()
        return str(sum([1 async for _ in requests])).encode()

    handler = grpc.stream_unary_rpc_method_handler(count)
    server = native.NativeServer(1 << 20, UNREAD)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {"Count": handler}),))
    port = server.listen("127.0.0.1", 0)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            count_of = channel.stream_unary("/t.T/Count", request_serializer=bytes, response_deserializer=bytes)
            call = count_of()  # type: ignore[call-arg]  # no iterator: written with call.write

            async def write_all() -> None:
                for _ in range(MESSAGES):
                    await call.write(b"x" * 65536)
                await call.done_writing()

            writer = asyncio.create_task(write_all())
            await eventually_async(lambda: contexts and len(contexts[0].inbox.items) >= UNREAD, "read ahead")
            with pytest.raises(TimeoutError):  # unbounded, 4 MiB on loopback would be written in milliseconds
                await asyncio.wait_for(asyncio.shield(writer), 2.0)
            assert len(contexts[0].inbox.items) == UNREAD
            stats = dict(server.stats())  # lmq_edge_read_pauses_total, lmq_edge_request_messages_total
            assert stats["read_pauses"] == 1 and stats["request_messages"] == UNREAD
            release.set()
            assert await call == str(MESSAGES).encode()  # every message, once the handler reads
            await writer
        assert dict(server.stats())["request_messages"] == MESSAGES
    finally:
        await server.stop(0)
