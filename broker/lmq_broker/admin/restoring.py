"""The caller's side of backups: write a streamed snapshot to a directory, and restore one into a data directory.

A snapshot directory holds the broker's files under their data-directory paths and ``manifest.json``, written
last (to a temporary name, fsynced, renamed): no manifest means the backup did not finish. ``restore`` runs
with the broker stopped; it checks the manifest's format, then copies every listed file into a staging
directory inside the target while hashing it, and moves the files into place only when every size and SHA-256
matched: a refused snapshot leaves the target as it was. See docs/backup.md.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Final

from lmq_broker import errors
from lmq_broker.admin import credentials
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as pb
from lmq_broker.storage.markers import RESTORE_MARKER, RESTORED_ID
from lmq_broker.storage.segment import fsync_dir

FORMAT: Final = 1  # the snapshot format this code writes and reads: a newer one is refused
CREDENTIALS: Final = credentials.FILE_NAME  # holds the admin secret: restored with mode 0600
MANIFEST: Final = "manifest.json"
RESTORING: Final = ".restoring"  # inside the target while files are copied and checked
COPY_BYTES: Final = 1024 * 1024
_SHA256_HEX: Final = 64
Progress = Callable[[str, int, int], None]  # (file done, files so far, bytes so far)


@dataclass(frozen=True, slots=True)
class Summary:
    directory: str
    files: int
    bytes: int
    seconds: float
    taken_ms: int


def receive(responses: Iterable[pb.BackupResponse], target: Path, progress: Progress | None = None) -> Summary:
    """Write a ``Backup`` stream into ``target`` (new or empty); the manifest goes last, once every file the
    broker listed arrived with its size and hash."""
    started = time.monotonic()
    if target.exists() and any(target.iterdir()):
        raise errors.Conflict(f"{target} is not empty: back up into a new or empty directory", path=str(target))
    target.mkdir(parents=True, exist_ok=True)
    writer = _Writer(target, progress)
    parts = iter(responses)
    try:
        for response in parts:
            if response.WhichOneof("part") == "chunk":
                writer.chunk(response.chunk)
            elif response.WhichOneof("part") == "manifest":
                writer.finish(response.manifest)
                for _ in parts:  # read the stream to its end, so the broker sees the backup through
                    pass
                seconds = time.monotonic() - started
                return Summary(str(target), writer.files, writer.bytes, seconds, response.manifest.taken_ms)
    finally:
        writer.close()
        close = getattr(parts, "close", None)
        if close is not None:  # a generator over a call: cancel it now, not when the traceback goes
            close()
    raise errors.BrokerUnavailable(f"the backup stream ended before its manifest: {target} is incomplete")


class _Writer:
    def __init__(self, target: Path, progress: Progress | None) -> None:
        self._target = target
        self._progress = progress
        self._open: tuple[str, BinaryIO, Any] | None = None
        self._seen: dict[str, tuple[int, str]] = {}
        self.files = 0
        self.bytes = 0

    def chunk(self, part: pb.BackupChunk) -> None:
        if self._open is None or self._open[0] != part.path:
            self._done()
            path = _inside(self._target, part.path)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._open = (part.path, path.open("xb"), hashlib.sha256())
        name, out, digest = self._open
        if part.offset != out.tell():
            raise errors.StorageError(f"{name}: chunk at {part.offset}, expected {out.tell()}")
        out.write(part.data)
        digest.update(part.data)
        self.bytes += len(part.data)

    def _done(self) -> None:
        if self._open is None:
            return
        name, out, digest = self._open
        out.flush()
        os.fsync(out.fileno())
        self._seen[name] = (out.tell(), digest.hexdigest())
        out.close()
        self._open = None
        self.files += 1
        if self._progress is not None:
            self._progress(name, self.files, self.bytes)

    def close(self) -> None:
        if self._open is not None:
            self._open[1].close()

    def finish(self, manifest: pb.BackupManifest) -> None:
        self._done()
        for f in manifest.files:
            if self._seen.get(f.path) != (f.size, f.sha256):
                raise errors.StorageError(f"{f.path} did not arrive as the broker sent it", path=f.path)
        text = json.dumps(_manifest_dict(manifest), indent=1) + "\n"
        _write_durably(self._target / MANIFEST, text.encode())


def _manifest_dict(m: pb.BackupManifest) -> dict[str, Any]:
    return {
        "format": m.format,
        "taken_ms": m.taken_ms,
        "broker_version": m.broker_version,
        "log_end": [m.log_end_segment, m.log_end_position],
        "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in m.files],
    }


def _write_durably(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    tmp.replace(path)
    fsync_dir(path.parent)


def _inside(root: Path, name: str) -> Path:
    """``root/name`` for a relative, "/"-separated name that stays inside ``root`` (a stream or manifest
    could name ``../x``)."""
    rel = PurePosixPath(name)
    if not name or rel.is_absolute() or ".." in rel.parts or rel.parts[0] in (MANIFEST, RESTORING):
        raise errors.InvalidArgument(f"bad file name in snapshot: {name!r}", path=name)
    return root.joinpath(*rel.parts)


# --- restore ---------------------------------------------------------------------------------------------


def read_manifest(snapshot: Path) -> dict[str, Any]:
    """The manifest of a complete snapshot; refuses a partial one and one of a newer format."""
    try:
        manifest = json.loads((snapshot / MANIFEST).read_text())
    except FileNotFoundError:
        raise errors.InvalidArgument(
            f"{snapshot} has no {MANIFEST}: not a complete snapshot (the backup did not finish)", path=str(snapshot)
        ) from None
    except (OSError, ValueError) as exc:
        raise errors.InvalidArgument(f"{snapshot / MANIFEST} is unreadable: {exc}", path=str(snapshot)) from None
    if not isinstance(manifest, dict):
        raise errors.InvalidArgument(f"{snapshot / MANIFEST} is not a snapshot's manifest", path=str(snapshot))
    fmt = manifest.get("format")
    if not isinstance(fmt, int) or fmt > FORMAT:
        raise errors.UnsupportedVersion(
            f"snapshot format {fmt!r} is newer than this lmq-admin reads ({FORMAT}): restore with a newer one",
            version=fmt,
        )
    _check_shape(snapshot, manifest)
    return dict(manifest)


def _check_shape(snapshot: Path, manifest: dict[str, Any]) -> None:
    """A manifest of the format read: ``taken_ms`` a number, ``files`` a list of distinct paths, each with a
    size and a SHA-256; anything else (a damaged or hand-edited manifest) is refused before a file is copied."""

    def bad(problem: str) -> errors.InvalidArgument:
        return errors.InvalidArgument(
            f"{snapshot / MANIFEST} is damaged or altered: {problem}", path=str(snapshot / MANIFEST)
        )

    if type(manifest.get("taken_ms")) is not int:
        raise bad("taken_ms is not a number")
    files = manifest.get("files")
    if not isinstance(files, list):
        raise bad("files is not a list")
    seen: set[str] = set()
    for n, f in enumerate(files):
        if not (
            isinstance(f, dict)
            and isinstance(f.get("path"), str)
            and type(f.get("size")) is int
            and f["size"] >= 0
            and isinstance(f.get("sha256"), str)
            and len(f["sha256"]) == _SHA256_HEX
        ):
            raise bad(f"files[{n}] is not a path, a size and a SHA-256")
        if f["path"] in seen:
            raise bad(f"{f['path']!r} is listed twice")
        seen.add(f["path"])


def restore(snapshot: Path, data_dir: Path, *, force: bool = False, progress: Progress | None = None) -> Summary:
    """Copy a complete, unaltered snapshot into ``data_dir`` (the broker stopped). A non-empty ``data_dir`` is
    refused unless ``force`` (its contents are then replaced, never while a broker holds it)."""
    started = time.monotonic()
    manifest = read_manifest(snapshot)
    inner, outer = snapshot.resolve(), data_dir.resolve()
    if inner == outer or outer in inner.parents or inner in outer.parents:
        raise errors.InvalidArgument(
            f"the snapshot {snapshot} and the data directory {data_dir} overlap: restoring would delete the snapshot "
            "or write into it; move the snapshot out of the data directory first",
            path=str(snapshot),
        )
    existed = data_dir.exists()
    if existed and any(data_dir.iterdir()):
        if not force:
            raise errors.Conflict(f"{data_dir} is not empty: restore into an empty directory, or give --force")
        _check_not_in_use(data_dir)
    staging = data_dir / RESTORING
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        total = _copy_checked(snapshot, staging, manifest["files"], progress)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if not existed:
            shutil.rmtree(data_dir, ignore_errors=True)
        raise
    _write_durably(staging / RESTORED_ID, uuid.uuid4().hex.encode() + b"\n")  # a new source of relocated offsets
    marker = data_dir / RESTORE_MARKER
    _write_durably(marker, b"a restore is moving files into this directory\n")  # the broker will not open it
    for entry in data_dir.iterdir():
        if entry.name in (RESTORING, RESTORE_MARKER):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    for entry in staging.iterdir():
        entry.rename(data_dir / entry.name)
    staging.rmdir()
    fsync_dir(data_dir)  # the renames: a power cut right after a restore must not bring back part of the staging
    marker.unlink()
    fsync_dir(data_dir)
    files = len(manifest["files"])
    return Summary(str(data_dir), files, total, time.monotonic() - started, int(manifest["taken_ms"]))


def _copy_checked(snapshot: Path, staging: Path, files: list[dict[str, Any]], progress: Progress | None) -> int:
    total = 0
    for n, f in enumerate(files, 1):
        name = str(f["path"])
        source, target = _inside(snapshot, name), _inside(staging, name)
        target.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        try:
            with source.open("rb") as src, target.open("xb") as out:
                while data := src.read(COPY_BYTES):
                    digest.update(data)
                    out.write(data)
                out.flush()
                os.fsync(out.fileno())
                size = out.tell()
        except FileNotFoundError:
            raise errors.InvalidArgument(f"snapshot file {name} is missing", path=name) from None
        if size != f["size"] or digest.hexdigest() != f["sha256"]:
            raise errors.InvalidArgument(
                f"snapshot file {name} does not match its manifest ({size} bytes, expected {f['size']}; "
                "or its SHA-256 differs): the snapshot was damaged or altered",
                path=name,
            )
        if name == CREDENTIALS:
            target.chmod(0o600)
        total += size
        if progress is not None:
            progress(name, n, total)
    return total


def _check_not_in_use(data_dir: Path) -> None:
    """Refuse a data directory a broker has open: RocksDB holds a POSIX lock on ``meta/LOCK`` while it runs."""
    lock = data_dir / "meta" / "LOCK"
    if not lock.exists():
        return
    with lock.open("rb+") as f:
        try:
            fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise errors.Conflict(f"{data_dir} is in use by a running broker: stop it before restoring") from None
        fcntl.lockf(f, fcntl.LOCK_UN)
