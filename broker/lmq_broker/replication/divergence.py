"""Where a replica's lite topic parted from its slot's owner's (pure: over a ``Log``), Kafka's leader-epoch rule.

Every record keeps the epoch its slot's owner stored it in (``model.NewMessage.epoch``; copies keep it). One
owner per epoch, whose log only grows while it holds the lease, and a replica that appends an owner's copies
only after it checked its log against that owner's (``following``): so two replicas holding a record of the
same epoch at the same offset hold the same records up to it, and in each log epochs never go down along the
offsets (a binary search finds where an epoch ends).

A replica whose last record of a topic has epoch ``f`` asks the owner for ``answer(owner, f)``: the newest
epoch ``e`` ≤ ``f`` the owner holds records of, and the offset ``x`` where the owner's records of epochs above
``e`` begin. If ``e == f`` both logs hold the same records below ``x`` (both agree with the owner of ``f`` up
to their last record of ``f``): the replica keeps ``min(end, x)``. If ``e < f`` (the replica's records of ``f``
never reached the owner) it also cuts where its own epochs above ``e`` begin, and asks again with its new last
epoch; the epochs it asks with go down, so that ends. ``e`` is None when the owner holds no record of an epoch
≤ ``f`` (it holds none of the topic, or retention took them): the replica keeps nothing of the owner's range.

A record acknowledged at ``--min-insync-replicas`` = R is on every replica, the owner included, at its offset and
with its epoch: the owner's answer never lies below it, so it is never cut (docs/replication.md, Guarantees).
"""

from __future__ import annotations

from typing import Protocol

Record = tuple[int, int]  # (offset, epoch)


class Log(Protocol):
    """One lite topic of one replica, as the rule reads it (``sources.StoreLog``; a list in tests)."""

    def bounds(self) -> tuple[int, int]:
        """(min, end): its first offset kept and its next offset."""
        ...

    def first_from(self, offset: int) -> Record | None:
        """The first record at ``offset`` or after (below the end), or None."""
        ...

    def last_below(self, offset: int) -> Record | None:
        """The last record below ``offset`` (at or above the min), or None (also when too many offsets before it
        are lost ranges to look through: the caller then cuts more, never less)."""
        ...


def first_above(log: Log, epoch: int) -> int:
    """The first offset from which every record has an epoch above ``epoch`` (the end when none has)."""
    lo, hi = log.bounds()
    while lo < hi:
        mid = (lo + hi) // 2
        found = log.first_from(mid)
        if found is None or found[1] > epoch:
            hi = mid
        else:
            lo = found[0] + 1
    return lo


def last_epoch(log: Log) -> int | None:
    """The epoch of the topic's last record; None when it holds none."""
    found = log.last_below(log.bounds()[1])
    return None if found is None else found[1]


def answer(owner: Log, epoch: int) -> tuple[int | None, int]:
    """The owner's answer to a replica whose last record has ``epoch``: (the newest epoch ≤ it the owner holds
    records of, or None; the offset where the owner's records of later epochs begin)."""
    x = first_above(owner, epoch)
    found = owner.last_below(x)
    return (None if found is None else found[1]), x


def cut_point(mine: Log, epoch: int, theirs: tuple[int | None, int]) -> int:
    """Where this replica cuts its topic, its last record having ``epoch`` and the owner having answered
    ``theirs``; the end when nothing is cut. Ask again afterwards unless the answer's epoch was ``epoch``."""
    low, end = mine.bounds()
    same, x = theirs
    keep = min(end, x)
    if same != epoch:
        keep = min(keep, low if same is None else first_above(mine, same))
    return max(keep, 0)


class Listed:
    """A ``Log`` over a list of epochs by offset (None: a lost offset), from ``low``: the rule's unit tests."""

    def __init__(self, epochs: list[int | None], low: int = 0) -> None:
        self.epochs = epochs
        self.low = low

    def bounds(self) -> tuple[int, int]:
        return self.low, len(self.epochs)

    def first_from(self, offset: int) -> Record | None:
        for at in range(max(offset, self.low), len(self.epochs)):
            epoch = self.epochs[at]
            if epoch is not None:
                return at, epoch
        return None

    def last_below(self, offset: int) -> Record | None:
        for at in range(min(offset, len(self.epochs)) - 1, self.low - 1, -1):
            epoch = self.epochs[at]
            if epoch is not None:
                return at, epoch
        return None

    def cut(self, end: int) -> None:
        del self.epochs[end:]
