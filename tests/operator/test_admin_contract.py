"""One contract for ``BrokerAdmin``: the gRPC implementation against a real broker, and the in-memory twin."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lmq_broker import model as broker_model
from lmq_broker.admin.client import AdminClient
from lmq_operator import admins, desired, grpcadmin, model

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
    keys = (broker.admin_access_key, broker.admin_secret_key)
    return lambda: grpcadmin.GrpcAdmin(broker.admin_endpoint, timeout_s=5.0, keys=keys)


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


def test_a_wildcard_groups_patterns_round_trip(admin_factory: Callable[[], admins.BrokerAdmin]) -> None:
    patterns = ("session-*", "dev/+/cmd", "all/#")
    spec = {"parentTopic": TOPIC.name, "wildcard": True, "litePatterns": list(patterns)}
    group = desired.config(model.Kind.LITE_GROUP, "contract-wild", spec)
    assert isinstance(group, model.GroupConfig)

    async def scenario() -> None:
        admin = admin_factory()
        try:
            await admin.put(TOPIC)
            assert await admin.put(group) is True
            got = await admin.get(model.Kind.LITE_GROUP, group.key)
            assert got is not None and got.config == group and group.lite_patterns == patterns
            assert await admin.put(group) is False  # in sync: nothing to write
            await admin.delete(model.Kind.LITE_GROUP, group.key, True)
            await admin.delete(model.Kind.PARENT_TOPIC, TOPIC.key, True)
        finally:
            await admin.close()

    run(scenario())


Record = Callable[[admins.BrokerAdmin, str, model.ReclaimRun], None]


@pytest.fixture(params=["grpc", "memory"])
def with_records(
    request: pytest.FixtureRequest, start_broker: Callable[..., Any]
) -> Iterator[tuple[Callable[[], admins.BrokerAdmin], Record]]:
    """An admin, and a way to leave a reclaim run's record as the job does (RecordReclaimRuns on a broker)."""
    if request.param == "memory":

        def keep(admin: admins.BrokerAdmin, parent: str, run: model.ReclaimRun) -> None:
            assert isinstance(admin, admins.MemoryAdmin)
            admin.reclaims[parent] = run

        yield admins.MemoryAdmin, keep
        return
    broker = start_broker("contract-reclaim")
    with AdminClient(broker.admin_endpoint, **broker.admin_keys) as client:

        def record(admin: admins.BrokerAdmin, parent: str, run: model.ReclaimRun) -> None:
            fields = {f: getattr(run, f) for f in model.ReclaimRun.__dataclass_fields__}
            assert client.record_reclaim_runs([broker_model.ReclaimRun(parent=parent, **fields)]).recorded == (parent,)

        keys = (broker.admin_access_key, broker.admin_secret_key)
        yield (lambda: grpcadmin.GrpcAdmin(broker.admin_endpoint, timeout_s=5.0, keys=keys)), record


def test_a_reclaim_record_is_observed_with_its_parent_and_goes_with_it(
    with_records: tuple[Callable[[], admins.BrokerAdmin], Record],
) -> None:
    factory, record = with_records
    last = model.ReclaimRun("job-1", 1_000, 2_000, 9, 5, 3, 1, 0, 1, 0, dry_run=True)

    async def scenario() -> None:
        admin = factory()
        try:
            await admin.put(TOPIC)
            seen = await admin.get(model.Kind.PARENT_TOPIC, TOPIC.key)
            assert seen is not None and seen.reclaim is None
            record(admin, TOPIC.name, last)
            seen = await admin.get(model.Kind.PARENT_TOPIC, TOPIC.key)
            assert seen is not None and seen.reclaim == last and seen.config == TOPIC  # every field, both ways
            await admin.delete(model.Kind.PARENT_TOPIC, TOPIC.key, True)
            await admin.put(TOPIC)
            again = await admin.get(model.Kind.PARENT_TOPIC, TOPIC.key)
            assert again is not None and again.reclaim is None  # a re-created topic has no run yet
        finally:
            await admin.close()

    run(scenario())


def test_group_without_its_parent_is_refused_for_the_missing_parent(
    admin_factory: Callable[[], admins.BrokerAdmin],
) -> None:
    async def scenario() -> None:
        admin = admin_factory()
        try:
            with pytest.raises(admins.AdminError) as info:
                await admin.put(_group("no-such-parent"))
            assert info.value.failure is model.Failure.MISSING_PARENT
            assert "not found" in info.value.message
        finally:
            await admin.close()

    run(scenario())


def test_a_group_whose_parent_topic_was_deleted_is_observed_as_such(
    admin_factory: Callable[[], admins.BrokerAdmin],
) -> None:
    """A broker keeps a lite group when its parent topic goes; the observation says the parent is missing."""

    async def scenario() -> None:
        admin = admin_factory()
        try:
            await admin.put(TOPIC)
            group = _group(TOPIC.name)
            await admin.put(group)
            seen = await admin.get(model.Kind.LITE_GROUP, group.key)
            assert seen is not None and seen.parent_missing is False
            assert await admin.delete(model.Kind.PARENT_TOPIC, TOPIC.key, True) is True
            orphan = await admin.get(model.Kind.LITE_GROUP, group.key)
            assert orphan is not None and orphan.config == group and orphan.parent_missing is True
            await admin.delete(model.Kind.LITE_GROUP, group.key, True)
        finally:
            await admin.close()

    run(scenario())


def test_unreachable_broker_is_unavailable() -> None:
    async def scenario() -> None:
        grpc_admin = grpcadmin.GrpcAdmin("127.0.0.1:1", timeout_s=1.0)
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


def test_admin_calls_need_the_admin_pair_not_the_client_pair(start_broker: Callable[..., Any]) -> None:
    broker = start_broker("secured", extra=("--access-key", "ak", "--secret-key", "sk"))
    admin_keys = (broker.admin_access_key, broker.admin_secret_key)

    async def scenario() -> None:
        signed = grpcadmin.GrpcAdmin(broker.admin_endpoint, timeout_s=5.0, keys=admin_keys)
        unsigned = grpcadmin.GrpcAdmin(broker.admin_endpoint, timeout_s=5.0)
        client_pair = grpcadmin.GrpcAdmin(broker.admin_endpoint, timeout_s=5.0, keys=("ak", "sk"))
        wrong = grpcadmin.GrpcAdmin(broker.admin_endpoint, timeout_s=5.0, keys=(admin_keys[0], "nope"))
        try:
            assert await signed.put(TOPIC) is True
            for admin in (unsigned, client_pair, wrong):
                with pytest.raises(admins.AdminError) as info:
                    await admin.get(model.Kind.PARENT_TOPIC, TOPIC.key)
                assert info.value.failure is model.Failure.REJECTED
                assert info.value.message.startswith("UNAUTHENTICATED")
        finally:
            for admin in (signed, unsigned, client_pair, wrong):
                await admin.close()

    run(scenario())


def _user(policies: list[dict[str, Any]], *, enabled: bool = True) -> model.UserConfig:
    spec = {"secretRef": {"name": "s"}, "policies": policies, "enabled": enabled}
    cfg = desired.gate(
        model.Kind.LMQ_USER, {"name": "contract-user", "uid": "u"}, spec, {}, model.Credential("s" * 12, "s/k@1")
    )
    assert isinstance(cfg, model.UserConfig)
    return cfg


def test_a_user_and_exactly_its_policies_round_trip(admin_factory: Callable[[], admins.BrokerAdmin]) -> None:
    """A broker shows the user without a secret or its version; a put leaves exactly the entries it names."""
    first = _user([
        {"resources": ["Lite:chat/a-*", "Group:a-*"], "actions": ["Sub", "Pub", "Sub"], "sourceCidrs": ["10.0.0.0/8"]},
        {"resources": ["Lite:chat/a-secret-*"], "actions": ["Sub"], "decision": "Deny"},
    ])  # fmt: skip
    then = _user([{"resources": ["Topic:chat"], "actions": ["Pub"]}], enabled=False)

    async def scenario() -> None:
        admin = admin_factory()
        try:
            assert await admin.get(model.Kind.LMQ_USER, first.key) is None
            assert await admin.put(first) is True
            seen = await admin.get(model.Kind.LMQ_USER, first.key)
            assert seen is not None and seen.config == dataclasses.replace(first, secret_version="")
            assert seen.config.secret == ""  # never returned
            assert await admin.put(then) is False
            seen = await admin.get(model.Kind.LMQ_USER, first.key)
            assert seen is not None and seen.config == dataclasses.replace(then, secret_version="")
            assert await admin.delete(model.Kind.LMQ_USER, first.key, True) is True
            assert await admin.delete(model.Kind.LMQ_USER, first.key, True) is False
            assert await admin.get(model.Kind.LMQ_USER, first.key) is None
        finally:
            await admin.close()

    run(scenario())
