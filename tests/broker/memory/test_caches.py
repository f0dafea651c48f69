"""The two bounded caches: a memo cleared when full, and an LRU; each keeps its bound and counts."""

from __future__ import annotations

import pytest

from lmq_broker import caches, errors
from lmq_broker.storage import keys


def test_a_bounded_dict_forgets_everything_when_a_new_key_finds_it_full() -> None:
    memo: caches.BoundedDict[str, int] = caches.BoundedDict(2)
    assert memo.put("a", 1) == 1
    memo.put("b", 2)
    memo.put("b", 3)  # a known key replaces its value: nothing forgotten
    assert memo == {"a": 1, "b": 3} and memo.evictions == 0
    memo.put("c", 4)
    assert memo == {"c": 4}
    assert (memo.misses, memo.evictions) == (4, 2)


def test_an_lru_drops_the_least_recently_used_entry() -> None:
    lru: caches.LRU[str, int] = caches.LRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.touch("a") == 1  # now b is the least recent
    assert lru.touch("x") is None
    lru.put("c", 3)
    assert list(lru.items()) == [("a", 1), ("c", 3)]
    lru.put("a", 5)  # refreshing a key is no miss and evicts nothing
    assert list(lru) == ["c", "a"] and (lru.misses, lru.evictions) == (3, 1)


def test_an_lru_filled_in_a_loop_is_trimmed_once() -> None:
    lru: caches.LRU[int, int] = caches.LRU(3)
    for i in range(10):
        lru[i] = i
    assert len(lru) == 10
    lru.trim()
    assert list(lru) == [7, 8, 9] and lru.evictions == 7


@pytest.mark.parametrize("kind", [caches.BoundedDict, caches.LRU])
def test_a_cache_needs_room_for_one_entry(kind: type[caches.BoundedDict[str, int] | caches.LRU[str, int]]) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        kind(0)


def test_two_stores_name_caches_share_nothing() -> None:
    first, second = keys.NameCache(4), keys.NameCache(4)
    first.queue("%LMQ%$P$a", 0)
    assert first.valid_parent("P") and "P" in first._parents
    assert second.by_topic == {} and second._parents == {}


def test_a_name_cache_stays_within_its_capacity() -> None:
    names = keys.NameCache(4)
    for i in range(10):
        names.queue(f"%LMQ%$P$t{i}", 0)
        names.topic(f"T{i}")
        assert len(names.by_topic) <= 4 and len(names.topics) <= 4
    assert names.queue("%LMQ%$P$t9", 0).lite == "t9"
    with pytest.raises(errors.InvalidName, match="invalid parent"):
        names.queue("%LMQ%$bad parent$x", 0)
