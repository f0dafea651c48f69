"""Optional TLS and request signing, on a real server (the signing itself is protocol.auth's, tested there;
here: that the broker wires the client pair for the v2 service, its admin pair for the admin service, and
serves TLS, on both edges of the client port: grpcio's and the native one, docs/design/native-edge.md)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from lmq_broker import app, testing
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


EDGES = pytest.mark.parametrize("edge", ["grpcio", "native"])


@EDGES
async def test_tls(tmp_path: Path, edge: str) -> None:
    cert, key = self_signed(tmp_path)
    broker = await running(
        config_for(tmp_path / "data", host="127.0.0.1", port=0, metrics_port=-1, tls_cert=cert, tls_key=key, edge=edge)
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


async def test_an_admin_port_serves_admin_alone_and_the_client_port_no_admin(tmp_path: Path) -> None:
    """--admin-port: what a network policy needs to open the client port to all and admin to the control plane."""
    broker = await running(
        config_for(
            tmp_path / "data",
            host="127.0.0.1",
            port=0,
            admin_port=0,
            metrics_port=-1,
            admin_access_key="admin-ak",
            admin_secret_key="admin-sk",
        )
    )
    try:
        assert broker.admin_port not in (0, broker.port)
        signed = auth.sign_metadata("admin-ak", "admin-sk", datetime.now())
        async with grpc.aio.insecure_channel(broker.endpoint) as client_port:
            route = await service_pb2_grpc.MessagingServiceStub(client_port).QueryRoute(ROUTE)
            assert route.status.code == pb.OK
            with pytest.raises(grpc.aio.AioRpcError) as absent:
                await admin_pb2_grpc.LmqAdminStub(client_port).ListParentTopics(
                    admin_pb2.ListParentTopicsRequest(), metadata=signed
                )
            assert absent.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert f"on port {broker.admin_port} (--admin-port)" in (absent.value.details() or "")
        async with grpc.aio.insecure_channel(broker.admin_endpoint) as admin_port:
            admin = admin_pb2_grpc.LmqAdminStub(admin_port)
            listed = await admin.ListParentTopics(admin_pb2.ListParentTopicsRequest(), metadata=signed)
            assert [t.topic.name for t in listed.topics] == ["AGENT_TASK_NS"]
            with pytest.raises(grpc.aio.AioRpcError) as unsigned:  # its own port, the same admin pair
                await admin.ListParentTopics(admin_pb2.ListParentTopicsRequest())
            assert unsigned.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as no_v2:
                await service_pb2_grpc.MessagingServiceStub(admin_port).QueryRoute(ROUTE)
            assert no_v2.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await broker.stop(0.2)
    assert broker.admin_port != 0  # both listeners closed by stop: a new broker may take the ports again
    again = await running(
        config_for(tmp_path / "data", host="127.0.0.1", port=broker.port, admin_port=broker.admin_port, metrics_port=-1)
    )
    await again.stop(0.2)


async def _served_by(endpoint: str, ca: Path, server_name: str) -> grpc.StatusCode:
    """The status of an admin call over TLS trusting ``ca`` for ``server_name`` (UNAVAILABLE: handshake refused)."""
    creds = grpc.ssl_channel_credentials(ca.read_bytes())
    options = (("grpc.ssl_target_name_override", server_name),)
    async with grpc.aio.secure_channel(endpoint, creds, options=options) as channel:
        try:
            await admin_pb2_grpc.LmqAdminStub(channel).ListParentTopics(admin_pb2.ListParentTopicsRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


@EDGES
async def test_tls_on_both_listeners_follows_a_renewed_certificate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, edge: str
) -> None:
    """A renewed Secret (the kubelet swaps the mounted files) is served without a restart; a pair that does not
    load leaves the served one in place. The client port is ``edge``'s, the admin port grpcio's."""
    first = testing.issue_certificate(tmp_path / "old", "lmq-broker.mq.svc")
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    cert, key = mounted / "tls.crt", mounted / "tls.key"
    shutil.copy(first.cert, cert)
    shutil.copy(first.key, key)
    broker = await running(
        config_for(
            tmp_path / "data",
            host="127.0.0.1",
            port=0,
            admin_port=0,
            metrics_port=-1,
            admin_anonymous=True,
            tls_cert=cert,
            tls_key=key,
            edge=edge,
        )
    )
    ports = (broker.endpoint, broker.admin_endpoint)
    # TLS, and the admin service on its port only
    answers = {broker.endpoint: grpc.StatusCode.UNIMPLEMENTED, broker.admin_endpoint: grpc.StatusCode.OK}
    try:
        for endpoint in ports:
            assert await _served_by(endpoint, first.ca, "lmq-broker.mq.svc") == answers[endpoint]
        for endpoint in ports:
            assert await _served_by(endpoint, first.ca, "other.name") == grpc.StatusCode.UNAVAILABLE

        renewed = testing.issue_certificate(tmp_path / "new", "lmq-broker.mq.svc")  # another CA, too
        swap = tmp_path / "swap"
        swap.mkdir()
        shutil.copy(renewed.cert, swap / "tls.crt")
        shutil.copy(renewed.key, swap / "tls.key")
        os.replace(swap / "tls.crt", cert)
        os.replace(swap / "tls.key", key)
        for endpoint in ports:
            assert await _served_by(endpoint, renewed.ca, "lmq-broker.mq.svc") == answers[endpoint]
            assert await _served_by(endpoint, first.ca, "lmq-broker.mq.svc") == grpc.StatusCode.UNAVAILABLE

        shutil.copy(first.key, swap / "tls.key")  # a key that does not match the certificate
        os.replace(swap / "tls.key", key)
        with caplog.at_level(logging.WARNING, logger="lmq_broker.protocol"):
            for _ in range(3):
                for endpoint in ports:
                    assert await _served_by(endpoint, renewed.ca, "lmq-broker.mq.svc") == answers[endpoint]
        refusals = [r for r in caplog.records if "not reloaded" in r.getMessage()]
        assert len(refusals) == 2, refusals  # once per listener, not at every handshake
    finally:
        await broker.stop(0.2)
