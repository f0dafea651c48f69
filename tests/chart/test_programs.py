"""The chart's commands, arguments and environment against the programs they start.

Each component reads what the chart gives it with its own parser (no copy of their rules here), and a
real broker started with the chart's arguments answers the chart's probes, then stops on SIGTERM within
the chart's grace period.
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from lmq_broker import __main__ as broker_cli
from lmq_broker import testing as broker_testing
from lmq_operator import settings as operator_settings
from lmq_reclaim import options as reclaim_options

Manifest = dict[str, Any]
Render = Callable[..., list[Manifest]]
One = Callable[..., Manifest]

POD = "demo-lmq-broker-0"
HEADLESS = "demo-lmq-broker-headless"
PROBE_DEADLINE_S = 60.0


def container(obj: Manifest) -> dict[str, Any]:
    if obj["kind"] == "CronJob":
        spec = obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    else:
        spec = obj["spec"]["template"]["spec"]
    found: dict[str, Any] = spec["containers"][0]
    return found


def kubelet_expand(words: list[str], env: dict[str, str]) -> list[str]:
    """What the kubelet does to command and args: $(VAR) becomes the container's variable."""
    expanded = []
    for word in words:
        result = word
        for name, value in env.items():
            result = result.replace(f"$({name})", value)
        expanded.append(result)
    return expanded


def literal_env(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def test_the_broker_reads_the_charts_arguments(render: Render, one: One) -> None:
    broker = container(one(render({"broker": {"extraArgs": ["--flush-mode", "async"]}}), "StatefulSet"))
    env = {**literal_env(broker), "POD_NAME": POD}
    args = broker_cli.build_parser().parse_args(kubelet_expand(broker["args"], env))
    config = broker_cli.config_from(args, env)
    assert (config.port, config.metrics_port) == (8081, 9100)
    assert str(config.store.data_dir) == "/data"
    assert config.broker_name == POD
    assert config.advertised_host == f"{POD}.{HEADLESS}.mq.svc.cluster.local"
    assert config.store.flush_mode.value == "async"


def test_the_operator_reads_the_charts_environment(render: Render, one: One) -> None:
    for values, namespace in (({}, None), ({"operator": {"watchNamespace": "apps"}}, "apps")):
        deployment = one(render(values), "Deployment")
        operator = container(deployment)
        conf = operator_settings.from_env(literal_env(operator))
        assert conf.namespace == namespace
        assert (conf.broker_service, conf.broker_namespace) == (HEADLESS, "mq")
        assert conf.broker_statefulset == "demo-lmq-broker"
        assert (conf.admin_port, conf.metrics_port) == (8081, 9101)
        # The liveness probe asks where kopf listens.
        assert conf.liveness_endpoint is not None
        liveness = urlsplit(conf.liveness_endpoint)
        probe = operator["livenessProbe"]["httpGet"]
        ports = {p["name"]: p["containerPort"] for p in operator["ports"]}
        assert (liveness.port, liveness.path) == (ports[probe["port"]], probe["path"])
        assert ports["metrics"] == conf.metrics_port


def test_the_reclaim_job_reads_the_charts_arguments(render: Render, one: One) -> None:
    reclaim = container(one(render({"reclaim": {"enabled": True, "extraArgs": ["--dry-run"]}}), "CronJob"))
    parsed = reclaim_options.parse(reclaim["args"])
    assert (parsed.broker_service, parsed.namespace, parsed.cluster_domain) == (HEADLESS, "mq", "cluster.local")
    assert parsed.broker_port == 8081
    assert parsed.master == "local[2]"
    assert parsed.driver_memory == "1g"
    assert str(parsed.local_dir).startswith("/tmp/")  # inside the scratch emptyDir
    assert parsed.dry_run is True


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        error.close()
        return error.code


def test_a_broker_started_like_the_chart_answers_its_probes(render: Render, one: One, tmp_path: Path) -> None:
    statefulset = one(render(), "StatefulSet")
    broker = container(statefulset)
    args = kubelet_expand(broker["args"], {**literal_env(broker), "POD_NAME": POD})
    assert args[0] == "serve"
    # The pod has its own network and volume; on a shared test machine, ports 0 and a temporary directory.
    local = {"--data-dir": str(tmp_path / "data"), "--port": "0", "--metrics-port": "0"}
    flags = args[1:]
    for flag, value in local.items():
        flags[flags.index(flag) + 1] = value

    process = broker_testing.start_broker(tmp_path / "data", extra_args=flags)
    try:
        probes = {kind: broker[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
        ports = {p["name"]: p["containerPort"] for p in broker["ports"]}
        assert {ports[probe["port"]] for probe in probes.values()} == {9100}  # the --metrics-port of the chart
        deadline = time.monotonic() + PROBE_DEADLINE_S
        pending = dict(probes)
        while pending:
            for kind, probe in list(pending.items()):
                if _status(process.metrics_url + probe["path"]) == 200:
                    del pending[kind]
            assert time.monotonic() < deadline, f"probes still failing: {pending}\n{process.log()[-2000:]}"
            time.sleep(0.05)
    finally:
        grace_s = float(statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"])
        started = time.monotonic()
        code = process.stop(timeout=grace_s)
        # start_broker leaves the output pipe to the garbage collector; close it (ResourceWarning is an error).
        if process.process.stdout is not None:
            process.process.stdout.close()
    assert code == 0, process.log()[-2000:]
    assert time.monotonic() - started < grace_s
    assert os.listdir(tmp_path / "data"), "the broker wrote nothing to its data directory"
