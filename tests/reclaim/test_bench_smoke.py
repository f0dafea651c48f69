"""bench/bench_reclaim.py --quick runs to the end and prints its figure lines (the figures themselves are
measured by running the benchmark, not here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from benchruns import run_bench

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_reclaim.py"


@pytest.mark.slow
def test_quick_benchmark_prints_its_figures() -> None:
    # --flush sync: the brokers' production default (the bench's own default is async, as its recorded figures)
    done = run_bench([sys.executable, str(BENCH), "--quick", "--flush", "sync"], 900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for figure in ("generation:", "reclaim wall (scan + reclaim, Spark start included):", "split: plan", "rates:"):
        assert figure in out, out
    assert (
        "topics walked: 100000; returned by the brokers: 10000 (expected 10000); expired: 10000 (expected 10000)" in out
    )
    assert "brokers: --flush-mode sync" in out
    assert "result: OK" in out
