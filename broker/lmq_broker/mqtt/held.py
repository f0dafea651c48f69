"""The subscriptions an MQTT session holds, per parent: ``parent -> lite filter -> options``.

Every MQTT filter has one subscription that stands for it (``topics.filter_in`` gives the filter back): in the
default parent, or in its named parent for a filter without wildcards whose topic is always kept there; and
one in each other parent it can match (``topics.Space.subscriptions_of``). A filter whose first level is ``+``
or ``#`` reaches into every named parent; what it makes there is marked ``EXPANDED`` (an options bit above
MQTT's), since the same lite filter may also be asked for by name (``+/x`` and ``chat/x`` both hold ``("x",)``
in ``chat``): ending one of the two must leave the other. Expansions are not saved; they are derived again on
restore, from the named parents that exist by then.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, NamedTuple

from lmq_broker.dispatch import wildcards
from lmq_broker.mqtt import topics

EXPANDED: Final = 1 << 40  # made by a first-level wildcard, not asked for by name (above ``identifiers``' bits)
Subs = dict[str, dict[wildcards.Filter, int]]
_WILD: Final = (wildcards.ONE_LEVEL, wildcards.ANY_LEVELS)


class Made(NamedTuple):
    parent: str
    filter: wildcards.Filter
    existed: bool


def count(subs: Subs, default: str) -> int:
    """MQTT filters held."""
    return len(texts(subs, default))


def holds(subs: Subs, wanted: Sequence[topics.Subscription]) -> bool:
    """Is this MQTT filter held (its own subscription; not one a wildcard filter made)."""
    options = subs.get(wanted[0].parent, {}).get(wanted[0].filter)
    return options is not None and not options & EXPANDED


def add(subs: Subs, wanted: Sequence[topics.Subscription], options: int) -> list[Made]:
    """Hold the subscriptions of one MQTT filter (``Space.subscriptions_of``) with ``options``."""
    wild = wanted[0].filter[0] in _WILD
    made = []
    for i, (parent, levels) in enumerate(wanted):
        held = subs.setdefault(parent, {})
        now = held.get(levels)
        if i and wild:
            if now is None or now & EXPANDED:
                held[levels] = options | EXPANDED
        else:
            held[levels] = options
        made.append(Made(parent, levels, now is not None))
    return made


def remove(subs: Subs, space: topics.Space, wanted: Sequence[topics.Subscription]) -> dict[str, list[wildcards.Filter]]:
    """End one MQTT filter; what ended per parent (empty: the filter was not held)."""
    if not holds(subs, wanted):
        return {}
    wild = wanted[0].filter[0] in _WILD
    ended: dict[str, list[wildcards.Filter]] = {}
    for i, (parent, levels) in enumerate(wanted):
        now = subs.get(parent, {}).get(levels)
        if now is None or (i and wild != bool(now & EXPANDED)):
            continue  # another filter's: asked for by name, or (ending one by name) made by a wildcard
        del subs[parent][levels]
        ended.setdefault(parent, []).append(levels)
    for parent, levels in expand(subs, space):  # another wildcard filter still wants it
        if levels in ended.get(parent, ()):
            ended[parent].remove(levels)
    return {parent: filters for parent, filters in ended.items() if filters}


def expand(subs: Subs, space: topics.Space, *, named_first: bool = False) -> list[topics.Subscription]:
    """The named parents' subscriptions of the first-level wildcard filters held (``EXPANDED``), made where
    missing; ``named_first``: also that of a filter held in the default parent that names a parent at its first
    level with a wildcard after it (``chat/#`` made before ``chat`` existed: its own, as ``add`` makes it). A
    filter without wildcards keeps to the default parent until it is made again. The caller checks access."""
    made = []
    for levels, options in list(subs.get(space.default, {}).items()):
        wild = levels[0] in _WILD
        if not wild and not (named_first and any(level in _WILD for level in levels[1:])):
            continue
        for parent, named in space.subscriptions_of(topics.filter_in(space.default, space.default, levels))[1:]:
            held = subs.setdefault(parent, {})
            now = held.get(named)
            if now is None or (not wild and now & EXPANDED):
                held[named] = options | EXPANDED if wild else options
                made.append(topics.Subscription(parent, named))
    return made


def reaches(subs: Subs, default: str) -> tuple[bool, frozenset[str]]:
    """Which parents created later the filters held in the default parent would reach into: all (a first-level
    wildcard filter), and those named by a literal first level with a wildcard after it (``following``)."""
    wild, firsts = False, set()
    for levels in subs.get(default, {}):
        if levels[0] in _WILD:
            wild = True
        elif any(level in _WILD for level in levels[1:]):
            firsts.add(topics.unescape_level(levels[0]))
    return wild, frozenset(firsts)


def texts(subs: Subs, default: str) -> dict[str, int]:
    """The MQTT filters held, as a session is saved: text -> options (``chat/#`` holds a subscription in the
    default parent and one in ``chat``: one text)."""
    return {topics.filter_in(default, p, f): o for p, held in subs.items() for f, o in held.items() if not o & EXPANDED}
