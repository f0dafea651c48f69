"""Admin calls open to users (``--acl``, issue 29): a broker process, ``lmq-admin`` signing as a user, and the
admin client. A user's policies' Create/Update/Delete/Get/List admit the matching calls on their resources;
user and acl management and the cluster-wide calls stay with the admin pair; a refusal is PERMISSION_DENIED,
counted by user and action, logged at INFO without a secret."""

from __future__ import annotations

import io
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmq_broker import errors, model
from lmq_broker.admin import cli
from lmq_broker.admin.client import AdminClient
from lmq_broker.admin.results import AclEntry
from lmq_broker.testing import BrokerProcess, start_broker

ALICE = ("alice", "alice-secret-1")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    process = start_broker(tmp_path_factory.mktemp("acl") / "data", extra_args=["--acl"])
    with AdminClient(process.admin_endpoint, timeout_s=10, **process.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic("chat", model.MessageType.LITE))
        admin.put_group(model.LiteGroup("b-group", "chat"))
        admin.put_user(*ALICE)
        admin.put_user("root", "root-secret-1", super_user=True)
        admin.put_acl(
            [
                AclEntry("alice", "Group:a-*", ("Create", "Delete", "Get", "List")),
                AclEntry("alice", "Topic:a-*", ("Create", "Update", "Get", "List")),
            ]
        )
    yield process
    assert process.stop() == 0, process.log()[-4000:]


def as_alice(broker: BrokerProcess, *args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    keys = ["--access-key", ALICE[0], "--secret-key", ALICE[1]]
    code = cli.main(["--endpoint", broker.admin_endpoint, *keys, "--output", "json", *args], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def refused(broker: BrokerProcess, user: str, action: str) -> float:
    with urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.search(rf'^lmq_acl_refused_total\{{action="{action}",user="{user}"\}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_user_administers_what_its_policies_allow_with_lmq_admin(broker: BrokerProcess) -> None:
    code, out, err = as_alice(broker, "group", "put", "a-team", "--bind-topic", "chat")
    assert code == 0, err
    assert json.loads(out)["created"] is True
    code, out, err = as_alice(broker, "group", "get", "a-team")
    assert code == 0, err
    code, out, err = as_alice(broker, "group", "list")
    assert code == 0, err
    listed: Any = json.loads(out)
    assert "a-team" in out and "b-group" not in out, listed  # a List answers only what she may List
    code, _, err = as_alice(broker, "group", "put", "b-spy", "--bind-topic", "chat")
    assert code == 1 and "user alice may not Get on Group:b-spy" in err  # lmq-admin reads the group first
    before = refused(broker, "alice", "Create")
    with (
        AdminClient(broker.admin_endpoint, timeout_s=10, access_key=ALICE[0], secret_key=ALICE[1]) as alice,
        pytest.raises(errors.Forbidden, match="user alice may not Create on Group:b-spy"),
    ):
        alice.put_group(model.LiteGroup("b-spy", "chat"))
    assert refused(broker, "alice", "Create") == before + 1
    code, _, err = as_alice(broker, "group", "put", "a-team", "--bind-topic", "chat", "--client-quota", "5")
    assert code == 1 and "may not Update on Group:a-team" in err  # it exists: a change needs Update
    code, _, err = as_alice(broker, "group", "delete", "b-group")
    assert code == 1 and "may not Delete on Group:b-group" in err
    code, out, err = as_alice(broker, "group", "delete", "a-team")
    assert code == 0 and json.loads(out) is True, err
    code, out, err = as_alice(broker, "parent-topic", "put", "a-parent")
    assert code == 0, err
    code, out, err = as_alice(broker, "parent-topic", "list")
    assert code == 0 and "a-parent" in out and '"chat"' not in out, out
    code, _, err = as_alice(broker, "parent-topic", "delete", "a-parent")
    assert code == 1 and "may not Delete on Topic:a-parent" in err
    assert "alice-secret-1" not in broker.log()
    assert re.search(r"refused admin PutLiteGroup: user alice may not Create on Group:b-spy", broker.log())


def test_user_and_cluster_wide_calls_stay_with_the_admin_pair(broker: BrokerProcess) -> None:
    before = refused(broker, "alice", "List")
    code, _, err = as_alice(broker, "user", "list")
    assert code == 1 and "user alice may not call ListUsers" in err
    assert refused(broker, "alice", "List") == before + 1
    code, _, err = as_alice(broker, "acl", "put", "alice", "*", "--actions", "Pub")
    assert code == 1 and "may not call PutAcl" in err
    with AdminClient(broker.admin_endpoint, timeout_s=10, access_key=ALICE[0], secret_key=ALICE[1]) as alice:
        with pytest.raises(errors.Forbidden, match="may not call GetCluster"):
            alice.cluster()
        with pytest.raises(errors.Forbidden, match="may not call ListQuotas"):
            alice.list_quotas()
    with AdminClient(broker.admin_endpoint, timeout_s=10, access_key="root", secret_key="root-secret-1") as root:
        assert [u.name for u in root.list_users()] == ["alice", "root"]  # a super user may do everything
    with (
        AdminClient(broker.admin_endpoint, timeout_s=10, access_key="alice", secret_key="wrong-secret") as wrong,
        pytest.raises(errors.Unauthorized),
    ):
        wrong.list_parent_topics()


def test_a_users_scan_and_backup_are_refused_permission_denied(broker: BrokerProcess, tmp_path: Path) -> None:
    """The streaming admin calls (a reclaim scan, a backup) stay with the admin pair too, and a user's is refused
    PERMISSION_DENIED with its reason: before 2026-11-30 the refusal's handler was a coroutine where a stream's
    must be a generator, and the native edge (the broker's default) ended such a call UNKNOWN, logging a stack
    trace."""
    with AdminClient(broker.admin_endpoint, timeout_s=10, access_key=ALICE[0], secret_key=ALICE[1]) as alice:
        with pytest.raises(errors.Forbidden, match="user alice may not call ScanLiteTopics"):
            list(alice.scan_lite_topics_columns("chat"))
        with pytest.raises(errors.Forbidden, match="user alice may not call Backup"):
            alice.backup(tmp_path / "snap")
    code, _, err = as_alice(broker, "backup", str(tmp_path / "cli-snap"))
    assert code == 1 and "may not call Backup" in err and "Traceback" not in err
    assert "Traceback" not in broker.log()
