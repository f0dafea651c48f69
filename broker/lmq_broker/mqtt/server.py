"""The MQTT listener (``--mqtt-port``, off by default): accepts connections and keeps one per client id.

It shares the broker's dispatcher, so MQTT and the RocketMQ clients meet in the same store, ready set and
offsets (docs/mqtt.md). In a cluster it is given ``owners`` (``mqtt.owners``): publishes are stored at their
lite topics' owners, as gRPC sends are. With ``--tls-cert`` the listener speaks TLS like the gRPC port.
Stopping the broker ends every connection without publishing wills: the broker going away is not the client
failing. A broker killed with connections open publishes their wills after its restart (``durable`` armed
rows, MQTT-3.1.2-8), after their delay from then.

Connections see it through ``host.Host`` (this module imports theirs, never the reverse).

It also runs what outlives a connection: MQTT 5 wills waiting for their delay (kept in the durable store,
``wills``; cancelled when the client id connects again), and a sweep that drops persistent sessions past their
expiry interval. It counts the sockets open, in all and per client address, and refuses those over the caps
(``limits``) before they cost a connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Final

from lmq_broker import errors
from lmq_broker.access.control import AccessControl
from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch import wildcards
from lmq_broker.dispatch.dispatcher import Dispatcher
from lmq_broker.mqtt import (
    authorizing,
    codec,
    durable,
    following,
    framing,
    host,
    limits,
    matching,
    session_cap,
    shares,
    stats,
    storing,
    topics,
    wills,
)
from lmq_broker.mqtt.connection import Connection
from lmq_broker.mqtt.owners import Owners
from lmq_broker.mqtt.properties import Reason

log = logging.getLogger(__name__)

STOP_GRACE_S: Final = 5.0
EXPIRY_SWEEP_S: Final = 60.0  # how often sessions past their expiry interval are dropped


class MqttServer:
    def __init__(
        self,
        dispatcher: Dispatcher,
        config: BrokerConfig,
        owners: Owners | None = None,
        access: AccessControl | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.access = access or AccessControl(False)  # users and policies (--acl): ``mqtt.authorizing``
        self.owners = owners  # a cluster's: publishes are stored at their lite topics' owners (None: alone)
        self.config = config
        self.durable = durable.Durable(config.store.data_dir, config.mqtt_max_session_expiry_s)
        self.port = 0
        self.stopping = False
        self._server: asyncio.Server | None = None
        self._clients: dict[str, host.Client] = {}  # client id -> its connection
        self._tasks: set[asyncio.Task[None]] = set()
        self.stats = stats.Stats()
        self.sockets = limits.Sockets(config)
        self.sessions = session_cap.Sessions(config, self.durable)
        self.read_budget = framing.Budget(  # large packets being read, in all and per client address
            config.mqtt_max_read_bytes, config.mqtt_max_read_bytes_per_address, config.mqtt_min_read_rate
        )
        self.share_members = shares.Members(config.mqtt_max_share_members)  # shared subscriptions' members here
        self.wills = wills.Wills(self.durable, dispatcher, self._publish_will, self.stats)
        self._sweeper: asyncio.Task[None] | None = None
        self._rechecking: asyncio.Task[None] | None = None  # the sessions' filters checked after an access change
        self._recheck_again = False
        self._watcher: Callable[[], object] | None = None
        self.followers = following.Followers(dispatcher)
        # --replicas: until the rows changed so far are on the in-sync followers (``stating.flushed``)
        self.replicated: Callable[[], Awaitable[bool]] | None = None

    async def start(self, host: str, port: int) -> int:
        context = None
        if self.config.tls_cert is not None and self.config.tls_key is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(self.config.tls_cert, self.config.tls_key)
        await self.dispatcher.run(self.durable.all_gone, self.dispatcher.wall_clock())
        # the wills of the connections the last run ended without an end of theirs (killed): due after their delay
        fired = await self.dispatcher.run(self.durable.fire_armed, self.dispatcher.wall_clock())
        if fired:
            log.info("mqtt: %d wills of connections that ended with the broker's last run to be published", fired)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        self.wills.start()
        if self.access.enabled:
            loop = asyncio.get_running_loop()
            self._watcher = watcher = lambda: loop.call_soon_threadsafe(self._access_changed)
            self.access.watch(watcher)
        await self.followers.start()
        self._server = await asyncio.start_server(self._accept, host, port, ssl=context)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("mqtt listening on %s:%d%s", host, self.port, " (TLS)" if context else "")
        return self.port

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.stopping:
            writer.close()
            return
        peer = writer.get_extra_info("peername")
        address = peer[0] if isinstance(peer, tuple) else str(peer or "")
        over = self.sockets.admit(address)
        if over is not None:
            await self._refuse(reader, writer, over)
            return
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await Connection(self, reader, writer).run()
        finally:
            self._tasks.discard(task)
            self.sockets.release(address)

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, over: str) -> None:
        """A socket over a cap: its CONNECT answered with a refusal while few are (else closed at once)."""
        sockets = self.sockets
        if sockets.refusing >= limits.REFUSING_MAX:
            self.stats.refused[stats.UNANSWERED] += 1
            writer.close()
            return
        self.stats.refused[over] += 1
        cap = "--mqtt-max-connections" if over == stats.CONNECTIONS else "--mqtt-max-connections-per-address"
        sockets.refusing += 1
        try:
            await limits.refuse_socket(reader, writer, f"{cap} reached")
        finally:
            sockets.refusing -= 1

    async def take_over(self, connection: host.Client, clean_start: bool) -> None:
        """``connection`` now owns its client id; a connection that held it is ended first (MQTT-3.1.4-2).
        A delayed will of the client id is dropped, or published at once when the session ends (clean start)."""
        while (other := self._clients.get(connection.client_id)) is not None and other is not connection:
            log.info("mqtt client %s connected again from %s: ending its older connection", other.client_id,
                     connection.peer)  # fmt: skip
            await other.kick()
        self._clients[connection.client_id] = connection
        pending = await self.wills.take(connection.client_id)
        if pending is not None and clean_start:  # the old session ends now, its will's wait with it (5.0 3.1.3.2.2)
            host, will = pending
            await self._publish_will(connection.client_id, host, will)

    async def rows_saved(self, client_id: str, what: str) -> None:
        if self.replicated is not None and not await self.replicated():
            log.warning("mqtt client %s: a change of %s is answered before it reached every in-sync replica "
                        "(a failover right now may find it as it was)", client_id, what)  # fmt: skip

    async def _publish_will(self, client_id: str, host: str, will: codec.Will) -> bool:
        return await storing.publish_will(self, client_id, host, will)

    async def retained(
        self, parent: str, levels: wildcards.Filter, limit: int = matching.RETAINED_LIMIT
    ) -> tuple[list[durable.Retained], bool]:
        """The retained messages this broker holds that ``levels`` matches (another broker's session asks,
        ``MqttRetained``), clears kept as tombstones included, at most ``limit``, and whether more matched."""
        if self.stopping:
            raise errors.BrokerUnavailable("the broker is shutting down")
        now = self.dispatcher.wall_clock()
        default = self.config.mqtt_default_parent
        return await self.dispatcher.run(matching.retained, self.durable, parent, levels, now, limit, True, default)

    def authorize_publish(self, user: str, address: str, where: topics.Topic) -> None:
        """Under ``--acl``: ``errors.Forbidden`` unless ``user`` may publish to the lite topic ``where`` (the
        publish's topic as the broker's topic space maps it, ``topics.Space``; ``authorizing``)."""
        authorizing.publish(self.access, user, address, where)

    def authorize_subscribe(self, user: str, address: str, parent: str, levels: wildcards.Filter) -> None:
        """Under ``--acl``: ``errors.Forbidden`` unless ``user`` may subscribe to the filter."""
        authorizing.subscribe(self.access, user, address, parent, levels)

    def owner(self, client_id: str) -> host.Client | None:
        return self._clients.get(client_id)

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

    def _access_changed(self) -> None:
        """A user or policy changed: every session's filters checked again (one pass at a time; a change during
        a pass: one more)."""
        if self.stopping:
            return
        if self._rechecking is not None and not self._rechecking.done():
            self._recheck_again = True
            return
        self._rechecking = asyncio.get_running_loop().create_task(self._recheck_all())

    async def _recheck_all(self) -> None:
        while True:
            self._recheck_again = False
            saved = 0
            for connection in list(self._clients.values()):
                try:
                    saved += await connection.recheck()
                except Exception:
                    log.exception("mqtt client %s: subscriptions not checked again", connection.client_id)
            if saved:  # the rewritten sessions on the replicas, waited for once (a failover keeps no ended filter)
                await self.rows_saved(f"{saved} sessions", "their filters after an access change")
            if not self._recheck_again:
                return

    def forget(self, connection: host.Client) -> None:
        if self._clients.get(connection.client_id) is connection:
            del self._clients[connection.client_id]

    def sockets_open(self) -> int:
        return self.sockets.total

    def connection_count(self) -> int:
        return len(self._tasks)

    async def stop(self) -> None:
        self.stopping = True
        if self._server is not None:
            self._server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._watcher is not None:
            self.access.unwatch(self._watcher)
        if self._rechecking is not None:
            self._rechecking.cancel()
        await self.followers.stop()
        await self.wills.stop()  # the wills waiting stay in the store: a restarted broker publishes them
        for connection in list(self._clients.values()):
            connection.close(Reason.SERVER_SHUTTING_DOWN, "the broker is shutting down")
        if self._tasks:
            _, late = await asyncio.wait(list(self._tasks), timeout=STOP_GRACE_S)
            for task in late:
                task.cancel()
            if late:  # their ends (asyncio's stream callback sees them); a cancellation of this wait goes on up
                await asyncio.wait(late)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        try:
            left = await asyncio.to_thread(self.durable.disarm_all)
        except Exception:  # then published after the next start (at least once)
            self.stats.errors[stats.WILL_WRITE] += 1
            log.exception("mqtt: the wills of the connections ended by the stop not dropped")
        else:
            if left:
                log.warning("mqtt: %d will(s) left armed by connection ends the stop cut short, dropped", left)
        await asyncio.to_thread(self.durable.close)
