"""Clients that take lite topics by pattern rather than one by one: wildcard lite groups, topic filters and
name patterns.

RocketMQ 5.5.0's ``lite.sub.wildcard``: a client of a wildcard group registers with COMPLETE_ADD (the set it
sends is ignored; the clients' ``subscribe_lite_all()``), holds no per-topic subscriptions and counts against
no subscription quota; it receives every lite topic of its parent. Topic filters generalise that (MQTT
subscriptions, docs/mqtt.md; RocketMQ clients' patterns, docs/protocol.md): a lite name is split into levels
at ``_`` and a filter is a tuple of levels where ``+`` matches one level and a last ``#`` any remainder, none
included (``("a", "#")`` matches ``a`` and ``a_b_c``); a whole-parent registration is the filter ``("#",)``.
A *prefix filter* is one element ending in ``*``: ``("session-*",)`` matches every name that starts with
``session-``, levels and all (names never hold ``*``, so it cannot be mistaken for a level).

Arrivals are matched, never scanned for: while any registration exists, each arrived LMQ costs one dict
lookup for its parent and, where the parent has filters, one walk down that parent's filter trie (one branch
per level, plus the ``+`` and ``#`` branches) and one dict lookup per distinct prefix length registered in the
parent (at most 65: names are at most 64 bytes): the cost grows with the filters that match, not with the
registered filters, clients or lite topics. A registering client's backlog is found by the dispatcher's paged
catch-up, off the loop, over the key range its filters can match (``scan_range``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Final

from lmq_broker import model
from lmq_broker.dispatch import level_index

LEVEL_SEPARATOR: Final = "_"  # in lite names; MQTT's "/" (docs/mqtt.md)
ONE_LEVEL: Final = "+"
ANY_LEVELS: Final = "#"
ANY_CHARS: Final = "*"  # ends a prefix filter
WHOLE_PARENT: Final = (ANY_LEVELS,)
PATTERN_CHARS: Final = frozenset("*+#/")  # never in a lite name: a name holding one is a pattern
_PATTERN_LEVEL_RE: Final = re.compile(r"^[A-Za-z0-9-]*$")
_PATTERN_PREFIX_RE: Final = re.compile(r"^[A-Za-z0-9_/-]*$")
_PATTERN_LEVELS_RE: Final = re.compile(r"[/_]")
_PAST_NAMES: Final = "\x7f"  # sorts after every character a lite name may hold ([A-Za-z0-9_-])

Filter = tuple[str, ...]
Members = dict[str, set[str]]  # group -> client ids


class _Node:
    __slots__ = ("any", "children", "here", "one")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.one: _Node | None = None  # the "+" branch
        self.here: Members = {}  # filters ending at this node
        self.any: Members = {}  # filters ending with "#" after this node

    def empty(self) -> bool:
        return not (self.children or self.one or self.here or self.any)


class _Prefixes:
    """The prefix filters of one parent: members by prefix, and how many prefixes there are of each length."""

    __slots__ = ("by_prefix", "lengths")

    def __init__(self) -> None:
        self.by_prefix: dict[str, Members] = {}
        self.lengths: dict[int, int] = {}

    def add(self, prefix: str, group: str, client_id: str) -> None:
        members = self.by_prefix.get(prefix)
        if members is None:
            members = self.by_prefix[prefix] = {}
            self.lengths[len(prefix)] = self.lengths.get(len(prefix), 0) + 1
        members.setdefault(group, set()).add(client_id)

    def discard(self, prefix: str, group: str, client_id: str) -> None:
        members = self.by_prefix.get(prefix)
        if members is None:
            return
        _discard(members, group, client_id)
        if not members:
            del self.by_prefix[prefix]
            left = self.lengths[len(prefix)] - 1
            if left:
                self.lengths[len(prefix)] = left
            else:
                del self.lengths[len(prefix)]

    def match(self, lite: str, found: Members) -> None:
        for length in self.lengths:
            if length <= len(lite):
                members = self.by_prefix.get(lite[:length])
                if members is not None:
                    _merge(found, members)


class Wildcards:
    def __init__(self) -> None:
        self._by_parent: dict[str, Members] = {}  # whole-parent registrations: parent -> group -> clients
        self._tries: dict[str, _Node] = {}  # parent -> filter trie of the other registrations
        self._prefixes: dict[str, _Prefixes] = {}  # parent -> its prefix filters
        self._of_client: dict[str, tuple[str, str]] = {}  # client id -> (parent, group)
        self._filters: dict[str, frozenset[Filter]] = {}  # client id -> its filters (absent: whole parent)
        self.indexes: dict[str, level_index.LevelIndex] = {}  # parent -> its lite names by level, once needed

    def __bool__(self) -> bool:
        return bool(self._of_client)

    def add(self, client_id: str, group: str, parent: str, filters: Iterable[Filter] | None = None) -> bool:
        """Register (replacing any earlier registration of the client); ``filters`` None is the whole parent.
        True when this changed what the client takes."""
        wanted = None if filters is None else frozenset(filters)
        if wanted is not None and WHOLE_PARENT in wanted:
            wanted = None
        if self._of_client.get(client_id) == (parent, group) and self._filters.get(client_id) == wanted:
            return False
        self.remove(client_id)
        self._of_client[client_id] = (parent, group)
        if wanted is None:
            self._by_parent.setdefault(parent, {}).setdefault(group, set()).add(client_id)
            return True
        self._filters[client_id] = wanted
        for levels in wanted:
            prefix = prefix_of(levels)
            if prefix is not None:
                self._prefixes.setdefault(parent, _Prefixes()).add(prefix, group, client_id)
                continue
            node = self._tries.setdefault(parent, _Node())
            for level in levels[:-1] if levels[-1] == ANY_LEVELS else levels:
                if level == ONE_LEVEL:
                    node.one = node.one or _Node()
                    node = node.one
                else:
                    node = node.children.setdefault(level, _Node())
            (node.any if levels[-1] == ANY_LEVELS else node.here).setdefault(group, set()).add(client_id)
        return True

    def remove(self, client_id: str) -> tuple[str, str] | None:
        where = self._of_client.pop(client_id, None)
        if where is None:
            return None
        parent, group = where
        filters = self._filters.pop(client_id, None)
        if filters is None:
            _discard(self._by_parent[parent], group, client_id)
            if not self._by_parent[parent]:
                del self._by_parent[parent]
            return where
        root, prefixes = self._tries.get(parent), self._prefixes.get(parent)
        for levels in filters:
            prefix = prefix_of(levels)
            if prefix is None and root is not None:
                _unregister(root, levels, group, client_id)
            elif prefix is not None and prefixes is not None:
                prefixes.discard(prefix, group, client_id)
        if root is not None and root.empty():
            del self._tries[parent]
        if prefixes is not None and not prefixes.by_prefix:
            del self._prefixes[parent]
        return where

    def index_arrived(self, lmqs: Iterable[str]) -> None:
        """Lite topics written to: their names join their parent's level index, where it has one."""
        for lmq in lmqs:
            if lmq.startswith(model.LMQ_PREFIX):
                _, parent, lite = lmq.split(model.LMQ_SEPARATOR, 2)
                index = self.indexes.get(parent)
                if index is not None:
                    index.add(lite)

    def index_forget(self, lmq: str) -> None:
        """A reclaimed lite topic leaves its parent's level index."""
        if self.indexes and lmq.startswith(model.LMQ_PREFIX):
            _, parent, lite = lmq.split(model.LMQ_SEPARATOR, 2)
            index = self.indexes.get(parent)
            if index is not None:
                index.discard(lite)

    def registration(self, client_id: str) -> tuple[str, str] | None:
        """(parent, group) of a registered client, or None."""
        return self._of_client.get(client_id)

    def filters(self, client_id: str) -> frozenset[Filter] | None:
        """The client's filters; None for a whole-parent registration (or none at all)."""
        return self._filters.get(client_id)

    def groups_of_lmq(self, lmq: str) -> Mapping[str, set[str]]:
        """Groups (and their registered clients) that take the LMQ ``lmq``."""
        if not self._of_client or not lmq.startswith(model.LMQ_PREFIX):
            return {}
        _, parent, lite = lmq.split(model.LMQ_SEPARATOR, 2)
        whole = self._by_parent.get(parent, {})
        root, prefixes = self._tries.get(parent), self._prefixes.get(parent)
        if root is None and prefixes is None:
            return whole
        found: Members = {group: set(clients) for group, clients in whole.items()}
        if root is not None:
            _match(root, lite.split(LEVEL_SEPARATOR), 0, found)
        if prefixes is not None:
            prefixes.match(lite, found)
        return found

    def holds(self, client_id: str, lmq: str) -> bool:
        where = self._of_client.get(client_id)
        if where is None or not lmq.startswith(model.LMQ_PREFIX):
            return False
        _, parent, lite = lmq.split(model.LMQ_SEPARATOR, 2)
        return parent == where[0] and self.takes(client_id, lite)

    def takes(self, client_id: str, lite: str) -> bool:
        """Does the registered client take lite topic ``lite`` of its parent."""
        filters = self._filters.get(client_id)
        if filters is None:
            return client_id in self._of_client
        levels = lite.split(LEVEL_SEPARATOR)
        return any(matches(f, levels) for f in filters)

    def scan_ranges(self, client_id: str) -> list[tuple[str, str]]:
        """Ranges of lite names of the parent (``scan_ranges``) holding every name the client can take: a
        catch-up pass pages through those only."""
        filters = self._filters.get(client_id)
        return scan_ranges(filters) if filters is not None else [("", "")]


def scan_ranges(filters: Iterable[Filter]) -> list[tuple[str, str]]:
    """Sorted, disjoint (start after, end before) ranges of lite names ("": an open end) holding every name
    one of ``filters`` can match: one per literal prefix not covered by a shorter one."""
    prefixes = sorted({_literal_prefix(f) for f in filters})
    if not prefixes or not prefixes[0]:
        return [("", "")]
    kept: list[str] = []
    for prefix in prefixes:  # sorted: a prefix that covers this one came just before it among the kept ones
        if not kept or not prefix.startswith(kept[-1]):
            kept.append(prefix)
    # every name that starts with a prefix sorts after _just_before(prefix) and before prefix + _PAST_NAMES
    return [(_just_before(prefix), prefix + _PAST_NAMES) for prefix in kept]


def scan_range(filters: Iterable[Filter]) -> tuple[str, str]:
    """(start after, end before) in lite names covering every name one of ``filters`` can match ("": open)."""
    ranges = scan_ranges(filters)
    return ranges[0][0], ranges[-1][1]


def _literal_prefix(f: Filter) -> str:
    prefix = prefix_of(f)
    if prefix is not None:
        return prefix
    literal = []
    for level in f:
        if level in (ONE_LEVEL, ANY_LEVELS):
            break
        literal.append(level)
    return LEVEL_SEPARATOR.join(literal)


def is_pattern(name: str) -> bool:
    return not PATTERN_CHARS.isdisjoint(name)


def parse_pattern(text: str) -> Filter:
    """A RocketMQ client's pattern -> its filter; ValueError saying what is wrong. ``session-*``: the names
    that start with ``session-``; ``a/+/c``, ``a/#``: MQTT filters over the levels of a name, separated by
    ``/`` or ``_`` alike (``a_+`` is ``a/+``); ``#`` and ``*``: every lite topic of the parent."""
    if ANY_CHARS in text[:-1]:
        raise ValueError("'*' may only end a pattern (use '+' for one level)")
    if text.endswith(ANY_CHARS):
        prefix = text[:-1]
        if not _PATTERN_PREFIX_RE.match(prefix):
            raise ValueError("a pattern ending in '*' holds characters of [A-Za-z0-9_/-] before it")
        return (prefix.replace("/", LEVEL_SEPARATOR) + ANY_CHARS,) if prefix else WHOLE_PARENT
    levels = tuple(_PATTERN_LEVELS_RE.split(text))
    for i, level in enumerate(levels):
        if level == ANY_LEVELS and i != len(levels) - 1:
            raise ValueError("'#' must be the last level")
        if level not in (ONE_LEVEL, ANY_LEVELS) and not _PATTERN_LEVEL_RE.match(level):
            raise ValueError("levels (between '/' or '_') hold [A-Za-z0-9-], or are '+' or '#'")
    return levels


def prefix_of(f: Filter) -> str | None:
    """The prefix of a prefix filter (``("session-*",)`` -> ``session-``); None for a level filter."""
    return f[0][:-1] if len(f) == 1 and f[0].endswith(ANY_CHARS) else None


def matches(f: Filter, levels: list[str]) -> bool:
    prefix = prefix_of(f)
    if prefix is not None:
        return LEVEL_SEPARATOR.join(levels).startswith(prefix)
    for i, level in enumerate(f):
        if level == ANY_LEVELS:
            return True
        if i >= len(levels) or (level != ONE_LEVEL and level != levels[i]):
            return False
    return len(f) == len(levels)


def _match(node: _Node, levels: list[str], i: int, found: Members) -> None:
    if node.any:
        _merge(found, node.any)
    if i == len(levels):
        if node.here:
            _merge(found, node.here)
        return
    child = node.children.get(levels[i])
    if child is not None:
        _match(child, levels, i + 1, found)
    if node.one is not None:
        _match(node.one, levels, i + 1, found)


def _merge(into: Members, members: Members) -> None:
    for group, clients in members.items():
        into.setdefault(group, set()).update(clients)


def _discard(members: Members, group: str, client_id: str) -> None:
    clients = members.get(group)
    if clients is not None:
        clients.discard(client_id)
        if not clients:
            del members[group]


def _unregister(root: _Node, levels: Filter, group: str, client_id: str) -> None:
    path = [root]
    steps = levels[:-1] if levels[-1] == ANY_LEVELS else levels
    for level in steps:
        node = path[-1].one if level == ONE_LEVEL else path[-1].children.get(level)
        if node is None:
            return
        path.append(node)
    _discard(path[-1].any if levels[-1] == ANY_LEVELS else path[-1].here, group, client_id)
    for depth in range(len(path) - 1, 0, -1):  # prune the branch back to the first node still in use
        if not path[depth].empty():
            break
        parent, level = path[depth - 1], steps[depth - 1]
        if level == ONE_LEVEL:
            parent.one = None
        else:
            del parent.children[level]


def _just_before(name: str) -> str:
    """A bound that sorts before ``name`` and after every lite name smaller than it (scan starts are exclusive)."""
    return name[:-1] + chr(ord(name[-1]) - 1) + _PAST_NAMES


def parent_of(lmq: str) -> str:
    """``%LMQ%$parent$lite`` -> ``parent`` (names never contain ``$``)."""
    return lmq.split(model.LMQ_SEPARATOR, 2)[1]
