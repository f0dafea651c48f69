"""The subscriptions an MQTT session holds, per parent: ``parent -> lite filter -> options``.

Every MQTT filter has one subscription that stands for it (``topics.filter_in`` gives the filter back): in the
default parent, or in its named parent for a filter without wildcards whose topic is always kept there; and
one in each other parent it can match (``topics.Space.subscriptions_of``). A filter whose first level is ``+``
or ``#`` reaches into every named parent; what it makes there is marked ``EXPANDED`` (an options bit above
MQTT's), since the same lite filter may also be asked for by name (``+/x`` and ``chat/x`` both hold ``("x",)``
in ``chat``): ending one of the two must leave the other. Expansions are not saved; they are derived again on
restore, from the named parents that exist by then.

A filter without wildcards made before its first level named a parent (``chat/x`` while no ``chat`` existed)
is held in the default parent, where its topic was kept then (``chat_x``); once ``chat`` exists its topic is kept
there (``x``), so the filter is held there too (``expand``). Both stay held: what the default parent already
keeps for the topic is still delivered, each message is kept in one of the two (never both, so never sent
twice), and nothing new comes to the default one. Ending the filter ends both (``twin``); a saved session marks
such a filter (``IN_DEFAULT``) so that a restore holds both again, even when the parent came while it was away.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final, NamedTuple

from lmq_broker.dispatch import wildcards
from lmq_broker.mqtt import topics

EXPANDED: Final = 1 << 40  # made by a first-level wildcard, not asked for by name (above ``identifiers``' bits)
IN_DEFAULT: Final = 1 << 41  # saved only: a filter without wildcards that is (also) held in the default parent
Subs = dict[str, dict[wildcards.Filter, int]]
_WILD: Final = (wildcards.ONE_LEVEL, wildcards.ANY_LEVELS)


class Made(NamedTuple):
    parent: str
    filter: wildcards.Filter
    existed: bool


def count(subs: Subs, default: str) -> int:
    """MQTT filters held."""
    return len(texts(subs, default))


def holds(subs: Subs, wanted: Sequence[topics.Subscription], default: str = "") -> bool:
    """Is this MQTT filter held (its own subscription, or its ``twin``; not one a wildcard filter made)."""
    for parent, levels in [wanted[0], *twin(wanted, default)]:
        options = subs.get(parent, {}).get(levels)
        if options is not None and not options & EXPANDED:
            return True
    return False


def twin(wanted: Sequence[topics.Subscription], default: str) -> list[topics.Subscription]:
    """A filter without wildcards kept in a named parent: its subscription in the default parent, where its topic
    was kept before that parent existed (``chat/x``: ``("chat", "x")``); none for any other filter."""
    if not default or len(wanted) != 1 or wanted[0].parent == default or _is_wild(wanted[0].filter):
        return []
    parent, levels = wanted[0]
    return [topics.Subscription(default, tuple(topics.escape_level(lv) for lv in (parent, *levels)))]


def _is_wild(levels: wildcards.Filter) -> bool:
    return any(level in _WILD for level in levels)


def add(subs: Subs, wanted: Sequence[topics.Subscription], options: int, default: str = "") -> list[Made]:
    """Hold the subscriptions of one MQTT filter (``Space.subscriptions_of``) with ``options`` (and its ``twin``
    in the ``default`` parent, if held, too)."""
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
    for parent, levels in twin(wanted, default):  # held from before its parent existed: new options there too
        if levels in subs.get(parent, {}):
            subs[parent][levels] = options
    return made


def add_saved(subs: Subs, space: topics.Space, text: str, options: int) -> None:
    """A saved filter held again (``texts``); one marked ``IN_DEFAULT`` is held in the default parent as well."""
    wanted = space.subscriptions_of(text)
    add(subs, wanted, options & ~(EXPANDED | IN_DEFAULT))
    if options & IN_DEFAULT:
        for parent, levels in twin(wanted, space.default):
            subs.setdefault(parent, {})[levels] = options & ~(EXPANDED | IN_DEFAULT)


def remove(subs: Subs, space: topics.Space, wanted: Sequence[topics.Subscription]) -> dict[str, list[wildcards.Filter]]:
    """End one MQTT filter; what ended per parent (empty: the filter was not held)."""
    if not holds(subs, wanted, space.default):
        return {}
    wild = wanted[0].filter[0] in _WILD
    ended: dict[str, list[wildcards.Filter]] = {}
    for i, (parent, levels) in enumerate([*wanted, *twin(wanted, space.default)]):
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
    level (``chat/#`` or ``chat/x`` made before ``chat`` existed: its own, as ``add`` makes it; the default
    parent's stays). The caller checks access."""
    made = []
    for levels, options in list(subs.get(space.default, {}).items()):
        wild = levels[0] in _WILD
        if not wild and not named_first:
            continue
        wanted = space.subscriptions_of(topics.filter_in(space.default, space.default, levels))
        for parent, named in (w for w in wanted if w.parent != space.default):
            held = subs.setdefault(parent, {})
            now = held.get(named)
            if now is None or (not wild and now & EXPANDED):
                held[named] = options | EXPANDED if wild else options
                made.append(topics.Subscription(parent, named))
    return made


def reaches(subs: Subs, default: str) -> tuple[bool, frozenset[str]]:
    """Which parents created later the filters held in the default parent would reach into: all (a first-level
    wildcard filter), and those named by a literal first level with more levels after it (``following``)."""
    return reach_of(subs.get(default, {}))


def reach_of(filters: Iterable[wildcards.Filter]) -> tuple[bool, frozenset[str]]:
    """``reaches`` over the default parent's ``filters`` (escaped levels)."""
    wild, firsts = False, set()
    for levels in filters:
        if levels[0] in _WILD:
            wild = True
        elif len(levels) > 1:
            firsts.add(topics.unescape_level(levels[0]))
    return wild, frozenset(firsts)


def texts(subs: Subs, default: str) -> dict[str, int]:
    """The MQTT filters held, as a session is saved: text -> options (``chat/#`` holds a subscription in the
    default parent and one in ``chat``: one text); one without wildcards held in the default parent is marked
    ``IN_DEFAULT`` (its parent may come while the session is away)."""
    out: dict[str, int] = {}
    for parent, held in subs.items():
        for levels, options in held.items():
            if options & EXPANDED:
                continue
            text = topics.filter_in(default, parent, levels)
            mark = IN_DEFAULT if parent == default and len(levels) > 1 and not _is_wild(levels) else 0
            out[text] = options | mark | (out.get(text, 0) & IN_DEFAULT)
    return out
