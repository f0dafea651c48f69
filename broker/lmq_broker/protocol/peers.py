"""This broker among its peers: routes that list every broker, and the one hop a send or a subscription
takes to the broker that owns its lite topic.

The official producers pick a route queue round-robin for LITE messages, so a send reaches any broker; the
owner (``cluster.membership``) stores it. Forwards to one owner are gathered per event-loop tick into one
SendMessage carrying many messages (measured ~0.57 ms of CPU per message forwarded alone, ~0.01 ms at 64 a
call), marked with ``x-lmq-forwarded`` so the receiver stores them whatever its own view of the ring: a
message never takes a second hop. The receipt (message id, offset) is the owner's. An owner that cannot be
reached answers the client INTERNAL_ERROR, which the official clients retry; nothing is stored here.

Python, Java and Node clients send SyncLiteSubscription to the access endpoint only: it is split by owner
and each owner gets its part (a COMPLETE_ADD becomes one complete set per broker, empty for brokers that own
none of the topics). A pattern (``session-*``) can match topics of every broker, so it is part of each
broker's set. Go sends it to every broker itself; each copy is applied where it lands, for that broker's part.
Receives, acks and assignments need no hop: each broker serves the topics it holds.

Which broker holds a topic created before a scale-up is asked once (``DescribeLiteTopic`` over the admin
service, signed with this broker's admin pair, which every broker of a cluster shares) and remembered. With
``--admin-port`` that call goes to the peer's host on the same admin port number as ours (every broker of a
cluster runs with the same flags; the chart's: 8082).

Routes come in two sets: the internal one names every slot by its member endpoint, the external one (for the
``--external-port`` listener, clients outside the cluster) by its external address (``cluster.external``).
Calls between brokers always use the member endpoints. With TLS they trust ``--tls-ca`` (the CA that signed the
brokers' certificates; without it the certificate itself, which must then be self-signed) and check the name
``--tls-server-name`` when given (every broker of a release serves one certificate naming that name).

The membership can change while the broker runs (``apply``, from the admin service): routes, assignments and
what is remembered about where topics live change in one step of the event loop. A leaving broker (scale-down)
also routes the sends other brokers forward to it: the topics it holds stay here until drained
(``protocol.draining``), any other goes on to its owner, a second hop that exists only while brokers leave.
A broker that is no member at all (removed, still running) forwards everything.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final

import grpc
from prometheus_client import CollectorRegistry, Counter

from lmq_broker import errors, model
from lmq_broker.cluster import external as ext
from lmq_broker.cluster import membership as mb
from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch import wildcards
from lmq_broker.protocol import auth, context, convert, draining, status
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

# x-mq-language of the clients that send SyncLiteSubscription to every route endpoint themselves. Go (v5.1.4)
# does; Java 5.2.0 sends it to its configured endpoint only (``LitePushConsumerImpl.syncLiteSubscription`` ->
# ``getEndpoints()``), like Python and Node, so its calls are split here. A client wrongly counted as calling
# one endpoint only costs repeated, idempotent parts; one wrongly counted here would miss other brokers' topics.
SYNCS_EVERY_BROKER: Final = frozenset(("GOLANG",))

# The answer to one forwarded request: the owner's reply to the batch it went in and the range of entries that
# are this request's (the whole reply when it went alone, or was refused).
_Part = tuple[spb.SendMessageResponse, int, int]
StoreHere = Callable[[Sequence[pb.Message]], Awaitable[spb.SendMessageResponse]]  # this broker's handler
LocalHolds = Callable[[str, str], Awaitable[bool]]  # (parent, lite) -> this broker's store holds it
Subscribers = Callable[[str, str], list[tuple[str, str]]]  # (parent, lite) -> (client id, group) subscribed here
Subscription = tuple[str, str, str, list[str], list[str]]  # client id, group, parent, lite topics, patterns


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


def external_of(config: BrokerConfig) -> ext.ExternalAddresses | None:
    """The external addresses of the config's slots; None without an external listener. InvalidArgument when
    the listener is on but some member of ``--peers`` has no address (neither listed nor by template)."""
    if config.external_port < 0:
        return None
    addresses = ext.ExternalAddresses.parse(
        config.external_addresses, config.external_address_template, config.pod_processes
    )
    found = membership_of(config)
    if found is not None:
        addresses.of_slots(len(found[0].members))
    return addresses


def endpoints_of(member: str) -> pb.Endpoints:
    host, _, port = member.rpartition(":")
    return convert.endpoints_of(host.strip("[]"), int(port))


@dataclass
class _Batch:
    parts: list[bytes] = field(default_factory=list)  # serialized SendMessageRequests (their messages concatenate)
    counts: list[int] = field(default_factory=list)
    waiters: list[asyncio.Future[_Part]] = field(default_factory=list)
    size: int = 0


class Peers:
    def __init__(
        self,
        membership: mb.Membership,
        me: int,
        config: BrokerConfig,
        *,
        holds_locally: LocalHolds,
        drained_locally: draining.Drained,
        subscribers: Subscribers,
        admin_keys: tuple[str, str] | None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self._holds_locally = holds_locally
        self._admin_keys = admin_keys
        self._subscribers = subscribers
        self.handoff = draining.Handoff(drained_locally, self._move_subscriptions)
        self._channels: dict[str, grpc.aio.Channel] = {}  # by endpoint: slots keep theirs across a change
        self._placement: dict[str, dict[str, int]] = {}  # parent -> lite topic -> slot
        self._placed = 0  # entries of _placement
        self._batches: dict[str, _Batch] = {}
        self._in_flight: dict[str, int] = {}  # forward calls per owner endpoint not yet answered
        self._tasks: set[asyncio.Task[None]] = set()
        self.membership = membership
        self.me = me
        self.brokers: list[pb.Broker] = []
        self.external_brokers: list[pb.Broker] = []  # the same brokers by their external addresses
        self._external = external_of(config)
        self.apply(membership, me)
        registry = registry or CollectorRegistry()
        self.forwarded_messages = Counter(
            "lmq_forwarded_messages", "Messages sent on to the broker owning their lite topic", registry=registry
        )
        self.forward_calls = Counter(
            "lmq_forward_calls", "SendMessage calls carrying forwarded messages", registry=registry
        )

    def apply(self, membership: mb.Membership, me: int) -> None:
        """A new membership, in one step: routes, assignments and remembered placements follow it at once.
        ``me`` is -1 when this broker is no member (removed, still running: it only forwards)."""
        name = self.config.broker_name.rsplit("-", 1)[0]
        self.membership = membership
        self.me = me
        self.brokers = [
            pb.Broker(name=f"{name}-{slot}", id=0, endpoints=endpoints_of(member))
            for slot, member in enumerate(membership.members)
        ]
        self.external_brokers = [
            pb.Broker(name=broker.name, id=0, endpoints=endpoints_of(self._external_address(slot)))
            for slot, broker in enumerate(self.brokers)
        ]
        self._placement = {}
        self._placed = 0
        gone = [endpoint for endpoint in self._channels if endpoint not in membership.members]
        for endpoint in gone:
            channel = self._channels.pop(endpoint)
            self._spawn(channel.close(CALL_TIMEOUT_S))  # calls still running on it get their answers

    def _external_address(self, slot: int) -> str:
        """Slot ``slot``'s external address; its member endpoint (and a warning) when it has none, which
        ``SetCluster`` refuses beforehand (``check_external``): a client outside then cannot reach that broker."""
        if self._external is None:
            return self.membership.members[slot]
        try:
            return self._external.of(slot)
        except errors.InvalidArgument as exc:
            log.warning("%s: external clients get its internal address %s", exc.message, self.membership.members[slot])
            return self.membership.members[slot]

    def routed(self, external: bool) -> list[pb.Broker]:
        """The brokers as routes name them for a client on the external listener or on the internal one."""
        return self.external_brokers if external and self._external is not None else self.brokers

    @property
    def routes_forwarded(self) -> bool:
        """Forwarded sends are routed here, not just stored: this broker is leaving, or no member."""
        return self.me < 0 or self.membership.leaving(self.me)

    @property
    def size(self) -> int:
        return len(self.membership.members)

    def permission(self, slot: int) -> int:
        return pb.READ_WRITE if self.membership.writable(slot) else pb.READ

    def _spawn(self, work: Awaitable[None]) -> None:
        async def run() -> None:
            await work

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            await asyncio.gather(task, return_exceptions=True)
        for channel in self._channels.values():
            await channel.close(None)
        self._channels.clear()

    def _channel(self, target: str) -> grpc.aio.Channel:
        channel = self._channels.get(target)
        if channel is None:
            config = self.config
            if config.tls_cert is not None:
                trusted = (config.tls_ca or config.tls_cert).read_bytes()  # read per channel: a renewed CA counts
                options: tuple[tuple[str, int | str], ...] = _CHANNEL_OPTIONS
                if config.tls_server_name:
                    options += (("grpc.ssl_target_name_override", config.tls_server_name),)
                credentials = grpc.ssl_channel_credentials(root_certificates=trusted)
                channel = grpc.aio.secure_channel(target, credentials, options=options)
            else:
                channel = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)
            self._channels[target] = channel
        return channel

    def channel(self, target: str) -> grpc.aio.Channel:
        return self._channel(target)

    def headers_of(self, caller: context.Caller) -> tuple[tuple[str, str], ...]:
        """Headers of a v2 call made for ``caller`` (its client id and namespace), marked and signed."""
        return self._signed(
            self._client_keys, (context.CLIENT_ID, caller.client_id), (context.NAMESPACE, caller.namespace)
        )

    def _signed(self, keys: tuple[str, str] | None, *extra: tuple[str, str]) -> tuple[tuple[str, str], ...]:
        headers: tuple[tuple[str, str], ...] = ((FORWARDED, "1"), *extra)
        if keys is not None and keys[0]:
            headers += auth.sign_metadata(keys[0], keys[1], datetime.now(UTC))
        return headers

    @property
    def _client_keys(self) -> tuple[str, str] | None:
        return (self.config.access_key, self.config.secret_key) if self.config.access_key else None

    def admin(self, endpoint: str) -> tuple[admin_grpc.LmqAdminAsyncStub, tuple[tuple[str, str], ...]]:
        """A stub of another broker's admin service and the headers to sign a call with (this broker's admin
        pair, which every broker of a cluster shares). With ``--admin-port`` the admin service is on the peer's
        host at that port (every broker of a cluster runs with the same flags)."""
        target = mb.admin_endpoint(endpoint, self.config.admin_port)
        return admin_grpc.LmqAdminStub(self._channel(target)), self._signed(self._admin_keys)

    # --- where a lite topic lives ---------------------------------------------------------------------------
    async def owners(self, parent: str, lites: Sequence[str]) -> list[int]:
        """The slot each lite topic of ``parent`` is written to (``cluster.membership.resolve``)."""
        known = (self._placement.get(parent) or {}).get  # ``_remember`` makes a parent's dict
        out = [known(lite, -1) for lite in lites]  # per message of a batched send: the common case first
        if -1 not in out:
            return out
        unknown: list[int] = []
        for i in [i for i, slot in enumerate(out) if slot == -1]:
            lite = lites[i]
            out[i] = self._placement.get(parent, {}).get(lite, -1)  # missing several times in one request
            if out[i] == -1:
                found = mb.candidates(self.membership, model.QueueId.lmq(parent, lite).topic)
                if len(found) == 1:
                    out[i] = found[0]
                    self._remember(parent, lite, found[0])
                else:
                    unknown.append(i)
        if unknown:
            resolved = await asyncio.gather(*(self._look_up(parent, lites[i]) for i in unknown))
            for i, slot in zip(unknown, resolved, strict=True):
                out[i] = slot
        return out

    def _remember(self, parent: str, lite: str, slot: int) -> None:
        if self._placed >= PLACEMENT_CACHE:
            self._placement.clear()
            self._placed = 0
        placed = self._placement.get(parent)
        if placed is None:
            placed = self._placement[parent] = {}
        if lite not in placed:
            self._placed += 1
        placed[lite] = slot

    async def _look_up(self, parent: str, lite: str) -> int:
        """A topic whose owner changed with a scale-up or down: does an older owner hold it? (And, when that
        one is leaving, has it handed the topic to today's owner yet?) Asked once, then kept."""
        lmq = model.QueueId.lmq(parent, lite).topic
        found = mb.candidates(self.membership, lmq)
        asked = list(found[1:])
        if any(self.membership.leaving(slot) for slot in asked):
            asked.append(found[0])
        answers = await asyncio.gather(*(self._holds(slot, parent, lite) for slot in asked))
        held = dict(zip(asked, answers, strict=True))
        slot = mb.resolve(self.membership, lmq, held.__getitem__)
        self._remember(parent, lite, slot)
        return slot

    async def _holds(self, slot: int, parent: str, lite: str) -> bool:
        if slot == self.me:
            return await self._holds_locally(parent, lite)
        member = self.membership.members[slot]
        stub, metadata = self.admin(member)
        try:
            await stub.DescribeLiteTopic(
                admin_pb.DescribeLiteTopicRequest(parent=parent, lite=lite), metadata=metadata, timeout=CALL_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise errors.BrokerUnavailable(
                f"cannot tell whether broker {member} holds lite topic {lite!r}: {exc.code().name} {exc.details()}"
            ) from None
        return True

    # --- sends ----------------------------------------------------------------------------------------------
    async def send(
        self,
        request: spb.SendMessageRequest,
        store_here: StoreHere,
    ) -> spb.SendMessageResponse:
        """Store what this broker owns, forward the rest to the owners; one answer in the request's order."""
        messages = request.messages
        owners = await self._owners_of(messages)
        kept: list[tuple[str, str]] = []
        if owners is not None and self.me in owners and self.membership.leaving(self.me):
            kept = await self._hand_over(messages, owners)
        try:
            return await self._send_to(request, owners, store_here)
        finally:
            for parent, lite in kept:
                self.handoff.release(parent, lite)

    async def _hand_over(self, messages: Sequence[pb.Message], owners: list[int]) -> list[tuple[str, str]]:
        """At a leaving broker: the topics it holds that are drained go to today's owner (``owners`` is changed
        in place); returns the topics kept here, to be released once stored."""
        topics: dict[tuple[str, str], list[int]] = {}
        for i, (message, slot) in enumerate(zip(messages, owners, strict=True)):
            if slot == self.me and message.system_properties.HasField("lite_topic"):
                topics.setdefault((message.topic.name, message.system_properties.lite_topic), []).append(i)
        decisions = await asyncio.gather(*(self.handoff.keep(parent, lite) for parent, lite in topics))
        kept = []
        for (parent, lite), keep in zip(topics, decisions, strict=True):
            if keep:
                kept.append((parent, lite))
                continue
            today = mb.owner(self.membership, model.QueueId.lmq(parent, lite).topic)
            for i in topics[parent, lite]:
                owners[i] = today
        return kept

    async def _send_to(
        self, request: spb.SendMessageRequest, owners: list[int] | None, store_here: StoreHere
    ) -> spb.SendMessageResponse:
        messages = request.messages
        if owners is None:
            return await store_here(messages)
        slots = dict.fromkeys(owners)  # in order of first appearance
        if len(slots) == 1:
            slot = owners[0]
            if slot == self.me:
                return await store_here(messages)
            return _alone(await self._forward(slot, request.SerializeToString(), len(messages)))
        by_slot: dict[int, list[int]] = {slot: [] for slot in slots}
        for i, slot in enumerate(owners):
            by_slot[slot].append(i)
        parts: dict[int, Awaitable[_Part]] = {}
        for slot, indices in by_slot.items():
            part = [messages[i] for i in indices]  # wrappers of the request's own messages: no copy
            if slot == self.me:
                parts[slot] = _part_of(store_here(part))
            else:
                forwarded = spb.SendMessageRequest(messages=part).SerializeToString()
                parts[slot] = self._forward(slot, forwarded, len(indices))
        replies = dict(zip(parts, await asyncio.gather(*parts.values(), return_exceptions=True), strict=True))
        return _merge(len(messages), by_slot, replies)

    async def _owners_of(self, messages: Sequence[pb.Message]) -> list[int] | None:
        """Each message's owner slot; None when all are this broker's (no lite message, or one parent here)."""
        parent = ""
        lites: list[str] = []
        for message in messages:
            props = message.system_properties
            lite = props.lite_topic  # reading it is cheaper than HasField, which only an empty value needs
            if not lite and not props.HasField("lite_topic"):
                if lites or parent:
                    return await self._mixed_owners(messages)
                continue
            name = message.topic.name
            if name != parent:
                if parent:
                    return await self._mixed_owners(messages)
                parent = name
            lites.append(lite)
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

    def _forward(self, slot: int, serialized: bytes, count: int) -> asyncio.Future[_Part]:
        """Queue ``count`` messages (a serialized SendMessageRequest) for ``slot``: sent at the end of this tick,
        or, while ``MAX_IN_FLIGHT`` calls to that owner are unanswered, when one of them is answered. The
        answer is the owner's reply to the batch and where these messages' entries start in it."""
        loop = asyncio.get_running_loop()
        target = self.membership.members[slot]
        waiter: asyncio.Future[_Part] = loop.create_future()
        batch = self._batches.get(target)
        if batch is None or batch.size + count > MAX_BATCH:
            if batch is not None:
                self._flush(target)
            batch = self._batches[target] = _Batch()
            if self._in_flight.get(target, 0) < MAX_IN_FLIGHT:
                loop.call_soon(self._flush_if, target, batch)
        batch.parts.append(serialized)
        batch.counts.append(count)
        batch.waiters.append(waiter)
        batch.size += count
        return waiter

    def _flush_if(self, target: str, batch: _Batch) -> None:
        if self._batches.get(target) is batch:
            self._flush(target)

    def _flush(self, target: str) -> None:
        batch = self._batches.pop(target)
        self._in_flight[target] = self._in_flight.get(target, 0) + 1
        task = asyncio.get_running_loop().create_task(self._send_batch(target, batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_batch(self, target: str, batch: _Batch) -> None:
        try:
            await self._answer_batch(target, batch)
        finally:
            self._in_flight[target] -= 1
            if target in self._batches and self._in_flight[target] < MAX_IN_FLIGHT:
                self._flush(target)  # what gathered meanwhile

    async def _answer_batch(self, target: str, batch: _Batch) -> None:
        reply = await self._call_send(target, b"".join(batch.parts), batch.size)
        if isinstance(reply, BaseException):
            for waiter in batch.waiters:
                if not waiter.done():
                    waiter.set_exception(reply)
            return
        if reply.status.code == pb.OK and len(reply.entries) == batch.size:
            start = 0
            for waiter, count in zip(batch.waiters, batch.counts, strict=True):
                if not waiter.done():
                    waiter.set_result((reply, start, start + count))  # entries are copied out only if needed alone
                start += count
            return
        if len(batch.waiters) == 1:  # the owner refused this request: its answer is the client's
            if not batch.waiters[0].done():
                batch.waiters[0].set_result(_all_of(reply))
            return
        # One request of the batch was refused (a send is all or nothing): find which, one call per request.
        answers = await asyncio.gather(
            *(self._call_send(target, part, count) for part, count in zip(batch.parts, batch.counts, strict=True))
        )
        for waiter, answer in zip(batch.waiters, answers, strict=True):
            if waiter.done():
                continue
            if isinstance(answer, BaseException):
                waiter.set_exception(answer)
            else:
                waiter.set_result(_all_of(answer))

    async def _call_send(self, target: str, payload: bytes, count: int) -> spb.SendMessageResponse | errors.LmqError:
        call = self._channel(target).unary_unary(
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
                f"broker {target} owning these lite topics did not answer: "
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
        """Each owner gets its part of the subscription change (``names`` already read from the request); a
        pattern (``wildcards.is_pattern``) is part of every broker's, since each holds topics it may match. A
        client that sends the change to every broker itself (Java, Go) has each copy applied once: only this
        broker's part of it, here."""
        parent = convert.topic_name(request.topic)
        action = request.action
        if action == pb.COMPLETE_REMOVE:
            names = []
        patterns = [name for name in names if wildcards.is_pattern(name)]
        named = [name for name in names if not wildcards.is_pattern(name)]
        parts: dict[int, list[str]] = {}
        if patterns or action in (pb.COMPLETE_ADD, pb.COMPLETE_REMOVE):
            parts = {slot: list(patterns) for slot in range(self.size)}
        if named:
            for name, owner in zip(named, await self.owners(parent, named), strict=True):
                for slot in mb.subscribers_at(self.membership, model.QueueId.lmq(parent, name).topic, owner):
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

    async def subscribe_at_owners(
        self, subscriptions: Sequence[Subscription], joined: Collection[int] | None = None
    ) -> int:
        """(client id, group, parent, lite topics, patterns) subscribed here: each topic's subscription made at
        today's owner too (with ``joined``, only where that owner is one of those slots) and each pattern at
        every slot of ``joined``. Returns how many could not be (their clients' next full sync makes them)."""
        calls = []
        for client_id, group, parent, lites, patterns in subscriptions:
            by_owner: dict[int, list[str]] = {slot: list(patterns) for slot in joined or ()}
            for lite in lites:
                owner = mb.owner(self.membership, model.QueueId.lmq(parent, lite).topic)
                if joined is None or owner in joined:
                    by_owner.setdefault(owner, []).append(lite)
            for slot, subset in by_owner.items():
                if not subset:
                    continue
                request = spb.SyncLiteSubscriptionRequest(
                    action=pb.PARTIAL_ADD,
                    topic=pb.Resource(name=parent),
                    group=pb.Resource(name=group),
                    lite_topic_set=subset,
                )
                calls.append((len(subset), self._call_sync(slot, request, context.Caller(client_id=client_id))))
        replies = await asyncio.gather(*(call for _, call in calls), return_exceptions=True)
        return sum(
            count
            for (count, _), reply in zip(calls, replies, strict=True)
            if isinstance(reply, BaseException) or reply.status.code != pb.OK
        )

    async def _move_subscriptions(self, parent: str, lite: str) -> None:
        """A topic this leaving broker hands over: its consumers subscribed here are subscribed at today's owner
        too (each client's own subscription, as if it had sent it there)."""
        today = mb.owner(self.membership, model.QueueId.lmq(parent, lite).topic)
        calls = []
        for client_id, group in self._subscribers(parent, lite):
            request = spb.SyncLiteSubscriptionRequest(
                action=pb.PARTIAL_ADD,
                topic=pb.Resource(name=parent),
                group=pb.Resource(name=group),
                lite_topic_set=[lite],
            )
            calls.append(self._call_sync(today, request, context.Caller(client_id=client_id)))
        for reply in await asyncio.gather(*calls):
            if reply.status.code != pb.OK:
                raise errors.BrokerUnavailable(
                    f"lite topic {lite!r} cannot move to {self.membership.members[today]} yet: its subscription "
                    f"there was refused ({reply.status.message}); try again"
                )

    async def _call_sync(
        self, slot: int, request: spb.SyncLiteSubscriptionRequest, caller: context.Caller
    ) -> spb.SyncLiteSubscriptionResponse:
        target = self.membership.members[slot]
        call = self._channel(target).unary_unary(
            _SYNC,
            request_serializer=spb.SyncLiteSubscriptionRequest.SerializeToString,
            response_deserializer=spb.SyncLiteSubscriptionResponse.FromString,
        )
        try:
            reply: spb.SyncLiteSubscriptionResponse = await call(
                request, metadata=self.headers_of(caller), timeout=CALL_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            raise errors.BrokerUnavailable(
                f"broker {target} owning some of these lite topics did not answer: {exc.code().name}"
            ) from None
        return reply


def _raw(payload: bytes) -> bytes:
    return payload


def _all_of(reply: spb.SendMessageResponse) -> _Part:
    return reply, 0, len(reply.entries)


async def _part_of(reply: Awaitable[spb.SendMessageResponse]) -> _Part:
    return _all_of(await reply)


def _alone(part: _Part) -> spb.SendMessageResponse:
    """The answer to one request on its own (its entries copied out of a batch's reply if need be)."""
    reply, start, end = part
    if start == 0 and end == len(reply.entries):
        return reply
    return spb.SendMessageResponse(status=reply.status, entries=reply.entries[start:end])


def _merge(
    total: int, by_slot: dict[int, list[int]], replies: dict[int, _Part | BaseException]
) -> spb.SendMessageResponse:
    """One answer for a request split across owners: entries in request order, each with its part's status.
    Each owner's part is all or nothing; the request as a whole is not (MULTIPLE_RESULTS when parts differ)."""
    parts: dict[int, _Part] = {}
    for slot, indices in by_slot.items():
        part = replies[slot]
        if isinstance(part, BaseException) or part[0].status.code != pb.OK or part[2] - part[1] != len(indices):
            break
        parts[slot] = part
    else:  # every part stored: the usual case, filled into a template (copying entries costs twice as much)
        # An owner's OK entry is its OK status, the message id and the offset (``send_message.reply``).
        out = status.ok_send_reply(total)
        entries = out.entries
        for slot, indices in by_slot.items():
            reply, start, end = parts[slot]
            for i, entry in zip(indices, reply.entries[start:end], strict=True):
                target = entries[i]
                target.message_id = entry.message_id
                target.offset = entry.offset
        return out
    merged: list[spb.SendResultEntry | None] = [None] * total
    codes: set[int] = set()
    first_failure: pb.Status | None = None
    for slot, indices in by_slot.items():
        answer = replies[slot]
        reply = (
            spb.SendMessageResponse(status=status.status_of(answer))
            if isinstance(answer, BaseException)
            else _alone(answer)
        )
        codes.add(reply.status.code)
        if reply.status.code != pb.OK and first_failure is None:
            first_failure = reply.status
        for n, i in enumerate(indices):
            merged[i] = reply.entries[n] if n < len(reply.entries) else spb.SendResultEntry(status=reply.status)
    if codes == {pb.OK}:
        overall = status.ok()
    elif len(codes) == 1 and first_failure is not None:
        overall = first_failure
    else:
        overall = pb.Status(code=pb.MULTIPLE_RESULTS, message="parts of this request had different results")
    return spb.SendMessageResponse(status=overall, entries=[e for e in merged if e is not None])
