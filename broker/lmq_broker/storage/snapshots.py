"""A consistent copy of a serving store, for ``lmq-admin backup`` (docs/backup.md).

Under the write lock (no append round, commit or lite-topic delete in flight) the snapshot hard-links every
segment file and notes its size, and takes a RocksDB checkpoint of ``index/`` and of ``meta/``. The lock is
held for a few milliseconds: links and checkpoints copy no data (a checkpoint links table files and flushes
the memtable). The copy itself happens afterwards, outside the lock, reading each linked segment only up to
the noted size: the log only grows at its end, a cut (``undo_round``) only removes bytes above where the
round began, and a segment that retention unlinks meanwhile lives on through its link.

So the index checkpoint (``X``) is exactly the copied log end, and no consumer offset, ack or hand-out in
the meta checkpoint lies past it (in ``sync`` mode a record is indexed, so delivered, only after its fsync;
commits take the same lock). A restored store opens as after a crash of the broker at that instant:
recovery finds nothing to replay and, in ``async`` mode, reconciles offsets as it always does.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from lmq_broker import errors
from lmq_broker.storage import core as core_mod
from lmq_broker.storage import segment as seg_mod

COMMITLOG: Final = "commitlog"
INDEX: Final = "index"
META: Final = "meta"


@dataclass(frozen=True, slots=True)
class SnapshotFile:
    """One file of a snapshot: its path below the data directory, where to read it and how many bytes."""

    name: str  # relative, "/"-separated: "commitlog/0000000003.log", "meta/000012.sst"
    source: Path
    size: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    files: tuple[SnapshotFile, ...]
    log_end: tuple[int, int]  # (segment, position): the copied log ends here
    taken_ms: int


def take(core: core_mod.Core, staging: Path) -> Snapshot:
    """Link and checkpoint the store into ``staging`` (a new directory on the data directory's file system,
    removed by the caller when the copy is done)."""
    staging.mkdir(parents=True)
    with core.write_lock:
        core.check_open()
        busy = core.rebuilding or core.unreadable or core.failed or core.index_error or core.meta.error
        if busy is not None:  # (a read-only reopen of meta/ or index/ cannot be checkpointed)
            raise errors.BrokerUnavailable(f"no snapshot while the store is unwell: {core.health() or busy}")
        taken = core.clock()
        logs = staging / COMMITLOG
        logs.mkdir()
        files = []
        for seq in core.log.seqs():
            name = seg_mod.file_name(seq)
            os.link(core.log.directory / name, logs / name)
            files.append(SnapshotFile(f"{COMMITLOG}/{name}", logs / name, core.log.size_of(seq)))
        last = core.log.seqs()[-1]
        end = (last, core.log.size_of(last))
        core.index.copy_to(staging / INDEX)
        core.meta.copy_to(staging / META)
    for part in (INDEX, META):
        files.extend(_tree(staging, part))
    return Snapshot(tuple(files), end, taken)


def discard(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)


def _tree(staging: Path, part: str) -> list[SnapshotFile]:
    root = staging / part
    return [
        SnapshotFile(f"{part}/{path.relative_to(root).as_posix()}", path, path.stat().st_size)
        for path in sorted(root.rglob("*"))
        if path.is_file()
    ]
