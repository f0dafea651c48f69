"""Users and policies (RocketMQ ACL 2.0's model, plus lite topics as resources), and how a decision is made.

Pure values and functions, no I/O: the meta store keeps them as one JSON document (``document``), the admin
service changes them, and the v2 service and the MQTT listener ask ``Rules.allows`` per call.

A policy entry is (user, resource, decision) → actions and optional source networks. Resources:

* ``Topic:<name>`` — a parent (or normal) topic, and every lite topic under it;
* ``Group:<name>`` — a consumer group (an MQTT session's implicit group is ``%MQTT%<client id>``);
* ``Lite:<parent>/<name>`` — lite topics of one parent only: tenant A's sessions under a shared parent;
* ``*`` — everything (``Topic:*``, ``Group:*`` and ``Lite:<parent>/*`` likewise).

A name is literal, a prefix when it ends with the only ``*`` (``Lite:chat/tenant-a-*``), or a pattern with ``*``
(any characters) and ``?`` (one) anywhere. The decision for (user, action, target, source address): super users
may do everything; otherwise any matching deny refuses, else any matching allow admits, else refused (default
deny). A rule with source networks matches only calls from inside one of them.

Which rules can apply is worked out once per user when the document changes (``compile``), so a decision is a
short scan of that user's rules; the broker keeps the answers in a bounded cache (``access.control``).
"""

from __future__ import annotations

import enum
import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final, NamedTuple

from lmq_broker import errors

MAX_NAME_CHARS: Final = 128  # a user name (the access key)
MAX_SECRET_CHARS: Final = 256
MIN_SECRET_CHARS: Final = 8
MAX_RESOURCE_CHARS: Final = 512
_NAME_RE: Final = re.compile(r"^[A-Za-z0-9._:@-]+$")

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class Action(enum.StrEnum):
    PUB = "Pub"
    SUB = "Sub"
    CREATE = "Create"
    UPDATE = "Update"
    DELETE = "Delete"
    GET = "Get"
    LIST = "List"


class Decision(enum.StrEnum):
    ALLOW = "Allow"
    DENY = "Deny"


class Kind(enum.StrEnum):
    """What a call touches: a topic, a group, one lite topic of a parent, or "something under this topic" (a
    route or an assignment, which a user with rights on some lite topics of the parent needs too)."""

    TOPIC = "Topic"
    GROUP = "Group"
    LITE = "Lite"
    UNDER = "Under"


# The groups of MQTT sessions and shared subscriptions (``dispatch.metadata.MQTT_GROUP_PREFIX``): made by the broker
# for each session, never by a rule's grant. A v2 receive naming one under the session's consumer id would take that
# session's messages whatever their lite topics; an admin put of one would change how the session is served.
SESSION_GROUP_PREFIX: Final = "%MQTT%"


class Target(NamedTuple):  # a tuple: hashed in C, it is the decision cache's key
    kind: Kind
    name: str  # the topic, group or lite topic
    parent: str = ""  # LITE: the parent topic

    def __str__(self) -> str:
        if self.kind is Kind.LITE:
            return f"Lite:{self.parent}/{self.name}"
        if self.kind is Kind.UNDER:
            return f"Topic:{self.name}"
        return f"{self.kind.value}:{self.name}"


def topic(name: str) -> Target:
    return Target(Kind.TOPIC, name)


def group(name: str) -> Target:
    return Target(Kind.GROUP, name)


def lite(parent: str, name: str) -> Target:
    return Target(Kind.LITE, name, parent)


def under(parent: str) -> Target:
    return Target(Kind.UNDER, parent)


@dataclass(frozen=True, slots=True)
class User:
    name: str  # the access key of MQv2-HMAC-SHA1, the MQTT username
    secret: str = field(repr=False)  # the secret key, the MQTT password: never logged, never returned
    super_user: bool = False
    enabled: bool = True


@dataclass(frozen=True, slots=True)
class Entry:
    """One policy entry: ``user`` may (``ALLOW``) or may not (``DENY``) do ``actions`` on ``resource``, from
    ``sources`` (CIDRs; none: from anywhere)."""

    user: str
    resource: str
    actions: tuple[Action, ...]
    decision: Decision = Decision.ALLOW
    sources: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, str, Decision]:
        return (self.user, self.resource, self.decision)


# --- validation ---------------------------------------------------------------------------------------------


def checked_user(user: User) -> User:
    if not user.name or len(user.name) > MAX_NAME_CHARS or not _NAME_RE.match(user.name):
        raise errors.InvalidArgument(
            f"user name {user.name[:MAX_NAME_CHARS]!r} must be 1-{MAX_NAME_CHARS} characters of [A-Za-z0-9._:@-]",
            kind="user",
        )
    if not MIN_SECRET_CHARS <= len(user.secret) <= MAX_SECRET_CHARS:
        raise errors.InvalidArgument(
            f"the secret of user {user.name} must be {MIN_SECRET_CHARS}-{MAX_SECRET_CHARS} characters", kind="user"
        )
    return user


def checked_entry(entry: Entry) -> Entry:
    checked_user(User(entry.user, "x" * MIN_SECRET_CHARS))
    _matcher_of(entry.resource)  # raises InvalidArgument when the resource does not parse
    if not entry.actions:
        raise errors.InvalidArgument(f"policy on {entry.resource} names no action", kind="acl")
    for source in entry.sources:
        _network(source)
    return Entry(
        entry.user,
        entry.resource,
        tuple(sorted(set(entry.actions), key=list(Action).index)),
        entry.decision,
        tuple(dict.fromkeys(entry.sources)),
    )


def action_of(text: str) -> Action:
    for action in Action:
        if action.value.lower() == text.strip().lower():
            return action
    raise errors.InvalidArgument(f"unknown action {text!r}: one of {', '.join(a.value for a in Action)}", kind="acl")


def decision_of(text: str) -> Decision:
    for decision in Decision:
        if decision.value.lower() == text.strip().lower():
            return decision
    raise errors.InvalidArgument(f"unknown decision {text!r}: Allow or Deny", kind="acl")


def _network(text: str) -> IpNetwork:
    try:
        return ipaddress.ip_network(text.strip(), strict=False)
    except ValueError:
        raise errors.InvalidArgument(f"source {text!r} is not an IP address or CIDR", kind="acl") from None


# --- names: literal, prefix or pattern --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Name:
    literal: str | None = None
    prefix: str | None = None
    pattern: re.Pattern[str] | None = None

    def matches(self, name: str) -> bool:
        if self.literal is not None:
            return name == self.literal
        if self.prefix is not None:
            return name.startswith(self.prefix)
        return self.pattern is not None and self.pattern.fullmatch(name) is not None


def _name_of(text: str, what: str) -> _Name:
    if not text:
        raise errors.InvalidArgument(f"resource names no {what}", kind="acl")
    if "*" not in text and "?" not in text:
        return _Name(literal=text)
    if text.endswith("*") and "*" not in text[:-1] and "?" not in text:
        return _Name(prefix=text[:-1])
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in text)
    return _Name(pattern=re.compile(regex, re.DOTALL))


@dataclass(frozen=True, slots=True)
class _Matcher:
    kind: Kind  # TOPIC, GROUP or LITE (the resource's kind)
    name: _Name
    parent: str = ""  # LITE: the parent, literal

    def matches(self, target: Target, *, allow: bool) -> bool:
        kind = target.kind
        if self.kind is Kind.TOPIC:
            if kind is Kind.LITE:
                return self.name.matches(target.parent)
            return kind in (Kind.TOPIC, Kind.UNDER) and self.name.matches(target.name)
        if self.kind is Kind.GROUP:
            return kind is Kind.GROUP and self.name.matches(target.name)
        if kind is Kind.LITE:
            return target.parent == self.parent and self.name.matches(target.name)
        # Rights on some lite topics of a parent admit its route; a deny of some of them does not refuse it.
        return allow and kind is Kind.UNDER and target.name == self.parent


def _matcher_of(resource: str) -> tuple[_Matcher, ...]:
    text = resource.strip()
    if len(text) > MAX_RESOURCE_CHARS:
        raise errors.InvalidArgument(f"resource longer than {MAX_RESOURCE_CHARS} characters", kind="acl")
    if text == "*":
        return (_Matcher(Kind.TOPIC, _name_of("*", "name")), _Matcher(Kind.GROUP, _name_of("*", "name")))
    kind_text, sep, rest = text.partition(":")
    kinds = {k.value.lower(): k for k in (Kind.TOPIC, Kind.GROUP, Kind.LITE)}
    kind = kinds.get(kind_text.lower())
    if not sep or kind is None:
        raise errors.InvalidArgument(
            f"resource {resource!r} must be Topic:<name>, Group:<name>, Lite:<parent>/<name> or *", kind="acl"
        )
    if kind is not Kind.LITE:
        return (_Matcher(kind, _name_of(rest, "name")),)
    parent, slash, name = rest.partition("/")
    if not slash or not parent or "*" in parent or "?" in parent:
        raise errors.InvalidArgument(
            f"resource {resource!r} must be Lite:<parent>/<name> (a literal parent)", kind="acl"
        )
    return (_Matcher(Kind.LITE, _name_of(name, "lite topic"), parent),)


# --- compiled rules -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Rule:
    allow: bool
    actions: frozenset[Action]
    matcher: _Matcher
    networks: tuple[IpNetwork, ...]

    def applies(self, action: Action, target: Target, source: IpAddress | None) -> bool:
        if action not in self.actions or not self.matcher.matches(target, allow=self.allow):
            return False
        return not self.networks or (source is not None and any(source in net for net in self.networks))


@dataclass(frozen=True, slots=True)
class Subject:
    """One user's compiled rights."""

    user: User
    rules: tuple[_Rule, ...]
    by_source: bool  # some rule names source networks: the decision depends on the caller's address

    def allows(self, action: Action, target: Target, source: IpAddress | None = None) -> bool:
        if not self.user.enabled:
            return False
        if self.user.super_user:
            return True
        if target.kind is Kind.GROUP and target.name.startswith(SESSION_GROUP_PREFIX):
            return False  # an MQTT session's (or share's) group is the broker's own: no rule gives it
        allowed = False
        for rule in self.rules:
            if rule.applies(action, target, source):
                if not rule.allow:
                    return False  # deny wins
                allowed = True
        return allowed


@dataclass(frozen=True, slots=True)
class Rules:
    """Every user's compiled rights: what a decision reads. Built again from scratch on every change."""

    subjects: Mapping[str, Subject] = field(default_factory=dict)

    def subject(self, name: str) -> Subject | None:
        return self.subjects.get(name)

    def secret_of(self, name: str) -> str | None:
        """The secret of the enabled user ``name``, for checking a signature or an MQTT password."""
        found = self.subjects.get(name)
        return found.user.secret if found is not None and found.user.enabled else None


def compile_rules(users: Iterable[User], entries: Iterable[Entry]) -> Rules:
    by_user: dict[str, list[_Rule]] = {}
    for entry in entries:
        networks = tuple(_network(s) for s in entry.sources)
        for matcher in _matcher_of(entry.resource):
            rule = _Rule(entry.decision is Decision.ALLOW, frozenset(entry.actions), matcher, networks)
            by_user.setdefault(entry.user, []).append(rule)
    subjects = {}
    for user in users:
        rules = by_user.get(user.name, [])
        rules.sort(key=lambda r: r.allow)  # denies first: a refusal stops the scan early
        subjects[user.name] = Subject(user, tuple(rules), any(r.networks for r in rules))
    return Rules(subjects)


def source_of(peer: str) -> IpAddress | None:
    """The caller's address from gRPC's ``context.peer()`` (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``) or an MQTT
    socket's host; None when it is neither (a Unix socket)."""
    text = peer.replace("%5B", "[").replace("%5D", "]")
    if text.startswith(("ipv4:", "ipv6:")):
        text = text[5:]
        if text.startswith("["):
            text = text[1 : text.find("]")]
        elif text.count(":") == 1:
            text = text.rpartition(":")[0]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None
