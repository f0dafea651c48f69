"""This broker among its peers: routes that list every broker, and the one hop a send or a subscription
takes to the broker that owns its lite topic.

The official producers pick a route queue round-robin for LITE messages, so a send reaches any broker; the
owner (``cluster.membership``) stores it. Forwards to one owner are gathered per event-loop tick into one
SendMessage carrying many messages (measured ~0.57 ms of CPU per message forwarded alone, ~0.01 ms at 64 a
call), marked with ``x-lmq-forwarded`` so the receiver stores them whatever its own view of the ring: a
message never takes a second hop. The receipt (message id, offset) is the owner's. An owner that cannot be
reached answers the client INTERNAL_ERROR, which the official clients retry; nothing is stored here.

Python and Node clients send SyncLiteSubscription to the access endpoint only: it is split by owner and
each owner gets its part (a COMPLETE_ADD becomes one complete set per broker, empty for brokers that own
none of the topics). Java and Go send it to every broker themselves; those copies are applied as they are.
Receives, acks and assignments need no hop: each broker serves the topics it holds.

Which broker holds a topic created before a scale-up is asked once (``DescribeLiteTopic`` over the admin
service, signed with this broker's admin pair, which every broker of a cluster shares) and remembered. With
``--admin-port`` that call goes to the peer's host on the same admin port number as ours (every broker of a
cluster runs with the same flags; the chart's: 8082).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final

import grpc
from prometheus_client import CollectorRegistry, Counter

from lmq_broker import errors, model
from lmq_broker.cluster import membership as mb
from lmq_broker.config import BrokerConfig
from lmq_broker.protocol import auth, context, convert, status
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as admin_pb
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2_grpc as admin_grpc

log = logging.getLogger(__name__)

FORWARDED: Final = "x-lmq-forwarded"  # on calls one broker makes to another: apply here, never pass on
CALL_TIMEOUT_S: Final = 2.0  # RocketMQ's proxy gives its broker calls 2 s
MAX_BATCH: Final = 10_000  # SendMessage's per-request limit (handlers.send_message)
# Forward calls to one owner unanswered at once; more messages wait and go together when one is answered (a
# group commit: at low rates a message goes at once, under load the batches grow by themselves).
MAX_IN_FLIGHT: Final = 2
PLACEMENT_CACHE: Final = 262_144  # lite topic -> slot answers kept; cleared wholesale when full
_SEND: Final = "/apache.rocketmq.v2.MessagingService/SendMessage"
_SYNC: Final = "/apache.rocketmq.v2.MessagingService/SyncLiteSubscription"
_CHANNEL_OPTIONS: Final = (
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.enable_retries", 0),
)

# x-mq-language of the clients that send SyncLiteSubscription to every route endpoint themselves
SYNCS_EVERY_BROKER: Final = frozenset(("JAVA", "GOLANG"))

LocalHolds = Callable[[str, str], Awaitable[bool]]  # (parent, lite) -> this broker's store holds it


def forwarded(metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
    return any(key == FORWARDED for key, _ in metadata or ())


def membership_of(config: BrokerConfig) -> tuple[mb.Membership, int] | None:
    """The cluster and this broker's slot from the config; None for a broker alone (no ``peers``)."""
    if not config.peers:
        return None
    membership = mb.Membership.parse(config.peers, config.ring_history)
    if config.ordinal >= 0:
        if config.ordinal >= len(membership.members):
            raise errors.InvalidArgument(f"ordinal {config.ordinal} but only {len(membership.members)} peers")
        return membership, config.ordinal
    if not config.advertised_address:
        raise errors.InvalidArgument("with peers, set ordinal or advertised_address (this broker's place in them)")
    return membership, membership.slot_of(config.advertised_address)


def endpoints_of(member: str) -> pb.Endpoints:
    host, _, port = member.rpartition(":")
    return convert.endpoints_of(host.strip("[]"), int(port))


@dataclass
class _Batch:
    parts: list[bytes] = field(default_factory=list)  # serialized SendMessageRequests (their messages concatenate)
    counts: list[int] = field(default_factory=list)
    waiters: list[asyncio.Future[spb.SendMessageResponse]] = field(default_factory=list)
    size: int = 0


class Peers:
    def __init__(
        self,
        membership: mb.Membership,
        me: int,
        config: BrokerConfig,
        *,
        holds_locally: LocalHolds,
        admin_keys: tuple[str, str] | None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.membership = membership
        self.me = me
        self.config = config
        self._holds_locally = holds_locally
        self._admin_keys = admin_keys
        self.brokers = [
            pb.Broker(name=f"{config.broker_name.rsplit('-', 1)[0]}-{slot}", id=0, endpoints=endpoints_of(member))
            for slot, member in enumerate(membership.members)
        ]
        self._channels: dict[tuple[int, bool], grpc.aio.Channel] = {}  # (slot, admin port) -> channel
        self._placement: dict[str, int] = {}
        self._batches: dict[int, _Batch] = {}
        self._in_flight: dict[int, int] = {}  # forward calls per owner not yet answered
        self._tasks: set[asyncio.Task[None]] = set()
        registry = registry or CollectorRegistry()
        self.forwarded_messages = Counter(
            "lmq_forwarded_messages", "Messages sent on to the broker owning their lite topic", registry=registry
        )
        self.forward_calls = Counter(
            "lmq_forward_calls", "SendMessage calls carrying forwarded messages", registry=registry
        )

    @property
    def size(self) -> int:
        return len(self.membership.members)

    def permission(self, slot: int) -> int:
        return pb.READ_WRITE if self.membership.writable(slot) else pb.READ

    async def close(self) -> None:
        for task in list(self._tasks):
            await asyncio.gather(task, return_exceptions=True)
        for channel in self._channels.values():
            await channel.close(None)
        self._channels.clear()

    def _channel(self, slot: int, admin: bool = False) -> grpc.aio.Channel:
        """To a peer's client port, or (``admin``) to where it serves the admin service."""
        admin = admin and self.config.admin_port > 0
        channel = self._channels.get((slot, admin))
        if channel is None:
            target = self.membership.members[slot]
            if admin:
                target = f"{target.rsplit(':', 1)[0]}:{self.config.admin_port}"
            if self.config.tls_cert is not None:
                credentials = grpc.ssl_channel_credentials(root_certificates=self.config.tls_cert.read_bytes())
                channel = grpc.aio.secure_channel(target, credentials, options=_CHANNEL_OPTIONS)
            else:
                channel = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)
            self._channels[slot, admin] = channel
        return channel

    def _signed(self, keys: tuple[str, str] | None, *extra: tuple[str, str]) -> tuple[tuple[str, str], ...]:
        headers: tuple[tuple[str, str], ...] = ((FORWARDED, "1"), *extra)
        if keys is not None and keys[0]:
            headers += auth.sign_metadata(keys[0], keys[1], datetime.now(UTC))
        return headers

    @property
    def _client_keys(self) -> tuple[str, str] | None:
        return (self.config.access_key, self.config.secret_key) if self.config.access_key else None

    # --- where a lite topic lives ---------------------------------------------------------------------------
    async def owners(self, parent: str, lites: Sequence[str]) -> list[int]:
        """The slot each lite topic of ``parent`` is written to (``cluster.membership.resolve``)."""
        placement = self._placement
        out: list[int] = []
        unknown: list[int] = []
        for lite in lites:
            lmq = model.QueueId.lmq(parent, lite).topic
            slot = placement.get(lmq)
            if slot is None:
                found = mb.candidates(self.membership, lmq)
                if len(found) == 1:
                    slot = found[0]
                    self._remember(lmq, slot)
                else:
                    slot = -1
                    unknown.append(len(out))
            out.append(slot)
        if unknown:
            resolved = await asyncio.gather(*(self._look_up(parent, lites[i]) for i in unknown))
            for i, slot in zip(unknown, resolved, strict=True):
                out[i] = slot
        return out

    def _remember(self, lmq: str, slot: int) -> None:
        if len(self._placement) >= PLACEMENT_CACHE:
            self._placement.clear()
        self._placement[lmq] = slot

    async def _look_up(self, parent: str, lite: str) -> int:
        """A topic whose owner changed with a scale-up: does an older owner hold it? Asked once, then kept."""
        lmq = model.QueueId.lmq(parent, lite).topic
        found = mb.candidates(self.membership, lmq)
        held = {slot: await self._holds(slot, parent, lite) for slot in found[1:]}
        slot = mb.resolve(self.membership, lmq, held.__getitem__)
        self._remember(lmq, slot)
        return slot

    async def _holds(self, slot: int, parent: str, lite: str) -> bool:
        if slot == self.me:
            return await self._holds_locally(parent, lite)
        metadata = self._signed(self._admin_keys)
        stub = admin_grpc.LmqAdminStub(self._channel(slot, admin=True))
        try:
            await stub.DescribeLiteTopic(
                admin_pb.DescribeLiteTopicRequest(parent=parent, lite=lite), metadata=metadata, timeout=CALL_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise errors.BrokerUnavailable(
                f"cannot tell whether broker {self.membership.members[slot]} holds lite topic {lite!r}: "
                f"{exc.code().name} {exc.details()}"
            ) from None
        return True

    # --- sends ----------------------------------------------------------------------------------------------
    async def send(
        self,
        request: spb.SendMessageRequest,
        store_here: Callable[[spb.SendMessageRequest], Awaitable[spb.SendMessageResponse]],
    ) -> spb.SendMessageResponse:
        """Store what this broker owns, forward the rest to the owners; one answer in the request's order."""
        messages = request.messages
        owners = await self._owners_of(messages)
        if owners is None or all(slot == self.me for slot in owners):
            return await store_here(request)
        if len(set(owners)) == 1:
            return await self._forward(owners[0], request.SerializeToString(), len(messages))
        by_slot: dict[int, list[int]] = {}
        for i, slot in enumerate(owners):
            by_slot.setdefault(slot, []).append(i)
        parts: dict[int, Awaitable[spb.SendMessageResponse]] = {}
        for slot, indices in by_slot.items():
            part = spb.SendMessageRequest(messages=[messages[i] for i in indices])
            parts[slot] = (
                store_here(part) if slot == self.me else self._forward(slot, part.SerializeToString(), len(indices))
            )
        replies = dict(zip(parts, await asyncio.gather(*parts.values(), return_exceptions=True), strict=True))
        return _merge(len(messages), by_slot, replies)

    async def _owners_of(self, messages: Sequence[pb.Message]) -> list[int] | None:
        """Each message's owner slot; None when all are this broker's (no lite message, or one parent here)."""
        parent = ""
        lites: list[str] = []
        for message in messages:
            if not message.system_properties.HasField("lite_topic"):
                if lites or parent:
                    return await self._mixed_owners(messages)
                continue
            name = message.topic.name
            if parent and name != parent:
                return await self._mixed_owners(messages)
            parent = name
            lites.append(message.system_properties.lite_topic)
        if not lites:
            return None
        if len(lites) != len(messages):
            return await self._mixed_owners(messages)
        return await self.owners(parent, lites)

    async def _mixed_owners(self, messages: Sequence[pb.Message]) -> list[int]:
        out: list[int] = []
        for message in messages:
            props = message.system_properties
            if props.HasField("lite_topic"):
                out += await self.owners(message.topic.name, [props.lite_topic])
            else:
                out.append(self.me)
        return out

    def _forward(self, slot: int, serialized: bytes, count: int) -> asyncio.Future[spb.SendMessageResponse]:
        """Queue ``count`` messages (a serialized SendMessageRequest) for ``slot``: sent at the end of this tick,
        or, while ``MAX_IN_FLIGHT`` calls to that owner are unanswered, when one of them is answered."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[spb.SendMessageResponse] = loop.create_future()
        batch = self._batches.get(slot)
        if batch is None or batch.size + count > MAX_BATCH:
            if batch is not None:
                self._flush(slot)
            batch = self._batches[slot] = _Batch()
            if self._in_flight.get(slot, 0) < MAX_IN_FLIGHT:
                loop.call_soon(self._flush_if, slot, batch)
        batch.parts.append(serialized)
        batch.counts.append(count)
        batch.waiters.append(waiter)
        batch.size += count
        return waiter

    def _flush_if(self, slot: int, batch: _Batch) -> None:
        if self._batches.get(slot) is batch:
            self._flush(slot)

    def _flush(self, slot: int) -> None:
        batch = self._batches.pop(slot)
        self._in_flight[slot] = self._in_flight.get(slot, 0) + 1
        task = asyncio.get_running_loop().create_task(self._send_batch(slot, batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_batch(self, slot: int, batch: _Batch) -> None:
        try:
            await self._answer_batch(slot, batch)
        finally:
            self._in_flight[slot] -= 1
            if slot in self._batches and self._in_flight[slot] < MAX_IN_FLIGHT:
                self._flush(slot)  # what gathered meanwhile

    async def _answer_batch(self, slot: int, batch: _Batch) -> None:
        reply = await self._call_send(slot, b"".join(batch.parts), batch.size)
        if isinstance(reply, BaseException):
            for waiter in batch.waiters:
                if not waiter.done():
                    waiter.set_exception(reply)
            return
        if reply.status.code == pb.OK and len(reply.entries) == batch.size:
            start = 0
            for waiter, count in zip(batch.waiters, batch.counts, strict=True):
                if not waiter.done():
                    waiter.set_result(
                        spb.SendMessageResponse(status=reply.status, entries=reply.entries[start : start + count])
                    )
                start += count
            return
        if len(batch.waiters) == 1:  # the owner refused this request: its answer is the client's
            if not batch.waiters[0].done():
                batch.waiters[0].set_result(reply)
            return
        # One request of the batch was refused (a send is all or nothing): find which, one call per request.
        answers = await asyncio.gather(
            *(self._call_send(slot, part, count) for part, count in zip(batch.parts, batch.counts, strict=True))
        )
        for waiter, answer in zip(batch.waiters, answers, strict=True):
            if waiter.done():
                continue
            if isinstance(answer, BaseException):
                waiter.set_exception(answer)
            else:
                waiter.set_result(answer)

    async def _call_send(self, slot: int, payload: bytes, count: int) -> spb.SendMessageResponse | errors.LmqError:
        call = self._channel(slot).unary_unary(
            _SEND, request_serializer=_raw, response_deserializer=spb.SendMessageResponse.FromString
        )
        self.forward_calls.inc()
        self.forwarded_messages.inc(count)
        try:
            reply: spb.SendMessageResponse = await call(
                payload, metadata=self._signed(self._client_keys), timeout=CALL_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            return errors.BrokerUnavailable(
                f"broker {self.membership.members[slot]} owning these lite topics did not answer: "
                f"{exc.code().name}; nothing was stored, try again"
            )
        return reply

    # --- subscriptions ------------------------------------------------------------------------------------
    async def sync_lite(
        self,
        request: spb.SyncLiteSubscriptionRequest,
        names: list[str],
        caller: context.Caller,
        apply_here: Callable[[spb.SyncLiteSubscriptionRequest], Awaitable[spb.SyncLiteSubscriptionResponse]],
    ) -> spb.SyncLiteSubscriptionResponse:
        """Each owner gets its part of the subscription change (``names`` already read from the request). A
        client that sends the change to every broker itself (Java, Go) has each copy applied once: only this
        broker's part of it, here."""
        parent = convert.topic_name(request.topic)
        action = request.action
        parts: dict[int, list[str]] = {}
        if action in (pb.COMPLETE_ADD, pb.COMPLETE_REMOVE):
            parts = {slot: [] for slot in range(self.size)}
        if action != pb.COMPLETE_REMOVE and names:
            for name, slot in zip(names, await self.owners(parent, names), strict=True):
                parts.setdefault(slot, []).append(name)
        if caller.language in SYNCS_EVERY_BROKER:
            parts = (
                {self.me: parts.get(self.me, [])}
                if action in (pb.COMPLETE_ADD, pb.COMPLETE_REMOVE)
                else {slot: subset for slot, subset in parts.items() if slot == self.me}
            )
        calls: list[Awaitable[spb.SyncLiteSubscriptionResponse]] = []
        for slot, subset in sorted(parts.items()):
            part = spb.SyncLiteSubscriptionRequest()
            part.CopyFrom(request)
            del part.lite_topic_set[:]
            part.lite_topic_set.extend(subset)
            calls.append(apply_here(part) if slot == self.me else self._call_sync(slot, part, caller))
        replies = await asyncio.gather(*calls, return_exceptions=True)
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
            if reply.status.code != pb.OK:
                return reply
        return spb.SyncLiteSubscriptionResponse(status=pb.Status(code=pb.OK, message="OK"))

    async def _call_sync(
        self, slot: int, request: spb.SyncLiteSubscriptionRequest, caller: context.Caller
    ) -> spb.SyncLiteSubscriptionResponse:
        call = self._channel(slot).unary_unary(
            _SYNC,
            request_serializer=spb.SyncLiteSubscriptionRequest.SerializeToString,
            response_deserializer=spb.SyncLiteSubscriptionResponse.FromString,
        )
        headers = self._signed(
            self._client_keys, (context.CLIENT_ID, caller.client_id), (context.NAMESPACE, caller.namespace)
        )
        try:
            reply: spb.SyncLiteSubscriptionResponse = await call(request, metadata=headers, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise errors.BrokerUnavailable(
                f"broker {self.membership.members[slot]} owning some of these lite topics did not answer: "
                f"{exc.code().name}"
            ) from None
        return reply


def _raw(payload: bytes) -> bytes:
    return payload


def _merge(
    total: int, by_slot: dict[int, list[int]], replies: dict[int, spb.SendMessageResponse | BaseException]
) -> spb.SendMessageResponse:
    """One answer for a request split across owners: entries in request order, each with its part's status.
    Each owner's part is all or nothing; the request as a whole is not (MULTIPLE_RESULTS when parts differ)."""
    entries: list[spb.SendResultEntry | None] = [None] * total
    codes: set[int] = set()
    first_failure: pb.Status | None = None
    for slot, indices in by_slot.items():
        reply = replies[slot]
        if isinstance(reply, BaseException):
            reply = spb.SendMessageResponse(status=status.status_of(reply))
        codes.add(reply.status.code)
        if reply.status.code != pb.OK and first_failure is None:
            first_failure = reply.status
        for n, i in enumerate(indices):
            entries[i] = reply.entries[n] if n < len(reply.entries) else spb.SendResultEntry(status=reply.status)
    if codes == {pb.OK}:
        overall = status.ok()
    elif len(codes) == 1 and first_failure is not None:
        overall = first_failure
    else:
        overall = pb.Status(code=pb.MULTIPLE_RESULTS, message="parts of this request had different results")
    return spb.SendMessageResponse(status=overall, entries=[e for e in entries if e is not None])
