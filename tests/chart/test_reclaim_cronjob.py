"""The reclaim CronJob's policy, audit and credentials values, and the sizing rules a Spark pod needs.

Defaults render no policy flags (the job's own defaults apply); each value, once set, becomes exactly the
job's flag, and every rendered object still validates against the Kubernetes schema.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from lmq_reclaim import options

Manifest = dict[str, Any]
Render = Callable[..., list[Manifest]]
One = Callable[..., Manifest]
CRONJOB = "demo-lmq-reclaim"
CHART_ARGS = 16  # broker discovery, Spark master, driver memory, class archive, local dir: see test_objects.py


def reclaim_container(cronjob: Manifest) -> Manifest:
    containers = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["reclaim"]
    container: Manifest = containers[0]
    return container


def policy_args(render: Render, one: One, reclaim: dict[str, Any]) -> list[str]:
    cronjob = one(render({"reclaim": {"enabled": True, **reclaim}}), "CronJob", CRONJOB)
    args: list[str] = reclaim_container(cronjob)["args"]
    return args[CHART_ARGS:]


def test_defaults_leave_the_policy_to_the_job(render: Render, one: One) -> None:
    assert policy_args(render, one, {}) == []


def test_each_policy_value_becomes_the_jobs_flag(render: Render, one: One) -> None:
    args = policy_args(
        render,
        one,
        {
            "minAgeMinutes": 30,
            "onlyFullyConsumed": True,
            "noLiveSubscribers": True,
            "dryRun": True,
            "maxDeletesPerSecond": 500,
            "extraArgs": ["--rows-per-task", "100000"],
        },
    )
    assert args == [
        "--min-age-minutes", "30", "--only-fully-consumed", "--no-live-subscribers", "--dry-run",
        "--max-deletes-per-second", "500", "--rows-per-task", "100000",
    ]  # fmt: skip
    # The rendered command line is one the job accepts, and means what the values say.
    full = reclaim_container(
        one(render({"reclaim": {"enabled": True, "minAgeMinutes": 30, "dryRun": True}}), "CronJob", CRONJOB)
    )["args"]
    parsed = options.parse(full)
    assert (parsed.broker_service, parsed.namespace, parsed.min_age_minutes, parsed.dry_run) == (
        "demo-lmq-broker-headless",
        "mq",
        30,
        True,
    )
    assert parsed.local_dir is not None and str(parsed.local_dir) == "/tmp/spark"


def test_zero_is_a_value_not_an_absence(render: Render, one: One) -> None:
    assert policy_args(render, one, {"minAgeMinutes": 0, "maxDeletesPerSecond": 0}) == [
        "--min-age-minutes", "0", "--max-deletes-per-second", "0",
    ]  # fmt: skip


def test_audit_goes_to_the_claim_one_directory_per_run(render: Render, one: One, kube_version: str) -> None:
    objects = render({"reclaim": {"enabled": True, "audit": {"existingClaim": "reclaim-audit", "format": "jsonl"}}})
    cronjob = one(objects, "CronJob", CRONJOB)
    container = reclaim_container(cronjob)
    assert container["args"][CHART_ARGS:] == ["--audit-path", "/audit/reclaim-{now}", "--audit-format", "jsonl"]
    assert {m["mountPath"]: m["name"] for m in container["volumeMounts"]} == {"/tmp": "scratch", "/audit": "audit"}
    volumes = {v["name"]: v for v in cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["audit"] == {"name": "audit", "persistentVolumeClaim": {"claimName": "reclaim-audit"}}
    assert kubernetes_validate.validate(cronjob, kube_version, strict=True)


def test_credentials_come_from_a_secret(render: Render, one: One, kube_version: str) -> None:
    cronjob = one(render({"reclaim": {"enabled": True, "credentialsSecret": "lmq-keys"}}), "CronJob", CRONJOB)
    env = {e["name"]: e for e in reclaim_container(cronjob)["env"]}
    assert env["LMQ_RECLAIM_ACCESS_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "lmq-keys", "key": "accessKey"}}
    assert env["LMQ_RECLAIM_SECRET_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "lmq-keys", "key": "secretKey"}}
    assert not any("secret" in a.lower() for a in reclaim_container(cronjob)["args"])
    assert kubernetes_validate.validate(cronjob, kube_version, strict=True)


def test_the_cronjob_is_safe_to_fire_twice_and_bounded(render: Render, one: One) -> None:
    spec = one(render({"reclaim": {"enabled": True}}), "CronJob", CRONJOB)["spec"]
    assert spec["concurrencyPolicy"] == "Forbid"
    job = spec["jobTemplate"]["spec"]
    assert job["activeDeadlineSeconds"] > 0 and job["ttlSecondsAfterFinished"] > 0
    assert job["template"]["spec"]["restartPolicy"] == "Never"
    scratch = next(v for v in job["template"]["spec"]["volumes"] if v["name"] == "scratch")
    assert "emptyDir" in scratch


def bytes_of(quantity: str) -> int:
    """Kubernetes quantities (2Gi, 512Mi, 3G) and JVM sizes (1g, 1536m)."""
    match = re.fullmatch(r"(\d+)([kKmMgGtT]i?)?", quantity)
    assert match, quantity
    number, unit = int(match[1]), (match[2] or "")
    powers = {"k": 1, "m": 2, "g": 3, "t": 4}
    if not unit:
        return number
    base = 1024 if unit.endswith("i") or unit.islower() else 1000
    return int(number * base ** powers[unit[0].lower()])


def test_memory_limit_covers_driver_memory_and_overhead(chart: helm.Chart) -> None:
    reclaim = chart.values["reclaim"]
    driver = bytes_of(reclaim["driverMemory"])
    limit = bytes_of(reclaim["resources"]["limits"]["memory"])
    # JVM overhead (Spark's rule: max(384 MiB, 10% of the heap)) plus Python workers (Arrow batches).
    overhead = max(384 * 2**20, driver // 10) + 512 * 2**20
    assert limit >= driver + overhead


@pytest.mark.parametrize(
    ("reclaim", "where"),
    [
        ({"minAgeMinutes": -1}, "minAgeMinutes"),
        ({"minAgeMinutes": "15"}, "minAgeMinutes"),
        ({"maxDeletesPerSecond": -5}, "maxDeletesPerSecond"),
        ({"audit": {"format": "csv"}}, "format"),
        ({"audit": {"existingClaim": "x", "path": "/y"}}, "path"),
        ({"dryRun": "yes"}, "dryRun"),
    ],
)
def test_bad_reclaim_values_are_refused(chart: helm.Chart, reclaim: dict[str, Any], where: str) -> None:
    values = {**chart.values, "reclaim": {**chart.values["reclaim"], **reclaim}}
    with pytest.raises(helm.HelmValuesError, match=where):
        chart.validate_schema(values)
