"""Healing: a store that paused its writes after a storage fault takes them again once the fault is gone,
without a restart.

Two faults pause writes (``core``): a failed fsync (``undurable``) and a failed index write (``index_error``:
after a full disk RocksDB refuses every write until it is reopened). One thread retries every HEAL_RETRY_S,
under the write lock, until both are gone: ``CommitLog.sync_again`` for the first; for the second a reopen
of the index and a replay of the log beyond its checkpoint (``recovery.recover``, as at open: the records of
a delete whose index write failed are applied then). A retry that keeps failing for HEAL_GIVE_UP_S for any
reason but a full disk (which only freed space cures, not a restart) latches ``failed``, so the liveness
probe fails and the pod is restarted.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable
from typing import Final

from lmq_broker import errors
from lmq_broker.storage import core as core_mod
from lmq_broker.storage import recovery

log = logging.getLogger(__name__)

HEAL_RETRY_S: Final = 0.5
HEAL_GIVE_UP_S: Final = 120.0


def disk_full(error: str) -> bool:
    return "No space left" in error or f"[Errno {errno.ENOSPC}]" in error or "quota exceeded" in error.lower()


class Healer:
    """The healing thread of one store (see the module docstring); ``start`` is the core's ``on_fault``."""

    def __init__(self, core: core_mod.Core, on_corruption: Callable[[errors.IndexCorrupt], None]) -> None:
        self._core = core
        self._on_corruption = on_corruption
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.retry_s = HEAL_RETRY_S
        self.give_up_s = HEAL_GIVE_UP_S

    def start(self) -> None:
        """A fault was just recorded: heal it (idempotent, and cheap: a writer under the lock calls it)."""
        with self._lock:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="lmq-store-heal", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            t = self._thread
        if t is not None:
            t.join()

    def _faulty(self) -> bool:
        core = self._core
        return core.undurable is not None or core.index_error is not None

    def _run(self) -> None:
        core = self._core
        since = time.monotonic()
        while True:
            if self._stop.wait(self.retry_s):
                return
            with core.write_lock:
                if core.closed or core.failed is not None:
                    error: str | None = None
                else:
                    error = self._heal_once()
            if error is None or disk_full(error):
                since = time.monotonic()  # only a fault that is not a full disk counts towards giving up
            elif time.monotonic() - since > self.give_up_s:
                core.failed = f"could not recover from a storage fault in {self.give_up_s:.0f} s: {error}"
                log.error("%s; restart the broker", core.failed)
            with self._lock:  # a fault recorded after this check starts a new thread (``_thread`` is None)
                if core.closed or core.failed is not None or not self._faulty():
                    self._thread = None
                    return

    def _heal_once(self) -> str | None:
        """(Under the write lock.) One try at each fault; why one still stands, or None."""
        core = self._core
        if core.undurable is not None:
            try:
                core.log.sync_again()
            except OSError as e:
                core.fsync_failures += 1
                core.undurable = f"fsync failed: {e}"
                return core.undurable
            log.warning("commit log fsync succeeds again (after: %s); writes resume", core.undurable)
            core.undurable = None
        if core.index_error is not None:
            was = core.index_error
            try:
                core.reopen_index()
                core.index.on_corruption = self._on_corruption
                done = recovery.recover(core)
            except errors.LmqError as e:
                core.index_error = e.message
                return e.message
            except Exception as e:  # rocksdict raises bare Exception carrying RocksDB's status text
                core.index_error = str(e)
                return str(e)
            core.index_error = None
            log.warning("index reopened (after: %s), %d records re-indexed; writes resume", was, done.reindexed)
        return None
