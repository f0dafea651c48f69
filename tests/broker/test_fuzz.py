"""Malformed requests against a real broker process: every answer is a known v2 status, never an internal
error, and the broker keeps serving. Property-based (hypothesis): arbitrary names, sizes, enum numbers,
missing fields, and raw bytes that are not protobuf at all."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc
from lmq_broker.testing import BrokerProcess, start_broker

KNOWN_CODES = frozenset(pb.Code.values())
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
names = st.one_of(
    st.sampled_from(["AGENT_TASK_NS", "executor-group", "", "%DLQ%x", "a$b", "x" * 200]),
    st.text(max_size=40),
)
lites = st.one_of(st.sampled_from(["session-1", "", "a b", "é", "x" * 65]), st.text(max_size=70))
enums: st.SearchStrategy[Any] = st.one_of(st.integers(-3, 8), st.integers(-(2**31), 2**31 - 1))  # any int32
headers = st.sampled_from(
    [
        (("x-mq-client-id", "fuzzer"),),
        (("x-mq-client-id", "fuzzer"), ("x-mq-language", "PYTHON"), ("x-mq-client-version", "5.1.2")),
        (),
    ]
)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    process = start_broker(Path(tmp_path_factory.mktemp("fuzz")) / "data", extra_args=["--flush-mode", "async"])
    yield process
    assert process.stop() == 0, process.log()[-3000:]


@pytest.fixture(scope="module")
def stub(broker: BrokerProcess) -> Iterator[service_pb2_grpc.MessagingServiceStub]:
    with grpc.insecure_channel(broker.endpoint) as channel:
        yield service_pb2_grpc.MessagingServiceStub(channel)


def check(status: pb.Status) -> None:
    assert status.code in KNOWN_CODES and status.code != pb.CODE_UNSPECIFIED
    assert status.code not in (pb.INTERNAL_ERROR, pb.INTERNAL_SERVER_ERROR), status.message


def durations() -> st.SearchStrategy[duration_pb2.Duration]:
    return st.builds(
        duration_pb2.Duration, seconds=st.integers(-(10**6), 10**6), nanos=st.integers(-(10**9) + 1, 10**9 - 1)
    )


@st.composite
def messages(draw: st.DrawFn) -> pb.Message:
    props = pb.SystemProperties(
        message_id=draw(st.text(max_size=140)),
        message_type=draw(enums),
        body_encoding=draw(enums),
        keys=draw(st.lists(st.text(max_size=10), max_size=3)),
    )
    if draw(st.booleans()):
        props.lite_topic = draw(lites)
    if draw(st.booleans()):
        props.tag = draw(st.text(max_size=10))
    if draw(st.booleans()):
        props.message_group = draw(st.text(max_size=10))
    oversized = draw(st.integers(0, 9)) == 0  # 4 MiB bodies are slow to ship: one draw in ten
    body = b"x" * (4 * 1024 * 1024 + 1) if oversized else draw(st.binary(max_size=64))
    return pb.Message(
        topic=pb.Resource(name=draw(names)),
        body=body,
        system_properties=props,
        user_properties=draw(st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3)),
    )


@FUZZ
@given(batch=st.lists(messages(), max_size=3), metadata=headers)
def test_send_message(stub: service_pb2_grpc.MessagingServiceStub, batch: list[pb.Message], metadata: tuple) -> None:  # type: ignore[type-arg]
    check(stub.SendMessage(spb.SendMessageRequest(messages=batch), metadata=metadata, timeout=10).status)


@FUZZ
@given(action=enums, topic=names, group=names, lite_set=st.lists(lites, max_size=12), metadata=headers, data=st.data())
def test_sync_lite_subscription(
    stub: service_pb2_grpc.MessagingServiceStub,
    *,
    action: Any,
    topic: str,
    group: str,
    lite_set: list[str],
    metadata: tuple,  # type: ignore[type-arg]
    data: st.DataObject,
) -> None:
    request = spb.SyncLiteSubscriptionRequest(
        action=action, topic=pb.Resource(name=topic), group=pb.Resource(name=group), lite_topic_set=lite_set
    )
    if data.draw(st.booleans()):
        which = data.draw(st.sampled_from(["policy", "offset", "tail_n", "timestamp"]))
        bound = 2**31 - 1 if which == "policy" else 2**40  # policy is an enum (int32) on the wire
        setattr(request.offset_option, which, data.draw(st.integers(-5, bound)))
    check(stub.SyncLiteSubscription(request, metadata=metadata, timeout=10).status)


@FUZZ
@given(
    topic=names, group=names, batch=st.integers(-5, 5000), auto_renew=st.booleans(), metadata=headers, data=st.data()
)
def test_receive_message(
    stub: service_pb2_grpc.MessagingServiceStub,
    *,
    topic: str,
    group: str,
    batch: int,
    auto_renew: bool,
    metadata: tuple,  # type: ignore[type-arg]
    data: st.DataObject,
) -> None:
    request = spb.ReceiveMessageRequest(
        group=pb.Resource(name=group),
        message_queue=pb.MessageQueue(topic=pb.Resource(name=topic)),
        batch_size=batch,
        auto_renew=auto_renew,
        long_polling_timeout=duration_pb2.Duration(seconds=0),
        filter_expression=pb.FilterExpression(type=data.draw(enums), expression=data.draw(st.text(max_size=5))),
    )
    if data.draw(st.booleans()):
        request.invisible_duration.CopyFrom(data.draw(durations()))
    frames = list(stub.ReceiveMessage(request, metadata=metadata, timeout=10))
    statuses = [f.status for f in frames if f.HasField("status")]
    assert len(statuses) == 1
    check(statuses[0])


@FUZZ
@given(handle=st.text(max_size=80), group=names, topic=names, invisible=durations(), suspend=st.booleans())
def test_ack_and_change_invisible(
    stub: service_pb2_grpc.MessagingServiceStub,
    *,
    handle: str,
    group: str,
    topic: str,
    invisible: duration_pb2.Duration,
    suspend: bool,
) -> None:
    g, t = pb.Resource(name=group), pb.Resource(name=topic)
    ack = spb.AckMessageRequest(group=g, topic=t, entries=[spb.AckMessageEntry(message_id="m", receipt_handle=handle)])
    check(stub.AckMessage(ack, timeout=10).status)
    change = spb.ChangeInvisibleDurationRequest(
        group=g, topic=t, receipt_handle=handle, invisible_duration=invisible, suspend=suspend
    )
    check(stub.ChangeInvisibleDuration(change, timeout=10).status)
    dlq = spb.ForwardMessageToDeadLetterQueueRequest(group=g, topic=t, receipt_handle=handle)
    check(stub.ForwardMessageToDeadLetterQueue(dlq, timeout=10).status)


@FUZZ
@given(topic=names, group=names, client_type=enums, metadata=headers)
def test_route_assignment_heartbeat(
    stub: service_pb2_grpc.MessagingServiceStub,
    *,
    topic: str,
    group: str,
    client_type: Any,
    metadata: tuple,  # type: ignore[type-arg]
) -> None:
    check(stub.QueryRoute(spb.QueryRouteRequest(topic=pb.Resource(name=topic)), metadata=metadata, timeout=10).status)
    assignment = spb.QueryAssignmentRequest(topic=pb.Resource(name=topic), group=pb.Resource(name=group))
    check(stub.QueryAssignment(assignment, metadata=metadata, timeout=10).status)
    beat = spb.HeartbeatRequest(client_type=client_type, group=pb.Resource(name=group))
    check(stub.Heartbeat(beat, metadata=metadata, timeout=10).status)


@FUZZ
@given(client_type=enums, group=names, topics=st.lists(names, max_size=3), publishing=st.booleans())
def test_telemetry_settings(
    stub: service_pb2_grpc.MessagingServiceStub, *, client_type: Any, group: str, topics: list[str], publishing: bool
) -> None:
    settings_ = pb.Settings(client_type=client_type)
    if publishing:
        settings_.publishing.topics.extend(pb.Resource(name=t) for t in topics)
    else:
        settings_.subscription.group.name = group
        settings_.subscription.subscriptions.extend(pb.SubscriptionEntry(topic=pb.Resource(name=t)) for t in topics)
    call = stub.Telemetry(iter([spb.TelemetryCommand(settings=settings_)]), metadata=(("x-mq-client-id", "tf"),))
    replies = list(call)
    assert len(replies) == 1
    check(replies[0].status)


@FUZZ
@given(
    raw=st.one_of(st.binary(max_size=256), st.just(b"\x00"), st.just(b"\x0a\xff")),
    method=st.sampled_from(["SendMessage", "SyncLiteSubscription", "AckMessage"]),
)
def test_bytes_that_are_not_protobuf(broker: BrokerProcess, raw: bytes, method: str) -> None:
    response: Any = {
        "SendMessage": spb.SendMessageResponse,
        "SyncLiteSubscription": spb.SyncLiteSubscriptionResponse,
        "AckMessage": spb.AckMessageResponse,
    }[method]
    with grpc.insecure_channel(broker.endpoint) as channel:
        call = channel.unary_unary(
            f"/apache.rocketmq.v2.MessagingService/{method}",
            request_serializer=None,  # the raw bytes go out as they are
            response_deserializer=response.FromString,
        )
        answer = call(raw, timeout=10)
    check(answer.status)  # parseable bytes: handled like any request; the rest: BAD_REQUEST


def test_broker_still_serves_after_fuzzing(stub: service_pb2_grpc.MessagingServiceStub, broker: BrokerProcess) -> None:
    reply = stub.QueryRoute(spb.QueryRouteRequest(topic=pb.Resource(name="AGENT_TASK_NS")), timeout=10)
    assert reply.status.code == pb.OK
    assert broker.alive()
    assert "Traceback" not in broker.log()
