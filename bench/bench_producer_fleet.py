"""A producer fleet through one access port: msg/s and broker CPU per message for ``serve --processes N``,
N = 1, 2, 4, and the ratio N=4 ÷ N=1 of CPU per message (goal <= 1.15, issue 28 item 3).

Production's shape: many producer processes, each with its own channel (one HTTP/2 connection), each sending
one LITE message per SendMessage call with the official client's headers, a few calls in flight (the official
clients' synchronous ``send`` from a few threads), all to the pod's one access port. With N > 1 the kernel
spreads the connections over the N processes (SO_REUSEPORT) and a message whose lite topic another process
owns takes the forward hop, as every official client's sends do, since producers pick a broker round-robin.

``--producers`` K processes (this script re-run with ``--producer``: raw gRPC stubs, so the load costs no
client library's own work), each with ``--inflight`` calls in flight for ``--seconds`` after a common start.
The figure is the brokers' CPU (user + system, every process of the pod summed) per message acknowledged,
which more processes than cores leave meaningful (msg/s is capped by the host's cores); the load average is
printed with every run, and so are two figures of batching: messages per group commit of the store
(``lmq_append_commits_total`` of every process; each commit is a write and, with sync flush, an fsync) and
context switches per message of every thread of the pod (each is a thread that went to sleep and was woken:
the event loops, the edges' and the appenders' threads). ``--local-hop socket,grpc`` (the default) measures
every N > 1 with the pod's local hop (``cluster.local_hop``: a Unix socket between its processes) and with gRPC
between them (the baseline, as before it), the pods all started at once and their runs interleaved.

    python bench/bench_producer_fleet.py            # ~2 min
    python bench/bench_producer_fleet.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import grpc
import psutil

from lmq_broker import model
from lmq_broker.cluster import membership as mb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.testing import BrokerProcess, start_broker

METHOD = "/apache.rocketmq.v2.MessagingService/SendMessage"
PARENT = "AGENT_TASK_NS"
GOAL_RATIO = 1.15
PROCESS_RE = re.compile(r"lmq-broker process (\d+) grpc=(\S+) metrics=(\d+)")
PAYLOADS_PER_PRODUCER = 2048


def figure(name: str, value: float, unit: str, *, op: str, target: float, extra: str = "") -> None:
    ok = value >= target if op == ">=" else value <= target
    verdict = "PASS" if ok else "BELOW TARGET"
    print(f"FIGURE {name}: {value:,.2f} {unit} (target {op} {target:,.2f} {unit}) {verdict}{extra}", flush=True)


# --- one producer process ------------------------------------------------------------------------------------
def payloads(index: int, topics: int, body: bytes, owned: Sequence[str] = ()) -> list[bytes]:
    """``owned``: the lite topics to send to (a direct producer's, those of the process it dials)."""
    names = list(owned) or [f"t{i}" for i in range(topics)]
    out = []
    for n in range(PAYLOADS_PER_PRODUCER):
        props = pb.SystemProperties(
            message_id=f"01F{index:04X}{n:025X}", message_type=pb.LITE,
            lite_topic=names[(index * 7919 + n) % len(names)], body_encoding=pb.IDENTITY, born_host="producer",
        )  # fmt: skip
        message = pb.Message(topic=pb.Resource(name=PARENT), body=body, system_properties=props)
        out.append(spb.SendMessageRequest(messages=[message]).SerializeToString())
    return out


def headers(client_id: str) -> tuple[tuple[str, str], ...]:
    """What the official clients put on every call (no signature: the broker runs without client auth)."""
    return (
        ("x-mq-client-id", client_id), ("x-mq-language", "JAVA"), ("x-mq-protocol", "v2"),
        ("x-mq-client-version", "5.0.8"), ("x-mq-date-time", time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())),
        ("x-mq-request-id", str(uuid.uuid4())),
    )  # fmt: skip


async def produce(endpoint: str, index: int, args: argparse.Namespace) -> None:
    owned: list[str] = []
    if args.members:  # direct: only the topics the process at ``endpoint`` owns
        members = tuple(args.members.split(","))
        membership = mb.Membership(members, (len(members),))
        slot = members.index(endpoint)
        names = (f"t{i}" for i in range(args.topics))
        owned = [n for n in names if mb.owner(membership, model.QueueId.lmq(PARENT, n).topic) == slot]
    data = payloads(index, args.topics, b"x" * args.body, owned)
    metadata = headers(f"fleet-{os.getpid()}@{index}")
    async with grpc.aio.insecure_channel(endpoint) as channel:  # one channel: one connection, as one client
        call = channel.unary_unary(
            METHOD, request_serializer=None, response_deserializer=spb.SendMessageResponse.FromString
        )
        for raw in data[:20]:  # warm: connection, routes, placement
            await call(raw, metadata=metadata, timeout=30)
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # "go"
        stop = time.monotonic() + args.seconds
        counts = [0] * args.inflight

        async def worker(slot: int) -> None:
            n = slot
            while time.monotonic() < stop:
                reply = await call(data[n % len(data)], metadata=metadata, timeout=30)
                if reply.status.code != pb.OK:
                    raise RuntimeError(f"send refused: {reply.status}")
                counts[slot] += 1
                n += args.inflight

        await asyncio.gather(*(worker(slot) for slot in range(args.inflight)))
    print(f"sent {sum(counts)}", flush=True)


# --- the fleet ------------------------------------------------------------------------------------------------
class Run(NamedTuple):
    rate: float  # msg/s acknowledged, all producers
    cpu_us: float  # broker CPU per message, every process of the pod
    load: float  # 1-minute load average after the run
    per_commit: float  # messages per group commit of the store, every process
    switches: float  # context switches per message, every thread of the pod


def pod_cpu_s(pid: int) -> float:
    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        times = proc.cpu_times()
        total += times.user + times.system
    return total


def pod_switches(pid: int) -> int:
    """Context switches (voluntary and not) of every thread of every process of the pod so far."""
    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        for status in Path(f"/proc/{proc.pid}/task").glob("*/status"):
            with contextlib.suppress(OSError):
                for line in status.read_text().splitlines():
                    if "ctxt_switches:" in line:
                        total += int(line.split()[-1])
    return total


def pod_commits(pod: BrokerProcess) -> float:
    """Group commits of the store (``lmq_append_commits_total``) of every process of the pod so far."""
    # each process's latest line: the supervisor prints it again when it starts a process again (its death and
    # cause are in the log: ``broker process <i> ended: ...``)
    ports = list({m[1]: m[3] for m in PROCESS_RE.finditer(pod.log())}.values()) or [str(pod.metrics_port)]
    total = 0.0
    for port in ports:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
                text = answer.read().decode()
        except OSError as e:  # a process of the pod is down: say why, from the pod's own log
            raise RuntimeError(f"metrics port {port} of the pod: {e}; {ended(pod)}") from e
        total += sum(
            float(line.split()[-1]) for line in text.splitlines() if line.startswith("lmq_append_commits_total")
        )
    return total


def deaths(pod: BrokerProcess) -> list[str]:
    """What the pod logged around each death of one of its processes: the log before it (a native crash's
    message precedes the stacks its fault handler dumps) and the supervisor's line (the cause, its last lines)."""
    log = pod.log()
    found = re.finditer(r"^.*broker process \d+ ended: ", log, re.M)
    return [log[max(0, m.start() - 3000) : m.start() + 2000] for m in found]


def ended(pod: BrokerProcess) -> str:
    """The pod's processes that died, or the end of its log."""
    died = deaths(pod)
    return "processes ended:\n" + "\n".join(died) if died else f"the pod's log ends:\n{pod.log()[-4000:]}"


def fleet_run(pod: BrokerProcess, args: argparse.Namespace, members: Sequence[str] = ()) -> Run:
    """``members``: each process's own endpoint; given, producer i dials process i mod N with its topics only."""
    endpoint, pid = pod.endpoint, pod.pid
    command = [sys.executable, __file__, "--topics", str(args.topics), "--body", str(args.body),
               "--inflight", str(args.inflight), "--seconds", str(args.seconds)]  # fmt: skip
    if members:
        command += ["--members", ",".join(members)]
    producers = [
        subprocess.Popen(
            [*command, "--producer", members[i % len(members)] if members else endpoint, "--index", str(i)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(args.producers)
    ]
    try:
        for p in producers:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a producer did not start")
        before, switches, commits = pod_cpu_s(pid), pod_switches(pid), pod_commits(pod)
        started = time.monotonic()
        for p in producers:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        sent = 0
        for p in producers:
            out, _ = p.communicate(timeout=args.seconds + 120)
            if p.returncode != 0 or not out.strip().startswith("sent "):
                raise RuntimeError(f"a producer failed ({p.returncode}): {out!r}; {ended(pod)}")
            sent += int(out.split()[1])
        elapsed = time.monotonic() - started
        used = pod_cpu_s(pid) - before
        switches, commits = pod_switches(pid) - switches, pod_commits(pod) - commits
        if deaths(pod):  # a broker process that dies under load is a bug, not a figure
            raise RuntimeError(f"a process of the pod died; {ended(pod)}")
    finally:
        for p in producers:
            if p.poll() is None:
                p.kill()
                p.wait()
    sent = max(1, sent)
    return Run(sent / elapsed, used * 1e6 / sent, os.getloadavg()[0], sent / max(1.0, commits), switches / sent)


def configs(counts: list[int], hops: list[str]) -> list[tuple[int, str]]:
    """(N, local hop) of every pod measured: N=1 has no hop to choose; ``direct`` is a socket pod whose
    producers each dial an owner with its own topics (no message takes a hop: the floor for that N)."""
    return [(n, hop) for n in counts for hop in (hops if n > 1 else ["-"])]


def process_endpoints(pod: BrokerProcess) -> list[str]:
    found = {int(m[1]): m[2] for m in PROCESS_RE.finditer(pod.log())}
    return [found[i] for i in range(len(found))]


def measure(tmp: Path, todo: list[tuple[int, str]], args: argparse.Namespace) -> dict[tuple[int, str], list[Run]]:
    """Every pod started at once and the runs interleaved (run 1 of each, then run 2 of each...), so that a
    change in the host's load touches every configuration alike."""
    results: dict[tuple[int, str], list[Run]] = {config: [] for config in todo}
    with contextlib.ExitStack() as stack:
        pods = {}
        members: dict[tuple[int, str], list[str]] = {}
        for n, hop in todo:
            extra = ["--processes", str(n), "--local-hop", hop.replace("direct", "socket")] if n > 1 else []
            pod = pods[n, hop] = stack.enter_context(start_broker(tmp / f"n{n}-{hop}", extra_args=extra))
            members[n, hop] = process_endpoints(pod) if hop == "direct" else []
        for _ in range(args.runs):
            for config, pod in pods.items():
                results[config].append(fleet_run(pod, args, members[config]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--processes", default="1,2,4", help="broker processes per pod, comma-separated")
    parser.add_argument("--producers", type=int, default=8, help="producer processes (K)")
    parser.add_argument("--inflight", type=int, default=4, help="calls in flight per producer")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each timed run")
    parser.add_argument("--runs", type=int, default=3, help="runs per N")
    parser.add_argument("--topics", type=int, default=1000, help="lite topics")
    parser.add_argument("--body", type=int, default=1024, help="body bytes")
    parser.add_argument(
        "--local-hop", default="socket,grpc,direct", help="the hop between the pod's processes, comma-separated: each "
        "N > 1 is measured with each (grpc: the baseline, as before the local hop; direct: no hop, producers dial "
        "owners)",
    )  # fmt: skip
    parser.add_argument("--producer", metavar="ENDPOINT", help=argparse.SUPPRESS)
    parser.add_argument("--members", default="", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.producer:
        asyncio.run(produce(args.producer, args.index, args))
        return
    if args.quick:
        args.producers, args.seconds, args.runs, args.processes = 2, 2.0, 1, "1,2"
    counts = [int(n) for n in args.processes.split(",") if n]
    hops = [hop for hop in args.local_hop.split(",") if hop]
    with tempfile.TemporaryDirectory() as tmp:
        results = measure(Path(tmp), configs(counts, hops), args)
    print(
        f"{args.producers} producer processes x {args.inflight} in flight, single-message SendMessage, {args.body} B "
        f"LITE into {args.topics} lite topics, one access port; {args.seconds:.0f} s x {args.runs} runs "
        f"(interleaved); {os.cpu_count()} cores; load average now {os.getloadavg()[0]:.1f}"
    )
    for (n, hop), runs in results.items():
        each = ", ".join(f"{r.cpu_us:,.0f} us @ {r.rate:,.0f} msg/s (load {r.load:.1f})" for r in runs)
        rate, cpu = statistics.median(r.rate for r in runs), statistics.median(r.cpu_us for r in runs)
        per_commit, switches = (
            statistics.median(r.per_commit for r in runs),
            statistics.median(r.switches for r in runs),
        )
        name = f"N={n}" + (f" local hop {hop}" if n > 1 else "")
        print(f"FIGURE producer fleet {name}: broker CPU per message: {cpu:,.0f} us, {rate:,.0f} msg/s (runs: {each})")
        print(f"  {name}: {per_commit:,.1f} messages per group commit, {switches:,.1f} context switches per message")
    base_config = next(iter(results))
    base = statistics.median(r.cpu_us for r in results[base_config])
    for (n, hop), runs in results.items():
        if (n, hop) == base_config:
            continue
        ratio = statistics.median(r.cpu_us for r in runs) / base
        name = f"producer fleet CPU per message N={n} ({hop}) ÷ N={base_config[0]}"
        figure(name, ratio, "x", op="<=", target=GOAL_RATIO)


if __name__ == "__main__":
    main()
