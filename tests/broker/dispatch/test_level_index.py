"""The lite-name level trie (``dispatch.level_index``) against its plain twin, the walk over every name, on
random names and filters, as names come and go (issue 28 item 4)."""

from __future__ import annotations

import asyncio
import bisect
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
async def test_the_dispatcher_keeps_a_parents_index_current_as_topics_come_and_go(
    lite: Lite, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built when a filter without a literal prefix first needs it (here every match in key order gives up
    at once), then kept: a topic created later is found by the next such filter, a reclaimed one is not; what
    the index finds is what the plain walk finds."""
    monkeypatch.setattr(subscriptions, "WALK_BUDGET", 0)
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
    assert store.lite_names_held(PARENT, ["b_1", "b_", "z", "c_x_y", "", "a"]) == [
        True,
        False,
        False,
        True,
        False,
        True,
    ]
    assert store.lite_names_held(PARENT + "2", ["z", "a"]) == [True, False]


@asynchronous
async def test_topics_written_while_the_index_is_built_are_found(lite: Lite, monkeypatch: pytest.MonkeyPatch) -> None:
    """The index is built a page per loop step, arrivals joining it from its first step: topics written
    while it is built, with names before the page being read (no later page holds them), are in it, as are
    all the topics read; the filter that asked for the build finds them all then."""
    monkeypatch.setattr(subscriptions, "WALK_BUDGET", 0)
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


def pages_of(names: set[str]) -> level_index.Page:
    """``Store.lite_names`` over a sorted list: the names after ``after``, at most ``limit``."""
    ordered = sorted(names)

    def page(after: str, limit: int) -> list[str]:
        start = bisect.bisect_right(ordered, after)
        return ordered[start : start + limit]

    return page


def held_of(names: set[str]) -> level_index.Held:
    """``Store.lite_names_held`` over a set."""
    return lambda candidates: [c in names for c in candidates]


@settings(deadline=None, max_examples=400)
@given(st.lists(NAME, max_size=60), st.lists(FILTER, min_size=1, max_size=5))
def test_the_walk_in_key_order_finds_what_the_plain_walk_finds(
    names: list[str], filters: list[wildcards.Filter]
) -> None:
    found, spent = level_index.matching_in_order(pages_of(set(names)), held_of(set(names)), filters, 1_000_000)
    assert found == level_index.matching_plain(names, filters)
    assert 0 <= spent <= 1_000_000


def test_the_walk_in_key_order_on_a_large_parent_reads_little_and_gives_up_past_its_budget() -> None:
    names = {f"b{b}_f{f}_r{r}" for b in range(10) for f in range(10) for r in range(1000)}
    names |= {f"b{b}0_f1_r1" for b in range(3)} | {"b1", "b1_f1", "b1_f1_r1_x", "b1a_f1_r1"}  # levels extending others
    reads: list[int] = []
    page = pages_of(names)

    def counted(after: str, limit: int) -> list[str]:
        got = page(after, limit)
        reads.append(len(got))
        return got

    filters: list[wildcards.Filter] = [("+", f"f{j % 10}", f"r{j}") for j in range(100)] + [("+", "f1", "r1", "#")]
    held = held_of(names)
    found, spent = level_index.matching_in_order(counted, held, filters, 20_000)
    assert found == level_index.matching_plain(names, filters)
    assert sum(reads) < 2_000, sum(reads)
    assert spent < 20_000
    assert level_index.matching_in_order(page, held, [("+", "+", "+")], 20_000) == (None, 20_000)  # 100,000 names
    assert level_index.matching_in_order(page, held, [("#",)], 20_000) == (None, 20_000)


@asynchronous
async def test_a_match_in_key_order_builds_no_index_until_it_would_read_too_much(
    lite: Lite, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before a parent has an index, filters are matched on the store's key order: found as the plain walk
    finds them, no index built; filters that would read more than ``WALK_BUDGET`` names build it."""
    names = [f"b{b}_f{f}_r{r}" for b in range(3) for f in range(4) for r in range(50)] + ["b1", "b10_f1_r1"]
    for name in names:
        await lite.send(name, b"m")
    d = lite.dispatcher
    cheap: list[wildcards.Filter] = [("+", "f1", "r7"), ("+", "+", "r9"), ("b1", "#"), ("+",)]
    found = await d.lite_topics_matching(PARENT, cheap)
    assert found is not None and {m.lite for m in found} == level_index.matching_plain(names, cheap)
    assert PARENT not in d.wildcards.indexes
    monkeypatch.setattr(subscriptions, "WALK_BUDGET", 100)
    dear: list[wildcards.Filter] = [("+", "+", "+")]  # every name: 600 to read
    found = await d.lite_topics_matching(PARENT, dear)
    assert found is not None and {m.lite for m in found} == level_index.matching_plain(names, dear)
    assert PARENT in d.wildcards.indexes


@asynchronous
async def test_matches_in_key_order_that_add_up_to_about_two_builds_build_the_index(
    lite: Lite, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each match in key order is cheap, but a parent matched again and again (catch-up passes, SUBSCRIBE
    after SUBSCRIBE) gets its index once they have cost ``WALKS_BEFORE_INDEX`` in all: built in the background,
    it answers from then on."""
    names = [f"d{d}_x{x}" for d in range(5) for x in range(5)]
    for name in names:
        await lite.send(name, b"m")
    d = lite.dispatcher
    filters: list[wildcards.Filter] = [("+", "x3")]
    _, one = level_index.matching_in_order(
        pages_of(set(names)), held_of(set(names)), filters, subscriptions.WALK_BUDGET
    )
    monkeypatch.setattr(subscriptions, "WALKS_BEFORE_INDEX", 3 * one)
    for _ in range(2):
        found = await d.lite_topics_matching(PARENT, filters)
        assert found is not None and {m.lite for m in found} == level_index.matching_plain(names, filters)
        assert PARENT not in d.wildcards.indexes
    found = await d.lite_topics_matching(PARENT, filters)  # the third: about as dear as ``WALKS_BEFORE_INDEX``
    assert found is not None and {m.lite for m in found} == level_index.matching_plain(names, filters)
    await until(lambda: PARENT in d.wildcards.indexes and d.wildcards.indexes[PARENT].size == len(names))
    found = await d.lite_topics_matching(PARENT, [("+", "x1")])
    assert found is not None and {m.lite for m in found} == {f"d{d}_x1" for d in range(5)}
