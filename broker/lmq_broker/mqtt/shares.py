"""Shared subscriptions (MQTT 5.0 section 4.8.2; also taken from 3.1.1 clients, as common brokers do).

A filter ``$share/<name>/<filter>`` makes its session a member of the share (name, filter): each message the
filter matches goes to one member. A share is a lite group of its own, shared by its members, as the
consumers of one RocketMQ group share it: ``%MQTT%%share%`` + the first 40 hex digits of SHA-256 over
``<name>`` U+0000 ``<filter>`` (``group_of``). Two shares of one name and different filters are different
shares (the spec's example: ``$share/consumer1/sport/#`` and ``$share/consumer1/sport/tennis/+``). Each member
is one dispatcher client of that group (``consumer_of``), so a message is leased to one member at a time; a
QoS 1 delivery a member did not acknowledge when its connection ended is given back to the group at once and
goes to another member (or the same, when it comes back first). A session id group (``%MQTT%<id>`` or
``%MQTT%%<hex>``) can never equal a share group: a plain client id has no ``%``, a hashed one is hex only.

A share's filter reaches the parents an ordinary filter would (``topics.Space``: the default parent for a first
level naming no parent, every parent for a first-level wildcard); a member is one client per parent. In a
cluster the group's offsets and leases live at each topic's owner, and a member is a client there too, so
members connected to different brokers get distinct messages. A share starts at the end of the lite topics it
matches when no member reads it (``read_by``: none registered on a broker; like any new subscription); a member
joining a share that has members keeps the group's offsets, so it takes its part of what they have not consumed
yet. No retained messages are sent for a shared subscription (4.8.2).

Caps (docs/security.md "Resource caps"): shares per session (``--mqtt-max-shares-per-client``) and members per
share on this broker (``--mqtt-max-share-members``); beyond them the filter is refused in the SUBACK (5.0:
``0x97`` quota exceeded, 3.1.1: ``0x80``) and counted (``lmq_mqtt_refused_total{reason}``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from lmq_broker.dispatch import api, metadata

PREFIX: Final = "$share/"
GROUP_PREFIX: Final = metadata.MQTT_GROUP_PREFIX + "%share%"
_HASH_HEX: Final = 40
_FORBIDDEN_IN_NAME: Final = frozenset("/+#")


class ShareError(ValueError):
    """A ``$share/`` filter that is not ``$share/<name>/<filter>`` with a valid name (MQTT-4.8.2-1, -2)."""


@dataclass(frozen=True, slots=True)
class Share:
    name: str
    filter: str  # the topic filter after the share name, as the client wrote it

    @property
    def text(self) -> str:
        return f"{PREFIX}{self.name}/{self.filter}"

    @property
    def group(self) -> str:
        return group_of(self.name, self.filter)


def is_shared(text: str) -> bool:
    return text.startswith(PREFIX)


def parse(text: str) -> Share:
    """``$share/<name>/<filter>``: the name is at least one character without ``/``, ``+`` or ``#``, followed by
    ``/`` and a non-empty filter (MQTT-4.8.2-1, MQTT-4.8.2-2)."""
    if not is_shared(text):
        raise ShareError(f"not a shared subscription: {text!r}")
    name, slash, filter_ = text[len(PREFIX) :].partition("/")
    if not name or _FORBIDDEN_IN_NAME & set(name):
        raise ShareError(f"invalid share name {name!r}: one or more characters, none of / + #")
    if not slash or not filter_:
        raise ShareError("a share name must be followed by / and a topic filter")
    return Share(name, filter_)


def group_of(name: str, filter_: str) -> str:
    """The lite group of the share (``name``, ``filter_``)."""
    digest = hashlib.sha256(f"{name}\x00{filter_}".encode()).hexdigest()
    return GROUP_PREFIX + digest[:_HASH_HEX]


def is_group(group: str) -> bool:
    return group.startswith(GROUP_PREFIX)


def read_by(clients: Iterable[api.ClientView], parent: str) -> bool:
    """Some member reads the share in ``parent``: one of its group's ``clients`` on a broker holds a subscription
    in that parent there."""
    return any(c.subscription_count and c.topic == parent for c in clients)


def consumer_of(share_group: str, parent: str, session_group: str) -> str:
    """The dispatcher client of one member: unique per (share, parent, session)."""
    return f"{share_group}@{parent}@{session_group}"


class Members:
    """The members of each share connected to this broker (by share group), for the per-share cap and for
    starting a share with no members at the end of its topics."""

    def __init__(self, max_members: int) -> None:
        self.max_members = max_members
        self._members: dict[str, set[str]] = {}

    def count(self, share_group: str) -> int:
        return len(self._members.get(share_group, ()))

    def join(self, share_group: str, client_id: str) -> bool:
        """Add ``client_id``; False (nothing added) when the share already has its cap of other members."""
        held = self._members.setdefault(share_group, set())
        if client_id not in held and len(held) >= self.max_members:
            if not held:
                del self._members[share_group]
            return False
        held.add(client_id)
        return True

    def leave(self, share_group: str, client_id: str) -> None:
        held = self._members.get(share_group)
        if held is None:
            return
        held.discard(client_id)
        if not held:
            del self._members[share_group]


@dataclass(frozen=True, slots=True)
class Member:
    """One session's shared subscription: its share, the parent and filter levels of the share's filter, the
    subscription's options (with its identifier, ``identifiers``) and the member's dispatcher client."""

    share: Share
    parent: str
    levels: tuple[str, ...]  # ``wildcards.Filter``
    options: int
    consumer: str

    @property
    def group(self) -> str:
        return self.share.group
