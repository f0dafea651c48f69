"""Sets of offsets as runs: what a consumer group acknowledged (or saw settled as gone) above its commit point.

A lost segment can take millions of consecutive offsets with it, and acks above a stuck head come in long
stretches too: one object per offset cost seconds and hundreds of MiB. ``OffsetRanges`` keeps disjoint,
ascending, non-adjacent half-open runs ``[start, end)`` and reads as the ascending offsets they hold (a
``Sequence[int]``, so it goes wherever a plain tuple of offsets went), with ``len``, indexing and membership
in O(log runs) and equality in O(runs). Iterating it yields every offset: callers that care use ``runs``.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Final, final, overload

Run = tuple[int, int]  # [start, end)


@final
class OffsetRanges(Sequence[int]):
    __slots__ = ("_counts", "_starts", "runs")

    def __init__(self, runs: Iterable[Run] = ()) -> None:
        """``runs``: ascending, disjoint, non-adjacent and non-empty (``of`` builds them from offsets)."""
        self.runs: tuple[Run, ...] = tuple(runs)
        self._starts: list[int] | None = None  # built on first indexed access
        self._counts: list[int] | None = None

    @staticmethod
    def of(offsets: Iterable[int]) -> OffsetRanges:
        """The runs of ``offsets`` (any order, duplicates allowed)."""
        if isinstance(offsets, OffsetRanges):
            return offsets
        runs: list[Run] = []
        start = end = -1
        for offset in sorted(set(offsets)):
            if offset == end:
                end += 1
                continue
            if end > start:
                runs.append((start, end))
            start, end = offset, offset + 1
        if end > start:
            runs.append((start, end))
        return OffsetRanges(runs)

    def _index(self) -> tuple[list[int], list[int]]:
        if self._starts is None or self._counts is None:
            self._starts = [s for s, _ in self.runs]
            self._counts = list(itertools.accumulate(e - s for s, e in self.runs))
        return self._starts, self._counts

    def __len__(self) -> int:
        if not self.runs:
            return 0
        return self._index()[1][-1]

    def __bool__(self) -> bool:
        return bool(self.runs)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...
    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        if isinstance(index, slice):
            return tuple(self)[index]
        if index == 0 and self.runs:
            return self.runs[0][0]
        if index == -1 and self.runs:
            return self.runs[-1][1] - 1
        _, counts = self._index()
        size = counts[-1] if counts else 0
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError("offset index out of range")
        i = bisect.bisect_right(counts, index)
        before = counts[i - 1] if i else 0
        return self.runs[i][0] + index - before

    def __contains__(self, offset: object) -> bool:
        if not isinstance(offset, int):
            return False
        starts, _ = self._index()
        i = bisect.bisect_right(starts, offset) - 1
        return i >= 0 and offset < self.runs[i][1]

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(itertools.starmap(range, self.runs))

    def __reversed__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(range(e - 1, s - 1, -1) for s, e in reversed(self.runs))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, OffsetRanges):
            return self.runs == other.runs
        if isinstance(other, tuple | list):
            return len(self) == len(other) and tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.runs)

    def __repr__(self) -> str:
        return f"OffsetRanges({list(self.runs)!r})"


EMPTY: Final = OffsetRanges()
