"""One MQTT network connection: CONNECT, then publishes in and deliveries out, through the dispatcher.

Publishing goes through ``Dispatcher.send`` like a gRPC SendMessage: the PUBLISH packets a connection read
are appended in order, as many per store call as arrived meanwhile (one fsync for the lot), and each QoS 1
PUBACK (QoS 2 PUBREC) is written once the append returned, that is after the fsync (``--flush-mode sync``).
In a cluster the messages go to their lite topics' owners instead (``server.owners``), and the answers wait
for theirs: an owner that cannot store fails the batch like a failing store here.

Consuming: an MQTT session is the implicit lite group ``%MQTT%<client id>`` (``metadata.MQTT_GROUP_PREFIX``) and,
per parent topic it subscribes in, one dispatcher client registered with its topic filters
(``Dispatcher.subscribe_filters``); a loop per parent long-polls ``receive_lite`` like a push consumer
(auto-renewed leases), writes each message as a PUBLISH, and acknowledges it to the dispatcher once the
client's PUBACK arrives (QoS 1) or once written (QoS 0), which commits the group's offset. So a message is
delivered at the lower of its publish QoS and the subscription's, in order per topic, and a QoS 1 message
the client never acknowledged is handed out again: at once to the reconnected session (its leases are given
back when the connection ends), with DUP set.

A new subscription starts at the end of every matching lite topic (MQTT delivers what is published after
it, plus the retained message); a persistent session resumes at its group's offsets.

In a cluster (``server.owners`` active) the session is subscribed at every other broker too, its new filters
starting at their ends there as well; its loop then takes this broker's messages and pulls, without waiting,
the others' (``Owners.waiting``: from those that said they have some), within the same in-flight window, and
between two rounds waits, leasing nothing, on this broker's ready set (``Dispatcher.await_ready``) and on the
others' (one wait parked at each, renewed every 30 s at most): a message anywhere wakes it at once, and an
idle session costs each other broker one call per parked wait. What came from another broker is settled there
(``Owners.settle``, batched off the reader by ``_settle_loop``; it keeps its place in the window until then)
and given back there when the connection ends. A SUBSCRIBE also gets the other brokers' retained messages (per
topic the newest).

MQTT 5 on the same path (chosen by the CONNECT's level, ``self.v5``): what 3.1.1 can only answer by closing
gets a reason code (a negative PUBACK, a SUBACK code, a DISCONNECT before closing); the session lives as long
as its expiry interval (3.1.1: clean = 0, persistent = never); the client's receive maximum bounds the QoS 1
deliveries waiting for PUBACKs, ours bounds its unacknowledged publishes; properties travel as message
properties (``mapping``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final

from lmq_broker import errors, model
from lmq_broker.dispatch import metadata, wildcards
from lmq_broker.mqtt import codec, durable, framing, held, limits, mapping, matching, properties, stats, storing, topics
from lmq_broker.mqtt.owners import Owners, Pulled, Remote
from lmq_broker.mqtt.properties import Properties, Reason

if TYPE_CHECKING:
    from lmq_broker.mqtt.server import MqttServer

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S: Final = 10.0
KEEP_ALIVE_GRACE: Final = 1.5  # MQTT-3.1.2-24: one and a half keep-alive periods without a packet ends it
MAX_INFLIGHT: Final = 64  # QoS 1 deliveries waiting for their PUBACK, per connection
PUBLISH_QUEUE: Final = 256  # PUBLISH packets read and not yet stored; the reader waits beyond it
MAX_PUBLISH_BATCH: Final = 256  # messages per store call
MAX_FILTERS: Final = 1000  # topic filters one session may hold
POLL_MS: Final = 20_000
ALONE_POLL_MS: Final = 1_000  # a broker that may join a cluster (it has ``owners``): its sessions look this often
RETRY_S: Final = 1.0  # a refused receive (store rebuilding, parent deleted) is tried again after this
MQTT_QOS_PROPERTY: Final = mapping.QOS  # user property of a QoS 0 publish: delivered at QoS 0 to every subscriber
RECEIVE_MAXIMUM: Final = PUBLISH_QUEUE  # 5.0: a client's QoS 1/2 publishes not yet acknowledged, at most
TOPIC_ALIAS_MAX: Final = 64  # 5.0: inbound topic aliases per connection
NEVER: Final = 0xFFFFFFFF  # 5.0: a session expiry interval that never ends
_PLAIN_ID: Final = re.compile(r"^[A-Za-z0-9_-]{1,100}$")
_BOOT_HOST: Final = "mqtt"


def group_of(client_id: str) -> str:
    """The implicit lite group of an MQTT client id: the id itself when it is a short plain name, else a hash
    (a ``%`` marks it, which no plain id holds, so two ids never share a group)."""
    if _PLAIN_ID.match(client_id):
        return metadata.MQTT_GROUP_PREFIX + client_id
    return metadata.MQTT_GROUP_PREFIX + "%" + hashlib.sha256(client_id.encode()).hexdigest()[:40]


@dataclass(frozen=True, slots=True)
class _In:
    """A publish read: stored (``store``), or refused with ``reason`` (5.0; the answer keeps its place)."""

    packet: codec.Publish
    store: bool = True
    reason: int = 0
    why: str = ""


@dataclass(frozen=True, slots=True)
class _Out:
    """A QoS 1 delivery waiting for its PUBACK; ``receipt`` is empty for a retained message; ``remote``: it
    came from another broker of the cluster (settled there, ``Owners.settle``)."""

    consumer: str
    receipt: str
    parent: str = ""
    remote: bool = False


class Closed(Exception):
    """The connection ends; ``graceful`` when the client sent DISCONNECT (no will then); ``code``: the reason
    a 5.0 client is told in a DISCONNECT."""

    def __init__(self, reason: str, *, graceful: bool = False, code: int | None = None) -> None:
        super().__init__(reason)
        self.graceful = graceful
        self.code = code


class Connection:
    def __init__(self, server: MqttServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.server = server
        self.dispatcher = server.dispatcher
        self.config = server.config
        self.reader = reader
        self.writer = writer
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer or "")
        self.host = peer[0] if isinstance(peer, tuple) else _BOOT_HOST
        self.client_id = ""
        self.group = ""
        self.v5 = False
        self.expiry_s: int | None = 0  # seconds the session outlives the connection; None: forever
        self.will: codec.Will | None = None
        self.keep_alive_s = 0
        self.max_inflight = MAX_INFLIGHT  # 5.0: lowered to the client's receive maximum
        self.max_packet_out = codec.MAX_REMAINING_LENGTH  # 5.0: the client's maximum packet size
        self.problem_info = True  # 5.0: reason strings wanted
        self.subs: dict[str, dict[wildcards.Filter, int]] = {}  # parent -> filter -> options (low bits: QoS)
        self._aliases: dict[int, str] = {}  # 5.0 inbound topic aliases
        self._unacked_in = 0  # 5.0: the client's QoS 1/2 publishes not yet answered
        self._retained_tasks: set[asyncio.Task[None]] = set()
        self._stored = False  # a session row exists for this client id
        self._consumers: dict[str, asyncio.Task[None]] = {}
        self._made_at: dict[str, tuple[str, ...]] = {}  # parent -> the cluster's members its filters were made at
        self._out: dict[int, _Out] = {}
        self._acks: dict[tuple[str, str], list[str]] = {}  # (consumer, parent) -> PUBACKed, not settled there yet
        self._unsettled = 0  # receipts in _acks or being settled
        self._acks_ready = asyncio.Event()
        self._settler: asyncio.Task[None] | None = None
        self._room = asyncio.Event()
        self._room.set()
        self._ids = itertools.cycle(range(1, 65536))
        self._incoming: asyncio.Queue[_In | None] = asyncio.Queue(PUBLISH_QUEUE)
        self._publisher: asyncio.Task[None] | None = None
        self._awaiting_release: set[int] = set()  # QoS 2 packet ids stored, PUBREL not yet seen
        self._failure: BaseException | None = None
        self._level = codec.LEVEL_3_1_1  # what packets after the CONNECT are read at
        self._connected = asyncio.Event()  # CONNACK written: deliveries may follow
        self._closing = False
        self._shut = False  # writing shut down (``framing.linger``)
        self.done = asyncio.Event()
        self.kicked = False

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
            self.server.stats.refused[stats.READ_BYTES] += 1
            reason, code = f"refused: {exc} (--mqtt-max-read-bytes)", Reason.QUOTA_EXCEEDED
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
        self.kicked = True
        self.close(Reason.SESSION_TAKEN_OVER, "another connection took the client id")
        await self.done.wait()

    def close(self, code: int, why: str = "") -> None:
        """Close the socket; a 5.0 client is told why first (a DISCONNECT with ``code``)."""
        self._tell(code, why)
        self.writer.close()

    def _tell(self, code: int, why: str) -> None:
        """A 5.0 client is told why the broker ends the connection (a DISCONNECT with ``code``)."""
        if self.v5 and self._connected.is_set() and not self.writer.is_closing() and not self._shut:
            self.writer.write(codec.encode_disconnect(code, self._why(why)))

    def _why(self, text: str) -> Properties:
        """A reason string, where the client asked for them (5.0 ``request_problem_info``)."""
        return Properties(reason_string=text[:200]) if text and self.problem_info else properties.NONE

    async def _first(self) -> codec.Connect | None:
        """The CONNECT (within ``CONNECT_TIMEOUT_S``, at most ``limits.connect_bytes``); None: closed first."""
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            try:
                frame = await framing.read_frame(
                    self.reader, limits.connect_bytes(self.config), self.server.read_budget
                )
            except codec.PacketTooLarge:
                self.server.stats.refused[stats.CONNECT_TOO_LARGE] += 1
                with contextlib.suppress(asyncio.IncompleteReadError):  # 5.0 (read so far): answered with 0x95
                    if limits.is_v5_connect(await self.reader.readexactly(7)):
                        self.writer.write(codec.encode_connack(False, Reason.PACKET_TOO_LARGE, codec.LEVEL_5))
                raise
        if frame is None:
            return None
        first, body = frame
        try:
            connect = codec.decode_packet(first, body)
        except codec.UnsupportedProtocol as exc:
            self.writer.write(codec.encode_connack(False, codec.ConnectCode.BAD_PROTOCOL_VERSION, exc.level))
            raise Closed(exc.reason) from None
        except codec.MalformedPacket as exc:
            if limits.is_v5_connect(body):  # 5.0 section 3.1.4: a bad CONNECT may be answered with its code
                self.writer.write(codec.encode_connack(False, exc.code, codec.LEVEL_5))
            raise
        if not isinstance(connect, codec.Connect):
            raise codec.MalformedPacket("the first packet is not CONNECT")  # MQTT-3.1.0-1
        return connect

    async def _handshake(self) -> bool:
        connect = await self._first()
        if connect is None:
            return False
        self.v5 = connect.level == codec.LEVEL_5
        self._level = connect.level
        refused = limits.refusal(connect, self.config)
        if refused is not None:
            code, counted = refused
            why = limits.words(counted, self.config)
            if counted:  # a cap: counted, and said
                self.server.stats.refused[counted] += 1
            self.writer.write(codec.encode_connack(False, code, connect.level, self._why(why) if self.v5 else None))
            await self.writer.drain()
            raise Closed(f"CONNECT refused: {code:#04x} {why}".rstrip(), graceful=True)
        self.client_id = connect.client_id or "auto-" + secrets.token_hex(8)  # MQTT-3.1.3-6
        self.group = group_of(self.client_id)
        clean_start = connect.clean_session
        self.will = connect.will
        self.keep_alive_s = connect.keep_alive_s
        acked = properties.NONE
        if connect.properties is not None:  # 5.0
            p = connect.properties
            self.expiry_s = None if p.session_expiry_s == NEVER else p.session_expiry_s or 0
            self.max_inflight = min(MAX_INFLIGHT, p.receive_max or MAX_INFLIGHT)
            self.max_packet_out = min(codec.MAX_REMAINING_LENGTH, p.max_packet_size or codec.MAX_REMAINING_LENGTH)
            self.problem_info = p.request_problem_info != 0
            acked = Properties(
                receive_max=RECEIVE_MAXIMUM,
                topic_alias_max=TOPIC_ALIAS_MAX,
                max_packet_size=self._max_packet_bytes() + 5,  # the fixed header's 5 bytes at most
                subscription_ids_available=0,
                shared_subscription_available=0,
                assigned_client_id=None if connect.client_id else self.client_id,
            )
        else:
            self.expiry_s = 0 if clean_start else None
        await self.server.take_over(self, clean_start)
        session_present = False
        now = self.dispatcher.wall_clock()
        saved = await self.dispatcher.run(self.server.durable.load_session, self.client_id, now)
        if clean_start and saved is not None:
            await self.dispatcher.run(self.server.durable.drop_session, self.client_id)  # MQTT-3.1.2-6
        elif saved is not None:
            session_present = self._stored = True
            await self._restore(saved)
        if self.persistent:
            await self._save()  # a persistent session exists from its CONNECT on, subscribed or not
        self.writer.write(codec.encode_connack(session_present, codec.ConnectCode.ACCEPTED, connect.level, acked))
        self._connected.set()
        await self.writer.drain()
        log.info("mqtt client %s connected from %s (MQTT %s, clean start %s, session expiry %s, session present %s)",
                 self.client_id, self.peer, "5.0" if self.v5 else "3.1.1", clean_start, self.expiry_s,
                 session_present)  # fmt: skip
        self._publisher = asyncio.get_running_loop().create_task(self._publish_loop())
        return True

    @property
    def persistent(self) -> bool:
        return self.expiry_s != 0

    @property
    def _cluster(self) -> Owners | None:
        """The cluster this broker is part of (its other brokers hold lite topics too); None while alone."""
        owners = self.server.owners
        return owners if owners is not None and owners.active else None

    def _max_packet_bytes(self) -> int:
        return self.config.max_body_bytes + 2 + codec.MAX_STRING_BYTES + 2  # a PUBLISH: topic, packet id, body

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
        limit = self._max_packet_bytes()
        progress = keep_alive.reading if keep_alive is not None else None
        while True:
            if keep_alive is not None:
                keep_alive.reading()
            frame = await framing.read_frame(self.reader, limit, self.server.read_budget, stall_s, progress)
            if keep_alive is not None:
                keep_alive.handling()
            if self._failure is not None:
                raise Closed(f"publish failed: {self._failure}", code=Reason.UNSPECIFIED_ERROR)
            if frame is None:
                if self.server.stopping:
                    raise Closed("the broker is shutting down", graceful=True)
                raise Closed("taken over by a newer connection" if self.kicked else "closed without DISCONNECT")
            await self._handle(codec.decode_packet(frame[0], frame[1], self._level))

    async def _end(self, graceful: bool, reason: str, code: int | None) -> None:
        self._closing = True
        if self.client_id:
            log.info("mqtt client %s disconnected (%s)", self.client_id, reason)
        for task in [*self._consumers.values(), *self._retained_tasks]:
            await _stop(task)
        if self._settler is not None:  # what the client acknowledged, settled where it came from; then it ends
            self._acks_ready.set()
            await self._ended(self._settler, "settling acknowledged deliveries")
        if self._publisher is not None:  # store what was read (the client may not learn it; at least once)
            await self._incoming.put(None)
            await self._ended(self._publisher, "storing what was read")
        if code is not None and not self.kicked:
            self._tell(code, reason)  # after the answers to what was stored: a DISCONNECT is the last packet
            self._shut = True  # nothing is written after this DISCONNECT (a takeover meanwhile: no second one)
            await framing.linger(self.writer, self.reader)  # read by the client, not lost to a reset
        remote: dict[tuple[str, str], list[str]] = {}  # (consumer, parent) -> other brokers' receipts
        for out in self._out.values():  # handed out, not acknowledged: back to the group at once
            if out.remote:
                remote.setdefault((out.consumer, out.parent), []).append(out.receipt)
            elif out.receipt:
                with contextlib.suppress(errors.LmqError):
                    await self.dispatcher.change_invisible(self.group, out.receipt, 0)
        self._out.clear()
        for parent in self._consumers:
            self.dispatcher.client_gone(self._consumer_id(parent))
        cluster = self._cluster
        if cluster is not None:  # the other brokers' leases back there; a session that ends, its subscriptions
            calls = [cluster.release(c, self.group, p, receipts) for (c, p), receipts in remote.items()]
            if not self.persistent and self._connected.is_set():
                calls += [cluster.unsubscribe(self._consumer_id(p), self.group, p, []) for p in self.subs]
            await asyncio.gather(*calls, return_exceptions=True)
        if self._connected.is_set() and not self.server.stopping:
            await self._session_ended()
        if not graceful and self.will is not None and not self.server.stopping:
            delay = (self.will.properties or properties.NONE).will_delay_s or 0
            if self.expiry_s is not None:
                delay = min(delay, self.expiry_s)  # 5.0 section 3.1.3.2.2: at the latest when the session ends
            if delay:
                await self.server.wills.delay(self.client_id, self.host, self.will, delay)
            else:
                await storing.publish_will(self.server, self.client_id, self.host, self.will)
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()
        self.server.forget(self)
        self.done.set()

    async def _session_ended(self) -> None:
        """A persistent session starts its expiry interval; any other is gone (also a resumed one: 5.0 allows
        resuming with an expiry of 0). Not when a newer connection took it over: that one owns it now."""
        if self.server.owner(self.client_id) not in (self, None):
            return
        durable_ = self.server.durable
        try:
            if self.persistent and self._stored:
                await self.dispatcher.run(durable_.session_ended, self.client_id, self.dispatcher.wall_clock(),
                                          self.expiry_s)  # fmt: skip
            elif self._stored:
                await self.dispatcher.run(durable_.drop_session, self.client_id)
        except Exception:  # the session row stays as it was: it expires late (or, dropped, lives on)
            self.server.stats.errors[stats.SESSION_EXPIRY_WRITE] += 1
            log.exception("mqtt client %s: the end of its session not recorded", self.client_id)

    async def _ended(self, task: asyncio.Task[None], what: str) -> None:
        await stats.wait_ended(task, f"mqtt client {self.client_id}: {what}", self.server.stats)

    # --- packets in ---------------------------------------------------------------------------------------------
    async def _handle(self, packet: codec.Packet) -> None:
        if isinstance(packet, codec.Publish):
            await self._received(packet)
        elif isinstance(packet, codec.PacketId):
            if packet.kind == codec.PUBACK:
                await self._acknowledged(packet.packet_id)
            elif packet.kind == codec.PUBREL:
                known = packet.packet_id in self._awaiting_release
                if known:
                    self._awaiting_release.discard(packet.packet_id)
                    self._unacked_in -= 1 if self.v5 else 0
                reason = 0 if known or not self.v5 else Reason.PACKET_ID_NOT_FOUND
                self.writer.write(codec.encode_packet_id(codec.PUBCOMP, packet.packet_id, reason, self._ack_props()))
            else:  # PUBREC/PUBCOMP answer QoS 2 deliveries, which this broker never makes; UNSUBACK is ours
                raise codec.ProtocolError(f"unexpected packet type {packet.kind}")
        elif isinstance(packet, codec.Subscribe):
            await self._subscribe(packet)
        elif isinstance(packet, codec.Unsubscribe):
            await self._unsubscribe(packet)
        elif isinstance(packet, codec.Bare) and packet.kind == codec.PINGREQ:
            self.writer.write(codec.PINGRESP_BYTES)
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
            if self.expiry_s == 0 and expiry != 0:
                raise codec.ProtocolError("DISCONNECT sets a session expiry after CONNECT said 0")  # MQTT-3.14.2-2
            self.expiry_s = None if expiry == NEVER else expiry
        if packet.reason == Reason.SUCCESS:
            self.will = None  # MQTT-3.14.4-3
        raise Closed(f"DISCONNECT {packet.reason:#04x}", graceful=packet.reason == Reason.SUCCESS)

    def _ack_props(self, why: str = "") -> Properties | None:
        """The property section of an acknowledgement: None (no section) for 3.1.1."""
        return self._why(why) if self.v5 else None

    async def _received(self, packet: codec.Publish) -> None:
        duplicate = packet.qos == 2 and packet.packet_id in self._awaiting_release
        if packet.properties is not None:
            packet = self._resolve_alias(packet)
            if packet.qos and not duplicate:
                self._unacked_in += 1
                if self._unacked_in > RECEIVE_MAXIMUM:
                    raise Closed("receive maximum exceeded", code=Reason.RECEIVE_MAXIMUM_EXCEEDED)  # MQTT-3.3.4-9
        refusal = await self._refusal_of(packet)
        if refusal is not None:
            reason, why = refusal
            if not self.v5 or packet.qos == 0:
                # 3.1.1 has no negative PUBACK: closing is the only way to tell the client (MQTT-3.3.5-2)
                self._refused(packet.topic, reason, why)
                raise Closed(f"PUBLISH to {packet.topic!r} refused: {why}", code=reason)
            self._refused(packet.topic, reason, why, answered=True)
            await self._incoming.put(_In(packet, False, reason, why))
            return
        if packet.qos == 2 and packet.packet_id is not None:
            self._awaiting_release.add(packet.packet_id)  # a resend before its PUBREL is not stored again
        await self._incoming.put(_In(packet, not duplicate))

    def _resolve_alias(self, packet: codec.Publish) -> codec.Publish:
        """5.0 inbound topic alias: a topic sets it, an empty topic uses it (section 3.3.2.3.4)."""
        assert packet.properties is not None
        if packet.properties.subscription_ids:
            raise codec.ProtocolError("a client's PUBLISH carries a subscription identifier")  # MQTT-3.3.4-6
        alias = packet.properties.topic_alias
        if alias is None:
            return packet
        if alias > TOPIC_ALIAS_MAX:
            raise Closed(f"topic alias {alias} over {TOPIC_ALIAS_MAX}", code=Reason.TOPIC_ALIAS_INVALID)
        if packet.topic:
            self._aliases[alias] = packet.topic
            return packet
        topic = self._aliases.get(alias)
        if topic is None:
            raise codec.ProtocolError(f"topic alias {alias} was never set")
        return replace(packet, topic=topic)

    async def _refusal_of(self, packet: codec.Publish) -> tuple[int, str] | None:
        """Why the publish cannot be stored (a 5.0 reason code and words), None when it can."""
        try:
            parent, _ = (await storing.space_of(self.server)).lite_of(packet.topic)
            (await self.dispatcher.metadata()).lite_parent(parent)
        except (topics.TopicError, errors.LmqError) as exc:
            return _reason_of(exc), str(exc)
        p = packet.properties
        if p is not None and p.payload_format == 1:
            try:
                packet.payload.decode("utf-8")
            except UnicodeDecodeError:
                return Reason.PAYLOAD_FORMAT_INVALID, "payload format indicator 1 and a payload that is not UTF-8"
        return None

    def _refused(self, topic: str, reason: int, why: str, *, answered: bool = False) -> None:
        """A refused publish: counted by reason, logged at INFO (rate-limited) with what the client is told."""
        name = Reason(reason).name.lower() if reason in Reason.__members__.values() else f"{reason:#04x}"
        self.server.stats.publishes_refused[name] += 1
        told = f"{'reason code' if answered else 'DISCONNECT'} {reason:#04x}" if self.v5 else "3.1.1: no other way"
        outcome = f"answered with {told}" if answered else f"the connection is closed ({told})"
        self.server.stats.refusals.refused(self.client_id, "PUBLISH", topic, why, outcome)

    async def _publish_loop(self) -> None:
        """Store what was read, in order and in batches, then acknowledge each (after the store's fsync)."""
        while True:
            item = await self._incoming.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < MAX_PUBLISH_BATCH and not self._incoming.empty():
                more = self._incoming.get_nowait()
                if more is None:
                    self._incoming.put_nowait(None)
                    break
                batch.append(more)
            if self._failure is not None:
                continue  # the connection is ending: nothing more is stored (the reader may still be putting)
            try:
                await self._store([i.packet for i in batch if i.store])  # one store call for the lot
            except (errors.LmqError, topics.TopicError, ValueError) as exc:
                if not self.v5 or not _answerable(exc):
                    self._refused(batch[0].packet.topic, _reason_of(exc), str(exc))
                    self._failure = exc
                    self.close(Reason.UNSPECIFIED_ERROR, str(exc))  # the reader sees the end, reports ``_failure``
                    continue
                batch = await self._store_each(batch)  # 5.0: each publish gets its own answer
            for i in batch:
                self._answer(i)

    async def _store_each(self, batch: list[_In]) -> list[_In]:
        """Store one by one what failed together (a quota refuses the whole batch), refusing each that fails."""
        out = []
        for item in batch:
            answer = item
            if item.store:
                p = item.packet
                try:
                    await self._store([p])
                except (errors.LmqError, topics.TopicError, ValueError) as exc:
                    if p.qos == 2 and p.packet_id is not None:
                        self._awaiting_release.discard(p.packet_id)
                    answer = _In(p, False, _reason_of(exc), str(exc))
                    self._refused(p.topic, answer.reason, answer.why, answered=True)
            out.append(answer)
        return out

    def _answer(self, i: _In) -> None:
        p = i.packet
        if p.packet_id is None:
            return
        if p.qos == 1:
            self.writer.write(codec.encode_packet_id(codec.PUBACK, p.packet_id, i.reason, self._ack_props(i.why)))
        else:
            self.writer.write(codec.encode_packet_id(codec.PUBREC, p.packet_id, i.reason, self._ack_props(i.why)))
        if self.v5 and (p.qos == 1 or i.reason >= Reason.UNSPECIFIED_ERROR):
            self._unacked_in -= 1  # QoS 2: once PUBREL is answered, unless refused (MQTT-4.9.0-3)

    async def _store(self, publishes: Sequence[codec.Publish]) -> None:
        await storing.store(self.server, self.client_id, self.host, publishes)

    async def _acknowledged(self, packet_id: int) -> None:
        out = self._out.pop(packet_id, None)
        if out is None:
            return  # not ours (or acknowledged twice): nothing to settle
        if out.remote:  # settled there by the settler, off the reader; it holds its room until then
            self._acks.setdefault((out.consumer, out.parent), []).append(out.receipt)
            self._unsettled += 1
            if self._settler is None:
                self._settler = asyncio.get_running_loop().create_task(self._settle_loop())
            self._acks_ready.set()
            return
        if self._busy < self.max_inflight:
            self._room.set()
        if out.receipt:
            try:
                await self.dispatcher.ack(self.group, out.receipt, client_id=out.consumer)
            except errors.LmqError as exc:  # e.g. the lease was given back meanwhile: it comes again
                log.info("mqtt client %s: PUBACK %d not settled: %s", self.client_id, packet_id, exc.message)

    @property
    def _busy(self) -> int:
        """Deliveries taking room in the in-flight window: awaiting their PUBACK, or their settling elsewhere."""
        return len(self._out) + self._unsettled

    async def _settle_loop(self) -> None:
        """The other brokers' messages the client acknowledged, settled there: all that came meanwhile at once."""
        while True:
            await self._acks_ready.wait()
            self._acks_ready.clear()
            await self._settle_acks()
            if self._closing:  # the reader has stopped: nothing more comes
                return

    async def _settle_acks(self) -> None:
        while self._acks:
            acks, self._acks = self._acks, {}
            cluster = self._cluster
            try:
                if cluster is not None:  # else alone again: their leases there expire, they come again
                    settling = (cluster.settle(c, self.group, p, receipts) for (c, p), receipts in acks.items())
                    await asyncio.gather(*settling)
            finally:
                self._unsettled -= sum(map(len, acks.values()))
                if self._busy < self.max_inflight:
                    self._room.set()

    # --- subscriptions ----------------------------------------------------------------------------------------
    async def _restore(self, saved: dict[str, int]) -> None:
        space = await storing.space_of(self.server)
        for text, options in saved.items():
            with contextlib.suppress(topics.TopicError):
                held.add(self.subs, space.subscriptions_of(text), options & ~held.EXPANDED)
        cluster = self._cluster
        for parent in list(self.subs):
            await self._register(parent)
            if cluster is not None:  # resumed at the group's offsets there too
                await self._make_everywhere(cluster, parent)

    async def _make_everywhere(self, cluster: Owners, parent: str) -> None:
        """The session's filters in ``parent`` made at every broker (again), resuming at the group's offsets."""
        self._made_at[parent] = cluster.members
        held = list(self.subs.get(parent, ()))
        try:
            await cluster.subscribe(self._consumer_id(parent), self.group, parent, held, None)
        except errors.LmqError as exc:
            log.warning("mqtt client %s: subscriptions in %s not made at every broker: %s", self.client_id, parent,
                        exc.message)  # fmt: skip

    async def _subscribe(self, packet: codec.Subscribe) -> None:
        codes: list[int] = []
        fresh: dict[str, list[wildcards.Filter]] = {}
        granted: dict[int, list[tuple[str, wildcards.Filter]]] = {}  # index in codes -> what it granted
        no_retained: set[int] = set()  # 5.0 retain handling: granted, but no retained messages now
        failure = codec.SUBACK_FAILURE
        if packet.properties is not None and packet.properties.subscription_ids:
            raise Closed("subscription identifiers are not supported", code=Reason.SUBSCRIPTION_IDS_NOT_SUPPORTED)
        snap = await self.dispatcher.metadata()
        space = topics.space_of(snap)
        for text, options in packet.filters:
            if self.v5 and text.startswith("$share/"):
                codes.append(Reason.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED)
                continue
            try:
                wanted = space.subscriptions_of(text)
                snap.lite_parent(space.default)
            except (topics.TopicError, errors.LmqError) as exc:
                codes.append(Reason.TOPIC_FILTER_INVALID if self.v5 else failure)
                self.server.stats.refusals.refused(
                    self.client_id, "SUBSCRIBE", text, str(exc), f"SUBACK {codes[-1]:#04x}"
                )
                continue
            existed = held.holds(self.subs, wanted)
            if not existed and held.count(self.subs, space.default) >= MAX_FILTERS:
                codes.append(Reason.QUOTA_EXCEEDED if self.v5 else failure)
                continue
            kept = options & ~codec.OPTION_QOS | min(options & codec.OPTION_QOS, 1)  # QoS 2 -> QoS 1
            made = held.add(self.subs, wanted, kept)
            for parent, levels, _ in (m for m in made if not m.existed):
                fresh.setdefault(parent, []).append(levels)
            handling = options >> codec.OPTION_RETAIN_HANDLING_SHIFT
            if handling == 2 or (handling == 1 and existed):
                no_retained.add(len(codes))
            granted[len(codes)] = [(m.parent, m.filter) for m in made]
            codes.append(kept & codec.OPTION_QOS)
        for parent, new in fresh.items():
            older = [f for f in self.subs[parent] if f not in new]
            try:
                await self._start_at_end(parent, new, older)
                await self._register(parent)
                cluster = self._cluster
                if cluster is not None:  # at the other brokers too, from their ends as well
                    consumer = self._consumer_id(parent)
                    if self._made_at.get(parent) != cluster.members:  # set first: the loop must not make ``new``
                        self._made_at[parent] = cluster.members
                        if older:  # made while this broker was alone, or before a broker joined
                            await cluster.subscribe(consumer, self.group, parent, older, None)
                    await cluster.subscribe(consumer, self.group, parent, new, older)
            except errors.LmqError as exc:  # e.g. the store rebuilds its index: these filters fail, the rest holds
                log.warning("mqtt client %s: subscriptions in %s refused: %s", self.client_id, parent, exc.message)
                cluster = self._cluster
                if cluster is not None:  # brokers that took them before one refused
                    await cluster.unsubscribe(self._consumer_id(parent), self.group, parent, new)
                for f in new:
                    self.subs[parent].pop(f, None)
                for i, pairs in list(granted.items()):
                    if pairs[0][0] == parent and pairs[0][1] in new:  # its own subscription failed
                        codes[i] = _reason_of(exc) if self.v5 else failure
                        del granted[i]
                    else:  # a named parent a wildcard reaches into: the rest holds
                        granted[i] = [(p, f) for p, f in pairs if p != parent or f not in new]
                await self._register(parent)
        if granted and self.persistent:
            await self._save()
        self.writer.write(codec.encode_suback(packet.packet_id, codes, self._ack_props()))
        sends = [(p, f, codes[i]) for i, pairs in granted.items() if i not in no_retained for p, f in pairs]
        if sends:  # after the SUBACK (MQTT-3.3.1-6, 3.8.4-3); off the reader, which reads the PUBACKs they wait for
            task = asyncio.get_running_loop().create_task(self._send_all_retained(sends))
            self._retained_tasks.add(task)
            task.add_done_callback(self._retained_tasks.discard)

    async def _send_all_retained(self, wanted: list[tuple[str, wildcards.Filter, int]]) -> None:
        try:
            elsewhere = await self._retained_elsewhere(wanted)
            for (parent, levels, qos), theirs in zip(wanted, elsewhere, strict=True):
                await self._send_retained(parent, levels, qos, theirs)
        except (ConnectionError, errors.LmqError) as exc:
            log.info("mqtt client %s: retained messages not sent: %s", self.client_id, exc)

    async def _unsubscribe(self, packet: codec.Unsubscribe) -> None:
        changed: dict[str, list[wildcards.Filter]] = {}  # parent -> the filters ended there
        codes = []
        space = await storing.space_of(self.server)
        for text in packet.filters:
            try:
                wanted = space.subscriptions_of(text)
            except topics.TopicError:
                codes.append(Reason.TOPIC_FILTER_INVALID)
                continue
            existed = held.holds(self.subs, wanted)
            for parent, ended in held.remove(self.subs, space, wanted).items():
                changed.setdefault(parent, []).extend(ended)
            codes.append(Reason.SUCCESS if existed else Reason.NO_SUBSCRIPTION_EXISTED)
        cluster = self._cluster
        for parent, ended in changed.items():
            await self._register(parent)
            if cluster is not None:
                await cluster.unsubscribe(self._consumer_id(parent), self.group, parent, ended)
        if changed and self.persistent:
            await self._save()
        if self.v5:
            self.writer.write(codec.encode_unsuback(packet.packet_id, codes))
        else:
            self.writer.write(codec.encode_packet_id(codec.UNSUBACK, packet.packet_id))

    async def _save(self) -> None:
        filters = held.texts(self.subs, self.config.mqtt_default_parent)
        await self.dispatcher.run(self.server.durable.save_session, self.client_id, filters, self.expiry_s)
        self._stored = True

    async def _start_at_end(self, parent: str, new: list[wildcards.Filter], older: list[wildcards.Filter]) -> None:
        """The group's start in each existing lite topic here that only the ``new`` filters match: its end."""
        dispatcher = self.dispatcher

        async def scan(parent: str, start_after: str, end_before: str, limit: int) -> list[model.LiteTopicMeta]:
            return await dispatcher.run(dispatcher.store.scan_lite_topics, parent, start_after, end_before, limit)

        await matching.start_at_end(scan, dispatcher.reset_offsets, self.group, parent, new, older,
                                    default=self.config.mqtt_default_parent,
                                    indexed=lambda f: dispatcher.lite_topics_matching(parent, f))  # fmt: skip

    async def _register(self, parent: str) -> None:
        """Give the dispatcher this session's filters in ``parent``; start or stop the parent's delivery loop."""
        filters = topics.registered(self.config.mqtt_default_parent, parent, self.subs.get(parent, {}))
        await self.dispatcher.subscribe_filters(consumer := self._consumer_id(parent), self.group, parent, filters)
        task = self._consumers.get(parent)
        if filters and task is None:
            self._consumers[parent] = asyncio.get_running_loop().create_task(self._consume(parent))
        elif not filters and task is not None:
            await _stop(task)
            del self._consumers[parent]
            self.dispatcher.client_gone(consumer)
            self.subs.pop(parent, None)

    def _consumer_id(self, parent: str) -> str:
        return f"{self.group}@{parent}"

    # --- deliveries out -------------------------------------------------------------------------------------
    async def _consume(self, parent: str) -> None:
        consumer = self._consumer_id(parent)
        await self._connected.wait()
        remote: Remote | None = None  # in a cluster: the other brokers, as this loop waits on them
        try:
            while not self._closing:
                try:  # a client slow to PUBACK: still alive for the dispatcher (its registration, its leases)
                    await asyncio.wait_for(self._room.wait(), POLL_MS / 1000)
                except TimeoutError:
                    self.dispatcher.client_seen(consumer)
                    cluster = self._cluster
                    if cluster is not None:  # and for the other brokers, which it is not pulling from meanwhile
                        await cluster.keep_alive(consumer, self.group)
                    continue
                if self.dispatcher.wildcards.registration(consumer) is None and self.subs.get(parent):
                    await self._register(parent)  # expired meanwhile (an event loop stalled past client expiry)
                room = self.max_inflight - self._busy
                if room <= 0:  # retained messages took the room (5.0: the client's receive maximum is a limit)
                    self._room.clear()
                    continue
                cluster = self._cluster
                try:
                    if cluster is None:
                        if remote is not None:  # the cluster shrank back to this broker
                            remote.close()
                            remote = None
                        poll_ms = POLL_MS if self.server.owners is None else ALONE_POLL_MS
                        found = await self._receive(parent, consumer, room, poll_ms)
                    else:
                        if self._made_at.get(parent) != cluster.members:  # a broker joined, or this one was alone
                            await self._make_everywhere(cluster, parent)
                        if remote is None:
                            remote = cluster.waiting(consumer, self.group, parent)
                        found = await self._gather(remote, parent, consumer, room)
                except errors.LmqError as exc:
                    log.warning("mqtt client %s: receive in %s refused (%s); retried", self.client_id, parent,
                                exc.message)  # fmt: skip
                    await asyncio.sleep(RETRY_S)
                    continue
                if not found and self.dispatcher.draining:
                    return
        finally:
            if remote is not None:
                remote.close()  # the waits parked at the other brokers leased nothing: nothing is lost

    async def _receive(self, parent: str, consumer: str, room: int, poll_ms: int) -> bool:
        """This broker's messages for the session, delivered; False when none came within ``poll_ms``."""
        deliveries = await self.dispatcher.receive_lite(
            consumer,
            self.group,
            parent,
            batch=max(1, min(room, self.config.receive_batch_size)),
            invisible_ms=self.config.lease_renew_slice_ms,
            poll_ms=poll_ms,
            auto_renew=True,
        )
        if not deliveries:
            return False
        pulled = [Pulled(d.message.lite_topic or "", d.message.body, d.attempt, d.receipt_handle,
                         d.message.user_properties) for d in deliveries]  # fmt: skip
        await self._deliver(parent, consumer, pulled, remote=False)
        return True

    async def _gather(self, remote: Remote, parent: str, consumer: str, room: int) -> bool:
        """In a cluster: this broker's messages and, without waiting, those of the other brokers that said they
        have some (as gathering does for a LiteSimpleConsumer); while none come, wait for either, leasing
        nothing anywhere: False when the wait ended (the loop then takes what is ready) or timed out."""
        found = await self._receive(parent, consumer, room, 0)
        room = self.max_inflight - self._busy
        if room > 0:
            pulled = await remote.pull(min(room, self.config.receive_batch_size))
            if pulled:
                await self._deliver(parent, consumer, pulled, remote=True)
                found = True
        if found or self.max_inflight - self._busy <= 0:
            return found
        here = asyncio.ensure_future(self.dispatcher.await_ready(consumer, self.group, parent, POLL_MS, capped=False))
        there = asyncio.ensure_future(remote.wait(POLL_MS / 1000))
        try:
            await asyncio.wait((here, there), return_when=asyncio.FIRST_COMPLETED)
        finally:
            here.cancel()
            there.cancel()
        for task in (here, there):  # a failure is the receive's to tell (it fails the same way)
            if task.done() and not task.cancelled():
                task.exception()
        return False

    async def _deliver(self, parent: str, consumer: str, deliveries: Sequence[Pulled], *, remote: bool) -> None:
        """Write ``deliveries`` as PUBLISH packets; ``remote``: they came from the other brokers (settled there)."""
        settle: list[str] = []
        subs = self.subs.get(parent, {})
        now = self.dispatcher.wall_clock()
        default = self.config.mqtt_default_parent
        for d in deliveries:
            props = d.properties
            mine = props.get(mapping.CLIENT) == self.client_id
            matched = [o for f, o in subs.items() if topics.takes(default, parent, f, d.lite, props)
                       and not (mine and o & _NO_LOCAL)]  # fmt: skip
            if not matched or mapping.expired(props, now):  # unsubscribed since it was leased, no-local, expired
                settle.append(d.receipt)
                continue
            qos = 0 if props.get(MQTT_QOS_PROPERTY) == "0" else max(o & codec.OPTION_QOS for o in matched)
            retain = props.get(mapping.RETAIN) == "1" and any(o & codec.OPTION_RETAIN_AS_PUBLISHED for o in matched)
            packet_id = self._packet_id() if qos else None
            topic = topics.topic_in(default, parent, d.lite, props)
            data = self._publish_bytes(topic, d.body, props, now, qos=qos, packet_id=packet_id, retain=retain,
                                       dup=d.attempt > 1)  # fmt: skip
            if data is None or qos == 0:
                settle.append(d.receipt)
            else:
                assert packet_id is not None
                self._out[packet_id] = _Out(consumer, d.receipt, parent, remote)
            if data is not None:
                self.writer.write(data)
        if self._busy >= self.max_inflight:
            self._room.clear()
        await self.writer.drain()
        if remote:
            cluster = self._cluster
            if cluster is not None and settle:
                await cluster.settle(consumer, self.group, parent, settle)
            return
        for receipt in settle:
            try:
                await self.dispatcher.ack(self.group, receipt, client_id=consumer)
            except errors.LmqError as exc:
                log.info("mqtt client %s: delivery not settled: %s", self.client_id, exc.message)

    def _publish_bytes(
        self,
        topic: str,
        body: bytes,
        stored: dict[str, str],
        now_ms: int,
        *,
        qos: int,
        packet_id: int | None,
        retain: bool,
        dup: bool = False,
    ) -> bytes | None:
        """The PUBLISH for a subscriber; None when it is over the client's maximum packet size (5.0: dropped,
        as if sent, MQTT-3.1.2-25)."""
        if not self.v5:
            return codec.encode_publish(topic, body, qos, packet_id, retain=retain, dup=dup)
        props = mapping.outgoing(stored, now_ms)
        data = codec.encode_publish(topic, body, qos, packet_id, retain=retain, dup=dup, props=props)
        if len(data) > self.max_packet_out:
            log.info("mqtt client %s: a message to %s over its maximum packet size is dropped", self.client_id, topic)
            return None
        return data

    async def _retained_elsewhere(
        self, wanted: list[tuple[str, wildcards.Filter, int]]
    ) -> list[list[durable.Retained] | None]:
        """Per subscription, the retained messages the other brokers of a cluster hold (asked all at once);
        None each while this broker is alone."""
        cluster = self._cluster
        if cluster is None:
            return [None for _ in wanted]
        return list(await asyncio.gather(*(cluster.retained(parent, levels) for parent, levels, _ in wanted)))

    async def _send_retained(
        self, parent: str, levels: wildcards.Filter, granted: int, elsewhere: list[durable.Retained] | None
    ) -> None:
        """The retained messages ``levels`` matches: this broker's and ``elsewhere`` (the other brokers'), per
        topic the newest. Streamed under the same bounds as live deliveries: a QoS 1 one waits for room in the
        in-flight window, and each is written once the socket took the one before (``drain``), so a client
        that does not read holds one of them here, not all (``matching.stream_retained``)."""
        now = self.dispatcher.wall_clock()
        found = matching.stream_retained(self.dispatcher.run, self.server.durable, parent, levels, now, elsewhere,
                                         default=(default := self.config.mqtt_default_parent))  # fmt: skip
        async for r in found:
            qos = min(r.qos, granted)
            while qos and self._busy >= self.max_inflight:
                self._room.clear()
                await self._room.wait()
            packet_id = self._packet_id() if qos else None
            topic = topics.topic_in(default, parent, r.lite, r.properties)
            data = self._publish_bytes(topic, r.payload, r.properties, now, qos=qos, packet_id=packet_id, retain=True)
            if data is None:
                continue
            if packet_id is not None:
                self._out[packet_id] = _Out("", "")
            self.writer.write(data)
            await self.writer.drain()

    def _packet_id(self) -> int:
        for packet_id in self._ids:
            if packet_id not in self._out:
                return packet_id
        raise AssertionError("unreachable: packet ids cycle forever")


async def _stop(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait for its end. Again and again: in Python 3.11 a ``wait_for`` whose inner wait
    completes as the cancellation arrives returns normally and swallows it (the long poll would go on)."""
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=0.1)
    with contextlib.suppress(asyncio.CancelledError, Exception):
        task.result()


_NO_LOCAL: Final = codec.OPTION_NO_LOCAL


def _reason_of(exc: Exception) -> int:
    """The 5.0 reason code a refused publish or subscription is answered with."""
    if isinstance(exc, topics.TopicError | errors.NotFound | errors.InvalidName | errors.InvalidLiteTopic):
        return Reason.TOPIC_NAME_INVALID
    if isinstance(exc, errors.LiteTopicQuotaExceeded | errors.SubscriptionQuotaExceeded | errors.TooManyRequests):
        return Reason.QUOTA_EXCEEDED
    if isinstance(exc, errors.Unauthorized | errors.Forbidden):
        return Reason.NOT_AUTHORIZED
    if isinstance(exc, errors.InvalidArgument | mapping.PropertiesTooLarge):
        return Reason.IMPLEMENTATION_SPECIFIC_ERROR
    return Reason.UNSPECIFIED_ERROR


def _answerable(exc: Exception) -> bool:
    """A refusal of these publishes (answered per publish in 5.0), not a failing store (which ends it)."""
    return _reason_of(exc) != Reason.UNSPECIFIED_ERROR
