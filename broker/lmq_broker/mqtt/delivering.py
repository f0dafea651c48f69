"""The messages out: per parent topic a loop long-polls ``receive_lite`` like a push consumer (auto-renewed
leases), writes each message as a PUBLISH, and acknowledges it to the dispatcher once the client's PUBACK
arrives (QoS 1) or once written (QoS 0), which commits the group's offset. A QoS 1 message the client never
acknowledged is handed out again (its lease given back when the connection ends), with DUP set, under the
packet id it had (a persistent session records it before the PUBLISH is written, ``_promise``: MQTT-4.4.0-1,
across a kill -9 too); a retained message sent at QoS 1 or 2 is recorded whole before it is written and, not
acknowledged, sent again on resume (``releasing.Releases.resend``) as the in-flight window allows.

A shared subscription's membership (``sharing``) runs the same loop for its share's group, with the
member's own dispatcher client (``Share``), in a cluster too; its deliveries share the connection's window and
packet ids.

In a cluster the loop also pulls, without waiting, the other brokers' messages (``Owners.waiting``) within the
same in-flight window, and between two rounds waits on this broker's ready set and on theirs; what came from
another broker is settled there (``Owners.settle``, batched off the reader by ``_settle_loop``; it keeps its
place in the window until then) and given back there when the connection ends.

A message goes out at the lower of its publish QoS (``mapping.QOS``: "0", "2"; else 1) and the subscription's.
A QoS 2 delivery (``releasing``) is settled when its PUBCOMP arrives (its packet id's row forgotten only once
it is known settled: else its message, coming again, is settled unsent, ``completed``); one whose PUBREC came
(PUBREL sent) is not given back when the connection ends but settled then: the client has it, and its packet
id (persisted) is released on reconnect by a PUBREL, not a second PUBLISH.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Final, Protocol

from lmq_broker import errors
from lmq_broker.dispatch import wildcards
from lmq_broker.mqtt import codec, durable, exactly, identifiers, mapping, matching, topics
from lmq_broker.mqtt.link import Link
from lmq_broker.mqtt.owners import Owners, Pulled, Remote

log = logging.getLogger(__name__)

POLL_MS: Final = 20_000
ALONE_POLL_MS: Final = 1_000  # a broker that may join a cluster (it has ``owners``): its sessions look this often
RETRY_S: Final = 1.0  # a refused receive (store rebuilding, parent deleted) is tried again after this
MQTT_QOS_PROPERTY: Final = mapping.QOS  # user property of a QoS 0 publish: delivered at QoS 0 to every subscriber
_NO_LOCAL: Final = codec.OPTION_NO_LOCAL
_QOS: Final = {"0": 0, "2": 2}  # a message's ``mapping.QOS``; without it (QoS 1, a RocketMQ producer's): 1


@dataclass(frozen=True, slots=True)
class Out:
    """A QoS 1 or 2 delivery waiting for its PUBACK (PUBREC, PUBCOMP); ``receipt`` is empty for a retained
    message; ``remote``: it came from another broker of the cluster (settled there, ``Owners.settle``)."""

    consumer: str
    receipt: str
    parent: str = ""
    remote: bool = False
    qos: int = 1
    released: bool = False  # QoS 2: PUBREC came, PUBREL sent: its PUBCOMP settles it
    message_id: str = ""  # the message's id (QoS 2: recorded with a released packet id, also another broker's)
    group: str = ""  # a shared subscription's (``shares``); empty: the session's
    row: str = ""  # the durable row holding its packet id until acknowledged (``PUBLISHED``, ``RESEND``); "": none
    unacked: durable.Unacked | None = None  # a retained message: what a resumed session is sent again
    text: str = ""  # its ``RESEND`` row's message (``unacked`` as recorded)


@dataclass(frozen=True, slots=True)
class _Send:
    """One delivery to write as a PUBLISH (``Deliveries._plan``)."""

    delivery: Pulled
    topic: str
    qos: int
    packet_id: int | None
    retain: bool
    dup: bool
    ids: Sequence[int]
    kept: bool  # its packet id has a ``durable.PUBLISHED`` row (promised before, or now)


@dataclass(slots=True)
class _Plan:
    sends: list[_Send] = field(default_factory=list)
    settle: list[str] = field(default_factory=list)  # receipts passed over (or sent at QoS 0)
    forget: list[tuple[int, str, str]] = field(default_factory=list)  # completed restored deliveries: (packet id,
    # receipt, message id)
    cleared: list[int] = field(default_factory=list)  # packet ids of restored deliveries settled, PUBCOMP to come
    promise: list[tuple[int, str]] = field(default_factory=list)  # QoS 1/2 (packet id, message id) to record
    lasting: bool = False  # a QoS 2 one among them: recorded with an fsync (a QoS 1 one's survives a kill -9 only)
    qos1: list[int] = field(default_factory=list)  # the packet ids of ``promise`` at QoS 1
    unpromised: list[tuple[str, int, str]] = field(default_factory=list)  # recorded rows no longer owed


Whose = tuple[str, str, str]  # (consumer, group, parent): where another broker's receipts are settled or given back


@dataclass(slots=True)
class _Taking:
    """Deliveries leased for the session and not yet in ``Deliveries.out`` (``_deliver`` between its awaits):
    ``back`` still to write (given back if the connection ends first), ``settle`` passed over or written at
    QoS 0 (settled then)."""

    whose: Whose
    remote: bool
    back: list[str]
    settle: list[str] = field(default_factory=list)


class Registrar(Protocol):
    """The session's subscriptions, as a delivery loop keeps them registered (``subscribing.Subscriptions``)."""

    async def register(self, parent: str) -> None: ...

    async def follow(self, cluster: Owners, parent: str) -> None: ...


class Share(Registrar, Protocol):
    """A shared subscription's membership, as its delivery loop reads for it (``sharing.Membership``)."""

    @property
    def consumer(self) -> str: ...

    @property
    def group(self) -> str: ...

    async def filters(self, receipts: list[str]) -> dict[wildcards.Filter, int] | None:
        """The share's filter -> options now; None when the session left it since ``receipts`` were leased
        (they are given back to the share then)."""


class Deliveries:
    def __init__(self, link: Link) -> None:
        self.link = link
        self.out: dict[int, Out] = {}
        # message id -> packet id: a QoS 2 delivery restored after a restart whose PUBCOMP came before its message
        # was handed out again (its lease died with the process): that message is settled then, never sent, and
        # its packet id (still recorded in the durable store until then) is not reused meanwhile
        self.completed: dict[str, int] = {}
        self._acks: dict[Whose, list[str]] = {}  # PUBACKed, not settled there yet
        self._unsettled = 0  # receipts in _acks or being settled
        self._acks_ready = asyncio.Event()
        self._settler: asyncio.Task[None] | None = None
        self._room = asyncio.Event()
        self._room.set()
        self._ids = itertools.cycle(range(1, 65536))
        self.promised: dict[str, int] = {}  # published before, no PUBACK/PUBREC: message id -> its packet id
        # rows of deliveries acknowledged since (direction, packet id, message): forgotten with the next rows
        # recorded, or at the end (not one durable write per PUBACK)
        self.unkept: list[tuple[str, int, str]] = []
        self.unsent: list[int] = []  # retained deliveries of a resumed session in ``out``, not written yet: no room
        self._reserved: set[int] = set()  # packet ids planned, not yet in ``out``
        self._taking: dict[int, _Taking] = {}  # a ``_deliver`` under way -> what it leased and has not settled
        self._completing: dict[int, tuple[str, str]] = {}  # another broker's QoS 2 delivery completed, being settled
        # there: packet id -> (receipt, message id)
        self._takings = itertools.count()

    async def consume(self, parent: str, registrar: Registrar, share: Share | None = None) -> None:
        """Deliver the session's messages in ``parent``, or, with ``share``, that share's (``registrar`` too)."""
        link = self.link
        dispatcher = link.dispatcher
        consumer = link.consumer_id(parent) if share is None else share.consumer
        group = link.group if share is None else share.group
        await link.connected.wait()
        remote: Remote | None = None  # in a cluster: the other brokers, as this loop waits on them
        try:
            while not link.closing:
                try:  # a client slow to PUBACK: still alive for the dispatcher (its registration, its leases)
                    await asyncio.wait_for(self._room.wait(), POLL_MS / 1000)
                except TimeoutError:
                    dispatcher.client_seen(consumer)
                    cluster = link.cluster
                    if cluster is not None:  # and for the other brokers, which it is not pulling from meanwhile
                        await cluster.keep_alive(consumer, group)
                    continue
                if dispatcher.wildcard_registration(consumer) is None and (share or link.subs.get(parent)):
                    await registrar.register(parent)  # expired meanwhile (an event loop stalled past client expiry)
                room = link.max_inflight - self.busy
                if room <= 0:  # retained messages took the room (5.0: the client's receive maximum is a limit)
                    self._room.clear()
                    continue
                cluster = link.cluster
                try:
                    if cluster is None:
                        if remote is not None:  # the cluster shrank back to this broker
                            remote.close()
                            remote = None
                        poll_ms = POLL_MS if link.host.owners is None else ALONE_POLL_MS
                        found = await self._receive(parent, consumer, room, poll_ms, share)
                    else:
                        await registrar.follow(cluster, parent)  # a broker joined, or this one was alone
                        if remote is None:
                            remote = cluster.waiting(consumer, group, parent)
                        found = await self._gather(remote, parent, consumer, room, share)
                except errors.LmqError as exc:
                    log.warning("mqtt client %s: receive in %s refused (%s); retried", link.client_id, parent,
                                exc.message)  # fmt: skip
                    await asyncio.sleep(RETRY_S)
                    continue
                if not found and dispatcher.draining:
                    return
        finally:
            if remote is not None:
                remote.close()  # the waits parked at the other brokers leased nothing: nothing is lost

    async def _receive(self, parent: str, consumer: str, room: int, poll_ms: int, share: Share | None = None) -> bool:
        """This broker's messages for the session, delivered; False when none came within ``poll_ms``."""
        link = self.link
        deliveries = await link.dispatcher.receive_lite(
            consumer,
            link.group if share is None else share.group,
            parent,
            batch=max(1, min(room, link.config.receive_batch_size)),
            invisible_ms=link.config.lease_renew_slice_ms,
            poll_ms=poll_ms,
            auto_renew=True,
        )
        if not deliveries:
            return False
        pulled = [Pulled(d.message.lite_topic or "", d.message.body, d.attempt, d.receipt_handle,
                         d.message.user_properties, d.message.message_id) for d in deliveries]  # fmt: skip
        await self._deliver(parent, consumer, pulled, remote=False, share=share)
        return True

    async def _gather(self, remote: Remote, parent: str, consumer: str, room: int, share: Share | None) -> bool:
        """In a cluster: this broker's messages and, without waiting, those of the other brokers that said they
        have some (as gathering does for a LiteSimpleConsumer); while none come, wait for either, leasing
        nothing anywhere: False when the wait ended (the loop then takes what is ready) or timed out."""
        link = self.link
        found = await self._receive(parent, consumer, room, 0, share)
        room = link.max_inflight - self.busy
        if room > 0:
            pulled = await remote.pull(min(room, link.config.receive_batch_size))
            if pulled:
                await self._deliver(parent, consumer, pulled, remote=True, share=share)
                found = True
        if found or link.max_inflight - self.busy <= 0:
            return found
        group = link.group if share is None else share.group
        ready = link.dispatcher.await_ready(consumer, group, parent, POLL_MS, capped=False)
        here = asyncio.ensure_future(ready)
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

    async def _deliver(
        self, parent: str, consumer: str, deliveries: Sequence[Pulled], *, remote: bool, share: Share | None = None
    ) -> None:
        """Write ``deliveries`` as PUBLISH packets; ``remote``: they came from the other brokers (settled there);
        ``share``: from a share's group, under its filter."""
        link = self.link
        token = next(self._takings)
        whose = (consumer, link.group if share is None else share.group, parent)
        taking = self._taking[token] = _Taking(whose, remote, [d.receipt for d in deliveries])
        await link.retained_sent.wait()  # a new subscription's retained messages go first
        group, held = link.group, link.subs.get(parent, {})
        if share is not None:
            shared = await share.filters([d.receipt for d in deliveries])
            if shared is None:
                del self._taking[token]  # given back to the share
                return
            group, held = share.group, shared
        plan = self._plan(parent, deliveries, held, shared=share is not None)
        await self._promise(plan)
        now = link.dispatcher.wall_clock()
        for one in plan.sends:  # no await from the first PUBLISH built to the last written: topic aliases bind in order
            d, qos, packet_id = one.delivery, one.qos, one.packet_id
            data = self.publish_bytes(one.topic, d.body, d.properties, now, qos=qos, packet_id=packet_id,
                                      retain=one.retain, dup=one.dup, ids=one.ids)  # fmt: skip
            if data is None or qos == 0 or packet_id is None:
                plan.settle.append(d.receipt)
            else:
                self.out[packet_id] = Out(
                    consumer, d.receipt, parent, remote, qos, message_id=d.message_id,
                    group="" if share is None else group, row=durable.PUBLISHED if one.kept else "",
                )  # fmt: skip
            if data is not None:
                link.writer.write(data)
        taking.back, taking.settle = [], plan.settle  # each in ``out`` now, or to settle
        self._reserved.difference_update(one.packet_id for one in plan.sends)
        if self.busy >= link.max_inflight:
            self._room.clear()
        await link.writer.drain()
        left = await self._settle_unsent(parent, consumer, group, plan.settle, remote=remote)
        del self._taking[token]
        forget = []
        for packet_id, receipt, message_id in plan.forget:
            if receipt in left:  # not known settled: it may come again, settled then (its row kept meanwhile)
                self.completed[message_id] = packet_id
            else:
                forget.append(packet_id)
        if forget and link.persistent:  # after the acks: a crash before this only leaves a PUBREL to resend
            await link.dispatcher.run(link.host.durable.qos2_update, link.client_id, durable.OUTBOUND, [], forget)
        await self._cleared(plan.cleared)

    async def _cleared(self, packet_ids: list[int]) -> None:
        """Released deliveries whose message is settled (after the acks): their rows keep the packet id only,
        so the PUBCOMP of a later connection forgets it (with the message id it would wait for the message to
        come again, which it never does: a PUBREL on every reconnect, the id never free)."""
        link = self.link
        if not packet_ids or not link.persistent:
            return
        try:
            await link.dispatcher.run(link.host.durable.qos2_stored, link.client_id, packet_ids, durable.OUTBOUND)
        except Exception as exc:  # the rows stay as they were: their ids stay taken
            log.warning("mqtt client %s: settled QoS 2 deliveries not recorded: %s", link.client_id, exc)

    def _plan(
        self, parent: str, deliveries: Sequence[Pulled], held: dict[wildcards.Filter, int], *, shared: bool
    ) -> _Plan:
        """What each delivery becomes: passed over (settled), or a PUBLISH at a QoS under a packet id (a QoS 2
        one handed out again under the id it was published with before, ``promised``; not a share's, which
        goes to another member when this one leaves)."""
        link = self.link
        plan = _Plan()
        now = link.dispatcher.wall_clock()
        default = link.config.mqtt_default_parent
        held_by_id = {o.message_id: i for i, o in self.out.items() if o.released and o.message_id}
        for d in deliveries:
            taken = held_by_id.get(d.message_id) if d.message_id else None
            if taken is not None:  # the client has it (PUBREC before a restart): settled, not sent again
                plan.settle.append(d.receipt)
                self.out[taken] = replace(self.out[taken], message_id="")  # its PUBCOMP only forgets the id
                plan.cleared.append(taken)
                continue
            if d.message_id and d.message_id in self.completed:  # ... and completed it since: the same
                plan.settle.append(d.receipt)
                plan.forget.append((self.completed.pop(d.message_id), d.receipt, d.message_id))
                continue
            props = d.properties
            mine = props.get(mapping.CLIENT) == link.client_id
            matched = [o for f, o in held.items() if topics.takes(default, parent, f, d.lite, props)
                       and not (mine and o & _NO_LOCAL)]  # fmt: skip
            promised = self.promised.pop(d.message_id, None) if d.message_id else None
            if not matched or mapping.expired(props, now):  # unsubscribed since it was leased, no-local, expired
                plan.settle.append(d.receipt)
                if promised is not None:
                    plan.unpromised.append((durable.PUBLISHED, promised, d.message_id))
                continue
            qos = min(_QOS.get(props.get(MQTT_QOS_PROPERTY, ""), 1), max(o & codec.OPTION_QOS for o in matched))
            if promised is not None and qos == 0:  # downgraded since, sent without a packet id: it is no longer owed
                plan.unpromised.append((durable.PUBLISHED, promised, d.message_id))
                promised = None
            packet_id = promised or (self._packet_id() if qos else None)
            if packet_id is not None:
                self._reserved.add(packet_id)
            promise = qos > 0 and promised is None and bool(d.message_id) and not shared
            if promise:
                plan.promise.append((packet_id or 0, d.message_id))
                plan.lasting = plan.lasting or qos == 2
                if qos == 1:
                    plan.qos1.append(packet_id or 0)
            kept = promised is not None or (promise and link.persistent)
            retain = props.get(mapping.RETAIN) == "1" and any(o & codec.OPTION_RETAIN_AS_PUBLISHED for o in matched)
            topic = topics.topic_in(default, parent, d.lite, props)
            dup = d.attempt > 1 or promised is not None
            plan.sends.append(_Send(d, topic, qos, packet_id, retain, dup, identifiers.ids_of(matched), kept))
        return plan

    async def _promise(self, plan: _Plan) -> None:
        """A persistent session's QoS 1 and 2 PUBLISHes: their packet ids recorded before they are written, so
        the message handed out again after a reconnect or a restart (a kill -9 too) goes under the same id
        (MQTT-4.4.0-1); with them the rows of deliveries acknowledged since are forgotten. One write per
        delivery batch, fsynced only when it holds a QoS 2 one (a QoS 1 one lost to a power cut comes again
        under a new id, DUP set, which QoS 1 allows; a QoS 2 one would be taken as a new message)."""
        link = self.link
        if link.persistent and (plan.promise or plan.unpromised):
            await self.record(durable.PUBLISHED, plan.promise, plan.unpromised, lasting=plan.lasting, qos1=plan.qos1)

    async def record(
        self,
        direction: str,
        add: list[tuple[int, str]],
        remove: Sequence[tuple[str, int, str]] = (),
        *,
        lasting: bool = False,
        qos1: Sequence[int] = (),
    ) -> None:
        """``add`` recorded (``durable.Durable.qos2_promise``; those of ``qos1`` as QoS 1's), with ``remove`` and
        the rows of deliveries acknowledged since (``unkept``) forgotten; those go back to ``unkept`` if the write
        fails."""
        link = self.link
        unkept, self.unkept = self.unkept, []
        try:
            await link.dispatcher.run(link.host.durable.qos2_promise, link.client_id, direction, add,
                                      [*remove, *unkept], lasting=lasting, qos1=frozenset(qos1))  # fmt: skip
        except BaseException:
            self.unkept[:0] = unkept
            raise

    async def _settle_unsent(
        self, parent: str, consumer: str, group: str, receipts: list[str], *, remote: bool
    ) -> set[str]:
        """Deliveries passed over (or sent at QoS 0) settled: at the broker that handed them out; returned, the
        receipts not known settled (they may come again)."""
        link = self.link
        if remote:
            cluster = link.cluster
            if not receipts:
                return set()
            if cluster is None:  # alone again: their leases there expire, they come again
                return set(receipts)
            return set(await cluster.settle(consumer, group, parent, receipts))
        left = set()
        for receipt in receipts:
            try:
                await link.dispatcher.ack(group, receipt, client_id=consumer)
            except errors.LmqError as exc:
                log.info("mqtt client %s: delivery not settled: %s", link.client_id, exc.message)
                left.add(receipt)
        return left

    def publish_bytes(  # noqa: PLR0913 (a PUBLISH's fields, each a keyword)
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
        ids: Sequence[int] = (),
    ) -> bytes | None:
        """The PUBLISH for a subscriber, written at once by the caller (a topic alias it carries binds from
        here on); None when it is over the client's maximum packet size (5.0: dropped, as if sent,
        MQTT-3.1.2-25)."""
        if not self.link.v5:
            return codec.encode_publish(topic, body, qos, packet_id, retain=retain, dup=dup)
        alias, bound = self.link.aliases.choose(topic)
        props = mapping.outgoing(stored, now_ms, ids, alias)  # with the identifiers of the subscriptions matched
        data = codec.encode_publish(topic if bound else "", body, qos, packet_id, retain=retain, dup=dup, props=props)
        if len(data) > self.link.max_packet_out:
            log.info("mqtt client %s: a message to %s over its maximum packet size is dropped", self.link.client_id,
                     topic)  # fmt: skip
            return None
        self.link.aliases.sent(topic, alias, bound)  # the caller writes it now: the client reads them in this order
        return data

    async def retained_elsewhere(
        self, wanted: list[tuple[str, wildcards.Filter, int]]
    ) -> list[list[durable.Retained] | None]:
        """Per subscription, the retained messages the other brokers of a cluster hold (asked all at once);
        None each while this broker is alone."""
        cluster = self.link.cluster
        if cluster is None:
            return [None for _ in wanted]
        return list(await asyncio.gather(*(cluster.retained(parent, levels) for parent, levels, _ in wanted)))

    async def send_retained(
        self,
        parent: str,
        levels: wildcards.Filter,
        granted: int,
        elsewhere: list[durable.Retained] | None,
        as_of: int | None = None,
    ) -> None:
        """The retained messages ``levels`` matches: this broker's and ``elsewhere`` (the other brokers'), per
        topic the newest. Streamed under the same bounds as live deliveries: a QoS 1 one waits for room in the
        in-flight window, and each is written once the socket took the one before (``drain``), so a client
        that does not read holds one of them here, not all (``matching.stream_retained``). ``as_of``: the
        SUBACK's time; a message retained after it was delivered to the subscription live, not sent again
        (alone: in a cluster other brokers' clocks may differ, and a duplicate at QoS 1 beats a loss)."""
        link = self.link
        now = link.dispatcher.wall_clock()
        default = link.config.mqtt_default_parent
        found = matching.stream_retained(link.dispatcher.run, link.host.durable, parent, levels, now, elsewhere,
                                         default=default)  # fmt: skip
        async for r in found:
            if as_of is not None and elsewhere is None and r.stored_ms > as_of:  # one clock: this broker's
                continue
            qos = min(r.qos, granted)
            while qos and self.busy >= link.max_inflight:
                self._room.clear()
                await self._room.wait()
            packet_id = self._packet_id() if qos else None
            topic = topics.topic_in(default, parent, r.lite, r.properties)
            ids = identifiers.ids_of([link.subs.get(parent, {}).get(levels, 0)])
            if packet_id is not None:  # kept until acknowledged: a resumed session gets it again
                unacked = durable.Unacked(topic, r.payload, qos, r.properties, tuple(ids))
                persistent = link.persistent
                out = self.out[packet_id] = Out("", "", qos=qos, row=durable.RESEND if persistent else "",
                                                unacked=unacked, text=unacked.text() if persistent else "")  # fmt: skip
                if persistent:  # recorded before it is written: a kill -9 forgets nothing the client may have
                    await self.record(durable.RESEND, [(packet_id, out.text)])
            data = self.publish_bytes(topic, r.payload, r.properties, now, qos=qos, packet_id=packet_id, retain=True,
                                      ids=ids)  # fmt: skip
            if data is None:
                if packet_id is not None and self.out.pop(packet_id, None) is not None and out.row:
                    self.unkept.append((out.row, packet_id, out.text))
                continue
            link.writer.write(data)
            await link.writer.drain()

    def _packet_id(self) -> int:
        for packet_id in self._ids:
            if packet_id in self.out or packet_id in self._reserved or packet_id in self._completing:
                continue
            if self.completed and packet_id in self.completed.values():
                continue
            if not self.promised or packet_id not in self.promised.values():
                return packet_id
        raise AssertionError("unreachable: packet ids cycle forever")

    async def acknowledged(self, packet_id: int) -> None:
        """PUBACK: a QoS 1 delivery settled."""
        out = self.out.get(packet_id)
        if out is None or out.qos != 1:
            return  # not ours (or acknowledged twice, or a QoS 2 one's): nothing to settle
        del self.out[packet_id]
        await self.settle(packet_id, out)
        if out.row and self.link.persistent:  # forgotten with the next rows written (or at the end)
            self.unkept.append((out.row, packet_id, out.text if out.unacked else out.message_id))

    async def unkeep(self, direction: str, packet_ids: list[int]) -> None:
        """Rows of acknowledged deliveries (``Out.row``) forgotten; one left behind (a failed write) only holds its
        packet id until its message comes again or the session ends."""
        link = self.link
        if not link.persistent:  # else the rows go with the session
            return
        try:
            await link.dispatcher.run(link.host.durable.qos2_update, link.client_id, direction, [], packet_ids)
        except Exception as exc:
            log.warning("mqtt client %s: acknowledged deliveries not recorded: %s", link.client_id, exc)

    async def settle(self, packet_id: int, out: Out) -> bool:
        """``out``, no longer in ``self.out``, acknowledged where it came from; its room in the window freed.
        False when it is known not settled (its lease was given back meanwhile: its message comes again). Another
        broker's is settled by the settler, off the reader (a QoS 2 one's row forgotten then, ``_completed_there``)."""
        link = self.link
        if out.remote:  # it holds its room until then
            self._acks.setdefault((out.consumer, out.group or link.group, out.parent), []).append(out.receipt)
            if out.qos == 2 and out.released:  # its packet id stays taken until then
                self._completing[packet_id] = (out.receipt, out.message_id)
            self._unsettled += 1
            await self.send_unsent()
            if self._settler is None:
                self._settler = asyncio.get_running_loop().create_task(self._settle_loop())
            self._acks_ready.set()
            return True
        await self.send_unsent()
        if self.busy < link.max_inflight:
            self._room.set()
        if out.receipt:
            try:
                await link.dispatcher.ack(out.group or link.group, out.receipt, client_id=out.consumer)
            except errors.LmqError as exc:  # e.g. the lease was given back meanwhile: it comes again
                log.info("mqtt client %s: PUBACK %d not settled: %s", link.client_id, packet_id, exc.message)
                return False
        return True

    async def send_unsent(self) -> None:
        """A resumed session's retained deliveries (``releasing.Releases.resend``) written, under their packet ids
        with DUP, while the in-flight window has room for them (each written one holds its room until
        acknowledged); one now over a 5.0 client's maximum packet size is dropped, as if sent."""
        link = self.link
        dropped = []
        while self.unsent and self.busy - len(self.unsent) < link.max_inflight:
            packet_id = self.unsent.pop(0)
            out = self.out.get(packet_id)
            if out is None or (sent := out.unacked) is None:
                continue
            now = link.dispatcher.wall_clock()
            data = self.publish_bytes(sent.topic, sent.payload, sent.properties, now, qos=sent.qos,
                                      packet_id=packet_id, retain=True, dup=True, ids=sent.ids)  # fmt: skip
            if data is None:
                del self.out[packet_id]
                dropped.append(packet_id)
            else:
                link.writer.write(data)
        if dropped:
            await self.unkeep(durable.RESEND, dropped)

    @property
    def busy(self) -> int:
        """Deliveries taking room in the in-flight window: awaiting their PUBACK, or their settling elsewhere."""
        return len(self.out) + self._unsettled

    async def _settle_loop(self) -> None:
        """The other brokers' messages the client acknowledged, settled there: all that came meanwhile at once."""
        while True:
            await self._acks_ready.wait()
            self._acks_ready.clear()
            await self._settle_acks()
            if self.link.closing:  # the reader has stopped: nothing more comes
                return

    async def _settle_acks(self) -> None:
        link = self.link
        while self._acks:
            acks, self._acks = self._acks, {}
            cluster = link.cluster
            batch = {receipt for receipts in acks.values() for receipt in receipts}
            left = batch  # not known settled
            try:
                if cluster is not None:  # else alone again: their leases there expire, they come again
                    settling = (cluster.settle(c, g, p, receipts) for (c, g, p), receipts in acks.items())
                    left = {receipt for part in await asyncio.gather(*settling) for receipt in part}
            finally:
                self._unsettled -= sum(map(len, acks.values()))
                if self.busy < link.max_inflight:
                    self._room.set()
                await self._completed_there(batch, left)

    async def _completed_there(self, batch: set[str], left: set[str]) -> None:
        """Other brokers' QoS 2 deliveries whose PUBCOMP came, settling there over (``batch``): a settled one's row
        forgotten (after: a crash before this only leaves a PUBREL to resend); one not known settled (``left``:
        its broker down, or too slow) keeps its row, so a reconnect releases it again, and waits for its message
        to come again (its lease there runs out), settled then without being sent (``completed``)."""
        forget = []
        for packet_id, (receipt, message_id) in list(self._completing.items()):
            if receipt not in batch:
                continue
            del self._completing[packet_id]
            if receipt in left and message_id:
                self.completed[message_id] = packet_id
            else:
                forget.append(packet_id)
        if forget:
            exactly.crash_point(exactly.COMPLETED)
            await self.unkeep(durable.OUTBOUND, forget)

    async def settle_acknowledged(self) -> None:
        """At the end: what the client acknowledged, settled where it came from; then the settler ends."""
        if self._settler is not None:
            self._acks_ready.set()
            await self.link.ended(self._settler, "settling acknowledged deliveries")

    async def give_back(self) -> dict[Whose, list[str]]:
        """At the end: what was handed out and not acknowledged goes back to the group at once; returned, per
        (consumer, group, parent), the receipts of the other brokers' (given back there by the caller). A QoS 2
        delivery whose PUBREC came is settled instead: the client has it (its packet id is released on
        reconnect by a PUBREL)."""
        link = self.link
        remote: dict[Whose, list[str]] = {}
        settled: dict[Whose, list[str]] = {}  # released, from the other brokers: settled there
        cleared: list[int] = []  # released, settled here: their rows cleared
        settled_ids: dict[str, int] = {}  # receipt -> packet id
        await self._keep_unacked()
        for packet_id, out in self.out.items():
            if out.remote:
                whose = (out.consumer, out.group or link.group, out.parent)
                (settled if out.released else remote).setdefault(whose, []).append(out.receipt)
                if out.released:
                    settled_ids[out.receipt] = packet_id
            elif out.receipt:
                with contextlib.suppress(errors.LmqError):
                    if out.released:
                        await link.dispatcher.ack(out.group or link.group, out.receipt, client_id=out.consumer)
                        cleared.append(packet_id)
                    else:
                        await link.dispatcher.change_invisible(out.group or link.group, out.receipt, 0)
        for taking in self._taking.values():  # leased by a delivery loop stopped before it wrote or settled them
            consumer, group, _ = taking.whose
            if taking.remote:
                for receipts, into in ((taking.back, remote), (taking.settle, settled)):
                    if receipts:
                        into.setdefault(taking.whose, []).extend(receipts)
                continue
            for receipt in taking.back:
                with contextlib.suppress(errors.LmqError):
                    await link.dispatcher.change_invisible(group, receipt, 0)
            for receipt in taking.settle:
                with contextlib.suppress(errors.LmqError):
                    await link.dispatcher.ack(group, receipt, client_id=consumer)
        self._taking.clear()
        self.out.clear()
        cluster = link.cluster
        if cluster is not None and settled:
            calls = (cluster.settle(c, g, p, receipts) for (c, g, p), receipts in settled.items())
            results = await asyncio.gather(*calls, return_exceptions=True)
            for receipts, result in zip(settled.values(), results, strict=True):
                if not isinstance(result, BaseException):  # the rows of those not known settled stay as they are
                    cleared += [settled_ids[r] for r in receipts if r in settled_ids and r not in result]
        await self._cleared(cleared)
        return remote

    async def _keep_unacked(self) -> None:
        """At the end of a persistent session's connection: the rows of deliveries acknowledged since the last
        write forgotten (``unkept``). Each QoS 1 and 2 delivery not acknowledged has its row already (written before
        it was, ``_promise``, ``send_retained``: MQTT-4.4.0-1 across a kill -9 too); not a share's, which may go
        to another member."""
        link = self.link
        if not link.persistent or not self.unkept:
            return
        try:
            await self.record(durable.PUBLISHED, [])
        except Exception as exc:  # they only hold their packet ids until their messages come again or the end
            log.warning("mqtt client %s: acknowledged deliveries not recorded: %s", link.client_id, exc)
