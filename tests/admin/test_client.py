"""The client's edge: status codes back to error classes, unreachable brokers, unexpected failures, asyncio."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from lmq_broker import errors, model
from lmq_broker.admin import codes, convert
from lmq_broker.admin.client import AsyncAdminClient, DeleteOutcome
from lmq_broker.admin.testing import Broker, LoopThread, serve_admin
from lmq_broker.config import BrokerConfig
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as pb
from lmq_broker.storage.api import Store


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (errors.InvalidArgument("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.InvalidLiteTopic("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.TopicNotFound("x"), grpc.StatusCode.NOT_FOUND),
        (errors.GroupNotFound("x"), grpc.StatusCode.NOT_FOUND),
        (errors.Conflict("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (errors.LiteTopicQuotaExceeded("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.Unauthorized("x"), grpc.StatusCode.UNAUTHENTICATED),
        (errors.CorruptRecord("x"), grpc.StatusCode.INTERNAL),
        (errors.Unsupported("x"), grpc.StatusCode.UNIMPLEMENTED),
        (errors.LmqError("x"), grpc.StatusCode.INTERNAL),
    ],
)
def test_errors_round_trip_through_status_and_class_name(error: errors.LmqError, code: grpc.StatusCode) -> None:
    assert codes.status_for(error) == code
    ((_, name),) = codes.trailers(error)
    back = codes.error_for(code, "msg", name, rpc="X")
    assert type(back) is type(error)
    assert back.fields == {"code": code.name, "rpc": "X"}


def test_without_a_class_name_the_status_gives_the_family() -> None:
    assert type(codes.error_for(grpc.StatusCode.NOT_FOUND, "m")) is errors.NotFound
    assert type(codes.error_for(grpc.StatusCode.ALREADY_EXISTS, "m")) is errors.Conflict
    assert type(codes.error_for(grpc.StatusCode.DEADLINE_EXCEEDED, "m")) is errors.BrokerUnavailable
    assert type(codes.error_for(grpc.StatusCode.INTERNAL, "m")) is errors.LmqError
    assert type(codes.error_for(grpc.StatusCode.DATA_LOSS, "m")) is errors.LmqError


def test_a_class_name_that_contradicts_the_status_is_not_trusted() -> None:
    assert type(codes.error_for(grpc.StatusCode.INVALID_ARGUMENT, "m", "TopicNotFound")) is errors.InvalidArgument
    assert type(codes.error_for(grpc.StatusCode.NOT_FOUND, "m", "NoSuchClass")) is errors.NotFound


def test_an_unreachable_broker_raises_broker_unavailable(broker: Broker) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    admin = broker.client()
    admin_down = type(admin)(f"127.0.0.1:{port}", 2.0)
    try:
        with pytest.raises(errors.BrokerUnavailable) as raised:
            admin_down.list_quotas()
        assert raised.value.fields["rpc"] == "ListQuotas"
        assert raised.value.fields["endpoint"] == f"127.0.0.1:{port}"
        with pytest.raises(errors.BrokerUnavailable):
            list(admin_down.scan_lite_topics_columns())
    finally:
        admin_down.close()


class _BrokenStore:
    """Delegates to a real store but fails in ways the service does not expect, or as a storage error."""

    def __init__(self, inner: Store) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def list_quotas(self) -> list[model.Quota]:
        raise RuntimeError("disk on fire")

    def scan_lite_topics(self, *args: object, **kwargs: object) -> list[model.LiteTopicMeta]:
        raise errors.StorageError("index unreadable")


@pytest.fixture
def broken(loop_thread: LoopThread, lmq_store: Store, broker_config: BrokerConfig) -> Iterator[Broker]:
    served = serve_admin(loop_thread, _BrokenStore(lmq_store), broker_config)  # type: ignore[arg-type]
    yield served
    served.close()


def test_unexpected_failures_become_internal_and_storage_errors_keep_their_class(broken: Broker) -> None:
    admin = broken.client()
    with pytest.raises(errors.LmqError) as raised:
        admin.list_quotas()
    assert type(raised.value) is errors.LmqError
    assert raised.value.fields["code"] == "INTERNAL"
    assert "RuntimeError: disk on fire" in raised.value.message

    with pytest.raises(errors.StorageError, match="index unreadable"):
        list(admin.scan_lite_topics_columns())
    with pytest.raises(errors.StorageError, match="index unreadable"):
        admin.list_lite_topics()
    assert admin.list_parent_topics() == []  # the service keeps serving


def test_async_client_for_asyncio_callers(broker: Broker) -> None:
    broker.send("orders", "s1")
    broker.send("orders", "s2")

    async def scenario() -> tuple[bool, list[str], list[DeleteOutcome]]:
        async with AsyncAdminClient(broker.endpoint, 10.0) as admin:
            put = await admin.put_parent_topic(model.ParentTopic("orders"))
            lites = []
            async for batch in admin.scan_lite_topics_columns("orders", batch_size=1):
                lites.extend(batch["lite"])
            with pytest.raises(errors.GroupNotFound):
                await admin.get_group("missing")
            scanned: dict[str, list[Any]] = {
                "parent": ["orders"],
                "lite": ["s1"],
                "max_offset": [1],
                "last_store_ms": [0],
                "last_consume_ms": [0],
            }
            outcomes = await admin.compare_and_delete(scanned, dry_run=True)
            return put.created, lites, outcomes

    created, lites, outcomes = asyncio.run(scenario())

    assert created
    assert lites == ["s1", "s2"]
    assert outcomes == [DeleteOutcome.KEPT_CHANGED]  # last_store_ms differs from what we claimed


def test_delete_outcome_numbers_match_the_proto() -> None:
    assert {o.name: int(o) for o in DeleteOutcome} == {
        name: number for name, number in pb.DeleteOutcome.items() if name != "DELETE_OUTCOME_UNSPECIFIED"
    }


@pytest.mark.parametrize(
    ("code", "transient"),
    [
        (grpc.StatusCode.UNAVAILABLE, True),
        (grpc.StatusCode.DEADLINE_EXCEEDED, True),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, True),
        (grpc.StatusCode.INTERNAL, True),
        (grpc.StatusCode.NOT_FOUND, False),
        (grpc.StatusCode.INVALID_ARGUMENT, False),
        (grpc.StatusCode.UNAUTHENTICATED, False),
        (grpc.StatusCode.FAILED_PRECONDITION, False),
    ],
)
def test_transient_failures_are_the_ones_a_retry_may_get_past(code: grpc.StatusCode, transient: bool) -> None:
    assert codes.transient(codes.error_for(code, "m")) is transient
    assert not codes.transient(errors.InvalidArgument("decoded nonsense"))  # no call failed: nothing to retry


def test_a_delete_reply_must_give_one_known_outcome_per_row() -> None:
    reply = pb.CompareAndDeleteResponse(outcome=[pb.DELETED, pb.KEPT_CHANGED])
    assert convert.outcomes_from_pb(reply, 2, "b:1") == [DeleteOutcome.DELETED, DeleteOutcome.KEPT_CHANGED]
    with pytest.raises(errors.LmqError, match="b:1: 2 outcomes for 3 rows"):
        convert.outcomes_from_pb(reply, 3, "b:1")
    with pytest.raises(errors.LmqError, match="unknown delete outcome"):
        convert.outcomes_from_pb(pb.CompareAndDeleteResponse(outcome=[pb.DeleteOutcome.ValueType(99)]), 1, "b:1")
