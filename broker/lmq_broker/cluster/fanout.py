"""Subscriptions in a cluster: each owner gets its part of a client's subscription change, and keeps getting
it when it restarts or was down when the client asked.

Python, Java (5.2.0) and Node clients send SyncLiteSubscription to the access endpoint only: it is split by
owner and each owner gets its part (a COMPLETE_ADD becomes one complete set per broker, empty for brokers that
own none of the topics). A pattern (``session-*``) can match topics of every broker, so it is part of each
broker's set. Go sends it to every broker itself; each copy is applied where it lands, for that broker's part.

The access broker keeps what each client asked for (its *intents*: per client, group and parent, the named
lite topics and the patterns), so that an owner that could not be reached when the client asked, or that
restarted and lost what it held in memory (kill -9), gets the client's part again as soon as it answers
(``repush``, driven by ``watch``): the client's call is answered OK when every broker that answered took its
part, and a broker that did not answer is behind until it is brought up to date. A refusal (a quota, a bad
pattern) is the client's answer and changes no intent. Intents are capped (``max_subscriptions_per_broker`` x
slots, 42902 beyond it) and dropped with their client when this broker forgets the client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Final

import grpc

from lmq_broker import errors, model
from lmq_broker.cluster import membership as mb
from lmq_broker.cluster.links import CALL_TIMEOUT_S, V2, Links
from lmq_broker.cluster.owners import Owners
from lmq_broker.dispatch import wildcards
from lmq_broker.protocol import context, convert
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb

log = logging.getLogger(__name__)

_SYNC: Final = V2 + "SyncLiteSubscription"
QUICK_TIMEOUT_S: Final = 0.5  # a call to a broker the watch found down: no wait for a connection
REPUSH_CHUNK: Final = 1_000  # lite topics per re-pushed SyncLiteSubscription
REPUSH_CALLS: Final = 8  # re-push calls to one broker at once
# x-mq-language of the clients that send SyncLiteSubscription to every route endpoint themselves. Go (v5.1.4)
# does; Java 5.2.0 sends it to its configured endpoint only (``LitePushConsumerImpl.syncLiteSubscription`` ->
# ``getEndpoints()``), like Python and Node, so its calls are split here. A client wrongly counted as calling
# one endpoint only costs repeated, idempotent parts; one wrongly counted here would miss other brokers' topics.
SYNCS_EVERY_BROKER: Final = frozenset(("GOLANG",))

Subscription = tuple[str, str, str, list[str], list[str]]  # client id, group, parent, lite topics, patterns
Subscribers = Callable[[str, str], list[tuple[str, str]]]  # (parent, lite) -> (client id, group) subscribed here
Known = Callable[[str], bool]  # a client id this broker still knows (its registry)
ApplyHere = Callable[[spb.SyncLiteSubscriptionRequest], Awaitable[spb.SyncLiteSubscriptionResponse]]


Mark = tuple[int, int]  # when a change ended: its number (``Fanout._changes``) and its clock (monotonic ms)
RECENT_REMOVALS: Final = 1_024  # removals remembered per intent against a full sync built before them
RECENT_KEPT_MS: Final = 10_000  # ... for this long (or twice ``--full-sync-grace-ms``)


@dataclass
class _Intent:
    # name -> when the change that added it ended: a complete set that began before then, or less than
    # ``--full-sync-grace-ms`` after, was built by a client that did not have the name yet, and does not take it away
    lites: dict[str, Mark] = field(default_factory=dict)
    patterns: dict[str, Mark] = field(default_factory=dict)
    # names a removal took away lately -> when it ended: such a complete set does not bring them back
    removed: dict[str, Mark] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.lites) + len(self.patterns)


class Fanout:
    def __init__(self, links: Links, owners: Owners, *, subscribers: Subscribers, known: Known) -> None:
        self._links = links
        self._owners = owners
        self._subscribers = subscribers
        self._known = known
        self._intents: dict[tuple[str, str, str], _Intent] = {}  # (client id, group, parent) -> what it asked
        self._names = 0  # lite topics and patterns held in _intents
        self._changes = 0  # beginnings and ends of client changes here, numbered in order
        self.unreachable: set[int] = set()  # slots found down: asked without waiting, their parts kept if silent
        self.behind: set[int] = set()  # slots that missed a part since they last answered
        # Every member given every intent again by the current ring (``watch.Watch.ring_changed``): a change split
        # by a ring that changed before it was remembered calls it (the change's own repush did not know it)
        self.ring_changed: Callable[[], None] | None = None

    @property
    def cap(self) -> int:
        return self._links.config.max_subscriptions_per_broker * max(1, self._links.size)

    # --- a client's change --------------------------------------------------------------------------------
    async def sync_lite(
        self, request: spb.SyncLiteSubscriptionRequest, names: list[str], caller: context.Caller, apply_here: ApplyHere
    ) -> spb.SyncLiteSubscriptionResponse:
        """Each owner gets its part of the change (``names`` already read from the request); a broker that does
        not answer gets it later (``repush``). A client that sends the change to every broker itself (Go) has
        each copy applied once: only this broker's part of it, here."""
        parent = convert.topic_name(request.topic)
        group = convert.group_name(request.group)
        action = request.action
        self._changes += 1
        began = (self._changes, _now_ms())
        if action == pb.COMPLETE_REMOVE:
            names = []
        self._check_cap(caller.client_id, group, parent, action, names)
        split_by = self._links.membership
        patterns = [name for name in names if wildcards.is_pattern(name)]
        named = [name for name in names if not wildcards.is_pattern(name)]
        parts: dict[int, list[str]] = {}
        if patterns or action in (pb.COMPLETE_ADD, pb.COMPLETE_REMOVE):
            parts = {slot: list(patterns) for slot in range(self._links.size)}
        for name, slots in zip(named, await self._where(parent, named), strict=True):
            for slot in slots:
                parts.setdefault(slot, []).append(name)
        me = self._links.me
        if caller.language in SYNCS_EVERY_BROKER:
            parts = (
                {me: parts.get(me, [])}
                if action in (pb.COMPLETE_ADD, pb.COMPLETE_REMOVE)
                else {slot: subset for slot, subset in parts.items() if slot == me}
            )
        missed: list[int] = []
        targets = sorted(parts)
        calls: list[Awaitable[spb.SyncLiteSubscriptionResponse]] = []
        for slot in targets:
            part = spb.SyncLiteSubscriptionRequest()
            part.CopyFrom(request)
            del part.lite_topic_set[:]
            part.lite_topic_set.extend(parts[slot])
            # a broker the watch found down is not waited for: asked once, its part is kept if it does not answer
            quick = slot in self.unreachable
            calls.append(apply_here(part) if slot == me else self._call_sync(slot, part, caller, quick=quick))
        replies = await asyncio.gather(*calls, return_exceptions=True)
        for slot, reply in zip(targets, replies, strict=True):
            if isinstance(reply, errors.BrokerUnavailable) and slot != me:
                missed.append(slot)
            elif isinstance(reply, BaseException):
                raise reply
            elif reply.status.code != pb.OK:
                return reply
        self._changes += 1
        self._remember(caller.client_id, group, parent, action, names, began, (self._changes, _now_ms()))
        if self._links.membership is not split_by and self.ring_changed is not None:
            self.ring_changed()  # split by the older ring, and not known yet to the repush its change started
        if missed:
            self.behind.update(missed)
            self.unreachable.update(missed)  # until the watch hears from it again
            log.info(
                "%s's subscription change is kept for %s, which did not answer: applied when it does",
                caller.client_id,
                ", ".join(self._links.membership.members[slot] for slot in missed),
            )
        return spb.SyncLiteSubscriptionResponse(status=pb.Status(code=pb.OK, message="OK"))

    async def _where(self, parent: str, named: Sequence[str]) -> list[tuple[int, ...]]:
        """The slots each named topic's subscription goes to: its owner (and today's owner too while the owner
        is leaving), or, when its owner cannot be told (an older candidate does not answer), every candidate:
        a subscription where the topic does not live is harmless, a missing one strands its messages."""
        membership = self._links.membership
        try:
            owners = await self._owners.owners(parent, named)
        except errors.BrokerUnavailable:
            return [mb.candidates(membership, model.QueueId.lmq(parent, name).topic) for name in named]
        return [
            mb.subscribers_at(membership, model.QueueId.lmq(parent, name).topic, owner)
            for name, owner in zip(named, owners, strict=True)
        ]

    def _check_cap(self, client_id: str, group: str, parent: str, action: int, names: list[str]) -> None:
        if action not in (pb.PARTIAL_ADD, pb.COMPLETE_ADD):
            return
        intent = self._intents.get((client_id, group, parent))
        held = intent.size if intent is not None else 0
        grows = len(names) - held if action == pb.COMPLETE_ADD else len(names)
        if self._names + grows > self.cap:
            raise errors.SubscriptionQuotaExceeded(
                f"this broker keeps at most {self.cap} lite subscriptions for the clients that call it "
                f"(--max-subscriptions-per-broker x brokers); {self._names} are held"
            )

    def _remember(  # noqa: PLR0917 (the change, as the client sent it, and when)
        self, client_id: str, group: str, parent: str, action: int, names: list[str], began: Mark, ended: Mark
    ) -> None:
        """The client's change, which ``began`` and ``ended`` then (changes run concurrently: a subscribe waiting
        for a broker that does not answer can end after the client's next full sync began). The client adds a
        name to its own set only once its subscribe is answered (and drops one once its unsubscribe is), so a
        complete set replaces the intent but keeps the names whose subscribe ended after the complete set began,
        or less than ``--full-sync-grace-ms`` before (a full sync sent at once, unawaited, can arrive after a
        subscribe sent after it: as ``dispatch.subscriptions``), and does not bring back what an unsubscribe
        that ended then took away; a removal takes away only what was added before it began."""
        key = (client_id, group, parent)
        intent = self._intents.pop(key, None) or _Intent()
        self._names -= intent.size
        grace = self._links.config.full_sync_grace_ms

        def newer(mark: Mark) -> bool:
            return mark[0] > began[0] or (grace > 0 and mark[1] >= began[1] - grace)

        if action in (pb.COMPLETE_ADD, pb.COMPLETE_REMOVE):
            removed = {n: at for n, at in intent.removed.items() if newer(at)}
            intent = _Intent(
                {n: at for n, at in intent.lites.items() if newer(at)},
                {n: at for n, at in intent.patterns.items() if newer(at)},
                removed,
            )
            names = [name for name in names if name not in removed]
        for name in names:
            into = intent.patterns if wildcards.is_pattern(name) else intent.lites
            if action == pb.PARTIAL_REMOVE:
                if into.get(name, began)[0] < began[0]:
                    del into[name]
                if grace:
                    intent.removed.pop(name, None)
                    intent.removed[name] = ended
            else:
                into[name] = max(into.get(name, (0, 0)), ended)
                intent.removed.pop(name, None)
        _forget_old(intent.removed, ended[1] - max(RECENT_KEPT_MS, 2 * grace))
        if intent.size or intent.removed:
            self._intents[key] = intent
            self._names += intent.size

    @property
    def intents(self) -> int:
        return self._names

    def prune(self) -> int:
        """Forget the intents of clients this broker no longer knows; returns how many clients."""
        gone = [key for key in self._intents if not self._known(key[0])]
        for key in gone:
            self._names -= self._intents.pop(key).size
        return len(gone)

    # --- bringing a broker up to date ---------------------------------------------------------------------------
    async def repush(self, slot: int) -> tuple[int, int]:
        """Every intent's part at ``slot`` (its patterns, and the named topics it is a candidate for or, with
        replication, holds the lease of a candidate of), made again
        there (PARTIAL_ADD: idempotent, and never takes away what another access broker gave it). Returns how
        many lite topics and patterns were made there and how many could not be (it stays behind, to be tried
        again)."""
        self.prune()
        membership = self._links.membership
        serving = self._owners.serving or (lambda candidate: candidate)  # replication: a failover's new holder
        requests: list[tuple[int, spb.SyncLiteSubscriptionRequest, context.Caller]] = []
        for (client_id, group, parent), intent in list(self._intents.items()):
            share = sorted(intent.patterns) + sorted(
                lite
                for lite in intent.lites
                if any(
                    slot in (candidate, serving(candidate))
                    for candidate in mb.candidates(membership, model.QueueId.lmq(parent, lite).topic)
                )
            )
            for start in range(0, len(share), REPUSH_CHUNK):
                chunk = share[start : start + REPUSH_CHUNK]
                request = spb.SyncLiteSubscriptionRequest(
                    action=pb.PARTIAL_ADD,
                    topic=pb.Resource(name=parent),
                    group=pb.Resource(name=group),
                    lite_topic_set=chunk,
                )
                requests.append((len(chunk), request, context.Caller(client_id=client_id)))
        self.behind.discard(slot)  # a change that misses it while this runs marks it again
        failed = await self._calls(slot, requests)
        if failed:
            self.behind.add(slot)
        return sum(count for count, _, _ in requests) - failed, failed

    async def _calls(
        self, slot: int, requests: Sequence[tuple[int, spb.SyncLiteSubscriptionRequest, context.Caller]]
    ) -> int:
        """Make ``requests`` at ``slot``, ``REPUSH_CALLS`` at a time; how many of their names failed."""
        gate = asyncio.Semaphore(REPUSH_CALLS)

        async def one(count: int, request: spb.SyncLiteSubscriptionRequest, caller: context.Caller) -> int:
            async with gate:
                try:
                    reply = await self._call_sync(slot, request, caller)
                except errors.LmqError:
                    return count
                return 0 if reply.status.code == pb.OK else count

        return sum(await asyncio.gather(*(one(*r) for r in requests)))

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
                owner = self._owners.owner_today(parent, lite)
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

    async def move_subscriptions(self, parent: str, lite: str) -> None:
        """A topic this leaving broker hands over: its consumers subscribed here are subscribed at today's owner
        too (each client's own subscription, as if it had sent it there)."""
        today = self._owners.owner_today(parent, lite)
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
                    f"lite topic {lite!r} cannot move to {self._links.membership.members[today]} yet: its "
                    f"subscription there was refused ({reply.status.message}); try again"
                )

    async def _call_sync(
        self, slot: int, request: spb.SyncLiteSubscriptionRequest, caller: context.Caller, *, quick: bool = False
    ) -> spb.SyncLiteSubscriptionResponse:
        target = self._links.membership.members[slot]
        call = self._links.channel(target).unary_unary(
            _SYNC,
            request_serializer=spb.SyncLiteSubscriptionRequest.SerializeToString,
            response_deserializer=spb.SyncLiteSubscriptionResponse.FromString,
        )
        try:
            reply: spb.SyncLiteSubscriptionResponse = await call(
                request,
                metadata=self._links.v2_headers("SyncLiteSubscription", caller),
                timeout=QUICK_TIMEOUT_S if quick else CALL_TIMEOUT_S,
                wait_for_ready=not quick,
            )
        except grpc.aio.AioRpcError as exc:
            raise errors.BrokerUnavailable(
                f"broker {target} owning some of these lite topics did not answer: {exc.code().name}"
            ) from None
        return reply


def _now_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def _forget_old(removed: dict[str, Mark], since_ms: int) -> None:
    """Removals older than ``since_ms`` and past the last ``RECENT_REMOVALS`` (oldest first: each moves its name
    to the end)."""
    while removed:
        oldest = next(iter(removed))
        if removed[oldest][1] >= since_ms and len(removed) <= RECENT_REMOVALS:
            return
        del removed[oldest]
