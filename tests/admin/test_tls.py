"""Every caller of the admin service over TLS, against one real TLS broker serving admin on its own port, as the
chart runs it: ``lmq-admin``, the operator's ``GrpcAdmin`` and the reclaim job's ``BrokerAdmin``, each from the
settings the chart gives it (``LMQ_TLS_CA``, ``LMQ_TLS_SERVER_NAME``). The callers dial an address the
certificate does not name (127.0.0.1, as pod IPs in a cluster) and check it against the server name instead."""

from __future__ import annotations

import asyncio
import io
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmq_broker import errors, model
from lmq_broker.admin import cli, credentials, tls
from lmq_broker.admin.client import AdminClient
from lmq_broker.testing import SHARED_ADMIN_ENV, BrokerProcess, Certificate, issue_certificate, start_broker
from lmq_operator import grpcadmin, settings
from lmq_operator import model as operator_model
from lmq_reclaim import brokers, options

SERVER_NAME = "demo-lmq-broker.mq.svc"  # what the chart's certificate carries and its callers expect


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> Certificate:
    return issue_certificate(tmp_path_factory.mktemp("tls"), SERVER_NAME, "*.demo-lmq-broker-headless.mq.svc")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory, certificate: Certificate) -> Iterator[BrokerProcess]:
    args = [
        "--no-bootstrap",
        "--admin-port",
        "0",
        "--tls-cert",
        str(certificate.cert),
        "--tls-key",
        str(certificate.key),
    ]
    process = start_broker(tmp_path_factory.mktemp("broker") / "data", extra_args=args, env=SHARED_ADMIN_ENV)
    assert process.admin_endpoint != process.endpoint
    yield process
    process.stop()


@pytest.fixture
def tls_env(monkeypatch: pytest.MonkeyPatch, certificate: Certificate, broker: BrokerProcess) -> None:
    monkeypatch.setenv(tls.CA_ENV, str(certificate.ca))
    monkeypatch.setenv(tls.SERVER_NAME_ENV, SERVER_NAME)
    monkeypatch.setenv(cli.ENDPOINT_ENV, broker.admin_endpoint)
    for name, value in SHARED_ADMIN_ENV.items():
        monkeypatch.setenv(name, value)


def test_client_tls_takes_flags_then_the_environment(tmp_path: Path, certificate: Certificate) -> None:
    env = {tls.CA_ENV: str(certificate.ca), tls.SERVER_NAME_ENV: SERVER_NAME}
    assert tls.client_tls(environ={}) is None  # plaintext unless asked
    assert tls.client_tls(environ=env) == tls.ClientTls(certificate.ca, SERVER_NAME)
    other = tmp_path / "other-ca.crt"
    other.write_bytes(certificate.ca.read_bytes())
    assert tls.client_tls(other, "", environ=env) == tls.ClientTls(other, "")  # a flag wins, "" included
    assert tls.ClientTls(other, SERVER_NAME).options() == (("grpc.ssl_target_name_override", SERVER_NAME),)
    assert tls.ClientTls(other).options() == ()
    with pytest.raises(errors.InvalidArgument, match=tls.CA_ENV):
        tls.client_tls(environ={tls.SERVER_NAME_ENV: SERVER_NAME})
    with pytest.raises(errors.InvalidArgument, match="cannot read the TLS CA file"):
        tls.client_tls(tmp_path / "missing.crt", environ={})


def test_lmq_admin_over_tls(tls_env: None, certificate: Certificate, broker: BrokerProcess) -> None:
    out, err = io.StringIO(), io.StringIO()
    assert cli.main(["parent-topic", "put", "orders"], out, err) == cli.EXIT_OK, err.getvalue()
    assert cli.main(["-o", "json", "parent-topic", "list"], out, err) == cli.EXIT_OK
    assert '"name": "orders"' in out.getvalue()

    wrong_name = io.StringIO()
    assert cli.main(["--tls-server-name", "evil.example", "parent-topic", "list"], io.StringIO(), wrong_name) == 1
    assert "BrokerUnavailable" in wrong_name.getvalue()
    plaintext = AdminClient(broker.admin_endpoint, 5.0, access_key="x", secret_key="y")
    with plaintext, pytest.raises(errors.BrokerUnavailable):  # a TLS broker does not answer plaintext
        plaintext.list_parent_topics()
    unreadable = io.StringIO()
    assert cli.main(["--tls-ca", "/nonexistent/ca.crt", "parent-topic", "list"], io.StringIO(), unreadable) == 2
    assert "cannot read the TLS CA file" in unreadable.getvalue()


def test_the_operator_over_tls(tls_env: None, broker: BrokerProcess) -> None:
    env = {
        "LMQ_OPERATOR_BROKERS": broker.admin_endpoint,
        "LMQ_OPERATOR_ACCESS_KEY": SHARED_ADMIN_ENV["LMQ_ADMIN_ACCESS_KEY"],
        "LMQ_OPERATOR_SECRET_KEY": SHARED_ADMIN_ENV["LMQ_ADMIN_SECRET_KEY"],
        tls.CA_ENV: os.environ[tls.CA_ENV],
        tls.SERVER_NAME_ENV: SERVER_NAME,
    }
    conf = settings.from_env(env)
    assert conf.tls is not None and conf.tls.server_name == SERVER_NAME

    async def apply_one() -> bool:
        admin = grpcadmin.GrpcAdmin(broker.admin_endpoint, conf.admin_timeout_s, conf.admin_keys, tls=conf.tls)
        try:
            await admin.put(operator_model.TopicConfig("operator-tls", 30, 100))
            return (await admin.get(operator_model.Kind.PARENT_TOPIC, "operator-tls")) is not None
        finally:
            await admin.close()

    assert asyncio.run(apply_one())
    with pytest.raises(settings.SettingsError, match=tls.CA_ENV):
        settings.from_env({**env, tls.CA_ENV: ""})


def test_the_reclaim_job_over_tls(tls_env: None, broker: BrokerProcess) -> None:
    opts = options.parse(["--brokers", broker.admin_endpoint])  # CA and name from the environment
    assert opts.tls is not None and opts.tls.server_name == SERVER_NAME
    keys = credentials.KeyPair(SHARED_ADMIN_ENV["LMQ_ADMIN_ACCESS_KEY"], SHARED_ADMIN_ENV["LMQ_ADMIN_SECRET_KEY"])
    with AdminClient(
        broker.admin_endpoint, 5.0, access_key=keys.access_key, secret_key=keys.secret_key, tls=opts.tls
    ) as admin:
        admin.put_parent_topic(model.ParentTopic("reclaim-tls", expiration_minutes=30))
    with brokers.ArrowAdmin(broker.admin_endpoint, 5.0, keys, opts.tls) as admin:
        assert admin.broker_name() == "broker-0"
        assert "reclaim-tls" in [p.topic.name for p in admin.parents()]
    with brokers.ArrowAdmin(broker.admin_endpoint, 5.0, keys) as plaintext, pytest.raises(errors.BrokerUnavailable):
        plaintext.broker_name()
