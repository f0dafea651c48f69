"""Access control on the v2 service: which user a call is, and what each request asks to do.

With ``--acl`` the v2 handlers' wrappers (``guard``, with an ``auth.Verifier`` over the users' secrets) have
verified the call's signature before the service runs, and left its user in ``auth.USER``. Each method then names what
it touches (``policy.Target``) and the action, and ``AccessControl.check`` answers from its cache; a refusal
raises ``errors.Forbidden``, which the service's edge turns into the v2 status FORBIDDEN (40300), logs at
INFO (``refusals``) and counts in ``lmq_acl_refused_total{user,action}``.

What each call needs (RocketMQ ACL 2.0's table, with lite topics): SendMessage Pub on each message's lite topic
(``Lite:<parent>/<lite>``) or topic; ReceiveMessage, AckMessage, ChangeInvisibleDuration and
ForwardMessageToDeadLetterQueue Sub on the group and on the topic (on the lite topic when the request names
one); SyncLiteSubscription Sub on the group and on each lite topic (a pattern is checked as its text);
QueryRoute Pub or Sub on the topic or on some lite topic of it; QueryAssignment and Telemetry settings Sub on
the group and the topics (Telemetry publishing: Pub).

A lite subscription stays checked: after a change of the rules, what each client subscribed is checked again
and what its user may no longer read is removed (``revoking``).

In a cluster the decision is made once, at the broker the client called: the calls it makes to other brokers
for that client are signed with the admin pair, the super user (``cluster.links``), and carry the peer header.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from lmq_broker import errors
from lmq_broker.access import policy
from lmq_broker.access.control import AccessControl
from lmq_broker.protocol import auth, revoking
from lmq_broker.protocol.context import Caller
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.handlers import sync_lite_subscription

PUB, SUB = policy.Action.PUB, policy.Action.SUB
CONSUMERS_KEPT: Final = 16_384  # (user, group, topic, lite) admitted to consume, remembered until a change


class Gate:
    """The v2 service's checks; ``enabled`` False (no ``--acl``): the service never calls them."""

    def __init__(self, access: AccessControl, revoker: revoking.Revoker | None = None) -> None:
        self.access = access
        self.revoker = revoker  # lite subscriptions checked again when the rules change
        self.enabled = access.enabled
        # Consumer calls (receive, ack, invisibility) repeat the same (user, group, topic, lite) many times a
        # second: their two decisions in one lookup, for the rules of ``generation`` (refusals are not kept).
        self._consumers: dict[tuple[str, str, str, str], bool] = {}
        self._generation = access.generation

    def _check(self, user: str, peer: str, action: policy.Action, targets: Iterable[policy.Target]) -> None:
        for target in targets:
            self.access.check(user, action, target, peer)

    def _route(self, user: str, peer: str, topic: str) -> None:
        route(self.access, user, peer, topic)

    def send(self, peer: str, request: spb.SendMessageRequest) -> None:
        messages = request.messages
        targets = (_published(messages[0]),) if len(messages) == 1 else {_published(m) for m in messages}
        self._check(auth.USER.get(), peer, PUB, targets)

    def route(self, peer: str, request: spb.QueryRouteRequest) -> None:
        self._route(auth.USER.get(), peer, request.topic.name)

    def consume(self, peer: str, group: str, topic: str, lite: str = "") -> None:
        """Receive, assignment, ack, invisibility, dead letter: Sub on the group and the (lite) topic."""
        user, access = auth.USER.get(), self.access
        if access.generation != self._generation:
            self._consumers.clear()
            self._generation = access.generation
        key = (user, group, topic, lite)
        if key in self._consumers:
            return
        access.check(user, SUB, policy.group(group), peer)
        access.check(user, SUB, policy.lite(topic, lite) if lite else policy.under(topic), peer)
        if not access.by_source(user):
            if len(self._consumers) >= CONSUMERS_KEPT:
                self._consumers.clear()
            self._consumers[key] = True

    def ack(self, peer: str, request: spb.AckMessageRequest) -> None:
        entries = request.entries
        if len(entries) == 1:  # the official clients ack one message per call: no set to build
            self.consume(peer, request.group.name, request.topic.name, entries[0].lite_topic)
            return
        for lite in {e.lite_topic for e in entries} or {""}:
            self.consume(peer, request.group.name, request.topic.name, lite)

    async def sync_lite(
        self, peer: str, request: spb.SyncLiteSubscriptionRequest, caller: Caller, max_chars: int
    ) -> None:
        user = auth.USER.get()
        names = await sync_lite_subscription.lite_topics(request, caller, max_chars)
        revoker = self.revoker
        if revoker is not None and caller.client_id:
            revoker.made(caller, user, peer, request, names)
        try:
            self.access.check(user, SUB, policy.group(request.group.name), peer)
            parent = request.topic.name
            self._check(user, peer, SUB, (policy.lite(parent, n) for n in names))
        except errors.Forbidden:
            if revoker is not None and caller.client_id:
                revoker.refused(caller.client_id)  # what it holds from before (a restart, a change) is checked
            raise


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
