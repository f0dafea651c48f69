"""ENOSPC under ``meta/`` (issue 12 item 9), on a real tmpfs in a private mount namespace: acks fail while
the disk is full and readiness says why (without I/O); reads keep working meanwhile, even after the store's
retrier failed to reopen meta/ read-write; once space returns, writes resume without a restart."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("full_meta.py")


def run_in_mount_namespace(args: list[str]) -> subprocess.CompletedProcess[str]:
    """As root a private mount namespace is enough; otherwise a user namespace maps us to root in it. A
    machine that allows neither fails this test (it must not skip)."""
    unshare = shutil.which("unshare")
    assert unshare is not None, "util-linux unshare is required for the full-disk test"
    flags = ["--mount"] if os.geteuid() == 0 else ["--mount", "--map-root-user"]
    return subprocess.run([unshare, *flags, *args], capture_output=True, text=True, timeout=120, check=False)


def test_a_full_meta_disk_fails_readiness_then_recovers_when_space_returns(tmp_path: Path) -> None:
    proc = run_in_mount_namespace([sys.executable, str(SCRIPT), str(tmp_path / "data")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["ready_before"] == "200 OK"
    assert seen["fill_errno"] == 28  # ENOSPC
    assert seen["failed_after_commits"] is not None, seen
    assert "No space left" in seen["error"]
    assert seen["ready_while_full"] == "503 Service Unavailable"
    assert "meta store cannot write" in seen["ready_body_while_full"]
    assert seen["commit_while_full"] == "refused"
    assert "read_error_while_full" not in seen, seen
    assert seen["offset_while_full"] is not None  # reads keep working while meta cannot write
    assert seen["topics_while_full"] == ["orders"]
    assert seen["messages_while_full"] == 10
    assert seen["ready_still_full"] == "503 Service Unavailable"
    assert seen["readyz_ms"] < 50  # no reopen on the event loop
    assert seen["ready_after_space_returns"] == "200 OK"
    assert seen["offset_after"] == seen["offset_after_restart"] == 9
