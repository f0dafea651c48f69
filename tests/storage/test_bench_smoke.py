"""The storage benchmarks run (--quick) and print their figure lines. Behaviour only: speed is not judged here."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from benchruns import run_bench

BENCH = Path(__file__).resolve().parents[2] / "bench"
FIGURE = re.compile(r"^FIGURE (\w+): -?[\d,.]+ .*\(target (<=|>=) [\d,.]+ .*\) (PASS|BELOW TARGET)", re.MULTILINE)

EXPECTED = {
    "bench_store_append.py": {
        "append_sync_batch512_threads1",
        "append_async_batch512_threads1",
        "append_sync_batch64_threads4",
    },
    "bench_store_multidispatch.py": {
        "multidispatch_sync_extra_queue_cost",
        "multidispatch_async_extra_queue_cost",
        "multidispatch_unbatched_sync_extra_queue_cost",
    },
    "bench_store_lite.py": {
        "lite_rss_growth_per_topic_steady_state",
        "lite_read_next32_p99",
        "lite_restart_clean_to_ready",
        "lite_restart_after_sigkill_to_ready",
        "lite_restart_reindexing_a_tail_to_ready",
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_bench_runs_quick_and_prints_its_figures(script: str, tmp_path: Path) -> None:
    proc = run_bench([sys.executable, str(BENCH / script), "--quick", "--dir", str(tmp_path)], 240)
    assert proc.returncode == 0, proc.stderr
    assert {m.group(1) for m in FIGURE.finditer(proc.stdout)} == EXPECTED[script], proc.stdout
    assert list(tmp_path.iterdir()) == []  # benchmarks clean up after themselves
