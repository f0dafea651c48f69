"""One MQTT network connection: CONNECT, then publishes in and deliveries out, through the dispatcher.

Publishing goes through ``Dispatcher.send`` like a gRPC SendMessage: the PUBLISH packets a connection read
are appended in order, as many per store call as arrived meanwhile (one fsync for the lot), and each QoS 1
PUBACK (QoS 2 PUBREC) is written once the append returned, that is after the fsync (``--flush-mode sync``).

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
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import logging
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from lmq_broker import errors, model
from lmq_broker.dispatch import metadata, offsets, wildcards
from lmq_broker.dispatch.dispatcher import Delivery
from lmq_broker.mqtt import codec, durable, topics

if TYPE_CHECKING:
    from lmq_broker.mqtt.server import MqttServer

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S: Final = 10.0
KEEP_ALIVE_GRACE: Final = 1.5  # MQTT-3.1.2-24: one and a half keep-alive periods without a packet ends it
READ_BYTES: Final = 64 * 1024
MAX_INFLIGHT: Final = 64  # QoS 1 deliveries waiting for their PUBACK, per connection
PUBLISH_QUEUE: Final = 256  # PUBLISH packets read and not yet stored; the reader waits beyond it
MAX_PUBLISH_BATCH: Final = 256  # messages per store call
MAX_FILTERS: Final = 1000  # topic filters one session may hold
POLL_MS: Final = 20_000
RETRY_S: Final = 1.0  # a refused receive (store rebuilding, parent deleted) is tried again after this
MQTT_QOS_PROPERTY: Final = "MQTT_QOS"  # user property of a QoS 0 publish: delivered at QoS 0 to every subscriber
_PLAIN_ID: Final = re.compile(r"^[A-Za-z0-9_-]{1,100}$")
_BOOT_HOST: Final = "mqtt"


def group_of(client_id: str) -> str:
    """The implicit lite group of an MQTT client id: the id itself when it is a short plain name, else a hash
    (a ``%`` marks it, which no plain id holds, so two ids never share a group)."""
    if _PLAIN_ID.match(client_id):
        return metadata.MQTT_GROUP_PREFIX + client_id
    return metadata.MQTT_GROUP_PREFIX + "%" + hashlib.sha256(client_id.encode()).hexdigest()[:40]


@dataclass(frozen=True, slots=True)
class _Out:
    """A QoS 1 delivery waiting for its PUBACK; ``receipt`` is empty for a retained message."""

    consumer: str
    receipt: str


class Closed(Exception):
    """The connection ends; ``graceful`` when the client sent DISCONNECT (no will then)."""

    def __init__(self, reason: str, *, graceful: bool = False) -> None:
        super().__init__(reason)
        self.graceful = graceful


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
        self.clean = True
        self.will: codec.Will | None = None
        self.keep_alive_s = 0
        self.subs: dict[str, dict[wildcards.Filter, int]] = {}  # parent -> filter -> granted QoS
        self._consumers: dict[str, asyncio.Task[None]] = {}
        self._out: dict[int, _Out] = {}
        self._room = asyncio.Event()
        self._room.set()
        self._ids = itertools.cycle(range(1, 65536))
        self._incoming: asyncio.Queue[tuple[codec.Publish, bool] | None] = asyncio.Queue(PUBLISH_QUEUE)
        self._publisher: asyncio.Task[None] | None = None
        self._awaiting_release: set[int] = set()  # QoS 2 packet ids stored, PUBREL not yet seen
        self._failure: BaseException | None = None
        self._decoder = codec.Decoder(self._max_packet_bytes())
        self._connected = asyncio.Event()  # CONNACK written: deliveries may follow
        self._closing = False
        self.done = asyncio.Event()
        self.kicked = False

    # --- life ------------------------------------------------------------------------------------------------
    async def run(self) -> None:
        graceful, reason = False, "connection lost"
        try:
            if await self._handshake():
                await self._serve()
        except Closed as exc:
            graceful, reason = exc.graceful, str(exc)
        except codec.MalformedPacket as exc:
            reason = f"malformed packet: {exc.reason}"
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError) as exc:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        except asyncio.CancelledError:
            reason = "broker shutting down"
            graceful = True  # the broker, not the client, ends it: no will (docs/mqtt.md)
        except Exception:
            log.exception("mqtt client %s (%s): connection failed", self.client_id or "?", self.peer)
        finally:
            await self._end(graceful, reason)

    async def kick(self) -> None:
        """Another connection took this client id (MQTT-3.1.4-2): end this one and wait until it has."""
        self.kicked = True
        self.writer.close()
        await self.done.wait()

    async def _handshake(self) -> bool:
        first: list[codec.Packet] = []
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            while not first:
                data = await self.reader.read(READ_BYTES)
                if not data:
                    return False
                try:
                    first = self._decoder.feed(data)
                except codec.UnsupportedProtocol as exc:
                    self.writer.write(codec.encode_connack(False, codec.ConnectCode.BAD_PROTOCOL_VERSION, exc.level))
                    raise Closed(exc.reason) from None
        connect = first[0]
        if not isinstance(connect, codec.Connect):
            raise codec.MalformedPacket("the first packet is not CONNECT")  # MQTT-3.1.0-1
        refused = self._refusal(connect)
        if refused is not None:
            self.writer.write(codec.encode_connack(False, refused))
            await self.writer.drain()
            raise Closed(f"CONNECT refused: {refused.name}", graceful=True)
        self.client_id = connect.client_id or "auto-" + secrets.token_hex(8)  # MQTT-3.1.3-6
        self.group = group_of(self.client_id)
        self.clean = connect.clean_session
        self.will = connect.will
        self.keep_alive_s = connect.keep_alive_s
        await self.server.take_over(self)
        session_present = False
        saved = await self.dispatcher.run(self.server.durable.load_session, self.client_id)
        if self.clean:
            if saved is not None:
                await self.dispatcher.run(self.server.durable.drop_session, self.client_id)  # MQTT-3.1.2-6
        elif saved is not None:
            session_present = True
            await self._restore(saved)
        else:
            await self._save()  # a persistent session exists from its CONNECT on, subscribed or not
        self.writer.write(codec.encode_connack(session_present, codec.ConnectCode.ACCEPTED))
        self._connected.set()
        await self.writer.drain()
        log.info("mqtt client %s connected from %s (clean session %s, session present %s)",
                 self.client_id, self.peer, self.clean, session_present)  # fmt: skip
        self._publisher = asyncio.get_running_loop().create_task(self._publish_loop())
        for packet in first[1:]:
            await self._handle(packet)
        return True

    def _refusal(self, connect: codec.Connect) -> codec.ConnectCode | None:
        if not connect.client_id and not connect.clean_session:
            return codec.ConnectCode.IDENTIFIER_REJECTED  # MQTT-3.1.3-8
        if connect.will is not None:
            try:
                topics.lite_of(connect.will.topic, self.config.max_lite_topic_size)
            except topics.TopicError:
                return codec.ConnectCode.NOT_AUTHORIZED  # a will we could never publish
        if self.config.access_key:
            if connect.username is None or connect.password is None:
                return codec.ConnectCode.NOT_AUTHORIZED
            user_ok = hmac.compare_digest(connect.username.encode(), self.config.access_key.encode())
            password_ok = hmac.compare_digest(connect.password, self.config.secret_key.encode())
            if not (user_ok and password_ok):
                return codec.ConnectCode.BAD_USERNAME_OR_PASSWORD
        return None

    def _max_packet_bytes(self) -> int:
        return self.config.max_body_bytes + 2 + codec.MAX_STRING_BYTES + 2  # a PUBLISH: topic, packet id, body

    async def _serve(self) -> None:
        timeout = self.keep_alive_s * KEEP_ALIVE_GRACE if self.keep_alive_s else None
        while True:
            async with asyncio.timeout(timeout):
                data = await self.reader.read(READ_BYTES)
            if self._failure is not None:
                raise Closed(f"publish failed: {self._failure}")
            if not data:
                if self.server.stopping:
                    raise Closed("the broker is shutting down", graceful=True)
                raise Closed("taken over by a newer connection" if self.kicked else "closed without DISCONNECT")
            for packet in self._decoder.feed(data):
                await self._handle(packet)

    async def _end(self, graceful: bool, reason: str) -> None:
        self._closing = True
        if self.client_id:
            log.info("mqtt client %s disconnected (%s)", self.client_id, reason)
        for task in self._consumers.values():
            await _stop(task)
        if self._publisher is not None:  # store what was read (the client may not learn it; at least once)
            await self._incoming.put(None)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._publisher
        for out in self._out.values():  # handed out, not acknowledged: back to the group at once
            if out.receipt:
                with contextlib.suppress(errors.LmqError):
                    await self.dispatcher.change_invisible(self.group, out.receipt, 0)
        self._out.clear()
        for parent in self._consumers:
            self.dispatcher.client_gone(self._consumer_id(parent))
        if not graceful and self.will is not None and not self.server.stopping:
            await self._publish_will(self.will)
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()
        self.server.forget(self)
        self.done.set()

    async def _publish_will(self, will: codec.Will) -> None:
        try:
            await self._store([codec.Publish(will.topic, will.payload, will.qos, will.retain)])
            log.info("mqtt client %s: will published to %s", self.client_id, will.topic)
        except (errors.LmqError, topics.TopicError, ValueError) as exc:
            log.warning("mqtt client %s: will to %s not published: %s", self.client_id, will.topic, exc)

    # --- packets in ---------------------------------------------------------------------------------------------
    async def _handle(self, packet: codec.Packet) -> None:
        if isinstance(packet, codec.Publish):
            await self._received(packet)
        elif isinstance(packet, codec.PacketId):
            if packet.kind == codec.PUBACK:
                await self._acknowledged(packet.packet_id)
            elif packet.kind == codec.PUBREL:
                self._awaiting_release.discard(packet.packet_id)
                self.writer.write(codec.encode_packet_id(codec.PUBCOMP, packet.packet_id))
            else:  # PUBREC/PUBCOMP answer QoS 2 deliveries, which this broker never makes; UNSUBACK is ours
                raise codec.MalformedPacket(f"unexpected packet type {packet.kind}")
        elif isinstance(packet, codec.Subscribe):
            await self._subscribe(packet)
        elif isinstance(packet, codec.Unsubscribe):
            await self._unsubscribe(packet)
        elif isinstance(packet, codec.Bare) and packet.kind == codec.PINGREQ:
            self.writer.write(codec.PINGRESP_BYTES)
        elif isinstance(packet, codec.Bare) and packet.kind == codec.DISCONNECT:
            self.will = None  # MQTT-3.14.4-3
            raise Closed("DISCONNECT", graceful=True)
        else:
            raise codec.MalformedPacket(f"unexpected {type(packet).__name__}")  # a second CONNECT: MQTT-3.1.0-2

    async def _received(self, packet: codec.Publish) -> None:
        try:
            parent, _ = topics.lite_of(packet.topic, self.config.max_lite_topic_size)
            (await self.dispatcher.metadata()).lite_parent(parent)
        except (topics.TopicError, errors.LmqError) as exc:
            # 3.1.1 has no negative PUBACK: closing is the only way to tell the client (MQTT-3.3.5-2)
            raise Closed(f"PUBLISH to {packet.topic!r} refused: {exc}") from None
        if not packet.payload and not packet.retain:
            raise Closed(f"PUBLISH to {packet.topic!r} refused: an empty message cannot be stored")
        duplicate = packet.qos == 2 and packet.packet_id in self._awaiting_release
        if packet.qos == 2 and packet.packet_id is not None:
            self._awaiting_release.add(packet.packet_id)  # a resend before its PUBREL is not stored again
        await self._incoming.put((packet, not duplicate))

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
                await self._store([p for p, store in batch if store])
            except (errors.LmqError, topics.TopicError, ValueError) as exc:
                self._failure = exc
                self.writer.close()  # the reader sees the end and reports ``_failure``
                continue
            for p, _ in batch:
                if p.qos == 1 and p.packet_id is not None:
                    self.writer.write(codec.encode_packet_id(codec.PUBACK, p.packet_id))
                elif p.qos == 2 and p.packet_id is not None:
                    self.writer.write(codec.encode_packet_id(codec.PUBREC, p.packet_id))

    async def _store(self, publishes: Sequence[codec.Publish]) -> None:
        """Append the messages (one store call), then record the retained ones; both durable on return."""
        messages: list[model.NewMessage] = []
        retained: list[durable.Retained] = []
        now = self.dispatcher.wall_clock()
        for p in publishes:
            parent, lite = topics.lite_of(p.topic, self.config.max_lite_topic_size)
            if p.retain:
                retained.append(durable.Retained(parent, lite, p.payload, min(p.qos, 1), now))
            if p.payload:
                messages.append(self._message(parent, lite, p, now))
        if messages:
            await self.dispatcher.send(messages)
        if retained:
            await self.dispatcher.run(self.server.durable.put_retained, retained)

    def _message(self, parent: str, lite: str, p: codec.Publish, now_ms: int) -> model.NewMessage:
        lmq = model.QueueId.lmq(parent, lite)
        queues = (model.QueueId(parent, 0), lmq) if self.config.index_parent_queue else (lmq,)
        return model.NewMessage(
            message_id=secrets.token_hex(16).upper(),
            topic=parent,
            body=p.payload,
            queues=queues,
            lite_topic=lite,
            message_type=model.MessageType.LITE,
            born_timestamp_ms=now_ms,
            born_host=self.host,
            user_properties={MQTT_QOS_PROPERTY: "0"} if p.qos == 0 else {},
        )

    async def _acknowledged(self, packet_id: int) -> None:
        out = self._out.pop(packet_id, None)
        if out is None:
            return  # not ours (or acknowledged twice): nothing to settle
        if len(self._out) < MAX_INFLIGHT:
            self._room.set()
        if out.receipt:
            try:
                await self.dispatcher.ack(self.group, out.receipt, client_id=out.consumer)
            except errors.LmqError as exc:  # e.g. the lease was given back meanwhile: it comes again
                log.info("mqtt client %s: PUBACK %d not settled: %s", self.client_id, packet_id, exc.message)

    # --- subscriptions ----------------------------------------------------------------------------------------
    async def _restore(self, saved: dict[str, int]) -> None:
        for text, qos in saved.items():
            with contextlib.suppress(topics.TopicError):
                parent, levels = topics.subscription_of(text)
                self.subs.setdefault(parent, {})[levels] = qos
        for parent in list(self.subs):
            await self._register(parent)

    async def _subscribe(self, packet: codec.Subscribe) -> None:
        codes: list[int] = []
        fresh: dict[str, list[wildcards.Filter]] = {}
        granted: dict[int, tuple[str, wildcards.Filter]] = {}  # index in codes -> the subscription it granted
        snap = await self.dispatcher.metadata()
        for text, qos in packet.filters:
            try:
                parent, levels = topics.subscription_of(text)
                snap.lite_parent(parent)
            except (topics.TopicError, errors.LmqError) as exc:
                log.info("mqtt client %s: subscription %r refused: %s", self.client_id, text, exc)
                codes.append(codec.SUBACK_FAILURE)
                continue
            held = self.subs.setdefault(parent, {})
            if levels not in held:
                if sum(map(len, self.subs.values())) >= MAX_FILTERS:
                    codes.append(codec.SUBACK_FAILURE)
                    continue
                fresh.setdefault(parent, []).append(levels)
            held[levels] = min(qos, 1)  # QoS 2 subscriptions are granted QoS 1
            granted[len(codes)] = (parent, levels)
            codes.append(held[levels])
        for parent, new in fresh.items():
            older = [f for f in self.subs[parent] if f not in new]
            try:
                await self._start_at_end(parent, new, older)
                await self._register(parent)
            except errors.LmqError as exc:  # e.g. the store rebuilds its index: these filters fail, the rest holds
                log.warning("mqtt client %s: subscriptions in %s refused: %s", self.client_id, parent, exc.message)
                for f in new:
                    self.subs[parent].pop(f, None)
                for i, (p, f) in list(granted.items()):
                    if p == parent and f in new:
                        codes[i] = codec.SUBACK_FAILURE
                        del granted[i]
                await self._register(parent)
        if granted and not self.clean:
            await self._save()
        self.writer.write(codec.encode_suback(packet.packet_id, codes))
        for i, (parent, levels) in granted.items():  # MQTT-3.3.1-6, 3.8.4-3: retained messages after the SUBACK
            await self._send_retained(parent, levels, codes[i])

    async def _unsubscribe(self, packet: codec.Unsubscribe) -> None:
        changed = set()
        for text in packet.filters:
            with contextlib.suppress(topics.TopicError):
                parent, levels = topics.subscription_of(text)
                if self.subs.get(parent, {}).pop(levels, None) is not None:
                    changed.add(parent)
        for parent in changed:
            await self._register(parent)
        if changed and not self.clean:
            await self._save()
        self.writer.write(codec.encode_packet_id(codec.UNSUBACK, packet.packet_id))

    async def _save(self) -> None:
        filters = {topics.filter_text(p, f): q for p, held in self.subs.items() for f, q in held.items()}
        await self.dispatcher.run(self.server.durable.save_session, self.client_id, filters)

    async def _start_at_end(self, parent: str, new: list[wildcards.Filter], older: list[wildcards.Filter]) -> None:
        """The group's start in each existing lite topic that only the ``new`` filters match: its end (what
        it holds was published before the subscription). Pages over the range those filters can match."""
        start_after, end_before = wildcards.scan_range(new)
        lites: list[str] = []
        while True:
            page = await self.dispatcher.run(
                self.dispatcher.store.scan_lite_topics, parent, start_after, end_before, 512
            )
            for meta in page:
                levels = meta.lite.split(wildcards.LEVEL_SEPARATOR)
                if (
                    meta.max_offset > meta.min_offset
                    and any(wildcards.matches(f, levels) for f in new)
                    and not any(wildcards.matches(f, levels) for f in older)
                ):
                    lites.append(meta.lite)
            if len(page) < 512:
                break
            start_after = page[-1].lite
        for i in range(0, len(lites), 512):
            await self.dispatcher.reset_offsets(
                self.group, parent, lites[i : i + 512], offsets.OffsetReset(offsets.OffsetPolicy.MAX)
            )

    async def _register(self, parent: str) -> None:
        """Give the dispatcher this session's filters in ``parent``; start or stop the parent's delivery loop."""
        filters = list(self.subs.get(parent, {}))
        consumer = self._consumer_id(parent)
        await self.dispatcher.subscribe_filters(consumer, self.group, parent, filters)
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
        slice_ms = self.config.lease_renew_slice_ms
        await self._connected.wait()
        while not self._closing:
            try:  # a client slow to PUBACK: still alive for the dispatcher (its registration, its leases)
                await asyncio.wait_for(self._room.wait(), POLL_MS / 1000)
            except TimeoutError:
                self.dispatcher.client_seen(consumer)
                continue
            if self.dispatcher.wildcards.registration(consumer) is None and self.subs.get(parent):
                await self._register(parent)  # expired meanwhile (an event loop stalled past client expiry)
            room = MAX_INFLIGHT - len(self._out)
            try:
                deliveries = await self.dispatcher.receive_lite(
                    consumer,
                    self.group,
                    parent,
                    batch=max(1, min(room, self.config.receive_batch_size)),
                    invisible_ms=slice_ms,
                    poll_ms=POLL_MS,
                    auto_renew=True,
                )
            except errors.LmqError as exc:
                log.warning("mqtt client %s: receive in %s refused (%s); retried", self.client_id, parent, exc.message)
                await asyncio.sleep(RETRY_S)
                continue
            if not deliveries:
                if self.dispatcher.draining:
                    return
                continue
            await self._deliver(parent, consumer, deliveries)

    async def _deliver(self, parent: str, consumer: str, deliveries: list[Delivery]) -> None:
        settle: list[str] = []
        held = self.subs.get(parent, {})
        for d in deliveries:
            m = d.message
            lite = m.lite_topic or ""
            levels = lite.split(wildcards.LEVEL_SEPARATOR)
            qos = max((q for f, q in held.items() if wildcards.matches(f, levels)), default=None)
            if qos is None:  # unsubscribed since it was leased: this session is not to get it
                settle.append(d.receipt_handle)
                continue
            if m.user_properties.get(MQTT_QOS_PROPERTY) == "0":
                qos = 0
            topic = topics.topic_of(parent, lite)
            if qos == 0:
                self.writer.write(codec.encode_publish(topic, m.body))
                settle.append(d.receipt_handle)
                continue
            packet_id = self._packet_id()
            self._out[packet_id] = _Out(consumer, d.receipt_handle)
            self.writer.write(codec.encode_publish(topic, m.body, 1, packet_id, dup=d.attempt > 1))
        if len(self._out) >= MAX_INFLIGHT:
            self._room.clear()
        await self.writer.drain()
        for receipt in settle:
            try:
                await self.dispatcher.ack(self.group, receipt, client_id=consumer)
            except errors.LmqError as exc:
                log.info("mqtt client %s: delivery not settled: %s", self.client_id, exc.message)

    async def _send_retained(self, parent: str, levels: wildcards.Filter, granted: int) -> None:
        start_after, end_before = wildcards.scan_range([levels])
        found = await self.dispatcher.run(self.server.durable.retained_between, parent, start_after, end_before)
        for r in found:
            if not wildcards.matches(levels, r.lite.split(wildcards.LEVEL_SEPARATOR)):
                continue
            qos = min(r.qos, granted)
            packet_id = None
            if qos:
                packet_id = self._packet_id()
                self._out[packet_id] = _Out("", "")
            topic = topics.topic_of(parent, r.lite)
            self.writer.write(codec.encode_publish(topic, r.payload, qos, packet_id, retain=True))
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
