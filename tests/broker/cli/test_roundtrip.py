"""The chart's ``helm test`` program against a real broker as the chart runs it: admin on its own port, TLS, no
bootstrap objects. It must prove a message goes in and comes out, and leave nothing behind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lmq_broker import roundtrip
from lmq_broker.admin import tls
from lmq_broker.admin.client import AdminClient
from lmq_broker.testing import SHARED_ADMIN_ENV, SHARED_ADMIN_KEYS, BrokerProcess, issue_certificate, start_broker

NAME = "demo-lmq-broker.mq.svc"


@pytest.fixture
def broker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[BrokerProcess]:
    cert = issue_certificate(tmp_path / "tls", NAME)
    args = ["--no-bootstrap", "--admin-port", "0", "--tls-cert", str(cert.cert), "--tls-key", str(cert.key)]
    process = start_broker(tmp_path / "data", extra_args=args, env=SHARED_ADMIN_ENV)
    for name, value in {**SHARED_ADMIN_ENV, tls.CA_ENV: str(cert.ca), tls.SERVER_NAME_ENV: NAME}.items():
        monkeypatch.setenv(name, value)
    yield process
    process.stop()


def test_one_message_goes_round_and_the_topic_is_gone(
    broker: BrokerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    assert roundtrip.main(["--endpoint", broker.endpoint, "--admin-endpoint", broker.admin_endpoint]) == 0
    out = capsys.readouterr().out
    assert "one message sent" in out and "received back" in out, out
    with AdminClient(broker.admin_endpoint, 5.0, tls=tls.client_tls(), **SHARED_ADMIN_KEYS) as admin:
        assert admin.list_parent_topics() == []  # nothing left, and nothing was there before (--no-bootstrap)


def test_a_failed_step_fails_the_test_with_its_reason(
    broker: BrokerProcess, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LMQ_ADMIN_SECRET_KEY", "not-the-secret")
    assert roundtrip.main(["--endpoint", broker.endpoint, "--admin-endpoint", broker.admin_endpoint]) == 1
    assert "Unauthorized: unauthorized: signature does not match" in capsys.readouterr().err
    monkeypatch.setenv("LMQ_ADMIN_SECRET_KEY", SHARED_ADMIN_ENV["LMQ_ADMIN_SECRET_KEY"])
    # the admin service is not on the client port: declaring the topic fails there, nothing is sent
    assert (
        roundtrip.main(
            ["--endpoint", broker.endpoint],
        )
        == 1
    )
    err = capsys.readouterr().err
    assert f"admin service is not served on this port: it is on port {broker.admin_port}" in err, err
