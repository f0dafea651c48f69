"""Access control on the v2 service: which user a call is, and what each request asks to do.

With ``--acl`` the v2 handler finder (``guard.Messaging``, with an ``auth.Verifier`` over the users' secrets)
has verified the call's signature before the service runs, and left its user in ``auth.USER``. Each method
then names what it touches (``policy.Target``) and the action, and ``AccessControl.check`` answers from its
cache (a send and a consumer call: ``Gate``'s own, one lookup per call, before that); a refusal
raises ``errors.Forbidden``, which the service's edge turns into the v2 status FORBIDDEN (40300), logs at
INFO (``refusals``) and counts in ``lmq_acl_refused_total{user,action}``.

What each call needs (RocketMQ ACL 2.0's table, with lite topics): SendMessage Pub on each message's lite topic
(``Lite:<parent>/<lite>``) or topic; ReceiveMessage, AckMessage, ChangeInvisibleDuration and
ForwardMessageToDeadLetterQueue Sub on the group and on the topic (on the lite topic when the request names
one); SyncLiteSubscription Sub on the group and on each lite topic (a pattern is checked as its text; a wildcard group's
COMPLETE_ADD on each of the group's lite patterns, on ``*`` without any: all the group will receive);
QueryRoute Pub or Sub on the topic or on some lite topic of it; QueryAssignment and Telemetry settings Sub on
the group and the topics (Telemetry publishing: Pub).

A client id is its user's: once a user's SyncLiteSubscription made the lite subscriptions a client id holds, another
user's ReceiveMessage, SyncLiteSubscription, NotifyClientTermination, Heartbeat or Telemetry under that id is
FORBIDDEN (``owned``): deliveries follow the client id's subscriptions, not the caller's rights, so a user with Sub
on a group it shares with another would otherwise receive that user's lite topics by naming its client id.

A lite subscription stays checked: after a change of the rules, what each client subscribed is checked again
and what its user may no longer read is removed (``revoking``).

In a cluster the decision is made once, at the broker the client called: the calls it makes to other brokers
for that client are signed with the admin pair, the super user (``cluster.links``), and carry the peer header
and the client's user (``context.ON_BEHALF``), which a broker reads only on a super user's call (``acting``): a
client's own header is ignored, and the owner of a lite topic checks whose client id it is as the access broker does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Final

from lmq_broker import errors
from lmq_broker.access import policy
from lmq_broker.access.control import AccessControl
from lmq_broker.protocol import auth, revoking
from lmq_broker.protocol.context import ON_BEHALF, ON_BEHALF_FROM, Caller, Metadata
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.handlers import sync_lite_subscription

PUB, SUB = policy.Action.PUB, policy.Action.SUB
ADMITTED_KEPT: Final = 16_384  # admissions (to send, to consume) a Gate remembers of each kind until a change
Peer = Callable[[], str]  # the call's address, read when a decision needs it (``context.peer``)
Reach = Callable[[str, str], Awaitable[tuple[str, ...] | None]]  # (group, parent) -> a wildcard group's patterns


class Gate:
    """The v2 service's checks; ``enabled`` False (no ``--acl``): the service never calls them. ``peer`` gives the
    call's address (``context.peer()``, a string built per call): asked only when a decision is not remembered."""

    def __init__(
        self,
        access: AccessControl,
        revoker: revoking.Revoker | None = None,
        subscriber: Callable[[str], str] = lambda client_id: "",
        wildcard: Reach | None = None,
    ) -> None:
        """``subscriber``: the user whose lite subscriptions a client id holds ("": none), ``Dispatcher.subscriber``;
        ``wildcard``: what a wildcard group of a parent receives (its lite patterns, ``*`` for all), None for
        another group."""
        self.access = access
        self.revoker = revoker  # lite subscriptions checked again when the rules change
        self._subscriber = subscriber
        self._wildcard = wildcard
        self.enabled = access.enabled
        # Sends and consumer calls (receive, ack, invisibility) repeat the same (user, topic, lite) and (user,
        # group, topic, lite) many times a second: their decisions in one lookup each, for the rules of
        # ``generation`` (refusals are not kept, nor the answers of a user whose rules name networks).
        self._publishers: dict[tuple[str, str, str | None], bool] = {}
        self._consumers: dict[tuple[str, str, str, str], bool] = {}
        self._generation = access.generation

    def _fresh(self) -> None:
        """Forget every remembered admission when the rules changed since (one int compare when they did not)."""
        if self.access.generation != self._generation:
            self._publishers.clear()
            self._consumers.clear()
            self._generation = self.access.generation

    def _remember(self, kept: dict[Any, bool], key: Any, user: str) -> None:
        if not self.access.by_source(user):
            if len(kept) >= ADMITTED_KEPT:
                kept.clear()
            kept[key] = True

    def _check(self, user: str, peer: str, action: policy.Action, targets: Iterable[policy.Target]) -> None:
        for target in targets:
            self.access.check(user, action, target, peer)

    def acting(self, caller: Caller, metadata: Metadata | None, peer: Peer | None = None) -> Caller:
        """``caller`` with the user it acts for: the signature's, or, on a call signed by a super user (the admin
        pair a broker of the cluster signs its calls for clients with), the user it names in ``ON_BEHALF``; and,
        when ``peer`` is given, the client's address: the call's own, or the one such a call names with that user
        (so that a subscription forwarded to its owner is checked again there as from where its client called)."""
        user, source = auth.USER.get(), ""
        if self.access.is_super(user):
            named = ""
            for key, value in metadata or ():
                if key == ON_BEHALF and isinstance(value, str):
                    named = value
                elif key == ON_BEHALF_FROM and isinstance(value, str):
                    source = value
            user, source = (named, source) if named else (user, "")
        if not source and peer is not None:
            source = peer()
        return dataclasses.replace(caller, user=user, source=source)

    def owned(self, caller: Caller) -> None:
        """FORBIDDEN (counted as Sub) when ``caller``'s client id holds lite subscriptions another user made;
        super users (and brokers acting for no one) may act under any."""
        if caller.client_id:
            owned(self.access, self._subscriber(caller.client_id), caller.client_id, caller.user or auth.USER.get())

    def send(self, peer: Peer, request: spb.SendMessageRequest) -> None:
        """Pub on each message's lite topic, or topic. A single message (what the official clients send) is
        looked up by (user, topic, lite topic) first; ``send_plain`` is the same check without that memory."""
        messages = request.messages
        if len(messages) != 1:
            self.send_plain(peer, request)
            return
        message = messages[0]
        props = message.system_properties  # read once: each protobuf field access builds a wrapper
        user, topic = auth.USER.get(), message.topic.name
        key = (user, topic, props.lite_topic if props.HasField("lite_topic") else None)
        self._fresh()
        if key in self._publishers:
            return
        self.access.check(user, PUB, _published(message), peer())
        self._remember(self._publishers, key, user)

    def send_plain(self, peer: Peer, request: spb.SendMessageRequest) -> None:
        """``send`` with no memory of its own: every message's target checked by ``AccessControl``."""
        self._check(auth.USER.get(), peer(), PUB, {_published(m) for m in request.messages})

    def route(self, peer: Peer, request: spb.QueryRouteRequest) -> None:
        route(self.access, auth.USER.get(), peer(), request.topic.name)

    def consume(self, peer: Peer, group: str, topic: str, lite: str = "") -> None:
        """Receive, assignment, ack, invisibility, dead letter: Sub on the group and the (lite) topic."""
        user, access = auth.USER.get(), self.access
        key = (user, group, topic, lite)
        self._fresh()
        if key in self._consumers:
            return
        address = peer()
        access.check(user, SUB, policy.group(group), address)
        access.check(user, SUB, policy.lite(topic, lite) if lite else policy.under(topic), address)
        self._remember(self._consumers, key, user)

    def ack(self, peer: Peer, request: spb.AckMessageRequest) -> None:
        entries = request.entries
        if len(entries) == 1:  # the official clients ack one message per call: no set to build
            self.consume(peer, request.group.name, request.topic.name, entries[0].lite_topic)
            return
        for lite in {e.lite_topic for e in entries} or {""}:
            self.consume(peer, request.group.name, request.topic.name, lite)

    async def sync_lite(
        self, peer: Peer, request: spb.SyncLiteSubscriptionRequest, caller: Caller, max_chars: int
    ) -> None:
        user, address = auth.USER.get(), peer()
        self.owned(caller)  # before anything is noted: another user's client id stays theirs
        names = await sync_lite_subscription.lite_topics(request, caller, max_chars)
        reach = None
        if request.action == pb.COMPLETE_ADD and self._wildcard is not None:
            # a wildcard group's client receives every lite topic its patterns match (all: ``*``), whatever the
            # set it sends: that is what it must be allowed to read
            reach = await self._wildcard(request.group.name, request.topic.name)
            names = names if reach is None else list(reach)
        revoker = self.revoker
        if revoker is not None and caller.client_id:
            revoker.made(caller, caller.user or user, caller.source or address, request, names, whole=reach is not None)
        try:
            self.access.check(user, SUB, policy.group(request.group.name), address)
            parent = request.topic.name
            self._check(user, address, SUB, (policy.lite(parent, n) for n in names))
        except errors.Forbidden:
            if revoker is not None and caller.client_id:
                revoker.refused(caller.client_id)  # what it holds from before (a restart, a change) is checked
            raise


def owned(access: AccessControl, owner: str, client_id: str, user: str) -> None:
    """FORBIDDEN (counted as Sub) unless ``user`` may act under ``client_id``, whose lite subscriptions ``owner``
    made ("": none known): the same user, or either of them super."""
    if not owner or owner == user or access.is_super(user) or access.is_super(owner):
        return
    name = access.count_refusal(user, SUB)
    raise errors.Forbidden(
        f"user {name} may not use client id {client_id}: its lite subscriptions are another user's "
        "(access control; every client of a user needs a client id of its own)",
        kind="acl",
        user=name,
        action=SUB.value,
    )


def route(access: AccessControl, user: str, peer: str, topic: str) -> None:
    """Pub or Sub on the topic or some lite topic of it (a route serves both producers and consumers)."""
    target = policy.under(topic)
    if not (access.allows(user, PUB, target, peer) or access.allows(user, SUB, target, peer)):
        raise access.refusal(user, SUB, target)


def settings(access: AccessControl, user: str, peer: str, settings: pb.Settings) -> None:
    """A Telemetry settings frame: a producer's topics (Pub or Sub, as a route), Sub on a consumer's group and
    topics."""
    if settings.HasField("publishing"):
        for resource in settings.publishing.topics:
            route(access, user, peer, resource.name)
    if settings.HasField("subscription"):
        subscription = settings.subscription
        if subscription.HasField("group"):
            access.check(user, SUB, policy.group(subscription.group.name), peer)
        for entry in subscription.subscriptions:
            access.check(user, SUB, policy.under(entry.topic.name), peer)


def _published(message: pb.Message) -> policy.Target:
    props = message.system_properties  # read once: each protobuf field access builds a wrapper
    if props.HasField("lite_topic"):
        return policy.lite(message.topic.name, props.lite_topic)
    return policy.topic(message.topic.name)
