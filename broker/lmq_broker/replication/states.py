"""State rows: what consumers depend on besides messages and commit points, copied as keyed rows (pure).

A slot's holder sees its state as rows ``(kind, key) -> value`` (``stating`` says which kinds and where they
come from). It ships what changed since its last batch (a value, or None: a tombstone), each batch numbered
``seq`` within a *stream* (one per holding of the slot: a restart, or a takeover, starts a new one). A follower
keeps the rows per slot (its *shadow*) and applies a batch only as the next of the stream it knows; a gap, or
another stream, makes it fetch the whole set again (a *snapshot*: the holder's rows now, with the stream and
the seq of its last batch) before it counts as in sync. Rows are whole values, so a batch that repeats what a
snapshot already had changes nothing.

Layout of a batch (and of a snapshot, with ``"full": true``): JSON
``{"slot", "epoch", "stream", "seq", "full", "rows": [[kind, key, value or null]…]}``. A snapshot comes in pages:
it adds ``"page"`` (the snapshot's name at the holder, which keeps it a while for the next pages) and ``"more"``
(true: rows follow, asked for by that name and the count of rows received).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from lmq_broker import errors

Key = tuple[str, str]  # (kind, key)
Rows = dict[Key, str]


@dataclass(frozen=True, slots=True)
class Batch:
    slot: int
    epoch: int
    stream: str
    seq: int
    rows: list[tuple[str, str, str | None]]
    full: bool = False
    page: str = ""  # a snapshot's name at the holder (its pages)
    more: bool = False  # a snapshot page with more rows after it


def encode(batch: Batch) -> bytes:
    value = {
        "slot": batch.slot,
        "epoch": batch.epoch,
        "stream": batch.stream,
        "seq": batch.seq,
        "full": batch.full,
        "rows": [list(r) for r in batch.rows],
    }
    if batch.full:
        value |= {"page": batch.page, "more": batch.more}
    return json.dumps(value, separators=(",", ":")).encode()


def decode(data: bytes) -> Batch:
    try:
        v = json.loads(data)
        rows = [(str(kind), str(key), None if value is None else str(value)) for kind, key, value in v["rows"]]
        slot, epoch, stream, seq = int(v["slot"]), int(v["epoch"]), str(v["stream"]), int(v["seq"])
        page, more = str(v.get("page", "")), bool(v.get("more", False))
        return Batch(slot, epoch, stream, seq, rows, bool(v["full"]), page, more)
    except (ValueError, KeyError, TypeError) as exc:
        raise errors.InvalidArgument(f"unreadable state batch: {exc}") from None


@dataclass(slots=True)
class Tracker:
    """The holder's side of one slot: what its followers were last sent."""

    stream: str
    seq: int = 0
    shipped: Rows = field(default_factory=dict)

    def diff(self, current: Rows) -> list[tuple[str, str, str | None]]:
        """The rows that changed since the last batch (None: gone), and take them as shipped."""
        out: list[tuple[str, str, str | None]] = [
            (kind, key, value) for (kind, key), value in current.items() if self.shipped.get((kind, key)) != value
        ]
        out += [(kind, key, None) for (kind, key) in self.shipped if (kind, key) not in current]
        self.shipped = dict(current)
        return out


@dataclass(slots=True)
class Shadow:
    """A follower's copy of one slot's rows, as of ``seq`` of ``stream``."""

    stream: str
    seq: int
    rows: Rows

    def apply(self, batch: Batch) -> bool:
        """Apply the next batch of the stream; False (nothing applied) when it is not the next one."""
        if batch.stream != self.stream or batch.seq != self.seq + 1:
            return batch.stream == self.stream and batch.seq <= self.seq  # an old one: already in
        put(self.rows, batch.rows)
        self.seq = batch.seq
        return True


def put(rows: Rows, changes: list[tuple[str, str, str | None]]) -> None:
    for kind, key, value in changes:
        if value is None:
            rows.pop((kind, key), None)
        else:
            rows[(kind, key)] = value


def of_kind(rows: Mapping[Key, str], kind: str) -> list[str]:
    return [value for (k, _), value in rows.items() if k == kind]
