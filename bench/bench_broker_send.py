"""Official-client send rate against the broker ÷ against a bare grpcio echo server (goal >= 0.7).

Both servers run as their own processes on this machine, in the same run: the echo server answers
QueryRoute, Telemetry and Heartbeat with the minimum the client needs and SendMessage with an immediate
OK (no validation, no storage); the broker runs with its defaults (sync flush, group commit). The same
rocketmq-python-client 5.1.2 Producer, with the same ``--threads`` sending LITE messages of ``--body``
bytes over ``--topics`` lite topics, is timed against each. Prints ``FIGURE`` lines, and each server's CPU
per message: client and servers share this machine's cores, so server CPU is client throughput lost.

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
        async def Telemetry(self, requests: Any, context: Any) -> Any:
            async for command in requests:
                settings = pb.Settings()
                settings.CopyFrom(command.settings)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--echo-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=4, help="sending threads of the one producer")
    parser.add_argument("--body", type=int, default=1024, help="body bytes")
    parser.add_argument("--topics", type=int, default=100, help="lite topics")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each timed run")
    parser.add_argument("--runs", type=int, default=5, help="alternating runs per server (runs spread widely)")
    parser.add_argument(
        "--flush-modes", default="sync,async", help="broker flush modes to measure (sync is the default config)"
    )
    args = parser.parse_args()
    if args.echo_server:
        serve_echo()
        return
    seconds = 2.0 if args.quick else args.seconds
    runs = 1 if args.quick else args.runs
    body = b"x" * args.body
    modes = [m for m in args.flush_modes.split(",") if m]
    echo_rates: list[float] = []
    echo_cpu: list[float] = []
    broker_rates: dict[str, list[float]] = {mode: [] for mode in modes}
    broker_cpu: dict[str, list[float]] = {mode: [] for mode in modes}
    echo, echo_endpoint = start_echo()
    try:
        with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
            brokers = {
                mode: stack.enter_context(start_broker(Path(tmp) / mode, extra_args=["--flush-mode", mode]))
                for mode in modes
            }
            for _ in range(runs):  # alternate, so drifting machine load hits every server alike
                rate, cpu = send_rate(echo_endpoint, seconds, args.threads, body, args.topics, pid=echo.pid)
                echo_rates.append(rate)
                echo_cpu.append(cpu)
                for mode, broker in brokers.items():
                    rate, cpu = send_rate(broker.endpoint, seconds, args.threads, body, args.topics, pid=broker.pid)
                    broker_rates[mode].append(rate)
                    broker_cpu[mode].append(cpu)
    finally:
        echo.kill()
        echo.wait()
    echo_rate = statistics.median(echo_rates)
    print(
        f"official client 5.1.2 Producer, {args.threads} threads, {args.body} B LITE messages, {args.topics} lite "
        f"topics, {seconds:.0f} s x {runs} runs per server"
    )
    print(
        f"echo server: {echo_rate:,.0f} msg/s (runs: {', '.join(f'{r:,.0f}' for r in echo_rates)}), "
        f"{statistics.median(echo_cpu):,.0f} us CPU/message; load average {os.getloadavg()[0]:.1f}"
    )
    for mode, rates in broker_rates.items():
        rate = statistics.median(rates)
        print(
            f"lmq broker, {mode} flush: {rate:,.0f} msg/s (runs: {', '.join(f'{r:,.0f}' for r in rates)}), "
            f"{statistics.median(broker_cpu[mode]):,.0f} us CPU/message"
        )
        figure(f"send rate broker({mode} flush)/echo", rate / echo_rate, "x", op=">=", target=0.7)


if __name__ == "__main__":
    main()
