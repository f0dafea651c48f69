"""Append throughput of LmqStore: 1 KiB messages, batched, in ``sync`` and ``async`` flush modes.

Prints one ``FIGURE`` line per measured figure with its target. Wall-clock figures on a shared 2-core machine
are noisy: every figure is the median of several timed runs (the best run is printed beside it).

    python bench/bench_store_append.py            # full run (~1 min)
    python bench/bench_store_append.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from lmq_broker import config, model
from lmq_broker.storage import store as store_mod

BODY = b"x" * 1024
PARENT = model.QueueId("Bench", 0)


def figure(name: str, value: float, unit: str, *, op: str, target: float, extra: str = "") -> None:
    ok = value >= target if op == ">=" else value <= target
    verdict = "PASS" if ok else "BELOW TARGET"
    print(f"FIGURE {name}: {value:,.1f} {unit} (target {op} {target:,.0f} {unit}) {verdict}{extra}", flush=True)


def messages(n: int, start: int) -> list[model.NewMessage]:
    return [model.NewMessage(f"m{start + i}", "Bench", BODY, (PARENT,)) for i in range(n)]


def run_once(root: Path, mode: config.FlushMode, total: int, batch: int, threads: int) -> tuple[float, int, float]:
    """Messages per second of ``total`` messages appended in batches by ``threads`` threads; fsyncs; CPU us/msg."""
    data = root / f"{mode}-{time.monotonic_ns()}"
    store = store_mod.open_store(config.StoreConfig(data_dir=data, flush_mode=mode))
    per_thread = total // threads
    batches = [messages(batch, i * batch) for i in range(per_thread // batch)]
    store.append(messages(batch, 10**9))  # warm: segment created, caches primed
    fsyncs = store.fsync_count

    def work() -> None:
        for b in batches:
            store.append(b)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    t0, cpu0 = time.perf_counter(), time.process_time()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    store.flush()  # async: the data is durable at the end of the measured interval too
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    fsyncs = store.fsync_count - fsyncs
    store.close()
    shutil.rmtree(data)
    n = len(batches) * batch * threads
    return n / elapsed, fsyncs, cpu / n * 1e6


def measure(root: Path, mode: config.FlushMode, total: int, batch: int, *, threads: int, runs: int) -> None:
    rates, fsyncs, cpus = zip(*(run_once(root, mode, total, batch, threads) for _ in range(runs)), strict=True)
    target = 50_000 if mode == config.FlushMode.SYNC else 100_000
    per_fsync = total / max(1, statistics.median(fsyncs))
    figure(
        f"append_{mode}_batch{batch}_threads{threads}",
        statistics.median(rates),
        "msg/s",
        op=">=",
        target=target,
        extra=f"  [best {max(rates):,.0f} msg/s of {runs} runs; ~{per_fsync:,.0f} msgs per fsync; "
        f"{statistics.median(cpus):.1f} us CPU per message]",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--dir", type=Path, default=None, help="where to put the data (default: a temp dir)")
    args = parser.parse_args()
    total, runs = (20_000, 1) if args.quick else (200_000, 5)
    root = Path(tempfile.mkdtemp(prefix="lmq-bench-append-", dir=args.dir))
    try:
        print(f"# {total:,} messages of {len(BODY)} B per run, {runs} runs per figure, data in {root}")
        print(f"# load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
        measure(root, config.FlushMode.SYNC, total, 512, threads=1, runs=runs)
        measure(root, config.FlushMode.ASYNC, total, 512, threads=1, runs=runs)
        # group commit: 4 producers with smaller batches share fsyncs
        measure(root, config.FlushMode.SYNC, total, 64, threads=4, runs=runs)
        print(f"# load average at end: {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
