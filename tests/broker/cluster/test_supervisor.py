"""``serve --processes``: a process that dies is logged with its cause (exit code or signal, and its last lines
on stderr; a fatal signal first dumps its threads' stacks) and, once started again, says its ports again, on the
metrics port it had (real processes)."""

from __future__ import annotations

import io
import os
import re
import signal
import sys
import urllib.request
from pathlib import Path

import pytest
from pods import PROCESS_RE, child_pid, start_pod
from waiting import eventually

from lmq_broker import supervisor
from lmq_broker.supervisor import Child
from lmq_broker.testing import SHARED_ADMIN_ENV


def ended_child(code: str) -> str:
    """What the supervisor says of a real process running ``code`` once it has ended."""
    child = Child(0, [sys.executable, "-c", code], dict(os.environ))
    child.start()
    assert child.process is not None
    return child.ended(child.process.wait(30))


def test_an_exit_is_said_with_its_code_and_the_last_lines_on_stderr() -> None:
    code = "import sys\nfor i in range(30): print(f'line {i}', file=sys.stderr)\nraise SystemExit('boom: the cause')"
    said = ended_child(code)
    assert said.startswith("exit code 1; its last lines on stderr:"), said
    assert "  | boom: the cause" in said
    assert "line 29" in said and "line 9\n" not in said  # the last 20 lines only


def test_a_death_by_signal_is_said_with_the_signal_name() -> None:
    assert ended_child("import os\nos.abort()").startswith("signal SIGABRT"), ended_child("import os\nos.abort()")
    assert ended_child("pass") == "exit code 0; it wrote nothing on stderr"


def test_a_crashed_process_is_logged_and_started_again_on_its_ports(tmp_path: Path) -> None:
    pod = start_pod(tmp_path / "pod", "SUP_NS", [], SHARED_ADMIN_ENV)
    try:
        victim = child_pid(pod.broker, 1)
        assert victim is not None
        os.kill(victim, signal.SIGABRT)  # as a failed check in grpc's core ends it
        said = eventually(
            lambda: re.search(r"broker process 1 ended: (.*)", pod.broker.log()), "the death logged", timeout_s=30
        )
        assert said is not None
        assert said[1] == "signal SIGABRT; its last lines on stderr:", said[0]
        assert "Fatal Python error: Aborted" in pod.broker.log()  # the fault handler's dump of its stacks
        lines = eventually(
            lambda: [m for m in PROCESS_RE.finditer(pod.broker.log()) if m[1] == "1"][1:], "its ready line again", 60
        )
        assert (lines[0][2], int(lines[0][3])) == (pod.endpoints[1], pod.metrics[1])  # the same ports as before
        restarted = child_pid(pod.broker, 1)
        assert restarted not in (None, victim)
        with urllib.request.urlopen(f"http://127.0.0.1:{pod.metrics[1]}/metrics", timeout=5) as answer:
            assert answer.status == 200
    finally:
        pod.broker.stop()


def test_a_child_is_not_stalled_when_the_pod_output_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pod's stderr closed (its reader gone): the child's lines are still read and dropped, so the child
    goes on past a full pipe (64 KiB) instead of blocking on its next log line."""
    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stderr", closed)
    code = "import sys\nfor i in range(20_000): print('x' * 100, file=sys.stderr)"
    child = Child(0, [sys.executable, "-c", code], dict(os.environ))
    child.start()
    assert child.process is not None
    assert child.process.wait(60) == 0
    assert child.ended(0).startswith("exit code 0; its last lines on stderr:\n  | xxx")


class Writes(io.StringIO):
    """stdout whose every write is kept apart: a line written in two writes can have another writer's line
    between them on a shared pipe."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, s: str) -> int:
        self.calls.append(s)
        return super().write(s)


def test_the_ready_lines_are_written_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted process's line and the pod's own lines go out in one write each, newline included: the bench
    read ``metrics=40103`` followed by a child's log line (``2026-11-30 ...``) as port 401032026."""
    out = Writes()
    monkeypatch.setattr(sys, "stdout", out)
    child = Child(1, [], {})
    child.starts = 2  # started again: its line is printed at once
    ready = "lmq-broker ready grpc=127.0.0.1:5 metrics=40103 admin=0\nother output\n"
    child._read_stdout(io.StringIO(ready))
    supervisor.say("lmq-broker ready grpc=127.0.0.1:4 metrics=40103")
    assert out.calls == [
        "lmq-broker process 1 grpc=127.0.0.1:5 metrics=40103\n",
        "other output\n",
        "lmq-broker ready grpc=127.0.0.1:4 metrics=40103\n",
    ]
