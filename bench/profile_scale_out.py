"""Where one process of a ``serve --processes N`` pod spends its CPU under batched sends through the access port
(``bench_scale_out.py``'s access mode: 500 mixed-topic messages per request, (N-1)/N of them forwarded over
the local hop): a py-spy sample of process 0 (every process takes client requests and serves its siblings'
forwards alike), summed into layers as ``profile_broker_send.py`` does, with the lmq functions by inclusive
share (issue 28 item 1).

``--send-path`` picks the access processes' send path (``serve --send-path``): ``raw`` routes the request's
wire bytes and forwards them untouched, ``decoded`` lets grpcio decode the request and re-encodes what it
forwards (the plain twin).

``--singles``: instead, single-message sends, ``--inflight`` in flight (default 64), to process 0's own port of
lite topics process 1 owns (``bench_scale_out.py``'s "forwarded, 64 in flight"), both processes of a
``--processes 2`` pod sampled: where a forwarded single send's CPU goes at the access process and at the owner.

Not a timed benchmark (py-spy pauses the process to sample it): the shares are the figure.

    python bench/profile_scale_out.py --processes 4 --send-path decoded --seconds 15
    python bench/profile_scale_out.py --processes 4 --send-path raw --seconds 15
    python bench/profile_scale_out.py --singles --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from bench_scale_out import message, owner_of, process_endpoints, pump, requests, slot_pids
from profile_broker_send import py_spy, summarize
from profile_replication import inclusive

from lmq_broker.cluster import membership as mb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.testing import start_broker


async def load(endpoint: str, payloads: list[bytes], seconds: float, inflight: int) -> int:
    """Send ``payloads`` round and round for ``seconds``; returns the requests sent."""
    deadline = time.monotonic() + seconds
    sent = 0
    while time.monotonic() < deadline:
        await pump([(endpoint, list(payloads))], inflight)
        sent += len(payloads)
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--send-path", default="", choices=("", "raw", "decoded"), help="default: the broker's")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--rate", type=int, default=200)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--inflight", type=int, default=0, help="requests outstanding per process (default 4; "
                        "--singles: in all, default 64)")  # fmt: skip
    parser.add_argument("--singles", action="store_true", help="forwarded single sends, both processes sampled")
    parser.add_argument("--native", action="store_true", help="py-spy --native (native frames too)")
    parser.add_argument("--keep", type=Path, help="--singles: copy the raw samples into this directory")
    args = parser.parse_args()
    if args.singles:
        singles(args)
        return
    args.inflight = args.inflight or 4
    n = args.processes
    payloads = requests(20_000, 500, 10_000, b"x" * 128, None)[0]
    extra = ["--processes", str(n)] + (["--send-path", args.send_path] if args.send_path else [])
    print(f"profile: N={n}, send path {args.send_path}, load average before {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp_name, start_broker(Path(tmp_name) / "pod", extra_args=extra) as pod:
        tmp = Path(tmp_name)
        asyncio.run(pump([(pod.endpoint, payloads[:4])], 1))  # warm-up: channels, hop connections, placement
        pid = slot_pids(pod, n)[0]
        raw = tmp / "p0.raw"
        record = [py_spy(), "record", "--pid", str(pid), "--rate", str(args.rate), "--format", "raw"]
        record += ["--native"] if args.native else []
        spy = subprocess.Popen(
            [*record, "--output", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        time.sleep(1.0)
        try:
            sent = asyncio.run(load(pod.endpoint, payloads, args.seconds, args.inflight * n))
        finally:
            spy.send_signal(signal.SIGINT)
            spy.communicate(timeout=60)
        print(f"{sent * 500:,} messages sent; process 0 of {n}:")
        summarize(raw, args.top)
        inclusive(raw, args.top)
    print(f"load average after {os.getloadavg()[0]:.1f}")


def singles(args: argparse.Namespace) -> None:
    """Forwarded single sends at ``--inflight`` (64) in flight, process 0 (access) and 1 (owner) sampled."""
    inflight = args.inflight or 64
    print(f"profile: forwarded single sends, {inflight} in flight, load average {os.getloadavg()[0]:.1f}", flush=True)
    with (
        tempfile.TemporaryDirectory() as tmp_name,
        start_broker(Path(tmp_name) / "pod", extra_args=["--processes", "2"]) as pod,
    ):
        tmp = Path(tmp_name)
        endpoints = process_endpoints(pod)
        membership = mb.Membership.parse(",".join(endpoints))
        lites = [f"f{i}" for i in range(4000) if owner_of(membership, f"f{i}") == 1][:500]
        payloads = [
            spb.SendMessageRequest(messages=[message(i, lites[i % len(lites)], b"x" * 128)]).SerializeToString()
            for i in range(2000)
        ]
        asyncio.run(pump([(endpoints[0], payloads[:50])], 1))  # warm: channels, hop connection, placement
        spies = []
        for slot, pid in enumerate(slot_pids(pod, 2)):
            record = [py_spy(), "record", "--pid", str(pid), "--rate", str(args.rate), "--format", "raw"]
            record += ["--native"] if args.native else []
            raw = tmp / f"p{slot}.raw"
            spies.append((raw, subprocess.Popen(
                [*record, "--output", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )))  # fmt: skip
        time.sleep(1.0)
        try:
            sent = asyncio.run(load(endpoints[0], payloads, args.seconds, inflight))
        finally:
            for _, spy in spies:
                spy.send_signal(signal.SIGINT)
            for _, spy in spies:
                spy.communicate(timeout=60)
        print(f"{sent:,} single sends to process 0, all forwarded to process 1")
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            for raw, _ in spies:
                shutil.copy(raw, args.keep / raw.name)
        for (raw, _), name in zip(spies, ("access (process 0)", "owner (process 1)"), strict=True):
            print(f"--- {name}")
            summarize(raw, args.top)
            inclusive(raw, args.top)
    print(f"load average after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
