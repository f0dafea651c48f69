"""The admin plane as the broker process serves it: wired into ``lmq-broker serve`` beside the v2 service,
with the real dispatcher as its live view, client auth switched on by ``LMQ_ACCESS_KEY``/``LMQ_SECRET_KEY`` and
the admin pair by ``LMQ_ADMIN_ACCESS_KEY``/``LMQ_ADMIN_SECRET_KEY`` (as the chart sets them on broker pods)."""

from __future__ import annotations

import io
import json
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import grpc
import pytest

from lmq_broker import errors, model
from lmq_broker.admin import cli
from lmq_broker.admin.client import AdminClient, DeleteOutcome, OffsetPolicy, OffsetReset
from lmq_broker.protocol import auth
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as v2
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as v2s
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as v2_grpc
from lmq_broker.testing import BrokerProcess, start_broker

AK, SK = "ops-ak", "ops-secret"
ADMIN_AK, ADMIN_SK = "ops-admin-ak", "ops-admin-secret"


@pytest.fixture
def broker_process(tmp_path: Path) -> Iterator[BrokerProcess]:
    process = start_broker(
        tmp_path / "data",
        extra_args=["--no-bootstrap", "--flush-mode", "async", "--broker-name", "broker-7"],
        env={
            "LMQ_ACCESS_KEY": AK,
            "LMQ_SECRET_KEY": SK,
            "LMQ_ADMIN_ACCESS_KEY": ADMIN_AK,
            "LMQ_ADMIN_SECRET_KEY": ADMIN_SK,
        },
    )
    yield process
    process.stop()
    if process.process.stdout is not None:  # start_broker leaves its log pipe open (a ResourceWarning)
        process.process.stdout.close()


def _send(endpoint: str, parent: str, lite: str, count: int) -> None:
    metadata = (*auth.sign_metadata(AK, SK, datetime.now()), ("x-mq-client-id", "admin-test@1@0@x"))
    with grpc.insecure_channel(endpoint) as channel:
        stub = v2_grpc.MessagingServiceStub(channel)
        for i in range(count):
            message = v2.Message(topic=v2.Resource(name=parent), body=f"m{i}".encode())
            props = message.system_properties
            props.message_id = uuid.uuid4().hex.upper()
            props.lite_topic = lite
            props.message_type = v2.LITE
            props.body_encoding = v2.IDENTITY
            props.born_host = "test"
            props.born_timestamp.FromMilliseconds(int(time.time() * 1000))
            reply = stub.SendMessage(v2s.SendMessageRequest(messages=[message]), metadata=metadata, timeout=10)
            assert reply.status.code == v2.OK, reply.status.message


def test_admin_calls_against_the_broker_process(broker_process: BrokerProcess) -> None:
    with AdminClient(broker_process.admin_endpoint, 10.0, **broker_process.admin_keys) as admin:
        assert broker_process.admin_keys == {"access_key": ADMIN_AK, "secret_key": ADMIN_SK}
        assert admin.put_parent_topic(model.ParentTopic("orders", expiration_minutes=5)).created
        assert admin.put_group(model.LiteGroup("g", bind_topic="orders")).created
        _send(broker_process.endpoint, "orders", "session-1", 3)
        _send(broker_process.endpoint, "orders", "session-2", 1)

        described = admin.describe_lite_topic("orders", "session-1")
        info = admin.broker_info()
        scanned: dict[str, list[object]] = {}
        for batch in admin.scan_lite_topics_columns("orders", batch_size=1, with_subscribers=True):
            for name, values in batch.items():
                scanned.setdefault(name, []).extend(values)

        assert described.meta.max_offset == 3
        assert (info.broker_name, info.parent_topic_count, info.group_count) == ("broker-7", 1, 1)
        assert info.lite_topic_count == 2
        assert info.undrained_messages == 4  # g has consumed nothing yet
        assert info.stored_bytes > 0
        assert admin.get_group("g").lag == 0  # no offset and no subscriber: none of g's topics yet
        assert scanned["lite"] == ["session-1", "session-2"]
        assert scanned["subscriber_count"] == [0, 0]

        _send(broker_process.endpoint, "orders", "session-2", 1)  # session-2 changes after the scan
        assert admin.compare_and_delete(scanned, dry_run=True) == [
            DeleteOutcome.WOULD_DELETE,
            DeleteOutcome.KEPT_CHANGED,
        ]
        assert admin.compare_and_delete(scanned) == [DeleteOutcome.DELETED, DeleteOutcome.KEPT_CHANGED]
        with pytest.raises(errors.NotFound):
            admin.describe_lite_topic("orders", "session-1")
        assert admin.describe_lite_topic("orders", "session-2").meta.max_offset == 2


def test_auth_guards_the_admin_service_of_the_broker_process(
    broker_process: BrokerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    with (
        AdminClient(broker_process.admin_endpoint, 10.0) as anonymous,
        pytest.raises(errors.Unauthorized, match="missing authorization header"),
    ):
        anonymous.put_parent_topic(model.ParentTopic("orders"))

    monkeypatch.setenv(cli.ENDPOINT_ENV, broker_process.admin_endpoint)
    monkeypatch.delenv(cli.ACCESS_KEY_ENV, raising=False)
    monkeypatch.delenv(cli.SECRET_KEY_ENV, raising=False)
    monkeypatch.setenv(cli.DATA_DIR_ENV, str(broker_process.data_dir))  # no file there: the pair came from env
    err = io.StringIO()
    assert cli.main(["parent-topic", "list"], err=err) == 1
    assert err.getvalue().startswith("error: Unauthorized: unauthorized: missing authorization header")
    assert err.getvalue().splitlines()[-1].startswith("hint: sent unsigned")

    err = io.StringIO()
    assert cli.main(["--access-key", AK, "--secret-key", SK, "parent-topic", "list"], err=err) == 1  # client pair
    assert "unknown access key" in err.getvalue()

    monkeypatch.setenv(cli.ACCESS_KEY_ENV, ADMIN_AK)  # as on a broker pod, where the broker reads the same variables
    monkeypatch.setenv(cli.SECRET_KEY_ENV, ADMIN_SK)
    out = io.StringIO()
    assert cli.main(["-o", "json", "parent-topic", "list"], out=out) == 0
    assert json.loads(out.getvalue()) == []


def _subscribe(endpoint: str, client_id: str, parent: str, group: str, lites: list[str]) -> None:
    metadata = (*auth.sign_metadata(AK, SK, datetime.now()), ("x-mq-client-id", client_id))
    request = v2s.SyncLiteSubscriptionRequest(
        action=v2.PARTIAL_ADD,
        topic=v2.Resource(name=parent),
        group=v2.Resource(name=group),
        lite_topic_set=lites,
    )
    with grpc.insecure_channel(endpoint) as channel:
        reply = v2_grpc.MessagingServiceStub(channel).SyncLiteSubscription(request, metadata=metadata, timeout=10)
    assert reply.status.code == v2.OK, reply.status.message


def test_lite_operations_against_the_dispatcher_of_the_broker_process(broker_process: BrokerProcess) -> None:
    client_id = "lite-sub@1@0@x"
    with AdminClient(broker_process.admin_endpoint, 10.0, **broker_process.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic("orders"))
        admin.put_group(model.LiteGroup("g", bind_topic="orders"))
        _send(broker_process.endpoint, "orders", "session-1", 3)
        _send(broker_process.endpoint, "orders", "session-2", 2)
        _send(broker_process.endpoint, "orders", "session-3", 1)  # nobody's: not g's topic
        _subscribe(broker_process.endpoint, client_id, "orders", "g", ["session-2", "session-1"])

        assert admin.get_lite_client(client_id).lite_topics == ("session-1", "session-2")
        assert admin.get_lite_client(client_id).client.group == "g"
        lag = admin.group_lag("g")
        assert (lag.lag, lag.lagging_topics) == (5, 2)
        assert [(t.lite, t.lag, t.committed_offset) for t in lag.top] == [("session-1", 3, -1), ("session-2", 2, -1)]
        assert 0 <= lag.latency_ms < 60_000

        assert admin.reset_lite_offsets("g", ["session-1"], OffsetReset(OffsetPolicy.MAX)) == {"session-1": 3}
        assert admin.group_lag("g").lag == 2
        assert admin.trigger_lite_dispatch("g") == ["session-2"]  # session-1 has nothing left for g
        assert admin.trigger_lite_dispatch("g", ["session-1", "session-3"]) == []

        out = io.StringIO()
        args = ["--endpoint", broker_process.admin_endpoint, "lite", "client", client_id, "-o", "json"]
        assert cli.main(["--access-key", ADMIN_AK, "--secret-key", ADMIN_SK, *args], out=out) == 0
        assert json.loads(out.getvalue())["lite_topics"] == ["session-1", "session-2"]


def test_a_new_parent_topic_is_seen_by_every_concurrent_caller(broker_process: BrokerProcess) -> None:
    """Right after PutParentTopic answers, concurrent QueryRoute and SendMessage calls all find the topic: a
    caller that arrives while another's metadata reload runs waits for a copy as new as the change."""
    metadata = (*auth.sign_metadata(AK, SK, datetime.now()), ("x-mq-client-id", "admin-test@2@0@x"))
    with (
        AdminClient(broker_process.admin_endpoint, 10.0, **broker_process.admin_keys) as admin,
        grpc.insecure_channel(broker_process.endpoint) as channel,
    ):
        stub = v2_grpc.MessagingServiceStub(channel)
        for trial in range(5):
            parent = f"FRESH_{trial}"
            admin.put_parent_topic(model.ParentTopic(parent))
            asked = [
                stub.QueryRoute.future(v2s.QueryRouteRequest(topic=v2.Resource(name=parent)), metadata=metadata)
                for _ in range(8)
            ]
            codes = [f.result(10).status.code for f in asked]
            assert codes == [v2.OK] * 8, (parent, codes)
