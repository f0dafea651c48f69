"""One contract for ``BrokerAdmin``: the gRPC implementation against a real broker, and the in-memory twin."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from lmq_operator import admins, apply, desired, model

TOPIC = model.TopicConfig("contract-topic", 30, 100)


def _group(bind: str) -> model.Config:
    cfg = desired.config(
        model.Kind.LITE_GROUP, "contract-group", {"parentTopic": bind, "subscriptionModel": "Exclusive"}
    )
    assert not isinstance(cfg, desired.InvalidSpec)
    return cfg


QUOTA = model.QuotaConfig("parent:contract-topic", 10, 5, -1)


@pytest.fixture(params=["grpc", "memory"])
def admin_factory(request: pytest.FixtureRequest, start_broker: Callable[..., Any]) -> Callable[[], admins.BrokerAdmin]:
    if request.param == "memory":
        return admins.MemoryAdmin
    broker = start_broker("contract")
    return lambda: apply.GrpcAdmin(broker.admin_endpoint, timeout_s=5.0)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_put_get_delete_round_trip(admin_factory: Callable[[], admins.BrokerAdmin]) -> None:
    async def scenario() -> None:
        admin = admin_factory()
        try:
            assert await admin.get(model.Kind.PARENT_TOPIC, TOPIC.key) is None
            assert await admin.put(TOPIC) is True
            assert await admin.put(TOPIC) is False  # idempotent: not created twice
            seen = await admin.get(model.Kind.PARENT_TOPIC, TOPIC.key)
            assert seen is not None and seen.config == TOPIC
            assert dict(seen.figures) == {"liteTopicCount": 0}

            group = _group(TOPIC.name)
            assert await admin.put(group) is True
            got = await admin.get(model.Kind.LITE_GROUP, group.key)
            assert got is not None and got.config == group  # no field is normalised away: equality means in sync
            assert dict(got.figures) == {"subscriptionCount": 0, "clientCount": 0, "lag": 0}

            assert await admin.put(QUOTA) is True
            quota = await admin.get(model.Kind.LITE_QUOTA, QUOTA.key)
            assert quota is not None and quota.config == QUOTA

            assert await admin.delete(model.Kind.LITE_GROUP, group.key, True) is True
            assert await admin.delete(model.Kind.LITE_GROUP, group.key, True) is False
            assert await admin.delete(model.Kind.LITE_QUOTA, QUOTA.key, True) is True
            assert await admin.delete(model.Kind.PARENT_TOPIC, TOPIC.key, True) is True
            assert await admin.get(model.Kind.PARENT_TOPIC, TOPIC.key) is None
            assert await admin.undrained_messages() == 0
        finally:
            await admin.close()

    run(scenario())


def test_group_without_its_parent_is_rejected(admin_factory: Callable[[], admins.BrokerAdmin]) -> None:
    async def scenario() -> None:
        admin = admin_factory()
        try:
            with pytest.raises(admins.AdminError) as info:
                await admin.put(_group("no-such-parent"))
            assert info.value.failure is model.Failure.REJECTED
            assert "not found" in info.value.message
        finally:
            await admin.close()

    run(scenario())


def test_unreachable_broker_is_unavailable() -> None:
    async def scenario() -> None:
        grpc_admin = apply.GrpcAdmin("127.0.0.1:1", timeout_s=1.0)
        memory = admins.MemoryAdmin()
        memory.down = True
        try:
            for admin in (grpc_admin, memory):
                with pytest.raises(admins.AdminError) as info:
                    await admin.get(model.Kind.PARENT_TOPIC, "x")
                assert info.value.failure is model.Failure.UNAVAILABLE
                assert info.value.message.startswith("UNAVAILABLE")
        finally:
            await grpc_admin.close()

    run(scenario())


def test_signed_admin_calls_reach_a_broker_that_checks_keys(start_broker: Callable[..., Any]) -> None:
    broker = start_broker("secured", extra=("--access-key", "ak", "--secret-key", "sk"))

    async def scenario() -> None:
        signed = apply.GrpcAdmin(broker.admin_endpoint, timeout_s=5.0, keys=("ak", "sk"))
        unsigned = apply.GrpcAdmin(broker.admin_endpoint, timeout_s=5.0)
        wrong = apply.GrpcAdmin(broker.admin_endpoint, timeout_s=5.0, keys=("ak", "nope"))
        try:
            assert await signed.put(TOPIC) is True
            for admin in (unsigned, wrong):
                with pytest.raises(admins.AdminError) as info:
                    await admin.get(model.Kind.PARENT_TOPIC, TOPIC.key)
                assert info.value.failure is model.Failure.REJECTED
                assert info.value.message.startswith("UNAUTHENTICATED")
        finally:
            for admin in (signed, unsigned, wrong):
                await admin.close()

    run(scenario())
