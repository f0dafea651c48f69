"""The processes of a pod (``serve --processes``) as the tests see them, through /proc, and the ports they take."""

from __future__ import annotations

import socket
from pathlib import Path

from lmq_broker.supervisor import free_ports
from lmq_broker.testing import BrokerProcess


def free_block(count: int) -> int:
    """A port p with p .. p + count - 1 all free now (a pod's port and its processes' ports)."""
    for _ in range(50):
        base = free_ports("127.0.0.1", 1)[0]
        if base + count > 65535:
            continue
        held = []
        try:
            for port in range(base, base + count):
                held.append(socket.create_server(("127.0.0.1", port)))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError("no block of free ports")


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
