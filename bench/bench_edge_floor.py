"""Server CPU per message under a native load generator: lmq vs a bare grpcio echo, beside RocketMQ 5.5.0.

Issue 28 item 7 asks whether Python-level tuning can reach RocketMQ 5.5.0's 221 us of server CPU per message
(official Java client, 256 sends in flight, 1 KiB LITE messages, 2-core host; a figure quoted from the issue,
not measured here). The load here is ghz (a Go gRPC load tool, so the generator costs no Python): 256 unary
SendMessage calls in flight on one HTTP/2 connection, as one official client's channel carries them, each a
valid one-message LITE request (1 KiB body, lite topics ``t0..t99`` of AGENT_TASK_NS, distinct message ids)
read from a file of serialized requests. Three servers, each its own process, alternating runs:

* ``echo``: the bare grpcio aio server of ``bench_broker_send.py`` (answers OK with the message ids; parses
  the request, stores nothing): the floor of any server on grpcio's asyncio API, which lmq uses.
* ``sync echo``: the same answer from grpcio's synchronous server (a thread pool of ``--sync-workers``, no
  asyncio): what grpcio costs without its asyncio layer.
* ``lmq``: ``python -m lmq_broker serve`` standalone on a real port with its defaults (sync flush).
* ``lmq native``: the same broker with ``--edge native`` (the Rust HTTP/2 edge, docs/design/native-edge.md;
  ``make native``), in the same run: ``--edge grpcio,native`` (the default when the module is built).

The figure is server CPU (user + system, from /proc through psutil) per message answered OK, which the other
load on a shared 2-core host changes far less than msg/s; the load average is printed with every run. If the
aio echo alone costs more than 221 us, no change in lmq's handlers reaches RocketMQ: see
docs/design/native-edge.md.

ghz is found on PATH, in ``$LMQ_GHZ``, or in ~/.cache/lmq/bin; else it is built there once with
``go install github.com/bojand/ghz/cmd/ghz@v0.120.0`` (the Go module proxy; never inside the repository).

    python bench/bench_edge_floor.py            # ~2 min (after ghz is built)
    python bench/bench_edge_floor.py --quick    # smoke run
    python bench/bench_edge_floor.py --edge native --inflight 256   # the native edge alone beside the echoes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Final, NamedTuple

import grpc
import psutil
from bench_broker_send import start_echo

from lmq_broker.protocol import native
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.testing import start_broker

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "proto"
GHZ_MODULE = "github.com/bojand/ghz/cmd/ghz@v0.120.0"
GHZ_CACHE = Path.home() / ".cache" / "lmq" / "bin"
CALL = "apache.rocketmq.v2.MessagingService.SendMessage"
PARENT = "AGENT_TASK_NS"
# RocketMQ 5.5.0's server CPU per message (us) by calls in flight, official Java client, 1 KiB LITE, 2 cores:
# quoted from issue 28 item 7, not measured here.
ROCKETMQ_US: Final = {256: 221.0, 1: 1098.0}


def figure(name: str, value: float, unit: str, *, op: str, target: float, extra: str = "") -> None:
    ok = value >= target if op == ">=" else value <= target
    verdict = "PASS" if ok else "BELOW TARGET"
    print(f"FIGURE {name}: {value:,.2f} {unit} (target {op} {target:,.2f} {unit}) {verdict}{extra}", flush=True)


def ghz_binary() -> str:
    """The ghz executable: found, or built once into ~/.cache/lmq/bin from the Go module proxy."""
    found = os.environ.get("LMQ_GHZ") or shutil.which("ghz")
    if found:
        return found
    cached = GHZ_CACHE / "ghz"
    if cached.exists():
        return str(cached)
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None)
    if go is None:
        sys.exit("bench_edge_floor: no ghz and no Go toolchain to build it (set LMQ_GHZ)")
    GHZ_CACHE.mkdir(parents=True, exist_ok=True)
    print(f"building ghz into {GHZ_CACHE} (once): go install {GHZ_MODULE}", flush=True)
    subprocess.run([go, "install", GHZ_MODULE], check=True, env={**os.environ, "GOBIN": str(GHZ_CACHE)}, cwd="/")
    return str(cached)


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def request(n: int, body: bytes, topics: int) -> spb.SendMessageRequest:
    message = pb.Message(
        topic=pb.Resource(name=PARENT),
        body=body,
        system_properties=pb.SystemProperties(
            message_id=f"01EDGE{n:026X}", message_type=pb.LITE, lite_topic=f"t{n % topics}", body_encoding=pb.IDENTITY
        ),
    )
    return spb.SendMessageRequest(messages=[message])


def write_requests(path: Path, count: int, body: bytes, topics: int) -> None:
    """``count`` requests, count-delimited (a varint length before each): ghz sends them round-robin."""
    with path.open("wb") as out:
        for n in range(count):
            data = request(n, body, topics).SerializeToString()
            out.write(varint(len(data)) + data)


def check_ok(endpoint: str, body: bytes) -> None:
    """One request through Python first, so a run of v2-level refusals (gRPC OK, status not OK) is caught."""
    with grpc.insecure_channel(endpoint) as channel:
        call = channel.unary_unary(
            f"/{CALL.rsplit('.', 1)[0]}/SendMessage",
            request_serializer=spb.SendMessageRequest.SerializeToString,
            response_deserializer=spb.SendMessageResponse.FromString,
        )
        reply = call(request(10**9, body, 1), timeout=30)
    if reply.status.code != pb.OK:
        raise RuntimeError(f"{endpoint} refused the bench's request: {reply.status}")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and its children (a broker may run helpers)."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        times = proc.cpu_times()
        total += times.user + times.system
    return total


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Run(NamedTuple):
    rate: float  # msg/s answered OK
    server_us: float  # server CPU per message
    ghz_us: float  # the load generator's CPU per message
    load: float  # 1-minute load average at the end of the run


def ghz_run(ghz: str, endpoint: str, data: Path, *, inflight: int, seconds: float, pid: int) -> Run:
    command = [
        ghz, "--insecure", "--proto", str(PROTO_DIR / "apache/rocketmq/v2/service.proto"),
        "--import-paths", str(PROTO_DIR), "--call", CALL, "--binary-file", str(data),
        "--concurrency", str(inflight), "--connections", "1", "--duration", f"{seconds}s",
        "--timeout", "30s", "--format", "json", endpoint,
    ]  # fmt: skip
    before, ghz_before = tree_cpu_s(pid), children_cpu_s()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    used, ghz_used = tree_cpu_s(pid) - before, children_cpu_s() - ghz_before
    if done.returncode != 0 and not done.stdout.strip():
        raise RuntimeError(f"ghz failed ({done.returncode}): {done.stderr[-2000:]}")
    report = json.loads(done.stdout)
    ok = int(report.get("statusCodeDistribution", {}).get("OK", 0))
    if ok == 0:
        raise RuntimeError(f"ghz: no call answered OK: {report.get('errorDistribution')}")
    return Run(ok / (report["total"] / 1e9), used * 1e6 / ok, ghz_used * 1e6 / ok, os.getloadavg()[0])


def describe(name: str, runs: list[Run]) -> str:
    each = ", ".join(f"{r.server_us:,.0f} us @ {r.rate:,.0f} msg/s (load {r.load:.1f})" for r in runs)
    return (
        f"{name}: server CPU {statistics.median(r.server_us for r in runs):,.0f} us/message, "
        f"{statistics.median(r.rate for r in runs):,.0f} msg/s, ghz {statistics.median(r.ghz_us for r in runs):,.0f} "
        f"us/message (runs: {each})"
    )


SYNC_ECHO_READY = "sync-echo ready port="


def serve_sync_echo(workers: int) -> None:
    """grpcio's synchronous server (a thread pool; no asyncio) answering SendMessage as the aio echo does."""
    from concurrent import futures  # noqa: PLC0415

    from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc  # noqa: PLC0415

    class Echo(service_pb2_grpc.MessagingServiceServicer):
        def SendMessage(self, request: Any, context: Any) -> Any:  # noqa: N802 (the RPC's name)
            reply = spb.SendMessageResponse(status=pb.Status(code=pb.OK))
            for m in request.messages:
                reply.entries.add(status=pb.Status(code=pb.OK), message_id=m.system_properties.message_id)
            return reply

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    service_pb2_grpc.add_MessagingServiceServicer_to_server(Echo(), server)  # type: ignore[abstract]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"{SYNC_ECHO_READY}{port}", flush=True)
    server.wait_for_termination()


def start_sync_echo(workers: int) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, __file__, "--sync-echo-server", "--sync-workers", str(workers)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith(SYNC_ECHO_READY):
        process.kill()
        raise RuntimeError(f"sync echo server did not start: {line!r}")
    return process, f"127.0.0.1:{int(line[len(SYNC_ECHO_READY) :])}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--inflight", default="256", help="calls in flight, comma-separated list (e.g. 1,256)")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each timed run")
    parser.add_argument("--runs", type=int, default=3, help="alternating runs per server")
    parser.add_argument("--body", type=int, default=1024, help="body bytes")
    parser.add_argument("--topics", type=int, default=100, help="lite topics")
    parser.add_argument("--sync-workers", type=int, default=16, help="threads of the sync grpcio echo")
    parser.add_argument(
        "--edge",
        default="grpcio,native" if native.available() else "grpcio",
        help="lmq's edges to measure, comma-separated: grpcio, native (serve --edge; native needs `make native`)",
    )
    parser.add_argument("--sync-echo-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sync_echo_server:
        serve_sync_echo(args.sync_workers)
        return
    seconds, runs = (2.0, 1) if args.quick else (args.seconds, args.runs)
    ghz = ghz_binary()
    body = b"x" * args.body
    echo, echo_endpoint = start_echo()
    sync_echo, sync_endpoint = start_sync_echo(args.sync_workers)
    try:
        with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as brokers:
            data = Path(tmp) / "requests.bin"
            write_requests(data, 4096, body, args.topics)
            servers = {"echo": (echo_endpoint, echo.pid), "sync echo": (sync_endpoint, sync_echo.pid)}
            for edge in [e for e in args.edge.split(",") if e]:
                name = "lmq" if edge == "grpcio" else f"lmq {edge}"
                broker = brokers.enter_context(start_broker(Path(tmp) / edge, extra_args=("--edge", edge)))
                servers[name] = (broker.endpoint, broker.pid)
            for endpoint, pid in servers.values():
                check_ok(endpoint, body)
                ghz_run(ghz, endpoint, data, inflight=64, seconds=1.0, pid=pid)  # warm: channel, topics
            for inflight in [int(n) for n in args.inflight.split(",") if n]:
                measured: dict[str, list[Run]] = {name: [] for name in servers}
                for _ in range(runs):  # alternate, so drifting machine load hits every server alike
                    for name, (endpoint, pid) in servers.items():
                        run = ghz_run(ghz, endpoint, data, inflight=inflight, seconds=seconds, pid=pid)
                        measured[name].append(run)
                report(inflight, measured, args, seconds, runs)
    finally:
        for process in (echo, sync_echo):
            process.kill()
            process.wait()


def report(inflight: int, measured: dict[str, list[Run]], args: argparse.Namespace, seconds: float, runs: int) -> None:
    print(
        f"ghz v0.120.0, {inflight} SendMessage calls in flight on 1 connection, {args.body} B LITE messages, "
        f"{args.topics} lite topics, {seconds:.0f} s x {runs} alternating runs per server; {os.cpu_count()} cores"
    )
    for name, runs_of in measured.items():
        print(describe(name, runs_of))
    echo_us = statistics.median(r.server_us for r in measured["echo"])
    edges = {
        name: statistics.median(r.server_us for r in runs_of) for name, runs_of in measured.items() if "lmq" in name
    }
    for name, lmq_us in edges.items():
        figure(f"{name} ÷ bare echo, {inflight} in flight", lmq_us / echo_us, "x", op="<=", target=1.2)
    if "lmq" in edges and "lmq native" in edges:
        print(f"native edge ÷ grpcio edge, {inflight} in flight: {edges['lmq native'] / edges['lmq']:.2f}x")
    rocketmq = ROCKETMQ_US.get(inflight)
    if rocketmq is None:
        print(f"(no RocketMQ 5.5.0 figure quoted for {inflight} in flight: measured for 1 and 256)")
        return
    quoted = f" (RocketMQ 5.5.0: {rocketmq:,.0f} us/message, issue 28 item 7, quoted, not measured here)"
    figure(f"edge floor, bare grpcio echo CPU per message, {inflight} in flight", echo_us, "us", op="<=",
           target=rocketmq, extra=quoted)  # fmt: skip
    sync_us = statistics.median(r.server_us for r in measured["sync echo"])
    figure(f"sync grpcio echo (thread pool) CPU per message, {inflight} in flight", sync_us, "us", op="<=",
           target=rocketmq)  # fmt: skip
    for name, lmq_us in edges.items():
        figure(f"{name} server CPU per message, {inflight} in flight", lmq_us, "us", op="<=", target=rocketmq)
        figure(f"{name} ÷ RocketMQ 5.5.0 (quoted), {inflight} in flight", lmq_us / rocketmq, "x", op="<=", target=1.0)


if __name__ == "__main__":
    main()
