"""The broker's side of ``lmq-admin backup``: snapshot the store, stream the files, the manifest last.

The store links its segments and checkpoints its RocksDB instances under its write lock
(``storage.snapshots``) into a staging directory inside the data directory (hard links need the same file
system); the MQTT sessions are copied with SQLite's online backup API, the saved lite subscriptions and the
admin credentials as files (each is replaced whole by a rename, so a copy is one version). Then every file is
streamed in chunks, hashed on the way, and the manifest (sizes, SHA-256) goes last: a receiver that has no
manifest has no complete snapshot. The staging directory goes when the stream ends, however it ends; one
left by a crash is removed by the next backup.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import shutil
import sqlite3
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final, NoReturn, Protocol, runtime_checkable

import grpc

import lmq_broker
from lmq_broker import errors
from lmq_broker.admin import restoring
from lmq_broker.dispatch import saved_subscriptions
from lmq_broker.mqtt import durable
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as pb
from lmq_broker.storage import snapshots
from lmq_broker.storage.api import Store

log = logging.getLogger(__name__)

STAGING: Final = "backup-staging"  # below the data directory
CHUNK_BYTES: Final = 1024 * 1024
MAX_CHUNK_BYTES: Final = 3 * 1024 * 1024  # under gRPC's 4 MiB message cap with room for the framing
COPIED_FILES: Final = (saved_subscriptions.FILE_NAME, restoring.CREDENTIALS)
# A caller that takes no message of the stream for this long is cut off (CANCELLED): a suspended or wedged
# ``lmq-admin backup`` held the broker's one backup and the staging links (segments retention cannot free).
STALL_S: Final = 300.0
ABORT_WAIT_S: Final = 1.0


@dataclass
class Tally:
    """Backups served by this process, by outcome (``lmq_backups_total{outcome}``)."""

    done: int = 0
    refused: int = 0  # another backup of the same data directory was running
    failed: int = 0  # the store was unwell, a file could not be read, or the caller went away

    def outcomes(self) -> dict[str, float]:
        return {"done": self.done, "refused": self.refused, "failed": self.failed}


TALLY: Final = Tally()
_running: set[Path] = set()  # data directories with a backup under way (a broker may serve admin on two ports)


@runtime_checkable
class Snapshotting(Protocol):
    """A store that keeps its state on disk (``LmqStore``; the in-memory twin has nothing to back up)."""

    def snapshot(self, staging: Path) -> snapshots.Snapshot: ...


class Backups:
    """Backups of one broker's store, one at a time."""

    def __init__(self, store: Store, data_dir: Path) -> None:
        self._store = store
        self._data_dir = data_dir.resolve()

    async def stream(
        self, request: pb.BackupRequest, context: Aborting | None = None
    ) -> AsyncGenerator[pb.BackupResponse, None]:
        """The snapshot's parts, the manifest last; ``context``, the call's, ends a stalled caller's call."""
        chunk = request.chunk_bytes or CHUNK_BYTES
        if not 0 < chunk <= MAX_CHUNK_BYTES:
            raise errors.InvalidArgument(f"chunk_bytes must be 1..{MAX_CHUNK_BYTES}", chunk_bytes=chunk)
        if not isinstance(self._store, Snapshotting):
            raise errors.Unsupported("this broker's store keeps nothing on disk to back up")
        if self._data_dir in _running:
            TALLY.refused += 1
            raise errors.Conflict("a backup of this broker is already running; retry when it is done")
        _running.add(self._data_dir)
        staging = self._data_dir / STAGING
        done = False
        watch = _Watchdog(STALL_S, context)
        try:
            await asyncio.to_thread(snapshots.discard, staging)  # a crashed backup's leftovers
            snap = await asyncio.to_thread(self._prepare, staging)
            listed = []
            for item in snap.files:
                digest = hashlib.sha256()
                async for part in _chunks(item, chunk, digest):
                    watch.arm()
                    yield pb.BackupResponse(chunk=part)
                    watch.disarm()
                listed.append(pb.BackupFile(path=item.name, size=item.size, sha256=digest.hexdigest()))
            watch.arm()
            yield pb.BackupResponse(manifest=_manifest(snap, listed))
            done = True
        finally:
            watch.disarm()
            snapshots.discard(staging)  # (synchronous: an async generator may be closed outside a loop turn)
            _running.discard(self._data_dir)
            if done:
                TALLY.done += 1
            else:
                TALLY.failed += 1

    def _prepare(self, staging: Path) -> snapshots.Snapshot:
        """(A worker thread.) The store's snapshot plus the broker's other state files."""
        assert isinstance(self._store, Snapshotting)
        snap = self._store.snapshot(staging)
        files = list(snap.files)
        sessions = self._data_dir / durable.FILE_NAME
        if sessions.exists():
            copy = staging / durable.FILE_NAME
            _backup_sqlite(sessions, copy)
            files.append(snapshots.SnapshotFile(durable.FILE_NAME, copy, copy.stat().st_size))
        for name in COPIED_FILES:
            try:
                shutil.copyfile(self._data_dir / name, staging / name)
            except FileNotFoundError:
                continue
            files.append(snapshots.SnapshotFile(name, staging / name, (staging / name).stat().st_size))
        return snapshots.Snapshot(tuple(files), snap.log_end, snap.taken_ms)


class Aborting(Protocol):
    """What the watchdog needs of a call's context (grpcio's or the native edge's)."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn: ...


class _Watchdog:
    """Ends the call when the caller has not taken the last message within ``seconds``: its write waits on
    HTTP/2 flow control for as long as the caller reads nothing, and the stream's ``finally`` would never run.
    The call is aborted CANCELLED (grpcio sends that status; the native edge sends it once its task ends), then
    the task that drives the stream is cancelled, which closes the stream."""

    def __init__(self, seconds: float, context: Aborting | None) -> None:
        self._seconds = seconds
        self._context = context
        self._task = asyncio.current_task()
        self._timer: asyncio.TimerHandle | None = None
        self._cutting: asyncio.Task[None] | None = None

    def arm(self) -> None:
        self.disarm()
        self._timer = asyncio.get_running_loop().call_later(self._seconds, self._stalled)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _stalled(self) -> None:
        log.warning("a backup's caller took nothing for %.0f s: the backup is cut off", self._seconds)
        self._cutting = asyncio.get_running_loop().create_task(self._cut())

    async def _cut(self) -> None:
        if self._context is not None:
            message = f"the caller took no part of the backup for {self._seconds:.0f} s: cut off"
            abort = self._context.abort(grpc.StatusCode.CANCELLED, message)
            # AbortError: the status is on its way; a timeout: it waits behind the stalled write (grpcio)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(abort, ABORT_WAIT_S)
        if self._task is not None:
            self._task.cancel()


def _backup_sqlite(source: Path, target: Path) -> None:
    """SQLite's online backup: a consistent copy while the MQTT listener keeps writing."""
    src = sqlite3.connect(f"file:{source}?mode=ro", uri=True)
    try:
        dst = sqlite3.connect(target)
        try:
            src.backup(dst)
        finally:
            dst.close()
    finally:
        src.close()


async def _chunks(item: snapshots.SnapshotFile, size: int, digest: hashlib._Hash) -> AsyncIterator[pb.BackupChunk]:
    """The first ``item.size`` bytes of the file (a linked segment may have grown since it was noted)."""
    with item.source.open("rb") as f:
        offset = 0
        while True:
            data = await asyncio.to_thread(f.read, min(size, item.size - offset))
            if offset < item.size and not data:
                raise errors.StorageError(f"{item.name} ended at {offset} of {item.size} bytes while being copied")
            digest.update(data)
            if data or offset == 0:
                yield pb.BackupChunk(path=item.name, offset=offset, data=data)
            offset += len(data)
            if offset >= item.size:
                return


def _manifest(snap: snapshots.Snapshot, files: list[pb.BackupFile]) -> pb.BackupManifest:
    return pb.BackupManifest(
        format=restoring.FORMAT,
        taken_ms=snap.taken_ms,
        broker_version=lmq_broker.__version__,
        log_end_segment=snap.log_end[0],
        log_end_position=snap.log_end[1],
        files=files,
    )
