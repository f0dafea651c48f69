"""Admin is never anonymous by default: the broker process generates its admin pair once, keeps it across
restarts, and ``lmq-admin`` finds it in the data directory; ``--admin-anonymous`` is the only way to open it."""

from __future__ import annotations

import io
import json
import secrets
import stat
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from lmq_broker import errors, model
from lmq_broker.admin import cli, credentials
from lmq_broker.admin.client import AdminClient
from lmq_broker.protocol import auth
from lmq_broker.testing import BrokerProcess, start_broker


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (cli.ACCESS_KEY_ENV, cli.SECRET_KEY_ENV, cli.DATA_DIR_ENV, "LMQ_ADMIN_ANONYMOUS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def broker(tmp_path: Path, clean_env: None) -> Iterator[BrokerProcess]:
    process = start_broker(tmp_path / "data", extra_args=["--no-bootstrap", "--flush-mode", "async"])
    yield process
    process.stop()
    if process.process.stdout is not None:
        process.process.stdout.close()


def test_an_anonymous_admin_call_is_refused_by_default(broker: BrokerProcess) -> None:
    with AdminClient(broker.admin_endpoint, 10.0) as anonymous, pytest.raises(errors.Unauthorized) as refused:
        anonymous.put_parent_topic(model.ParentTopic("orders"))
    assert refused.value.fields["code"] == "UNAUTHENTICATED"
    assert "missing authorization header" in refused.value.message
    assert "admin-credentials.json" in refused.value.message  # how to get credentials
    with AdminClient(broker.admin_endpoint, 10.0, **broker.admin_keys) as admin:
        assert admin.list_parent_topics() == []  # nothing was created by the refused call


def test_the_generated_pair_is_private_and_survives_restarts(broker: BrokerProcess) -> None:
    path = broker.data_dir / credentials.FILE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first = json.loads(path.read_text())
    assert first == broker.admin_keys
    assert [p.name for p in broker.data_dir.iterdir() if p.name.endswith(".tmp")] == []
    log = broker.log()
    assert str(path) in log and first["secret_key"] not in log  # the path is logged, never the secret

    again = broker.restart()
    try:
        assert json.loads(path.read_text()) == first
        assert again.admin_keys == first
        with AdminClient(again.admin_endpoint, 10.0, **again.admin_keys) as admin:
            assert admin.put_parent_topic(model.ParentTopic("orders")).created
        assert first["secret_key"] not in again.log()
    finally:
        again.stop()
        if again.process.stdout is not None:
            again.process.stdout.close()


def test_lmq_admin_reads_the_pair_from_the_data_dir(
    broker: BrokerProcess, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(cli.ENDPOINT_ENV, broker.admin_endpoint)
    out = io.StringIO()
    assert cli.main(["--data-dir", str(broker.data_dir), "parent-topic", "put", "orders"], out=out) == 0

    monkeypatch.setenv(cli.DATA_DIR_ENV, str(broker.data_dir))  # LMQ_DATA_DIR, as the broker reads it
    out = io.StringIO()
    assert cli.main(["-o", "json", "parent-topic", "list"], out=out) == 0
    assert [t["topic"]["name"] for t in json.loads(out.getvalue())] == ["orders"]

    monkeypatch.delenv(cli.DATA_DIR_ENV)
    monkeypatch.chdir(broker.data_dir.parent)  # `make run` in the repository root keeps ./data
    assert broker.data_dir.name == "data"
    assert cli.main(["parent-topic", "get", "orders"], out=io.StringIO()) == 0

    monkeypatch.chdir(tmp_path / "data")  # no ./data here: unsigned, refused, with a one-line hint
    err = io.StringIO()
    assert cli.main(["parent-topic", "list"], err=err) == cli.EXIT_FAILED
    lines = err.getvalue().splitlines()
    assert lines[0].startswith("error: Unauthorized: unauthorized: missing authorization header")
    assert len(lines) == 2 and lines[1].startswith("hint: sent unsigned (no data/admin-credentials.json)")


def test_admin_client_resolved_finds_the_pair_as_lmq_admin_does(broker: BrokerProcess) -> None:
    with AdminClient.resolved(broker.admin_endpoint, 10.0, data_dir=broker.data_dir) as admin:
        assert admin.list_parent_topics() == []


def test_explicit_keys_win_over_the_file(broker: BrokerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cli.ENDPOINT_ENV, broker.admin_endpoint)
    monkeypatch.setenv(cli.ACCESS_KEY_ENV, broker.admin_access_key)
    monkeypatch.setenv(cli.SECRET_KEY_ENV, "not-the-secret")
    err = io.StringIO()
    assert cli.main(["--data-dir", str(broker.data_dir), "parent-topic", "list"], err=err) == cli.EXIT_FAILED
    assert "signature does not match" in err.getvalue()
    assert f"hint: signed with access key {broker.admin_access_key}" in err.getvalue()
    assert cli.main(["--access-key", "only-half", "parent-topic", "list"], err=io.StringIO()) == cli.EXIT_USAGE


def test_a_skewed_signature_is_refused(broker: BrokerProcess) -> None:
    late = AdminClient(
        broker.admin_endpoint, 10.0, clock=lambda: auth.utc_now() - timedelta(hours=1), **broker.admin_keys
    )
    with late, pytest.raises(errors.Unauthorized, match="from the broker's UTC clock"):
        late.list_parent_topics()


def test_admin_anonymous_opens_admin_and_warns(tmp_path: Path, clean_env: None) -> None:
    with start_broker(tmp_path / "data", extra_args=["--no-bootstrap", "--admin-anonymous"]) as open_broker:
        assert open_broker.admin_keys == {"access_key": "", "secret_key": ""}
        with AdminClient(open_broker.admin_endpoint, 10.0) as anonymous:
            assert anonymous.put_parent_topic(model.ParentTopic("orders")).created
        assert "WARNING" in open_broker.log() and "--admin-anonymous" in open_broker.log()
    assert not (tmp_path / "data" / credentials.FILE_NAME).exists()
    if open_broker.process.stdout is not None:
        open_broker.process.stdout.close()


def test_a_configured_pair_is_used_and_nothing_is_generated(tmp_path: Path, clean_env: None) -> None:
    env = {"LMQ_ADMIN_ACCESS_KEY": "ops", "LMQ_ADMIN_SECRET_KEY": "ops-secret"}
    with start_broker(tmp_path / "data", extra_args=["--no-bootstrap"], env=env) as configured:
        with AdminClient(configured.admin_endpoint, 10.0, access_key="ops", secret_key="ops-secret") as admin:
            assert admin.list_parent_topics() == []
        assert "ops-secret" not in configured.log()
    assert not (tmp_path / "data" / credentials.FILE_NAME).exists()
    if configured.process.stdout is not None:
        configured.process.stdout.close()


# --- the file and the lookup order, as functions ---------------------------------------------------------------
def test_write_is_atomic_and_private(tmp_path: Path) -> None:
    path = tmp_path / "d" / credentials.FILE_NAME
    pair = credentials.generate()
    credentials.write(path, pair)
    assert credentials.read(path) == pair
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == [credentials.FILE_NAME]
    assert "secret" not in repr(pair).replace("secret_key", "") and pair.secret_key not in repr(pair)


def test_load_or_create_reuses_the_file(tmp_path: Path) -> None:
    made, created = credentials.load_or_create(tmp_path)
    again, created_again = credentials.load_or_create(tmp_path)
    assert (created, created_again) == (True, False)
    assert again == made


def test_a_damaged_file_is_an_error_not_a_new_pair(tmp_path: Path) -> None:
    credentials.path_in(tmp_path).write_text("{not json")
    with pytest.raises(errors.InvalidArgument, match="cannot read admin credentials"):
        credentials.load_or_create(tmp_path)


def test_resolve_order_flags_then_env_then_file(tmp_path: Path) -> None:
    on_disk = credentials.generate()
    credentials.write(credentials.path_in(tmp_path), on_disk)
    env = {credentials.ACCESS_KEY_ENV: "env-ak", credentials.SECRET_KEY_ENV: "env-sk"}
    assert credentials.resolve("f-ak", "f-sk", tmp_path, env) == credentials.KeyPair("f-ak", "f-sk")
    assert credentials.resolve("", "", tmp_path, env) == credentials.KeyPair("env-ak", "env-sk")
    assert credentials.resolve("", "", tmp_path, {}) == on_disk
    assert credentials.resolve("", "", None, {credentials.DATA_DIR_ENV: str(tmp_path)}) == on_disk
    assert credentials.resolve("", "", tmp_path / "nowhere", {}) is None
    with pytest.raises(errors.InvalidArgument, match="go together"):
        credentials.resolve("f-ak", "", tmp_path, {})


def test_a_generated_secret_never_starts_with_a_dash(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--secret-key -Qv…`` is a missing value to argparse (seen: 1 secret in 64 broke a CLI call), so a secret
    that starts with '-' is drawn again."""
    drawn = iter(["-QvN13n4X0SCZ6rJ25", "_ok-secret"])
    monkeypatch.setattr(secrets, "token_urlsafe", lambda nbytes: next(drawn))
    assert credentials.new_secret() == "_ok-secret"
