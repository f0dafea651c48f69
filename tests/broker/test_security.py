"""Optional TLS and request signing, on a real server (the signing itself is protocol.auth's, tested there;
here: that the broker wires the client pair for the v2 service, its admin pair for the admin service, and
serves TLS)."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from lmq_broker import app
from lmq_broker.admin import credentials
from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch.testing import config_for
from lmq_broker.protocol import auth
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2, admin_pb2_grpc

pytestmark = pytest.mark.asyncio
ROUTE = spb.QueryRouteRequest(topic=pb.Resource(name="AGENT_TASK_NS"))


async def running(config: BrokerConfig) -> app.Broker:
    broker = app.Broker(config)
    await broker.start()
    return broker


@pytest_asyncio.fixture
async def signed_broker(tmp_path: Path) -> AsyncIterator[app.Broker]:
    broker = await running(
        config_for(
            tmp_path / "data",
            host="127.0.0.1",
            port=0,
            metrics_port=-1,
            access_key="ak",
            secret_key="sk",
            admin_access_key="admin-ak",
            admin_secret_key="admin-sk",
        )
    )
    yield broker
    await broker.stop(0.2)


async def test_unsigned_calls_are_unauthorized_and_signed_ones_served(signed_broker: app.Broker) -> None:
    async with grpc.aio.insecure_channel(signed_broker.endpoint) as channel:
        stub = service_pb2_grpc.MessagingServiceStub(channel)
        unsigned = await stub.QueryRoute(ROUTE)
        assert unsigned.status.code == pb.UNAUTHORIZED
        wrong = await stub.QueryRoute(ROUTE, metadata=auth.sign_metadata("ak", "other", datetime.now()))
        assert wrong.status.code == pb.UNAUTHORIZED
        signed = await stub.QueryRoute(ROUTE, metadata=auth.sign_metadata("ak", "sk", datetime.now()))
        assert signed.status.code == pb.OK


async def test_the_admin_service_needs_the_admin_pair_not_the_client_pair(signed_broker: app.Broker) -> None:
    async with grpc.aio.insecure_channel(signed_broker.endpoint) as channel:
        admin = admin_pb2_grpc.LmqAdminStub(channel)
        for metadata in ((), auth.sign_metadata("ak", "sk", datetime.now())):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await admin.ListParentTopics(admin_pb2.ListParentTopicsRequest(), metadata=metadata)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "admin key pair" in (refused.value.details() or "")
        listed = await admin.ListParentTopics(
            admin_pb2.ListParentTopicsRequest(), metadata=auth.sign_metadata("admin-ak", "admin-sk", datetime.now())
        )
        assert [t.topic.name for t in listed.topics] == ["AGENT_TASK_NS"]
        v2 = service_pb2_grpc.MessagingServiceStub(channel)  # and the admin pair is not a client's
        route = await v2.QueryRoute(ROUTE, metadata=auth.sign_metadata("admin-ak", "admin-sk", datetime.now()))
        assert route.status.code == pb.UNAUTHORIZED


async def test_with_client_auth_off_admin_still_needs_the_generated_pair(tmp_path: Path) -> None:
    data = tmp_path / "data"
    broker = await running(config_for(data, host="127.0.0.1", port=0, metrics_port=-1))
    try:
        pair = credentials.read(credentials.path_in(data))
        async with grpc.aio.insecure_channel(broker.endpoint) as channel:
            route = await service_pb2_grpc.MessagingServiceStub(channel).QueryRoute(ROUTE)
            assert route.status.code == pb.OK  # v2 clients stay open
            admin = admin_pb2_grpc.LmqAdminStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await admin.ListParentTopics(admin_pb2.ListParentTopicsRequest())
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            signed = auth.sign_metadata(pair.access_key, pair.secret_key, datetime.now())
            listed = await admin.ListParentTopics(admin_pb2.ListParentTopicsRequest(), metadata=signed)
            assert [t.topic.name for t in listed.topics] == ["AGENT_TASK_NS"]
    finally:
        await broker.stop(0.2)


def self_signed(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "tls.crt", directory / "tls.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert),
        ],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


async def test_tls(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    broker = await running(
        config_for(tmp_path / "data", host="127.0.0.1", port=0, metrics_port=-1, tls_cert=cert, tls_key=key)
    )
    try:
        credentials = grpc.ssl_channel_credentials(cert.read_bytes())
        async with grpc.aio.secure_channel(broker.endpoint, credentials) as channel:
            reply = await service_pb2_grpc.MessagingServiceStub(channel).QueryRoute(ROUTE, timeout=10)
            assert reply.status.code == pb.OK
        async with grpc.aio.insecure_channel(broker.endpoint) as plain:
            with pytest.raises(grpc.aio.AioRpcError):
                await service_pb2_grpc.MessagingServiceStub(plain).QueryRoute(ROUTE, timeout=5)
    finally:
        await broker.stop(0.2)
