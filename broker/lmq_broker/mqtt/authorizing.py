"""Access control for MQTT (``--acl``; docs/security.md): the few checks the connection calls.

A CONNECT names a user and its secret as username and password (a will needs Pub on its topic); a PUBLISH
needs Pub on its lite topic (``chat/a/1`` is ``Lite:chat/a_1``); a SUBSCRIBE needs Sub per filter, checked as
the filter's lite text (``chat/a/#`` as ``Lite:chat/a_#``): a prefix rule admits a filter only when its
literal levels stay inside the prefix, a filter that reaches wider (``chat/#``) needs ``Topic:chat``. An MQTT
session's implicit group (``%MQTT%<client id>``) is not checked: it is the client's own.

Refusals raise ``errors.Forbidden`` (the connection answers 0x87 Not authorized in 5.0, and as 3.1.1 allows),
counted in ``lmq_acl_refused_total{user,action}``.
"""

from __future__ import annotations

import hmac

from lmq_broker import errors
from lmq_broker.access import policy
from lmq_broker.access.control import AccessControl
from lmq_broker.dispatch import wildcards
from lmq_broker.mqtt import codec, topics


def connect_refusal(access: AccessControl, connect: codec.Connect, host: str) -> int | None:
    """The 3.1.1 CONNACK code a CONNECT is refused with under ``--acl`` (5.0: translated, 0x86 / 0x87); None:
    accepted."""
    name = connect.username or ""
    secret = access.secret_of(name)
    password = connect.password or b""
    if secret is None or not hmac.compare_digest(password, secret.encode()):
        access.note("CONNECT", f"user {name[:64]!r} from {host}: bad user name or password")
        return codec.ConnectCode.BAD_USERNAME_OR_PASSWORD
    will = connect.will
    if will is not None:
        try:
            publish(access, name, host, will.topic)
        except errors.Forbidden:
            return codec.ConnectCode.NOT_AUTHORIZED
    return None


def publish(access: AccessControl, user: str, host: str, topic: str) -> None:
    """Pub on the topic's lite topic (a topic that names none is refused elsewhere, as invalid)."""
    if not access.enabled:
        return
    try:
        parent, lite = topics.lite_of(topic)
    except topics.TopicError:
        return
    _check(access, user, host, policy.Action.PUB, policy.lite(parent, lite))


def subscribe(access: AccessControl, user: str, host: str, parent: str, levels: wildcards.Filter) -> None:
    if access.enabled:
        _check(access, user, host, policy.Action.SUB, policy.lite(parent, wildcards.LEVEL_SEPARATOR.join(levels)))


def _check(access: AccessControl, user: str, host: str, action: policy.Action, target: policy.Target) -> None:
    try:
        access.check(user, action, target, host)
    except errors.Forbidden as refused:
        access.note(f"MQTT {action.value}", refused.message)
        raise
