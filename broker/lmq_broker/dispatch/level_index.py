"""The lite names of a parent as a trie of their levels (split at ``_``): which names a set of topic filters
matches, found by walking only the branches the filters can reach, not every name of the parent.

A filter without a literal prefix (``+/x``, ``+/+/temp``: MQTT subscriptions, RocketMQ clients' patterns)
can match names anywhere in the parent, so without an index each new filter set means paging through every
lite name and testing each against each filter: one 100-filter MQTT SUBSCRIBE over 100,000 lite topics was
10 million tests on the event loop (4.5 s of CPU, gRPC sends held up to 2 s). Here ``+/x`` costs one dict
lookup per distinct first level.

An index is built for a parent the first time such a filter set needs it (paged from the store, a page per
loop step) and kept from then on: arrivals add their names (``Wildcards.arrived``), reclaims remove them. It
may hold a name a reclaim removed while it was being built (a page read before the delete): callers check
what they find against the store, as they check what a scan finds. ``matching_plain`` is the walk it replaces,
kept as its twin (tests compare both on random names and filters).

Memory: one dict per name that has longer names below it; a name with none ends as a ``None`` leaf.

Before a parent has an index, ``matching_in_order`` tries the filters on the store's key order instead: a
literal level costs nothing until the last (then a key lookup for the name, a filter's all in one multi-get),
a ``+`` lists the distinct levels at that point by skipping each one's longer names (a seek per level that has
any), so ``+/f4/r123`` over ``b<0-9>_f<0-9>_r<0-999>`` reads ~20 names and looks 10 up, not 100,000. It gives
up past a budget of names read (filters that reach most names, e.g. ``+/+/+`` or ``+/temp`` over 100,000
first levels): then the index is built.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Final

from lmq_broker.dispatch import wildcards

_TOP: Final = "\x7f"  # above every character of a lite name ([A-Za-z0-9_-])
_SEEK_COST: Final = 5  # a page read's cost in the budget of ``matching_in_order``, besides its names (~4 µs)
_FIRST_PAGE: Final = 8
_PAGE_MAX: Final = 4096
Page = Callable[[str, int], list[str]]  # (after, limit): a parent's names after ``after``, in key order
Held = Callable[[list[str]], list[bool]]  # which of these are names of the parent
_END: Final = "\x00"  # key of "a name ends here" in a node that also has children (never in a lite name)
Node = dict[str, "Node | None"]


class LevelIndex:
    __slots__ = ("_root", "size")

    def __init__(self) -> None:
        self._root: Node = {}
        self.size = 0

    def add(self, lite: str) -> None:
        head, sep, last = lite.rpartition(wildcards.LEVEL_SEPARATOR)
        self._add_at(self._node_for(head) if sep else self._root, last)

    def add_many(self, lites: Iterable[str]) -> None:
        """``add`` of each name; names that share their levels but the last (as consecutive names of a page
        in key order mostly do) find their node once. ``_add_at`` inlined: this runs once per lite topic of a
        parent when its index is built."""
        root = self._root
        node_for = self._node_for
        head_was, node = "", root
        added, level_sep, end = 0, wildcards.LEVEL_SEPARATOR, _END
        for lite in lites:
            head, sep, last = lite.rpartition(level_sep)
            if not sep:
                node = root
            elif head != head_was or node is root:
                head_was, node = head, node_for(head)
            below = node.get(last, end)  # ``end``: absent (a missing key and a None leaf differ)
            if below is end:
                node[last] = None
                added += 1
            elif isinstance(below, dict) and end not in below:
                below[end] = None
                added += 1
        self.size += added

    def _node_for(self, head: str) -> Node:
        """The node of the levels ``head`` (a name without its last level), made where missing."""
        node = self._root
        for level in head.split(wildcards.LEVEL_SEPARATOR):
            child = node.get(level, _END)  # _END: absent (a missing key and a None leaf differ)
            if child is None:  # a leaf name gets a longer one below it
                child = node[level] = {_END: None}
            elif child == _END:
                child = node[level] = {}
            assert isinstance(child, dict)
            node = child
        return node

    def _add_at(self, node: Node, last: str) -> None:
        if last not in node:
            node[last] = None
            self.size += 1
        else:
            below = node[last]
            if below is not None and _END not in below:
                below[_END] = None
                self.size += 1

    def discard(self, lite: str) -> None:
        levels = lite.split(wildcards.LEVEL_SEPARATOR)
        path: list[tuple[Node, str]] = []
        node: Node | None = self._root
        for level in levels[:-1]:
            assert node is not None
            child = node.get(level)
            if child is None:
                return
            path.append((node, level))
            node = child
        assert node is not None
        last = levels[-1]
        if last not in node:
            return
        below = node[last]
        if below is None:
            del node[last]
        elif _END in below:
            del below[_END]
        else:
            return
        self.size -= 1
        for parent, level in reversed(path):  # prune what no name passes through any more
            child = parent[level]
            if child:
                if list(child) == [_END]:
                    parent[level] = None
                break
            del parent[level]

    def matching(self, filters: Iterable[wildcards.Filter]) -> set[str]:
        """The names any of ``filters`` (level filters or prefix filters) matches."""
        out: set[str] = set()
        for f in filters:
            out.update(self.matching_one(f))
        return out

    def matching_one(self, f: wildcards.Filter) -> Iterator[str]:
        prefix = wildcards.prefix_of(f)
        if prefix is not None:  # only the first levels that can start it
            head, sep, _ = prefix.partition(wildcards.LEVEL_SEPARATOR)
            for key, child in self._root.items():
                if key != _END and (key == head if sep else key.startswith(head)):
                    top = [key] if child is None or _END in child else []
                    below = _names(child, key + wildcards.LEVEL_SEPARATOR) if child is not None else iter(())
                    yield from (name for name in (*top, *below) if name.startswith(prefix))
            return
        yield from _walk(self._root, f)


def _ends(value: Node | None) -> bool:
    """Does a name end at the node ``value`` (a None leaf, or a node marked ``_END``)."""
    return value is None or _END in value


def _walk(root: Node, f: wildcards.Filter) -> Iterator[str]:
    """The names ``f`` matches, level by level: the nodes the levels so far reach, each with its path (its
    levels joined, the separator after each), then those of its last level that end a name."""
    sep = wildcards.LEVEL_SEPARATOR
    reached: list[tuple[str, Node | None]] = [("", root)]
    last = len(f) - 1
    for i, level in enumerate(f):
        if level == wildcards.ANY_LEVELS:  # the rest, none included: ("a", "#") matches "a" itself
            for path, node in reached:
                if i and _ends(node):
                    yield path[:-1]
                if node is not None:
                    yield from _names(node, path)
            return
        if i == last:
            for path, node in reached:
                if node is None:
                    continue
                if level != wildcards.ONE_LEVEL:
                    if level in node and _ends(node[level]):
                        yield path + level
                    continue
                yield from (path + key for key, child in node.items() if key != _END and _ends(child))
            return
        step: list[tuple[str, Node | None]] = []
        for path, node in reached:
            if node is None:
                continue
            if level != wildcards.ONE_LEVEL:
                if level in node:
                    step.append((path + level + sep, node[level]))
                continue
            step.extend((path + key + sep, child) for key, child in node.items() if key != _END)
        reached = step


def _names(node: Node, path: str) -> Iterator[str]:
    """Every name below ``node`` (not ``node``'s own), ``path`` its levels joined, a separator after each."""
    sep = wildcards.LEVEL_SEPARATOR
    for key, child in node.items():
        if key == _END:
            continue
        if child is None:
            yield path + key
            continue
        if _END in child:
            yield path + key
        yield from _names(child, path + key + sep)


def matching_plain(names: Iterable[str], filters: Iterable[wildcards.Filter]) -> set[str]:
    """The twin: every name tested against every filter (what a scan of the parent does)."""
    wanted = list(filters)
    return {n for n in names if any(wildcards.matches(f, n.split(wildcards.LEVEL_SEPARATOR)) for f in wanted)}


class _OverBudget(Exception):
    pass


def matching_in_order(
    page: Page, held: Held, filters: Iterable[wildcards.Filter], budget: int
) -> tuple[set[str] | None, int]:
    """``LevelIndex.matching`` without an index: the names ``filters`` match, read through ``page`` (the
    parent's names in key order, as ``Store.lite_names``) and ``held`` (``Store.lite_names_held``), None once
    the reads would exceed ``budget`` (names read or looked up, ``_SEEK_COST`` more per read: 1 to 1.5 µs each
    here); and what the reads cost of it. Runs off the loop (store reads)."""
    reader = _Reader(page, held, budget)
    out: set[str] = set()
    try:
        for f in filters:
            prefix = wildcards.prefix_of(f)
            out.update(reader.names_from(prefix) if prefix is not None else _walk_in_order(reader, f))
    except _OverBudget:
        return None, budget
    return out, budget - reader.left


def _at_or_after(name: str) -> str:
    """The ``after`` of a page that starts at the first name ``>= name``: nothing lies between the two, since no
    name holds ``_TOP``."""
    return name[:-1] + chr(ord(name[-1]) - 1) + _TOP if name else ""


class _Reader:
    """The store's key order as a trie: each read charged to the budget; the levels found below a path kept."""

    __slots__ = ("_held", "_levels", "_page", "left")

    def __init__(self, page: Page, held: Held, budget: int) -> None:
        self._page, self._held, self.left = page, held, budget
        self._levels: dict[str, dict[str, list[bool]]] = {}

    def _charge(self, cost: int) -> None:
        self.left -= cost
        if self.left < 0:
            raise _OverBudget

    def _read(self, after: str, limit: int) -> list[str]:
        self._charge(limit + _SEEK_COST)  # charged for what it may read
        return self._page(after, limit)

    def names(self, candidates: list[str]) -> list[str]:
        """Those of ``candidates`` that are names (one multi-get: a key each, ~1 µs)."""
        wanted = [c for c in candidates if c]
        if not wanted:
            return []
        self._charge(len(wanted) + _SEEK_COST)
        return list(itertools.compress(wanted, self._held(wanted)))

    def names_from(self, path: str) -> Iterator[str]:
        """Every name starting with ``path``."""
        after, limit = _at_or_after(path), _FIRST_PAGE
        while True:
            page = self._read(after, limit)
            for name in page:
                if not name.startswith(path):
                    return
                yield name
            if len(page) < limit:
                return
            after, limit = page[-1], min(limit * 2, _PAGE_MAX)

    def levels(self, path: str) -> dict[str, list[bool]]:
        """The levels that follow ``path`` ("" or ending with the separator) in some name, each with [a name
        ends there, longer names go on]: a page at a time, past the longer names of the page's last level."""
        found = self._levels.get(path)
        if found is not None:
            return found
        found = self._levels[path] = {}
        sep, at = wildcards.LEVEL_SEPARATOR, len(path)
        after, limit = _at_or_after(path), _FIRST_PAGE
        while True:
            page = self._read(after, limit)
            new = 0
            for name in page:
                if not name.startswith(path):
                    return found
                level, below, _ = name[at:].partition(sep)
                seen = found.get(level)
                if seen is None:
                    seen = found[level] = [False, False]
                    new += 1
                seen[bool(below)] = True
            if len(page) < limit:
                return found
            level, below, _ = page[-1][at:].partition(sep)
            after = path + level + sep + _TOP if below else page[-1]  # past the last level's longer names
            limit = min(limit * 2, _PAGE_MAX) if 2 * new >= limit else _FIRST_PAGE


def _walk_in_order(reader: _Reader, f: wildcards.Filter) -> Iterator[str]:
    """``_walk`` on the store's key order: the paths the levels so far may reach (a literal level is not looked
    up until the name's end), then the names of the last level."""
    sep = wildcards.LEVEL_SEPARATOR
    reached = [""]
    last = len(f) - 1
    for i, level in enumerate(f):
        if level == wildcards.ANY_LEVELS:
            if i:
                yield from reader.names([path[:-1] for path in reached])
            for path in reached:
                yield from reader.names_from(path)
            return
        if i == last:
            if level != wildcards.ONE_LEVEL:
                yield from reader.names([path + level for path in reached])
                return
            for path in reached:
                yield from (path + key for key, (ends, _) in reader.levels(path).items() if ends)
            return
        if level != wildcards.ONE_LEVEL:
            reached = [path + level + sep for path in reached]
            continue
        ends = f[i + 1] == wildcards.ANY_LEVELS  # then a name that ends here matches too ("a_#" matches "a")
        reached = [
            path + key + sep for path in reached for key, found in reader.levels(path).items() if found[1] or ends
        ]
