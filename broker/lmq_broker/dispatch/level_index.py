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
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Final

from lmq_broker.dispatch import wildcards

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
