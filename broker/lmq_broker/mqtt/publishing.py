"""The client's publishes: stored through ``Dispatcher.send`` like a gRPC SendMessage. The PUBLISH packets a
connection read are appended in order, as many per store call as arrived meanwhile (one fsync for the lot),
and each QoS 1 PUBACK (QoS 2 PUBREC) is written once the append returned, that is after the fsync
(``--flush-mode sync``). In a cluster the messages go to their lite topics' owners instead (``storing``), and
the answers wait for theirs: an owner that cannot store fails the batch like a failing store here.

What 3.1.1 can only answer by closing, 5.0 answers with a reason code (a negative PUBACK); our receive maximum
bounds a 5.0 client's unacknowledged publishes.

QoS 2 (MQTT 3.1.1 and 5.0 section 4.3.3, method B): the message is stored once and answered PUBREC; its packet
id is kept until the PUBREL, which is answered PUBCOMP, and a resend of the PUBLISH meanwhile (DUP) is answered
PUBREC again without being stored. For a persistent session the ids are written to the durable store
(``durable.INBOUND``) before the batch is appended, each with the message id its message is stored under, in
one transaction per batch with the PUBRELs' removals, so a resend after a reconnect or a broker restart (kill
-9 at any point included) is stored once: ``exactly``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Final

from lmq_broker import errors
from lmq_broker.mqtt import codec, durable, exactly, stats, storing, topics
from lmq_broker.mqtt.link import Closed, Link, reason_of
from lmq_broker.mqtt.properties import Reason

log = logging.getLogger(__name__)

PUBLISH_QUEUE: Final = 256  # PUBLISH packets read and not yet stored; the reader waits beyond it
MAX_PUBLISH_BATCH: Final = 256  # messages per store call
RECEIVE_MAXIMUM: Final = PUBLISH_QUEUE  # 5.0: a client's QoS 1/2 publishes not yet acknowledged, at most
TOPIC_ALIAS_MAX: Final = 64  # 5.0: inbound topic aliases per connection


@dataclass(frozen=True, slots=True)
class _In:
    """A publish read: stored (``store``), or refused with ``reason`` (5.0; the answer keeps its place)."""

    packet: codec.Publish
    store: bool = True
    reason: int = 0
    why: str = ""
    message_id: str = ""  # a persistent session's QoS 2 publish: the id it is stored under (``exactly``)


@dataclass(frozen=True, slots=True)
class _Release:
    """A PUBREL read: ``known`` when its packet id awaited it (else 5.0 answers 0x92)."""

    packet_id: int
    known: bool


class Publishes:
    def __init__(self, link: Link) -> None:
        self.link = link
        self.failure: BaseException | None = None  # storing failed: the connection ends
        self._aliases: dict[int, str] = {}  # 5.0 inbound topic aliases
        self._unacked_in = 0  # 5.0: the client's QoS 1/2 publishes not yet answered
        self._incoming: asyncio.Queue[_In | _Release | None] = asyncio.Queue(PUBLISH_QUEUE)
        self._publisher: asyncio.Task[None] | None = None
        self._awaiting_release: set[int] = set()  # QoS 2 packet ids stored, PUBREL not yet seen
        self._unverified: dict[int, exactly.Planned] = {}  # of those, read back from the rows: stored maybe

    def start(self) -> None:
        self._publisher = asyncio.get_running_loop().create_task(self._publish_loop())

    async def finish(self) -> None:
        """Store what was read (the client may not learn it; at least once)."""
        if self._publisher is not None:
            await self._incoming.put(None)
            await self.link.ended(self._publisher, "storing what was read")

    async def resume(self) -> None:
        """A resumed persistent session: the QoS 2 packet ids that still await their PUBREL."""
        link = self.link
        ids = await link.dispatcher.run(link.host.durable.qos2_ids, link.client_id, durable.INBOUND)
        self._awaiting_release = set(ids)
        self._unverified = {i: planned for i, text in ids.items() if (planned := exactly.planned_of(text))}
        for i, text in ids.items():
            if text and i not in self._unverified:  # a damaged row: whether its message was stored is unknown
                log.error(
                    "mqtt client %s: the row of QoS 2 packet id %d does not read (%r); its resend is stored again "
                    "rather than lost (at least once)", link.client_id, i, text[:80],
                )  # fmt: skip
                self._unverified[i] = exactly.UNKNOWN

    async def released(self, packet_id: int) -> None:
        """PUBREL: answered with PUBCOMP (5.0: 0x92 for an id not awaiting one), in order with the publishes
        read before it (the id is forgotten in the durable store first)."""
        known = packet_id in self._awaiting_release
        if known:
            self._awaiting_release.discard(packet_id)
            self._unverified.pop(packet_id, None)
            self._unacked_in = max(0, self._unacked_in - 1) if self.link.v5 else 0
        await self._incoming.put(_Release(packet_id, known))

    async def received(self, packet: codec.Publish) -> None:
        duplicate = packet.qos == 2 and packet.packet_id in self._awaiting_release
        again = await self._not_stored(packet.packet_id) if duplicate else None  # stored now under its id
        if packet.properties is not None:
            packet = self._resolve_alias(packet)
            if packet.qos and not duplicate:
                self._unacked_in += 1
                if self._unacked_in > RECEIVE_MAXIMUM:
                    self.link.host.stats.refused[stats.RECEIVE_MAXIMUM] += 1
                    raise Closed("receive maximum exceeded", code=Reason.RECEIVE_MAXIMUM_EXCEEDED)  # MQTT-3.3.4-9
        elif packet.qos == 2 and not duplicate:
            self._within_qos2_cap(packet)
        refusal = await self._refusal_of(packet)
        if refusal is not None:
            reason, why = refusal
            if not self.link.v5 or packet.qos == 0:
                # 3.1.1 has no negative PUBACK: closing is the only way to tell the client (MQTT-3.3.5-2)
                self._refused(packet.topic, reason, why)
                raise Closed(f"PUBLISH to {packet.topic!r} refused: {why}", code=reason)
            self._refused(packet.topic, reason, why, answered=True)
            if again is not None and packet.packet_id is not None:  # its flow ends: its row goes (``_forget``)
                self._awaiting_release.discard(packet.packet_id)
            await self._incoming.put(_In(packet, False, reason, why, again.message_id if again else ""))
            return
        if packet.qos == 2 and packet.packet_id is not None:
            self._awaiting_release.add(packet.packet_id)  # a resend before its PUBREL is not stored again
        if again is not None:
            await self._incoming.put(_In(packet, True, message_id=again.message_id))
            return
        await self._incoming.put(_In(packet, not duplicate))

    async def _not_stored(self, packet_id: int | None) -> exactly.Planned | None:
        """A resend of a QoS 2 publish whose row was read back (after a reconnect or restart): its row, when its
        message is not in the store (the broker died before the append); None when it is, or was known to be.
        In a cluster it is looked for at its lite topic's owner; an owner that cannot tell closes the connection
        (the row stays: the client's next resend is looked for again)."""
        planned = self._unverified.pop(packet_id, None) if packet_id is not None else None
        if planned is None or planned is exactly.UNKNOWN:
            return planned  # (UNKNOWN: a damaged row; stored now, under a new id)
        cluster = self.link.cluster
        if cluster is not None:
            try:
                found = await cluster.was_stored(planned)
            except errors.LmqError as exc:  # neither stored twice nor answered: the client resends later
                if packet_id is not None:
                    self._unverified[packet_id] = planned
                self._refused(planned.lite, reason_of(exc), f"QoS 2 resend {packet_id} not checked: {exc}")
                raise Closed(f"QoS 2 resend {packet_id} not checked at its owner: {exc}", code=reason_of(exc)) from exc
            if found is not None:
                return None if found else planned
        dispatcher = self.link.dispatcher
        try:
            stored = await dispatcher.run(exactly.was_stored, dispatcher.store, planned)
        except errors.LmqError as exc:  # cannot tell: stored again rather than lost (at least once)
            log.warning("mqtt client %s: QoS 2 resend %d not checked, stored again: %s", self.link.client_id,
                        packet_id, exc)  # fmt: skip
            stored = False
        return None if stored else planned

    def _within_qos2_cap(self, packet: codec.Publish) -> None:
        """3.1.1: one QoS 2 publish more than ``--mqtt-max-qos2-inflight`` awaiting PUBREL: counted, logged, closed
        (3.1.1 has no refusal but closing; the client resends it after reconnecting, nothing is lost)."""
        link = self.link
        cap = link.config.mqtt_max_qos2_inflight
        if len(self._awaiting_release) < cap:
            return
        link.host.stats.refused[stats.QOS2_INFLIGHT] += 1
        why = f"{cap} QoS 2 publishes await their PUBREL (--mqtt-max-qos2-inflight)"
        link.host.stats.refusals.refused(link.client_id, "PUBLISH", packet.topic, why, "the connection is closed")
        raise Closed(f"QoS 2 publish refused: {why}")

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
        link = self.link
        try:
            snap = await link.dispatcher.metadata()
            where = topics.space_of(snap).lite_of(packet.topic)
            snap.lite_parent(where.parent)
            link.host.authorize_publish(link.user, link.address, where)
        except (topics.TopicError, errors.LmqError) as exc:
            return reason_of(exc), str(exc)
        p = packet.properties
        if p is not None and p.payload_format == 1:
            try:
                packet.payload.decode("utf-8")
            except UnicodeDecodeError:
                return Reason.PAYLOAD_FORMAT_INVALID, "payload format indicator 1 and a payload that is not UTF-8"
        return None

    def _refused(self, topic: str, reason: int, why: str, *, answered: bool = False) -> None:
        """A refused publish: counted by reason, logged at INFO (rate-limited) with what the client is told."""
        link = self.link
        name = Reason(reason).name.lower() if reason in Reason.__members__.values() else f"{reason:#04x}"
        link.host.stats.publishes_refused[name] += 1
        told = f"{'reason code' if answered else 'DISCONNECT'} {reason:#04x}" if link.v5 else "3.1.1: no other way"
        outcome = f"answered with {told}" if answered else f"the connection is closed ({told})"
        link.host.stats.refusals.refused(link.client_id, "PUBLISH", topic, why, outcome)

    async def _publish_loop(self) -> None:
        """Store what was read, in order and in batches, then acknowledge each (after the store's fsync)."""
        while True:
            item = await self._incoming.get()
            if item is None:
                return
            batch: list[_In | _Release] = [item]
            while len(batch) < MAX_PUBLISH_BATCH and not self._incoming.empty():
                more = self._incoming.get_nowait()
                if more is None:
                    self._incoming.put_nowait(None)
                    break
                batch.append(more)
            if self.failure is not None:
                continue  # the connection is ending: nothing more is stored (the reader may still be putting)
            try:  # a persistent session's QoS 2 rows (and PUBRELs) first: ``exactly``
                batch, recorded = await self._record(batch)
            except Exception as exc:  # nothing stored, no PUBREC: the client resends, nothing is lost
                self._fail(exc, "")
                continue
            stored = [i for i in batch if isinstance(i, _In) and i.store]
            try:
                await self._store([i.packet for i in stored], [i.message_id for i in stored])  # one store call
            except (errors.LmqError, topics.TopicError, ValueError) as exc:
                if not self.link.v5 or not _answerable(exc):
                    self._fail(exc, stored[0].packet.topic if stored else "")
                    continue
                batch = await self._store_each(batch)  # 5.0: each publish gets its own answer
            await self._forget_refused(batch)
            if any(i.message_id for i in stored):
                exactly.crash_point(exactly.APPENDED)
                if not await self._stored_elsewhere(batch):
                    continue
            if recorded:  # the rows on the replicas before the PUBRECs (PUBCOMPs): a resend there is found too
                await self.link.host.rows_saved(self.link.client_id, "its QoS 2 packet ids")
            for i in batch:
                self._answer(i)

    def _fail(self, exc: Exception, topic: str) -> None:
        """Storing failed: the connection ends (the client resends what it got no answer for)."""
        self._refused(topic, reason_of(exc), str(exc))
        self.failure = exc
        self.link.close(Reason.UNSPECIFIED_ERROR, str(exc))  # the reader sees the end, tells ``failure``

    async def _record(self, batch: list[_In | _Release]) -> tuple[list[_In | _Release], bool]:
        """A persistent session's QoS 2 packet ids to be stored in ``batch`` (each with the message id it is then
        stored under, ``exactly``) and those released, in the durable store before the batch is appended (one
        transaction); the batch with those message ids, and whether rows were written."""
        link = self.link
        if not link.persistent:
            return batch, False  # the state ends with the connection (it is in ``_awaiting_release``)
        space = await storing.space_of(link.host)
        planned: list[tuple[int, str, str, str]] = []
        out: list[_In | _Release] = []
        for i in batch:
            pid = i.packet.packet_id if isinstance(i, _In) and i.store and i.packet.qos == 2 else None
            if isinstance(i, _In) and pid is not None:
                if not i.message_id:
                    i = replace(i, message_id=storing.new_message_id())  # noqa: PLW2901 (the item, with its id)
                parent, lite = space.lite_of(i.packet.topic)
                planned.append((pid, i.message_id, parent, lite))
            out.append(i)
        remove = [i.packet_id for i in batch if isinstance(i, _Release) and i.known]
        ends: list[int | None] = [None] * len(planned)
        cluster = link.cluster
        if cluster is not None and planned:  # where each goes at its owner (``exactly``: looked for from there)
            ends = await cluster.ends([(parent, lite) for _, _, parent, lite in planned])
        if planned or remove:
            await link.dispatcher.run(self._write_rows, planned, ends, remove)
        if planned:
            exactly.crash_point(exactly.RECORDED)
        return out, bool(planned or remove)

    def _write_rows(self, planned: list[tuple[int, str, str, str]], ends: list[int | None], remove: list[int]) -> None:
        """Blocking: each planned publish's place read (here, or its end at its owner: ``ends``), then the rows
        written (one transaction)."""
        link = self.link
        store = link.dispatcher.store
        add = [
            (pid, exactly.plan(store, mid, parent, lite, end).text())
            for (pid, mid, parent, lite), end in zip(planned, ends, strict=True)
        ]
        link.host.durable.qos2_update(link.client_id, durable.INBOUND, add, remove)

    async def _stored_elsewhere(self, batch: Sequence[_In | _Release]) -> bool:
        """In a cluster, where a message may be stored at another owner (which ``exactly`` cannot look in): the
        rows of the QoS 2 publishes stored are marked so once the append returned, before their PUBRECs. A
        failure ends the connection (False: no PUBREC; a resend is looked for here, maybe stored again)."""
        link = self.link
        ids = [i.packet.packet_id for i in batch if isinstance(i, _In) and i.message_id and i.store]
        if link.cluster is None or not ids:
            return True
        try:
            await link.dispatcher.run(link.host.durable.qos2_stored, link.client_id, [i for i in ids if i is not None])
        except Exception as exc:
            self._fail(exc, "")
            return False
        return True

    async def _forget_refused(self, batch: Sequence[_In | _Release]) -> None:
        """The rows of QoS 2 publishes refused (5.0) after their rows were written: their flows ended, their ids
        are free. A failure leaves them: a resend is then looked for, not found, and stored."""
        link = self.link
        gone = [i.packet.packet_id for i in batch if isinstance(i, _In) and i.message_id and not i.store]
        ids = [pid for pid in gone if pid is not None]
        if not ids or not link.persistent:
            return
        try:
            await link.dispatcher.run(link.host.durable.qos2_update, link.client_id, durable.INBOUND, [], ids)
        except Exception as exc:
            log.warning("mqtt client %s: rows of refused QoS 2 publishes kept: %s", link.client_id, exc)

    async def _store_each(self, batch: list[_In | _Release]) -> list[_In | _Release]:
        """Store one by one what failed together (a quota refuses the whole batch), refusing each that fails."""
        out: list[_In | _Release] = []
        for item in batch:
            answer = item
            if isinstance(item, _In) and item.store:
                p = item.packet
                try:
                    await self._store([p], [item.message_id])
                except (errors.LmqError, topics.TopicError, ValueError) as exc:
                    if p.qos == 2 and p.packet_id is not None:
                        self._awaiting_release.discard(p.packet_id)
                    answer = _In(p, False, reason_of(exc), str(exc), item.message_id)
                    self._refused(p.topic, answer.reason, answer.why, answered=True)
            out.append(answer)
        return out

    def _answer(self, i: _In | _Release) -> None:
        link = self.link
        if isinstance(i, _Release):
            reason = 0 if i.known or not link.v5 else Reason.PACKET_ID_NOT_FOUND
            link.writer.write(codec.encode_packet_id(codec.PUBCOMP, i.packet_id, reason, link.ack_props()))
            return
        p = i.packet
        if p.packet_id is None:
            return
        kind = codec.PUBACK if p.qos == 1 else codec.PUBREC
        link.writer.write(codec.encode_packet_id(kind, p.packet_id, i.reason, link.ack_props(i.why)))
        if link.v5 and (p.qos == 1 or i.reason >= Reason.UNSPECIFIED_ERROR):
            self._unacked_in -= 1  # QoS 2: once PUBREL is answered, unless refused (MQTT-4.9.0-3)

    async def _store(self, publishes: Sequence[codec.Publish], message_ids: Sequence[str] = ()) -> None:
        link = self.link
        await storing.store(link.host, link.client_id, link.address, publishes, message_ids)


def _answerable(exc: Exception) -> bool:
    """A refusal of these publishes (answered per publish in 5.0), not a failing store (which ends it)."""
    return reason_of(exc) != Reason.UNSPECIFIED_ERROR
