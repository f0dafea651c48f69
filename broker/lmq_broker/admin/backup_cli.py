"""``lmq-admin backup DIR`` and ``lmq-admin restore DIR --data-dir D``: the subcommands and their progress lines.

``backup`` calls the broker (its snapshot streams to this machine); ``restore`` is offline: it needs no
broker, only the snapshot directory and the stopped broker's data directory. Progress goes to stderr, one
line per file (name, files and bytes so far), the summary to stdout.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from lmq_broker import errors
from lmq_broker.admin import restoring

if TYPE_CHECKING:
    from lmq_broker.admin.client import AdminClient


def add(resources: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    backup = resources.add_parser(
        "backup",
        help="a consistent snapshot of the broker's store, taken while it serves, into DIR on this machine",
    )
    backup.add_argument("directory", type=Path, metavar="DIR", help="a new or empty directory")
    backup.add_argument("--chunk-bytes", type=int, default=0, help="bytes per streamed message (default 1 MiB)")
    backup.add_argument("--quiet", action="store_true", help="no progress line per file")
    backup.set_defaults(run=_backup)
    restore = resources.add_parser(
        "restore", help="bring a snapshot back into a stopped broker's data directory (offline: no broker call)"
    )
    restore.add_argument("directory", type=Path, metavar="DIR", help="a snapshot written by `lmq-admin backup`")
    restore.add_argument("--data-dir", type=Path, required=True, help="the data directory to restore into")
    restore.add_argument("--force", action="store_true", help="replace the contents of a non-empty --data-dir")
    restore.add_argument("--quiet", action="store_true", help="no progress line per file")
    restore.set_defaults(offline=_restore)


def _reporter(args: argparse.Namespace, err: TextIO) -> restoring.Progress | None:
    if args.quiet:
        return None

    def report(name: str, files: int, total: int) -> None:
        print(f"{files:>6} files {total / 1048576:>10.1f} MiB  {name}", file=err, flush=True)

    return report


def _backup(client: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    try:
        summary = client.backup(args.directory, chunk_bytes=args.chunk_bytes, progress=_reporter(args, args.err))
    except OSError as exc:  # the local side: a full disk, a directory we may not write
        raise errors.StorageError(f"cannot write the snapshot: {exc}") from None
    return _row(summary)


def _restore(args: argparse.Namespace, err: TextIO) -> dict[str, Any]:
    try:
        summary = restoring.restore(args.directory, args.data_dir, force=args.force, progress=_reporter(args, err))
    except OSError as exc:
        raise errors.StorageError(f"cannot restore: {exc}") from None
    return _row(summary)


def _row(summary: restoring.Summary) -> dict[str, Any]:
    return {
        "directory": summary.directory,
        "files": summary.files,
        "bytes": summary.bytes,
        "seconds": round(summary.seconds, 2),
        "taken_ms": summary.taken_ms,
    }
