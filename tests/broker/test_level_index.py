"""The lite-name level trie (``dispatch.level_index``) against its plain twin, the walk over every name, on
random names and filters, as names come and go (issue 28 item 4)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from lmq_broker.dispatch import level_index, wildcards

LEVEL = st.sampled_from(["", "a", "b", "ab", "x-1", "7"])
NAME = st.lists(LEVEL, min_size=1, max_size=4).map("_".join).filter(bool)
FILTER_LEVEL = st.sampled_from(["", "a", "b", "x-1", "+", "+", "#"])
FILTER = st.one_of(
    st.lists(FILTER_LEVEL, min_size=1, max_size=4).map(tuple).filter(lambda f: "#" not in f[:-1]),
    st.sampled_from(["a", "a_", "x-", "b_a"]).map(lambda p: (p + "*",)),
)


@settings(deadline=None, max_examples=400)
@given(st.lists(NAME, max_size=40), st.lists(NAME, max_size=20), st.lists(FILTER, min_size=1, max_size=5))
def test_the_trie_finds_what_the_plain_walk_finds(
    added: list[str], removed: list[str], filters: list[wildcards.Filter]
) -> None:
    index = level_index.LevelIndex()
    names: set[str] = set()
    for name in added:
        index.add(name)
        names.add(name)
    for name in removed:
        index.discard(name)
        names.discard(name)
    assert index.size == len(names)
    assert index.matching(filters) == level_index.matching_plain(names, filters)
    assert index.matching([wildcards.WHOLE_PARENT]) == names


def test_a_large_random_parent() -> None:
    rng = random.Random(28)
    names = {f"d{rng.randrange(300)}_s{rng.randrange(20)}_k{rng.randrange(50)}" for _ in range(20_000)}
    index = level_index.LevelIndex()
    for name in names:
        index.add(name)
    filters: list[wildcards.Filter] = [("+", "+", f"k{i}") for i in range(10)] + [("+", "s3", "#"), ("d7", "+", "+")]
    assert index.matching(filters) == level_index.matching_plain(names, filters)
    gone = set(rng.sample(sorted(names), 5000))
    for name in gone:
        index.discard(name)
    assert index.matching(filters) == level_index.matching_plain(names - gone, filters)
    assert index.size == len(names - gone)
