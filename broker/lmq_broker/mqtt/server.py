"""The MQTT listener (``--mqtt-port``, off by default): accepts connections and keeps one per client id.

It shares the broker's dispatcher, so MQTT and the RocketMQ clients meet in the same store, ready set and
offsets (docs/mqtt.md). In a cluster it is given ``owners`` (``mqtt.owners``): publishes are stored at their
lite topics' owners, as gRPC sends are. With ``--tls-cert`` the listener speaks TLS like the gRPC port.
Stopping the broker ends every connection without publishing wills: the broker going away is not the client
failing.

It also keeps what outlives a connection in memory: MQTT 5 wills waiting for their delay (cancelled when
the client id connects again), and a sweep that drops persistent sessions past their expiry interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from typing import Final

from lmq_broker import errors
from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch import wildcards
from lmq_broker.dispatch.dispatcher import Dispatcher
from lmq_broker.mqtt import codec, durable, matching
from lmq_broker.mqtt.connection import Connection
from lmq_broker.mqtt.owners import Owners
from lmq_broker.mqtt.properties import Reason

log = logging.getLogger(__name__)

STOP_GRACE_S: Final = 5.0
EXPIRY_SWEEP_S: Final = 60.0  # how often sessions past their expiry interval are dropped


class MqttServer:
    def __init__(self, dispatcher: Dispatcher, config: BrokerConfig, owners: Owners | None = None) -> None:
        self.dispatcher = dispatcher
        self.owners = owners  # a cluster's: publishes are stored at their lite topics' owners (None: alone)
        self.config = config
        self.durable = durable.Durable(config.store.data_dir)
        self.port = 0
        self.stopping = False
        self._server: asyncio.Server | None = None
        self._clients: dict[str, Connection] = {}  # client id -> its connection
        self._tasks: set[asyncio.Task[None]] = set()
        self._wills: dict[str, tuple[asyncio.Task[None], Connection, codec.Will]] = {}  # client id -> delayed will
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int) -> int:
        context = None
        if self.config.tls_cert is not None and self.config.tls_key is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(self.config.tls_cert, self.config.tls_key)
        await self.dispatcher.run(self.durable.all_gone, self.dispatcher.wall_clock())
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        self._server = await asyncio.start_server(self._accept, host, port, ssl=context)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("mqtt listening on %s:%d%s", host, self.port, " (TLS)" if context else "")
        return self.port

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.stopping:
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await Connection(self, reader, writer).run()
        finally:
            self._tasks.discard(task)

    async def take_over(self, connection: Connection, clean_start: bool) -> None:
        """``connection`` now owns its client id; a connection that held it is ended first (MQTT-3.1.4-2).
        A delayed will of the client id is dropped, or published at once when the session ends (clean start)."""
        while (other := self._clients.get(connection.client_id)) is not None and other is not connection:
            log.info("mqtt client %s connected again from %s: ending its older connection", other.client_id,
                     connection.peer)  # fmt: skip
            await other.kick()
        self._clients[connection.client_id] = connection
        pending = self._wills.pop(connection.client_id, None)
        if pending is not None:
            task, before, will = pending
            task.cancel()
            if clean_start:  # the old session ends now, and its will's wait with it (5.0 section 3.1.3.2.2)
                await before.publish_will(will)

    async def retained(
        self, parent: str, levels: wildcards.Filter, limit: int = matching.RETAINED_LIMIT
    ) -> tuple[list[durable.Retained], bool]:
        """The retained messages this broker holds that ``levels`` matches (another broker's session asks,
        ``MqttRetained``), clears kept as tombstones included, at most ``limit``, and whether more matched."""
        if self.stopping:
            raise errors.BrokerUnavailable("the broker is shutting down")
        now = self.dispatcher.wall_clock()
        return await self.dispatcher.run(matching.retained, self.durable, parent, levels, now, limit, True)

    def owner(self, client_id: str) -> Connection | None:
        return self._clients.get(client_id)

    def delay_will(self, connection: Connection, will: codec.Will, delay_s: int) -> None:
        """Publish ``connection``'s will after ``delay_s`` (5.0 will delay), unless its client id comes back."""
        client_id = connection.client_id

        async def later() -> None:
            await asyncio.sleep(delay_s)
            self._wills.pop(client_id, None)
            await connection.publish_will(will)

        task = asyncio.get_running_loop().create_task(later())
        self._wills[client_id] = (task, connection, will)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_SWEEP_S)
            try:
                dropped = await self.dispatcher.run(self.durable.expire_sessions, self.dispatcher.wall_clock())
            except Exception:
                log.exception("mqtt: session expiry sweep failed")
                continue
            if dropped:
                log.info("mqtt: %d sessions past their expiry interval dropped", dropped)

    def forget(self, connection: Connection) -> None:
        if self._clients.get(connection.client_id) is connection:
            del self._clients[connection.client_id]

    def connection_count(self) -> int:
        return len(self._tasks)

    async def stop(self) -> None:
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for task in [*(w[0] for w in self._wills.values()), *([self._sweeper] if self._sweeper else [])]:
            task.cancel()
        self._wills.clear()
        for connection in list(self._clients.values()):
            connection.close(Reason.SERVER_SHUTTING_DOWN, "the broker is shutting down")
        if self._tasks:
            _, late = await asyncio.wait(list(self._tasks), timeout=STOP_GRACE_S)
            for task in late:
                task.cancel()
            for task in late:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        await asyncio.to_thread(self.durable.close)
