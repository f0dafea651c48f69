"""Lite subscriptions survive a restart, a crash included.

Subscriptions live in memory, owned by client ids, as in RocketMQ. A client only re-sends its whole set
every 30 s (COMPLETE_ADD), and the Python 5.1.2 client never rebuilds a broken telemetry stream, so after
a restart its consumers would idle for up to 30 s. The broker therefore writes the registry to
``lite-subscriptions.jsonl`` in the data directory (one JSON object per client, written to a temporary file,
fsynced and renamed): at shutdown, and while it runs whenever the subscriptions changed, at most once per
``--subscriptions-save-interval-ms`` (1 s) and after a wait of at least ten times what the last write cost, so
a large registry is written less often rather than taking more than a tenth of a thread. A broker killed with
SIGKILL comes back with what it held at the last write; what changed after it comes back with the clients'
next sync (or, in a cluster, from the access brokers that keep the clients' intents). Restored clients expire
like any other if they do not come back. Under ``--acl`` each client's line also names the user that made its
subscriptions and its address, so they are checked against the rules as soon as they are restored
(``protocol.revoking``). The write runs on a thread and encodes a client's names
``ENCODE_SLICE`` at a time, so a client of 100,000 lite topics never holds the event loop for long.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from lmq_broker.storage.segment import fsync_dir

FILE_NAME: Final = "lite-subscriptions.jsonl"
PACE: Final = 10  # the wait after a write is at least this many times what the write cost
ENCODE_SLICE: Final = 2000  # names per JSON encoding call: the GIL goes back to the event loop in between
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ClientRecord:
    client_id: str
    client_type: int
    group: str
    bind_topic: str
    lmqs: tuple[str, ...]
    patterns: tuple[str, ...] = ()  # lite topic patterns (``wildcards``)
    owner: tuple[str, str] = ("", "")  # the user that made them and its address (``--acl``), ("", ""): unknown


def _json_list(names: tuple[str, ...]) -> str:
    """``json.dumps(list(names))``, encoded in slices (one C call over 100,000 names holds the GIL ~25 ms)."""
    parts = [json.dumps(names[i : i + ENCODE_SLICE])[1:-1] for i in range(0, len(names), ENCODE_SLICE)]
    return "[" + ", ".join(parts) + "]"


def save(records: list[ClientRecord], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as out:
        for r in records:
            fields = {"client": r.client_id, "type": r.client_type, "group": r.group, "bind": r.bind_topic}
            if r.owner[0]:
                fields["user"], fields["peer"] = r.owner
            row = json.dumps(fields)
            out.write(f'{row[:-1]}, "lmqs": {_json_list(r.lmqs)}, "patterns": {_json_list(r.patterns)}}}\n')
        out.flush()
        os.fsync(out.fileno())
    tmp.replace(path)
    fsync_dir(path.parent)  # the rename itself, or a power cut could bring the older snapshot back


def load(path: Path) -> list[ClientRecord]:
    """Read the last written registry (kept: the running broker replaces it); a damaged line is skipped."""
    if not path.exists():
        return []
    records = []
    skipped = 0
    for raw in path.read_bytes().splitlines():
        try:
            row = json.loads(raw.decode())  # a byte that is not UTF-8 damages its line, not the file
            records.append(
                ClientRecord(
                    str(row["client"]),
                    int(row["type"]),
                    str(row["group"]),
                    str(row["bind"]),
                    tuple(str(x) for x in row["lmqs"]),
                    tuple(str(x) for x in row.get("patterns", ())),  # absent in snapshots from before patterns
                    (str(row.get("user", "")), str(row.get("peer", ""))),  # absent without --acl or from before
                )
            )
        except (ValueError, KeyError, TypeError):  # UnicodeDecodeError is a ValueError
            skipped += 1
    if skipped:
        log.warning("%s: %d damaged line(s) skipped; those clients re-subscribe with their next sync", path, skipped)
    return records


class Saver:
    """Writes the registry (``export``) to ``path`` whenever its ``version`` moved, paced by ``interval_ms``
    and by what the last write cost. A failed write (a full disk) is logged, counted and tried again."""

    def __init__(
        self, version: Callable[[], int], export: Callable[[], list[ClientRecord]], path: Path, interval_ms: int
    ) -> None:
        self._version = version
        self._export = export
        self._path = path
        self._interval_s = interval_ms / 1000
        self._wait_s = self._interval_s
        self._saved = -1  # the first pass always writes: a stale file from before must not outlive a start
        self.writes = 0
        self.failures = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._wait_s)
            await self.save_if_changed()

    async def save_if_changed(self) -> bool:
        version = self._version()
        if version == self._saved:
            return False
        began = time.monotonic()
        records = self._export()
        write = asyncio.ensure_future(asyncio.to_thread(save, records, self._path))
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            # A cancelled task does not stop its thread: the write finishes (its rename included) before this
            # task ends, so the final save at shutdown never races it for the same temporary file.
            await asyncio.wait([write])
            if not write.cancelled() and write.exception() is not None:
                log.warning("lite subscriptions not saved at cancellation: %s", write.exception())
            raise
        except OSError as exc:
            self.failures += 1
            log.warning("lite subscriptions not saved (tried again in %.1f s): %s", self._wait_s, exc)
            return False
        self._saved = version
        self.writes += 1
        self._wait_s = max(self._interval_s, PACE * (time.monotonic() - began))
        return True
