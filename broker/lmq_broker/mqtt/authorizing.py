"""Access control for MQTT (``--acl``; docs/security.md): the few checks the connection calls.

A CONNECT names a user and its secret as username and password (a will needs Pub on its topic); a PUBLISH
needs Pub on its lite topic (``chat/a/1`` is ``Lite:chat/a_1``); a SUBSCRIBE needs Sub per filter, checked as
the filter's lite text (``chat/a/#`` as ``Lite:chat/a_#``): a prefix rule admits a filter only when its
literal levels stay inside the prefix, a filter that reaches wider (``chat/#``) needs ``Topic:chat``. An MQTT
session's implicit group (``%MQTT%<client id>``) is not checked: it is the client's own.

A policy change (``AccessControl.watch``) ends the filters of live sessions that their user may no longer read,
and a resumed session's saved filters are checked again before its CONNACK (``revoke``): a filter dropped so
stops delivering (a message handed out already may still be acknowledged), logged at INFO; the SUBSCRIBE is
not answered again (MQTT has no packet to tell a client its subscription ended). Shared subscriptions
(``$share/...``) are checked the same way, by their filter: a membership its user may no longer read is left
as an UNSUBSCRIBE would leave it (its unacknowledged deliveries go back to the share, for other members).

Refusals raise ``errors.Forbidden`` (the connection answers 0x87 Not authorized in 5.0, and as 3.1.1 allows),
counted in ``lmq_acl_refused_total{user,action}``.
"""

from __future__ import annotations

import hmac
import logging

from lmq_broker import errors
from lmq_broker.access import policy
from lmq_broker.access.control import AccessControl
from lmq_broker.dispatch import wildcards
from lmq_broker.mqtt import codec, topics
from lmq_broker.mqtt.subscribing import Subscriptions

log = logging.getLogger(__name__)


def connect_refusal(
    access: AccessControl, connect: codec.Connect, host: str, space: topics.Space | None = None
) -> int | None:
    """The 3.1.1 CONNACK code a CONNECT is refused with under ``--acl`` (5.0: translated, 0x86 / 0x87); None:
    accepted. ``space``: where the will's topic is stored (its first level's parent, else the default parent)."""
    name = connect.username or ""
    secret = access.secret_of(name)
    password = connect.password or b""
    if secret is None or not hmac.compare_digest(password, secret.encode()):
        access.note("CONNECT", f"user {name[:64]!r} from {host}: bad user name or password")
        return codec.ConnectCode.BAD_USERNAME_OR_PASSWORD
    will = connect.will
    if will is not None:
        try:
            where = space.lite_of(will.topic) if space is not None else topics.lite_of(will.topic)
            publish(access, name, host, where)
        except errors.Forbidden:
            return codec.ConnectCode.NOT_AUTHORIZED
        except topics.TopicError:
            pass  # an invalid will topic is refused elsewhere
    return None


def publish(access: AccessControl, user: str, host: str, where: topics.Topic) -> None:
    """Pub on the lite topic a publish is stored in (a topic of no named parent: the default parent's)."""
    if access.enabled:
        _check(access, user, host, policy.Action.PUB, policy.lite(where.parent, where.lite))


def subscribe(access: AccessControl, user: str, host: str, parent: str, levels: wildcards.Filter) -> None:
    if access.enabled:
        _check(access, user, host, policy.Action.SUB, policy.lite(parent, wildcards.LEVEL_SEPARATOR.join(levels)))


def _check(access: AccessControl, user: str, host: str, action: policy.Action, target: policy.Target) -> None:
    try:
        access.check(user, action, target, host)
    except errors.Forbidden as refused:
        access.note(f"MQTT {action.value}", refused.message)
        raise


async def revoke(access: AccessControl, subscriptions: Subscriptions) -> bool:
    """End the session's filters its user may no longer read (Sub on their lite text, as at SUBSCRIBE): at
    the dispatcher, at the cluster's other brokers, and in the saved session; whether that row was written (the
    caller waits for the rows of every session it rechecked to reach the replicas, once)."""
    link = subscriptions.link
    if not access.enabled:
        return False
    shared = await _revoke_shares(access, subscriptions)
    ended: dict[str, list[wildcards.Filter]] = {}
    for parent, held in list(link.subs.items()):
        for levels in list(held):
            target = policy.lite(parent, wildcards.LEVEL_SEPARATOR.join(levels))
            if not access.allows(link.user, policy.Action.SUB, target, link.address):
                del held[levels]
                ended.setdefault(parent, []).append(levels)
    if not ended:
        if shared and link.persistent and link.stored:
            await subscriptions.save(replicated=False)
            return True
        return False
    texts = sorted(topics.filter_in(link.config.mqtt_default_parent, p, f) for p, fs in ended.items() for f in fs)
    log.info("mqtt client %s, user %s: filters no longer allowed ended (access control changed): %s",
             link.client_id, link.user, ", ".join(texts))  # fmt: skip
    cluster = link.cluster
    for parent, filters in ended.items():
        await subscriptions.register(parent)
        if cluster is not None:
            await cluster.unsubscribe(link.consumer_id(parent), link.group, parent, filters)
    if link.persistent and link.stored:
        await subscriptions.save(replicated=False)
        return True
    return False


async def _revoke_shares(access: AccessControl, subscriptions: Subscriptions) -> bool:
    """Leave the shares whose filter the session's user may no longer read in one of the parents it reaches
    (the whole share: its parts are one subscription); whether any was left."""
    link, sharing = subscriptions.link, subscriptions.sharing
    texts = sorted(
        {
            member.share.text
            for parts in list(sharing.held.values())
            for member in parts
            if not access.allows(
                link.user, policy.Action.SUB,
                policy.lite(member.parent, wildcards.LEVEL_SEPARATOR.join(member.levels)), link.address,
            )
        }
    )  # fmt: skip
    if not texts:
        return False
    log.info("mqtt client %s, user %s: shared subscriptions no longer allowed left (access control changed): %s",
             link.client_id, link.user, ", ".join(texts))  # fmt: skip
    for text in texts:
        await sharing.unsubscribe(text)
    return True
