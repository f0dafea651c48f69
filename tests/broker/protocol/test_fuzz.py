"""Malformed requests against a real broker process: every answer is a known v2 status, never an internal
error, and the broker keeps serving. Property-based (hypothesis): arbitrary names, sizes, enum numbers,
missing fields, and raw bytes that are not protobuf at all.

The second half pins the exact code where the protocol has one (docs/protocol.md, "Validation and status
codes"): unknown enum values, oversized bodies (alone or within a batch, plain or gzip) and each required
field left out, against a parent topic of their own whose lite topics must stay empty."""

from __future__ import annotations

import gzip
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.protocol import auth
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
    replies: list[spb.TelemetryCommand] = []
    try:
        replies.extend(call)
    except grpc.RpcError as ended:  # a refusal: its status frame came first, then the stream ends naming it
        assert len(replies) == 1 and replies[0].status.code != pb.OK
        assert ended.code() != grpc.StatusCode.UNKNOWN
        assert f"({replies[0].status.code})" in (ended.details() or "")
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


@pytest.mark.parametrize("method", ["PutParentTopic", "ListClients", "ScanLiteTopics"])
def test_undecodable_admin_requests_are_invalid_argument(broker: BrokerProcess, method: str) -> None:
    signed = auth.sign_metadata(broker.admin_access_key, broker.admin_secret_key, auth.utc_now())  # admin pair first
    with grpc.insecure_channel(broker.endpoint) as channel:
        path = f"/lmq.admin.v1.LmqAdmin/{method}"
        if method == "ScanLiteTopics":
            call: Any = channel.unary_stream(path, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as refused:
                list(call(b"\x0a\xff", timeout=10, metadata=signed))
        else:
            call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as refused:
                call(b"\x0a\xff", timeout=10, metadata=signed)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    assert f"not a valid {method} message" in (refused.value.details() or "")


# --- exact codes --------------------------------------------------------------------------------------------
STRICT_PARENT, STRICT_GROUP = "FUZZ_STRICT", "fuzz-strict-group"
CLIENT = (("x-mq-client-id", "strict"),)
MAX_BODY = 4 * 1024 * 1024  # the broker's default --max-body-bytes
STRICT = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
valid_lites = st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True)


def unknown(enum: Any) -> st.SearchStrategy[Any]:
    """int32 values that are not a member of ``enum``."""
    known = frozenset(enum.values())
    return st.integers(-(2**31), 2**31 - 1).filter(lambda value: value not in known)


@pytest.fixture(scope="module")
def admin(broker: BrokerProcess) -> Iterator[AdminClient]:
    with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as client:
        client.put_parent_topic(model.ParentTopic(STRICT_PARENT))
        client.put_group(model.LiteGroup(STRICT_GROUP, STRICT_PARENT))
        yield client


def nothing_stored(admin: AdminClient) -> None:
    """None of the refused requests stored a message or left a subscription behind."""
    assert admin.get_parent_topic(STRICT_PARENT).lite_topic_count == 0
    assert admin.get_group(STRICT_GROUP).subscription_count == 0


def strict_message(lite: str, body: bytes = b"x", **sp: Any) -> pb.Message:  # sp: system properties
    props = pb.SystemProperties(**{"message_id": f"id-{lite}", "message_type": pb.LITE, "lite_topic": lite, **sp})
    return pb.Message(topic=pb.Resource(name=STRICT_PARENT), body=body, system_properties=props)


def call(stub: service_pb2_grpc.MessagingServiceStub, rpc: str, request: Any, metadata: Any = CLIENT) -> int:
    """The status code of a unary call, or of the single status frame of ReceiveMessage."""
    if rpc == "ReceiveMessage":
        frames = list(stub.ReceiveMessage(request, metadata=metadata, timeout=10))
        (status,) = [f.status for f in frames if f.HasField("status")]
        return int(status.code)
    return int(getattr(stub, rpc)(request, metadata=metadata, timeout=10).status.code)


@STRICT
@given(data=st.data(), lite=valid_lites)
@pytest.mark.parametrize(
    ("rpc", "field", "expected"),
    [
        ("SyncLiteSubscription", "action", pb.BAD_REQUEST),
        ("SyncLiteSubscription", "offset_policy", pb.ILLEGAL_OFFSET),
        ("Heartbeat", "client_type", pb.UNRECOGNIZED_CLIENT_TYPE),
        ("SendMessage", "message_type", pb.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE),
        ("SendMessage", "body_encoding", pb.BAD_REQUEST),
        ("ReceiveMessage", "filter_type", pb.ILLEGAL_FILTER_EXPRESSION),
    ],
)
def test_unknown_enum_values_get_their_code(
    stub: service_pb2_grpc.MessagingServiceStub,
    admin: AdminClient,
    *,
    rpc: str,
    field: str,
    expected: int,
    data: st.DataObject,
    lite: str,
) -> None:
    parent, group = pb.Resource(name=STRICT_PARENT), pb.Resource(name=STRICT_GROUP)
    request: Any
    if rpc == "SyncLiteSubscription":
        action = data.draw(unknown(pb.LiteSubscriptionAction)) if field == "action" else pb.PARTIAL_ADD
        request = spb.SyncLiteSubscriptionRequest(action=action, topic=parent, group=group, lite_topic_set=[lite])
        if field == "offset_policy":
            request.offset_option.policy = data.draw(unknown(pb.OffsetOption.Policy))
    elif rpc == "Heartbeat":
        request = spb.HeartbeatRequest(client_type=data.draw(unknown(pb.ClientType)), group=group)
    elif rpc == "SendMessage":
        value = data.draw(unknown(pb.MessageType if field == "message_type" else pb.Encoding))
        request = spb.SendMessageRequest(messages=[strict_message(lite, **{field: value})])
    else:
        request = spb.ReceiveMessageRequest(
            group=group, message_queue=pb.MessageQueue(topic=parent), batch_size=1, auto_renew=True,
            long_polling_timeout=duration_pb2.Duration(seconds=0),
            filter_expression=pb.FilterExpression(type=data.draw(unknown(pb.FilterType)), expression="*"),
        )  # fmt: skip
    assert call(stub, rpc, request) == expected
    nothing_stored(admin)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    extra=st.integers(1, 64 * 1024),
    packed=st.booleans(),
    valid_before=st.integers(0, 2),
    valid_after=st.integers(0, 2),
    lite=valid_lites,
)
def test_an_oversized_body_rejects_its_request(
    stub: service_pb2_grpc.MessagingServiceStub,
    admin: AdminClient,
    *,
    extra: int,
    packed: bool,
    valid_before: int,
    valid_after: int,
    lite: str,
) -> None:
    """Over the limit as sent, or only once inflated (gzip): MESSAGE_BODY_TOO_LARGE, and none of the
    request's messages is stored."""
    body = b"x" * (MAX_BODY + extra)
    big = strict_message(lite, gzip.compress(body), body_encoding=pb.GZIP) if packed else strict_message(lite, body)
    batch = [strict_message(f"ok-{i}") for i in range(valid_before)] + [big]
    batch += [strict_message(f"ok-{i}") for i in range(valid_before, valid_before + valid_after)]
    assert call(stub, "SendMessage", spb.SendMessageRequest(messages=batch)) == pb.MESSAGE_BODY_TOO_LARGE
    nothing_stored(admin)


MISSING = [
    ("SendMessage", "messages", pb.BAD_REQUEST),
    ("SendMessage", "topic", pb.ILLEGAL_TOPIC),
    ("SendMessage", "body", pb.MESSAGE_BODY_EMPTY),
    ("SendMessage", "message_id", pb.ILLEGAL_MESSAGE_ID),
    ("SendMessage", "lite_topic", pb.ILLEGAL_LITE_TOPIC),
    ("SyncLiteSubscription", "client_id", pb.CLIENT_ID_REQUIRED),
    ("SyncLiteSubscription", "topic", pb.ILLEGAL_TOPIC),
    ("SyncLiteSubscription", "group", pb.ILLEGAL_CONSUMER_GROUP),
    ("ReceiveMessage", "client_id", pb.CLIENT_ID_REQUIRED),
    ("ReceiveMessage", "group", pb.ILLEGAL_CONSUMER_GROUP),
    ("ReceiveMessage", "topic", pb.ILLEGAL_TOPIC),
    ("ReceiveMessage", "invisible_duration", pb.ILLEGAL_INVISIBLE_TIME),
    ("AckMessage", "group", pb.ILLEGAL_CONSUMER_GROUP),
    ("AckMessage", "topic", pb.ILLEGAL_TOPIC),
    ("AckMessage", "entries", pb.BAD_REQUEST),
    ("AckMessage", "receipt_handle", pb.INVALID_RECEIPT_HANDLE),
    ("ChangeInvisibleDuration", "group", pb.ILLEGAL_CONSUMER_GROUP),
    ("ChangeInvisibleDuration", "topic", pb.ILLEGAL_TOPIC),
    ("ChangeInvisibleDuration", "receipt_handle", pb.INVALID_RECEIPT_HANDLE),
    ("ForwardMessageToDeadLetterQueue", "group", pb.ILLEGAL_CONSUMER_GROUP),
    ("ForwardMessageToDeadLetterQueue", "topic", pb.ILLEGAL_TOPIC),
    ("ForwardMessageToDeadLetterQueue", "receipt_handle", pb.INVALID_RECEIPT_HANDLE),
    ("Heartbeat", "client_id", pb.CLIENT_ID_REQUIRED),
    ("Heartbeat", "client_type", pb.UNRECOGNIZED_CLIENT_TYPE),
]


def complete_request(rpc: str, lite: str, handle: str) -> Any:
    """A request of ``rpc`` with every field it needs (it may still fail later, e.g. on an unknown handle)."""
    parent, group = pb.Resource(name=STRICT_PARENT), pb.Resource(name=STRICT_GROUP)
    invisible = duration_pb2.Duration(seconds=30)
    builders: dict[str, Callable[[], Any]] = {
        "SendMessage": lambda: spb.SendMessageRequest(messages=[strict_message(lite)]),
        "SyncLiteSubscription": lambda: spb.SyncLiteSubscriptionRequest(
            action=pb.PARTIAL_ADD, topic=parent, group=group, lite_topic_set=[lite]
        ),
        "ReceiveMessage": lambda: spb.ReceiveMessageRequest(
            group=group,
            message_queue=pb.MessageQueue(topic=parent),
            batch_size=1,
            auto_renew=False,
            invisible_duration=invisible,
            long_polling_timeout=duration_pb2.Duration(seconds=0),
        ),
        "AckMessage": lambda: spb.AckMessageRequest(
            group=group, topic=parent, entries=[spb.AckMessageEntry(message_id="m", receipt_handle=handle)]
        ),
        "ChangeInvisibleDuration": lambda: spb.ChangeInvisibleDurationRequest(
            group=group, topic=parent, receipt_handle=handle, invisible_duration=invisible, lite_topic=lite
        ),
        "ForwardMessageToDeadLetterQueue": lambda: spb.ForwardMessageToDeadLetterQueueRequest(
            group=group, topic=parent, receipt_handle=handle, lite_topic=lite
        ),
        "Heartbeat": lambda: spb.HeartbeatRequest(client_type=pb.LITE_PUSH_CONSUMER, group=group),
    }
    return builders[rpc]()


@STRICT
@given(case=st.sampled_from(MISSING), lite=valid_lites, handle=st.text(min_size=1, max_size=80))
def test_a_missing_required_field_gets_its_code(
    stub: service_pb2_grpc.MessagingServiceStub,
    admin: AdminClient,
    case: tuple[str, str, int],
    lite: str,
    handle: str,
) -> None:
    rpc, field, expected = case
    request = complete_request(rpc, lite, handle)
    if field == "client_id":
        assert call(stub, rpc, request, metadata=()) == expected
        return nothing_stored(admin)
    holder = request
    if rpc == "SendMessage" and field != "messages":
        holder = request.messages[0] if field in ("topic", "body") else request.messages[0].system_properties
    elif rpc == "ReceiveMessage" and field == "topic":
        holder = request.message_queue
    elif rpc == "AckMessage" and field == "receipt_handle":
        holder = request.entries[0]
    holder.ClearField(field)
    assert call(stub, rpc, request) == expected
    nothing_stored(admin)


def test_broker_still_serves_after_fuzzing(stub: service_pb2_grpc.MessagingServiceStub, broker: BrokerProcess) -> None:
    reply = stub.QueryRoute(spb.QueryRouteRequest(topic=pb.Resource(name="AGENT_TASK_NS")), timeout=10)
    assert reply.status.code == pb.OK
    assert broker.alive()
    assert "Traceback" not in broker.log()
