"""How MQTT topic names and filters map onto parent topics and lite topics.

The first level of an MQTT topic names the parent topic; the rest, with ``/`` written as ``_``, is the lite
topic: ``chat/room-1/alice`` is lite topic ``room-1_alice`` of parent ``chat``. Lite topic names are 1-64
characters of ``[A-Za-z0-9_-]`` (RocketMQ's rule, which the official clients and our gRPC edge enforce), so
``/`` cannot appear in them and an escape is needed; swapping it with ``_`` is a bijection between every
valid lite name and the MQTT topics whose levels use ``[A-Za-z0-9-]``: a message a RocketMQ producer sends to
``session_1`` reaches MQTT subscribers as ``chat/session/1``, and the reverse. The price: ``_`` and any
character outside that set cannot appear in an MQTT topic after the parent level (docs/mqtt.md).

A filter's first level must be a parent name too (no ``+``/``#`` there: a subscription lives in one parent's
keyspace); its other levels become a ``wildcards.Filter`` over lite names split at ``_``.
"""

from __future__ import annotations

import re
from typing import Final, NamedTuple

from lmq_broker import model
from lmq_broker.dispatch import wildcards

LEVEL_SEPARATOR: Final = "/"
_LEVEL_RE: Final = re.compile(r"^[A-Za-z0-9-]*$")
_TOPIC_REST_RE: Final = re.compile(r"^[A-Za-z0-9/-]+$")


class TopicError(ValueError):
    pass


class Topic(NamedTuple):
    parent: str
    lite: str


def lite_of(topic: str, max_lite_bytes: int = model.MAX_LITE_TOPIC_BYTES) -> Topic:
    """``parent/a/b`` -> (``parent``, ``a_b``); TopicError when it has no lite topic there."""
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
    """The MQTT topic of lite topic ``lite`` of ``parent`` (every valid lite name has one)."""
    return parent + LEVEL_SEPARATOR + lite.replace(wildcards.LEVEL_SEPARATOR, LEVEL_SEPARATOR)


class Subscription(NamedTuple):
    parent: str
    filter: wildcards.Filter


def subscription_of(topic_filter: str) -> Subscription:
    """``parent/a/+/#`` -> (``parent``, ``("a", "+", "#")``); TopicError for what this broker cannot serve."""
    levels = topic_filter.split(LEVEL_SEPARATOR)
    parent, rest = levels[0], tuple(levels[1:])
    if parent in ("+", "#") or not model.is_valid_resource_name(parent):
        raise TopicError(f"filter {topic_filter[:160]!r}: the first level must name a parent topic")
    if not rest:
        raise TopicError(f"filter {topic_filter[:160]!r} names no lite topic (subscribe to {parent}/# for all)")
    for i, level in enumerate(rest):
        if level == wildcards.ANY_LEVELS and i != len(rest) - 1:
            raise TopicError(f"filter {topic_filter[:160]!r}: '#' must be the last level")  # MQTT-4.7.1-2
        if level not in (wildcards.ONE_LEVEL, wildcards.ANY_LEVELS) and not _LEVEL_RE.match(level):
            raise TopicError(f"filter {topic_filter[:160]!r}: levels hold [A-Za-z0-9-], or are '+' or '#'")
    return Subscription(parent, rest)


def filter_text(parent: str, levels: wildcards.Filter) -> str:
    return LEVEL_SEPARATOR.join((parent, *levels))
