"""The MQTT listener's way into the cluster (``mqtt.owners.Owners``): publishes stored at their owners, and
sessions that subscribe, receive and settle at every broker.

An MQTT publish (or will) read by any broker becomes the same ``SendMessage`` a RocketMQ producer's send would
be, handed to this broker's ``forwarding.Forwarder``: what this broker owns is stored here, the rest at its
owners (one hop, batched per owner), and the answer is per message. Only when every message is stored does
``store`` return, so the listener acknowledges (PUBACK, PUBREC) nothing that an owner did not store; an owner
that does not answer is ``errors.BrokerUnavailable`` ("nothing was stored, try again").

A session's subscriptions in a parent are a lite consumer's at the other brokers: the client ``consumer`` of
its implicit group, subscribed through the fan-out (``fanout.Fanout.sync_lite``: an exact filter is a named
lite topic, made at its owner; a wildcard filter is a pattern, made everywhere), so the access broker's
intents give an owner that restarted or did not answer its part again. A new filter first moves the group to
the end of the topics there that only it matches (the admin call ``MqttStartAtEnd``), as the session's own
broker does, so a new subscription does not replay the others' backlog. The session pulls from the others as
gathering does for a LiteSimpleConsumer (``gathering``): ReceiveMessage without waiting, auto-renewed leases,
and its acks and give-backs go to the broker that delivered (``<endpoint> <message id> <handle>``). Between
pulls it waits at each of them without leasing (``Waiting``: one ``AwaitLiteReady`` parked per other broker,
``readiness``), and pulls only from those that said they have something. Retained
messages stay with the broker that received the retained publish; a SUBSCRIBE asks every broker for its
matching ones (``MqttRetained``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, TypeVar, cast

import grpc
from google.protobuf import duration_pb2, timestamp_pb2
from google.protobuf import message as pb_message

from lmq_broker import errors, model
from lmq_broker.cluster import readiness
from lmq_broker.cluster.links import CALL_TIMEOUT_S, V2
from lmq_broker.cluster.peers import Peers
from lmq_broker.dispatch import wildcards
from lmq_broker.mqtt import durable, exactly
from lmq_broker.mqtt.owners import Pulled
from lmq_broker.protocol import context, convert, status
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as admin_pb

log = logging.getLogger(__name__)

_RECEIVE: Final = V2 + "ReceiveMessage"
_NO_WAIT: Final = duration_pb2.Duration()
_GIVE_BACK: Final = duration_pb2.Duration()
FIND: Final = "MqttFindMessage"
Resp = TypeVar("Resp", spb.AckMessageResponse, spb.ChangeInvisibleDurationResponse, spb.HeartbeatResponse)


class MqttLink:
    """``mqtt.owners.Owners`` over this broker's peers; ``peers`` answers None while the broker runs alone."""

    def __init__(self, peers: Callable[[], Peers | None]) -> None:
        self._peers = peers
        self._turns = itertools.count()
        self._background: set[asyncio.Task[None]] = set()  # give-backs of pulls cut off by a session's end

    def peers_now(self) -> Peers | None:
        return self._peers()

    @property
    def active(self) -> bool:
        return self._peers() is not None

    @property
    def members(self) -> tuple[str, ...]:
        peers = self._peers()
        return tuple(peers.membership.members) if peers is not None else ()

    async def store(self, messages: Sequence[model.NewMessage]) -> None:
        peers = self._peers()
        if peers is None:
            raise errors.BrokerUnavailable("this broker left its cluster meanwhile; nothing was stored, try again")
        if not messages:
            return
        request = spb.SendMessageRequest(messages=[message_to_pb(m) for m in messages])
        reply = await peers.forwarder.send(request, peer_copy=False)
        if reply.status.code == pb.OK and len(reply.entries) == len(messages):
            return
        failed = next((e.status for e in reply.entries if e.status.code != pb.OK), reply.status)
        raise status.error_of(failed)  # a 5.0 publisher gets its reason code, or 0x80 and a close

    async def was_stored(self, planned: exactly.Planned) -> bool | None:
        request = admin_pb.MqttFindMessageRequest(
            parent=planned.parent, lite=planned.lite, message_id=planned.message_id, from_offset=planned.end
        )
        while True:  # each call reads at most the owner's cap, then says where to go on
            reply = await self._find(planned.parent, planned.lite, request)
            if reply is None:
                return None
            if reply.found or reply.complete:
                return reply.found
            if reply.next_offset <= request.from_offset:
                raise errors.BrokerUnavailable(f"the owner of {planned.lite!r} read nothing from {request.from_offset}")
            request.from_offset = reply.next_offset

    async def ends(self, places: Sequence[tuple[str, str]]) -> list[int | None]:
        async def one(parent: str, lite: str) -> int | None:
            reply = await self._find(parent, lite, admin_pb.MqttFindMessageRequest(parent=parent, lite=lite))
            return None if reply is None else reply.end

        distinct = list(dict.fromkeys(places))  # each topic asked once, all at once
        found = dict(zip(distinct, await asyncio.gather(*(one(*place) for place in distinct)), strict=True))
        return [found[place] for place in places]

    async def _find(
        self, parent: str, lite: str, request: admin_pb.MqttFindMessageRequest
    ) -> admin_pb.MqttFindMessageResponse | None:
        """``MqttFindMessage`` at the lite topic's owner; None when that is this broker (or it runs alone)."""
        peers = self._peers()
        if peers is None:
            return None
        (slot,) = await peers.owners.owners(parent, [lite])
        if slot == peers.me:
            return None
        member = peers.membership.members[slot]
        stub, metadata = peers.admin(member, FIND)
        try:
            return await stub.MqttFindMessage(request, metadata=metadata, timeout=CALL_TIMEOUT_S, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            raise errors.BrokerUnavailable(f"{member} (the owner of {lite!r}) did not answer: {exc.details()}") from exc

    # --- subscriptions ----------------------------------------------------------------------------------------
    async def subscribe(
        self,
        consumer: str,
        group: str,
        parent: str,
        filters: Sequence[wildcards.Filter],
        older: Sequence[wildcards.Filter] | None,
    ) -> None:
        peers = self._peers()
        if peers is None or not filters:
            return
        if older is not None:
            await self._start_at_end(peers, group, parent, filters, older)
        await self._sync(peers, consumer, group, parent, pb.PARTIAL_ADD, [name_of(f) for f in filters])

    async def unsubscribe(self, consumer: str, group: str, parent: str, filters: Sequence[wildcards.Filter]) -> None:
        peers = self._peers()
        if peers is None:
            return
        action = pb.PARTIAL_REMOVE if filters else pb.COMPLETE_REMOVE
        try:
            await self._sync(peers, consumer, group, parent, action, [name_of(f) for f in filters])
        except errors.LmqError as exc:  # the others drop it when the client expires there
            log.info("mqtt %s: subscriptions in %s not ended at every broker: %s", consumer, parent, exc.message)

    async def _sync(  # noqa: PLR0917 (whose, where, what)
        self, peers: Peers, consumer: str, group: str, parent: str, action: int, names: list[str]
    ) -> None:
        request = spb.SyncLiteSubscriptionRequest(
            action=action,  # type: ignore[arg-type]
            topic=pb.Resource(name=parent),
            group=pb.Resource(name=group),
            lite_topic_set=names,
        )
        reply = await peers.fanout.sync_lite(request, names, context.Caller(client_id=consumer), _made_here)
        if reply.status.code != pb.OK:
            raise status.error_of(reply.status)

    async def _start_at_end(
        self,
        peers: Peers,
        group: str,
        parent: str,
        filters: Sequence[wildcards.Filter],
        older: Sequence[wildcards.Filter],
    ) -> None:
        request = admin_pb.MqttStartAtEndRequest(
            parent=parent, group=group, filters=[text_of(f) for f in filters], older=[text_of(f) for f in older]
        )

        async def one(member: str) -> None:
            stub, metadata = peers.admin(member, "MqttStartAtEnd")
            try:
                await stub.MqttStartAtEnd(request, metadata=metadata, timeout=CALL_TIMEOUT_S, wait_for_ready=True)
            except grpc.aio.AioRpcError as exc:  # its part of the subscription comes later, its backlog with it
                log.info("mqtt: new subscriptions of %s in %s not started at the end at %s: %s %s", group, parent,
                         member, exc.code().name, exc.details())  # fmt: skip

        await asyncio.gather(*(one(member) for member in _others(peers)))

    # --- receiving ----------------------------------------------------------------------------------------------
    async def pull(self, consumer: str, group: str, parent: str, batch: int) -> list[Pulled]:
        peers = self._peers()
        if peers is None or batch <= 0:
            return []
        others = _others(peers)
        turn = next(self._turns) % len(others) if others else 0
        return await self.pull_from(peers, [*others[turn:], *others[:turn]], consumer, group, parent, batch)

    def waiting(self, consumer: str, group: str, parent: str) -> Waiting:
        return Waiting(self, consumer, group, parent)

    async def pull_from(  # noqa: PLR0917 (where, whose, how many)
        self,
        peers: Peers,
        members: Sequence[str],
        consumer: str,
        group: str,
        parent: str,
        batch: int,
        told: readiness.Readiness | None = None,
    ) -> list[Pulled]:
        """``pull`` from ``members`` in this order, until ``batch``; ``told`` hears how each went."""
        caller = context.Caller(client_id=consumer)
        found: list[Pulled] = []
        for member in members:
            if len(found) >= batch:
                break
            call = asyncio.ensure_future(self._pull_one(peers, member, caller, group, parent, batch - len(found)))
            try:
                got = await asyncio.shield(call)
            except asyncio.CancelledError:  # the session ends: what that broker leased meanwhile goes back
                call.add_done_callback(lambda done: self._give_back_later(consumer, group, parent, done))
                self._give_back_later(consumer, group, parent, found)
                raise
            if told is not None:
                if got is None:
                    told.failed(member)
                else:
                    told.received(member, len(got))
            found += got or []
        return found

    async def _pull_one(  # noqa: PLR0917 (where, whose, how many)
        self, peers: Peers, member: str, caller: context.Caller, group: str, parent: str, batch: int
    ) -> list[Pulled] | None:
        """Without waiting there: a call cut off after that broker leased messages would hide them. None: that
        broker did not answer, or refused."""
        request = spb.ReceiveMessageRequest(
            group=pb.Resource(name=group),
            message_queue=pb.MessageQueue(topic=pb.Resource(name=parent)),
            batch_size=batch,
            auto_renew=True,
            long_polling_timeout=_NO_WAIT,
        )
        call = peers.links.channel(member).unary_stream(
            _RECEIVE,
            request_serializer=spb.ReceiveMessageRequest.SerializeToString,
            response_deserializer=spb.ReceiveMessageResponse.FromString,
        )
        out: list[Pulled] = []
        try:
            async for frame in call(
                request, metadata=peers.links.v2_headers("ReceiveMessage", caller), timeout=CALL_TIMEOUT_S
            ):
                if frame.HasField("message"):
                    m = frame.message
                    sp = m.system_properties
                    out.append(
                        Pulled(
                            lite=sp.lite_topic,
                            body=convert.body_of(m),
                            attempt=max(1, sp.delivery_attempt),
                            receipt=f"{member} {sp.message_id} {sp.receipt_handle}",
                            properties=dict(m.user_properties),
                            message_id=sp.message_id,  # a QoS 2 delivery's, kept with its released id
                        )
                    )
                elif frame.HasField("status") and frame.status.code not in (pb.OK, pb.MESSAGE_NOT_FOUND):
                    log.debug("mqtt %s: %s refused a pull: %s", caller.client_id, member, frame.status.message)
                    return None
        except grpc.aio.AioRpcError as exc:  # that broker's topics wait; the others are served meanwhile
            log.debug("mqtt %s: pulling from %s failed: %s", caller.client_id, member, exc.code().name)
            return None
        return out

    def _give_back_later(
        self, consumer: str, group: str, parent: str, pulled: asyncio.Future[list[Pulled] | None] | list[Pulled]
    ) -> None:
        if isinstance(pulled, asyncio.Future):
            if pulled.cancelled() or pulled.exception() is not None:
                return
            pulled = pulled.result() or []
        if not pulled:
            return
        receipts = [p.receipt for p in pulled]
        task = asyncio.get_running_loop().create_task(self.release(consumer, group, parent, receipts))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def settle(self, consumer: str, group: str, parent: str, receipts: Sequence[str]) -> list[str]:
        peers = self._peers()
        if peers is None or not receipts:
            return list(receipts)
        caller = context.Caller(client_id=consumer)

        async def one(member: str, entries: list[tuple[str, str]]) -> list[str]:
            request = spb.AckMessageRequest(group=pb.Resource(name=group), topic=pb.Resource(name=parent))
            for message_id, handle in entries:
                request.entries.add(message_id=message_id, receipt_handle=handle)
            reply = await self._v2(peers, member, "AckMessage", request, spb.AckMessageResponse, caller)
            if reply is None:  # not answered (down, too slow): whether it took them is unknown
                return [f"{member} {m} {h}" for m, h in entries]
            if reply.status.code == pb.OK:
                return []
            log.info("mqtt %s: acks at %s not all taken: %s", consumer, member, reply.status.message)
            taken = {(e.message_id, e.receipt_handle) for e in reply.entries if e.status.code == pb.OK}
            return [f"{member} {m} {h}" for m, h in entries if (m, h) not in taken]  # e.g. a lease that expired

        left = await asyncio.gather(*(one(member, entries) for member, entries in _by_member(receipts).items()))
        return [receipt for part in left for receipt in part]

    async def release(self, consumer: str, group: str, parent: str, receipts: Sequence[str]) -> None:
        peers = self._peers()
        if peers is None:
            return
        caller = context.Caller(client_id=consumer)
        calls: list[Awaitable[spb.ChangeInvisibleDurationResponse | None]] = []
        for member, entries in _by_member(receipts).items():
            for message_id, handle in entries:
                request = spb.ChangeInvisibleDurationRequest(
                    group=pb.Resource(name=group),
                    topic=pb.Resource(name=parent),
                    receipt_handle=handle,
                    invisible_duration=_GIVE_BACK,
                    message_id=message_id,
                )
                method = "ChangeInvisibleDuration"
                calls.append(self._v2(peers, member, method, request, spb.ChangeInvisibleDurationResponse, caller))
        await asyncio.gather(*calls)

    async def keep_alive(self, consumer: str, group: str) -> None:
        peers = self._peers()
        if peers is None:
            return
        request = spb.HeartbeatRequest(group=pb.Resource(name=group), client_type=pb.LITE_PUSH_CONSUMER)
        caller = context.Caller(client_id=consumer)
        await asyncio.gather(
            *(self._v2(peers, m, "Heartbeat", request, spb.HeartbeatResponse, caller) for m in _others(peers))
        )

    async def _v2(  # noqa: PLR0917 (where, what, for whom)
        self,
        peers: Peers,
        member: str,
        method: str,
        request: pb_message.Message,
        response: type[Resp],
        caller: context.Caller,
    ) -> Resp | None:
        """One peer call; None (logged) when that broker does not answer."""
        call = peers.links.channel(member).unary_unary(
            V2 + method,
            request_serializer=type(request).SerializeToString,
            response_deserializer=response.FromString,
        )
        try:
            reply = await call(
                request, metadata=peers.links.v2_headers(method, caller), timeout=CALL_TIMEOUT_S, wait_for_ready=True
            )
        except grpc.aio.AioRpcError as exc:
            log.info("mqtt %s: %s at %s failed: %s", caller.client_id, method, member, exc.code().name)
            return None
        return cast("Resp", reply)

    # --- retained messages --------------------------------------------------------------------------------------
    async def retained(self, parent: str, levels: wildcards.Filter) -> list[durable.Retained]:
        peers = self._peers()
        if peers is None:
            return []
        request = admin_pb.MqttRetainedRequest(parent=parent, filter=text_of(levels))

        async def one(member: str) -> list[durable.Retained]:
            stub, metadata = peers.admin(member, "MqttRetained")
            try:
                reply = await stub.MqttRetained(request, metadata=metadata, timeout=CALL_TIMEOUT_S, wait_for_ready=True)
            except grpc.aio.AioRpcError as exc:
                log.info("mqtt: retained messages of %s at %s not read: %s", parent, member, exc.code().name)
                return []
            if reply.truncated:
                log.info("mqtt: more retained messages of %s at %s than one answer holds", parent, member)
            return [
                durable.Retained(parent, r.lite, r.payload, r.qos, r.stored_ms, dict(r.properties))
                for r in reply.retained
            ]

        found = await asyncio.gather(*(one(member) for member in _others(peers)))
        return [r for part in found for r in part]


class Waiting:
    """``mqtt.owners.Remote`` of one session loop: one wait parked at each other broker (``readiness``, renewed
    every ``readiness.MAX_WAIT_S`` while the loop waits), pulls from the brokers that said ready."""

    def __init__(self, link: MqttLink, consumer: str, group: str, parent: str) -> None:
        self._link = link
        self._whose = (consumer, group, parent)
        self._ready = readiness.Readiness(link.peers_now, consumer, group, parent)
        self._members: tuple[str, ...] | None = None  # the members at the last pull; None: none yet
        self._pending: dict[str, None] = {}  # said ready (or filled a whole batch): pulled from next

    @property
    def calls(self) -> int:
        """Waits parked so far (tests and benchmarks count them)."""
        return self._ready.calls

    async def pull(self, batch: int) -> list[Pulled]:
        peers = self._link.peers_now()
        if peers is None or batch <= 0:
            return []
        others = _others(peers)
        members = tuple(peers.membership.members)
        if members != self._members:  # the first pull, or brokers joined or left: ask each
            self._members = members
            self._pending = dict.fromkeys(others)
        self._pending.update(dict.fromkeys(m for m in self._ready.take() if m in others))
        asked = [m for m in self._pending if m in others]
        consumer, group, parent = self._whose
        found = await self._link.pull_from(peers, asked, consumer, group, parent, batch, self._ready)
        self._pending = {}
        if len(found) >= batch:  # a full batch: what follows may be there already
            self._pending = dict.fromkeys(asked)
        return found

    async def wait(self, timeout_s: float) -> bool:
        peers = self._link.peers_now()
        if peers is None:
            return False
        if self._pending or self._members != tuple(peers.membership.members):
            return True
        return await self._ready.wait(_others(peers), timeout_s, park_s=readiness.MAX_WAIT_S)

    def close(self) -> None:
        self._ready.close()


async def _made_here(part: spb.SyncLiteSubscriptionRequest) -> spb.SyncLiteSubscriptionResponse:
    """This broker's part: its own dispatcher already holds the session's filters (``subscribe_filters``)."""
    return spb.SyncLiteSubscriptionResponse(status=status.ok())


def _others(peers: Peers) -> list[str]:
    return [m for slot, m in enumerate(peers.membership.members) if slot != peers.me]


def _by_member(receipts: Sequence[str]) -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    for receipt in receipts:
        member, message_id, handle = receipt.split(" ", 2)
        out.setdefault(member, []).append((message_id, handle))
    return out


def name_of(levels: wildcards.Filter) -> str:
    """A session's filter as a SyncLiteSubscription names it: an exact one is its lite topic, a wildcard one
    a pattern (``a/+/c``, ``#``: ``wildcards.parse_pattern`` reads it back as ``levels``)."""
    if any(level in (wildcards.ONE_LEVEL, wildcards.ANY_LEVELS) for level in levels):
        return text_of(levels)
    return wildcards.LEVEL_SEPARATOR.join(levels)


def text_of(levels: wildcards.Filter) -> str:
    """The filter after its parent level, as MQTT writes it (``a/+/c``)."""
    return "/".join(levels)


def message_to_pb(m: model.NewMessage) -> pb.Message:
    """The v2 message a producer would have sent for ``m`` (a LITE message of an MQTT publish)."""
    born = timestamp_pb2.Timestamp(seconds=m.born_timestamp_ms // 1000, nanos=m.born_timestamp_ms % 1000 * 1_000_000)
    return pb.Message(
        topic=pb.Resource(name=m.topic),
        body=m.body,
        user_properties=m.user_properties,
        system_properties=pb.SystemProperties(
            message_id=m.message_id,
            message_type=pb.LITE,
            lite_topic=m.lite_topic or "",
            body_encoding=pb.IDENTITY,
            born_host=m.born_host,
            born_timestamp=born,
        ),
    )
