"""lmq-admin user … and acl …: tables and JSON, secrets never shown back, changes stored and applied."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from lmq_broker.admin import cli
from lmq_broker.admin.testing import Broker


def run(broker: Broker, *args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["--endpoint", broker.endpoint, *args], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def run_json(broker: Broker, *args: str) -> Any:
    code, out, err = run(broker, "--output", "json", *args)
    assert (code, err) == (0, ""), err
    return json.loads(out)


def test_user_put_get_list_delete_never_shows_a_secret(broker: Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMQ_USER_SECRET", "alice-secret-1")
    put = run_json(broker, "user", "put", "alice")
    assert put == {"name": "alice", "super_user": False, "enabled": True, "created": True, "secret": ""}
    generated = run_json(broker, "user", "put", "bob", "--generate-secret", "--super")
    assert generated["super_user"] is True and len(generated["secret"]) >= 24  # shown this once
    monkeypatch.delenv("LMQ_USER_SECRET")
    again = run_json(broker, "user", "put", "alice", "--no-enabled")  # flags only: the secret is kept
    assert (again["created"], again["enabled"]) == (False, False)
    code, out, _ = run(broker, "user", "list")
    assert code == 0
    assert [line.split() for line in out.splitlines()] == [
        ["NAME", "SUPER_USER", "ENABLED", "ACL_ENTRIES"],
        ["alice", "False", "False", "0"],
        ["bob", "True", "True", "0"],
    ]
    assert "alice-secret-1" not in out and generated["secret"] not in out
    assert run_json(broker, "user", "get", "alice")["enabled"] is False
    assert run_json(broker, "user", "delete", "bob") == {"deleted": True, "acl_entries_deleted": 0}
    code, _, err = run(broker, "user", "get", "bob")
    assert code == 1 and "user bob does not exist" in err
    code, _, err = run(broker, "user", "put", "carol")  # a new user needs a secret
    assert code == 1 and "secret" in err


def test_acl_put_get_list_delete(broker: Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMQ_USER_SECRET", "alice-secret-1")
    run_json(broker, "user", "put", "alice")
    put = run_json(
        broker,
        "acl",
        "put",
        "alice",
        "Lite:chat/a-*",
        "Group:a-group",
        "--actions",
        "Pub,Sub",
        "--sources",
        "10.0.0.0/8",
    )
    assert put["created"] == 2
    run_json(broker, "acl", "put", "alice", "Lite:chat/a-secret", "--actions", "Sub", "--decision", "Deny")
    code, out, _ = run(broker, "acl", "get", "alice")
    assert code == 0
    assert [line.split() for line in out.splitlines()] == [
        ["USER", "RESOURCE", "ACTIONS", "DECISION", "SOURCES"],
        ["alice", "Lite:chat/a-*", "Pub,Sub", "Allow", "10.0.0.0/8"],
        ["alice", "Group:a-group", "Pub,Sub", "Allow", "10.0.0.0/8"],
        ["alice", "Lite:chat/a-secret", "Sub", "Deny"],
    ]
    assert len(run_json(broker, "acl", "list")) == 3
    assert run_json(broker, "user", "get", "alice")["acl_entries"] == 3
    assert run_json(broker, "acl", "delete", "alice", "Lite:chat/a-secret") == 1
    code, _, err = run(broker, "acl", "put", "nobody", "Topic:x", "--actions", "Pub")
    assert code == 1 and "user nobody does not exist" in err
    code, _, err = run(broker, "acl", "put", "alice", "Queue:x", "--actions", "Pub")
    assert code == 1 and "must be Topic:<name>" in err
    assert run_json(broker, "user", "delete", "alice") == {"deleted": True, "acl_entries_deleted": 2}
    assert run_json(broker, "acl", "list") == []
