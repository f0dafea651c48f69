"""What parked long polls and idle Telemetry streams cost the broker, and RSS under floods of them.

Four runs against one real broker process (raw grpc.aio stubs, no official client):

* ``spread``: POLLS ReceiveMessage long polls parked at once, spread over clients and connections so that no
  cap refuses them (50 per client id, 250 per connection): bytes per parked poll = RSS delta / POLLS, then the
  RSS still held once they ended (after a heap trim).
* ``flood``: FLOOD long polls from one client id on one connection (issue 26: 10,000): how many were refused
  (TOO_MANY_REQUESTS), the peak RSS, and what stays after.
* ``telemetry``: STREAMS Telemetry streams that push large settings frames and never read their replies,
  spread over client ids and connections: peak RSS, bytes per stream, what stays after.
* ``telemetry-flood``: the same from one client id on one connection: refused streams and peak RSS.

``--broker-path DIR`` runs the broker from another checkout (its ``broker/`` folder on PYTHONPATH), to measure
the code before a change. Prints ``FIGURE`` lines.

    python bench/bench_parked_polls.py            # ~1-2 min
    python bench/bench_parked_polls.py --quick    # smoke run (fewer polls and streams)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
import urllib.request
from collections import Counter
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


async def one_poll(stub: service_pb2_grpc.MessagingServiceAsyncStub, client_id: str, outcomes: Counter[str]) -> None:
    call = stub.ReceiveMessage(poll_request(), metadata=headers(client_id), timeout=POLL_S + 10)
    try:
        async for frame in call:
            if frame.HasField("status"):
                outcomes[pb.Code.Name(frame.status.code)] += 1
    except grpc.aio.AioRpcError as exc:
        outcomes[f"grpc {exc.code().name}"] += 1
    except asyncio.CancelledError:
        outcomes["parked"] += 1
        raise


async def poll_flood(broker: BrokerProcess, channels: int, clients: int, per_client: int) -> dict[str, float]:
    """``clients`` x ``per_client`` polls over ``channels`` connections; RSS figures while parked and after."""
    before = rss(broker)
    opened = [grpc.aio.insecure_channel(broker.endpoint) for _ in range(channels)]
    outcomes: Counter[str] = Counter()
    tasks = []
    for c in range(clients):
        stub: service_pb2_grpc.MessagingServiceAsyncStub = service_pb2_grpc.MessagingServiceStub(opened[c % channels])
        tasks += [asyncio.create_task(one_poll(stub, f"poll-{c}", outcomes)) for _ in range(per_client)]
    parked, peak = await settled(broker)
    refused = outcomes.get("TOO_MANY_REQUESTS", 0)
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


async def settings_frames(stop: asyncio.Event) -> AsyncIterator[spb.TelemetryCommand]:
    settings = pb.Settings(
        client_type=pb.PRODUCER, publishing=pb.Publishing(), user_agent=pb.UA(hostname="h" * SETTINGS_BYTES)
    )
    while not stop.is_set():
        yield spb.TelemetryCommand(settings=settings)
        await asyncio.sleep(0)


async def telemetry_flood(broker: BrokerProcess, channels: int, clients: int, per_client: int) -> dict[str, float]:
    before = rss(broker)
    opened = [grpc.aio.insecure_channel(broker.endpoint) for _ in range(channels)]
    stop = asyncio.Event()
    calls = []
    for c in range(clients):
        stub: service_pb2_grpc.MessagingServiceAsyncStub = service_pb2_grpc.MessagingServiceStub(opened[c % channels])
        calls += [stub.Telemetry(settings_frames(stop), metadata=headers(f"tele-{c}")) for _ in range(per_client)]
    refused = 0
    waiting = [asyncio.create_task(call.code()) for call in calls]
    parked, peak = await settled(broker)
    for task in waiting:
        if task.done() and task.result() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            refused += 1
    stop.set()
    for call in calls:
        call.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
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
    report("spread polls", await poll_flood(broker, 8, 40 // scale, 50), "poll")
    report("flood polls (1 client, 1 connection)", await poll_flood(broker, 1, 1, 10_000 // scale), "poll")
    report("telemetry streams (spread)", await telemetry_flood(broker, 10, 50 // scale, 2), "stream")
    report("telemetry flood (1 client, 1 connection)", await telemetry_flood(broker, 1, 1, 300 // scale), "stream")
    print("metrics:", parked_gauge(broker), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--broker-path", type=Path, help="run the broker from this checkout (its broker/ folder)")
    args = parser.parse_args()
    env = {"PYTHONPATH": str(args.broker_path / "broker")} if args.broker_path else None
    flags = ["--heap-trim-interval-ms", "1000", "--long-polling-timeout-ms", str(POLL_S * 1000)]
    with tempfile.TemporaryDirectory() as tmp, start_broker(Path(tmp) / "data", extra_args=flags, env=env) as broker:
        asyncio.run(run(broker, args.quick))


if __name__ == "__main__":
    main()
