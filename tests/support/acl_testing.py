"""For the access-control tests: two whole ``--acl`` brokers of one cluster in this process (real ports, real
stores) with one LITE parent topic, called as the admin pair; one ``--acl`` broker process."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

import grpc
from mqtt_brokers import start_brokers, stop_brokers

from lmq_broker import app, model
from lmq_broker.admin.client import AdminClient
from lmq_broker.protocol import auth
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2_grpc as admin_grpc
from lmq_broker.testing import BrokerProcess, start_broker

ADMIN: Final = ("admin-ak", "admin-sk")  # the pair ``start_brokers`` gives them


@contextlib.asynccontextmanager
async def acl_cluster(root: Path, parent: str) -> AsyncIterator[list[app.Broker]]:
    """Two brokers under ``root`` (slot order, MQTT on too), each holding the LITE parent ``parent``; stopped at the
    end however it ends."""
    started = await start_brokers(root, parent, [{"acl": True}, {"acl": True}])
    try:
        yield started
    finally:
        await stop_brokers(started)


async def admin_call(broker: app.Broker, method: str, request: object) -> object:
    """``method`` of the admin service, signed by the admin pair."""
    async with grpc.aio.insecure_channel(broker.endpoint) as channel:
        stub = admin_grpc.LmqAdminStub(channel)
        return await getattr(stub, method)(request, metadata=auth.sign_metadata(*ADMIN, datetime.now(UTC)))


def start_acl_broker(data_dir: Path, parent: str, *extra_args: str) -> BrokerProcess:
    """``serve --acl`` (and ``extra_args``) as a process, holding the LITE parent ``parent``."""
    process = start_broker(data_dir, extra_args=["--acl", *extra_args])
    with AdminClient(process.admin_endpoint, timeout_s=10, **process.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic(parent, model.MessageType.LITE))
    return process
