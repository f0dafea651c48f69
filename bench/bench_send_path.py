"""The broker's batched send path in one process, measured in CPU and in instructions per message.

``bench_broker_batch.py`` times a real broker over gRPC, and its figures move by several microseconds per
message with the machine's load. This one drives exactly what the broker runs for a SendMessage request
(parse the request, ``send_message.handle`` through the real dispatcher into a real store, serialize the
reply) without the transport, and reports CPU per message (``getrusage``: all threads, the appender's
included). With ``--callgrind`` it runs itself twice under ``valgrind --tool=callgrind`` (the warm-up alone,
then warm-up and the measured requests) and prints the difference in instructions per message: a figure
that other work on the machine does not change, for A/B comparisons of send-path code.

    python bench/bench_send_path.py                       # CPU per message, ~10 s (--quick: ~2 s)
    python bench/bench_send_path.py --callgrind           # instructions per message, a few minutes
    python bench/bench_send_path.py --callgrind --src ../other-worktree/broker   # the same, of other code
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from lmq_broker import app, model
from lmq_broker.config import BrokerConfig, FlushMode, StoreConfig
from lmq_broker.dispatch.dispatcher import Dispatcher
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.handlers import send_message
from lmq_broker.storage.store import open_store

try:  # not in trees from before scale-out: with --src of one, --mode handler only
    from lmq_broker.cluster import forwarding
    from lmq_broker.cluster import membership as mb
    from lmq_broker.supervisor import free_ports
except ImportError:
    pass

_SEND = "/apache.rocketmq.v2.MessagingService/SendMessage"

HERE = Path(__file__).resolve()
_EVENTS_RE = re.compile(r"^events:\s+(.+)$", re.MULTILINE)
_TOTALS_RE = re.compile(r"^summary:\s+(.+)$", re.MULTILINE)
# KCachegrind's cycle estimate: an L1 miss or a mispredicted branch ~10 cycles, a last-level miss ~100.
_CYCLE_WEIGHTS = {"Ir": 1, "I1mr": 10, "D1mr": 10, "D1mw": 10, "ILmr": 100, "DLmr": 100, "DLmw": 100}
_CYCLE_WEIGHTS |= {"Bcm": 10, "Bim": 10}


def payloads(count: int, batch: int, topics: int, body: bytes, start: int = 0) -> list[bytes]:
    """``count`` serialized SendMessageRequests of ``batch`` LITE messages over ``topics`` lite topics."""
    out = []
    n = start
    for _ in range(count):
        messages = []
        for _ in range(batch):
            sp = pb.SystemProperties(
                message_id=f"{n:034X}", message_type=pb.LITE, lite_topic=f"t{n % topics}", body_encoding=pb.IDENTITY
            )
            messages.append(pb.Message(topic=pb.Resource(name="AGENT_TASK_NS"), body=body, system_properties=sp))
            n += 1
        out.append(spb.SendMessageRequest(messages=messages).SerializeToString())
    return out


async def drive(data_dir: Path, warm: list[bytes], measured: list[bytes], inflight: int, flush: str) -> float:
    """Send ``warm`` then ``measured`` through the handler; CPU seconds of the process during ``measured``."""
    sys.setswitchinterval(0.0005)  # the broker's (lmq_broker.__main__)
    config = BrokerConfig(store=StoreConfig(data_dir=data_dir, flush_mode=FlushMode(flush)))
    store = open_store(config.store)
    app.bootstrap(store)
    dispatcher = Dispatcher(store, config)
    await dispatcher.start()
    edge = Edge(dispatcher, config)
    app.tune_gc()

    async def pump(requests: list[bytes]) -> None:
        queue = list(reversed(requests))

        async def worker() -> None:
            while queue:
                request = spb.SendMessageRequest.FromString(queue.pop())  # what grpc's deserializer does
                reply = await send_message.handle(edge, request)
                if reply.status.code != pb.OK:
                    raise RuntimeError(f"send failed: {reply.status}")
                reply.SerializeToString()

        await asyncio.gather(*(worker() for _ in range(inflight)))

    await pump(warm)
    before = _cpu_s()
    await pump(measured)
    used = _cpu_s() - before
    await dispatcher.close()
    store.close()
    return used


async def drive_cluster(
    data_dir: Path,
    warm: list[bytes],
    measured: list[bytes],
    inflight: int,
    flush: str,
    *,
    mode: str,
    send_path: str = "",
) -> float:
    """Two whole brokers (``--peers``) in this process and a gRPC client: ``access`` sends every request to
    broker 0, which stores its own topics and forwards the others; ``direct`` sends each message to its owner
    (the requests split by owner beforehand). CPU seconds of the process (both brokers and the client) during
    ``measured``."""
    forwarding.CALL_TIMEOUT_S = 600.0  # type: ignore[attr-defined]  # valgrind runs ~50x slower than the broker's 2 s allow
    members = ",".join(f"127.0.0.1:{port}" for port in free_ports("127.0.0.1", 2))
    membership = mb.Membership.parse(members)
    brokers = []
    for slot in range(2):
        store = StoreConfig(data_dir=data_dir / f"b{slot}", flush_mode=FlushMode(flush))
        config = BrokerConfig(
            store=store, host="127.0.0.1", port=int(membership.members[slot].rsplit(":", 1)[1]), metrics_port=-1,
            peers=members, ordinal=slot, admin_access_key="ak", admin_secret_key="sk",
            **({"send_path": send_path} if send_path else {}),  # type: ignore[arg-type]  # trees before it: no such setting
        )  # fmt: skip
        broker = app.Broker(config)
        await broker.start()
        brokers.append(broker)
    app.tune_gc()
    sys.setswitchinterval(0.0005)
    targets = [b.endpoint for b in brokers]
    channels = [grpc.aio.insecure_channel(t, options=[("grpc.max_send_message_length", 256 << 20)]) for t in targets]
    calls = [
        c.unary_unary(_SEND, request_serializer=None, response_deserializer=spb.SendMessageResponse.FromString)
        for c in channels
    ]

    def by_owner(requests: list[bytes]) -> list[tuple[int, bytes]]:
        """The requests' messages regrouped per owner into requests of the same size."""
        if not requests:
            return []
        batch = len(spb.SendMessageRequest.FromString(requests[0]).messages)
        pending: dict[int, list[pb.Message]] = {0: [], 1: []}
        out = []
        for raw in requests:
            for m in spb.SendMessageRequest.FromString(raw).messages:
                slot = mb.owner(membership, model.QueueId.lmq(m.topic.name, m.system_properties.lite_topic).topic)
                pending[slot].append(m)
                if len(pending[slot]) == batch:
                    out.append((slot, spb.SendMessageRequest(messages=pending[slot]).SerializeToString()))
                    pending[slot] = []
        rest = [(slot, spb.SendMessageRequest(messages=ms).SerializeToString()) for slot, ms in pending.items() if ms]
        return out + rest

    def work(requests: list[bytes]) -> list[tuple[int, bytes]]:
        return [(0, raw) for raw in requests] if mode == "access" else by_owner(requests)

    async def pump(items: list[tuple[int, bytes]]) -> None:
        queue = list(reversed(items))

        async def worker() -> None:
            while queue:
                slot, raw = queue.pop()
                reply = await calls[slot](raw, timeout=600)
                if reply.status.code != pb.OK:
                    raise RuntimeError(f"send failed: {reply.status}")

        await asyncio.gather(*(worker() for _ in range(inflight)))

    await pump(work(warm))
    items = work(measured)
    before = _cpu_s()
    await pump(items)
    used = _cpu_s() - before
    for channel in channels:
        await channel.close(None)
    for broker in brokers:
        await broker.stop(grace_s=1)
    return used


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _events(args: argparse.Namespace, measured: int, out_dir: Path) -> dict[str, int]:
    """Callgrind's totals of a whole run with ``measured`` requests after the warm-up (``Ir``: instructions;
    with ``--cache-sim`` also cache misses and mispredicted branches, and ``cycles``: their estimate)."""
    out = out_dir / f"callgrind.{measured}.out"
    command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
    if args.cache_sim:
        command += ["--cache-sim=yes", "--branch-sim=yes"]
    command += [sys.executable, str(HERE)]
    command += ["--inner", "--requests", str(args.requests), "--send", str(measured)]
    command += ["--warm", str(args.warm), "--batch", str(args.batch), "--topics", str(args.topics)]
    command += ["--body", str(args.body), "--inflight", str(args.inflight), "--flush-mode", args.flush_mode]
    command += ["--mode", args.mode] + (["--send-path", args.send_path] if args.send_path else [])
    subprocess.run(command, check=True, env=_env(args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    text = out.read_text(errors="replace")
    names, totals = _EVENTS_RE.search(text), _TOTALS_RE.search(text)
    if names is None or totals is None:
        raise RuntimeError(f"no events or summary line in {out}")
    found = dict(zip(names.group(1).split(), map(int, totals.group(1).split()), strict=True))
    found["cycles"] = sum(found.get(name, 0) * weight for name, weight in _CYCLE_WEIGHTS.items())
    return found


def _env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    if args.src:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(args.src).resolve()), env.get("PYTHONPATH")) if p)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40, help="measured requests")
    parser.add_argument("--warm", type=int, default=10, help="requests before measuring (creates the topics)")
    parser.add_argument("--batch", type=int, default=1000, help="messages per SendMessage")
    parser.add_argument("--topics", type=int, default=10_000, help="distinct lite topics")
    parser.add_argument("--body", type=int, default=128, help="body bytes")
    parser.add_argument("--inflight", type=int, default=4, help="requests outstanding")
    parser.add_argument("--flush-mode", choices=("sync", "async"), default="sync")
    parser.add_argument("--rounds", type=int, default=3, help="repetitions of the CPU measurement")
    parser.add_argument(
        "--mode",
        choices=("handler", "access", "direct"),
        default="handler",
        help="handler: the SendMessage handler alone; access/direct: two brokers (--peers) and a gRPC client in "
        "this process, every request to broker 0 (half forwarded) or each message to its owner",
    )
    parser.add_argument(
        "--send-path", default="", help="the brokers' --send-path (raw, decoded; default: theirs) in access/direct mode"
    )
    parser.add_argument("--callgrind", action="store_true", help="instructions per message under callgrind")
    parser.add_argument("--cache-sim", action="store_true", help="with --callgrind: simulate caches and branches")
    parser.add_argument("--keep", default="", help="with --callgrind: leave the callgrind files in this directory")
    parser.add_argument("--src", default="", help="a broker source root to measure instead (another worktree)")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--send", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.warm, args.rounds = 5, 2, 1
    messages = args.requests * args.batch
    if args.callgrind:
        with tempfile.TemporaryDirectory() as tmp:
            started = time.monotonic()
            out_dir = Path(args.keep or tmp)
            base = _events(args, 0, out_dir)
            total = _events(args, args.requests, out_dir)
        per = (total["Ir"] - base["Ir"]) / messages
        print(
            f"send path under callgrind: {args.requests} x {args.batch} messages after {args.warm} warm-up "
            f"requests, {args.topics:,} lite topics, {args.flush_mode} flush, {args.inflight} in flight, {args.mode} "
            f"({time.monotonic() - started:.0f} s)"
        )
        print(f"FIGURE send path instructions per message: {per:,.0f} (runs: {base['Ir']:,} and {total['Ir']:,})")
        if args.cache_sim:
            cycles = (total["cycles"] - base["cycles"]) / messages
            misses = {name: (total[name] - base[name]) / messages for name in _CYCLE_WEIGHTS if name != "Ir"}
            print(f"FIGURE send path estimated cycles per message: {cycles:,.0f}")
            print("per message: " + ", ".join(f"{name} {value:,.1f}" for name, value in misses.items()))
        sys.stdout.flush()
        return
    if args.src and not args.inner:
        sys.exit(
            subprocess.run(
                [sys.executable, str(HERE), *sys.argv[1:], "--inner"], check=False, env=_env(args)
            ).returncode
        )
    body = b"x" * args.body
    rounds = 1 if args.inner and args.send >= 0 else args.rounds
    cpu_us: list[float] = []
    for _ in range(rounds):
        warm = payloads(args.warm, args.batch, args.topics, body)
        measured = payloads(args.requests, args.batch, args.topics, body, start=args.warm * args.batch)
        if args.send >= 0:
            measured = measured[: args.send]
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp) / "data"
            if args.mode == "handler":
                used = asyncio.run(drive(data, warm, measured, args.inflight, args.flush_mode))
            else:
                used = asyncio.run(
                    drive_cluster(
                        data, warm, measured, args.inflight, args.flush_mode, mode=args.mode, send_path=args.send_path
                    )
                )
        if measured:
            cpu_us.append(used * 1e6 / (len(measured) * args.batch))
            print(f"CPU per message: {cpu_us[-1]:.2f} us", flush=True)
    if cpu_us and args.send < 0:  # not a run of --callgrind
        every = ", ".join(f"{us:.2f}" for us in cpu_us)
        print(f"FIGURE send path CPU per message ({args.mode}): {statistics.median(cpu_us):.2f} us (median of {every})")


if __name__ == "__main__":
    main()
