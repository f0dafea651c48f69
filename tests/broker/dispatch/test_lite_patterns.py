"""Lite topic patterns named by RocketMQ clients (``session-*``, ``a/+/c``, ``a/#``): the parser, the index
(prefix filters beside the level trie) against a plain matcher, quotas counting patterns, and on the
dispatcher over both stores: matching arrivals and backlog only, unsubscribe, full syncs, restore."""

from __future__ import annotations

import asyncio
import itertools
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from waiting import eventually_async

from lmq_broker import errors, model
from lmq_broker.dispatch import offsets, registry, saved_subscriptions, wildcards
from lmq_broker.dispatch.testing import GROUP, PARENT, Lite, background_done

PIECE = st.sampled_from(["a", "b", "ab", "s-1", ""])
NAME = st.lists(PIECE, min_size=1, max_size=4).map("_".join).filter(bool)
LEVEL = st.sampled_from(["a", "b", "ab", "+"])
PATTERN = st.one_of(
    st.lists(LEVEL, min_size=1, max_size=3).map("/".join),
    st.lists(LEVEL, min_size=0, max_size=2).map(lambda head: "/".join([*head, "#"])),
    st.sampled_from(["a", "a_", "a_b", "ab", "s", "s-", "b_a", ""]).map(lambda prefix: prefix + "*"),
)


def lmq(lite: str, parent: str = PARENT) -> str:
    return model.QueueId.lmq(parent, lite).topic


def reference(pattern: str, lite: str) -> bool:
    """What a pattern means, written with ``re``: ``*`` any characters at the end, ``+`` one level, a last
    ``#`` any levels (none included), levels split at ``/`` or ``_``."""
    if pattern.endswith("*"):
        return lite.startswith(pattern[:-1].replace("/", "_"))
    levels = re.split("[/_]", pattern)
    if levels[-1] == "#":
        head = "".join(("[^_]*" if x == "+" else re.escape(x)) + "_" for x in levels[:-1])
        return re.fullmatch(head + ".*", lite + "_", re.DOTALL) is not None
    return re.fullmatch("_".join("[^_]*" if x == "+" else re.escape(x) for x in levels), lite) is not None


# --- the parser -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("session-*", ("session-*",)),
        ("a/b*", ("a_b*",)),  # '/' and '_' separate levels alike
        ("a/+/c", ("a", "+", "c")),
        ("a_+_c", ("a", "+", "c")),
        ("a/#", ("a", "#")),
        ("#", ("#",)),
        ("*", ("#",)),  # every lite topic: the whole-parent fast path
        ("x/y", ("x", "y")),
    ],
)
def test_patterns_parse_into_filters(text: str, parsed: wildcards.Filter) -> None:
    assert wildcards.is_pattern(text)
    assert wildcards.parse_pattern(text) == parsed


@pytest.mark.parametrize("text", ["a*b", "a/*/c", "a/#/c", "a+/b", "a/b#", "a.b/+", "+*"])
def test_malformed_patterns_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"'\*'|'#'|levels|characters"):
        wildcards.parse_pattern(text)


def test_lite_names_are_never_patterns() -> None:
    assert not any(map(wildcards.is_pattern, ["session-1", "a_b_c", "A-z_09"]))


# --- the index ----------------------------------------------------------------------------------------------------
@settings(deadline=None)  # timings on a shared machine vary; the property is what counts
@given(st.lists(st.lists(PATTERN, min_size=1, max_size=3), min_size=1, max_size=5), st.lists(NAME, max_size=8))
def test_the_index_matches_like_the_reference(clients: list[list[str]], names: list[str]) -> None:
    w = wildcards.Wildcards()
    for i, patterns in enumerate(clients):
        w.add(f"c{i}", f"g{i % 2}", PARENT, [wildcards.parse_pattern(p) for p in patterns])
    for name in names:
        expected: dict[str, set[str]] = {}
        for i, patterns in enumerate(clients):
            if any(reference(p, name) for p in patterns):
                expected.setdefault(f"g{i % 2}", set()).add(f"c{i}")
        assert dict(w.groups_of_lmq(lmq(name))) == expected
        for i, patterns in enumerate(clients):
            assert w.holds(f"c{i}", lmq(name)) == any(reference(p, name) for p in patterns)
        assert w.groups_of_lmq(lmq(name, "other-parent")) == {}
        start_after, end_before = wildcards.scan_range([wildcards.parse_pattern(p) for p in clients[0]])
        if any(reference(p, name) for p in clients[0]):
            assert start_after < name and (not end_before or name < end_before)
    for i in range(len(clients)):
        w.remove(f"c{i}")
    assert not w and all(w.groups_of_lmq(lmq(name)) == {} for name in names)


@settings(deadline=None)  # timings on a shared machine vary; the property is what counts
@given(st.lists(PATTERN, min_size=1, max_size=6), st.lists(NAME, max_size=12))
def test_scan_ranges_are_sorted_disjoint_and_hold_every_match(patterns: list[str], names: list[str]) -> None:
    ranges = wildcards.scan_ranges([wildcards.parse_pattern(p) for p in patterns])
    assert all(end and end <= start for (_, end), (start, _) in itertools.pairwise(ranges)), ranges  # in order
    for name in names:
        inside = [(a, e) for a, e in ranges if a < name and (not e or name < e)]
        assert len(inside) <= 1, (name, ranges)
        if any(reference(p, name) for p in patterns):
            assert inside, (name, ranges)


def test_removing_one_client_keeps_a_prefix_another_holds() -> None:
    w = wildcards.Wildcards()
    w.add("c1", "g", PARENT, [("s-*",)])
    w.add("c2", "g", PARENT, [("s-*",), ("t*",)])
    w.remove("c2")
    assert w.groups_of_lmq(lmq("s-1")) == {"g": {"c1"}} and w.groups_of_lmq(lmq("t1")) == {}
    assert wildcards.scan_range([("s-*",)]) == ("s,\x7f", "s-\x7f")


# --- quotas -------------------------------------------------------------------------------------------------------
def test_a_pattern_counts_as_one_subscription() -> None:
    r = registry.Registry(max_pairs=4)
    r.add("c", [lmq("t1")], 3, 0, patterns=["s-*"])
    with pytest.raises(errors.SubscriptionQuotaExceeded, match="quota is 3"):
        r.add("c", [lmq("t2")], 3, 0, patterns=["a/#"])
    r.add("c", [], 3, 0, patterns=["a/#"])
    assert r.pair_count() == 3
    with pytest.raises(errors.SubscriptionQuotaExceeded, match="limit is 4"):
        r.add("d", [], 3, 0, patterns=["x*", "y*"])  # the broker-wide limit counts patterns too
    added, removed = r.replace("c", [lmq("t2")], 3, 0, patterns=["s-*", "b*"])
    assert (added, removed) == ([lmq("t2")], [lmq("t1")])
    state = r.get("c")
    assert state is not None and state.patterns == {"s-*", "b*"} and r.pair_count() == 3
    r.remove("c", [], 0, patterns=["b*", "never-held*"])
    assert state.patterns == {"s-*"} and r.pair_count() == 2
    r.drop("c")
    assert r.pair_count() == 0


# --- on the dispatcher ----------------------------------------------------------------------------------------------
asynchronous = pytest.mark.asyncio


async def nothing_but(lite: Lite, client: str, barrier: str, group: str = GROUP) -> None:
    """Nothing sent before reaches ``client``: a message on ``barrier`` (a lite topic it takes), sent after the
    background passes are done, comes alone (the ready queue hands topics out in the order they became ready)."""
    await background_done(lite.dispatcher)
    await lite.send(barrier)
    assert await lite.drain(client, 1, group) == [barrier]


async def queued(lite: Lite, client: str, name: str) -> None:
    await eventually_async(lambda: lmq(name) in lite.dispatcher.ready.queued(client), f"{name} queued for {client}")


@asynchronous
async def test_patterns_take_matching_arrivals_only(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c", GROUP, PARENT, ["session-*", "dev/+/cmd", "all/#", "named"])
    names = ["session-1", "session-2_x", "sess", "dev_1_cmd", "dev_1_cmd_x", "all", "all_a_b", "named", "other"]
    for name in names:
        await lite.send(name, name.encode())
    want = ["all", "all_a_b", "dev_1_cmd", "named", "session-1", "session-2_x"]
    assert sorted(await lite.drain("c", len(want))) == want
    await nothing_but(lite, "c", "named")
    assert lite.committed("session-1") == 1 and lite.committed("other") is None
    assert lite.dispatcher.subscription_count() == 4  # three patterns and one lite topic


@asynchronous
async def test_a_new_pattern_finds_the_backlog_of_matching_topics(lite: Lite) -> None:
    lite.put_group(model.LiteGroup(GROUP, PARENT, ready_capacity=10))  # fewer slots than topics: it resumes
    backlog = [f"job-{i:02d}" for i in range(25)]
    for name in [*backlog, "jo", "other-1"]:
        await lite.send(name)
    await lite.dispatcher.add_lite("c", GROUP, PARENT, ["job-*"])
    await background_done(lite.dispatcher)  # its ready queue is full
    await lite.dispatcher.add_lite("c", GROUP, PARENT, ["own"])
    await lite.send("own")  # overflows too: the catch-up walks the client's own topics after its patterns
    assert sorted(await lite.drain("c", 26)) == sorted([*backlog, "own"])
    await nothing_but(lite, "c", "job-barrier")


@asynchronous
async def test_a_new_pattern_walks_its_own_range_and_a_full_pass_resumes_across_ranges(
    lite: Lite, monkeypatch: pytest.MonkeyPatch
) -> None:
    lite.put_group(model.LiteGroup(GROUP, PARENT, ready_capacity=3))
    names = [f"{head}{i}" for head in ("a", "m", "z") for i in range(5)]
    for name in names:
        await lite.send(name)
    await lite.dispatcher.add_lite("c", GROUP, PARENT, ["a*"])
    await background_done(lite.dispatcher)
    scans: list[tuple[str, str]] = []
    scan = lite.store.scan_lite_topics

    def recorded(parent: str | None = None, start_after: str = "", end_before: str = "", limit: int = 1000) -> object:
        scans.append((start_after, end_before))
        return scan(parent, start_after, end_before, limit)

    monkeypatch.setattr(lite.store, "scan_lite_topics", recorded)
    await lite.dispatcher.add_lite("c", GROUP, PARENT, ["z*"])
    await background_done(lite.dispatcher)
    assert scans == [("y\x7f", "z\x7f")]  # the new pattern's range only: neither a* nor the m topics
    got = await lite.drain("c", 10)  # 3 slots: full passes resume across both ranges, round and round
    assert sorted(got) == [n for n in names if n[0] in "az"]
    assert not any(start < "m0" and (not end or end > "m0") for start, end in scans)  # never the gap between


@asynchronous
async def test_unsubscribing_a_pattern_stops_deliveries_even_of_queued_topics(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c", GROUP, PARENT, ["s-*", "t/#"])
    await lite.send("s-1")
    await queued(lite, "c", "s-1")
    await lite.dispatcher.remove_lite("c", GROUP, PARENT, ["s-*"])
    await lite.send("s-2")
    await lite.send("t_1")
    assert await lite.drain("c", 1) == ["t_1"]
    await nothing_but(lite, "c", "t_barrier")
    await lite.dispatcher.remove_all_lite("c", GROUP, PARENT)
    await lite.send("t_2")
    await background_done(lite.dispatcher)
    assert lite.dispatcher.wildcards.registration("c") is None and lite.dispatcher.subscription_count() == 0
    await lite.dispatcher.add_lite("c", GROUP, PARENT, ["barrier"])  # subscribed after t_2 was sent
    await nothing_but(lite, "c", "barrier")
    await lite.dispatcher.remove_lite("c", GROUP, PARENT, ["barrier"])
    await lite.dispatcher.add_lite("c", GROUP, PARENT, ["s-*"])  # back: from the group's offsets
    assert sorted(await lite.drain("c", 2)) == ["s-1", "s-2"]


@asynchronous
@pytest.mark.parametrize(
    ("names", "gone", "walk"),
    [
        (["s-*", "t/#"], "s-*", "backlog"),  # a new pattern's walk of its key range
        (["+/x", "t/#"], "+/x", "backlog"),  # no literal prefix: its names looked up by level
        (["s-1_x", "t/#"], "s-1_x", "catchup"),  # a catch-up pass over the client's named topics
    ],
)
async def test_a_walk_under_way_offers_nothing_unsubscribed_before_its_offer(
    lite: Lite, monkeypatch: pytest.MonkeyPatch, names: list[str], gone: str, walk: str
) -> None:
    await lite.send("s-1_x")  # backlog of the name or pattern the client drops while a walk finds it
    probe = lite.dispatcher.deliverer.pending_among
    found_it, go_on = asyncio.Event(), asyncio.Event()

    async def held(lmqs: list[str], group: str) -> list[str]:
        pending = await probe(lmqs, group)
        if lmq("s-1_x") in pending and not found_it.is_set():
            found_it.set()
            await go_on.wait()  # the walk has read and probed its page: its offers come next
        return pending

    if walk == "catchup":
        await lite.dispatcher.add_lite("c", GROUP, PARENT, names)  # queues s-1_x at once
        await background_done(lite.dispatcher)
    monkeypatch.setattr(lite.dispatcher.deliverer, "pending_among", held)
    if walk == "catchup":
        lite.dispatcher.subscriptions.start_catchup("c")
    else:
        await lite.dispatcher.add_lite("c", GROUP, PARENT, names)
    await asyncio.wait_for(found_it.wait(), 5)
    await lite.dispatcher.remove_lite("c", GROUP, PARENT, [gone])  # answered: nothing of it is queued from now
    go_on.set()
    await background_done(lite.dispatcher)
    assert lmq("s-1_x") not in lite.dispatcher.ready.queued("c")
    await nothing_but(lite, "c", "t_barrier")
    await lite.dispatcher.add_lite("c", GROUP, PARENT, [gone])  # back: the message waited at the group's offset
    assert await lite.drain("c", 1) == ["s-1_x"]


@asynchronous
async def test_a_full_sync_keeps_the_patterns_it_names_and_drops_the_others(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c", GROUP, PARENT, ["a*"])
    await lite.dispatcher.replace_lite("c", GROUP, PARENT, ["a*", "b/+"])  # a client's periodic COMPLETE_ADD
    await lite.send("a1")
    await lite.send("b_1")
    assert sorted(await lite.drain("c", 2)) == ["a1", "b_1"]
    lite.clock.advance(lite.dispatcher.config.full_sync_grace_ms + 1)  # the next full sync: built after the answer
    await lite.dispatcher.replace_lite("c", GROUP, PARENT, ["b/+"])
    await lite.send("a2")
    await nothing_but(lite, "c", "b_barrier")


@asynchronous
async def test_patterns_are_refused_beyond_the_quota_and_with_a_moving_offset(lite: Lite) -> None:
    lite.put_group(model.LiteGroup(GROUP, PARENT, client_quota=2))
    await lite.dispatcher.add_lite("c", GROUP, PARENT, ["t1", "s-*"])
    with pytest.raises(errors.SubscriptionQuotaExceeded):
        await lite.dispatcher.add_lite("c", GROUP, PARENT, ["x*"])
    with pytest.raises(errors.InvalidArgument, match="offset"):
        await lite.dispatcher.add_lite("d", GROUP, PARENT, ["y*"], offset=offsets.OffsetReset(offsets.OffsetPolicy.MIN))
    await lite.send("x1")
    await nothing_but(lite, "c", "s-barrier")


@asynchronous
async def test_patterns_survive_a_graceful_restart_through_the_snapshot(lite: Lite, tmp_path: Path) -> None:
    await lite.dispatcher.add_lite("c", GROUP, PARENT, ["s-*", "t1"])
    path = tmp_path / saved_subscriptions.FILE_NAME
    saved_subscriptions.save(lite.dispatcher.export_subscriptions(), path)
    records = saved_subscriptions.load(path)
    assert [(r.lmqs, r.patterns) for r in records] == [((lmq("t1"),), ("s-*",))]
    lite.dispatcher.client_gone("c")
    await lite.send("s-1")
    await lite.send("t1")
    lite.dispatcher.restore_subscriptions(records)
    assert sorted(await lite.drain("c", 2)) == ["s-1", "t1"]


# --- group-level patterns: a wildcard group's litePatterns ------------------------------------------------------
WILD = "wild-group"


@asynchronous
async def test_a_wildcard_group_with_patterns_takes_the_matching_lite_topics_only(lite: Lite) -> None:
    lite.put_group(model.LiteGroup(WILD, PARENT, wildcard=True, lite_patterns=("s-*", "d/+")))
    await lite.send("s-0")  # waiting before the client registers
    await lite.dispatcher.replace_lite("w", WILD, PARENT, [])  # subscribe_lite_all / the client's full sync
    for name in ("s-1", "d_1", "d_1_x", "other"):
        await lite.send(name)
    assert sorted(await lite.drain("w", 3, WILD)) == ["d_1", "s-0", "s-1"]
    assert lite.dispatcher.subscription_count() == 0  # the group's patterns are no client's subscriptions
    lite.put_group(model.LiteGroup(WILD, PARENT, wildcard=True, lite_patterns=("other",)))
    await lite.send("s-2")
    await queued(lite, "w", "s-2")  # under the old patterns
    await lite.dispatcher.replace_lite("w", WILD, PARENT, [])  # the next full sync reads the new patterns
    assert await lite.drain("w", 1, WILD) == ["other"]
    await nothing_but(lite, "w", "other", WILD)
