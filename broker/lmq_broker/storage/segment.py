"""One segment file of the commit log: append at the end, read anywhere by position, fsync, truncate.

Positional I/O (pwrite/pread) keeps the file offset out of the picture, so readers on any thread share
the one descriptor with the writer. Reads use pread rather than mmap: a 1M-topic broker reading random
records should not grow its resident set with file pages, and pread of a few KiB costs about a microsecond.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Final

from lmq_broker import errors

SUFFIX: Final = ".log"
NAME_DIGITS: Final = 10


def file_name(seq: int) -> str:
    return f"{seq:0{NAME_DIGITS}d}{SUFFIX}"


def parse_name(name: str) -> int | None:
    stem, dot, suffix = name.partition(".")
    if dot + suffix != SUFFIX or len(stem) != NAME_DIGITS or not stem.isdigit():
        return None
    return int(stem)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Segment:
    __slots__ = ("fd", "path", "seq", "size")

    def __init__(self, seq: int, path: Path, fd: int, size: int) -> None:
        self.seq = seq
        self.path = path
        self.fd = fd
        self.size = size

    @classmethod
    def create(cls, directory: Path, seq: int) -> Segment:
        path = directory / file_name(seq)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            fsync_dir(directory)  # the new name must survive a crash as well as its bytes
        except OSError:
            # Not created after all: a file left behind would make every later roll fail (O_EXCL)
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        return cls(seq, path, fd, 0)

    @classmethod
    def open(cls, directory: Path, seq: int) -> Segment:
        path = directory / file_name(seq)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        return cls(seq, path, fd, os.fstat(fd).st_size)

    def append(self, data: bytes | memoryview) -> int:
        """Write ``data`` at the end; return the position it starts at. Partial writes are continued."""
        start = self.size
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], start + done)
        self.size = start + done
        return start

    def read(self, position: int, size: int) -> bytes:
        data = os.pread(self.fd, size, position)
        if len(data) != size:
            raise errors.CorruptRecord(
                "short read: record beyond the end of its segment", segment=self.seq, position=position
            )
        return data

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def truncate(self, size: int, *, sync: bool = True) -> None:
        os.ftruncate(self.fd, size)
        self.size = size
        if sync:
            os.fdatasync(self.fd)

    def close(self) -> None:
        os.close(self.fd)
