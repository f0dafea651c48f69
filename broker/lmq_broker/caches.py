"""The broker's two kinds of bounded cache, so that each cache is one line where it is used.

- ``BoundedDict``: a memo that forgets everything when full. For values that are cheap to recompute (a
  validated name, an encoding) where what matters is only that a broker with a million topics never holds a
  million of them; no order is kept, so a lookup is a plain ``dict`` lookup.
- ``LRU``: keeps the most recently used entries. For values that cost I/O to reload (a queue's state, a
  commit point), where a hot entry must survive a scan of cold ones.

Both are real ``dict`` subclasses: lookups (``get``, ``in``, ``[]``) stay the C implementation on the hot
paths, and only inserting goes through Python (``put``), which is where the bound is kept. Lookups are
therefore not counted; ``misses`` counts the entries put (each one a miss computed by the caller) and
``evictions`` the entries the bound dropped. Each cache belongs to one owner (a store, a dispatcher), never
to a module: two brokers in one process share nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedDict(dict[K, V]):
    """A dict of at most ``capacity`` entries that is cleared when a ``put`` finds it full."""

    __slots__ = ("capacity", "evictions", "misses")

    def __init__(self, capacity: int) -> None:
        super().__init__()
        if capacity < 1:
            raise ValueError(f"a cache needs a capacity of at least 1, not {capacity}")
        self.capacity = capacity
        self.misses = 0
        self.evictions = 0

    def put(self, key: K, value: V) -> V:
        """Remember ``value`` for ``key`` (forgetting everything first if full); returns ``value``."""
        if len(self) >= self.capacity and key not in self:
            self.evictions += len(self)
            self.clear()
        self.misses += 1
        self[key] = value
        return value


class LRU(OrderedDict[K, V]):
    """An OrderedDict of at most ``capacity`` entries, least recently used first.

    ``touch`` marks a hit as used; ``put`` inserts (or refreshes) an entry as the most recent and drops the
    least recent beyond the capacity. A caller that inserts many entries in a loop may assign and
    ``move_to_end`` itself and call ``trim`` once after the loop."""

    __slots__ = ("capacity", "evictions", "misses")

    def __init__(self, capacity: int) -> None:
        super().__init__()
        if capacity < 1:
            raise ValueError(f"a cache needs a capacity of at least 1, not {capacity}")
        self.capacity = capacity
        self.misses = 0
        self.evictions = 0

    def touch(self, key: K) -> V | None:
        """The value for ``key``, marked most recently used; None if absent."""
        value = self.get(key)
        if value is not None:
            self.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> V:
        """Remember ``value`` for ``key`` as the most recently used; returns ``value``."""
        if key in self:
            self.move_to_end(key)
        else:
            self.misses += 1
        self[key] = value
        self.trim()
        return value

    def trim(self) -> None:
        """Drop the least recently used entries beyond the capacity."""
        while len(self) > self.capacity:
            self.popitem(last=False)
            self.evictions += 1
