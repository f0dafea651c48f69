"""Topic filters (``+``/``#`` over lite names split at ``_``): the trie agrees with a plain matcher, forgets
what is removed, bounds catch-up scans; on the dispatcher, registered filters take arrivals and backlog of
the matching lite topics only, over both stores."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmq_broker import model
from lmq_broker.dispatch import offsets, wildcards
from lmq_broker.dispatch.dispatcher import Delivery
from lmq_broker.dispatch.testing import PARENT, Lite, background_done

MQTT_GROUP = "%MQTT%client-1"
LEVEL = st.sampled_from(["a", "b", "c", ""])
FILTER = st.lists(st.sampled_from(["a", "b", "+", ""]), min_size=0, max_size=3).flatmap(
    lambda head: st.sampled_from([(*head, "#"), tuple(head) or ("a",)])
)
NAME = st.lists(LEVEL, min_size=1, max_size=4).map("_".join).filter(bool)


def lmq(lite: str, parent: str = PARENT) -> str:
    return model.QueueId.lmq(parent, lite).topic


def reference(f: wildcards.Filter, lite: str) -> bool:
    """MQTT matching, written the long way."""
    levels = lite.split("_")
    if f[-1] == "#":
        head = f[:-1]
        return len(levels) >= len(head) and all(x in ("+", y) for x, y in zip(head, levels, strict=False))
    return len(levels) == len(f) and all(x in ("+", y) for x, y in zip(f, levels, strict=True))


@settings(deadline=None)  # timings on a shared machine vary; the property is what counts
@given(st.lists(st.lists(FILTER, min_size=1, max_size=3), min_size=1, max_size=4), st.lists(NAME, max_size=8))
def test_the_trie_matches_like_mqtt(clients: list[list[wildcards.Filter]], names: list[str]) -> None:
    w = wildcards.Wildcards()
    for i, filters in enumerate(clients):
        w.add(f"c{i}", f"g{i % 2}", PARENT, filters)
    for name in names:
        expected: dict[str, set[str]] = {}
        for i, filters in enumerate(clients):
            if any(reference(f, name) for f in filters):
                expected.setdefault(f"g{i % 2}", set()).add(f"c{i}")
        assert dict(w.groups_of_lmq(lmq(name))) == expected
        for i, filters in enumerate(clients):
            assert w.holds(f"c{i}", lmq(name)) == any(reference(f, name) for f in filters)
        assert w.groups_of_lmq(lmq(name, "other-parent")) == {}


@settings(deadline=None)  # timings on a shared machine vary; the property is what counts
@given(st.lists(FILTER, min_size=1, max_size=4), st.lists(NAME, max_size=12))
def test_the_scan_range_holds_every_name_a_filter_matches(filters: list[wildcards.Filter], names: list[str]) -> None:
    start_after, end_before = wildcards.scan_range(filters)
    for name in names:
        if any(reference(f, name) for f in filters):
            assert name > start_after and (not end_before or name < end_before)


@settings(deadline=None)  # timings on a shared machine vary; the property is what counts
@given(st.lists(st.lists(FILTER, min_size=1, max_size=3), min_size=1, max_size=4))
def test_removing_every_client_leaves_nothing_behind(clients: list[list[wildcards.Filter]]) -> None:
    w = wildcards.Wildcards()
    for i, filters in enumerate(clients):
        w.add(f"c{i}", "g", PARENT, filters)
    w.add("whole", "g", PARENT)
    for i in range(len(clients)):
        assert w.remove(f"c{i}") == (PARENT, "g")
    assert w.remove("whole") == (PARENT, "g")
    assert not w and w._tries == {} and w._by_parent == {}


def test_a_filter_ending_in_hash_matches_its_parent_level_too() -> None:
    w = wildcards.Wildcards()
    w.add("c", "g", PARENT, [("a", "#")])
    assert w.takes("c", "a") and w.takes("c", "a_b_c") and not w.takes("c", "ab")
    assert w.add("c", "g", PARENT, [("a", "#")]) is False  # the same set again changes nothing
    w.add("c", "g", PARENT, [("#",)])  # the whole parent: the fast path of wildcard groups
    assert w.filters("c") is None and w.takes("c", "anything")


# --- on the dispatcher ------------------------------------------------------------------------------------------
asynchronous = pytest.mark.asyncio


async def receive(lite: Lite, client: str) -> list[Delivery]:
    return await lite.dispatcher.receive_lite(client, MQTT_GROUP, PARENT, batch=32, invisible_ms=10_000, poll_ms=0)


@asynchronous
async def test_filters_take_matching_arrivals_only_and_mqtt_groups_need_no_declaration(lite: Lite) -> None:
    await lite.dispatcher.subscribe_filters("c", MQTT_GROUP, PARENT, [("dev-1", "+"), ("all", "#")])
    for name in ("dev-1_cmd", "dev-2_cmd", "dev-1_cmd_x", "all", "all_a_b", "other"):
        await lite.send(name, name.encode())
    assert sorted(await lite.drain("c", 3, MQTT_GROUP)) == ["all", "all_a_b", "dev-1_cmd"]
    await lite.send("all", b"later")  # barrier: a later match comes alone, nothing unmatched before it
    assert await lite.drain("c", 1, MQTT_GROUP) == ["all"]
    await background_done(lite.dispatcher)
    assert await receive(lite, "c") == []
    assert lite.committed("dev-1_cmd", MQTT_GROUP) == 1 and lite.committed("dev-2_cmd", MQTT_GROUP) is None


@asynchronous
async def test_registration_finds_backlog_in_the_filters_range_and_resets_skip_history(lite: Lite) -> None:
    for name in ("x_old", "x_new", "y_z"):
        await lite.send(name, b"before")
    await lite.dispatcher.reset_offsets(MQTT_GROUP, PARENT, ["x_old"], offsets.OffsetReset(offsets.OffsetPolicy.MAX))
    await lite.dispatcher.subscribe_filters("c", MQTT_GROUP, PARENT, [("x", "+")])
    assert await lite.drain("c", 1, MQTT_GROUP) == ["x_new"]  # x_old starts at its end; y_z is not matched
    await lite.send("x_old", b"after")
    assert await lite.drain("c", 1, MQTT_GROUP) == ["x_old"]


@asynchronous
async def test_no_filters_unregister(lite: Lite) -> None:
    await lite.dispatcher.subscribe_filters("c", MQTT_GROUP, PARENT, [("a",)])
    await lite.dispatcher.subscribe_filters("c", MQTT_GROUP, PARENT, [])
    await lite.send("a")
    await background_done(lite.dispatcher)
    assert lite.dispatcher.wildcards.registration("c") is None
    await lite.dispatcher.subscribe_filters("c", MQTT_GROUP, PARENT, [("b",)])  # after "a" was sent
    await lite.send("b")
    assert await lite.drain("c", 1, MQTT_GROUP) == ["b"]  # barrier: it comes alone, "a" never came
