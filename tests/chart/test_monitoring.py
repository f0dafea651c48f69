"""The chart's monitoring: ServiceMonitor/PodMonitor toggles that select ports which really serve /metrics,
the operator's metrics Service, PrometheusRule alerts and the Grafana dashboard whose every query parses as
PromQL and names only metrics that a real broker, the operator or the kubelet export.

The Prometheus Operator's kinds are not in kubernetes-validate's schemas; they are checked against the
fields their CRDs define that the chart uses (conftest.MONITORING_SCHEMAS), strictly: an unknown field fails.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import prometheus_client
import promql_parser
import pytest

from lmq_broker import model
from lmq_broker import testing as broker_testing
from lmq_broker.admin.client import AdminClient
from lmq_broker.dispatch import testing as dispatch_testing
from lmq_operator import metrics as operator_metrics

Manifest = dict[str, Any]
Render = Callable[..., list[Manifest]]
One = Callable[..., Manifest]

ALL_ON: dict[str, Any] = {
    "monitoring": {
        "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "kps"}},
        "podMonitor": {"enabled": False, "interval": "20s", "labels": {"release": "kps"}},
        "prometheusRule": {
            "enabled": True,
            "labels": {"release": "kps"},
            "consumerLagThreshold": 500,
            "consumerLagFor": "30m",
            "deadLetterThreshold": 3,
            "diskFreeRatio": 0.2,
            "replicationLagThreshold": 700,
            "replicationFor": "2m",
        },
        "grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "Messaging"}},
    },
    "broker": {"replicas": 3, "replication": {"replicas": 2}},
}
# The same with PodMonitors instead of ServiceMonitors (the values schema refuses both at once).
PODS: dict[str, Any] = {
    **ALL_ON,
    "monitoring": {
        **ALL_ON["monitoring"],
        "serviceMonitor": {**ALL_ON["monitoring"]["serviceMonitor"], "enabled": False},
        "podMonitor": {**ALL_ON["monitoring"]["podMonitor"], "enabled": True},
    },
}
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
# Metrics the queries may use that lmq does not export: Prometheus's own and the kubelet's volume statistics.
EXTERNAL = {"up", "kubelet_volume_stats_available_bytes", "kubelet_volume_stats_capacity_bytes"}


def kinds(objects: list[Manifest]) -> set[str]:
    return {o["kind"] for o in objects}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (parsing it: a query that does not parse fails here)."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr!r}"
            found.add(node.name)
            return
        for attr in ("lhs", "rhs", "expr", "args", "param", "vector_selector"):
            child = getattr(node, attr, None)
            for item in child if isinstance(child, list) else [child]:
                if item is not None:
                    walk(item)

    walk(promql_parser.parse(expr))
    return found


def dashboard_query(expr: str) -> str:
    """A dashboard query as Grafana sends it: its variables replaced by values."""
    values = {"$__rate_interval": "1m", "$namespace": "mq", "$release": "demo-lmq", "${datasource}": "prom"}
    for name, value in values.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, expr
    return expr


def rules(objects: list[Manifest], one: One) -> dict[str, dict[str, Any]]:
    rule = one(objects, "PrometheusRule")
    return {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}


def dashboard(objects: list[Manifest], one: One) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(one(objects, "ConfigMap", "demo-lmq-dashboard")["data"]["lmq.json"])
    return found


def targets(board: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


# ---- rendering ----------------------------------------------------------------------------------------


def test_nothing_of_the_prometheus_operator_is_rendered_by_default(render: Render, one: One) -> None:
    objects = render()
    assert not kinds(objects) & MONITORING_KINDS
    # the only ConfigMap is the brokers' first membership (no dashboard)
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"] == ["demo-lmq-broker-peers"]
    service = one(objects, "Service", "demo-lmq-operator-metrics")  # the operator's metrics Service always is
    assert [(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [("metrics", 9101, "metrics")]
    without = render({"operator": {"enabled": False}})
    assert not [o for o in without if o["metadata"]["name"] == "demo-lmq-operator-metrics"]


def test_every_monitoring_object_has_the_fields_its_crd_defines(
    render: Render, monitoring_schemas: dict[str, dict[str, Any]]
) -> None:
    objects = [o for o in render(ALL_ON) if o["kind"] in MONITORING_KINDS]
    assert sorted(o["kind"] for o in objects) == ["PrometheusRule", "ServiceMonitor", "ServiceMonitor"]
    pods = [o for o in render(PODS) if o["kind"] in MONITORING_KINDS]
    assert sorted(o["kind"] for o in pods) == ["PodMonitor", "PodMonitor", "PrometheusRule"]
    objects += [o for o in pods if o["kind"] == "PodMonitor"]
    for obj in objects:
        jsonschema.validate(obj, monitoring_schemas[obj["kind"]])
        assert obj["metadata"]["namespace"] == "mq" and obj["metadata"]["labels"]["release"] == "kps"
    broken = dict(objects[0], spec={**objects[0]["spec"], "endpoint": []})  # guards the check: strict
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, monitoring_schemas[broken["kind"]])


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_service_monitors_scrape_exactly_the_services_that_serve_metrics(render: Render) -> None:
    objects = render(ALL_ON)
    services = [o for o in objects if o["kind"] == "Service"]
    for monitor in [o for o in objects if o["kind"] == "ServiceMonitor"]:
        (endpoint,) = monitor["spec"]["endpoints"]
        assert (endpoint["path"], endpoint["interval"]) == ("/metrics", "15s")
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["mq"]}
        scraped = [
            s["metadata"]["name"]
            for s in services
            if _selects(monitor["spec"]["selector"], s["metadata"]["labels"])
            and any(p["name"] == endpoint["port"] for p in s["spec"]["ports"])
        ]
        wanted = {"demo-lmq-broker": ["demo-lmq-broker-headless"], "demo-lmq-operator": ["demo-lmq-operator-metrics"]}
        assert scraped == wanted[monitor["metadata"]["name"]]
    ports = {s["metadata"]["name"]: {p["name"]: p["port"] for p in s["spec"]["ports"]} for s in services}
    assert ports["demo-lmq-broker-headless"]["metrics"] == 9100
    assert ports["demo-lmq-operator-metrics"]["metrics"] == 9101


def test_pod_monitors_scrape_the_containers_metrics_ports(render: Render) -> None:
    objects = render(PODS)
    workloads = {o["metadata"]["name"]: o for o in objects if o["kind"] in ("StatefulSet", "Deployment")}
    for monitor in [o for o in objects if o["kind"] == "PodMonitor"]:
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        assert endpoint["interval"] == "20s"
        (workload,) = [
            w
            for w in workloads.values()
            if _selects(monitor["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])
        ]
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert (
            named[endpoint["port"]]
            == {"demo-lmq-broker": 9100, "demo-lmq-operator": 9101}[workload["metadata"]["name"]]
        )
    for values in (ALL_ON, PODS):
        no_operator = render({**values, "operator": {"enabled": False}})
        monitors = [o["metadata"]["name"] for o in no_operator if o["kind"] in ("PodMonitor", "ServiceMonitor")]
        assert monitors == ["demo-lmq-broker"]


def test_service_and_pod_monitors_together_are_refused_before_rendering(render: Render) -> None:
    """Both would make Prometheus scrape every broker and the operator twice (doubled rates and sums)."""
    both = {**ALL_ON, "monitoring": {**ALL_ON["monitoring"], "podMonitor": PODS["monitoring"]["podMonitor"]}}
    with pytest.raises(helm.HelmValuesError) as refused:
        render(both)
    message = str(refused.value)
    assert "'/monitoring/podMonitor/enabled'" in message, message
    assert "serviceMonitor.enabled is true" in message and "scrape every target twice" in message, message
    assert "PodMonitor" not in {o["kind"] for o in render(ALL_ON)}  # each alone renders (guards the check)


def test_with_processes_every_process_of_a_pod_is_scraped(render: Render, one: One) -> None:
    # serve --processes 3 --metrics-port 9100: process i serves /metrics on 9101 + i.
    objects = render({**ALL_ON, "broker": {"replicas": 3, "processes": 3}})
    pods = render({**PODS, "broker": {"replicas": 3, "processes": 3}})
    (broker,) = one(objects, "StatefulSet", "demo-lmq-broker")["spec"]["template"]["spec"]["containers"]
    container_ports = {p["name"]: p["containerPort"] for p in broker["ports"]}
    by_pod_monitor = one(pods, "PodMonitor", "demo-lmq-broker")["spec"]["podMetricsEndpoints"]
    assert [container_ports[e["port"]] for e in by_pod_monitor] == [9101, 9102, 9103]
    assert {(e["path"], e["interval"]) for e in by_pod_monitor} == {("/metrics", "20s")}
    headless = {p["name"]: p for p in one(objects, "Service", "demo-lmq-broker-headless")["spec"]["ports"]}
    by_service_monitor = one(objects, "ServiceMonitor", "demo-lmq-broker")["spec"]["endpoints"]
    assert [container_ports[headless[e["port"]]["targetPort"]] for e in by_service_monitor] == [9101, 9102, 9103]
    assert {(e["path"], e["interval"]) for e in by_service_monitor} == {("/metrics", "15s")}
    # the operator has one process: one endpoint
    assert len(one(pods, "PodMonitor", "demo-lmq-operator")["spec"]["podMetricsEndpoints"]) == 1
    assert len(one(objects, "ServiceMonitor", "demo-lmq-operator")["spec"]["endpoints"]) == 1


def test_alerts_cover_brokers_consumers_dead_letters_disk_and_the_operator(render: Render, one: One) -> None:
    alerts = rules(render(ALL_ON), one)
    assert set(alerts) == {
        "LmqBrokerDown",
        "LmqBrokersMissing",
        "LmqBrokerStoreUnhealthy",
        "LmqBrokerDiskAlmostFull",
        "LmqBrokerDiskFillingUp",
        "LmqConsumerLagHigh",
        "LmqDeadLettersGrowing",
        "LmqOperatorNoLeader",
        "LmqOperatorReconcileFailing",
        "LmqReplicationUnderReplicated",
        "LmqReplicationLeaseUnheld",
        "LmqReplicationLagging",
    }
    for name, rule in alerts.items():
        metric_names(rule["expr"])  # parses
        promql_parser.parse_duration(rule["for"])
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        assert 'namespace="mq"' in rule["expr"], name  # this release's series only
    # the values land where they say
    assert alerts["LmqConsumerLagHigh"]["expr"].endswith("> 500") and alerts["LmqConsumerLagHigh"]["for"] == "30m"
    assert alerts["LmqDeadLettersGrowing"]["expr"].endswith("> 3")
    assert alerts["LmqBrokerDiskAlmostFull"]["expr"].endswith("< 0.2")
    assert alerts["LmqBrokersMissing"]["expr"].endswith("< 3")
    assert "count by (pod)" in alerts["LmqBrokersMissing"]["expr"]  # pods, not targets: one per process
    assert 'pod=~"demo-lmq-broker-[0-9]+"' in alerts["LmqBrokerDown"]["expr"]
    assert 'persistentvolumeclaim=~"data-demo-lmq-broker-[0-9]+"' in alerts["LmqBrokerDiskAlmostFull"]["expr"]
    assert "{{ $labels.group }}" in alerts["LmqConsumerLagHigh"]["annotations"]["summary"]  # Prometheus templates
    # replication (R=2 with 3 pods): per slot, against R; every slot of the ring held; lag against its threshold
    assert alerts["LmqReplicationUnderReplicated"]["expr"].endswith(") < 2")
    assert "sum by (namespace, slot)" in alerts["LmqReplicationUnderReplicated"]["expr"]
    assert alerts["LmqReplicationLeaseUnheld"]["expr"].endswith("< 3")
    assert alerts["LmqReplicationLagging"]["expr"].endswith("> 700")
    assert alerts["LmqReplicationUnderReplicated"]["for"] == "2m"
    no_replication = rules(render({**ALL_ON, "broker": {"replicas": 3, "replication": {"replicas": 1}}}), one)
    assert not [a for a in no_replication if a.startswith("LmqReplication")]
    # no volume, no disk alerts; no operator, no operator alerts
    no_disk = rules(render({**ALL_ON, "broker": {"persistence": {"enabled": False}}}), one)
    assert not {"LmqBrokerDiskAlmostFull", "LmqBrokerDiskFillingUp"} & set(no_disk)
    no_operator = rules(render({**ALL_ON, "operator": {"enabled": False}}), one)
    assert not [a for a in no_operator if a.startswith("LmqOperator")]


def test_the_dashboard_is_a_grafana_dashboard_whose_queries_parse(render: Render, one: One) -> None:
    objects = render(ALL_ON)
    config_map = one(objects, "ConfigMap", "demo-lmq-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "Messaging"}
    board = dashboard(objects, one)
    assert board["uid"] == "lmq-overview" and board["title"] == "lmq"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "namespace", "release"}
    queries = targets(board)
    assert len(queries) >= 20
    for query in queries:
        metric_names(dashboard_query(query))
    shown = set().union(*(metric_names(dashboard_query(q)) for q in queries))
    wanted_names = ("lmq_consumer_lag", "lmq_dead_letters_total", "up", "lmq_operator_leader")
    for wanted in (*wanted_names, "lmq_replication_in_sync", "lmq_replication_lag_messages"):
        assert wanted in shown
    off = {**ALL_ON, "monitoring": {**ALL_ON["monitoring"], "grafanaDashboard": {"enabled": False}}}
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert names - {(o["kind"], o["metadata"]["name"]) for o in render(off)} == {("ConfigMap", "demo-lmq-dashboard")}


# ---- the metrics they name exist --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def broker_metrics(tmp_path_factory: pytest.TempPathFactory) -> Iterator[set[str]]:
    """Metric names a real broker serves, with a lite group that has consumer lag (so its series exist)."""
    broker = broker_testing.start_broker(
        tmp_path_factory.mktemp("monitoring-broker"), extra_args=["--no-bootstrap"], env=broker_testing.SHARED_ADMIN_ENV
    )
    try:
        with AdminClient(broker.admin_endpoint, **broker_testing.SHARED_ADMIN_KEYS) as admin:
            admin.put_parent_topic(model.ParentTopic(dispatch_testing.PARENT))
            admin.put_group(model.LiteGroup("watched", dispatch_testing.PARENT))
        deadline = time.monotonic() + 30
        text = ""
        while "lmq_consumer_lag{" not in text:  # the first scrape starts the lag walk
            assert time.monotonic() < deadline, text[-2000:]
            with urllib.request.urlopen(f"http://127.0.0.1:{broker.metrics_port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
            time.sleep(0.1)
        # families declared (a labelled counter nobody incremented yet has no sample, but its TYPE line)
        yield series_names((m.group(1), m.group(2)) for m in re.finditer(r"^# TYPE (\S+) (\S+)$", text, re.M))
    finally:
        broker.stop()
        if broker.process.stdout is not None:
            broker.process.stdout.close()


def series_names(families: Iterable[tuple[str, str]]) -> set[str]:
    """The series names of (family name, type) pairs, as the exposition format spells them."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}
    names = set()
    for name, kind in families:
        names.add(name)
        names.update(name + suffix for suffix in suffixes.get(kind, ()))
    return names


def operator_metrics_names() -> set[str]:
    """Series names of the operator's registry (the default one, with the process collector)."""
    assert operator_metrics.LEADER is not None
    return series_names((family.name, family.type) for family in prometheus_client.REGISTRY.collect())


def test_every_metric_the_rules_and_the_dashboard_name_is_exported(
    render: Render, one: One, broker_metrics: set[str]
) -> None:
    objects = render(ALL_ON)
    used = set().union(*(metric_names(r["expr"]) for r in rules(objects, one).values()))
    used |= set().union(*(metric_names(dashboard_query(q)) for q in targets(dashboard(objects, one))))
    exported = broker_metrics | operator_metrics_names() | EXTERNAL
    assert "lmq_consumer_lag" in broker_metrics and "lmq_operator_leader" in exported
    assert "lmq_replication_in_sync" in used  # declared by an R=1 broker too (no samples)
    assert used - exported == set()
    assert "process_resident_memory_bytes" in used  # the operator's memory, next to its limit


def test_the_chart_ships_the_dashboard_file(chart_dir: Path) -> None:
    board = json.loads((chart_dir / "dashboards" / "lmq.json").read_text())
    assert board["schemaVersion"] >= 36 and board["panels"]
