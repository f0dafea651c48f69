"""How MQTT topic names and filters map onto parent topics and lite topics (docs/mqtt.md "Topic mapping").

Two ways, so that RocketMQ clients and any MQTT application share one store:

* *Named*: when the first level names an existing LITE parent and the rest is 1-64 characters of
  ``[A-Za-z0-9-]`` and ``/``, the rest with ``/`` written as ``_`` is the lite topic: ``chat/room-1/alice``
  is lite topic ``room-1_alice`` of parent ``chat``, and a RocketMQ producer's ``session_1`` there reaches
  MQTT subscribers as ``chat/session/1`` (a bijection between lite names and those topics).
* *Default*: every other topic (``TopicA``, ``/TopicA``, ``sensors/room1/temp`` without a ``sensors`` parent,
  ``chat/a b``, ``$SYS/x``) lives whole in the default parent (``--mqtt-default-parent``). Each level is
  escaped on its own, so the lite name keeps MQTT's levels (``_`` between them) and the dispatcher's filter
  trie matches it: ``[A-Za-z0-9]`` stays, every other UTF-8 byte becomes ``-XX`` (upper-case hex), ``-``
  and ``_`` included. Lite names hold 1-64 bytes of ``[A-Za-z0-9_-]`` (``model.is_valid_lite_topic``, the
  official clients' rule), so an escaped name over ``--max-lite-topic-size`` becomes ``-H`` and 32 hex
  digits of the topic's SHA-256 instead (``-H`` never starts an escaped name: ``-`` there is always followed by
  two upper-case hex digits), and each of its messages carries the whole topic (``mapping.TOPIC``), which is
  what a subscriber is sent. A hashed name matches no level filter, so a session holding filters in the
  default parent also takes ``HASHED`` there, and each delivery is matched against its real topic (``takes``).

A topic therefore has exactly one lite topic, and every lite topic made from one gives it back (the MQTT side
is canonical; a lite name a RocketMQ producer made up in the default parent is read back leniently, a ``-``
without two hex digits standing for itself). A filter maps to one subscription per parent it can match
(``Space.subscriptions_of``): a first level ``+`` or ``#`` in the default parent and in every named parent.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final, NamedTuple

from lmq_broker import model
from lmq_broker.dispatch import metadata, wildcards

LEVEL_SEPARATOR: Final = "/"
ESCAPE: Final = "-"
HASH_MARK: Final = "-H"  # starts a hashed name (never an escaped one)
HASH_HEX_DIGITS: Final = 32  # 128 bits of SHA-256
HASHED: Final[wildcards.Filter] = (HASH_MARK + wildcards.ANY_CHARS,)  # every hashed name of a parent
TOPIC_PROPERTY: Final = "MQTT_TOPIC"  # a hashed name's messages: the whole MQTT topic
DOLLAR_LEVEL: Final = "-24"  # an escaped first level that starts with "$"
_LEVEL_RE: Final = re.compile(r"^[A-Za-z0-9-]*$")
_TOPIC_REST_RE: Final = re.compile(r"^[A-Za-z0-9/-]+$")
_SAFE: Final = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
_ESCAPED_RE: Final = re.compile(r"-([0-9A-F]{2})")
_WILD: Final = (wildcards.ONE_LEVEL, wildcards.ANY_LEVELS)


class TopicError(ValueError):
    pass


class Topic(NamedTuple):
    parent: str
    lite: str


class Subscription(NamedTuple):
    parent: str
    filter: wildcards.Filter


# --- escaping (the default parent) -------------------------------------------------------------------------------
def escape_level(level: str) -> str:
    """One MQTT level -> ``[A-Za-z0-9-]*`` (``-XX`` per UTF-8 byte outside ``[A-Za-z0-9]``)."""
    if level.isascii() and level.isalnum():
        return level
    return "".join(chr(b) if b in _SAFE else f"-{b:02X}" for b in level.encode())


def unescape_level(level: str) -> str:
    """The inverse of ``escape_level``; a ``-`` not followed by two upper-case hex digits stands for itself."""
    if ESCAPE not in level:
        return level
    raw = bytearray()
    i = 0
    while i < len(level):
        m = _ESCAPED_RE.match(level, i)
        if m is not None:
            raw.append(int(m.group(1), 16))
            i += 3
        else:
            raw += level[i].encode()
            i += 1
    return raw.decode("utf-8", errors="replace")


def escape(topic: str) -> str:
    return wildcards.LEVEL_SEPARATOR.join(escape_level(level) for level in topic.split(LEVEL_SEPARATOR))


def unescape(lite: str) -> str:
    return LEVEL_SEPARATOR.join(unescape_level(level) for level in lite.split(wildcards.LEVEL_SEPARATOR))


def hashed(topic: str) -> str:
    return HASH_MARK + hashlib.sha256(topic.encode()).hexdigest()[:HASH_HEX_DIGITS]


def is_hashed(lite: str) -> bool:
    return lite.startswith(HASH_MARK)


def default_lite(topic: str, max_lite_bytes: int = model.MAX_LITE_TOPIC_BYTES) -> str:
    """The lite name of ``topic`` in the default parent: escaped, or hashed when that is too long."""
    lite = escape(topic)
    if len(lite) <= max_lite_bytes:
        return lite
    if len(HASH_MARK) + HASH_HEX_DIGITS > max_lite_bytes:
        raise TopicError(f"topic {topic[:160]!r}: over --max-lite-topic-size={max_lite_bytes} escaped")
    return hashed(topic)


# --- the named way ----------------------------------------------------------------------------------------------
def lite_of(topic: str, max_lite_bytes: int = model.MAX_LITE_TOPIC_BYTES) -> Topic:
    """``parent/a/b`` -> (``parent``, ``a_b``) the named way; TopicError when it has no lite topic there."""
    parent, sep, rest = topic.partition(LEVEL_SEPARATOR)
    if not sep or not rest:
        raise TopicError(f"topic {topic[:160]!r} names no lite topic: publish to <parent>/<lite topic>")
    if not model.is_valid_resource_name(parent):
        raise TopicError(f"topic {topic[:160]!r}: {parent[:160]!r} is not a valid parent topic name")
    if len(rest) > max_lite_bytes or not _TOPIC_REST_RE.match(rest):
        raise TopicError(
            f"topic {topic[:160]!r}: after the parent, 1..{max_lite_bytes} characters of [A-Za-z0-9-] and '/'"
        )
    return Topic(parent, rest.replace(LEVEL_SEPARATOR, wildcards.LEVEL_SEPARATOR))


def topic_of(parent: str, lite: str) -> str:
    """The MQTT topic of lite topic ``lite`` of a named ``parent`` (every valid lite name has one)."""
    return parent + LEVEL_SEPARATOR + lite.replace(wildcards.LEVEL_SEPARATOR, LEVEL_SEPARATOR)


def subscription_of(topic_filter: str) -> Subscription:
    """``parent/a/+/#`` -> (``parent``, ``("a", "+", "#")``) the named way; TopicError when not one."""
    levels = check_filter(topic_filter)
    parent, rest = levels[0], levels[1:]
    if parent in _WILD or not model.is_valid_resource_name(parent):
        raise TopicError(f"filter {topic_filter[:160]!r}: the first level must name a parent topic")
    if not rest:
        raise TopicError(f"filter {topic_filter[:160]!r} names no lite topic (subscribe to {parent}/# for all)")
    if not all(level in _WILD or _LEVEL_RE.match(level) for level in rest):
        raise TopicError(f"filter {topic_filter[:160]!r}: levels hold [A-Za-z0-9-], or are '+' or '#'")
    return Subscription(parent, rest)


def check_filter(topic_filter: str) -> wildcards.Filter:
    """The levels of a valid MQTT topic filter (sections 4.7.1, 4.7.3); TopicError when it is not one."""
    if not topic_filter:
        raise TopicError("an empty topic filter")  # MQTT-4.7.3-1
    levels = tuple(topic_filter.split(LEVEL_SEPARATOR))
    for i, level in enumerate(levels):
        if level == wildcards.ANY_LEVELS and i != len(levels) - 1:
            raise TopicError(f"filter {topic_filter[:160]!r}: '#' must be the last level")  # MQTT-4.7.1-2
        if level not in _WILD and ("+" in level or "#" in level):
            raise TopicError(f"filter {topic_filter[:160]!r}: '+' and '#' fill a whole level")  # MQTT-4.7.1-3
    return levels


def filter_text(parent: str, levels: wildcards.Filter) -> str:
    return LEVEL_SEPARATOR.join((parent, *levels))


# --- both ways --------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Space:
    """The MQTT topic space of a broker: its default parent and its named (LITE) parents."""

    default: str
    parents: frozenset[str]
    max_lite_bytes: int = model.MAX_LITE_TOPIC_BYTES

    def lite_of(self, topic: str) -> Topic:
        first, _, rest = topic.partition(LEVEL_SEPARATOR)
        if (
            first != self.default
            and first in self.parents
            and rest
            and len(rest) <= self.max_lite_bytes
            and _TOPIC_REST_RE.match(rest)
        ):
            return Topic(first, rest.replace(LEVEL_SEPARATOR, wildcards.LEVEL_SEPARATOR))
        if not topic:
            raise TopicError("an empty topic name")  # MQTT-4.7.3-1
        return Topic(self.default, default_lite(topic, self.max_lite_bytes))

    def topic_of(self, parent: str, lite: str, properties: Mapping[str, str] | None = None) -> str:
        return topic_in(self.default, parent, lite, properties)

    def subscriptions_of(self, topic_filter: str) -> list[Subscription]:
        """One subscription per parent ``topic_filter`` can match, the default parent's first; a filter of a
        named parent without wildcards whose topic is always kept there (``chat/room-1``) has that one only."""
        levels = check_filter(topic_filter)
        first, rest = levels[0], levels[1:]
        if first != self.default and first in self.parents and not set(rest) & set(_WILD):
            try:
                if self.lite_of(topic_filter).parent == first:
                    return [Subscription(first, rest)]
            except TopicError:
                pass
        out = [Subscription(self.default, tuple(lv if lv in _WILD else escape_level(lv) for lv in levels))]
        if first == wildcards.ANY_LEVELS:
            rest = wildcards.WHOLE_PARENT  # every topic of a named parent has a level after the parent's
        named = rest and all(level in _WILD or _LEVEL_RE.match(level) for level in rest)
        if not named:
            return out
        if first in _WILD:
            out += [Subscription(p, rest) for p in sorted(self.parents) if p != self.default]
        elif first != self.default and first in self.parents:
            out.append(Subscription(first, rest))
        return out


_last: list[tuple[metadata.Metadata, Space]] = []  # the space of the newest metadata seen (one entry)


def space_of(meta: metadata.Metadata) -> Space:
    """The topic space of ``meta`` (computed once per metadata copy: a new copy comes with every change)."""
    if _last and _last[0][0] is meta:
        return _last[0][1]
    lite = model.MessageType.LITE
    named = frozenset(name for name, p in meta.parents.items() if p.message_type == lite)
    space = Space(meta.config.mqtt_default_parent, named, meta.config.max_lite_topic_size)
    _last[:] = [(meta, space)]
    return space


def topic_in(default: str, parent: str, lite: str, properties: Mapping[str, str] | None = None) -> str:
    """The MQTT topic of lite topic ``lite`` of ``parent``, ``default`` being the default parent."""
    if parent != default:
        return topic_of(parent, lite)
    if is_hashed(lite) and properties is not None:
        whole = properties.get(TOPIC_PROPERTY)
        if whole:
            return whole
    return unescape(lite)


def filter_in(default: str, parent: str, levels: wildcards.Filter) -> str:
    """The MQTT filter a subscription (``parent``, ``levels``) stands for (within that parent)."""
    if parent != default:
        return filter_text(parent, levels)
    return LEVEL_SEPARATOR.join(lv if lv in _WILD else unescape_level(lv) for lv in levels)


def matches(topic_filter: str, topic: str) -> bool:
    """MQTT matching (section 4.7): ``+`` one level, a last ``#`` the rest (and the parent level), and a
    first-level wildcard never matches a topic starting with ``$`` (MQTT-4.7.2-1)."""
    f, t = topic_filter.split(LEVEL_SEPARATOR), topic.split(LEVEL_SEPARATOR)
    if f[0] in _WILD and t[0].startswith("$"):
        return False
    return wildcards.matches(tuple(f), t)


def takes(default: str, parent: str, levels: wildcards.Filter, lite: str, properties: Mapping[str, str]) -> bool:
    """Does subscription (``parent``, ``levels``) take lite topic ``lite`` (a message with ``properties``)."""
    if parent != default:
        return wildcards.matches(levels, lite.split(wildcards.LEVEL_SEPARATOR))
    if is_hashed(lite):
        return matches(filter_in(default, parent, levels), topic_in(default, parent, lite, properties))
    split = lite.split(wildcards.LEVEL_SEPARATOR)
    if levels[0] in _WILD and split[0].startswith(DOLLAR_LEVEL):
        return False  # MQTT-4.7.2-1
    return wildcards.matches(levels, split)


def registered(default: str, parent: str, filters: Iterable[wildcards.Filter]) -> list[wildcards.Filter]:
    """What the dispatcher is given for a session's ``filters`` in ``parent``: in the default parent, plus
    ``HASHED`` (hashed names match no level filter: ``takes`` decides per delivery)."""
    out = list(filters)
    if parent == default and out:
        out.append(HASHED)
    return out
