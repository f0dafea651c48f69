"""Run a benchmark script as a child for a smoke test, and leave nothing of it behind.

A benchmark starts brokers, JVMs and clients of its own. When the smoke test's timeout (or pytest-timeout)
stops the script, killing only the script would leave those running for the rest of the session, holding
ports, CPU and the data they write. So the script runs as the leader of its own process group, and the whole
group is killed once the run is over, however it ended.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path


def run_bench(argv: Sequence[str], timeout_s: float, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True)`` with the script's whole process group killed at
    the end; a run past ``timeout_s`` raises ``subprocess.TimeoutExpired`` as ``subprocess.run`` does."""
    process = subprocess.Popen(
        list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, start_new_session=True
    )
    try:
        out, err = process.communicate(timeout=timeout_s)
    finally:
        _kill_group(process.pid)
        if process.returncode is None:
            process.communicate()
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the script and everything it started are gone already
        os.killpg(pgid, signal.SIGKILL)
