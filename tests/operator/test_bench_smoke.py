"""bench/bench_operator.py --quick runs to the end and prints every figure line (figures are not asserted)."""

from __future__ import annotations

import sys

from benchruns import run_bench

from lmq_operator import testing

FIGURES = (
    "ready_latency_burst_p50_s ",
    "ready_latency_burst_p99_s ",
    "ready_latency_paced_p50_s ",
    "ready_latency_paced_p99_s ",
    "ready_latency_pair_p50_s ",
    "ready_latency_pair_p99_s ",
    "ready_all_s ",
    "operator_arrival_cpu_core_share ",
    "operator_cpu_core_share ",
    "operator_rss_mib ",
    "operator_rss_peak_mib ",
)


def test_bench_operator_quick_prints_its_figures() -> None:
    testing.binaries()  # a missing testenv is a failure with the `make testenv` hint, as in the suite
    done = run_bench([sys.executable, str(testing.REPO / "bench" / "bench_operator.py"), "--quick"], 240, testing.REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for figure in FIGURES:
        assert any(line.startswith(figure) for line in lines), (figure, done.stdout)
