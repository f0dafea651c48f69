"""Seconds from space freed to the first good send, after a storage fault (issue 26 items 1 and 2; goal < 10 s).

Each case runs ``tests/storage/disk_faults.py`` in a private mount namespace (root, or a user namespace
without loop devices: then the ``fsync`` cases fail): a broker process whose ``index/`` is a small tmpfs
that fills (``index``), whose commit log is ext4 on a loop device whose backing tmpfs fills so its fsyncs
fail (``fsync``), whose ``commitlog/`` alone is a full tmpfs (``log``), or whose whole data dir is
(``all``), in both flush modes. The script sends one message at a time until sends fail, frees the space,
and sends until one is taken. Prints ``FIGURE`` lines (the median of ``--rounds``) and the delivery check
of each run.

    python bench/bench_disk_faults.py              # 3 rounds of 6 cases, ~1.5 min
    python bench/bench_disk_faults.py --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "storage" / "disk_faults.py"
ASYNC = ["--flush-mode", "async", "--flush-interval-ms", "20"]
SYNC = ["--flush-mode", "sync"]
CASES = {
    "index-sync": ["index", *SYNC],
    "index-async": ["index", *ASYNC],
    "fsync-sync": ["fsync", *SYNC],
    "fsync-async": ["fsync", *ASYNC],
    "log-sync": ["log", *SYNC],
    "all-sync": ["all", *SYNC],
}
TARGET_S = {"log-sync": 0.1}  # nothing to heal: the next send fits


def run(case: list[str]) -> dict[str, object]:
    unshare = shutil.which("unshare")
    assert unshare is not None, "util-linux unshare is required"
    flags = ["--mount"] if os.geteuid() == 0 else ["--mount", "--map-root-user"]
    with tempfile.TemporaryDirectory(prefix="lmq-bench-disk-") as tmp:
        proc = subprocess.run(
            [unshare, *flags, sys.executable, str(SCRIPT), str(Path(tmp) / "data"), *case],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    if proc.returncode != 0:
        raise SystemExit(f"{case}: {proc.stderr[-3000:]}")
    seen: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for name, case in CASES.items():
        resumes: list[float] = []
        for _ in range(args.rounds):
            seen = run(case)
            resume = seen["resume_s"]
            assert isinstance(resume, float)
            resumes.append(resume)
            bad = {k: seen[k] for k in ("acked_lost", "delivered_twice", "refused_delivered") if seen[k]}
            outcome = bad or "delivery exact"
            print(
                f"  {name}: resumed after {resume:.4f} s, acked {seen['acked']}, refused {seen['refused']}, {outcome}"
            )
        target = TARGET_S.get(name, 10.0)
        median = statistics.median(resumes)
        runs = ", ".join(f"{r:.4f}" for r in resumes)
        verdict = "ok" if median < target else "MISSED"
        print(f"FIGURE disk_fault_resume_seconds[{name}] {median:.4f} s (runs {runs}; target < {target} s) {verdict}")


if __name__ == "__main__":
    main()
