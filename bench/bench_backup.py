"""Backups: how long the store's write lock is held for a snapshot, and how fast a backup streams.

Fills a data directory with 1 KiB messages over many lite topics (LmqStore directly), measures
``LmqStore.snapshot`` (the only part under the write lock: links and RocksDB checkpoints), then starts a real
broker on the directory and times ``lmq-admin backup`` (``AdminClient.backup``) and ``restore`` of it.

    python bench/bench_backup.py            # 200k messages (~240 MiB)
    python bench/bench_backup.py --quick    # 20k messages
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from lmq_broker import config, model
from lmq_broker.admin import restoring
from lmq_broker.admin.client import AdminClient
from lmq_broker.storage import snapshots
from lmq_broker.storage import store as store_mod
from lmq_broker.testing import start_broker

BODY = b"x" * 1024
BATCH = 500


def fill(data: Path, total: int, topics: int) -> None:
    s = store_mod.open_store(config.StoreConfig(data_dir=data, flush_mode=config.FlushMode.ASYNC))
    try:
        for start in range(0, total, BATCH):
            batch = []
            for i in range(start, min(start + BATCH, total)):
                lite = f"t{i % topics}"
                queue = model.QueueId.lmq("Bench", lite)
                batch.append(model.NewMessage(f"m{i}", "Bench", BODY, (queue,), lite_topic=lite))
            s.append(batch)
        for t in range(topics):
            s.commit_offset(model.QueueId.lmq("Bench", f"t{t}"), "g", 1)
    finally:
        s.close()


def lock_hold_ms(data: Path, runs: int) -> list[float]:
    s = store_mod.open_store(config.StoreConfig(data_dir=data))
    held = []
    try:
        for n in range(runs):
            staging = data / f"bench-staging-{n}"
            started = time.perf_counter()
            s.snapshot(staging)
            held.append((time.perf_counter() - started) * 1000)
            snapshots.discard(staging)
    finally:
        s.close()
    return held


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    total = 20_000 if args.quick else 200_000
    root = Path(tempfile.mkdtemp(prefix="lmq-bench-backup-"))
    try:
        data = root / "data"
        started = time.perf_counter()
        fill(data, total, topics=total // 20)
        print(f"filled {total:,} messages in {time.perf_counter() - started:.1f} s; load {os.getloadavg()[0]:.1f}")
        held = sorted(lock_hold_ms(data, 5))
        print(f"FIGURE snapshot under the write lock: median {held[2]:.1f} ms (runs {held[0]:.1f}-{held[-1]:.1f} ms)")
        broker = start_broker(data)
        try:
            with AdminClient(broker.admin_endpoint, **broker.admin_keys) as admin:
                summary = admin.backup(root / "snap")
        finally:
            broker.stop()
        mib = summary.bytes / 1048576
        print(
            f"FIGURE backup over gRPC: {mib:.0f} MiB, {summary.files} files in {summary.seconds:.1f} s = "
            f"{mib / summary.seconds:.0f} MiB/s; load {os.getloadavg()[0]:.1f}"
        )
        restored = restoring.restore(root / "snap", root / "restored")
        print(f"FIGURE restore (hash and copy): {mib / restored.seconds:.0f} MiB/s ({restored.seconds:.1f} s)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
