"""Calls that wait are capped per client id and per connection (issue 26, items 3 and 4), and long polls in all,
on a real broker process with raw grpc.aio stubs: long polls beyond a cap are answered TOO_MANY_REQUESTS,
Telemetry streams beyond one are ended RESOURCE_EXHAUSTED naming TOO_MANY_REQUESTS, each refusal counted; polls
under the cap still deliver; RSS stays bounded under floods. Before the caps, 10,000 polls from one client on one
connection were all parked (+242 MiB) and 300 Telemetry streams that never read held 893 MiB."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Final

import grpc
import psutil
import pytest
from raw_v2 import GROUP, PARENT, code_of, connection, headers, metric, parked, poll
from waiting import eventually_async

from lmq_broker.protocol import parking
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.testing import BrokerProcess, start_broker

if TYPE_CHECKING:  # only in the type stubs
    pass

MiB: Final = 1024 * 1024


@pytest.fixture(params=["grpcio", "native"])
def broker(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[BrokerProcess]:
    """On both edges (docs/design/native-edge.md): the caps are the handlers', whichever server carries them."""
    flags = [
        "--edge", str(request.param),
        "--max-polls-per-client", "4", "--max-polls-per-connection", "6", "--max-polls", "8",
        "--max-telemetry-streams-per-client", "2", "--max-telemetry-streams-per-connection", "3",
    ]  # fmt: skip
    with start_broker(tmp_path / "data", extra_args=flags) as started:
        yield started


@pytest.mark.asyncio
async def test_long_polls_beyond_a_cap_are_refused_too_many_requests_and_counted(broker: BrokerProcess) -> None:
    one, stub = connection(broker)
    other, other_stub = connection(broker)
    async with one, other:
        held = [asyncio.create_task(poll(stub, "a")) for _ in range(4)]
        await parked(broker, 4)
        assert code_of(await poll(stub, "a")) == "TOO_MANY_REQUESTS"  # its client id's cap (4)
        assert metric(broker, "lmq_calls_refused_total", reason="per_client", rpc="ReceiveMessage") == 1
        held += [asyncio.create_task(poll(stub, "b")) for _ in range(2)]
        await parked(broker, 6)
        assert code_of(await poll(stub, "c")) == "TOO_MANY_REQUESTS"  # the connection's cap (6), a fresh id
        assert metric(broker, "lmq_calls_refused_total", reason="per_connection", rpc="ReceiveMessage") == 1
        assert code_of(await poll(other_stub, "c", wait_s=1)) == "MESSAGE_NOT_FOUND"  # another connection parks
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await parked(broker, 0)  # a cancelled poll gives its place back
        assert code_of(await poll(stub, "a", wait_s=1)) == "MESSAGE_NOT_FOUND"


@pytest.mark.asyncio
async def test_long_polls_past_the_broker_s_cap_are_refused_whatever_their_connection(broker: BrokerProcess) -> None:
    """Each connection under its own cap (6), each client id under its own (4): before 2026-11-30 nothing capped
    their sum, so many connections parked without bound (1,024 polls on each)."""
    opened = [connection(broker) for _ in range(3)]
    stubs = [stub for _, stub in opened]
    held = [asyncio.create_task(poll(stubs[i], f"c{i}-{j % 2}")) for i in range(2) for j in range(4)]
    await parked(broker, 8)
    assert code_of(await poll(stubs[2], "fresh")) == "TOO_MANY_REQUESTS"  # a fresh id on a fresh connection
    assert metric(broker, "lmq_calls_refused_total", reason="total", rpc="ReceiveMessage") == 1
    for task in held[:1]:
        task.cancel()
    await asyncio.gather(*held[:1], return_exceptions=True)
    await parked(broker, 7)
    assert code_of(await poll(stubs[2], "fresh", wait_s=1)) == "MESSAGE_NOT_FOUND"  # the place given back
    for task in held:
        task.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    for channel, _ in opened:
        await channel.close(None)


@pytest.mark.asyncio
async def test_a_poll_that_asks_not_to_wait_is_not_counted(broker: BrokerProcess) -> None:
    channel, stub = connection(broker)
    async with channel:
        held = [asyncio.create_task(poll(stub, "a")) for _ in range(4)]
        await parked(broker, 4)
        assert code_of(await poll(stub, "a", wait_s=0)) == "MESSAGE_NOT_FOUND"  # a cluster peer's gathering call
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)


@pytest.mark.asyncio
async def test_polls_under_the_cap_still_deliver_after_a_flood_was_refused(broker: BrokerProcess) -> None:
    channel, stub = connection(broker)
    async with channel:
        sync = spb.SyncLiteSubscriptionRequest(
            action=pb.PARTIAL_ADD, topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP), lite_topic_set=["t1"]
        )
        assert (await stub.SyncLiteSubscription(sync, metadata=headers("a"))).status.code == pb.OK
        held = [asyncio.create_task(poll(stub, "a")) for _ in range(4)]
        await parked(broker, 4)
        flood = await asyncio.gather(*(poll(stub, "a") for _ in range(50)))
        assert {code_of(frames) for frames in flood} == {"TOO_MANY_REQUESTS"}
        props = pb.SystemProperties(message_id="m1", message_type=pb.LITE, lite_topic="t1", body_encoding=pb.IDENTITY)
        message = pb.Message(topic=pb.Resource(name=PARENT), body=b"hello", system_properties=props)
        sent = await stub.SendMessage(spb.SendMessageRequest(messages=[message]), metadata=headers("p"))
        assert sent.status.code == pb.OK
        done, pending = await asyncio.wait(held, return_when=asyncio.FIRST_COMPLETED, timeout=10)
        assert done, "no parked poll was woken by the message"
        frames = done.pop().result()
        assert [f.message.body for f in frames if f.HasField("message")] == [b"hello"]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def telemetry_settings(stop: asyncio.Event, hostname_bytes: int = 16) -> AsyncIterator[spb.TelemetryCommand]:
    settings = pb.Settings(
        client_type=pb.PRODUCER, publishing=pb.Publishing(), user_agent=pb.UA(hostname="h" * hostname_bytes)
    )
    yield spb.TelemetryCommand(settings=settings)
    await stop.wait()


async def silent(stop: asyncio.Event) -> AsyncIterator[spb.TelemetryCommand]:
    """No frame: a stream refused at its start need not send one, and a Python client's write after the
    server's status would turn that status into INTERNAL on the client's side (grpc/grpc#36066)."""
    await stop.wait()
    yield spb.TelemetryCommand()  # at the end of the test, when nothing reads the call any more


async def first_reply(call: grpc.aio.StreamStreamCall[spb.TelemetryCommand, spb.TelemetryCommand]) -> str:
    try:
        reply: spb.TelemetryCommand = await call.read()  # type: ignore[assignment]  # EOF is not expected here
    except grpc.aio.AioRpcError as exc:
        return f"grpc {exc.code().name}"
    return pb.Code.Name(reply.status.code)


@pytest.mark.asyncio
async def test_telemetry_streams_beyond_a_cap_are_ended_resource_exhausted_naming_the_code(
    broker: BrokerProcess,
) -> None:
    one, stub = connection(broker)
    other, other_stub = connection(broker)
    stop = asyncio.Event()
    async with one, other:
        calls = [stub.Telemetry(telemetry_settings(stop), metadata=headers("a")) for _ in range(2)]
        assert [await first_reply(call) for call in calls] == ["OK", "OK"]
        refused = stub.Telemetry(silent(stop), metadata=headers("a"))
        assert await first_reply(refused) == "TOO_MANY_REQUESTS"  # the status frame, then the gRPC error
        assert await refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, await refused.details()
        assert "TOO_MANY_REQUESTS (42900)" in await refused.details()
        assert metric(broker, "lmq_calls_refused_total", reason="per_client", rpc="Telemetry") == 1
        calls.append(stub.Telemetry(telemetry_settings(stop), metadata=headers("b")))
        assert await first_reply(calls[-1]) == "OK"
        crowded = stub.Telemetry(silent(stop), metadata=headers("c"))
        assert await first_reply(crowded) == "TOO_MANY_REQUESTS"  # the connection's cap (3)
        assert await crowded.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert metric(broker, "lmq_calls_refused_total", reason="per_connection", rpc="Telemetry") == 1
        elsewhere = other_stub.Telemetry(telemetry_settings(stop), metadata=headers("c"))
        assert await first_reply(elsewhere) == "OK"
        assert metric(broker, "lmq_telemetry_streams") == 4
        stop.set()
        for call in [*calls, elsewhere]:
            call.cancel()
        await eventually_async(lambda: metric(broker, "lmq_telemetry_streams") == 0, "no telemetry streams")
        again = stub.Telemetry(telemetry_settings(asyncio.Event()), metadata=headers("a"))
        assert await first_reply(again) == "OK"  # a closed stream gives its place back
        again.cancel()


@pytest.mark.parametrize("edge", ["grpcio", "native"])
def test_a_flood_of_long_polls_from_one_client_leaves_rss_bounded(tmp_path: Path, edge: str) -> None:
    flood = 5000  # without the caps every one parked: ~25 KiB each, +122 MiB, and held until they end

    async def run(broker: BrokerProcess) -> tuple[int, int, int, int]:
        process = psutil.Process(broker.pid)
        before = process.memory_info().rss
        channel, stub = connection(broker)
        async with channel:
            held = [asyncio.create_task(poll(stub, "flood", wait_s=30)) for _ in range(64)]
            await eventually_async(lambda: metric(broker, "lmq_parked_polls") == 64, "64 parked polls")
            peak = before
            flooding = asyncio.gather(*(poll(stub, "flood", wait_s=30) for _ in range(flood)))
            while not flooding.done():  # the peak while the flood lands, not only what it leaves behind
                peak = max(peak, process.memory_info().rss)
                await asyncio.sleep(0.02)  # the RSS sampling pace while the flood lands (the load), not a wait
            refused = sum(code_of(frames) == "TOO_MANY_REQUESTS" for frames in flooding.result())
            after = process.memory_info().rss
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
        return before, peak, after, refused

    # the default caps: 64 per client id, 1024 per connection
    with start_broker(tmp_path / "data", extra_args=["--edge", edge]) as broker:
        before, peak, after, refused = asyncio.run(run(broker))
        assert refused == flood
        assert metric(broker, "lmq_calls_refused_total", reason="per_client", rpc="ReceiveMessage") == flood
    # the peak is the burst waiting in grpc core to be taken and refused (~10 KiB a call, for a moment)
    assert (peak - before) / MiB < 90, f"RSS peaked {(peak - before) / MiB:.0f} MiB over {before / MiB:.0f} MiB"
    assert (after - before) / MiB < 10, f"RSS stayed {(after - before) / MiB:.0f} MiB higher once refused"


async def flooding_settings(stop: asyncio.Event) -> AsyncIterator[spb.TelemetryCommand]:
    """Settings frames of 160 KiB, each answered with a copy of itself, as fast as the broker takes them."""
    settings = pb.Settings(
        client_type=pb.PRODUCER, publishing=pb.Publishing(), user_agent=pb.UA(hostname="h" * 160 * 1024)
    )
    while not stop.is_set():
        yield spb.TelemetryCommand(settings=settings)
        await asyncio.sleep(0)


@pytest.mark.asyncio
@pytest.mark.parametrize("edge", ["grpcio", "native"])
async def test_telemetry_replies_nobody_reads_are_bounded_per_broker(tmp_path: Path, edge: str) -> None:
    # no cap per stream (test_memory_bounds has that one): the broker's cap is passed at a second 160 KiB reply
    flags = ["--telemetry-stream-buffer-bytes", "0", "--telemetry-buffer-bytes", "200000", "--edge", edge]
    with start_broker(tmp_path / "data", extra_args=flags) as broker:
        opened = [connection(broker) for _ in range(4)]
        stop = asyncio.Event()
        flooders = [
            stub.Telemetry(flooding_settings(stop), metadata=headers(f"flood-{i}"))
            for i, (_, stub) in enumerate(opened)
        ]  # never read
        buffered: list[float] = []

        def refused() -> bool:
            buffered.append(metric(broker, "lmq_telemetry_buffered_bytes"))
            return metric(broker, "lmq_calls_refused_total", reason="telemetry_buffer", rpc="Telemetry") > 0

        await eventually_async(refused, "a refusal")
        assert max(buffered) <= 200_000
        stop.set()
        for call in flooders:
            call.cancel()
        await eventually_async(
            lambda: metric(broker, "lmq_telemetry_buffered_bytes") == 0, "no buffered bytes"
        )  # their replies went with them
        channel, stub = connection(broker)
        again = stub.Telemetry(telemetry_settings(asyncio.Event()), metadata=headers("fresh"))
        assert await first_reply(again) == "OK"
        again.cancel()
        for opened_channel, _ in [*opened, (channel, stub)]:
            await opened_channel.close(None)


def test_a_full_telemetry_buffer_refuses_new_streams_until_half_of_it_is_free() -> None:
    budget = parking.Budget(1000)

    def full() -> bool:
        return budget.full

    assert budget.take(600) and not full()
    assert not budget.take(600) and full()  # a reply refused: new streams are refused too
    budget.give(50)
    assert full()  # 550 held: not yet half free
    budget.give(50)
    assert not full() and budget.take(500)
