"""Where a broker's CPU goes under single-message sends: a py-spy sample (native frames included) of a
standalone ``serve`` process, summed into layers (issue 28 item 2).

Load, one of:
* ``official``: the official Python client 5.1.2 Producer, ``--threads`` threads of single sends (the RPC shape
  every official client has: one LITE message per SendMessage, its signature headers, one channel);
* ``ghz``: ghz (built as ``bench_edge_floor.py`` does), ``--inflight`` SendMessage calls (default 256) in
  flight on one connection;
* ``drain``: the official LiteSimpleConsumer receiving 32 and acking each, ``--drain`` messages stored first
  (``bench_broker_send.py``'s receive + ack).

Each sample's stack is charged to one layer, by the innermost frame that belongs to one, in this order: lmq's
storage (``lmq_broker/storage``), dispatch (``lmq_broker/dispatch``), its gRPC edge (``lmq_broker/protocol``),
the rest of lmq; else protobuf, grpcio's Cython layer (``grpc/_cython``), grpc core (native frames of cygrpc's
shared object), asyncio's event loop (``asyncio/``), the interpreter itself, other. So "grpcio" is what any
grpcio server pays and "lmq" what lmq adds above it. The top self-time frames are printed as well.

Not a timed benchmark (py-spy pauses the process to sample it, which slows it): the shares are the figure.
py-spy is not a project dependency: ``pip install py-spy`` into any environment (or a tool venv such as
~/.cache/lmq/tools) and it is found on PATH or there.

    python bench/profile_broker_send.py --load official --seconds 20
    python bench/profile_broker_send.py --load ghz --seconds 20 --raw /tmp/lmq.raw
    python bench/profile_broker_send.py --load drain --drain 3000
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lmq_broker.testing import start_broker

TOOL_VENV_SPY = Path.home() / ".cache" / "lmq" / "tools" / "bin" / "py-spy"
FRAME_RE = re.compile(r"^(?P<func>.*?) \((?P<file>[^:()]*)(?::(?P<line>\d+))?\)$")
LAYERS = (  # (layer, test on a frame's file or function), innermost matching frame wins
    ("lmq storage", lambda f, fn: "lmq_broker/storage/" in f),
    ("lmq dispatch", lambda f, fn: "lmq_broker/dispatch/" in f),
    ("lmq protocol edge", lambda f, fn: "lmq_broker/protocol/" in f and "/gen/" not in f),
    ("lmq replication", lambda f, fn: "lmq_broker/replication/" in f),
    ("lmq other", lambda f, fn: "lmq_broker/" in f and "/gen/" not in f),
    ("protobuf", lambda f, fn: "google/protobuf" in f or "_upb" in f or "upb_" in fn),
    ("grpcio Cython layer", lambda f, fn: "grpc/_cython" in f and f.endswith((".pyx", ".pxi"))),
    ("grpc core (native)", lambda f, fn: "cygrpc" in f or "grpc_core" in fn or "grpc_" in fn),
    ("asyncio event loop", lambda f, fn: "asyncio/" in f or "_asyncio" in f or "selectors.py" in f),
    ("threads, queues, locks", lambda f, fn: f.endswith(("threading.py", "queue.py", "_queuemodule.c"))),
)
# A system call or the interpreter's own C code is charged to the Python or native frame that called it.


# A stack through one of these is a thread blocked, not burning CPU (py-spy's --native samples count them).
WAITS = frozenset(
    (
        *("epoll_wait", "pthread_cond_timedwait", "pthread_cond_wait", "fdatasync", "fsync", "sem_wait"),
        *("sem_timedwait", "take_gil", "PyThread_acquire_lock_timed", "poll", "select", "nanosleep", "accept"),
    )
)


def py_spy() -> str:
    found = shutil.which("py-spy") or (str(TOOL_VENV_SPY) if TOOL_VENV_SPY.exists() else None)
    if found is None:
        sys.exit("profile_broker_send: py-spy not found (pip install py-spy; see the docstring)")
    return found


def parse_frame(text: str) -> tuple[str, str]:
    match = FRAME_RE.match(text.strip())
    return (match["func"], match["file"]) if match else (text.strip(), "")


def charge(stack: list[tuple[str, str]]) -> str:
    """The layer of the innermost frame that has one (leaf first); a stack of none: system calls or the
    interpreter alone."""
    for func, file in reversed(stack):
        for name, test in LAYERS:
            if test(file, func):
                return name
    return "system calls / interpreter, no owner"


def summarize(raw: Path, top: int) -> None:
    layers: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    under_lmq = 0
    total = waits = 0
    for line in raw.read_text().splitlines():
        stack_text, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [parse_frame(part) for part in stack_text.split(";")[1:]]  # the first is the thread
        if not frames:
            continue
        if any(func in WAITS for func, _ in frames):
            waits += count
            continue
        total += count
        layers[charge(frames)] += count
        func, file = frames[-1]
        leaves[f"{func} ({Path(file).name})"] += count
        if any("lmq_broker/" in file and "/gen/" not in file for _, file in frames):
            under_lmq += count
    if total == 0:
        sys.exit("profile_broker_send: no samples")
    print(f"{total:,} samples of threads running ({waits:,} of threads blocked in a wait, left out)")
    print("share by layer (innermost frame that belongs to one):")
    for name, count in layers.most_common():
        print(f"  {name:24s} {100 * count / total:5.1f} %")
    print(f"samples with any lmq frame on the stack (inclusive): {100 * under_lmq / total:.1f} %")
    print(f"top {top} self-time frames:")
    for name, count in leaves.most_common(top):
        print(f"  {100 * count / total:5.1f} %  {name}")


def official_load(endpoint: str, seconds: float, threads: int, pid: int) -> None:
    from bench_broker_send import send_rate  # noqa: PLC0415 (imports the official client's descriptors)

    rate, cpu = send_rate(endpoint, seconds, threads, b"x" * 1024, 100, pid=pid)
    print(f"official client load: {rate:,.0f} msg/s, broker {cpu:,.0f} us CPU/message (sampled, so slowed)")


def ghz_load(endpoint: str, seconds: float, pid: int, tmp: Path, inflight: int) -> None:
    from bench_edge_floor import ghz_binary, ghz_run, write_requests  # noqa: PLC0415

    data = tmp / "requests.bin"
    write_requests(data, 4096, b"x" * 1024, 100)
    run = ghz_run(ghz_binary(), endpoint, data, inflight=inflight, seconds=seconds, pid=pid)
    print(f"ghz load: {run.rate:,.0f} msg/s, broker {run.server_us:,.0f} us CPU/message (sampled, so slowed)")


def drain_load(endpoint: str, count: int, pid: int) -> None:
    from bench_broker_send import drain_cpu  # noqa: PLC0415

    rate, cpu = drain_cpu(endpoint, count, pid=pid)
    print(f"receive + ack: {rate:,.0f} msg/s, broker {cpu:,.0f} us CPU/message (sampled, so slowed)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", choices=("official", "ghz", "drain"), default="official")
    parser.add_argument("--drain", type=int, default=3000, help="messages received and acked (--load drain)")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--threads", type=int, default=4, help="official client threads")
    parser.add_argument("--inflight", type=int, default=256, help="ghz calls in flight")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--raw", type=Path, help="keep py-spy's raw (collapsed) stacks here")
    args = parser.parse_args()
    spy = py_spy()
    with tempfile.TemporaryDirectory() as tmp_name, start_broker(Path(tmp_name) / "lmq") as broker:
        tmp = Path(tmp_name)
        raw = args.raw or tmp / "broker.raw"
        if args.load == "drain":
            from bench_broker_send import fill  # noqa: PLC0415

            fill(broker.endpoint, args.drain, b"x" * 1024)  # before the sampling starts
        record = [spy, "record", "--native", "--pid", str(broker.pid), "--rate", str(args.rate), "--format", "raw",
                  "--output", str(raw)]  # fmt: skip
        spying = subprocess.Popen(record, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)  # py-spy attaches; the load then runs inside its window
        try:
            if args.load == "official":
                official_load(broker.endpoint, args.seconds, args.threads, broker.pid)
            elif args.load == "ghz":
                ghz_load(broker.endpoint, args.seconds, broker.pid, tmp, args.inflight)
            else:
                drain_load(broker.endpoint, args.drain, broker.pid)
        finally:
            spying.send_signal(signal.SIGINT)  # py-spy writes what it sampled, then exits
            _, err = spying.communicate(timeout=60)
        if not raw.exists():
            sys.exit(f"py-spy failed: {err[-2000:]}")
        print(f"load average {os.getloadavg()[0]:.1f}; {os.cpu_count()} cores")
        summarize(raw, args.top)


if __name__ == "__main__":
    main()
