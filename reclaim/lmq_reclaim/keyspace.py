"""Splitting one parent's lite-name key space into ranges that Spark scans in parallel.

The broker serves scans by exclusive bounds (``start_after`` < key < ``end_before``). Every bound we
make is an occupied prefix followed by ``HIGH`` (U+10FFFF, the largest code point, whose UTF-8 form sorts
after every other character), so a bound can never equal a real key: consecutive ranges cover the key
space with nothing lost or doubled, whatever the names look like.

Counts per key range are unknown (the store keeps one counter per parent), so we balance on *occupied
prefixes* instead, found by cheap "first key after X" probes: one probe per occupied child skips the whole
subtree of that child. Names of one shape (uuid4, ``session-<n>``) fill their prefixes evenly, which is
what makes this a fair proxy; a long shared prefix is walked down before splitting. The probe count is
bounded, so a pathological key space only costs balance, never correctness.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

HIGH: Final = "\U0010ffff"
MAX_PROBES_PER_PARENT: Final = 600
PREFIXES_PER_RANGE: Final = 4  # refine until each range can take several prefixes, for balance
MAX_PREFIX_LEVELS: Final = 64  # lite names are at most 64 bytes: deeper levels cannot exist

# First key strictly greater than the argument, or None when there is none.
Probe = Callable[[str], "str | None"]


@dataclass(frozen=True, slots=True)
class KeyRange:
    """Exclusive bounds; an empty string means unbounded on that side."""

    start_after: str = ""
    end_before: str = ""


FULL_RANGE: Final = KeyRange()


def ranges_for(count: int, rows_per_range: int, max_ranges: int) -> int:
    """How many ranges a parent with ``count`` lite topics deserves."""
    if count <= 0:
        return 0
    return max(1, min(max_ranges, -(-count // max(1, rows_per_range))))


def occupied_children(prefix: str, probe: Probe, budget: list[int]) -> list[str]:
    """The distinct one-character extensions of ``prefix`` that begin some key (key == prefix excluded).

    ``budget`` is a one-element mutable counter of probes left; enumeration stops when it runs out and
    returns what it found (the caller then treats the remainder as one unsplittable prefix).
    """
    found: list[str] = []
    after = prefix
    while budget[0] > 0:
        budget[0] -= 1
        key = probe(after)
        if key is None or not key.startswith(prefix):
            break  # keys > prefix that start with it are longer than it, so this is the end of the subtree
        child = key[: len(prefix) + 1]
        found.append(child)
        after = child + HIGH
    return found


def split(n: int, probe: Probe, max_probes: int = MAX_PROBES_PER_PARENT) -> list[KeyRange]:
    """At most ``n`` ranges covering the whole key space, balanced on occupied prefixes."""
    if n <= 1:
        return [FULL_RANGE]
    budget = [max_probes]
    prefixes = [""]
    for _ in range(MAX_PREFIX_LEVELS):
        if len(prefixes) >= n * PREFIXES_PER_RANGE:
            break
        refined: list[str] = []
        for p in prefixes:
            children = occupied_children(p, probe, budget) if budget[0] > 0 else []
            refined.extend(children or [p])
        if refined == prefixes or budget[0] <= 0:
            prefixes = refined
            break
        prefixes = refined
    return _group(prefixes, n)


def _group(prefixes: Sequence[str], n: int) -> list[KeyRange]:
    """Cut sorted prefixes into ``n`` contiguous groups; a group's upper bound is its last prefix + HIGH."""
    count = len(prefixes)
    if count <= 1 or n <= 1:
        return [FULL_RANGE]
    groups = min(n, count)
    bounds: list[str] = []
    for g in range(1, groups):
        last_of_group = prefixes[(g * count) // groups - 1]
        bounds.append(last_of_group + HIGH)
    starts = ["", *bounds]
    ends = [*bounds, ""]
    return [KeyRange(s, e) for s, e in zip(starts, ends, strict=True)]


def contains(r: KeyRange, key: str) -> bool:
    """Whether ``key`` falls inside ``r`` (the broker's rule, mirrored for tests and assertions)."""
    return key > r.start_after and (r.end_before == "" or key < r.end_before)
