"""The chart's commands, arguments and environment against the programs they start.

Each component reads what the chart gives it with its own parser (no copy of their rules here), and a
real broker started with the chart's arguments answers the chart's probes, then stops on SIGTERM within
the chart's grace period.
"""

from __future__ import annotations

import asyncio
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from lmq_broker import __main__ as broker_cli
from lmq_broker import roundtrip
from lmq_broker import testing as broker_testing
from lmq_broker.admin import tls
from lmq_broker.admin.credentials import KeyPair
from lmq_operator import grpcadmin
from lmq_operator import model as operator_model
from lmq_operator import settings as operator_settings
from lmq_reclaim import brokers as reclaim_brokers
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
    assert (config.port, config.admin_port, config.metrics_port) == (8081, 8082, 9100)
    assert config.bootstrap is False  # no demo objects in production
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
        assert (conf.admin_port, conf.metrics_port) == (8082, 9101)  # the brokers' --admin-port
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
    assert parsed.broker_port == 8082  # the brokers' --admin-port
    assert parsed.master == "local[2]"
    assert parsed.driver_memory == "1g"
    assert str(parsed.local_dir).startswith("/tmp/")  # inside the scratch emptyDir
    assert parsed.dry_run is True
    assert parsed.broker_processes == 1


def test_the_reclaim_job_reaches_every_process_of_a_pod(render: Render, one: One) -> None:
    objects = render({"reclaim": {"enabled": True}, "broker": {"processes": 3}})
    parsed = reclaim_options.parse(container(one(objects, "CronJob"))["args"])
    (broker,) = one(objects, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    admin_ports = {p["containerPort"] for p in broker["ports"] if p["name"] == "admin" or p["name"].startswith("proc-")}
    # the job's endpoints per pod are the processes' admin ports (port + i)
    assert {parsed.broker_port + i for i in range(parsed.broker_processes)} == admin_ports == {8082, 8083, 8084}


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        error.close()
        return error.code


def test_a_broker_started_like_the_chart_answers_its_probes(render: Render, one: One, tmp_path: Path) -> None:
    # R=1: a ring of one pod here (the flags at R=2 start brokers in tests/broker/replication)
    statefulset = one(render({"broker": {"replication": {"replicas": 1}}}), "StatefulSet")
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


def mounted_secret(spec: dict[str, Any], c: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret, key) that the kubelet would put at ``path`` in container ``c`` of pod ``spec``."""
    directory, _, name = path.rpartition("/")
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == directory]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    (item,) = [i for i in volume["secret"]["items"] if i["path"] == name]
    return volume["secret"]["secretName"], item["key"]


def test_a_tls_broker_started_like_the_chart_serves_the_charts_callers(
    render: Render, one: One, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tls.enabled end to end with real programs: the broker with the chart's TLS arguments and admin port,
    then the helm test, the operator and the reclaim job with the chart's TLS settings, each file found where the
    chart mounts it (the Secret's keys stand in for the kubelet's files)."""
    values = {"tls": {"enabled": True, "existingSecret": "mq-tls"}, "reclaim": {"enabled": True}}
    objects = render({**values, "broker": {"replication": {"replicas": 1}}})
    server_name = "demo-lmq-broker.mq.svc"  # tls.serverName's default: the client Service
    issued = broker_testing.issue_certificate(tmp_path / "tls", server_name, f"*.{HEADLESS}.mq.svc")
    secret = {"tls.crt": issued.cert, "tls.key": issued.key, "ca.crt": issued.ca}  # what mq-tls holds

    def local_file(spec: dict[str, Any], c: dict[str, Any], path: str) -> str:
        name, key = mounted_secret(spec, c, path)
        assert name == "mq-tls"
        return str(secret[key])

    statefulset = one(objects, "StatefulSet")
    sts_spec, broker = statefulset["spec"]["template"]["spec"], container(statefulset)
    flags = kubelet_expand(broker["args"], {**literal_env(broker), "POD_NAME": POD})[1:]
    local = {"--data-dir": str(tmp_path / "data"), "--port": "0", "--admin-port": "0", "--metrics-port": "0"}
    for flag in ("--tls-cert", "--tls-key"):
        local[flag] = local_file(sts_spec, broker, flags[flags.index(flag) + 1])
    for flag, value in local.items():
        flags[flags.index(flag) + 1] = value
    process = broker_testing.start_broker(tmp_path / "data", extra_args=flags, env=broker_testing.SHARED_ADMIN_ENV)
    for name, value in broker_testing.SHARED_ADMIN_ENV.items():
        monkeypatch.setenv(name, value)
    try:
        # The helm test pod, against broker 0 (here: this process) through both ports.
        (test_pod,) = [o for o in objects if o["kind"] == "Pod"]
        pod_spec, roundtrip_container = test_pod["spec"], test_pod["spec"]["containers"][0]
        pod_env = literal_env(roundtrip_container)
        assert pod_env[tls.SERVER_NAME_ENV] == server_name
        monkeypatch.setenv(tls.CA_ENV, local_file(pod_spec, roundtrip_container, pod_env[tls.CA_ENV]))
        monkeypatch.setenv(tls.SERVER_NAME_ENV, pod_env[tls.SERVER_NAME_ENV])
        args = roundtrip_container["args"]
        assert args[1].endswith(":8081") and args[3].endswith(":8082")
        args = [args[0], process.endpoint, args[2], process.admin_endpoint]
        assert roundtrip_container["command"][2] == "lmq_broker.roundtrip"
        assert roundtrip.main(args) == 0

        # The operator, with the chart's environment.
        deployment = one(objects, "Deployment")
        operator = container(deployment)
        env = literal_env(operator)
        env[tls.CA_ENV] = local_file(deployment["spec"]["template"]["spec"], operator, env[tls.CA_ENV])
        env["LMQ_OPERATOR_BROKERS"] = process.admin_endpoint
        env["LMQ_OPERATOR_ACCESS_KEY"], env["LMQ_OPERATOR_SECRET_KEY"] = broker_testing.SHARED_ADMIN_ENV.values()
        conf = operator_settings.from_env(env)

        async def apply_topic() -> bool:
            admin = grpcadmin.GrpcAdmin(process.admin_endpoint, conf.admin_timeout_s, conf.admin_keys, tls=conf.tls)
            try:
                return await admin.put(operator_model.TopicConfig("chart-tls", 30, 100))
            finally:
                await admin.close()

        assert asyncio.run(apply_topic()) is True

        # The reclaim job, with the chart's arguments and environment.
        cronjob = one(objects, "CronJob")
        reclaim = container(cronjob)
        reclaim_env = literal_env(reclaim)
        pod = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        monkeypatch.setenv(tls.CA_ENV, local_file(pod, reclaim, reclaim_env[tls.CA_ENV]))
        monkeypatch.setenv(tls.SERVER_NAME_ENV, reclaim_env[tls.SERVER_NAME_ENV])
        opts = reclaim_options.parse(reclaim["args"])
        keys = KeyPair(*broker_testing.SHARED_ADMIN_ENV.values())
        with reclaim_brokers.ArrowAdmin(process.admin_endpoint, 10.0, keys, opts.tls) as admin:
            assert "chart-tls" in [p.topic.name for p in admin.parents()]
    finally:
        process.stop()
        if process.process.stdout is not None:
            process.process.stdout.close()
