"""AuthInterceptor on a real grpc.aio server: the v2 service (our generated stubs) and the admin service.

A recording v2 servicer writes every SendMessage into a real store, so "nothing is stored for an
unauthorized request" is checked on the store itself. The official client's own signing and status
checking are exercised in a separate interpreter (its copy of the v2 descriptors clashes with ours).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest

from lmq_broker import errors, model
from lmq_broker.admin import service
from lmq_broker.admin.client import AdminClient
from lmq_broker.admin.testing import LoopThread, Server, start_server
from lmq_broker.config import BrokerConfig, StoreConfig
from lmq_broker.dispatch.api import StaticLiveView
from lmq_broker.protocol import auth
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as v2
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as v2s
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as v2_grpc
from lmq_broker.storage import memory
from lmq_broker.storage.api import Store

AK, SK = "lmq-ak", "lmq-secret"
ADMIN_AK, ADMIN_SK = "lmq-admin-ak", "lmq-admin-secret"
NOW = datetime(2026, 1, 2, 3, 4, 5)


@dataclass
class RecordingService(v2_grpc.MessagingServiceServicer):
    """The v2 handlers a rejected call must never reach; SendMessage stores for real."""

    store: Store
    calls: list[str] = field(default_factory=list)

    async def SendMessage(self, request: v2s.SendMessageRequest, context: Any) -> v2s.SendMessageResponse:  # noqa: N802
        self.calls.append("SendMessage")
        for message in request.messages:
            lite = message.system_properties.lite_topic
            self.store.append(
                [
                    model.NewMessage(
                        message_id=message.system_properties.message_id,
                        topic=message.topic.name,
                        body=message.body,
                        queues=(model.QueueId(message.topic.name, 0), model.QueueId.lmq(message.topic.name, lite)),
                        lite_topic=lite,
                        message_type=model.MessageType.LITE,
                    )
                ]
            )
        return v2s.SendMessageResponse(status=v2.Status(code=v2.OK, message="OK"))

    async def ReceiveMessage(  # noqa: N802
        self, request: v2s.ReceiveMessageRequest, context: Any
    ) -> AsyncIterator[v2s.ReceiveMessageResponse]:
        self.calls.append("ReceiveMessage")
        yield v2s.ReceiveMessageResponse(status=v2.Status(code=v2.MESSAGE_NOT_FOUND))

    async def Telemetry(  # noqa: N802
        self, request_iterator: AsyncIterator[v2s.TelemetryCommand], context: Any
    ) -> AsyncIterator[v2s.TelemetryCommand]:
        self.calls.append("Telemetry")
        async for _ in request_iterator:
            yield v2s.TelemetryCommand(status=v2.Status(code=v2.OK))


@dataclass
class Guarded:
    server: Server
    store: Store
    v2: RecordingService
    live: StaticLiveView

    @property
    def endpoint(self) -> str:
        return self.server.endpoint


@pytest.fixture
def guarded(loop_thread: LoopThread, tmp_path: Path) -> Iterator[Guarded]:
    store = memory.MemoryStore()
    live = StaticLiveView()
    recording = RecordingService(store)  # type: ignore[abstract]  # abstract only in the generated stubs
    config = BrokerConfig(store=StoreConfig(data_dir=tmp_path), access_key=AK, secret_key=SK)

    def register(server: grpc.aio.Server) -> None:
        v2_grpc.add_MessagingServiceServicer_to_server(recording, server)
        service.register(server, store, live, config, admin_keys=(ADMIN_AK, ADMIN_SK))
        server.add_generic_rpc_handlers([_fake_health()])

    server = start_server(loop_thread, register, [auth.AuthInterceptor(AK, SK)])
    yield Guarded(server, store, recording, live)
    server.stop()


def _fake_health() -> grpc.GenericRpcHandler[Any, Any]:
    async def check(request: bytes, context: Any) -> bytes:
        return b""

    return grpc.method_handlers_generic_handler(
        "grpc.health.v1.Health", {"Check": grpc.unary_unary_rpc_method_handler(check)}
    )


def _send_request(lite: str = "s1") -> v2s.SendMessageRequest:
    message = v2.Message(topic=v2.Resource(name="orders"), body=b"hello")
    message.system_properties.message_id = "01ABC"
    message.system_properties.lite_topic = lite
    message.system_properties.message_type = v2.LITE
    return v2s.SendMessageRequest(messages=[message])


def _signed(ak: str = AK, sk: str = SK, at: datetime | None = None) -> tuple[tuple[str, str], ...]:
    return (*auth.sign_metadata(ak, sk, at or auth.utc_now()), ("x-mq-client-id", "test@1@0@x"))


# --- the check, as a pure function ---------------------------------------------------------------------------
def test_signature_is_hex_hmac_sha1_of_the_date_time_header() -> None:
    headers = dict(auth.sign_metadata(AK, SK, NOW))
    assert headers["x-mq-date-time"] == "20260102T030405Z"
    # printf 20260102T030405Z | openssl dgst -sha1 -hmac lmq-secret
    assert headers["authorization"] == (
        "MQv2-HMAC-SHA1 Credential=lmq-ak, SignedHeaders=x-mq-date-time, "
        "Signature=90b29e60e7d9a0c9797e22adc19d4c2cdae9de2a"
    )
    assert auth.check(list(headers.items()), AK, SK) is None


@pytest.mark.parametrize(
    ("metadata", "problem"),
    [
        ((), "missing authorization header"),
        (
            (("authorization", "MQv2-HMAC-SHA1 Credential=a, SignedHeaders=x-mq-date-time, Signature=00"),),
            "missing x-mq-date-time header",
        ),
        (
            (("x-mq-date-time", "20260102T030405Z"), ("authorization", "Basic abc")),
            "unsupported authorization algorithm",
        ),
        ((("x-mq-date-time", "20260102T030405Z"), ("authorization", "MQv2-HMAC-SHA1 Credential=lmq-ak")), "malformed"),
        (auth.sign_metadata("other-ak", SK, NOW), "unknown access key"),
        (auth.sign_metadata(AK, "wrong-secret", NOW), "signature does not match"),
        (
            (
                ("x-mq-date-time", "20260102T030405Z"),
                ("authorization", "MQv2-HMAC-SHA1 Credential=lmq-ak, SignedHeaders=host, Signature=00"),
            ),
            "SignedHeaders must be x-mq-date-time",
        ),
    ],
)
def test_check_explains_every_rejection(metadata: tuple[tuple[str, str], ...], problem: str) -> None:
    found = auth.check(metadata, AK, SK)
    assert found is not None
    assert found.startswith(problem)
    assert SK not in found


def test_a_signature_for_another_date_time_does_not_match() -> None:
    headers = dict(auth.sign_metadata(AK, SK, NOW))
    headers["x-mq-date-time"] = "20260102T030406Z"
    assert auth.check(list(headers.items()), AK, SK) == "signature does not match"


def test_a_date_time_outside_the_skew_window_is_refused() -> None:
    """A captured header stops working: the signed date-time must be near the broker's UTC clock."""
    headers = list(auth.sign_metadata(AK, SK, NOW))
    for seconds, accepted in ((0, True), (899, True), (-899, True), (901, False), (-901, False), (86400, False)):
        found = auth.check(headers, AK, SK, now=NOW.replace(tzinfo=UTC) + timedelta(seconds=seconds), max_skew_s=900)
        assert (found is None) == accepted, (seconds, found)
        if not accepted:
            assert found is not None and "from the broker's UTC clock" in found
    assert auth.check(headers, AK, SK, now=NOW.replace(tzinfo=UTC) + timedelta(days=30)) is None  # 0: unchecked


def test_a_replayed_header_is_refused_by_the_server(guarded: Guarded) -> None:
    stale = _signed(at=auth.utc_now() - timedelta(minutes=20))
    with grpc.insecure_channel(guarded.endpoint) as channel:
        reply = v2_grpc.MessagingServiceStub(channel).SendMessage(_send_request(), metadata=stale, timeout=10)
    assert reply.status.code == 40100 and "UTC clock" in reply.status.message


def test_the_interceptor_and_the_admin_guard_need_keys() -> None:
    with pytest.raises(ValueError, match="access key"):
        auth.AuthInterceptor("", SK)
    with pytest.raises(ValueError, match="admin access key"):
        auth.AdminGuard(_fake_health(), ADMIN_AK, "")


# --- on a real server ----------------------------------------------------------------------------------------
def test_a_signed_send_reaches_the_handler_and_is_stored(guarded: Guarded) -> None:
    with grpc.insecure_channel(guarded.endpoint) as channel:
        reply = v2_grpc.MessagingServiceStub(channel).SendMessage(_send_request(), metadata=_signed(), timeout=10)

    assert reply.status.code == v2.OK
    assert guarded.v2.calls == ["SendMessage"]
    assert guarded.store.lite_topic_count("orders") == 1


@pytest.mark.parametrize(
    ("metadata", "problem"),
    [
        (_signed(sk="wrong-secret"), "signature does not match"),
        (_signed(ak="intruder"), "unknown access key"),
        ((), "missing authorization header"),
    ],
)
def test_an_unauthorized_send_gets_status_unauthorized_and_stores_nothing(
    guarded: Guarded, metadata: tuple[tuple[str, str], ...], problem: str
) -> None:
    with grpc.insecure_channel(guarded.endpoint) as channel:
        reply = v2_grpc.MessagingServiceStub(channel).SendMessage(_send_request(), metadata=metadata, timeout=10)

    assert reply.status.code == v2.UNAUTHORIZED == auth.UNAUTHORIZED_CODE
    assert reply.status.message == f"unauthorized: {problem}"
    assert list(reply.entries) == []
    assert guarded.v2.calls == []
    assert guarded.store.lite_topic_count() == 0


def test_an_unauthorized_receive_gets_one_status_frame(guarded: Guarded) -> None:
    request = v2s.ReceiveMessageRequest(group=v2.Resource(name="g"))
    with grpc.insecure_channel(guarded.endpoint) as channel:
        stub = v2_grpc.MessagingServiceStub(channel)
        rejected = list(stub.ReceiveMessage(request, metadata=_signed(sk="nope"), timeout=10))
        accepted = list(stub.ReceiveMessage(request, metadata=_signed(), timeout=10))

    assert [r.status.code for r in rejected] == [v2.UNAUTHORIZED]
    assert [r.status.code for r in accepted] == [v2.MESSAGE_NOT_FOUND]
    assert guarded.v2.calls == ["ReceiveMessage"]


def test_an_unauthorized_telemetry_stream_is_aborted_unauthenticated(guarded: Guarded) -> None:
    settings = v2s.TelemetryCommand(settings=v2.Settings(client_type=v2.PRODUCER))
    with grpc.insecure_channel(guarded.endpoint) as channel:
        stub = v2_grpc.MessagingServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            list(stub.Telemetry(iter([settings]), metadata=_signed(sk="nope"), timeout=10))
        accepted = list(stub.Telemetry(iter([settings]), metadata=_signed(), timeout=10))

    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert raised.value.details() == "unauthorized: signature does not match"
    assert [r.status.code for r in accepted] == [v2.OK]
    assert guarded.v2.calls == ["Telemetry"]


def test_the_admin_service_wants_the_admin_pair_and_never_the_client_pair(guarded: Guarded) -> None:
    anonymous = AdminClient(guarded.endpoint, 10.0)
    wrong = AdminClient(guarded.endpoint, 10.0, access_key=ADMIN_AK, secret_key="nope")
    client_pair = AdminClient(guarded.endpoint, 10.0, access_key=AK, secret_key=SK)
    signed = AdminClient(guarded.endpoint, 10.0, access_key=ADMIN_AK, secret_key=ADMIN_SK)
    try:
        with pytest.raises(errors.Unauthorized, match="missing authorization header") as refused:
            anonymous.put_parent_topic(model.ParentTopic("orders"))
        assert auth.ADMIN_HINT in refused.value.message  # says how to get credentials
        with pytest.raises(errors.Unauthorized, match="signature does not match"):
            wrong.put_parent_topic(model.ParentTopic("orders"))
        with pytest.raises(errors.Unauthorized, match="unknown access key"):
            client_pair.put_parent_topic(model.ParentTopic("orders"))
        with pytest.raises(errors.Unauthorized):
            list(anonymous.scan_lite_topics_columns())
        assert guarded.store.list_parent_topics() == []
        assert guarded.live.metadata_changes == 0

        assert signed.put_parent_topic(model.ParentTopic("orders")).created
        assert [t.topic.name for t in signed.list_parent_topics()] == ["orders"]
    finally:
        for admin in (anonymous, wrong, client_pair, signed):
            admin.close()


def test_admin_keys_are_not_client_keys(guarded: Guarded) -> None:
    with grpc.insecure_channel(guarded.endpoint) as channel:
        stub = v2_grpc.MessagingServiceStub(channel)
        reply = stub.SendMessage(_send_request(), metadata=_signed(ADMIN_AK, ADMIN_SK), timeout=10)
    assert reply.status.code == v2.UNAUTHORIZED
    assert guarded.v2.calls == []


def test_a_skewed_admin_signature_is_refused(guarded: Guarded) -> None:
    stale = AdminClient(
        guarded.endpoint,
        10.0,
        access_key=ADMIN_AK,
        secret_key=ADMIN_SK,
        clock=lambda: auth.utc_now() - timedelta(minutes=20),
    )
    with stale, pytest.raises(errors.Unauthorized, match="from the broker's UTC clock"):
        stale.list_parent_topics()


def test_without_admin_keys_the_service_answers_unsigned_calls(loop_thread: LoopThread) -> None:
    store = memory.MemoryStore()
    config = BrokerConfig(admin_anonymous=True)
    server = start_server(loop_thread, lambda s: service.register(s, store, StaticLiveView(), config, admin_keys=None))
    try:
        with AdminClient(server.endpoint, 10.0) as anonymous:
            assert anonymous.put_parent_topic(model.ParentTopic("orders")).created
    finally:
        server.stop()


def test_health_checks_need_no_credentials(guarded: Guarded) -> None:
    with grpc.insecure_channel(guarded.endpoint) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check", None, None)
        assert check(b"", timeout=10) == b""


# --- the official client, in its own interpreter -------------------------------------------------------------
_OFFICIAL = textwrap.dedent(
    """
    import json, sys
    import grpc
    from rocketmq import ClientConfiguration, Credentials
    from rocketmq.grpc_protocol import MessagingServiceStub, SendMessageRequest
    from rocketmq.grpc_protocol.definition_pb2 import Message, Resource
    from rocketmq.v5.exception import UnauthorizedException
    from rocketmq.v5.util.messaging_result_checker import MessagingResultChecker
    from rocketmq.v5.util.signature import Signature

    endpoint, ak, sk = sys.argv[1:4]
    out = {"sign": Signature.sign(sk, "20260102T030405Z")}
    message = Message(topic=Resource(name="orders"), body=b"hi")
    message.system_properties.message_id = "01OFFICIAL"
    message.system_properties.lite_topic = "from-official"
    message.system_properties.message_type = 5
    request = SendMessageRequest(messages=[message])
    with grpc.insecure_channel(endpoint) as channel:
        stub = MessagingServiceStub(channel)
        for label, secret in (("right", sk), ("wrong", sk + "x")):
            config = ClientConfiguration(endpoint, Credentials(ak, secret))
            reply = stub.SendMessage(request, metadata=Signature.metadata(config, "official@1@0@x"), timeout=10)
            try:
                MessagingResultChecker.check(reply.status)
                out[label] = "ok"
            except UnauthorizedException as exc:
                out[label] = ["UnauthorizedException", exc.code, str(exc)]
    print(json.dumps(out))
    """
)


def test_the_official_client_signs_as_we_check_and_raises_unauthorized_exception(guarded: Guarded) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _OFFICIAL, guarded.endpoint, AK, SK],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)

    assert seen["sign"] == auth.signature(SK, "20260102T030405Z")
    assert seen["right"] == "ok"
    name, code, text = seen["wrong"]
    assert (name, code) == ("UnauthorizedException", auth.UNAUTHORIZED_CODE)
    assert "signature does not match" in text
    assert guarded.v2.calls == ["SendMessage"]  # only the signed call got through
    assert guarded.store.lite_topic("orders", "from-official") is not None
    assert guarded.store.lite_topic_count() == 1
