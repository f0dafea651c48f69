"""Start a real broker as a subprocess, for tests and benchmarks of every component.

Stable API (the operator, reclaim and e2e suites rely on it)::

    broker = start_broker(tmp_path / "data")              # port 0: a free port is picked
    broker.endpoint        # "127.0.0.1:<port>": the v2 MessagingService (official clients)
    broker.admin_endpoint  # the lmq.admin.v1 service: the same port, or --admin-port's
    broker.admin_keys      # {"access_key", "secret_key"} the admin service wants: AdminClient(..., **broker.admin_keys)
    broker.admin_env("LMQ_OPERATOR")  # the same pair as LMQ_OPERATOR_ACCESS_KEY/_SECRET_KEY, for a subprocess
    broker.metrics_url     # "http://127.0.0.1:<port>" (/metrics, /healthz, /readyz)
    broker.mqtt_port       # with extra_args ["--mqtt-port", "0"]: the MQTT listener's port (else -1)
    broker.external_port   # with extra_args ["--external-port", ...]: the external listener's port (else -1)
    broker.stop()          # SIGTERM: graceful (drains, flushes), waits for exit
    broker.kill()          # SIGKILL: crash
    broker = broker.restart()  # same data dir, same port, same arguments

Admin calls need the broker's admin key pair (docs/security.md): the one given in ``extra_args``
(``--admin-access-key``) or ``env`` (``LMQ_ADMIN_ACCESS_KEY``), else the one the broker generated in
``<data_dir>/admin-credentials.json``; with ``--admin-anonymous`` both keys are empty (calls go unsigned).
Suites with several brokers and one admin caller (the operator, the reclaim job) pass a shared pair,
``SHARED_ADMIN_ENV``, as on Kubernetes where every broker pod gets the chart's one Secret.

``issue_certificate(directory, "lmq-broker.mq.svc")`` makes a CA and a server certificate it signed (openssl), for
TLS brokers and the callers that check them (``--tls-ca``, ``--tls-server-name``).

``Inbox`` is a MessageListener (by duck typing) for the official client's push consumers that records
what it consumed and lets a test wait for a condition with a deadline.

A subprocess, not a thread: the official client ships its own copy of the apache.rocketmq.v2 protobuf
descriptors, which cannot share an interpreter with ours. This module therefore imports nothing from the
broker. ``start_broker`` returns once the broker printed its ready line (it listens by then); stdout and
stderr go to ``<data_dir>/../broker-<port>.log`` style files named in ``log_path``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypedDict

from lmq_broker import supervisor

READY_RE: Final = re.compile(
    r"lmq-broker ready grpc=(?P<host>[^ ]+):(?P<port>\d+) metrics=(?P<metrics>-?\d+)(?: admin=(?P<admin>\d+))?"
    r"(?: mqtt=(?P<mqtt>\d+))?(?: external=(?P<external>\d+))?"
)
START_TIMEOUT_S: Final = 60.0
STOP_TIMEOUT_S: Final = 30.0
ADMIN_CREDENTIALS_FILE: Final = "admin-credentials.json"  # lmq_broker.admin.credentials.FILE_NAME
SHARED_ADMIN_ENV: Final = {"LMQ_ADMIN_ACCESS_KEY": "lmq-test-admin", "LMQ_ADMIN_SECRET_KEY": "lmq-test-admin-secret"}


class AdminKeys(TypedDict):
    """Keyword arguments of ``AdminClient`` (``AdminClient(endpoint, **broker.admin_keys)``)."""

    access_key: str
    secret_key: str


SHARED_ADMIN_KEYS: Final = AdminKeys(
    access_key=SHARED_ADMIN_ENV["LMQ_ADMIN_ACCESS_KEY"], secret_key=SHARED_ADMIN_ENV["LMQ_ADMIN_SECRET_KEY"]
)


class BrokerStartError(RuntimeError):
    pass


@dataclass
class BrokerProcess:
    data_dir: Path
    port: int
    metrics_port: int
    process: subprocess.Popen[str]
    log_path: Path
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    _reader: threading.Thread | None = None
    admin_access_key: str = ""  # empty: the broker serves admin anonymously (--admin-anonymous)
    admin_secret_key: str = ""
    admin_port: int = 0  # 0: admin is served on ``port``
    mqtt_port: int = -1  # the MQTT listener's port (``--mqtt-port``), -1 without one
    external_port: int = -1  # the external listener's port (``--external-port``), -1 without one
    wrapper: tuple[str, ...] = ()  # the command the broker runs under (``start_broker``'s ``wrapper``)

    @property
    def admin_keys(self) -> AdminKeys:
        return AdminKeys(access_key=self.admin_access_key, secret_key=self.admin_secret_key)

    def admin_env(self, prefix: str = "LMQ_ADMIN") -> dict[str, str]:
        """The admin pair as ``<prefix>_ACCESS_KEY``/``<prefix>_SECRET_KEY`` variables (LMQ_OPERATOR, LMQ_RECLAIM)."""
        if not self.admin_access_key:
            return {}
        return {f"{prefix}_ACCESS_KEY": self.admin_access_key, f"{prefix}_SECRET_KEY": self.admin_secret_key}

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def admin_endpoint(self) -> str:
        return f"127.0.0.1:{self.admin_port or self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """Graceful stop (SIGTERM); returns the exit code. Kills if it does not exit within ``timeout``."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._join()
        return self.process.returncode

    def kill(self) -> None:
        """Crash (SIGKILL): nothing is flushed that the store had not made durable."""
        if self.alive():
            self.process.kill()
            self.process.wait()
        self._join()

    def restart(self, timeout: float = START_TIMEOUT_S) -> BrokerProcess:
        """Stop if running, then start again on the same data dir, ports and arguments."""
        self.stop()
        args = list(self.args)
        for flag, port in (("--mqtt-port", self.mqtt_port), ("--external-port", self.external_port)):
            if port > 0 and flag in args:  # the port it got, not "any free one" again
                args[args.index(flag) + 1] = str(port)
        return start_broker(
            self.data_dir, port=self.port, extra_args=args, env=self.env, timeout=timeout, wrapper=self.wrapper
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _join(self) -> None:
        if self._reader is not None:
            self._reader.join(5)
            self._reader = None

    def __enter__(self) -> BrokerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_broker(
    data_dir: Path | str,
    port: int = 0,
    extra_args: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = START_TIMEOUT_S,
    python: str = sys.executable,
    wrapper: Sequence[str] = (),
) -> BrokerProcess:
    """Run ``python -m lmq_broker serve`` on 127.0.0.1 and wait until it is ready.

    ``extra_args`` are more ``serve`` flags (e.g. ``["--no-bootstrap", "--flush-mode", "async"]``; a ``--host``
    there wins); the metrics port defaults to a free one (pass ``--metrics-port`` to choose). ``env`` is added to
    the environment. ``wrapper`` is a command that runs it and execs (``["ip", "netns", "exec", "ns1"]``).
    """
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    args = tuple(extra_args)
    if port == 0 and os.environ.get(supervisor.FREE_PORTS_ENV) and "--processes" not in args:
        # one of the suite's range (``free_ports``), which a restart takes again: bind(0)'s could be handed out
        # meanwhile (``--processes`` picks its ports itself: port + 1 + i must be free too)
        port = supervisor.free_ports("127.0.0.1", 1)[0]
        for flag in ("--mqtt-port", "--external-port"):
            if _flag(args, flag) == "0" and flag in args:
                at = args.index(flag) + 1
                args = (*args[:at], str(supervisor.free_ports("127.0.0.1", 1)[0]), *args[at + 1 :])
    command = [*wrapper, python, "-m", "lmq_broker", "serve", "--data-dir", str(data_dir), "--port", str(port)]
    command += ["--host", "127.0.0.1"]
    if "--metrics-port" not in args:
        command += ["--metrics-port", "0"]
    command += list(args)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    src = str(Path(__file__).resolve().parent.parent)
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (src, full_env.get("PYTHONPATH", "")) if p)
    log_path = data_dir.parent / f"{data_dir.name}.broker.log"
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, bufsize=1
    )
    found: dict[str, int] = {}
    ready = threading.Event()

    def pump() -> None:
        # Copies the output to the log file for the whole life of the process, so the pipe never fills.
        assert process.stdout is not None
        with log_path.open("a") as sink, process.stdout:
            for line in process.stdout:
                sink.write(line)
                sink.flush()
                match = READY_RE.search(line)
                if match and not ready.is_set():
                    found["port"] = int(match["port"])
                    found["metrics"] = int(match["metrics"])
                    found["admin"] = int(match["admin"] or match["port"])
                    found["mqtt"] = int(match["mqtt"]) if match["mqtt"] else -1
                    found["external"] = int(match["external"]) if match["external"] else -1
                    ready.set()
        ready.set()

    reader = threading.Thread(target=pump, name=f"broker-log-{process.pid}", daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.05):
        if time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise BrokerStartError(f"broker not ready after {timeout}s; log {log_path}:\n{_tail(log_path)}")
    if "port" not in found:
        process.wait()
        raise BrokerStartError(f"broker exited with {process.returncode}; log {log_path}:\n{_tail(log_path)}")
    admin_access_key, admin_secret_key = _admin_pair(data_dir, args, full_env)
    return BrokerProcess(
        data_dir,
        found["port"],
        found["metrics"],
        process,
        log_path,
        args,
        dict(env or {}),
        _reader=reader,
        admin_access_key=admin_access_key,
        admin_secret_key=admin_secret_key,
        admin_port=found["admin"],
        mqtt_port=found["mqtt"],
        external_port=found["external"],
        wrapper=tuple(wrapper),
    )


def _flag(args: Sequence[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _admin_pair(data_dir: Path, args: Sequence[str], env: Mapping[str, str]) -> tuple[str, str]:
    """The admin pair the broker started with, found as it finds it (flag, variable, generated file)."""
    anonymous = "--admin-anonymous" in args or (
        "--no-admin-anonymous" not in args and env.get("LMQ_ADMIN_ANONYMOUS", "").lower() in ("1", "true", "yes", "on")
    )
    if anonymous:
        return "", ""
    access_key = _flag(args, "--admin-access-key") or env.get("LMQ_ADMIN_ACCESS_KEY", "")
    if access_key:
        return access_key, _flag(args, "--admin-secret-key") or env.get("LMQ_ADMIN_SECRET_KEY", "")
    saved = json.loads((data_dir / ADMIN_CREDENTIALS_FILE).read_text())
    return str(saved["access_key"]), str(saved["secret_key"])


@dataclass(frozen=True)
class Certificate:
    ca: Path  # PEM of the CA that signed ``cert``
    cert: Path
    key: Path


def issue_certificate(directory: Path, *names: str, ca: Certificate | None = None, tag: str = "tls") -> Certificate:
    """A server certificate for ``names`` (DNS names, or IP addresses) signed by ``ca``'s CA, or by a new CA
    made in ``directory``; files ``<tag>.crt``/``<tag>.key`` (and ``<tag>-ca.crt``/``-ca.key``)."""
    directory.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    if ca is None:
        ca_cert, ca_key = directory / f"{tag}-ca.crt", directory / f"{tag}-ca.key"
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={tag} test CA",
                "-keyout", str(ca_key), "-out", str(ca_cert))  # fmt: skip
    else:
        ca_cert, ca_key = ca.ca, ca.ca.with_suffix(".key")
    cert, key, request = directory / f"{tag}.crt", directory / f"{tag}.key", directory / f"{tag}.csr"
    sans = ",".join(f"IP:{n}" if n.replace(".", "").isdigit() else f"DNS:{n}" for n in names)
    extensions = directory / f"{tag}.ext"
    extensions.write_text(f"subjectAltName={sans}\n")
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={names[0]}", "-keyout", str(key), "-out", str(request)
    )
    openssl("x509", "-req", "-in", str(request), "-CA", str(ca_cert), "-CAkey", str(ca_key), "-CAcreateserial",
            "-days", "1", "-extfile", str(extensions), "-out", str(cert))  # fmt: skip
    return Certificate(ca_cert, cert, key)


def _tail(path: Path, lines: int = 60) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def receive_some(consumer: Any, max_messages: int, timeout_s: float = 20.0, wait_s: int = 15) -> list[Any]:
    """Messages from an official-client SimpleConsumer: its receive, repeated until something comes or
    ``timeout_s`` passes (an empty answer while the broker is still settling is not the end)."""
    received: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while not received and time.monotonic() < deadline:
        received = consumer.receive(max_messages, wait_s)
    return received


def start_lite_simple_consumer(consumer: Any, timeout_s: float = 10.0) -> None:
    """Start an official-client LiteSimpleConsumer and wait for the broker's settings: it does not wait for
    them at startup itself, and its subscription quota is 0 until they arrive (every subscribe refused)."""
    consumer.startup()
    deadline = time.monotonic() + timeout_s
    while consumer.__dict__.get("_LiteSimpleConsumer__subscription_manager").lite_subscription_quota == 0:
        if time.monotonic() > deadline:
            raise TimeoutError("no settings from the broker")
        time.sleep(0.05)


class Inbox:
    """Records messages consumed by an official-client push consumer (pass it as the listener).

    ``accept(message) -> bool`` decides the consume result (default: always SUCCESS); every call is
    recorded in ``seen`` (failures included), accepted ones in ``accepted``.
    """

    def __init__(self, accept: Callable[[Any], bool] | None = None) -> None:
        self._accept = accept or (lambda _message: True)
        self._changed = threading.Condition()
        self.seen: list[Any] = []
        self.accepted: list[Any] = []

    def consume(self, message: Any) -> Any:
        from rocketmq import ConsumeResult  # noqa: PLC0415 - only e2e interpreters load the official client

        ok = self._accept(message)
        with self._changed:
            self.seen.append(message)
            if ok:
                self.accepted.append(message)
            self._changed.notify_all()
        return ConsumeResult.SUCCESS if ok else ConsumeResult.FAILURE

    def wait_for(self, condition: Callable[[Inbox], bool], timeout: float = 20.0) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: condition(self), timeout)

    def bodies(self) -> list[bytes]:
        with self._changed:
            return [m.body for m in self.accepted]


# --- the official Python client, started against a broker process (e2e interpreters only) -----------------
def client_config(broker: BrokerProcess) -> Any:
    from rocketmq import ClientConfiguration, Credentials  # noqa: PLC0415 - only e2e interpreters load the client

    return ClientConfiguration(broker.endpoint, Credentials(), request_timeout=5)


def started_producer(broker: BrokerProcess, clients: list[Any], *topics: str) -> Any:
    """A started Producer, added to ``clients`` (which the test shuts down)."""
    from rocketmq import Producer  # noqa: PLC0415 - only e2e interpreters load the client

    p = Producer(client_config(broker), topics)
    p.startup()
    clients.append(p)
    return p


def started_lite_consumer(broker: BrokerProcess, clients: list[Any], group: str, topic: str, inbox: Inbox) -> Any:
    """A started LitePushConsumer of ``group`` on parent ``topic`` delivering to ``inbox``, added to ``clients``."""
    from rocketmq import LitePushConsumer  # noqa: PLC0415 - only e2e interpreters load the client

    c = LitePushConsumer(client_config(broker), group, topic, inbox)
    c.startup()
    clients.append(c)
    return c


def send_lite(producer: Any, topic: str, lite: str, body: bytes) -> Any:
    from rocketmq import Message  # noqa: PLC0415 - only e2e interpreters load the client

    m = Message()
    m.topic = topic
    m.lite_topic = lite
    m.body = body
    return producer.send(m)


def send_lite_after_restart(producer: Any, topic: str, lite: str, body: bytes, timeout: float = 20) -> Any:
    """``send_lite`` for the first sends after a broker restarted on the same port: the client's channel may
    still be in its reconnect backoff and fail fast with "failed to connect" (nothing reached the broker, so
    sending again cannot duplicate); any other error is raised at once."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return send_lite(producer, topic, lite, body)
        except Exception as e:  # the client wraps the grpc error in its own types
            chain: list[BaseException] = [e]
            while len(chain) < 8 and (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None:
                chain.append(nxt)
            if not any("failed to connect" in str(x) for x in chain):
                raise
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def holders(endpoints: Sequence[str], parent: str, keys: AdminKeys) -> dict[str, list[int]]:
    """lite topic of ``parent`` -> the brokers (indexes into ``endpoints``) whose store holds it, read over each
    one's admin service (``keys``: its admin pair, ``BrokerProcess.admin_keys`` or ``SHARED_ADMIN_KEYS``)."""
    from lmq_broker.admin.client import AdminClient  # noqa: PLC0415 - the admin client is not needed to start one

    out: dict[str, list[int]] = {}
    for i, endpoint in enumerate(endpoints):
        with AdminClient(endpoint, timeout_s=10, **keys) as admin:
            start = ""
            while True:
                page = admin.list_lite_topics(parent, start_after=start, limit=1000)
                for info in page.topics:
                    out.setdefault(info.meta.lite, []).append(i)
                if not page.next_start_after:
                    break
                start = page.next_start_after
    return out
