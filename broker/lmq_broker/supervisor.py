"""``serve --processes N``: N broker processes in one pod, because one Python process is one core.

Each process is a ring slot of the cluster like a pod would be (``docs/scale-out.md``): its own data directory
(``<data-dir>/p<i>``), its own port (``--port`` + 1 + i, advertised in routes), and every one of them also
listens on the pod's client port (``--port``) with SO_REUSEPORT, so the kernel spreads client connections
over them. A process that dies is started again (its topics are unavailable meanwhile, the others' are not);
SIGTERM/SIGINT stop them all gracefully. With ``--external-port`` the same again for the external listener:
process i on its own external port + 1 + i, all sharing the external port, each told every slot's external
address (``--external-addresses`` given per pod becomes one per slot; the template needs ``--pod-processes``).

The processes share one admin key pair (``<data-dir>/admin-credentials.json`` unless configured): a peer asks
another with it which topics it holds, and an admin client reaches any of them with the same pair.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any, Final

from lmq_broker.admin import credentials
from lmq_broker.cluster import ring
from lmq_broker.cluster.external import ExternalAddresses, per_slot
from lmq_broker.cluster.membership import SEPARATOR, Membership
from lmq_broker.config import BrokerConfig

log = logging.getLogger(__name__)

READY_RE: Final = re.compile(
    r"lmq-broker ready grpc=(?P<grpc>[^ ]+) metrics=(?P<metrics>-?\d+)(?:.* mqtt=(?P<mqtt>\d+))?"
    r"(?:.* external=(?P<external>\d+))?"
)
START_TIMEOUT_S: Final = 120.0
STOP_TIMEOUT_S: Final = 30.0
RESTART_DELAY_S: Final = 1.0
STDERR_TAIL_LINES: Final = 20  # a child's last stderr lines quoted when it ends
STDERR_DRAIN_S: Final = 2.0


@dataclass(frozen=True)
class Plan:
    """What each process of this pod runs as."""

    access_port: int
    ports: tuple[int, ...]
    slots: tuple[int, ...]
    members: tuple[str, ...]  # every slot of the cluster, in slot order
    ring_history: str
    external_access_port: int = -1  # --external-port: the pod's shared external port; -1 without one
    external_ports: tuple[int, ...] = ()  # each process's own external port
    external_members: tuple[str, ...] = ()  # --external-addresses of every slot (from the pods' list)


FREE_PORTS_ENV: Final = "LMQ_FREE_PORTS"


def free_ports(host: str, count: int) -> list[int]:
    """Ports free now (``--port 0``: tests); held together so they differ.

    The kernel's choice (``bind`` to port 0) unless ``LMQ_FREE_PORTS`` names a range ``lo-hi``: then ports of that
    range. The test suites give each pytest-xdist worker a range of its own below the kernel's ephemeral ports, so
    that a port a test released to restart its broker on is not handed meanwhile to another worker's ``bind(0)``
    (its broker then failed to start: port in use)."""
    span = os.environ.get(FREE_PORTS_ENV, "")
    low, _, high = span.partition("-")
    candidates: list[int] = []
    if low.isdigit() and high.isdigit() and int(high) - int(low) >= count:
        candidates = random.sample(range(int(low), int(high) + 1), min(int(high) - int(low) + 1, 64 * count))
    sockets: list[socket.socket] = []
    try:
        while len(sockets) < count:
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            try:
                s.bind((host, candidates.pop() if candidates else 0))
            except OSError:
                s.close()
                continue
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _ports(host: str, port: int, n: int) -> tuple[int, list[int]]:
    """The pod's shared port and each process's own: port + 1 + i (port 0: free ones, for tests)."""
    if port == 0:
        access, *ports = free_ports(host, n + 1)
        return access, ports
    return port, [ring.process_port(port, i) for i in range(n)]


def plan(config: BrokerConfig) -> Plan:
    """Ports and slots of this pod's processes; with ``peers`` (one host:port per pod), the whole cluster's."""
    n = config.processes
    bind_host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
    access, ports = _ports(bind_host, config.port, n)
    external: dict[str, Any] = {}
    if config.external_port >= 0:
        external_access, external_ports = _ports(bind_host, config.external_port, n)
        listed = ExternalAddresses.parse(config.external_addresses).listed
        external = {
            "external_access_port": external_access,
            "external_ports": tuple(external_ports),
            "external_members": per_slot(listed, n),
        }
    if not config.peers:
        host = config.advertised_host or bind_host
        members = tuple(f"{host}:{port}" for port in ports)
        return Plan(access, tuple(ports), tuple(range(n)), members, config.ring_history, **external)
    pods = Membership.parse(config.peers).members
    ordinal = config.ordinal if config.ordinal >= 0 else pods.index(config.advertised_address)
    slot_members: list[str] = []
    for pod in pods:
        slot_members += ring.slot_endpoints(pod, n)
    slots = tuple(ring.slot_number(ordinal, i, n) for i in range(n))
    if config.port == 0:  # tests on one host: the free ports picked stand for this pod's slots
        for slot, port in zip(slots, ports, strict=True):
            slot_members[slot] = f"{slot_members[slot].rpartition(':')[0]}:{port}"
    return Plan(access, tuple(ports), slots, tuple(slot_members), config.ring_history, **external)


class Child:
    """One process of the pod: its output read here (the ready line taken, the rest passed on), the last lines
    it wrote to stderr kept to say why it ended, and each start after the first announced with its ready line."""

    def __init__(self, index: int, command: list[str], env: dict[str, str]) -> None:
        self.index = index
        self.command = command
        self.env = env
        self.process: subprocess.Popen[str] | None = None
        self.ready = threading.Event()
        self.line = ""
        self.metrics = ""
        self.mqtt = ""  # the MQTT port it listens on (process 0 of a pod, with --mqtt-port)
        self.starts = 0
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self._stderr_pump: threading.Thread | None = None

    def start(self) -> None:
        command = self.command
        if self.ready.is_set() and self.metrics not in ("", "0", "-1"):
            # started again after it was ready: on the metrics port the system gave it (``--metrics-port 0``), so
            # the port the pod's ready line published still answers; after a start that ended before its ready
            # line, a free one again (that port may have been taken meanwhile)
            again = {"--metrics-port=0": f"--metrics-port={self.metrics}"}
            if self.mqtt:  # and its MQTT clients reconnect where the pod's ready line said
                again["--mqtt-port=0"] = f"--mqtt-port={self.mqtt}"
            command = [again.get(arg, arg) for arg in command]
        self.ready.clear()
        self.stderr_tail.clear()
        self.starts += 1
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, encoding="utf-8", errors="replace",
            env=self.env, bufsize=1,
        )  # fmt: skip
        threading.Thread(target=self._pump, args=(self.process,), daemon=True).start()
        self._stderr_pump = threading.Thread(target=self._pump_stderr, args=(self.process,), daemon=True)
        self._stderr_pump.start()

    def _pump(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        with process.stdout:
            self._read_stdout(process.stdout)

    def _read_stdout(self, stdout: IO[str]) -> None:
        for line in stdout:
            match = READY_RE.search(line)
            if match:  # the pod prints one ready line of its own; this one is renamed
                self.metrics = match["metrics"]
                self.mqtt = match["mqtt"] or ""
                self.line = f"lmq-broker process {self.index} grpc={match['grpc']} metrics={self.metrics}"
                if self.mqtt:
                    self.line += f" mqtt={self.mqtt}"
                if match["external"]:
                    self.line += f" external={match['external']}"
                if self.starts > 1:  # started again: its ports said again (the pod's ready line is printed once)
                    say(self.line)
                self.ready.set()
            else:
                _copy(line, sys.stdout)

    def _pump_stderr(self, process: subprocess.Popen[str]) -> None:
        assert process.stderr is not None
        with process.stderr:
            for line in process.stderr:
                self.stderr_tail.append(line.rstrip("\n"))
                _copy(line, sys.stderr)

    def ended(self, code: int) -> str:
        """Why the process ended, for the log: its exit code or the signal that ended it, and its last lines
        on stderr (a traceback, a native abort's message)."""
        if self._stderr_pump is not None:
            self._stderr_pump.join(STDERR_DRAIN_S)  # the last lines it wrote, before they are quoted
        cause = f"exit code {code}"
        if code < 0:
            cause = f"signal {signal.Signals(-code).name}" if -code in signal.valid_signals() else f"signal {-code}"
        tail = "\n".join(f"  | {line}" for line in self.stderr_tail)
        return f"{cause}; its last lines on stderr:\n{tail}" if tail else f"{cause}; it wrote nothing on stderr"


def say(line: str) -> None:
    """A line of ports on stdout (the ready lines) in one write: ``print`` writes the text and its newline apart,
    and a log line written between them onto the same pipe (``2>&1``; a child's stderr) ran on from the port's
    digits (``metrics=40103`` + ``2026-11-30 ...`` read as port 401032026)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _copy(line: str, out: IO[str]) -> None:
    """A child's line onto the pod's own output; a write that fails drops it, so that the pipe is still read (a
    child blocked on a full pipe would stop serving)."""
    with contextlib.suppress(OSError, ValueError):
        out.write(line)
        out.flush()


def child_command(argv: Sequence[str], config: BrokerConfig, p: Plan, index: int) -> list[str]:
    metrics = config.metrics_port if config.metrics_port <= 0 else ring.process_port(config.metrics_port, index)
    copies = config.replica_port if config.replica_port <= 0 else ring.process_port(config.replica_port, index)
    overrides = {
        "--processes": "1",
        "--port": str(p.ports[index]),
        "--access-port": str(p.access_port),
        "--peers": SEPARATOR.join(p.members),
        "--ordinal": str(p.slots[index]),
        "--advertised-address": p.members[p.slots[index]],
        "--data-dir": str(config.store.data_dir / f"p{index}"),
        "--metrics-port": str(metrics),
        "--replica-port": str(copies),
        "--ring-history": p.ring_history,
        "--broker-name": f"{config.broker_name}-p{index}",
        "--local-hop-dir": str(config.store.data_dir / "hop"),
        # Every process needs it, not only for external addresses: a slot's followers are the same process of
        # the next pods (``replication.setup.followers_of``), and without it the next slot (this pod's) was taken.
        "--pod-processes": str(config.processes),
    }
    pod_mqtt = config.mqtt_port >= 0 and index > 0
    if config.mqtt_port >= 0:
        # MQTT on the pod's first process only: a session's state lives in the data dir of the process that
        # serves it, so a client that reconnected to a sibling (a shared port) would lose its session; its lite
        # topics are anywhere in the ring, as they are for a client of another pod
        overrides["--mqtt-port"] = "-1" if pod_mqtt else str(config.mqtt_port)
    if p.external_ports:
        overrides |= {
            "--external-port": str(p.external_ports[index]),
            "--external-access-port": str(p.external_access_port),
            "--external-addresses": SEPARATOR.join(p.external_members),
        }
    command = [sys.executable, "-m", "lmq_broker", *argv]
    for flag, value in overrides.items():
        command += [f"{flag}={value}"]
    if pod_mqtt:
        command.append("--pod-mqtt")  # its parents are made here too
    return command


def run(argv: Sequence[str], config: BrokerConfig) -> int:
    """Start the processes, print the pod's ready line, restart any that dies, stop all on SIGTERM."""
    p = plan(config)
    env = dict(os.environ)
    config.store.data_dir.mkdir(parents=True, exist_ok=True)
    if not config.admin_anonymous and not config.admin_access_key:
        pair, _ = credentials.load_or_create(config.store.data_dir)
        env["LMQ_ADMIN_ACCESS_KEY"], env["LMQ_ADMIN_SECRET_KEY"] = pair.access_key, pair.secret_key
    elif config.admin_anonymous and not config.cluster_secret and not config.peers:
        env["LMQ_CLUSTER_SECRET"] = secrets.token_hex(32)  # the pod's processes sign their calls to each other
    children = [Child(i, child_command(argv, config, p, i), env) for i in range(config.processes)]
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    for child in children:
        child.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    for child in children:
        while not child.ready.wait(0.1):
            assert child.process is not None
            if stopping.is_set() or child.process.poll() is not None or time.monotonic() > deadline:
                code = child.process.poll()
                _stop(children)
                why = "" if code is None else f": {child.ended(code)}"
                print(f"broker process {child.index} did not start{why}", file=sys.stderr)
                return 1
        say(child.line)
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
    external = f" external={p.external_access_port}" if p.external_ports else ""
    mqtt = f" mqtt={children[0].mqtt}" if children[0].mqtt else ""
    say(f"lmq-broker ready grpc={host}:{p.access_port} metrics={children[0].metrics}{mqtt}{external}")
    while not stopping.wait(0.2):
        for child in children:
            assert child.process is not None
            code = child.process.poll()
            if code is not None:
                log.error("broker process %d ended: %s\nstarting it again", child.index, child.ended(code))
                time.sleep(RESTART_DELAY_S)
                child.start()
    _stop(children)
    return 0


def _stop(children: Sequence[Child]) -> None:
    for child in children:
        if child.process is not None and child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    for child in children:
        if child.process is None:
            continue
        try:
            child.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                child.process.kill()
            child.process.wait()
