"""Lite subscriptions survive a graceful restart.

Subscriptions live in memory, owned by client ids, as in RocketMQ. A client only re-sends its whole set
every 30 s (COMPLETE_ADD), and the Python 5.1.2 client never rebuilds a broken telemetry stream, so after
a plain restart its consumers would idle for up to 30 s. On SIGTERM the broker therefore writes the
registry to ``lite-subscriptions.jsonl`` in the data directory (one JSON object per client, written to a
temporary file and renamed) and reads it back, once, on start. Restored clients expire like any other
if they do not come back. After a crash there is no snapshot and clients re-sync within 30 s.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

FILE_NAME: Final = "lite-subscriptions.jsonl"
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ClientRecord:
    client_id: str
    client_type: int
    group: str
    bind_topic: str
    lmqs: tuple[str, ...]
    patterns: tuple[str, ...] = ()  # lite topic patterns (``wildcards``)


def save(records: list[ClientRecord], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as out:
        for r in records:
            row = {"client": r.client_id, "type": r.client_type, "group": r.group, "bind": r.bind_topic}
            out.write(json.dumps({**row, "lmqs": list(r.lmqs), "patterns": list(r.patterns)}) + "\n")
        out.flush()
        os.fsync(out.fileno())
    tmp.replace(path)


def take(path: Path) -> list[ClientRecord]:
    """Read and delete the snapshot (a later crash must not resurrect it); a damaged line is skipped."""
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
                )
            )
        except (ValueError, KeyError, TypeError):  # UnicodeDecodeError is a ValueError
            skipped += 1
    if skipped:
        log.warning("%s: %d damaged line(s) skipped; those clients re-subscribe with their next sync", path, skipped)
    path.unlink()
    return records
