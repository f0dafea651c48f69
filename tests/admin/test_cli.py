"""lmq-admin against a real server: output in both formats, and exit codes 0 / 1 / 2."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lmq_broker import model
from lmq_broker.admin import cli
from lmq_broker.admin.testing import Broker


def run(broker: Broker, *args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["--endpoint", broker.endpoint, *args], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def run_json(broker: Broker, *args: str) -> Any:
    code, out, err = run(broker, "--output", "json", *args)
    assert (code, err) == (0, "")
    return json.loads(out)


def test_parent_topic_put_get_list_delete(broker: Broker) -> None:
    code, out, _ = run(broker, "parent-topic", "put", "orders", "--expiration-minutes", "60")
    assert code == 0
    assert out.splitlines()[0].split() == [
        "NAME",
        "MESSAGE_TYPE",
        "EXPIRATION_MINUTES",
        "MAX_LITE_TOPICS",
        "QUEUE_COUNT",
        "CREATED",
    ]
    assert out.splitlines()[1].split() == ["orders", "LITE", "60", "-1", "1", "True"]

    got = run_json(broker, "parent-topic", "get", "orders")
    assert got == {
        "topic": {
            "name": "orders",
            "message_type": "LITE",
            "expiration_minutes": 60,
            "max_lite_topics": -1,
            "queue_count": 1,
        },
        "lite_topic_count": 0,
        "last_reclaim": None,
    }
    run(broker, "parent-topic", "put", "jobs")
    broker.client().record_reclaim_runs([model.ReclaimRun("orders", "run-1", 1_000, 2_000, 4, 4, 3)])
    last = run_json(broker, "parent-topic", "get", "orders")["last_reclaim"]
    assert (last["run_id"], last["scanned"], last["reclaimed"], last["dry_run"]) == ("run-1", 4, 3, False)
    code, out, _ = run(broker, "parent-topic", "list")  # one cell per topic, with or without a run
    assert [line.split(maxsplit=6)[6] for line in out.splitlines()] == [
        "LAST_RECLAIM",
        "-",
        "run-1: reclaimed 3 of 4",
    ]
    assert run_json(broker, "parent-topic", "delete", "jobs") == {"deleted": True, "lite_topics_deleted": 0}
    assert [t["topic"]["name"] for t in run_json(broker, "parent-topic", "list")] == ["orders"]
    assert run_json(broker, "parent-topic", "delete", "orders") == {"deleted": True, "lite_topics_deleted": 0}
    code, out, _ = run(broker, "parent-topic", "list")
    assert (code, out.strip()) == (0, "(none)")


def test_parent_topic_put_of_a_normal_topic_with_queues(broker: Broker) -> None:
    code, out, err = run(broker, "parent-topic", "put", "jobs", "--message-type", "NORMAL", "--queues", "4")
    assert (code, err) == (0, "")
    header, row = out.splitlines()
    assert dict(zip(header.split(), row.split(), strict=True)) == {
        "NAME": "jobs",
        "MESSAGE_TYPE": "NORMAL",
        "EXPIRATION_MINUTES": "-1",
        "MAX_LITE_TOPICS": "-1",
        "QUEUE_COUNT": "4",
        "CREATED": "True",
    }
    assert broker.store.get_parent_topic("jobs") == model.ParentTopic("jobs", model.MessageType.NORMAL, queue_count=4)
    got = run_json(broker, "parent-topic", "get", "jobs")["topic"]
    assert (got["message_type"], got["queue_count"]) == ("NORMAL", 4)

    code, _, err = run(broker, "parent-topic", "put", "new-jobs", "--queues", "4")  # a new topic is LITE by default
    assert code == 1
    assert err.startswith("error: InvalidArgument: topic.queue_count: must be 1 for a LITE topic")
    code, _, err = run(broker, "parent-topic", "put", "jobs", "--queues", "6")  # an existing one keeps its type
    assert (code, err) == (0, "")
    assert broker.store.get_parent_topic("jobs") == model.ParentTopic("jobs", model.MessageType.NORMAL, queue_count=6)
    code, _, err = run(broker, "parent-topic", "put", "jobs", "--message-type", "NORMAL", "--queues", "65")
    assert code == 1
    assert err.startswith("error: InvalidArgument: topic.queue_count: must be in 1..64")
    code, _, err = run(broker, "parent-topic", "put", "jobs", "--message-type", "NORMAL", "--expiration-minutes", "5")
    assert code == 1
    assert err.startswith("error: InvalidArgument: topic.expiration_minutes: applies to LITE topics only")
    code, _, err = run(broker, "parent-topic", "put", "orders", "--message-type", "NORMAL", "--queues", "2")
    assert code == 0
    code, _, err = run(broker, "parent-topic", "put", "orders", "--message-type", "LITE", "--queues", "1")
    assert code == 1
    assert err.startswith("error: Conflict: topic.message_type is immutable: topic 'orders' is NORMAL, not LITE")


def test_parent_topic_put_refuses_other_message_types_as_usage(
    broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["--endpoint", broker.endpoint, "parent-topic", "put", "t", "--message-type", "FIFO"]) == 2
    assert "invalid choice: 'FIFO'" in capsys.readouterr().err
    assert broker.client().list_parent_topics() == []


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf", "soon"])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_a_usage_error(
    broker: Broker, capsys: pytest.CaptureFixture[str], timeout: str
) -> None:
    assert cli.main(["--endpoint", broker.endpoint, "--timeout", timeout, "parent-topic", "list"]) == 2
    assert "--timeout" in capsys.readouterr().err


def test_group_commands(broker: Broker) -> None:
    broker.client().put_parent_topic(model.ParentTopic("orders"))

    put = run_json(broker, "group", "put", "g", "--bind-topic", "orders", "--model", "exclusive", "--no-fifo")
    assert put["created"] is True
    assert put["value"]["model"] == "EXCLUSIVE"
    assert put["value"]["fifo"] is False
    assert put["value"]["client_quota"] == broker.config.default_client_quota  # left to the broker

    _, out, _ = run(broker, "group", "get", "g")  # one object wider than a terminal: a field per line
    fields = {line.split()[0]: line[len(line.split()[0]) :].strip() for line in out.splitlines()}
    assert list(fields)[:3] == ["NAME", "BIND_TOPIC", "MODEL"]
    assert (fields["NAME"], fields["BIND_TOPIC"], fields["MODEL"]) == ("g", "orders", "EXCLUSIVE")
    assert fields["RETRY.MAX_ATTEMPTS"] == "17" and fields["LAG"] == "0"
    assert max(len(line) for line in out.splitlines()) <= cli.TABLE_MAX_WIDTH
    assert [g["group"]["name"] for g in run_json(broker, "group", "list")] == ["g"]
    assert run_json(broker, "group", "delete", "g") is True


def test_parent_topic_put_keeps_the_fields_whose_options_are_not_given(broker: Broker) -> None:
    run_json(broker, "parent-topic", "put", "orders", "--expiration-minutes", "60", "--max-lite-topics", "10")
    put = run_json(broker, "parent-topic", "put", "orders", "--max-lite-topics", "5")
    assert put["created"] is False
    assert broker.store.get_parent_topic("orders") == model.ParentTopic(
        "orders", expiration_minutes=60, max_lite_topics=5
    )
    run_json(broker, "parent-topic", "put", "orders", "--expiration-minutes", "-1")
    assert broker.store.get_parent_topic("orders") == model.ParentTopic("orders", max_lite_topics=5)


def test_group_put_sets_and_clears_a_wildcard_groups_patterns(broker: Broker) -> None:
    broker.client().put_parent_topic(model.ParentTopic("orders"))
    put = ["group", "put", "w", "--bind-topic", "orders"]
    run_json(broker, *put, "--wildcard", "--lite-patterns", "session-*,dev/+/cmd")
    group = broker.store.get_group("w")
    assert group is not None and group.wildcard and group.lite_patterns == ("session-*", "dev/+/cmd")
    run_json(broker, *put, "--client-quota", "9")  # left out: kept
    assert broker.store.get_group("w") == dataclasses.replace(group, client_quota=9)
    run_json(broker, *put, "--lite-patterns", "")
    assert broker.store.get_group("w") == dataclasses.replace(group, client_quota=9, lite_patterns=())
    code, _, err = run(broker, *put, "--lite-patterns", "a*b")
    assert code == 1 and err.startswith("error: InvalidArgument: group.lite_patterns[0]")


def test_group_put_sets_a_backoff_and_keeps_the_fields_whose_options_are_not_given(broker: Broker) -> None:
    broker.client().put_parent_topic(model.ParentTopic("orders"))
    created = run_json(
        broker, "group", "put", "g", "--bind-topic", "orders", "--model", "exclusive", "--client-quota", "7",
        "--max-attempts", "5", "--backoff-ms", "1000,2500,60000", "--no-fifo", "--no-consume-enabled",
    )  # fmt: skip
    assert created["created"] is True
    expected = model.LiteGroup(
        "g", "orders", model=model.SubscriptionModel.EXCLUSIVE, client_quota=7,
        ready_capacity=broker.config.default_ready_capacity,
        retry=model.RetryPolicy(max_attempts=5, backoff_ms=(1000, 2500, 60000)), fifo=False, consume_enabled=False,
    )  # fmt: skip
    assert broker.store.get_group("g") == expected

    updated = run_json(broker, "group", "put", "g", "--bind-topic", "orders", "--ready-capacity", "20")
    assert updated["created"] is False
    assert broker.store.get_group("g") == dataclasses.replace(expected, ready_capacity=20)

    run_json(broker, "group", "put", "g", "--bind-topic", "orders", "--backoff-ms", "500", "--fifo")
    after = broker.store.get_group("g")
    assert after == dataclasses.replace(expected, ready_capacity=20, retry=model.RetryPolicy(5, (500,)), fifo=True)

    run_json(broker, "group", "put", "g", "--bind-topic", "orders", "--backoff-ms", "")  # the broker's default
    assert broker.store.get_group("g") == dataclasses.replace(after, retry=model.RetryPolicy(5))

    code, _, err = run(broker, "group", "put", "g", "--bind-topic", "orders", "--backoff-ms", "0")
    assert code == 1
    assert err.startswith("error: InvalidArgument: group.retry.backoff_ms[0]")
    broker.client().put_parent_topic(model.ParentTopic("other"))
    code, _, err = run(broker, "group", "put", "g", "--bind-topic", "other")
    assert code == 1
    assert err.startswith("error: Conflict: group.bind_topic is immutable")


def test_group_put_refuses_a_malformed_backoff_as_usage(broker: Broker, capsys: pytest.CaptureFixture[str]) -> None:
    broker.client().put_parent_topic(model.ParentTopic("orders"))
    argv = ["--endpoint", broker.endpoint, "group", "put", "g", "--bind-topic", "orders", "--backoff-ms", "1000,1s"]
    assert cli.main(argv) == 2
    assert "expected comma-separated milliseconds, got '1000,1s'" in capsys.readouterr().err
    assert broker.client().list_groups() == []


def test_quota_commands(broker: Broker) -> None:
    assert run_json(broker, "quota", "put", "parent:orders", "--max-lite-topics", "5")["created"] is True
    assert run_json(broker, "quota", "list") == [
        {"scope": "parent:orders", "max_lite_topics": 5, "max_subscriptions_per_client": -1, "max_send_rate": -1}
    ]
    code, out, _ = run(broker, "quota", "delete", "parent:orders")
    assert (code, out.split()) == (0, ["RESULT", "True"])


def test_lite_topic_describe_list_and_scan(broker: Broker) -> None:
    for lite in ("s1", "s2", "s3"):
        broker.send("orders", lite, count=2)
    broker.subscribe("orders", "s2", "client-1")

    described = run_json(broker, "lite-topic", "describe", "orders", "s2")
    assert described["meta"]["max_offset"] == 2
    assert described["subscribed_clients"] == ["client-1"]

    page = run_json(broker, "lite-topic", "list", "orders", "--limit", "2")
    assert [t["meta"]["lite"] for t in page["topics"]] == ["s1", "s2"]
    assert page["next_start_after"] == "s2"

    code, out, _ = run(broker, "lite-topic", "list", "orders", "--limit", "2")  # a table, not raw dicts
    header, *listed, more = out.splitlines()
    assert code == 0
    assert header.split() == [
        "PARENT",
        "LITE",
        "CREATED_MS",
        "LAST_STORE_MS",
        "LAST_CONSUME_MS",
        "MIN_OFFSET",
        "MAX_OFFSET",
        "SUBSCRIBER_COUNT",
    ]
    assert [(r.split()[1], r.split()[6], r.split()[7]) for r in listed] == [("s1", "2", "0"), ("s2", "2", "1")]
    assert more == "(more: --start-after s2)"
    code, out, _ = run(broker, "lite-topic", "list", "orders", "--start-after", "s2")
    assert (code, [line.split()[1] for line in out.splitlines()]) == (0, ["LITE", "s3"])  # last page: no cursor

    code, out, _ = run(broker, "lite-topic", "scan", "orders", "--batch-size", "2", "--with-subscribers")
    lines = out.splitlines()
    assert code == 0
    assert lines[0].split()[:2] == ["PARENT", "LITE"]
    assert lines[0].split()[-1] == "SUBSCRIBER_COUNT"
    assert [line.split()[1] for line in lines[1:]] == ["s1", "s2", "s3"]  # one header across batches

    code, out, _ = run(broker, "-o", "json", "lite-topic", "scan", "orders", "--start-after", "s1")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0
    assert [(r["lite"], r["max_offset"]) for r in rows] == [("s2", 2), ("s3", 2)]


def test_clients_and_broker_info(broker: Broker) -> None:
    broker.connect("c1", "g", "orders", subscriptions=2)
    assert [c["client_id"] for c in run_json(broker, "clients", "list")] == ["c1"]
    assert run_json(broker, "clients", "list", "--group", "other") == []

    info = run_json(broker, "broker", "info", "--skip-undrained")
    assert info["broker_name"] == "broker-test"
    assert info["client_count"] == 1
    assert info["undrained_messages"] == -1


def test_server_errors_exit_1_with_the_status_message(broker: Broker) -> None:
    code, out, err = run(broker, "parent-topic", "get", "missing")
    assert (code, out) == (1, "")
    assert err == "error: TopicNotFound: parent topic 'missing' not found\n"

    code, _, err = run(broker, "parent-topic", "put", "orders", "--expiration-minutes", "99999")
    assert code == 1
    assert err.startswith("error: InvalidArgument: topic.expiration_minutes: must be in -1..43200")


def test_usage_errors_exit_2(broker: Broker, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert cli.main(["parent-topic"]) == 2
    assert cli.main(["group", "put", "g"]) == 2  # --bind-topic is required
    assert cli.main(["--output", "yaml", "broker", "info"]) == 2
    assert "usage: lmq-admin" in capsys.readouterr().err
    assert broker.client().list_groups() == []


def test_unreachable_broker_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert cli.main(["--endpoint", f"127.0.0.1:{port}", "--timeout", "2", "broker", "info"]) == 1
    assert capsys.readouterr().err.startswith("error: BrokerUnavailable: GetBrokerInfo on 127.0.0.1:")


def test_endpoint_comes_from_the_environment(broker: Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cli.ENDPOINT_ENV, broker.endpoint)
    out = io.StringIO()
    assert cli.main(["-o", "json", "broker", "info", "--skip-undrained"], out=out) == 0
    assert json.loads(out.getvalue())["broker_name"] == "broker-test"


def test_the_console_script_runs_as_a_process(broker: Broker) -> None:
    script = Path(sys.executable).with_name("lmq-admin")
    env = {**os.environ, cli.ENDPOINT_ENV: broker.endpoint}
    done = subprocess.run(
        [str(script), "-o", "json", "parent-topic", "put", "orders"],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["created"] is True

    module = subprocess.run(
        [sys.executable, "-m", "lmq_broker.admin.cli", "parent-topic", "get", "nope"],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert module.returncode == 1
    assert "TopicNotFound" in module.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("-o", "json", "quota", "list"),
        ("quota", "-o", "json", "list"),
        ("quota", "list", "-o", "json"),
        ("quota", "list", "--output", "json"),
        ("quota", "list", "--output=json"),
        ("quota", "list", "-ojson"),
        ("-o", "table", "quota", "list", "-o", "json"),  # the last one wins
    ],
)
def test_output_option_in_any_position(broker: Broker, args: tuple[str, ...]) -> None:
    run(broker, "quota", "put", "broker", "--max-lite-topics", "7")
    code, out, err = run(broker, *args)
    assert (code, err) == (0, "")
    assert [q["max_lite_topics"] for q in json.loads(out)] == [7]


def test_output_option_hoisting_keeps_other_tokens_in_order() -> None:
    assert cli.hoist_output(["group", "put", "g", "-o", "json", "--bind-topic", "t"]) == [
        "-o",
        "json",
        "group",
        "put",
        "g",
        "--bind-topic",
        "t",
    ]
    assert cli.hoist_output(["lite-topic", "describe", "--", "p", "-o"]) == ["lite-topic", "describe", "--", "p", "-o"]
    assert cli.main(["quota", "list", "-o"], err=io.StringIO()) == cli.EXIT_USAGE  # no value: a usage error
    assert cli.main(["quota", "list", "-o", "yaml"], err=io.StringIO()) == cli.EXIT_USAGE


@pytest.mark.parametrize("endpoint", ["localhost", "localhost:", "[::1]", "10.0.0.1"])
def test_an_endpoint_without_a_port_is_a_usage_error_with_the_fix(endpoint: str) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["--endpoint", endpoint, "parent-topic", "list"], out=out, err=err)
    assert code == cli.EXIT_USAGE
    assert "names no port" in err.getvalue() and ":8081" in err.getvalue()


@pytest.mark.parametrize("endpoint", ["localhost:8081", "[::1]:8081", "unix:/tmp/lmq.sock", "dns:///lmq:8081"])
def test_endpoints_with_a_port_or_a_scheme_pass_the_check(endpoint: str) -> None:
    assert cli._has_port(endpoint)


def test_tables_print_times_and_backoffs_for_people_and_json_keeps_the_numbers(broker: Broker) -> None:
    assert cli._time_cell(0) == "-"
    assert cli._time_cell(1_764_316_800_000) == "2025-11-28T08:00:00Z"
    assert cli._backoff_cell([1000, 5000]) == "1s,5s"
    rocketmq_levels = list(model.RetryPolicy().backoff_ms)
    assert cli._backoff_cell(rocketmq_levels) == f"1s,5s…1h,2h ({len(rocketmq_levels)} steps)"
    assert cli._backoff_cell([1500]) == "1500ms"
    run(broker, "parent-topic", "put", "orders")
    for i in range(2):
        assert run(broker, "group", "put", f"group-with-a-long-name-{i}", "--bind-topic", "orders")[0] == 0
    code, out, _ = run(broker, "group", "list")
    assert code == 0 and max(len(line) for line in out.splitlines()) <= 140, out
    assert [g["group"]["retry"]["backoff_ms"] for g in run_json(broker, "group", "list")] == [rocketmq_levels] * 2
