"""A harness to serve the admin service in-process: for tests of the admin plane and of its callers.

The server runs its own event loop in a thread (as the broker does in its process), so tests call it
with the blocking ``AdminClient``, as the CLI and the reclaim job do. Seeding helpers write
through the real ``Store`` API; the live view is the in-memory ``StaticLiveView``. ``serve_admin`` serves the
service to anyone unless given ``admin_keys`` (the service itself is what most of these tests are about):
admin auth is tested with them in tests/admin/test_auth.py and on the broker process.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from lmq_broker import model
from lmq_broker.admin import client, service
from lmq_broker.admin.client import AdminClient
from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch.api import ClientView, StaticLiveView
from lmq_broker.storage.api import Store

CALL_TIMEOUT_S = 30.0


class LoopThread(client.LoopThread):
    """A loop in its own thread for servers under test; ``run`` gives up after ``CALL_TIMEOUT_S``."""

    def __init__(self) -> None:
        super().__init__("admin-test-loop", CALL_TIMEOUT_S)


@dataclass
class Server:
    """A grpc.aio server with whatever the test registers, on 127.0.0.1:<port 0>."""

    loop: LoopThread
    server: grpc.aio.Server
    port: int

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.loop.run(self.server.stop(None))


def start_server(
    loop: LoopThread, register: Callable[[grpc.aio.Server], None], interceptors: Sequence[Any] = ()
) -> Server:
    async def start() -> Server:
        server = grpc.aio.server(interceptors=list(interceptors))
        register(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return Server(loop, server, port)

    return loop.run(start())


@dataclass
class Broker:
    server: Server
    store: Store
    live: StaticLiveView
    config: BrokerConfig
    _clients: list[AdminClient] = field(default_factory=list)
    _ids: Iterator[int] = field(default_factory=itertools.count)

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def client(self, **options: Any) -> AdminClient:
        admin = AdminClient(self.endpoint, options.pop("timeout_s", 10.0), **options)
        self._clients.append(admin)
        return admin

    def send(self, parent: str, lite: str, count: int = 1) -> list[model.AppendResult]:
        """Store ``count`` LITE messages, indexed in the parent's queue and the lite topic's LMQ."""
        messages = [
            model.NewMessage(
                message_id=uuid.uuid4().hex,
                topic=parent,
                body=f"m{next(self._ids)}".encode(),
                queues=(model.QueueId(parent, 0), model.QueueId.lmq(parent, lite)),
                lite_topic=lite,
                message_type=model.MessageType.LITE,
            )
            for _ in range(count)
        ]
        return self.store.append(messages)

    def consume(self, parent: str, lite: str, group: str, offset: int) -> None:
        self.store.commit_offset(model.QueueId.lmq(parent, lite), group, offset)

    def subscribe(self, parent: str, lite: str, *client_ids: str) -> None:
        self.live.subs.setdefault(model.QueueId.lmq(parent, lite), []).extend(client_ids)

    def connect(self, client_id: str, group: str, topic: str, subscriptions: int = 0) -> None:
        self.live.client_views.append(ClientView(client_id, group, topic, 5, subscriptions, 1_000, 0))

    def close(self) -> None:
        for admin in self._clients:
            admin.close()
        self.server.stop()


def serve_admin(
    loop: LoopThread,
    store: Store,
    config: BrokerConfig,
    interceptors: Sequence[Any] = (),
    admin_keys: tuple[str, str] | None = None,
) -> Broker:
    """The admin service over ``store`` on a fresh port; ``Broker.close`` stops it (not the store)."""
    live = StaticLiveView(store=store)
    server = start_server(loop, lambda s: service.register(s, store, live, config, admin_keys=admin_keys), interceptors)
    return Broker(server, store, live, config)
