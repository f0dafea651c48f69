"""Draining one lite topic: receive 32, ack each, repeat. Messages per second, and the same run's calls per
second of a bare grpcio server as the yardstick (no issue names a target for this figure).

One lite topic hands out its next batch only after every message of the last one is acked, so the rate is
set by the round: one ReceiveMessage plus 32 concurrent AckMessage calls, each ack committing the offset.
``--messages`` LITE messages are stored first; then a raw-stub consumer (the calls the official
LiteSimpleConsumer makes) drains them. The echo server of bench_broker_send.py then answers the same
33-call rounds (Heartbeat, nothing stored) from the same client, for the ratio.

    python bench/bench_broker_consume.py           # ~30 s
    python bench/bench_broker_consume.py --quick   # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import grpc
from bench_broker_send import start_echo

from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as sg
from lmq_broker.testing import start_broker

PARENT, GROUP, LITE, BATCH = "AGENT_TASK_NS", "executor-group", "drained", 32
HEADERS = (("x-mq-client-id", "bench-consume"),)


async def fill(stub: sg.MessagingServiceAsyncStub, count: int) -> None:
    for start in range(0, count, 500):
        messages = [
            pb.Message(
                topic=pb.Resource(name=PARENT),
                body=b"x" * 128,
                system_properties=pb.SystemProperties(message_id=f"m{n}", message_type=pb.LITE, lite_topic=LITE),
            )
            for n in range(start, min(count, start + 500))
        ]
        reply = await stub.SendMessage(spb.SendMessageRequest(messages=messages))
        assert reply.status.code == pb.OK, reply.status


async def ack(stub: sg.MessagingServiceAsyncStub, message: pb.Message) -> None:
    request = spb.AckMessageRequest(
        group=pb.Resource(name=GROUP),
        topic=pb.Resource(name=PARENT),
        entries=[
            spb.AckMessageEntry(
                message_id=message.system_properties.message_id,
                receipt_handle=message.system_properties.receipt_handle,
            )
        ],
    )
    reply = await stub.AckMessage(request, metadata=HEADERS)
    assert reply.status.code == pb.OK, reply.status


async def drain(endpoint: str, count: int) -> tuple[float, list[float]]:
    """(messages per second, seconds per receive+ack round)."""
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = sg.MessagingServiceStub(channel)
        await fill(stub, count)
        subscribe = spb.SyncLiteSubscriptionRequest(
            action=pb.PARTIAL_ADD, topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP), lite_topic_set=[LITE]
        )
        assert (await stub.SyncLiteSubscription(subscribe, metadata=HEADERS)).status.code == pb.OK
        queue = pb.MessageQueue(topic=pb.Resource(name=PARENT))
        receive = spb.ReceiveMessageRequest(group=pb.Resource(name=GROUP), message_queue=queue, batch_size=BATCH)
        receive.invisible_duration.seconds = 30
        receive.long_polling_timeout.seconds = 5
        got, rounds = 0, []
        started = time.perf_counter()
        while got < count:
            t = time.perf_counter()
            frames = [frame async for frame in stub.ReceiveMessage(receive, metadata=HEADERS)]
            messages = [frame.message for frame in frames if frame.HasField("message")]
            if not messages:
                raise RuntimeError(f"a receive came back empty after {got} of {count} messages")
            await asyncio.gather(*(ack(stub, m) for m in messages))
            got += len(messages)
            rounds.append(time.perf_counter() - t)
        return count / (time.perf_counter() - started), rounds


async def echo_calls(endpoint: str, rounds: int) -> float:
    """Calls per second of rounds of 1 + BATCH concurrent trivial calls, the shape of a drain round."""
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = sg.MessagingServiceStub(channel)
        request = spb.HeartbeatRequest(group=pb.Resource(name=GROUP), client_type=pb.LITE_SIMPLE_CONSUMER)
        started = time.perf_counter()
        for _ in range(rounds):
            await stub.Heartbeat(request, metadata=HEADERS)
            await asyncio.gather(*(stub.Heartbeat(request, metadata=HEADERS) for _ in range(BATCH)))
        return rounds * (1 + BATCH) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 320 messages")
    args = parser.parse_args()
    count = 320 if args.quick else args.messages
    with tempfile.TemporaryDirectory() as tmp, start_broker(Path(tmp) / "data") as broker:
        rate, rounds = asyncio.run(drain(broker.endpoint, count))
    echo, endpoint = start_echo()
    try:
        echo_rate = asyncio.run(echo_calls(endpoint, len(rounds)))
    finally:
        echo.kill()
        echo.wait()
    quantiles = statistics.quantiles(rounds, n=100) if len(rounds) > 1 else [rounds[0]] * 99
    calls = rate * (1 + BATCH) / BATCH
    print(
        f"one lite topic, {count:,} messages, receive {BATCH} + {BATCH} concurrent acks per round; "
        f"round p50 {quantiles[49] * 1e3:.1f} ms, p99 {quantiles[98] * 1e3:.1f} ms"
    )
    print(f"FIGURE one-lite-topic drain rate: {rate:,.0f} msg/s ({calls:,.0f} calls/s)", flush=True)
    print(f"FIGURE drain calls/s ÷ echo calls/s: {calls / echo_rate:.2f} (echo {echo_rate:,.0f} calls/s)", flush=True)


if __name__ == "__main__":
    main()
