"""Lite topics taken over from a leaving slot, written down for good (docs/replication.md, *Changing the ring with
R > 1*).

A leaving slot's topic is taken over by the holder of its slot in the smaller ring (``setup.Replication.adopt``)
and goes on there where it ended: its next record names the new slot. A topic taken over idle keeps a last
record naming the leaving slot. Once that slot is removed, ``owning.Slots.recorded`` files such a topic by today's
ring, which is right only until a later scale-up brings the removed slot's number back (the re-added pod is that
slot again, on its old disk or a new one): its records would then file it under the new slot, whose pod lacks what
was stored since, or all of it. So each take-over is written down: the topic, the slot it left, the slot it went
to and the id of its last record then. While a topic's last record is still that one, naming that slot, the
topic belongs to the slot it went to (``slot_of``); a record stored since names its slot itself.

Written at the taker before the take-over counts as done, and at the leaving holder once told it is done; shipped
as state rows (kind ``MOVED``, ``stating``) of both slots, so every replica of either holds them (a new replica
from the snapshot it fetches before it counts as in sync), each writing the rows it gets here. Kept as JSON lines
in the data directory, one appended and fsynced per take-over (a scale-down's topics, once each), read at start.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Final

log = logging.getLogger(__name__)

FILE: Final = "moved-topics.jsonl"
MOVED: Final = "moved"  # the state rows' kind (``stating``)


@dataclass(frozen=True, slots=True)
class Move:
    left: int  # the slot it was taken over from (leaving then)
    went: int  # the slot that took it over
    last: str  # the message id of its last record then


class Moved:
    def __init__(self, data_dir: Path) -> None:
        self._path = data_dir / FILE
        self._rows: dict[str, Move] = {}  # LMQ name -> its take-over
        self._lock = threading.Lock()  # appends come from the loop's threads (``asyncio.to_thread``)
        self.version = 0  # changes with every row added (the state rows look again)
        try:
            data = self._path.read_bytes()
        except FileNotFoundError:
            data = b""
        whole = data.rfind(b"\n") + 1
        if whole < len(data):
            # A line cut by a crash while it was appended (never counted as written down: ``put`` returns after
            # the fsync). Cut off, or the next row would be appended onto it: one line that decodes as nothing.
            log.warning(
                "replication: %s ends in a line cut by a crash (%d bytes): cut off", self._path, len(data) - whole
            )
            with self._path.open("r+b") as out:
                out.truncate(whole)
                os.fsync(out.fileno())
        damaged = 0
        for line in data[:whole].splitlines():
            try:
                topic, move = _decode(line.decode())
            except (ValueError, KeyError, TypeError):  # UnicodeDecodeError is a ValueError
                damaged += 1
                continue
            self._rows[topic] = move
        if damaged:
            log.error(
                "replication: %d damaged lines of %s skipped: the take-overs they held are not known here (those "
                "topics go by the slot their last record names)", damaged, self._path,
            )  # fmt: skip
        if self._rows:
            log.info("replication: %d lite topics taken over from leaving slots are known here", len(self._rows))

    def slot_of(self, topic: str, recorded: int, last: str) -> int:
        """The slot of ``topic`` whose last record here names ``recorded`` and has the id ``last``: the slot that
        took it over when it was taken over with that last record from that slot, else ``recorded``."""
        move = self._rows.get(topic)
        if move is not None and move.left == recorded and move.last == last and recorded >= 0:
            return move.went
        return recorded

    def left(self, topic: str) -> int:
        """The slot ``topic`` was taken over from (-1: none)."""
        move = self._rows.get(topic)
        return -1 if move is None else move.left

    def put(self, topic: str, move: Move) -> bool:
        """Blocking (an fsync). Write a take-over down; False when it was already."""
        with self._lock:
            if self._rows.get(topic) == move:
                return False
            self._path.parent.mkdir(parents=True, exist_ok=True)
            with self._path.open("a") as out:
                out.write(_encode(topic, move) + "\n")
                out.flush()
                os.fsync(out.fileno())
            self._rows[topic] = move
            self.version += 1
            return True

    def rows_of(self, slot: int) -> dict[str, str]:
        """LMQ name -> the take-over's row (``_encode``) of every topic that left or went to ``slot``."""
        return {t: _encode(t, m) for t, m in list(self._rows.items()) if slot in {m.left, m.went}}

    def take(self, rows: list[tuple[str, str]]) -> list[str]:
        """Blocking. A holder's rows (LMQ name, row) written down here; the topics whose take-over is new here."""
        out: list[str] = []
        for topic, text in rows:
            try:
                named, move = _decode(text)
            except (ValueError, KeyError, TypeError):
                continue
            if named == topic and self.put(topic, move):
                out.append(topic)
        return out


def _encode(topic: str, move: Move) -> str:
    return json.dumps({"topic": topic, "left": move.left, "went": move.went, "last": move.last}, separators=(",", ":"))


def _decode(text: str) -> tuple[str, Move]:
    v = json.loads(text)
    return str(v["topic"]), Move(int(v["left"]), int(v["went"]), str(v["last"]))
