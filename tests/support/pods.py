"""The processes of a pod (``serve --processes``) as the tests see them, through /proc."""

from __future__ import annotations

from pathlib import Path

from lmq_broker.testing import BrokerProcess


def child_pid(pod: BrokerProcess, slot: int) -> int | None:
    """The pid of the live process of ``pod`` (``serve --processes``) serving ring slot ``slot``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, ppid = (entry / "stat").read_text().rpartition(")")[2].split()[:2]
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(ppid) == pod.pid and state != "Z" and f"--ordinal={slot}".encode() in argv:
            return int(entry.name)
    return None
