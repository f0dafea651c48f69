"""Summary table, exit code, command line and broker discovery (no Spark, no broker)."""

from __future__ import annotations

import socket
from collections.abc import Iterable

import pytest

from lmq_broker import errors
from lmq_reclaim import discovery, options, recording, report, session
from lmq_reclaim.columns import Outcome


def test_summary_counts_outcomes_and_totals() -> None:
    r = report.Report(now_ms=0, dry_run=False)
    b0 = r.brokers["broker-0"] = report.BrokerSummary("broker-0", "10.0.0.1:8081", scanned=10, expired=4)
    b1 = r.brokers["broker-1"] = report.BrokerSummary("broker-1", "10.0.0.2:8081", scanned=5, expired=1)
    b0.add_outcome(Outcome.DELETED, 2)
    b0.add_outcome(Outcome.KEPT_CHANGED, 1)
    b0.add_outcome(Outcome.KEPT_SUBSCRIBED, 1)
    b1.add_outcome(Outcome.NOT_FOUND, 1)
    assert (r.total.scanned, r.total.expired, r.total.reclaimed, r.total.not_found) == (15, 5, 2, 1)
    assert r.exit_code == 0
    table = report.render_table(r).splitlines()
    assert table[0].split() == ["broker", "endpoint", *report.COUNTERS]
    assert table[2].split() == ["broker-0", "10.0.0.1:8081", "10", "4", "2", "1", "1", "0", "0"]
    assert table[-1].split() == ["TOTAL", "15", "5", "2", "1", "1", "1", "0"]
    b1.errors = 1
    assert r.exit_code == 1


def test_a_parent_share_counts_every_outcome_as_expired() -> None:
    share = report.ParentSummary(scanned=9)
    for outcome, n in ((Outcome.DELETED, 3), (Outcome.KEPT_CHANGED, 1), (Outcome.NOT_FOUND, 1), (Outcome.ERROR, 2)):
        share.add_outcome(outcome, n)
    assert share == report.ParentSummary(scanned=9, expired=7, reclaimed=3, kept_changed=1, not_found=1)
    dry = report.ParentSummary()
    dry.add_outcome(Outcome.WOULD_DELETE, 4)
    assert (dry.expired, dry.reclaimed) == (4, 4)


def test_a_brokers_shares_are_its_own_parents_in_name_order() -> None:
    r = report.Report(now_ms=0, dry_run=False)
    r.parents[("broker-1", "orders")] = report.ParentSummary(scanned=1)
    r.parents[("broker-0", "orders")] = report.ParentSummary(scanned=2)
    r.parents[("broker-0", "jobs")] = report.ParentSummary()
    assert recording.shares(r, "broker-0") == {"jobs": report.ParentSummary(), "orders": report.ParentSummary(2)}
    assert list(recording.shares(r, "broker-0")) == ["jobs", "orders"]
    assert recording.shares(r, "broker-9") == {}


def test_recording_failures_are_counted_but_leave_the_exit_code_alone() -> None:
    r = report.Report(now_ms=1_000, dry_run=False, run_id="run-1", finish_ms=2_000)
    r.brokers["broker-0"] = report.BrokerSummary("broker-0", "127.0.0.1:1")
    r.parents[("broker-0", "orders")] = report.ParentSummary()
    recording.record([("broker-0", "127.0.0.1:1")], r, timeout_s=5.0)  # nothing listens there
    assert (r.recorded_on, r.record_failures, r.exit_code) == ([], 1, 0)
    assert r.error_messages[0].startswith("record broker-0: RecordReclaimRuns on 127.0.0.1:1: UNAVAILABLE")


def test_command_line_defaults_and_validation() -> None:
    opts = options.parse(["--brokers", "a:1, b:2"])
    assert opts.brokers == ("a:1", "b:2")
    assert (opts.master, opts.min_age_minutes, opts.dry_run) == (None, 15, False)
    opts = options.parse(["--broker-service", "lmq-broker", "--namespace", "mq", "--conf", "spark.x=1", "--dry-run"])
    assert opts.spark_conf == (("spark.x", "1"),) and opts.dry_run
    assert opts.pushdown and not options.parse(["--brokers", "a:1", "--no-pushdown"]).pushdown
    assert (opts.run_id, opts.record) == ("", True)
    named = options.parse(["--brokers", "a:1", "--run-id", "lmq-reclaim-29000000", "--no-record"])
    assert (named.run_id, named.record) == ("lmq-reclaim-29000000", False)
    for bad in (
        [],
        ["--brokers", "a:1", "--broker-service", "s", "--namespace", "n"],
        ["--broker-service", "s"],
        ["--brokers", "a:1", "--conf", "novalue"],
        ["--brokers", "a:1", "--delete-batch-size", "0"],
        ["--brokers", "a:1", "--run-id", "x" * 254],
        ["--brokers", "a:1", "--run-id", "two\nlines"],
    ):
        with pytest.raises(SystemExit) as exc:
            options.parse(bad)
        assert exc.value.code == 2


@pytest.mark.parametrize("rate", ["-1", "-0.5", "nan", "inf"])
def test_a_negative_or_non_finite_delete_rate_is_refused(rate: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        options.parse(["--brokers", "a:1", f"--max-deletes-per-second={rate}"])
    assert exc.value.code == 2
    assert f"--max-deletes-per-second: must be a number >= 0 (0: unlimited), got {rate}" in capsys.readouterr().err


def test_zero_delete_rate_still_means_unlimited() -> None:
    assert options.parse(["--brokers", "a:1", "--max-deletes-per-second", "0"]).max_deletes_per_second == 0
    assert options.parse(["--brokers", "a:1"]).max_deletes_per_second == 2000


def test_dns_discovery_resolves_a_real_name() -> None:
    # The headless Service's name resolves to one address per pod; localhost stands in for it here.
    found = discovery.from_dns("localhost", 8081)
    assert found
    assert all(e.endswith(":8081") for e in found)
    assert "127.0.0.1:8081" in found or "[::1]:8081" in found


def test_dns_discovery_builds_the_service_name_and_brackets_ipv6() -> None:
    asked: list[str] = []

    def resolver(host: str, port: int) -> Iterable[str]:
        asked.append(host)
        return ["10.1.0.7", "fd00::7", "10.1.0.7"]

    opts = options.parse(["--broker-service", "lmq-broker", "--namespace", "mq", "--broker-port", "9000"])
    assert discovery.discover(opts, resolve=resolver) == ["10.1.0.7:9000", "[fd00::7]:9000"]
    assert asked == ["lmq-broker.mq.svc.cluster.local"]


def test_each_pod_address_stands_for_its_processes() -> None:
    # serve --processes N: process i of a pod answers admin on the pod's admin port + i.
    def resolver(host: str, port: int) -> Iterable[str]:
        return ["10.1.0.8", "fd00::7", "10.1.0.7"]

    argv = ["--broker-service", "lmq-broker", "--namespace", "mq", "--broker-port", "8082", "--broker-processes", "3"]
    opts = options.parse(argv)
    assert opts.broker_processes == 3
    assert discovery.discover(opts, resolve=resolver) == [
        "10.1.0.7:8082",
        "10.1.0.7:8083",
        "10.1.0.7:8084",
        "10.1.0.8:8082",
        "10.1.0.8:8083",
        "10.1.0.8:8084",
        "[fd00::7]:8082",
        "[fd00::7]:8083",
        "[fd00::7]:8084",
    ]
    slices = [{"ports": [{"name": "admin", "port": 8082}], "endpoints": [{"addresses": ["10.0.0.1"]}]}]
    opts = options.parse([*argv[:-2], "--broker-processes", "2", "--discovery", "endpointslices"])
    assert discovery.discover(opts, list_slices=lambda s, n: slices) == ["10.0.0.1:8082", "10.0.0.1:8083"]
    assert options.parse(argv[:-2]).broker_processes == 1
    for bad in (
        ["--broker-service", "b", "--namespace", "mq", "--broker-processes", "0"],
        ["--brokers", "a:1", "--broker-processes", "2"],
    ):
        with pytest.raises(SystemExit):
            options.parse(bad)


def test_dns_failure_is_an_error_value() -> None:
    def resolver(host: str, port: int) -> Iterable[str]:
        raise socket.gaierror("no such host")

    with pytest.raises(errors.BrokerUnavailable):
        discovery.from_dns("nowhere.invalid", 1, resolver)


def test_endpointslices_give_the_ready_pods() -> None:
    slices = [
        {
            "ports": [{"name": "grpc", "port": 8081}],
            "endpoints": [
                {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
                {"addresses": ["10.0.0.3"], "conditions": {}},
            ],
        },
        {"ports": None, "endpoints": [{"addresses": ["10.0.0.4"]}]},
    ]
    opts = options.parse(["--broker-service", "lmq-broker", "--namespace", "mq", "--discovery", "endpointslices"])
    calls: list[tuple[str, str]] = []

    def lister(service: str, namespace: str) -> list[dict[str, object]]:
        calls.append((service, namespace))
        return slices  # type: ignore[return-value]

    assert discovery.discover(opts, list_slices=lister) == ["10.0.0.1:8081", "10.0.0.3:8081", "10.0.0.4:8081"]
    assert calls == [("lmq-broker", "mq")]
    with pytest.raises(errors.BrokerUnavailable):
        discovery.discover(opts, list_slices=lambda s, n: [])


def test_the_master_is_the_jobs_then_spark_submits_then_local(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    assert session.effective_master(options.parse(["--brokers", "a:1"])) == "local[2]"
    assert session.effective_master(options.parse(["--brokers", "a:1", "--master", "local[3]"])) == "local[3]"
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "40000")  # what spark-submit's launcher hands the driver
    assert session.effective_master(options.parse(["--brokers", "a:1"])) is None
    assert session.effective_master(options.parse(["--brokers", "a:1", "--master", "local[3]"])) == "local[3]"
