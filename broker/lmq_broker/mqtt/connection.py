"""One MQTT network connection: CONNECT, then publishes in and deliveries out, through the dispatcher.

This module is the connection's life (handshake, the reader, the end) and the dispatch of packets read; its
parts share a ``link.Link``: ``handshake`` reads and settles the CONNECT, ``publishing`` stores the client's
publishes and answers them, ``subscribing`` keeps its subscriptions registered, ``delivering`` writes the
messages out and settles them, ``releasing`` completes QoS 2 deliveries (PUBREC, PUBREL, PUBCOMP). They
reach the listener only through ``host.Host``.

MQTT 5 on the same path (chosen by the CONNECT's level, ``link.v5``): what 3.1.1 can only answer by closing
gets a reason code (a negative PUBACK, a SUBACK code, a DISCONNECT before closing); the session lives as long
as its expiry interval (3.1.1: clean = 0, persistent = --mqtt-max-session-expiry-s; 5.0: at most that); the
client's receive maximum bounds the QoS 1 deliveries waiting for PUBACKs, ours bounds its unacknowledged
publishes; properties travel as message properties (``mapping``). Ending the connection gives back what was
handed out and not acknowledged, so a reconnected session gets it again at once (with DUP set).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Final

from lmq_broker.mqtt import authorizing, codec, durable, framing, handshake, limits, properties, stats, storing
from lmq_broker.mqtt.delivering import Deliveries
from lmq_broker.mqtt.handshake import group_of
from lmq_broker.mqtt.host import Host
from lmq_broker.mqtt.link import Closed, Link
from lmq_broker.mqtt.properties import Reason
from lmq_broker.mqtt.publishing import Publishes
from lmq_broker.mqtt.releasing import Releases
from lmq_broker.mqtt.subscribing import Subscriptions

__all__ = ["Closed", "Connection", "group_of"]

log = logging.getLogger(__name__)

KEEP_ALIVE_GRACE: Final = 1.5  # MQTT-3.1.2-24: one and a half keep-alive periods without a packet ends it
UNREAD_ANSWERS_BYTES: Final = 64 * 1024  # written and not yet taken by the socket: the client's reads wait beyond
TAKEN_CHECK_S: Final = 1.0  # meanwhile, whether the client took any of it (then it counts as alive) this often


class Connection:
    def __init__(self, host: Host, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.host = host
        self.link = Link(host, reader, writer)
        self.deliveries = Deliveries(self.link)
        self.subscriptions = Subscriptions(self.link, self.deliveries)
        self.publishes = Publishes(self.link)
        self.releases = Releases(self.link, self.deliveries)
        self.will: codec.Will | None = None
        self.keep_alive_s = 0
        self.done = asyncio.Event()
        self._armed = ""  # the key of its will's ``durable`` row while the connection lives ("": none)
        self._handling = asyncio.Lock()  # a packet being handled, or a recheck of the subscriptions

    @property
    def client_id(self) -> str:
        return self.link.client_id

    @property
    def peer(self) -> str:
        return self.link.peer

    # --- life ------------------------------------------------------------------------------------------------
    async def run(self) -> None:
        graceful, reason, code = False, "connection lost", None
        try:
            if await self._handshake():
                await self._serve()
        except Closed as exc:
            graceful, reason, code = exc.graceful, str(exc), exc.code
        except codec.MalformedPacket as exc:
            reason, code = f"malformed packet: {exc.reason}", exc.code
        except framing.OverBudget as exc:
            per_address = exc.flag == "--mqtt-max-read-bytes-per-address"
            self.host.stats.refused[stats.READ_BYTES_PER_ADDRESS if per_address else stats.READ_BYTES] += 1
            reason, code = f"refused: {exc} ({exc.flag})", Reason.QUOTA_EXCEEDED
        except framing.TooSlow as exc:
            self.host.stats.refused[stats.READ_RATE] += 1
            reason = f"refused: {exc}, under --mqtt-min-read-rate ({self.host.read_budget.min_rate} bytes/s)"
            code = Reason.QUOTA_EXCEEDED
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError) as exc:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        except asyncio.CancelledError:  # the broker, not the client, ends it: no will (docs/mqtt.md)
            await self._end(True, "broker shutting down", None)
            raise  # the cancellation is the caller's to see
        except Exception:
            log.exception("mqtt client %s (%s): connection failed", self.client_id or "?", self.peer)
            code = Reason.UNSPECIFIED_ERROR
        await self._end(graceful, reason, code)

    async def kick(self) -> None:
        """Another connection took this client id (MQTT-3.1.4-2): end this one and wait until it has."""
        self.link.kicked = True
        self.close(Reason.SESSION_TAKEN_OVER, "another connection took the client id")
        try:
            async with asyncio.timeout(framing.LINGER_S):
                await self.done.wait()
        except TimeoutError:  # its client reads nothing: the socket cannot flush, nor the connection end
            self.link.writer.transport.abort()
            await self.done.wait()

    async def recheck(self) -> bool:
        """Access control changed (``--acl``): the filters the user may no longer read end, between packets;
        whether its persistent session's row was written (not yet waited for on the replicas)."""
        if not self.link.connected.is_set() or self.link.closing:
            return False  # a handshake under way checks a resumed session's filters itself
        async with self._handling:
            return await authorizing.revoke(self.host.access, self.subscriptions)

    def close(self, code: int, why: str = "") -> None:
        """Close the socket; a 5.0 client is told why first (a DISCONNECT with ``code``)."""
        self.link.close(code, why)

    async def _handshake(self) -> bool:
        link = self.link
        connect = await handshake.read_connect(link)
        if connect is None:
            return False
        link.v5 = connect.level == codec.LEVEL_5
        link.level = connect.level
        await handshake.refuse(link, connect)
        acked = handshake.settle(link, connect)
        clean_start = connect.clean_session
        self.will = connect.will
        self.keep_alive_s = limits.keep_alive_s(connect, link.config)  # the client's, or our cap
        clean_start, owned = await handshake.open_session(link, clean_start)  # another user's: fresh (--acl)
        reserved = await handshake.admit_session(link)  # a new persistent session past --mqtt-max-sessions: refused
        try:
            session_present = await self._open(clean_start, owned)
        finally:
            if reserved:
                self.host.sessions.made(link.client_id)
        await self._arm()
        link.writer.write(codec.encode_connack(session_present, codec.ConnectCode.ACCEPTED, connect.level, acked))
        await self.releases.resend()  # MQTT-4.4.0-1: a resumed session's PUBRELs (and retained), after its CONNACK
        link.connected.set()
        await link.writer.drain()
        log.info("mqtt client %s connected from %s (MQTT %s, clean start %s, session expiry %s, session present %s)",
                 link.client_id, link.peer, "5.0" if link.v5 else "3.1.1", clean_start, link.expiry_s,
                 session_present)  # fmt: skip
        self.publishes.start()
        return True

    async def _open(self, clean_start: bool, owned: bool) -> bool:
        """The client id taken over, its stored session resumed or dropped, a persistent one written; whether
        one was resumed (CONNACK session present)."""
        link = self.link
        await self.host.take_over(self, clean_start)
        session_present = False
        durable_ = self.host.durable
        saved = await link.dispatcher.run(durable_.load_session, link.client_id, link.dispatcher.wall_clock())
        if clean_start and saved is not None:
            await link.dispatcher.run(durable_.drop_session, link.client_id)  # MQTT-3.1.2-6
        elif saved is not None:
            session_present = link.stored = True
            await self.publishes.resume()
            await self.releases.resume()  # before the deliveries start: their packet ids stay taken
            await self.subscriptions.restore(saved)
            await authorizing.revoke(self.host.access, self.subscriptions)  # what its user may still read
        if link.persistent:
            await self.subscriptions.save()  # a persistent session exists from its CONNECT on, subscribed or not
            if owned:
                await link.dispatcher.run(durable_.own_session, link.client_id, link.user)
        return session_present

    async def _serve(self) -> None:
        idle_s = self.keep_alive_s * KEEP_ALIVE_GRACE if self.keep_alive_s else None
        try:
            async with asyncio.timeout(None) as alive:
                keep_alive = framing.KeepAlive(alive, idle_s) if idle_s else None
                try:
                    await self._read_loop(keep_alive, idle_s or framing.STALL_S)
                finally:
                    if keep_alive is not None:
                        keep_alive.stop()
        except TimeoutError:
            raise Closed("keep alive timeout", code=Reason.KEEP_ALIVE_TIMEOUT) from None

    async def _read_loop(self, keep_alive: framing.KeepAlive | None, stall_s: float) -> None:
        link = self.link
        limit = link.max_packet_bytes()
        progress = keep_alive.reading if keep_alive is not None else None
        while True:
            if keep_alive is not None:
                keep_alive.reading()
            frame = await framing.read_frame(
                link.reader, limit, self.host.read_budget, stall_s, progress, address=link.address
            )
            if keep_alive is not None:
                keep_alive.handling()
            if self.publishes.failure is not None:
                raise Closed(f"publish failed: {self.publishes.failure}", code=Reason.UNSPECIFIED_ERROR)
            if frame is None:
                if self.host.stopping:
                    raise Closed("the broker is shutting down", graceful=True)
                raise Closed("taken over by a newer connection" if link.kicked else "closed without DISCONNECT")
            async with self._handling:
                await self._handle(codec.decode_packet(frame[0], frame[1], link.level))
            if link.writer.transport.get_write_buffer_size() > UNREAD_ANSWERS_BYTES:
                await self._until_taken(keep_alive)

    async def _until_taken(self, keep_alive: framing.KeepAlive | None) -> None:
        """Read no further until the client took what waits for it: a client that sends and never reads would
        pile its answers (PINGRESP, PUBACK, SUBACK...) up here without bound. Its keep-alive runs meanwhile and
        ends it; a client that takes some of it within each check (a slow link taking large deliveries) counts
        as alive, as its packets would."""
        writer = self.link.writer
        so_far = framing.taken(writer)
        if keep_alive is not None:
            keep_alive.reading()
        while True:
            try:
                async with asyncio.timeout(TAKEN_CHECK_S):
                    await writer.drain()
                return
            except TimeoutError:  # this check's (the keep-alive's own expiry goes on up as a cancellation)
                now = framing.taken(writer)
                if now > so_far and keep_alive is not None:
                    keep_alive.reading()  # it took some: alive
                so_far = now

    async def _end(self, graceful: bool, reason: str, code: int | None) -> None:
        link = self.link
        link.closing = True
        if link.client_id:
            log.info("mqtt client %s disconnected (%s)", link.client_id, reason)
        await self.subscriptions.stop_all()
        await self.deliveries.settle_acknowledged()
        await self.publishes.finish()
        if code is not None and not link.kicked:
            link.tell(code, reason)  # after the answers to what was stored: a DISCONNECT is the last packet
            link.shut = True  # nothing is written after this DISCONNECT (a takeover meanwhile: no second one)
            await framing.linger(link.writer, link.reader)  # read by the client, not lost to a reset
        remote = await self.deliveries.give_back()  # (consumer, group, parent) -> other brokers' receipts
        for parent in self.subscriptions.consumers:
            link.dispatcher.client_gone(link.consumer_id(parent))
        cluster = link.cluster
        if cluster is not None:  # the other brokers' leases back there; a session that ends, its subscriptions
            calls = [cluster.release(c, g, p, receipts) for (c, g, p), receipts in remote.items()]
            if not link.persistent and link.connected.is_set():
                calls += [cluster.unsubscribe(link.consumer_id(p), link.group, p, []) for p in link.subs]
            await asyncio.gather(*calls, return_exceptions=True)
        await self.subscriptions.sharing.end()  # after the give-backs: the shares' members there end too
        if link.connected.is_set() and not self.host.stopping:
            await self._session_ended()
        if not graceful and self.will is not None and not self.host.stopping:
            delay = self._will_delay(self.will)
            if delay:
                await self.host.wills.delay(link.client_id, link.address, self.will, delay)
            else:
                await storing.publish_will(self.host, link.client_id, link.address, self.will)
        await self._disarm()
        await framing.shut(link.writer)
        self.host.forget(self)
        self.done.set()

    def _will_delay(self, will: codec.Will) -> int:
        """Seconds from the connection's end to its will: 5.0 its will delay, at the latest when the session ends
        (section 3.1.3.2.2); 3.1.1 none."""
        delay = (will.properties or properties.NONE).will_delay_s or 0
        expiry = self.link.expiry_s
        return delay if expiry is None else min(delay, expiry)

    async def _arm(self) -> None:
        """The will recorded while the connection lives (MQTT-3.1.2-8): a broker killed before the connection's end
        publishes it after its restart, after its delay from then (``durable.Durable.fire_armed``)."""
        link, will = self.link, self.will
        if will is None:
            return
        props = None if will.properties is None else properties.encode(will.properties)
        row = durable.Will(link.client_id, 0, will.topic, will.payload, will.qos, will.retain, props, link.address)
        armed = secrets.token_hex(8)
        await link.dispatcher.run(self.host.durable.arm_will, armed, self._will_delay(will), row)
        self._armed = armed

    async def _disarm(self) -> None:
        """At the end: the will was published, is waiting for its delay, or is dropped (a DISCONNECT, a stop)."""
        if not self._armed:
            return
        try:
            await self.link.dispatcher.run(self.host.durable.disarm_will, self._armed)
        except Exception:  # published again after the next restart (at least once)
            self.host.stats.errors[stats.WILL_WRITE] += 1
            log.exception("mqtt client %s: the end of its will not recorded", self.link.client_id)
        self._armed = ""

    async def _session_ended(self) -> None:
        """A persistent session starts its expiry interval; any other is gone (also a resumed one: 5.0 allows
        resuming with an expiry of 0). Not when a newer connection took it over: that one owns it now."""
        link = self.link
        if self.host.owner(link.client_id) not in (self, None):
            return
        durable_ = self.host.durable
        try:
            if link.persistent and link.stored:
                await link.dispatcher.run(durable_.session_ended, link.client_id, link.dispatcher.wall_clock(),
                                          link.expiry_s)  # fmt: skip
            elif link.stored:
                await link.dispatcher.run(durable_.drop_session, link.client_id)
        except Exception:  # the session row stays as it was: it expires late (or, dropped, lives on)
            self.host.stats.errors[stats.SESSION_EXPIRY_WRITE] += 1
            log.exception("mqtt client %s: the end of its session not recorded", link.client_id)

    # --- packets in ---------------------------------------------------------------------------------------------
    async def _handle(self, packet: codec.Packet) -> None:
        if isinstance(packet, codec.Publish):
            await self.publishes.received(packet)
        elif isinstance(packet, codec.PacketId):
            if packet.kind == codec.PUBACK:
                await self.deliveries.acknowledged(packet.packet_id)
            elif packet.kind == codec.PUBREL:
                await self.publishes.released(packet.packet_id)
            elif packet.kind == codec.PUBREC:
                await self.releases.received(packet)
            elif packet.kind == codec.PUBCOMP:
                await self.releases.completed(packet.packet_id)
            else:  # UNSUBACK is the broker's to send
                raise codec.ProtocolError(f"unexpected packet type {packet.kind}")
        elif isinstance(packet, codec.Subscribe):
            await self.subscriptions.subscribe(packet)
        elif isinstance(packet, codec.Unsubscribe):
            await self.subscriptions.unsubscribe(packet)
        elif isinstance(packet, codec.Bare) and packet.kind == codec.PINGREQ:
            self.link.writer.write(codec.PINGRESP_BYTES)
        elif isinstance(packet, codec.Bare) and packet.kind == codec.DISCONNECT:
            self.will = None  # MQTT-3.14.4-3
            raise Closed("DISCONNECT", graceful=True)
        elif isinstance(packet, codec.Disconnect):
            self._disconnected(packet)
        elif isinstance(packet, codec.Auth):  # no CONNECT here names an authentication method: MQTT-4.12.0-1
            raise codec.ProtocolError("AUTH without an authentication method")
        else:
            raise codec.ProtocolError(f"unexpected {type(packet).__name__}")  # a second CONNECT: MQTT-3.1.0-2

    def _disconnected(self, packet: codec.Disconnect) -> None:
        """A 5.0 DISCONNECT: it may set a new session expiry, and only a normal one drops the will."""
        expiry = packet.properties.session_expiry_s
        if expiry is not None:
            if self.link.expiry_s == 0 and expiry != 0:
                raise codec.ProtocolError("DISCONNECT sets a session expiry after CONNECT said 0")  # MQTT-3.14.2-2
            self.link.expiry_s = limits.session_expiry_s(
                None if expiry == handshake.NEVER else expiry, self.link.config
            )
        if packet.reason == Reason.SUCCESS:
            self.will = None  # MQTT-3.14.4-3
        raise Closed(f"DISCONNECT {packet.reason:#04x}", graceful=packet.reason == Reason.SUCCESS)
