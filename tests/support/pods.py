"""The processes of a pod (``serve --processes``) as the tests see them, through /proc, and the ports they take."""

from __future__ import annotations

import contextlib
import re
import socket
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.cluster import membership as mb
from lmq_broker.supervisor import free_ports
from lmq_broker.testing import SHARED_ADMIN_KEYS, BrokerProcess, start_broker

PROCESS_RE: Final = re.compile(r"lmq-broker process (\d+) grpc=(\S+) metrics=(\d+)")


@dataclass
class Pod:
    """A started ``serve --processes 2`` pod with one LITE parent topic: its processes' own endpoints and
    metrics ports, in slot order."""

    broker: BrokerProcess
    parent: str
    endpoints: list[str]
    metrics: list[int]

    def owned_by(self, slot: int, prefix: str, count: int) -> list[str]:
        """``count`` lite topic names of the parent, each starting with ``prefix``, that ``slot`` owns."""
        membership = mb.Membership(tuple(self.endpoints), (len(self.endpoints),))
        names = (f"{prefix}-{i}" for i in range(100_000))
        return [n for n in names if mb.owner(membership, model.QueueId.lmq(self.parent, n).topic) == slot][:count]

    def metric(self, slot: int, name: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics[slot]}/metrics", timeout=5).read().decode()
        found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        return float(found[1]) if found else 0.0


def start_pod(data: Path, parent: str, args: Sequence[str], env: Mapping[str, str]) -> Pod:
    """``serve --processes 2 --no-bootstrap`` with ``args``, and the LITE parent topic ``parent``."""
    broker = start_broker(data, extra_args=["--processes", "2", "--no-bootstrap", *args], env=dict(env))
    found = {int(m[1]): (m[2], int(m[3])) for m in PROCESS_RE.finditer(broker.log())}
    pod = Pod(broker, parent, [found[i][0] for i in range(2)], [found[i][1] for i in range(2)])
    with AdminClient(broker.endpoint, timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
        admin.put_parent_topic(model.ParentTopic(parent, model.MessageType.LITE))
    return pod


@contextlib.contextmanager
def pods_of(root: Path, kinds: Iterable[str], start: Callable[[Path, str], Pod]) -> Iterator[dict[str, Pod]]:
    """One pod per kind (``start(root / kind, kind)``), every one stopped at the end, however it ends."""
    started: dict[str, Pod] = {}
    try:
        for kind in kinds:
            started[kind] = start(root / kind, kind)
        yield started
    finally:
        for pod in started.values():
            pod.broker.stop()


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
