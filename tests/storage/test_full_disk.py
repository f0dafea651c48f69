"""ENOSPC on a real tmpfs in a private mount namespace. Under ``meta/`` (issue 12 item 9): acks fail while
the disk is full and readiness says why (without I/O); reads keep working meanwhile, even after the store's
retrier failed to reopen meta/ read-write; once space returns, writes resume without a restart. Under
``index/`` or with fsyncs of the commit log failing (issue 26 items 1 and 2): sends fail while it is full (an
error reply means "not stored"), readiness says why, and both resume within seconds of space returning,
without a restart. Under ``commitlog/`` alone: only the sends that meet the full disk fail."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).with_name("full_meta.py")
FAULTS_SCRIPT = Path(__file__).with_name("disk_faults.py")


def run_in_mount_namespace(args: list[str]) -> subprocess.CompletedProcess[str]:
    """As root a private mount namespace is enough; otherwise a user namespace maps us to root in it. A
    machine that allows neither fails this test (it must not skip)."""
    unshare = shutil.which("unshare")
    assert unshare is not None, "util-linux unshare is required for the full-disk test"
    flags = ["--mount"] if os.geteuid() == 0 else ["--mount", "--map-root-user"]
    return subprocess.run([unshare, *flags, *args], capture_output=True, text=True, timeout=180, check=False)


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


ASYNC = ["--flush-mode", "async", "--flush-interval-ms", "20"]
SYNC = ["--flush-mode", "sync"]


@pytest.mark.parametrize(
    ("fault", "flags"),
    [("index", SYNC), ("index", ASYNC), ("fsync", SYNC), ("fsync", ASYNC)],
    ids=["index-sync", "index-async", "fsync-sync", "fsync-async"],
)
def test_a_storage_fault_pauses_sends_which_resume_once_space_returns_and_no_error_reply_was_stored(
    tmp_path: Path, fault: str, flags: list[str]
) -> None:
    """``index``: index/ fills (RocksDB refuses writes until reopened); ``fsync``: the commit log's fsyncs fail
    (its ext4's loop device has no room left to write back). Both modes: not ready meanwhile, ready again
    and sends taken within seconds of space returning, no restart; across a SIGKILL and a restart every
    acked send is delivered once (retried ones included) and none answered with an error is."""
    seen = run_script([sys.executable, str(FAULTS_SCRIPT), str(tmp_path / "data"), fault, *flags])
    assert seen["sends_until_failure"] < 1000, seen  # the disk filled while the broker wrote
    status, body = seen["ready_while_full"]
    text = {"index": "index cannot write", "fsync": "cannot be made durable"}[fault]
    assert status == 503 and text in body and ("No space left" in body or "Input/output" in body), body
    assert seen["healthz_while_full"] == 200  # it heals once space returns: no restart wanted
    assert seen["gauge_while_full"] == 0  # lmq_store_index_writable / lmq_store_durable
    assert seen["retries_while_full"] >= 2  # the healer tried, and failed, while the disk stayed full
    assert seen["ok_while_full_after_retries"] == 0
    assert seen["ready_still_full"] == 503
    assert seen["resume_s"] < 10, seen  # from space freed to the first good send
    assert seen["ready_after"] == [200, "ready\n"]
    assert seen["healthz_after"] == 200
    assert seen["gauge_after"] == 1
    assert_delivered_exactly_the_acked(seen)


def test_a_full_commit_log_disk_fails_only_the_sends_that_meet_it(tmp_path: Path) -> None:
    """Only the log's writes fail (ENOSPC): each is cut off at once, so readiness stays green, and the first
    send after space returns is taken (the 3 ms of issue 26: nothing to heal)."""
    seen = run_script([sys.executable, str(FAULTS_SCRIPT), str(tmp_path / "data"), "log"])
    assert seen["sends_until_failure"] < 1000, seen
    assert seen["ready_while_full"][0] == 200 and seen["gauge_while_full"] == 1
    assert seen["ok_while_full_after_retries"] == 0
    assert seen["resume_s"] < 0.1, seen
    assert seen["ready_after"] == [200, "ready\n"]
    assert_delivered_exactly_the_acked(seen)


def test_a_full_data_disk_heals_whichever_part_met_it_first(tmp_path: Path) -> None:
    """The whole data dir on one small tmpfs, as on a real volume: the log, the index or meta meets the full disk
    first (here usually the index's WAL); sends resume once space returns, and delivery is exact."""
    seen = run_script([sys.executable, str(FAULTS_SCRIPT), str(tmp_path / "data"), "all"])
    assert seen["sends_until_failure"] < 1000, seen
    assert seen["healthz_while_full"] == 200
    assert seen["ok_while_full_after_retries"] == 0
    assert seen["resume_s"] < 10, seen
    assert seen["ready_after"] == [200, "ready\n"] and seen["healthz_after"] == 200
    assert_delivered_exactly_the_acked(seen)


def run_script(args: list[str]) -> dict[str, Any]:
    proc = run_in_mount_namespace(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return seen


def assert_delivered_exactly_the_acked(seen: dict[str, Any]) -> None:
    assert seen["retries_ok"] >= 1 and seen["errors_never_retried"] >= 1, seen
    assert seen["acked_lost"] == []  # every OK-acked send is delivered (after a SIGKILL and a restart) ...
    assert seen["delivered_twice"] == []  # ... once, retried ones included
    assert seen["refused_delivered"] == []  # and no send answered with an error ever is
    assert seen["unknown_delivered"] == []
