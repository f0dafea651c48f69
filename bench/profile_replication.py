"""Where replication's CPU goes (issue 32): the owner's shipping side and the follower's copy-receive side of
``bench_replication.py``'s load, broker by broker.

Three broker processes at one setting (``R`` or ``R/M``, as ``bench_replication.py --configs``), 1 KiB LITE
one-message sends through broker 0, ``--inflight`` at a time. Printed: each broker's CPU per message (user +
system from /proc, unsampled) and its idle CPU per second before the load; then, with ``--spy``, a py-spy
sample (native frames) of the owner and the follower of its slot during a second, sampled load, summed into
layers as ``profile_broker_send.py`` does, and the lmq functions by inclusive share (a function counted once
per stack).

Not a timed benchmark: the /proc figures of the first load are the figure, the shares show where they go.

    python bench/profile_replication.py --setting 2 --sends 3000 --spy
    python bench/profile_replication.py --setting 1 --sends 3000
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_replication import PARENT, cpu_s, send_load, start_pair
from profile_broker_send import WAITS, parse_frame, py_spy, summarize

from lmq_broker import model
from lmq_broker.cluster import membership as mb
from lmq_broker.testing import BrokerProcess
from lmq_operator import testing as kube_testing

IDLE_S = 3.0


def metric(broker: BrokerProcess, name: str) -> float:
    """A counter of the broker's /metrics (0 when it has none: an older tree)."""
    with urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    found = [line.split()[-1] for line in text.splitlines() if line.startswith(f"{name} ")]
    return float(found[0]) if found else 0.0


def commits_of(broker: BrokerProcess) -> float:
    """The broker's group commits of appends (``lmq_append_commits_total``, loop and thread), its own and copies'."""
    with urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("lmq_append_commits_total{"))


def copied_by(broker: BrokerProcess) -> tuple[float, float]:
    """(messages, store appends) the broker stored from copies since it started (appends: 0 on an older tree)."""
    return metric(broker, "lmq_replication_copied_total"), metric(broker, "lmq_replication_copy_appends_total")


def inclusive(raw: Path, top: int) -> None:
    """lmq functions by the share of running samples with them on the stack."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack_text, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        frames = [parse_frame(part) for part in stack_text.split(";")[1:]]
        if not frames or any(func in WAITS for func, _ in frames):
            continue
        n = int(count_text)
        total += n
        names = {
            f"{func} ({Path(file).parent.name}/{Path(file).name})" for func, file in frames if "lmq_broker/" in file
        }
        for name in names:
            counts[name] += n
    print(f"top {top} lmq functions, inclusive:")
    for name, n in counts.most_common(top):
        print(f"  {100 * n / max(total, 1):5.1f} %  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", default="2")
    parser.add_argument("--sends", type=int, default=3000)
    parser.add_argument("--inflight", type=int, default=8)
    parser.add_argument("--spy", action="store_true", help="then a py-spy sample of the owner and the follower")
    parser.add_argument("--rate", type=int, default=200)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}; R={args.setting}, {args.sends} sends, {args.inflight} in flight")
    with tempfile.TemporaryDirectory() as tmp_name, kube_testing.testenv(Path(tmp_name) / "testenv") as kube:
        tmp = Path(tmp_name)
        brokers, members = start_pair(tmp, kube, args.setting, "prof")
        try:
            membership = mb.Membership.parse(",".join(members))
            names = (f"t{i}" for i in range(100_000))
            lites = [n for n in names if mb.owner(membership, model.QueueId.lmq(PARENT, n).topic) == 0][:50]
            asyncio.run(send_load(members[0], lites, 200, args.inflight))
            idle0 = [cpu_s(b) for b in brokers]
            time.sleep(IDLE_S)
            idle = [(cpu_s(b) - c) / IDLE_S * 1e3 for b, c in zip(brokers, idle0, strict=True)]
            copied0, commits0 = copied_by(brokers[1]), commits_of(brokers[0])
            before = [cpu_s(b) for b in brokers]
            began = time.perf_counter()
            asyncio.run(send_load(members[0], lites, args.sends, args.inflight))
            took = time.perf_counter() - began
            per = [(cpu_s(b) - c) / args.sends * 1e6 for b, c in zip(brokers, before, strict=True)]
            print(f"{args.sends / took:,.0f} sends/s over {took:.1f} s")
            for i, (p, q) in enumerate(zip(per, idle, strict=True)):
                print(f"broker {i}: {p:,.0f} µs CPU/message (idle before: {q:.1f} ms CPU/s)")
            print(f"all: {sum(per):,.0f} µs CPU/message")
            commits = commits_of(brokers[0]) - commits0
            each = args.sends / max(commits, 1)
            print(f"owner: {args.sends:,} messages in {commits:,.0f} group commits: {each:.2f} each")
            if args.setting != "1":
                messages, appends = (a - b for a, b in zip(copied_by(brokers[1]), copied0, strict=True))
                each = messages / max(appends, 1)
                print(f"follower: {messages:,.0f} messages copied in {appends:,.0f} appends: {each:.2f} per copy")
            if args.spy:
                spy(brokers[:2], tmp, args, members[0], lites)
        finally:
            for b in brokers:
                b.stop()
    print(f"load average {os.getloadavg()[0]:.1f}")


def spy(brokers: list[BrokerProcess], tmp: Path, args: argparse.Namespace, endpoint: str, lites: list[str]) -> None:
    exe = py_spy()
    raws = [tmp / f"b{i}.raw" for i in range(len(brokers))]
    spies = []
    for b, raw in zip(brokers, raws, strict=True):
        record = [exe, "record", "--native", "--pid", str(b.pid), "--rate", str(args.rate), "--format", "raw"]
        record += ["--output", str(raw)]
        spies.append(subprocess.Popen(record, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    time.sleep(1.0)
    try:
        asyncio.run(send_load(endpoint, lites, args.sends, args.inflight))
    finally:
        for s in spies:
            s.send_signal(signal.SIGINT)
        for s in spies:
            s.communicate(timeout=60)
    for role, raw in zip(("owner (broker 0)", "follower (broker 1)"), raws, strict=True):
        print(f"--- {role}")
        if raw.exists():
            summarize(raw, args.top)
            inclusive(raw, args.top)


if __name__ == "__main__":
    main()
