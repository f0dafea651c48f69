"""The test apiserver harness itself: a stalled kube-apiserver start is retried once on a fresh process.

CI once saw a kube-apiserver accept connections but never finish a TLS handshake, and then outlive SIGTERM;
the whole operator suite errored at setup. These replay that with a stand-in apiserver.
"""

from __future__ import annotations

import logging
import stat
import sys
from pathlib import Path

import pytest

from lmq_operator import testing

# Prints a line, listens on --secure-port, accepts and never answers: a stalled apiserver.
STALLED = """
import signal, socket, sys, time
if "--ignore-sigterm" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("stand-in apiserver: stalled on purpose", flush=True)
port = int(next(a for a in sys.argv if a.startswith("--secure-port=")).split("=", 1)[1])
server = socket.create_server(("127.0.0.1", port))
held = []
while True:
    held.append(server.accept()[0])
"""


def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, stalls: int, ignore_sigterm: bool) -> None:
    """Point the harness at a bin dir whose kube-apiserver stalls on its first ``stalls`` starts and is the
    real one afterwards; etcd is the real one."""
    try:
        real_etcd, real_apiserver = testing.binaries()
    except testing.TestenvMissing as missing:
        pytest.fail(str(missing), pytrace=False)
    root = tmp_path / "testenv"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "etcd").symlink_to(real_etcd)
    (tmp_path / "stalled.py").write_text(STALLED)
    starts, flag = tmp_path / "starts", "--ignore-sigterm" if ignore_sigterm else ""
    wrapper = root / "bin" / "kube-apiserver"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'echo start >> "{starts}"\n'
        f'if [ "$(wc -l < "{starts}")" -le {stalls} ]; then\n'
        f'  exec "{sys.executable}" "{tmp_path / "stalled.py"}" "$@" {flag}\n'
        "fi\n"
        f'exec "{real_apiserver}" "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("LMQ_TESTENV_DIR", str(root))


def test_a_stalled_apiserver_start_is_retried_on_a_fresh_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stand_in(tmp_path, monkeypatch, stalls=1, ignore_sigterm=True)
    caplog.set_level(logging.WARNING, logger=testing.__name__)
    with testing.testenv(tmp_path / "env", start_timeout_s=10.0) as api:
        assert api.exists("/api/v1/namespaces/default")
    assert (tmp_path / "starts").read_text().count("start") == 2
    assert "stalled on purpose" in (tmp_path / "env" / "kube-apiserver-1.log").read_text()
    assert "stalled on purpose" not in (tmp_path / "env" / "kube-apiserver-2.log").read_text()
    messages = [r.getMessage() for r in caplog.records]
    retries = [m for m in messages if "retrying" in m]
    assert len(retries) == 1 and "start 1 of 2 failed" in retries[0] and "stalled on purpose" in retries[0]
    # The stand-in ignored SIGTERM and went down to SIGKILL.
    assert not any("still running" in m for m in messages)


def test_a_second_stalled_start_fails_with_its_state_and_log_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in(tmp_path, monkeypatch, stalls=2, ignore_sigterm=False)
    state = r"process \d+: state [RS], [\d.]+ s CPU; load average [\d. ]+; MemAvailable: \d+ kB"
    tail = r"kube-apiserver log tail:\n.*stalled on purpose"
    failed = pytest.raises(TimeoutError, match=rf"kube-apiserver /readyz.*\n{state}\n{tail}")
    with failed, testing.testenv(tmp_path / "env", start_timeout_s=3.0):
        pytest.fail("a testenv whose apiserver never answered was handed out")
    assert (tmp_path / "starts").read_text().count("start") == 2
