"""Official-client send rate against the broker ÷ against a bare grpcio echo server (goal >= 0.7), and each
server's CPU per message for sends and for receive + ack (goal: the broker's <= 1.2x the echo's, issue 28).

Both servers run as their own processes on this machine, in the same run: the echo server answers
QueryRoute, Telemetry and Heartbeat with the minimum the client needs and SendMessage with an immediate
OK (no validation, no storage); the broker runs with its defaults (sync flush, group commit, the native edge;
``--edge grpcio`` for grpcio's). The same
rocketmq-python-client 5.1.2 Producer, with the same ``--threads`` sending LITE messages of ``--body``
bytes over ``--topics`` lite topics, is timed against each. Prints ``FIGURE`` lines, and each server's CPU
per message: client and servers share this machine's cores, so server CPU is client throughput lost.

Receive + ack: the official LiteSimpleConsumer of the same client receives batches of 32 from one lite topic
and acks each message (one AckMessage call per message, as it does), ``--drain`` messages per run. The broker
holds them (sent before the clock starts); the echo answers every ReceiveMessage with 32 made-up messages and
every AckMessage with OK (it also answers SyncLiteSubscription and the consumer's settings). The figure is
server CPU per message received and acked.

    python bench/bench_broker_send.py           # ~90 s
    python bench/bench_broker_send.py --quick   # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from lmq_broker.testing import start_broker

ECHO_READY = "echo-server ready port="
ECHO_BODY = b"x" * 1024
DRAIN_LITE = "drained"
BATCH = 32


def figure(name: str, value: float, unit: str, *, op: str, target: float, extra: str = "") -> None:
    ok = value >= target if op == ">=" else value <= target
    verdict = "PASS" if ok else "BELOW TARGET"
    print(f"FIGURE {name}: {value:,.2f} {unit} (target {op} {target:,.2f} {unit}) {verdict}{extra}", flush=True)


# --- the echo server (its own process; uses lmq's generated stubs, never the official client) ------------------
def serve_echo() -> None:
    import grpc  # noqa: PLC0415
    from typing_extensions import override  # noqa: PLC0415

    from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb  # noqa: PLC0415
    from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb  # noqa: PLC0415
    from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc  # noqa: PLC0415

    class Echo(service_pb2_grpc.MessagingServiceServicer):
        def __init__(self, port: int) -> None:
            self.port = port
            self.received = 0

        @override
        async def QueryRoute(self, request: Any, context: Any) -> Any:
            endpoints = pb.Endpoints(scheme=pb.IPv4, addresses=[pb.Address(host="127.0.0.1", port=self.port)])
            queue = pb.MessageQueue(
                topic=request.topic, id=0, permission=pb.READ_WRITE,
                broker=pb.Broker(name="echo", id=0, endpoints=endpoints), accept_message_types=[pb.LITE, pb.NORMAL],
            )  # fmt: skip
            return spb.QueryRouteResponse(status=pb.Status(code=pb.OK), message_queues=[queue])

        @override
        async def Heartbeat(self, request: Any, context: Any) -> Any:
            return spb.HeartbeatResponse(status=pb.Status(code=pb.OK))

        @override
        async def NotifyClientTermination(self, request: Any, context: Any) -> Any:
            return spb.NotifyClientTerminationResponse(status=pb.Status(code=pb.OK))

        @override
        async def SendMessage(self, request: Any, context: Any) -> Any:
            reply = spb.SendMessageResponse(status=pb.Status(code=pb.OK))
            for m in request.messages:
                reply.entries.add(status=pb.Status(code=pb.OK), message_id=m.system_properties.message_id)
            return reply

        @override
        async def ReceiveMessage(self, request: Any, context: Any) -> Any:
            yield spb.ReceiveMessageResponse(status=pb.Status(code=pb.OK))
            for _ in range(request.batch_size):
                self.received += 1
                props = pb.SystemProperties(
                    message_id=f"echo-{self.received}", message_type=pb.LITE, lite_topic=DRAIN_LITE,
                    receipt_handle=f"rh-{self.received}", delivery_attempt=1, body_encoding=pb.IDENTITY,
                )  # fmt: skip
                message = pb.Message(topic=request.message_queue.topic, body=ECHO_BODY, system_properties=props)
                yield spb.ReceiveMessageResponse(message=message)

        @override
        async def AckMessage(self, request: Any, context: Any) -> Any:
            reply = spb.AckMessageResponse(status=pb.Status(code=pb.OK))
            for entry in request.entries:
                reply.entries.add(status=pb.Status(code=pb.OK), message_id=entry.message_id)
            return reply

        @override
        async def SyncLiteSubscription(self, request: Any, context: Any) -> Any:
            return spb.SyncLiteSubscriptionResponse(status=pb.Status(code=pb.OK))

        @override
        async def Telemetry(self, requests: Any, context: Any) -> Any:
            async for command in requests:
                settings = pb.Settings()
                settings.CopyFrom(command.settings)
                if settings.HasField("subscription"):  # a consumer (pub_sub is a oneof)
                    settings.subscription.lite_subscription_quota = 2000
                    settings.subscription.max_lite_topic_size = 64
                else:
                    settings.publishing.max_body_size = 4 * 1024 * 1024
                    settings.publishing.validate_message_type = True
                yield spb.TelemetryCommand(status=pb.Status(code=pb.OK), settings=settings)

    async def main() -> None:
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        service_pb2_grpc.add_MessagingServiceServicer_to_server(Echo(port), server)  # type: ignore[abstract]
        await server.start()
        print(f"{ECHO_READY}{port}", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def start_echo() -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        [sys.executable, __file__, "--echo-server"], stdout=subprocess.PIPE, text=True, env={**os.environ}
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith(ECHO_READY):
        process.kill()
        raise RuntimeError(f"echo server did not start: {line!r}")
    return process, f"127.0.0.1:{int(line[len(ECHO_READY) :])}"


# --- the client side (official client) -------------------------------------------------------------------
def cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def send_rate(
    endpoint: str, seconds: float, threads: int, body: bytes, topics: int, *, pid: int
) -> tuple[float, float]:
    """(messages per second, server CPU microseconds per message) of one timed run."""
    from rocketmq import ClientConfiguration, Credentials, Message, Producer  # noqa: PLC0415

    producer = Producer(ClientConfiguration(endpoint, Credentials()), ("AGENT_TASK_NS",))
    producer.startup()
    try:
        for i in range(50):  # warm: route, channel, settings
            m = Message()
            m.topic, m.lite_topic, m.body = "AGENT_TASK_NS", f"warm-{i % topics}", body
            producer.send(m)
        counts = [0] * threads
        stop = time.monotonic() + seconds

        def work(index: int) -> None:
            n = 0
            while time.monotonic() < stop:
                m = Message()
                m.topic, m.lite_topic, m.body = "AGENT_TASK_NS", f"t{(index * 7919 + n) % topics}", body
                producer.send(m)
                n += 1
            counts[index] = n

        workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        cpu_before = cpu_s(pid)
        started = time.monotonic()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        sent = sum(counts)
        return sent / (time.monotonic() - started), (cpu_s(pid) - cpu_before) * 1e6 / max(1, sent)
    finally:
        producer.shutdown()


def fill(endpoint: str, count: int, body: bytes) -> None:
    """``count`` messages into the drained lite topic, with the official Producer (before any clock starts)."""
    from rocketmq import ClientConfiguration, Credentials, Message, Producer  # noqa: PLC0415

    producer = Producer(ClientConfiguration(endpoint, Credentials()), ("AGENT_TASK_NS",))
    producer.startup()
    try:
        futures = []
        for _ in range(count):
            m = Message()
            m.topic, m.lite_topic, m.body = "AGENT_TASK_NS", DRAIN_LITE, body
            futures.append(producer.send_async(m))
        for future in futures:
            future.result(timeout=60)
    finally:
        producer.shutdown()


def drain_cpu(endpoint: str, count: int, *, pid: int) -> tuple[float, float]:
    """(messages per second, server CPU microseconds per message) of receiving and acking ``count`` messages."""
    from rocketmq import ClientConfiguration, Credentials, LiteSimpleConsumer  # noqa: PLC0415

    consumer = LiteSimpleConsumer("AGENT_TASK_NS", ClientConfiguration(endpoint, Credentials()), "executor-group", 5)
    consumer.startup()
    try:
        deadline = time.monotonic() + 15
        while True:  # the quota arrives with the first settings, after startup returns
            try:
                consumer.subscribe_lite(DRAIN_LITE)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        done = 0
        cpu_before = cpu_s(pid)
        started = time.monotonic()
        while done < count:
            batch = consumer.receive(BATCH, 30)
            if not batch and time.monotonic() - started > 120:
                raise RuntimeError(f"drained only {done} of {count} messages")
            for message in batch:
                consumer.ack(message)
            done += len(batch)
        return done / (time.monotonic() - started), (cpu_s(pid) - cpu_before) * 1e6 / max(1, done)
    finally:
        consumer.shutdown()


class Measured:
    """Every run's (msg/s, server CPU us per message) of one server, for sends and for receive + ack."""

    def __init__(self) -> None:
        self.send: list[tuple[float, float]] = []
        self.drain: list[tuple[float, float]] = []

    def line(self, name: str) -> str:
        rates = [rate for rate, _ in self.send]
        out = (
            f"{name}: send {statistics.median(rates):,.0f} msg/s (runs: {', '.join(f'{r:,.0f}' for r in rates)}), "
            f"{self.send_cpu():,.0f} us CPU/message"
        )
        if self.drain:
            rate = statistics.median(r for r, _ in self.drain)
            out += f"; receive+ack {rate:,.0f} msg/s, {self.drain_cpu():,.0f} us CPU/message"
        return out

    def send_rate(self) -> float:
        return statistics.median(rate for rate, _ in self.send)

    def send_cpu(self) -> float:
        return statistics.median(cpu for _, cpu in self.send)

    def drain_cpu(self) -> float:
        return statistics.median(cpu for _, cpu in self.drain)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--echo-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=4, help="sending threads of the one producer")
    parser.add_argument("--body", type=int, default=1024, help="body bytes")
    parser.add_argument("--topics", type=int, default=100, help="lite topics")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each timed run")
    parser.add_argument("--runs", type=int, default=5, help="alternating runs per server (runs spread widely)")
    parser.add_argument("--drain", type=int, default=1000, help="messages received and acked per run (0: none)")
    parser.add_argument(
        "--flush-modes", default="sync,async", help="broker flush modes to measure (sync is the default config)"
    )
    parser.add_argument(
        "--edge", default="native", choices=("grpcio", "native"), help="the brokers' edge (serve --edge)"
    )
    args = parser.parse_args()
    if args.echo_server:
        serve_echo()
        return
    seconds = 2.0 if args.quick else args.seconds
    runs = 1 if args.quick else args.runs
    drain = min(args.drain, 128) if args.quick else args.drain
    body = b"x" * args.body
    modes = [m for m in args.flush_modes.split(",") if m]
    echo_measured = Measured()
    measured = {mode: Measured() for mode in modes}
    echo, echo_endpoint = start_echo()
    try:
        with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
            brokers = {
                mode: stack.enter_context(
                    start_broker(Path(tmp) / mode, extra_args=["--flush-mode", mode, "--edge", args.edge])
                )
                for mode in modes
            }
            for _ in range(runs):  # alternate, so drifting machine load hits every server alike
                echo_measured.send.append(
                    send_rate(echo_endpoint, seconds, args.threads, body, args.topics, pid=echo.pid)
                )
                for mode, broker in brokers.items():
                    measured[mode].send.append(
                        send_rate(broker.endpoint, seconds, args.threads, body, args.topics, pid=broker.pid)
                    )
                if drain:
                    echo_measured.drain.append(drain_cpu(echo_endpoint, drain, pid=echo.pid))
                    for mode, broker in brokers.items():
                        fill(broker.endpoint, drain, body)
                        measured[mode].drain.append(drain_cpu(broker.endpoint, drain, pid=broker.pid))
    finally:
        echo.kill()
        echo.wait()
    report(args, (seconds, runs, drain), echo_measured, measured)


def report(
    args: argparse.Namespace, shape: tuple[float, int, int], echo: Measured, measured: dict[str, Measured]
) -> None:
    seconds, runs, drain = shape
    print(
        f"official client 5.1.2 Producer, {args.threads} threads, {args.body} B LITE messages, {args.topics} lite "
        f"topics, {seconds:.0f} s x {runs} runs per server; LiteSimpleConsumer receive {BATCH} + ack each, "
        f"{drain} messages per run; the brokers' edge: {args.edge}; load average {os.getloadavg()[0]:.1f}"
    )
    print(echo.line("echo server"))
    for mode, m in measured.items():
        print(m.line(f"lmq broker, {mode} flush"))
        figure(f"send rate broker({mode} flush)/echo", m.send_rate() / echo.send_rate(), "x", op=">=", target=0.7)
        figure(f"send CPU per message broker({mode} flush)/echo", m.send_cpu() / echo.send_cpu(), "x", op="<=",
               target=1.2)  # fmt: skip
        if drain:
            figure(f"receive+ack CPU per message broker({mode} flush)/echo", m.drain_cpu() / echo.drain_cpu(), "x",
                   op="<=", target=1.2)  # fmt: skip


if __name__ == "__main__":
    main()
