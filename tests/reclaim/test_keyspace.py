"""Key-range planning: every key lands in exactly one range, whatever the names, and ranges balance."""

from __future__ import annotations

import bisect
import string
import uuid

from hypothesis import given, settings
from hypothesis import strategies as st

from lmq_reclaim import job, keyspace, tasks

NAME_CHARS = string.ascii_letters + string.digits + "_-"


def sorted_probe(keys: list[str]) -> tuple[keyspace.Probe, list[int]]:
    """The broker's "first key after X", over a sorted list; also counts calls."""
    ordered = sorted(set(keys))
    calls = [0]

    def probe(after: str) -> str | None:
        calls[0] += 1
        i = bisect.bisect_right(ordered, after)
        return ordered[i] if i < len(ordered) else None

    return probe, calls


def owners(ranges: list[keyspace.KeyRange], key: str) -> int:
    return sum(keyspace.contains(r, key) for r in ranges)


@settings(max_examples=150, deadline=None)
@given(
    keys=st.lists(st.text(alphabet=NAME_CHARS, min_size=1, max_size=12), min_size=0, max_size=300),
    n=st.integers(min_value=1, max_value=20),
)
def test_every_key_is_in_exactly_one_range(keys: list[str], n: int) -> None:
    probe, _ = sorted_probe(keys)
    ranges = keyspace.split(n, probe)
    assert 1 <= len(ranges) <= n
    for key in keys:
        assert owners(ranges, key) == 1, key


def test_bounds_are_never_valid_names_and_are_increasing() -> None:
    keys = [str(uuid.UUID(int=i * 7919 + 13)) for i in range(2000)]
    probe, _ = sorted_probe(keys)
    ranges = keyspace.split(8, probe)
    bounds = [r.end_before for r in ranges[:-1]]
    assert bounds == sorted(bounds)
    assert all(b.endswith(keyspace.HIGH) for b in bounds)
    assert [r.start_after for r in ranges[1:]] == bounds
    assert ranges[0].start_after == "" and ranges[-1].end_before == ""


def test_uuid_names_split_evenly() -> None:
    keys = [str(uuid.uuid4()) for _ in range(20_000)]
    probe, calls = sorted_probe(keys)
    ranges = keyspace.split(10, probe)
    sizes = [sum(keyspace.contains(r, k) for k in keys) for r in ranges]
    assert len(ranges) == 10
    assert sum(sizes) == len(keys)
    assert max(sizes) < 1.5 * min(sizes), sizes
    assert calls[0] <= keyspace.MAX_PROBES_PER_PARENT


def test_a_long_shared_prefix_is_walked_down_before_splitting() -> None:
    keys = [f"session-{i:06d}" for i in range(5000)]
    probe, _ = sorted_probe(keys)
    ranges = keyspace.split(4, probe)
    sizes = [sum(keyspace.contains(r, k) for k in keys) for r in ranges]
    assert len(ranges) == 4
    assert min(sizes) > 0, sizes


def test_probe_budget_bounds_the_work_and_keeps_coverage() -> None:
    keys = [f"{a}{b}" for a in NAME_CHARS for b in NAME_CHARS]
    probe, calls = sorted_probe(keys)
    ranges = keyspace.split(16, probe, max_probes=20)
    assert calls[0] <= 20
    assert all(owners(ranges, k) == 1 for k in keys)


def test_one_range_asked_or_no_keys_is_the_full_range() -> None:
    probe, calls = sorted_probe([])
    assert keyspace.split(1, probe) == [keyspace.FULL_RANGE]
    assert keyspace.split(5, probe) == [keyspace.FULL_RANGE]
    assert calls[0] == 1


def test_ranges_for_scales_with_count_and_caps() -> None:
    assert keyspace.ranges_for(0, 1000, 64) == 0
    assert keyspace.ranges_for(1, 1000, 64) == 1
    assert keyspace.ranges_for(1000, 1000, 64) == 1
    assert keyspace.ranges_for(1001, 1000, 64) == 2
    assert keyspace.ranges_for(10**9, 1000, 64) == 64


def test_scan_tasks_alternate_between_brokers() -> None:
    def task(broker: str, i: int) -> tasks.ScanTask:
        return tasks.ScanTask(broker, f"{broker}:1", "P", keyspace.KeyRange(str(i), ""))

    planned = [task("a", 0), task("a", 1), task("a", 2), task("b", 0), task("c", 0), task("c", 1)]
    order = [(t.broker, t.key_range.start_after) for t in job.interleave(planned)]
    assert order == [("a", "0"), ("b", "0"), ("c", "0"), ("a", "1"), ("c", "1"), ("a", "2")]
