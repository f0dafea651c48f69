"""The lite-name level trie (``dispatch.level_index``) against its plain twin, the walk over every name, on
random names and filters, as names come and go (issue 28 item 4)."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmq_broker import model
from lmq_broker.dispatch import level_index, subscriptions, wildcards
from lmq_broker.dispatch import testing as dispatch_testing
from lmq_broker.dispatch.testing import PARENT, Lite, until
from lmq_broker.storage.api import Store

MQTT_GROUP = "%MQTT%client-1"
asynchronous = pytest.mark.asyncio
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
    filters: list[wildcards.Filter] = [("+", "+", f"k{i}") for i in range(10)]
    filters += [("+", "s3", "#"), ("d7", "+", "+")]
    assert index.matching(filters) == level_index.matching_plain(names, filters)
    gone = set(rng.sample(sorted(names), 5000))
    for name in gone:
        index.discard(name)
    assert index.matching(filters) == level_index.matching_plain(names - gone, filters)
    assert index.size == len(names - gone)


@asynchronous
async def test_the_dispatcher_keeps_a_parents_index_current_as_topics_come_and_go(lite: Lite) -> None:
    """Built when a filter without a literal prefix first needs it, then kept: a topic created later is found
    by the next such filter, a reclaimed one is not; what the index finds is what the plain walk finds."""
    for name in ("d1_x", "d2_x", "d3_y"):
        await lite.send(name, b"m")
    d = lite.dispatcher
    await d.subscribe_filters("c1", MQTT_GROUP, PARENT, [("+", "x")])
    assert sorted(await lite.drain("c1", 2, MQTT_GROUP)) == ["d1_x", "d2_x"]  # the backlog, found in the index
    assert PARENT in d.wildcards.indexes
    await lite.send("d4_x", b"later")  # written after the index was built: it joins it (as the arrival is told)
    await until(lambda: "d4_x" in d.wildcards.indexes[PARENT].matching([("+", "x")]))
    found = await d.lite_topics_matching(PARENT, [("+", "x")])
    assert found is not None and sorted(m.lite for m in found) == ["d1_x", "d2_x", "d4_x"]
    assert d.store.delete_lite_topic(PARENT, "d2_x")  # a reclaim: deleted, then forgotten
    d.forget_lite_topic(model.QueueId.lmq(PARENT, "d2_x"))
    assert d.wildcards.indexes[PARENT].matching([("+", "x")]) == {"d1_x", "d4_x"}
    assert await d.lite_topics_matching(PARENT, [("d1", "+")]) is None  # a literal prefix: a range scan
    every = [m.lite for m in d.store.scan_lite_topics(PARENT, "", "", 100)]
    filters: list[wildcards.Filter] = [("+", "y"), ("+", "+")]
    found = await d.lite_topics_matching(PARENT, filters)
    assert found is not None
    assert {m.lite for m in found} == level_index.matching_plain(every, filters)


def test_add_many_is_add_of_each() -> None:
    """The page-at-a-time build (``add_many``, reusing the node of consecutive names) against ``add``."""
    rng = random.Random(7)
    names = sorted({"_".join(rng.choice(["", "a", "b", "c1"]) for _ in range(rng.randint(1, 4))) for _ in range(3000)})
    names = [n for n in names if n]
    one, many = level_index.LevelIndex(), level_index.LevelIndex()
    for name in names:
        one.add(name)
    many.add_many(names[:1000])
    many.add_many(rng.sample(names, len(names)))  # out of order and again: the same index
    every: list[wildcards.Filter] = [("#",), ("+", "#"), ("+", "+"), ("a", "+", "#"), ("+",)]
    assert many.size == one.size == len(names)
    assert many.matching(every) == one.matching(every) == level_index.matching_plain(names, every)


def test_the_store_pages_lite_names_as_it_scans_them(store: Store) -> None:
    store.put_parent_topic(model.ParentTopic(PARENT))
    store.put_parent_topic(model.ParentTopic(PARENT + "2"))
    for parent, lite in [(PARENT, "b_1"), (PARENT, "a"), (PARENT, "b"), (PARENT + "2", "z"), (PARENT, "c_x_y")]:
        store.append([dispatch_testing.lite_message(lite, parent=parent)])
    names = [m.lite for m in store.scan_lite_topics(PARENT, "", "", 100)]
    assert names == ["a", "b", "b_1", "c_x_y"]
    assert store.lite_names(PARENT, "", 100) == names
    assert store.lite_names(PARENT, "", 2) + store.lite_names(PARENT, "b", 100) == names  # paged: after "b"
    assert store.lite_names(PARENT + "2") == ["z"]
    assert store.lite_names(PARENT, "c_x_y") == []


@asynchronous
async def test_topics_written_while_the_index_is_built_are_found(lite: Lite) -> None:
    """The index is built a page per loop step, arrivals joining it from its first step: topics written
    while it is built, with names before the page being read (no later page holds them), are in it, as are
    all the topics read; the filter that asked for the build finds them all then."""
    d = lite.dispatcher
    names = [f"d{i:06d}_x" for i in range(4 * subscriptions.INDEX_PAGE)]
    for start in range(0, len(names), 1000):
        batch = [dispatch_testing.lite_message(n, message_id=f"f-{n}") for n in names[start : start + 1000]]
        await d.send(batch)
    asking = asyncio.create_task(d.lite_topics_matching(PARENT, [("+", "x")]))
    await until(lambda: PARENT in d.wildcards.indexes)
    index = d.wildcards.indexes[PARENT]
    written: list[str] = []
    during = 0  # of them, told while pages of the names were still to be read (the build ran)
    while not asking.done():
        written.append(f"a{len(written):04d}_x")
        await lite.send(written[-1])
        await asyncio.sleep(0)  # the arrival is told (ingest hands arrivals over in a loop step of their own)
        during += index.size < len(names) + len(written)
    assert during, "the build ended before a topic was written: nothing shown"
    first = await asking
    assert first is not None and {m.lite for m in first} >= set(names)
    assert index.matching([("+", "x")]) == set(names) | set(written)
    assert index.size == len(names) + len(written)
    found = await d.lite_topics_matching(PARENT, [("+", "x")])
    assert found is not None and {m.lite for m in found} == set(names) | set(written)
