"""Subscription identifiers (MQTT 5.0 sections 3.8.2.1.2 and 3.3.2.3.8).

A SUBSCRIBE may carry one identifier (1 to 268,435,455); it belongs to every subscription that SUBSCRIBE made
or replaced, and each PUBLISH the broker sends carries the identifiers of the subscriptions it matched (one
property each; none for those without). The identifier is kept in the bits above a subscription's options
byte (``OPTIONS_BITS``), so it lives wherever the options do: in the session's filters in memory and in
``mqtt.sqlite3`` (a persistent session gets it back at its next connect). A SUBSCRIBE without one replaces
the subscription with one without (MQTT-3.8.4-3: the new subscription replaces the old one whole).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

OPTIONS_BITS: Final = 8
OPTIONS_MASK: Final = (1 << OPTIONS_BITS) - 1
MAX_ID: Final = 268_435_455  # the largest Variable Byte Integer


def with_id(options: int, subscription_id: int) -> int:
    """``options`` (the options byte) carrying ``subscription_id`` (0: none)."""
    return (options & OPTIONS_MASK) | (subscription_id << OPTIONS_BITS)


def id_of(options: int) -> int:
    return (options >> OPTIONS_BITS) & MAX_ID  # bits above the identifier's are others' (``held.EXPANDED``)


def ids_of(matched: Iterable[int]) -> list[int]:
    """The identifiers a PUBLISH carries for the subscriptions (their options) it matched: each once, sorted."""
    return sorted({i for i in map(id_of, matched) if i})
