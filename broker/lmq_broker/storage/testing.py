"""Test helpers for the stores (used by the storage and broker suites)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from lmq_broker.storage.api import Store
from lmq_broker.storage.memory import MemoryStore
from lmq_broker.storage.store import LmqStore


@contextlib.contextmanager
def another_writer(store: Store) -> Iterator[None]:
    """While inside, another thread holds the lock the store's writers take (LmqStore's write lock, the
    in-memory twin's only lock): ``try_begin`` and ``try_commit_offset`` refuse, blocking writers wait."""
    if isinstance(store, LmqStore):
        lock: contextlib.AbstractContextManager[object] = store._core.write_lock
    elif isinstance(store, MemoryStore):
        lock = store._lock
    else:
        raise TypeError(f"no write lock known for {type(store).__name__}")
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            inside.set()
            leave.wait(30)

    holder = threading.Thread(target=hold, name="another-writer")
    holder.start()
    try:
        if not inside.wait(10):
            raise TimeoutError("the other writer never got the store's write lock")
        yield
    finally:
        leave.set()
        holder.join()
