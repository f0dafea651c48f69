"""The backup CronJob (``backup.enabled``): off by default; on, it runs ``lmq-admin backup`` for every broker pod
and process into the claim, signs with the admin Secret, keeps ``backup.keep`` runs, may reach the admin port
through the NetworkPolicy, and validates against the Kubernetes schema; without a claim install is refused."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

Manifest = dict[str, Any]
Render = Callable[..., list[Manifest]]
One = Callable[..., Manifest]
CRONJOB = "demo-lmq-backup"
ON = {"backup": {"enabled": True, "existingClaim": "lmq-backups"}}


def container(cronjob: Manifest) -> Manifest:
    [only] = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    return dict(only)


def test_off_by_default(render: Render) -> None:
    assert not [o for o in render() if o["kind"] == "CronJob" and o["metadata"]["name"] == CRONJOB]


def test_every_broker_pod_and_process_goes_to_the_claim(render: Render, one: One, kube_version: str) -> None:
    cronjob = one(render({**ON, "broker": {"processes": 2}}), "CronJob", CRONJOB)
    assert kubernetes_validate.validate(cronjob, kube_version, strict=True)
    assert cronjob["spec"]["concurrencyPolicy"] == "Forbid"
    c = container(cronjob)
    env = {e["name"]: e for e in c["env"]}
    assert env["STS"]["value"] == "demo-lmq-broker"
    assert env["DOMAIN"]["value"] == "demo-lmq-broker-headless.mq.svc.cluster.local"
    assert env["PROCESSES"]["value"] == "2" and env["KEEP"]["value"] == "7"
    assert env["LMQ_ADMIN_SECRET_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "secretKey"
    assert "lmq_broker.admin.cli" in c["args"][0] and ' backup "$run/$STS-$i-$p"' in c["args"][0]
    assert c["volumeMounts"] == [{"name": "backups", "mountPath": "/backup"}]
    spec = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert spec["volumes"] == [{"name": "backups", "persistentVolumeClaim": {"claimName": "lmq-backups"}}]
    assert spec["automountServiceAccountToken"] is False


def test_the_admin_port_admits_the_backup_pods(render: Render, one: One) -> None:
    policy = one(render(ON), "NetworkPolicy", "demo-lmq-broker")
    admin = next(rule for rule in policy["spec"]["ingress"] if rule["ports"][0]["port"] == 8082)
    components = [f["podSelector"]["matchLabels"].get("app.kubernetes.io/component") for f in admin["from"]]
    assert "backup" in components


def test_no_claim_is_refused(render: Render) -> None:
    with pytest.raises(helm.HelmValuesError, match="existingClaim"):
        render({"backup": {"enabled": True}})


def test_the_script_backs_up_each_pod_and_keeps_the_newest_runs(render: Render, one: One, tmp_path: Path) -> None:
    """The rendered shell script, run by a real sh with stand-ins for getent and python on PATH."""
    script = container(one(render({"backup": {**ON["backup"], "keep": 2}}), "CronJob", CRONJOB))["args"][0]
    root = tmp_path / "backup"
    for old in ("20200101T000000Z", "20200102T000000Z"):
        (root / old).mkdir(parents=True)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "getent").write_text('#!/bin/sh\ncase "$2" in demo-lmq-broker-[01].*) exit 0;; esac\nexit 2\n')
    (bin_ / "python").write_text('#!/bin/sh\necho "$@" >> "$CALLS"\neval "mkdir -p \\"\\${$#}\\""\n')
    for tool in ("getent", "python"):
        (bin_ / tool).chmod(0o755)
    env = {"PATH": f"{bin_}:/usr/bin:/bin", "STS": "demo-lmq-broker", "DOMAIN": "h.mq.svc.cluster.local"}
    env |= {"PROCESSES": "1", "KEEP": "2", "CALLS": str(tmp_path / "calls")}
    done = subprocess.run(
        ["sh", "-c", script.replace("/backup", str(root))], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [c.split()[2:4] for c in calls] == [
        ["--endpoint", "demo-lmq-broker-0.h.mq.svc.cluster.local:8082"],
        ["--endpoint", "demo-lmq-broker-1.h.mq.svc.cluster.local:8082"],
    ]
    kept = sorted(p.name for p in root.iterdir())
    assert len(kept) == 2 and kept[0] == "20200102T000000Z"  # the oldest run went; this run and the last stay
    assert sorted(p.name for p in (root / kept[1]).iterdir()) == ["demo-lmq-broker-0-0", "demo-lmq-broker-1-0"]
