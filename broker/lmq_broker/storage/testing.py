"""Test helpers for the stores (used by the storage and broker suites)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

from lmq_broker import model
from lmq_broker.storage.api import Store, complete
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


def append_if_free(store: Store, messages: Sequence[model.NewMessage]) -> list[model.AppendResult] | None:
    """``store.append(messages)`` unless another writer holds the write path (then None, nothing written): the
    ``try_begin`` + ``complete`` the dispatcher's appender does, carried through on the calling thread."""
    pending = store.try_begin([messages])
    if pending is None:
        return None
    (outcome,) = complete(pending)
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome
