"""What parked long polls and idle Telemetry streams cost the broker, and RSS under floods of them.

Four runs against one real broker process (raw grpc.aio stubs, no official client):

* polls spread: 2,000 ReceiveMessage long polls parked at once, spread so that no cap refuses them (50 per
  client id, 250 per connection): bytes per parked poll = RSS delta / polls, then the RSS still held once
  they ended (after a heap trim).
* polls flood: 10,000 long polls from one client id on one connection (issue 26): how many were refused
  (TOO_MANY_REQUESTS), the peak RSS, and what stays after.
* telemetry idle: 300 streams that send their settings once and read the reply (as official clients do):
  bytes per open stream.
* telemetry never reading: 300 streams that push 160 KiB settings frames and never read their replies,
  one per client id over 10 connections, then 300 from one client id on one connection: refused streams,
  peak RSS, what stays after.

The broker runs from the checkout this script imports ``lmq_broker`` from (``start_broker`` puts that on the
broker's PYTHONPATH): ``PYTHONPATH=<other checkout>/broker python bench/bench_parked_polls.py`` measures another
checkout, such as the code before a change. Prints ``FIGURE`` lines.

    python bench/bench_parked_polls.py            # ~1-2 min
    python bench/bench_parked_polls.py --quick    # smoke run (fewer polls and streams)
    python bench/bench_parked_polls.py --edge grpcio   # grpcio's edge (default: native; polls parked in Python)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Final

import grpc
import psutil

from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc
from lmq_broker.testing import BrokerProcess, start_broker

KiB: Final = 1024
MiB: Final = 1024 * 1024
TOPIC, GROUP = "AGENT_TASK_NS", "executor-group"
POLL_S: Final = 60  # the polls outlive the measurement; they are cancelled at its end
SETTLE_S: Final = 1.5  # RSS unchanged (within 1 MiB) this long: the flood has landed
SETTINGS_BYTES: Final = 160 * KiB  # each Telemetry frame (a settings command answered with a copy of itself)


def figure(name: str, value: float, unit: str, extra: str = "") -> None:
    print(f"FIGURE {name}: {value:,.1f} {unit}{extra}", flush=True)


def headers(client_id: str) -> tuple[tuple[str, str], ...]:
    return (("x-mq-client-id", client_id), ("x-mq-language", "JAVA"), ("x-mq-client-version", "5.0.8"))


def poll_request() -> spb.ReceiveMessageRequest:
    request = spb.ReceiveMessageRequest(
        group=pb.Resource(name=GROUP),
        message_queue=pb.MessageQueue(topic=pb.Resource(name=TOPIC), id=0),
        batch_size=16,
        auto_renew=True,
    )
    request.long_polling_timeout.seconds = POLL_S
    return request


def rss(broker: BrokerProcess) -> int:
    return int(psutil.Process(broker.pid).memory_info().rss)


async def settled(broker: BrokerProcess, limit_s: float = 60.0) -> tuple[int, int]:
    """Wait until the broker's RSS stops moving; (RSS then, peak RSS seen)."""
    deadline = time.monotonic() + limit_s
    last, since, peak = rss(broker), time.monotonic(), 0
    while time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        now = rss(broker)
        peak = max(peak, now)
        if abs(now - last) > MiB:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= SETTLE_S:
            break
    return rss(broker), peak


def connections(broker: BrokerProcess, count: int) -> list[grpc.aio.Channel]:
    """``count`` channels, each on a TCP connection of its own (channels to one target otherwise share one)."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    return [grpc.aio.insecure_channel(broker.endpoint, options=options) for _ in range(count)]


def stubs(opened: list[grpc.aio.Channel], clients: int) -> list[service_pb2_grpc.MessagingServiceAsyncStub]:
    """One stub per client, the clients spread over the connections."""
    return [service_pb2_grpc.MessagingServiceStub(opened[c % len(opened)]) for c in range(clients)]


def refusals(broker: BrokerProcess, rpc: str) -> float:
    """``lmq_calls_refused_total`` of ``rpc``, every reason (0 on a broker without the caps)."""
    prefix = "lmq_calls_refused_total{"
    with urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=5) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(prefix) and f'rpc="{rpc}"' in line)


async def one_poll(stub: service_pb2_grpc.MessagingServiceAsyncStub, client_id: str) -> None:
    call = stub.ReceiveMessage(poll_request(), metadata=headers(client_id), timeout=POLL_S + 10)
    with contextlib.suppress(grpc.aio.AioRpcError):
        async for _ in call:
            pass


async def poll_flood(broker: BrokerProcess, channels: int, clients: int, per_client: int) -> dict[str, float]:
    """``clients`` x ``per_client`` polls over ``channels`` connections; RSS figures while parked and after."""
    before, refused_before = rss(broker), refusals(broker, "ReceiveMessage")
    opened = connections(broker, channels)
    tasks = [
        asyncio.create_task(one_poll(stub, f"poll-{c}"))
        for c, stub in enumerate(stubs(opened, clients))
        for _ in range(per_client)
    ]
    parked, peak = await settled(broker)
    refused = refusals(broker, "ReceiveMessage") - refused_before
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for channel in opened:
        await channel.close(None)
    after = await held(broker)
    return {"before": before, "parked": parked, "peak": peak, "after": after, "refused": refused, "sent": len(tasks)}


async def held(broker: BrokerProcess) -> int:
    """RSS once the broker has let go (its heap trimmed: --heap-trim-interval-ms is short here)."""
    await asyncio.sleep(2.0)
    return (await settled(broker))[0]


async def settings_frames(stop: asyncio.Event, flood: bool) -> AsyncIterator[spb.TelemetryCommand]:
    """A consumer's settings once (an idle client), or 160 KiB settings frames as fast as they are taken."""
    hostname = "h" * (SETTINGS_BYTES if flood else 16)
    settings = pb.Settings(client_type=pb.PRODUCER, publishing=pb.Publishing(), user_agent=pb.UA(hostname=hostname))
    yield spb.TelemetryCommand(settings=settings)
    while flood and not stop.is_set():
        yield spb.TelemetryCommand(settings=settings)
        await asyncio.sleep(0)
    await stop.wait()


async def read_all(call: grpc.aio.StreamStreamCall[spb.TelemetryCommand, spb.TelemetryCommand]) -> None:
    with contextlib.suppress(grpc.aio.AioRpcError):
        async for _ in call:
            pass


async def telemetry_flood(
    broker: BrokerProcess, channels: int, clients: int, per_client: int, flood: bool
) -> dict[str, float]:
    """``flood``: streams that push 160 KiB frames and never read; else idle streams that read their replies."""
    before, refused_before = rss(broker), refusals(broker, "Telemetry")
    opened = connections(broker, channels)
    stop = asyncio.Event()
    calls = [
        stub.Telemetry(settings_frames(stop, flood), metadata=headers(f"tele-{c}"))
        for c, stub in enumerate(stubs(opened, clients))
        for _ in range(per_client)
    ]
    readers = [] if flood else [asyncio.create_task(read_all(call)) for call in calls]
    parked, peak = await settled(broker)
    refused = refusals(broker, "Telemetry") - refused_before
    stop.set()
    for call in calls:
        call.cancel()
    await asyncio.gather(*readers, return_exceptions=True)
    for channel in opened:
        await channel.close(None)
    after = await held(broker)
    return {"before": before, "parked": parked, "peak": peak, "after": after, "refused": refused, "sent": len(calls)}


def parked_gauge(broker: BrokerProcess) -> str:
    with contextlib.suppress(OSError), urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
        wanted = ("lmq_calls_refused_total", "lmq_parked", "lmq_telemetry")
        return ", ".join(line for line in lines if line.startswith(wanted))
    return ""


def report(name: str, got: dict[str, float], unit_name: str) -> None:
    accepted = got["sent"] - got["refused"]
    grew = got["parked"] - got["before"]
    figure(f"{name}: {unit_name} sent / refused", got["sent"], "", f" / {got['refused']:,.0f}")
    figure(f"{name}: RSS before / parked / peak", got["before"] / MiB, "MiB",
           f" / {got['parked'] / MiB:,.1f} / {got['peak'] / MiB:,.1f}")  # fmt: skip
    if accepted:
        figure(f"{name}: bytes per accepted {unit_name}", grew / accepted, "B", f" ({accepted:,.0f} accepted)")
    figure(f"{name}: RSS held after they ended (over before)", (got["after"] - got["before"]) / MiB, "MiB")


async def run(broker: BrokerProcess, quick: bool) -> None:
    scale = 5 if quick else 1
    report("polls spread (50 per client id, 250 per connection)", await poll_flood(broker, 8, 40 // scale, 50), "poll")
    report("polls flood (1 client id, 1 connection)", await poll_flood(broker, 1, 1, 10_000 // scale), "poll")
    idle = await telemetry_flood(broker, 10, 300 // scale, 1, flood=False)
    report("telemetry idle (reading, 1 per client id)", idle, "stream")
    never = await telemetry_flood(broker, 10, 300 // scale, 1, flood=True)
    report("telemetry never reading (1 per client id, 10 connections)", never, "stream")
    one = await telemetry_flood(broker, 1, 1, 300 // scale, flood=True)
    report("telemetry never reading (1 client id, 1 connection)", one, "stream")
    print("metrics:", parked_gauge(broker), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--edge", default="native", help="serve --edge: grpcio or native (docs/design/native-edge.md)")
    args = parser.parse_args()
    print(f"edge: {args.edge}", flush=True)
    flags = ["--heap-trim-interval-ms", "1000", "--long-polling-timeout-ms", str(POLL_S * 1000), "--edge", args.edge]
    with tempfile.TemporaryDirectory() as tmp, start_broker(Path(tmp) / "data", extra_args=flags) as broker:
        asyncio.run(run(broker, args.quick))


if __name__ == "__main__":
    main()
