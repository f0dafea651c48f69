"""Official RocketMQ clients of every language, steered as processes (the driver contract of tests/clients).

Each driver (``tests/clients/<lang>``) wraps one official client and speaks JSON lines: requests with an id
on stdin, one reply per request and events on stdout. ``start_driver`` starts one against an endpoint;
scenarios call ops and wait for events with deadlines. Used by the client-compatibility suite and by
benchmarks that want a non-Python client.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

LANGS: Final = ("python", "java", "go", "node")
CALL_TIMEOUT_S: Final = 60.0
_names = itertools.count()


class DriverMissing(RuntimeError):
    pass


class DriverError(RuntimeError):
    def __init__(self, op: str, reply: dict[str, Any]) -> None:
        super().__init__(f"{op}: {reply.get('error')} (code {reply.get('code')})")
        self.reply = reply
        self.code = reply.get("code")


@dataclass
class Driver:
    """A running driver process: requests by id, replies matched to them, events kept in arrival order."""

    lang: str
    process: subprocess.Popen[str]
    log_path: Path
    ids: Iterator[int] = field(default_factory=itertools.count)
    replies: dict[int, dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)
    reader: threading.Thread | None = None
    noise: list[str] = field(default_factory=list)

    def start_reading(self) -> None:
        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    self.noise.append(line)  # a client printed to stdout: reported by check_clean_stdout
                    continue
                with self.changed:
                    if "id" in obj:
                        self.replies[obj["id"]] = obj
                    else:
                        self.events.append(obj)
                    self.changed.notify_all()
            with self.changed:
                self.changed.notify_all()

        self.reader = threading.Thread(target=read, name=f"driver-{self.lang}", daemon=True)
        self.reader.start()

    def send(self, op: str, **args: Any) -> int:
        rid = next(self.ids)
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"id": rid, "op": op, **args}) + "\n")
        self.process.stdin.flush()
        return rid

    def reply(self, rid: int, op: str, timeout: float = CALL_TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self.changed:
            while rid not in self.replies:
                left = deadline - time.monotonic()
                if left <= 0 or self.process.poll() is not None:
                    state = "exited" if self.process.poll() is not None else "no reply"
                    raise AssertionError(f"{self.lang} driver: {op} {state} after {timeout:.0f} s; log:\n{self.tail()}")
                self.changed.wait(min(left, 0.5))
            return self.replies.pop(rid)

    def call(self, op: str, timeout: float = CALL_TIMEOUT_S, **args: Any) -> dict[str, Any]:
        """Run one op; raise DriverError when the client reported a failure."""
        reply = self.reply(self.send(op, **args), op, timeout)
        if not reply.get("ok"):
            raise DriverError(op, reply)
        return reply

    def wait_events(
        self, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float, what: str
    ) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not predicate(self.events):
                left = deadline - time.monotonic()
                assert left > 0, f"{self.lang}: {what} not seen within {timeout:.0f} s; log:\n{self.tail()}"
                self.changed.wait(min(left, 0.5))
            return list(self.events)

    def messages(self, consumer: str) -> list[dict[str, Any]]:
        with self.changed:
            return [e for e in self.events if e.get("event") == "message" and e.get("consumer") == consumer]

    def tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def close(self) -> int:
        if self.process.poll() is None:
            with contextlib.suppress(AssertionError, OSError):  # the driver may already be gone
                self.reply(self.send("exit"), "exit", timeout=30)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.reader is not None:
            self.reader.join(5)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()
        return self.process.returncode


def driver_argv(pointers: Path, lang: str) -> list[str]:
    """The start command ``scripts/clients-build.sh`` wrote for ``lang`` into ``pointers/<lang>.json``."""
    pointer = pointers / f"{lang}.json"
    if not pointer.exists():
        raise DriverMissing(f"no {lang} driver: {pointer} is missing; run `make clients` (scripts/clients-build.sh)")
    argv: list[str] = json.loads(pointer.read_text())
    return argv


def start_driver(argv: list[str], lang: str, endpoint: str, log_dir: Path) -> Driver:
    log_path = log_dir / f"driver-{lang}-{next(_names)}.log"
    with log_path.open("w") as log:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(
            [*argv, "--endpoint", endpoint],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            cwd=log_dir,
        )
    driver = Driver(lang, process, log_path)
    driver.start_reading()
    driver.wait_events(lambda events: any(e.get("event") == "ready" for e in events), 60, "driver ready")
    return driver


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)
