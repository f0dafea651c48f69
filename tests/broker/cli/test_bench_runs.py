"""The smoke tests' runner leaves nothing of a benchmark behind: a script that started a child of its own and
overran its timeout is stopped with that child (before, a timed-out bench_reclaim left its brokers running)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchruns import run_bench
from waiting import eventually

SCRIPT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    return state != "Z"  # a zombie waits only for its reaper


def test_a_timed_out_script_is_stopped_with_what_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_bench([sys.executable, "-c", SCRIPT, str(pid_file)], timeout_s=10)
    child = int(pid_file.read_text())
    eventually(lambda: not _alive(child), "the script's child stopped with it", timeout_s=5)


def test_a_finished_script_returns_its_output_and_status() -> None:
    done = run_bench([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], timeout_s=30)
    assert (done.returncode, done.stdout) == (3, "out\n")
