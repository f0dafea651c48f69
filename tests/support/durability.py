"""What a test checks of a write that must survive a power cut: which files and directories were fsynced."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    """Every path ``os.fsync`` is called on meanwhile, a directory ending in "/" (the real fsync runs too)."""
    synced: list[Path] = []
    real = os.fsync

    def spy(fd: int) -> None:
        target = Path(os.readlink(f"/proc/self/fd/{fd}"))
        synced.append(Path(f"{target}/") if stat.S_ISDIR(os.fstat(fd).st_mode) else target)
        real(fd)

    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", spy)
        yield synced
