"""``python -m lmq_broker serve``: flags, LMQ_* variables, bootstrap, probes, graceful SIGTERM."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest

from lmq_broker import __main__ as cli
from lmq_broker.config import BrokerConfig, FlushMode
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc
from lmq_broker.testing import BrokerProcess, start_broker

HEADERS = (("x-mq-client-id", "cli-test"),)


def parse(argv: list[str], env: dict[str, str]) -> BrokerConfig:
    return cli.config_from(cli.build_parser().parse_args(["serve", *argv]), env)


def test_flags_win_over_variables_which_win_over_defaults() -> None:
    config = parse(["--port", "9999"], {"LMQ_PORT": "7777", "LMQ_DATA_DIR": "/tmp/x", "LMQ_BOOTSTRAP": "false"})
    assert config.port == 9999
    assert str(config.store.data_dir) == "/tmp/x"
    assert config.bootstrap is False
    default = parse([], {})
    assert (default.port, default.metrics_port, default.bootstrap) == (8081, 9100, True)


def test_every_documented_flag_exists_and_maps_to_config() -> None:
    config = parse(
        [
            "--data-dir", "d", "--port", "1", "--host", "127.0.0.1", "--metrics-port", "2", "--broker-name", "b",
            "--flush-mode", "async", "--advertised-host", "h", "--no-bootstrap", "--access-key", "ak",
            "--secret-key", "sk", "--tls-cert", "c.pem", "--tls-key", "k.pem",
        ],
        {},
    )  # fmt: skip
    assert config.store.flush_mode is FlushMode.ASYNC
    assert (config.broker_name, config.advertised_host, config.access_key) == ("b", "h", "ak")
    assert config.tls_cert == Path("c.pem") and config.bootstrap is False


def test_bad_values_exit_with_a_message() -> None:
    with pytest.raises(SystemExit, match="LMQ_PORT"):
        parse([], {"LMQ_PORT": "eighty"})
    with pytest.raises(SystemExit, match="invalid configuration"):
        parse(["--port", "70000"], {})


def test_acl_refuses_an_anonymous_admin_service(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--acl needs the admin key pair"):
        cli.main(["serve", "--data-dir", str(tmp_path), "--acl", "--admin-anonymous"])


def test_help_documents_flags_and_variables() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lmq_broker", "serve", "--help"], capture_output=True, text=True, check=True, timeout=60
    )
    for flag in ("--data-dir", "--port", "--metrics-port", "--no-bootstrap", "--tls-cert", "LMQ_DATA_DIR"):
        assert flag in result.stdout


def route(broker: BrokerProcess, topic: str) -> spb.QueryRouteResponse:
    with grpc.insecure_channel(broker.endpoint) as channel:
        stub = service_pb2_grpc.MessagingServiceStub(channel)
        return stub.QueryRoute(spb.QueryRouteRequest(topic=pb.Resource(name=topic)), metadata=HEADERS, timeout=10)


def test_fresh_serve_bootstraps_the_quick_start_resources(tmp_path: Path) -> None:
    with start_broker(tmp_path / "data", env={"LMQ_BROKER_NAME": "from-env"}) as broker:
        reply = route(broker, "AGENT_TASK_NS")
        assert reply.status.code == pb.OK
        assert reply.message_queues[0].broker.name == "from-env"
    with start_broker(tmp_path / "bare", extra_args=["--no-bootstrap"]) as broker:
        assert route(broker, "AGENT_TASK_NS").status.code == pb.TOPIC_NOT_FOUND


def test_probes_and_sigterm_keep_every_acknowledged_message(tmp_path: Path) -> None:
    broker = start_broker(tmp_path / "data", extra_args=["--flush-mode", "async"])
    with urllib.request.urlopen(broker.metrics_url + "/readyz", timeout=5) as ready:
        assert ready.status == 200
    with grpc.insecure_channel(broker.endpoint) as channel:
        stub = service_pb2_grpc.MessagingServiceStub(channel)
        messages = [
            pb.Message(
                topic=pb.Resource(name="AGENT_TASK_NS"),
                body=f"m{i}".encode(),
                system_properties=pb.SystemProperties(message_id=f"id{i}", message_type=pb.LITE, lite_topic="kept"),
            )
            for i in range(50)
        ]
        assert stub.SendMessage(spb.SendMessageRequest(messages=messages), timeout=10).status.code == pb.OK
    assert broker.stop() == 0  # SIGTERM: drain, flush, exit 0
    broker = start_broker(tmp_path / "data", extra_args=["--flush-mode", "async"])
    try:
        with grpc.insecure_channel(broker.endpoint) as channel:
            stub = service_pb2_grpc.MessagingServiceStub(channel)
            sub = spb.SyncLiteSubscriptionRequest(
                action=pb.PARTIAL_ADD,
                topic=pb.Resource(name="AGENT_TASK_NS"),
                group=pb.Resource(name="executor-group"),
                lite_topic_set=["kept"],
            )
            assert stub.SyncLiteSubscription(sub, metadata=HEADERS, timeout=10).status.code == pb.OK
            receive = spb.ReceiveMessageRequest(
                group=pb.Resource(name="executor-group"),
                message_queue=pb.MessageQueue(topic=pb.Resource(name="AGENT_TASK_NS")),
                batch_size=64,
                auto_renew=True,
            )
            frames = list(stub.ReceiveMessage(receive, metadata=HEADERS, timeout=30))
        bodies = [f.message.body for f in frames if f.HasField("message")]
        assert bodies == [f"m{i}".encode() for i in range(32)]  # one batch (receive_batch_size 32), in order
    finally:
        broker.stop()


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmq_broker", "serve", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_a_second_broker_on_the_same_port_fails_to_start(tmp_path: Path) -> None:
    with start_broker(tmp_path / "one") as first:
        with pytest.raises(Exception, match="exited"):
            start_broker(tmp_path / "two", port=first.port, timeout=60)
        assert first.alive()


def test_a_port_in_use_is_one_line_naming_the_flag_and_nothing_is_created(tmp_path: Path) -> None:
    with start_broker(tmp_path / "one", extra_args=["--metrics-port", "0", "--mqtt-port", "0"]) as first:
        cases = {
            "--port": ["--port", str(first.port)],
            "--metrics-port": ["--port", "0", "--metrics-port", str(first.metrics_port)],
            "--mqtt-port": ["--port", "0", "--metrics-port", "0", "--mqtt-port", str(first.mqtt_port)],
        }
        for flag, args in cases.items():
            data_dir = tmp_path / f"two{flag}"
            result = serve("--data-dir", str(data_dir), *args)
            assert result.returncode != 0
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and "already in use" in lines[0] and flag in lines[0], result.stderr
            assert not data_dir.exists()
        assert first.alive()


def test_a_data_dir_in_use_is_one_line_and_leaves_the_running_broker_alone(tmp_path: Path) -> None:
    with start_broker(tmp_path / "one") as first:
        result = serve("--data-dir", str(tmp_path / "one"), "--port", "0", "--metrics-port", "0")
        assert result.returncode != 0
        errors_out = [line for line in result.stderr.splitlines() if " INFO " not in line]
        assert len(errors_out) == 1 and "in use by another broker" in errors_out[0], result.stderr
        assert "--data-dir" in errors_out[0] and "Traceback" not in result.stderr
        assert "never awaited" not in result.stderr and "Event loop is closed" not in result.stderr
        assert first.alive()


def test_every_serve_flag_has_a_section_and_a_help_text_of_its_own() -> None:
    for name, _, _ in cli._fields():
        assert cli.section_of(name) != cli.OTHER_SECTION, f"--{name} belongs to no section of serve --help"
        assert name in cli.HELP, f"--{name} has no help text (it would only restate its name)"
    result = subprocess.run(
        [sys.executable, "-m", "lmq_broker", "serve", "--help"], capture_output=True, text=True, check=True, timeout=60
    )
    for title in ("listening:", "storage:", "delivery:", "limits:", "cluster (docs/scale-out.md):"):
        assert f"\n{title}\n" in result.stdout
