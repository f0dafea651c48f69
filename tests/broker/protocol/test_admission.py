"""Admission under bursts: every call is answered (served, or refused TOO_MANY_REQUESTS / RESOURCE_EXHAUSTED),
never cancelled by gRPC; refusals are counted and logged at most once per interval.

The burst tests run a whole broker on a real port and fire thousands of calls on one channel. Before
admission existed, grpc core refused calls past its backlog limit (1,000 waiting to be taken by the Python
server, every one past 3,000) as a bare CANCELLED: 3,000 QueryRoutes came back ~750 CANCELLED.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from waiting import eventually_async

from lmq_broker import app
from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch.testing import config_for
from lmq_broker.protocol import admission as admission_module
from lmq_broker.protocol.admission import Admission
from lmq_broker.protocol.context import Caller
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2, admin_pb2_grpc
from lmq_broker.protocol.handlers import query_route

PARENT = "AGENT_TASK_NS"
GROUP = "executor-group"
ROUTE = spb.QueryRouteRequest(topic=pb.Resource(name=PARENT))
ADMISSION_LOGGER = admission_module.__name__
BURST = 3000


def headers(client_id: str = "burst-client") -> tuple[tuple[str, str], ...]:
    return (("x-mq-client-id", client_id), ("x-mq-language", "JAVA"), ("x-mq-client-version", "5.0.8"))


def refused(broker: app.Broker, rpc: str) -> float:
    value = broker.metrics.registry.get_sample_value("lmq_calls_refused_total", {"rpc": rpc, "reason": "overload"})
    return value or 0.0


def overload_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == ADMISSION_LOGGER and r.levelno == logging.WARNING]


async def outcome(call: Awaitable[spb.QueryRouteResponse | spb.SendMessageResponse]) -> str:
    try:
        reply = await call
    except grpc.aio.AioRpcError as exc:
        return f"grpc {exc.code().name}"
    return pb.Code.Name(reply.status.code)


# --- the admission object ------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_admits_up_to_the_cap_and_frees_slots_on_leave() -> None:
    admission = Admission(2)
    assert [admission.enter() for _ in range(3)] == [True, True, False]
    assert admission.full
    admission.leave()
    assert [admission.full, admission.enter(), admission.full] == [False, True, True]
    assert admission.running == 2


def test_zero_means_no_cap() -> None:
    admission = Admission(0)
    assert all(admission.enter() for _ in range(100_000))
    assert not admission.full


def test_refusals_are_counted_each_and_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=ADMISSION_LOGGER)
    counted: list[tuple[str, str]] = []
    clock = Clock()
    admission = Admission(5, lambda rpc, reason: counted.append((rpc, reason)), clock=clock, log_interval_s=10.0)
    admission.refuse("SendMessage")  # the first refusal is told at once
    for _ in range(99):
        clock.now += 0.05
        admission.refuse("QueryRoute" if clock.now % 1 < 0.5 else "SendMessage")
    assert len(counted) == 100 and {reason for _, reason in counted} == {"overload"}
    assert len(overload_warnings(caplog)) == 1
    assert "refused 1 call " in overload_warnings(caplog)[0].getMessage()
    clock.now = 111.0  # the interval is over: the next refusal writes the summary of the 99 + itself
    admission.refuse("Heartbeat")
    (_, second) = overload_warnings(caplog)
    text = second.getMessage()
    assert "refused 100 calls" in text and "--max-concurrent-calls=5" in text and "Heartbeat 1" in text
    admission.refuse("Heartbeat")  # inside the new interval: owed until close()
    assert len(overload_warnings(caplog)) == 2
    admission.close()
    assert len(overload_warnings(caplog)) == 3 and "refused 1 call " in overload_warnings(caplog)[2].getMessage()
    admission.close()  # nothing owed: no line
    assert len(overload_warnings(caplog)) == 3


@pytest.mark.asyncio
async def test_the_summary_owed_is_written_when_the_interval_ends(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=ADMISSION_LOGGER)
    admission = Admission(1, log_interval_s=0.2)
    admission.refuse("SendMessage")
    admission.refuse("SendMessage")
    admission.refuse("QueryRoute")
    assert len(overload_warnings(caplog)) == 1
    await eventually_async(lambda: len(overload_warnings(caplog)) == 2, "two overload warnings", timeout_s=10)
    assert "refused 2 calls" in overload_warnings(caplog)[1].getMessage()
    admission.close()
    assert len(overload_warnings(caplog)) == 2


# --- a real broker ---------------------------------------------------------------------------------------------
async def started(config: BrokerConfig) -> app.Broker:
    broker = app.Broker(config)
    await broker.start()
    return broker


@pytest_asyncio.fixture
async def default_broker(tmp_path: Path) -> AsyncIterator[app.Broker]:
    broker = await started(config_for(tmp_path / "data", host="127.0.0.1", port=0, metrics_port=-1))
    yield broker
    await broker.stop(0.2)


@pytest_asyncio.fixture
async def capped_broker(tmp_path: Path) -> AsyncIterator[app.Broker]:
    # Admin open (admission is the subject here; the admin pair is tests/broker/protocol/test_security.py's).
    config = config_for(
        tmp_path / "data", host="127.0.0.1", port=0, metrics_port=-1, max_concurrent_calls=50, admin_anonymous=True
    )
    broker = await started(config)
    yield broker
    await broker.stop(0.2)


class Gate:
    """Holds QueryRoute handlers until opened: calls that are admitted stay running (slow work in hand)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened = asyncio.Event()
        self.entered = 0
        real = query_route.handle

        async def handle(edge: Edge, request: spb.QueryRouteRequest, caller: Caller) -> spb.QueryRouteResponse:
            self.entered += 1
            await self.opened.wait()
            return await real(edge, request, caller)

        monkeypatch.setattr(query_route, "handle", handle)


@pytest.mark.asyncio
async def test_a_burst_past_grpcs_backlog_is_served_not_cancelled(default_broker: app.Broker) -> None:
    async with grpc.aio.insecure_channel(default_broker.endpoint) as channel:
        stub = service_pb2_grpc.MessagingServiceStub(channel)
        outcomes = await asyncio.gather(*(outcome(stub.QueryRoute(ROUTE, metadata=headers())) for _ in range(BURST)))
    assert collections.Counter(outcomes) == {"OK": BURST}  # before: ~750 of 3,000 "grpc CANCELLED"


@pytest.mark.asyncio
async def test_a_burst_past_the_cap_is_refused_too_many_requests_counted_and_logged_once(
    capped_broker: app.Broker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=ADMISSION_LOGGER)
    gate = Gate(monkeypatch)
    async with grpc.aio.insecure_channel(capped_broker.endpoint) as channel:
        stub = service_pb2_grpc.MessagingServiceStub(channel)
        calls = [asyncio.ensure_future(outcome(stub.QueryRoute(ROUTE, metadata=headers()))) for _ in range(BURST)]
        # Every call reaches the broker: 50 run (held by the gate), the rest are answered at once.
        await eventually_async(
            lambda: gate.entered == 50 and refused(capped_broker, "QueryRoute") == BURST - 50,
            "50 calls in, the rest refused",
            timeout_s=60,
        )
        # the refusals' replies reach the client a moment after the count (the native edge writes them on its thread)
        await eventually_async(lambda: sum(call.done() for call in calls) == BURST - 50, "the refusals answered")
        gate.opened.set()
        outcomes = collections.Counter(await asyncio.gather(*calls))
        assert outcomes == {"OK": 50, "TOO_MANY_REQUESTS": BURST - 50}
        # Once the burst is over, a normal call is served.
        after = await stub.QueryRoute(ROUTE, metadata=headers())
        assert after.status.code == pb.OK
    (warning,) = overload_warnings(caplog)  # one line for the whole burst
    assert "refused 1 call " in warning.getMessage()


@pytest.mark.asyncio
async def test_refusals_by_kind_of_call(capped_broker: app.Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(monkeypatch)
    async with grpc.aio.insecure_channel(capped_broker.endpoint) as channel:
        stub = service_pb2_grpc.MessagingServiceStub(channel)
        held = [asyncio.ensure_future(stub.QueryRoute(ROUTE, metadata=headers())) for _ in range(50)]
        await eventually_async(lambda: gate.entered == 50, "50 calls in", timeout_s=60)
        # a v2 unary call: its response, with the v2 status the official clients retry on
        unary = await stub.SendMessage(spb.SendMessageRequest(), metadata=headers())
        assert unary.status.code == pb.TOO_MANY_REQUESTS == 42900
        assert "overloaded" in unary.status.message and "retry" in unary.status.message
        # a long poll: its first frame carries the status, as for every other refusal of ReceiveMessage
        receive = spb.ReceiveMessageRequest(
            group=pb.Resource(name=GROUP), message_queue=pb.MessageQueue(topic=pb.Resource(name=PARENT)), batch_size=1
        )
        frames = [frame async for frame in stub.ReceiveMessage(receive, metadata=headers(), timeout=10)]
        assert [frame.status.code for frame in frames] == [pb.TOO_MANY_REQUESTS]
        # Telemetry and the admin service have no v2 status to say it in
        telemetry = stub.Telemetry(iter([spb.TelemetryCommand()]), metadata=headers(), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as stream_refused:
            _ = [frame async for frame in telemetry]
        assert stream_refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        admin = admin_pb2_grpc.LmqAdminStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as admin_refused:
            await admin.ListParentTopics(admin_pb2.ListParentTopicsRequest())
        assert admin_refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for rpc in ("SendMessage", "ReceiveMessage", "Telemetry", "ListParentTopics"):
            assert refused(capped_broker, rpc) == 1
        gate.opened.set()
        assert all(reply.status.code == pb.OK for reply in await asyncio.gather(*held))
        listed = await admin.ListParentTopics(admin_pb2.ListParentTopicsRequest())
        assert [t.topic.name for t in listed.topics] == [PARENT]


@pytest.mark.asyncio
async def test_idle_long_polls_hold_no_slot(capped_broker: app.Broker) -> None:
    assert capped_broker.dispatcher is not None
    dispatcher = capped_broker.dispatcher
    consumers = 1000  # twenty times the cap, all waiting in long polls
    receive = spb.ReceiveMessageRequest(
        group=pb.Resource(name=GROUP),
        message_queue=pb.MessageQueue(topic=pb.Resource(name=PARENT)),
        batch_size=1,
        auto_renew=True,
    )
    receive.long_polling_timeout.seconds = 30
    async with grpc.aio.insecure_channel(capped_broker.endpoint) as channel:
        stub = service_pb2_grpc.MessagingServiceStub(channel)
        polls = [stub.ReceiveMessage(receive, metadata=headers(f"consumer-{i}"), timeout=60) for i in range(consumers)]
        waiting = [asyncio.ensure_future(poll.read()) for poll in polls]
        await eventually_async(lambda: dispatcher.client_count() >= consumers, "every consumer known", timeout_s=60)
        assert not any(w.done() for w in waiting)

        def send(i: int) -> Awaitable[spb.SendMessageResponse]:
            props = pb.SystemProperties(message_id=f"01{i:04X}", message_type=pb.LITE, lite_topic=f"t{i}")
            message = pb.Message(topic=pb.Resource(name=PARENT), body=b"x", system_properties=props)
            return stub.SendMessage(spb.SendMessageRequest(messages=[message]), metadata=headers())

        # 40 sends at once, under the cap of 50 (the native edge hands a burst to the broker all together, so 200 at
        # once would be refused past the cap whatever the polls hold): a poll holding a slot would refuse them
        outcomes = collections.Counter[str]()
        for first in range(0, 200, 40):
            outcomes.update(await asyncio.gather(*(outcome(send(i)) for i in range(first, first + 40))))
        assert outcomes == {"OK": 200}
        assert refused(capped_broker, "SendMessage") == 0
        for poll in polls:
            poll.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
