"""Scale-out: msg/s and broker CPU per message with N broker processes in one pod (``serve --processes N``),
the N ÷ 1 ratio (goal >= 0.8 N where cores allow), and what forwarding a message to its owner costs.

Rates: batched LITE sends into ``--topics`` lite topics of AGENT_TASK_NS (bootstrapped on every process).
* ``direct``: each request carries only topics of one owner and goes to that process's own port: the
  scale the ring gives when clients (or the forwarders) already batch per owner.
* ``access``: requests of mixed topics go to the pod's one access port (a channel per in-flight worker, so the
  kernel spreads the connections over the processes), so (N-1)/N of the messages take the forward hop:
  the pod's local hop (``--local-hop``, a Unix socket between its processes) and, as ``access (grpc hop)``, gRPC
  between them (the baseline, as before the local hop).
Forwarding: a ``serve --processes 2`` pod per hop; single-message sends to process 0's own port of topics owned
by process 1, one at a time (each forward call carries one message) and with 64 in flight (forwards gathered
per owner); the figures are process 0's and both processes' CPU per message, beside the same sends of topics
process 0 owns (stored where they arrive), and forwarded ÷ stored (issue 28: no dearer at 64 in flight).

The headline (issue 14's goal: >= 50,000 msg/s on 2 cores) is the batched send into 10,000 lite topics with as
many processes as the host has cores, through the access port and direct, every run printed (the load
generator runs on the same cores, as it would beside a pod on a small node).

The load generator is this process; its CPU per message (serializing is done before the clock starts; what
is left is gRPC and parsing the replies) is printed, and so are the cores the brokers kept busy. With as many
processes as cores, the msg/s ratio is capped by the cores: at most cores ÷ (cores one process keeps busy, its
appender and gRPC threads beside the event loop, + the generator's), whatever the code. The figure that does
not depend on the host is the brokers' CPU per message: ``efficiency`` is the one-process CPU per message ÷ the
N-process one (1.0: N processes spend per message what one does), and N x efficiency is the ratio N processes
would reach with the cores to keep each as busy as one process alone is.

    python bench/bench_scale_out.py            # a few minutes
    python bench/bench_scale_out.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import resource
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import grpc
import psutil

from lmq_broker.cluster import membership as mb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.testing import SHARED_ADMIN_ENV, BrokerProcess, start_broker

METHOD = "/apache.rocketmq.v2.MessagingService/SendMessage"
PARENT = "AGENT_TASK_NS"
PROCESS_RE = re.compile(r"lmq-broker process (?P<index>\d+) grpc=(?P<grpc>[^ ]+) metrics=")
OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]


def message(n: int, lite: str, body: bytes) -> pb.Message:
    return pb.Message(
        topic=pb.Resource(name=PARENT),
        body=body,
        system_properties=pb.SystemProperties(
            message_id=f"{n:034X}", message_type=pb.LITE, lite_topic=lite, body_encoding=pb.IDENTITY
        ),
    )


def owner_of(membership: mb.Membership | None, lite: str) -> int:
    return 0 if membership is None else mb.owner(membership, f"%LMQ%${PARENT}${lite}")


def requests(total: int, batch: int, topics: int, body: bytes, membership: mb.Membership | None) -> list[list[bytes]]:
    """Serialized requests per owner slot (``membership`` None: one list, mixed topics)."""
    slots = 1 if membership is None else len(membership.members)
    pending: list[list[pb.Message]] = [[] for _ in range(slots)]
    out: list[list[bytes]] = [[] for _ in range(slots)]
    for n in range(total):
        lite = f"t{n % topics}"
        slot = owner_of(membership, lite)
        pending[slot].append(message(n, lite, body))
        if len(pending[slot]) == batch:
            out[slot].append(spb.SendMessageRequest(messages=pending[slot]).SerializeToString())
            pending[slot] = []
    for slot, rest in enumerate(pending):
        if rest:
            out[slot].append(spb.SendMessageRequest(messages=rest).SerializeToString())
    return out


async def pump(targets: Sequence[tuple[str, list[bytes]]], inflight: int) -> float:
    """Send each target's payloads with ``inflight`` workers per target, each worker on its own channel."""
    channels: list[grpc.aio.Channel] = []

    async def worker(endpoint: str, queue: list[bytes]) -> None:
        channel = grpc.aio.insecure_channel(endpoint, options=[*OPTIONS, ("grpc.use_local_subchannel_pool", 1)])
        channels.append(channel)
        call = channel.unary_unary(
            METHOD, request_serializer=None, response_deserializer=spb.SendMessageResponse.FromString
        )
        while queue:
            reply = await call(queue.pop(), timeout=60)
            if reply.status.code != pb.OK:
                failed = [e.status for e in reply.entries if e.status.code != pb.OK][:1]
                raise RuntimeError(f"send failed: {reply.status} {failed}")

    queues = [(endpoint, list(reversed(payloads))) for endpoint, payloads in targets]
    started = time.perf_counter()
    await asyncio.gather(*(worker(e, q) for e, q in queues for _ in range(inflight)))
    elapsed = time.perf_counter() - started
    for channel in channels:
        await channel.close(None)
    return elapsed


def median(runs: Sequence[Run]) -> Run:
    return Run(*(statistics.median(run[i] for run in runs) for i in range(len(Run._fields))))


def own_cpu_s() -> float:
    """CPU seconds of this process (the load generator: its gRPC threads included) so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cpu_s(pids: Sequence[int]) -> float:
    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def process_endpoints(pod: BrokerProcess) -> list[str]:
    found = {int(m["index"]): m["grpc"] for m in PROCESS_RE.finditer(pod.log())}
    return [found[i] for i in sorted(found)]


class Run(NamedTuple):
    rate: float  # msg/s
    cpu_us: float  # the brokers' CPU per message, all processes together
    client_us: float  # the load generator's CPU per message


def measure_rates(
    tmp: Path, n: int, args: argparse.Namespace, total: int, body: bytes, *, hop: str = "socket", path: str = "raw"
) -> dict[str, list[Run]]:
    """mode -> every run; ``hop``: the pod's local hop (``--local-hop``), ``path`` its send path (``--send-path``),
    its access mode named after them unless they are the defaults, socket and raw (such a pod measures access
    only: direct sends take no hop)."""
    extra = ["--processes", str(n), "--local-hop", hop, "--send-path", path, *native(args)] if n > 1 else []
    out: dict[str, list[Run]] = {}
    with start_broker(tmp / f"n{n}-{hop}-{path}", extra_args=extra) as pod:
        endpoints = process_endpoints(pod) if n > 1 else [pod.endpoint]
        membership = mb.Membership.parse(",".join(endpoints)) if n > 1 else None
        pids = [c.pid for c in psutil.Process(pod.pid).children()] if n > 1 else [pod.pid]
        asyncio.run(pump([(pod.endpoint, requests(200, 50, 50, body, None)[0])], 1))  # warm-up
        modes = ("direct", "access") if n > 1 else ("direct",)
        plain = hop == "socket" and path == "raw"
        if not plain:
            modes = ("access",)
        for mode in modes:
            runs = []
            for _ in range(args.runs):
                if mode == "direct":
                    per_slot = requests(total, args.batch, args.topics, body, membership)
                    targets = list(zip(endpoints, per_slot, strict=True))
                else:
                    targets = [(pod.endpoint, requests(total, args.batch, args.topics, body, None)[0])]
                    inflight_total = args.inflight * n
                before, own = cpu_s(pids), own_cpu_s()
                elapsed = asyncio.run(pump(targets, args.inflight if mode == "direct" else inflight_total))
                used, own_used = cpu_s(pids) - before, own_cpu_s() - own
                runs.append(Run(total / elapsed, used * 1e6 / total, own_used * 1e6 / total))
            out[mode if plain else f"{mode} ({hop} hop, {path} send path)"] = runs
    return out


def slot_pids(pod: BrokerProcess, n: int) -> list[int]:
    """The pid of each process of a ``serve --processes`` pod, in slot order."""
    by_slot = {}
    for child in psutil.Process(pod.pid).children():
        for arg in child.cmdline():
            if arg.startswith("--ordinal="):
                by_slot[int(arg.partition("=")[2])] = child.pid
    return [by_slot[slot] for slot in range(n)]


def native(args: argparse.Namespace) -> list[str]:
    """The pods' ``--native-forward`` when one is asked for (none: the broker's default)."""
    return ["--native-forward", args.native_forward] if args.native_forward else []


def measure_forwarding(
    tmp: Path, count: int, body: bytes, hop: str, args: argparse.Namespace
) -> dict[str, tuple[float, float]]:
    """(process 0's, both processes') CPU per message (us) in a ``serve --processes 2`` pod whose processes
    forward over ``hop``: sent to process 0's own port, stored there vs forwarded to process 1, one
    single-message send at a time vs 64 in flight."""
    extra = ["--processes", "2", "--local-hop", hop, *native(args)]
    with start_broker(tmp / f"fwd-{hop}", extra_args=extra, env=SHARED_ADMIN_ENV) as pod:
        endpoints = process_endpoints(pod)
        membership = mb.Membership.parse(",".join(endpoints))
        pids = slot_pids(pod, 2)
        lites = {
            slot: [f"f{i}" for i in range(20_000) if owner_of(membership, f"f{i}") == slot][:500] for slot in (0, 1)
        }
        out = {}
        cases = (("stored here, alone", 0, 1), ("forwarded alone", 1, 1), ("stored here, 64 in flight", 0, 64),
                 ("forwarded, 64 in flight (gathered per owner)", 1, 64))  # fmt: skip
        for label, slot, inflight in cases:
            payloads = [
                spb.SendMessageRequest(messages=[message(i, lites[slot][i % 500], body)]).SerializeToString()
                for i in range(count + 50)
            ]
            asyncio.run(pump([(endpoints[0], payloads[:50])], 1))  # warm: channels, placement
            before = cpu_s(pids[:1]), cpu_s(pids)
            asyncio.run(pump([(endpoints[0], payloads[50:])], inflight))
            access = (cpu_s(pids[:1]) - before[0]) * 1e6 / count
            both = (cpu_s(pids) - before[1]) * 1e6 / count
            out[label] = (access, both)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    cores = os.cpu_count() or 1
    parser.add_argument(
        "--processes", default=f"1,{cores}", help=f"process counts to compare, e.g. 1,2,4 (default 1,{cores}: cores)"
    )
    parser.add_argument("--batch", type=int, default=500, help="messages per SendMessage")
    parser.add_argument("--topics", type=int, default=10_000, help="distinct lite topics")
    parser.add_argument("--inflight", type=int, default=4, help="requests outstanding per process")
    parser.add_argument("--body", type=int, default=128, help="body bytes")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--local-hop", default="socket,grpc", help="the pods' hops between processes, comma-separated: access mode is "
        "measured with each (grpc: the baseline, as before the local hop)",
    )  # fmt: skip
    parser.add_argument(
        "--send-path", default="raw,decoded", help="the pods' send paths, comma-separated: access mode is measured "
        "with each over the socket hop (decoded: the plain twin, grpcio decodes and forwarded parts are encoded again)",
    )  # fmt: skip
    parser.add_argument("--no-forwarding", action="store_true", help="skip the two-broker forwarding figures")
    parser.add_argument(
        "--forward-sends", type=int, default=3000, help="single-message sends per forwarding case (CPU is read in "
        "10 ms ticks: more sends, less noise)",
    )  # fmt: skip
    parser.add_argument(
        "--native-forward", choices=("on", "off"), help="the pods' --native-forward (the edge forwards a send owned "
        "by one sibling without Python; default: the broker's)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.runs = 1
    total = 20_000 if args.quick else 200_000
    body = b"x" * args.body
    counts = [int(c) for c in args.processes.split(",")]
    print(
        f"scale-out: {total:,} messages/run, {args.batch}/request, {args.topics:,} lite topics, {args.body} B bodies, "
        f"{args.inflight} in flight per process, sync flush, {os.cpu_count()} cores, "
        f"native forward {args.native_forward or 'default'}, "
        f"load average before {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        hops = [hop for hop in args.local_hop.split(",") if hop]
        paths = [path for path in args.send_path.split(",") if path]
        pods = [(hop, path) for hop in hops for path in (paths if hop == "socket" else ["raw"])]
        results: dict[int, dict[str, list[Run]]] = {}
        for n in counts:
            results[n] = {}
            for hop, path in pods if n > 1 else [("socket", "raw")]:
                results[n] |= measure_rates(tmp, n, args, total, body, hop=hop, path=path)
        first = median(results[counts[0]]["direct"])
        base, base_cpu = first.rate / counts[0], first.cpu_us
        for n, modes in results.items():
            for mode, runs in modes.items():
                rate, cpu, client = median(runs)
                efficiency = base_cpu / cpu
                print(
                    f"FIGURE scale-out N={n} {mode}: {rate:,.0f} msg/s ({rate / n:,.0f} per process), "
                    f"ratio to N=1 {rate / base:.2f} (goal >= {0.8 * min(n, cores):.1f}), "
                    f"broker CPU {cpu:.1f} us/msg",
                    flush=True,
                )
                print(
                    f"FIGURE scale-out N={n} {mode} CPU: broker {cpu:.1f} us/msg, efficiency vs N=1 "
                    f"{efficiency:.2f}, N x efficiency {n * efficiency:.2f} (goal >= {0.8 * n:.1f}); cores busy: "
                    f"brokers {cpu * rate / 1e6:.2f}, load generator {client * rate / 1e6:.2f} ({client:.1f} us/msg) "
                    f"of {cores}",
                    flush=True,
                )
        if cores in results:
            for mode, runs in results[cores].items():
                every = ", ".join(f"{run.rate:,.0f}" for run in runs)
                print(
                    f"FIGURE batched send into {args.topics:,} lite topics, processes = cores ({cores}), {mode}: "
                    f"{median(runs).rate:,.0f} msg/s median of runs {every} (goal >= 50,000 on 2 cores)",
                    flush=True,
                )
        for hop in [] if args.no_forwarding else hops:
            forwarding = measure_forwarding(tmp, 600 if args.quick else args.forward_sends, body, hop, args)
            for label, (access, both) in forwarding.items():
                print(
                    f"FIGURE single-message sends {label}, {hop} hop: access process {access:.0f} us/msg, "
                    f"both {both:.0f} us/msg",
                    flush=True,
                )
            for suffix in ("alone", "64 in flight"):
                here = next(v[1] for k, v in forwarding.items() if k.startswith("stored") and suffix in k)
                there = next(v[1] for k, v in forwarding.items() if k.startswith("forwarded") and suffix in k)
                print(f"FIGURE forwarded ÷ stored here, {suffix}, {hop} hop (both processes' CPU): {there / here:.2f}")
    print(f"load average after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
