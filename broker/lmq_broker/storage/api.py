"""The store's contract. ``LmqStore`` (segments + RocksDB) and ``MemoryStore`` (the in-memory twin)
both implement it, and one contract suite (tests/storage/test_contract.py) runs against both.

All methods are thread-safe and blocking. Callers on an event loop run them in an executor (``try_begin``
is the exception: it never waits for another writer, and leaves the fsync and the rest to the caller); in
``sync`` flush mode ``append`` returns only after the records are fsynced, and concurrent appends share one
fsync.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from lmq_broker import errors, model

Clock = Callable[[], int]  # milliseconds; both stores take one (``memory.ManualClock`` in tests)


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class RetentionReport:
    segments_deleted: int
    bytes_deleted: int
    queues_advanced: int


@dataclass(frozen=True, slots=True)
class FaultStats:
    """Storage faults of one store (its metrics): failed fsyncs (retries included), whether the log can be
    made durable and the index written now, index reopens after a failed write, writes refused meanwhile."""

    fsync_failures: int
    durable: bool
    index_writable: bool
    index_reopens: int
    refused: dict[str, int]  # by reason: not_durable, index_unwritable


class PendingAppend(Protocol):
    """Appends written to the log by ``Store.try_begin``, not yet durable nor visible; the write path stays
    taken until ``finish``, which must be called exactly once."""

    @property
    def needs_sync(self) -> bool:
        """True in ``sync`` flush mode when something was written: call ``sync`` before ``finish``."""
        ...

    def sync(self) -> None:
        """fsync the log (blocking: a few hundred microseconds on a quick disk, more on a slow one)."""
        ...

    def finish(self, sync_error: BaseException | None = None) -> list[list[model.AppendResult] | BaseException]:
        """Index what was written and make it visible (``sync_error``: the fsync failed, so nothing is: the
        records are cut off the log and writes pause until an fsync succeeds); frees the write path. One
        outcome per request: its results or its error."""
        ...


class Store(Protocol):
    # --- messages -------------------------------------------------------------------------------------
    def append(self, messages: Sequence[model.NewMessage]) -> list[model.AppendResult]:
        """Store every message once and index it into each of its queues, atomically per call.

        Raises InvalidArgument subclasses (nothing written) for empty bodies, oversized records or invalid
        queue names. Creating an LMQ's first entry creates its lite-topic metadata.
        """
        ...

    def try_begin(self, requests: Sequence[Sequence[model.NewMessage]]) -> PendingAppend | None:
        """Start appending ``requests`` (each atomic on its own, in order), unless another writer holds the
        write path right now: then None, and nothing written.

        For a caller that must not wait for another writer (an event loop): the records are validated
        and written, but neither fsynced nor indexed (so nobody can read them yet), and the store's write path
        stays taken until the caller calls ``finish`` on what it gets back, after ``sync`` when
        ``needs_sync``. A request that fails validation fails alone (its outcome is the error).

        Never take the write path blocking (``append``, offsets, metadata) on the thread that holds a pending
        append: ``finish`` would never run. An event loop that uses ``try_begin`` runs every other write in an
        executor.
        """
        ...

    def read(self, queue: model.QueueId, offset: int, max_count: int) -> list[model.StoredMessage]:
        """Up to ``max_count`` messages of ``queue`` from ``offset`` (clamped up to the queue's min): the
        messages of ``read_span``."""
        ...

    def read_span(self, queue: model.QueueId, offset: int, max_count: int) -> tuple[list[model.StoredMessage], int]:
        """Up to ``max_count`` messages of ``queue`` with offsets from ``offset``, and the end of the span they
        were read from: every offset in [offset, end) without a message among them is gone for good (below
        the queue's min; or lost with a damaged record or a missing segment, which the store reports). Such
        holes are passed over, so a damaged record never stops its queue. Only holes the store can vouch for:
        when it cannot (an index rebuild under way or done meanwhile, an offset without an entry and without a
        recorded loss), it raises ``StorageError`` (try later) or ends the span before the doubtful offset."""
        ...

    def health(self) -> str | None:
        """None while the store can serve; else why not (an index rebuild, a disk that cannot take writes):
        the broker's readiness probe fails meanwhile. Cheap and without side effects (an event loop calls it)."""
        ...

    def fatal(self) -> str | None:
        """Why the store cannot recover without a restart (a failed rebuild, a fault that did not heal), or
        None: the broker's liveness probe fails meanwhile. Cheap and without side effects."""
        ...

    def index_generation(self) -> int:
        """Changes whenever the index was replaced (a rebuild from the log while serving): whatever a reader
        cached of queue offsets, commit points or delivery state from before may be stale and is dropped."""
        ...

    def queue_offsets(self, queue: model.QueueId) -> tuple[int, int]:
        """(min, max) of a queue; max is the next offset to be written; (0, 0) for an unknown queue."""
        ...

    def truncate_queue(self, queue: model.QueueId, end: int) -> int:
        """Cut ``queue`` back so that its next offset is ``end`` (a replica dropping records its slot's owner
        never had): its messages at ``end`` and above are gone for good (the next append takes ``end`` again),
        and no group's commit point stays above ``end``. Durable before it returns, in either flush mode, and
        idempotent (a queue ending at or below ``end`` is left alone); returns how many offsets were cut."""
        ...

    # --- consumer offsets -----------------------------------------------------------------------------
    def commit_offset(
        self,
        queue: model.QueueId,
        group: str,
        offset: int,
        acked: Sequence[int] = (),
        handouts: model.Handouts = model.NO_HANDOUTS,
    ) -> None:
        """Persist the group's next offset to consume, the offsets above it it has acknowledged already and what
        it has handed out above it (replacing the previous sets; ``keys.checked_handouts`` says what hand-outs
        are accepted); for an LMQ also records the lite topic's last consume time."""
        ...

    def try_commit_offset(
        self,
        queue: model.QueueId,
        group: str,
        offset: int,
        acked: Sequence[int] = (),
        handouts: model.Handouts = model.NO_HANDOUTS,
    ) -> bool:
        """``commit_offset`` unless another writer holds the write path right now: then False, nothing written.
        For an event loop, like ``try_begin``: a commit is two small index writes, cheaper than a thread hop."""
        ...

    def commit_offsets(
        self, rows: Sequence[tuple[model.QueueId, str, int]], *, capped: bool = False
    ) -> list[tuple[model.QueueId, str, int]]:
        """``commit_offset`` of each (queue, group, offset), with nothing acked or handed out above it, in one
        write (a subscription's offset reset over many lite topics); a lite topic gone is skipped. ``capped``:
        each offset at most its queue's end as the write finds it (an MQTT start at the ends read earlier: one
        read of each queue, not one before and one in the write). Returns the rows written."""
        ...

    def get_offset(self, queue: model.QueueId, group: str) -> int | None: ...

    def get_acked(self, queue: model.QueueId, group: str) -> Sequence[int]:
        """The acknowledged offsets above the group's committed offset, as last committed (ascending; an
        ``OffsetRanges``: a run of millions of offsets costs one run)."""
        ...

    def get_handouts(self, queue: model.QueueId, group: str) -> model.Handouts:
        """What the group had handed out above its committed offset, as last committed (``NO_HANDOUTS`` when
        nothing, or when the offsets were committed before hand-outs were kept)."""
        ...

    def commit_points(self, queue: model.QueueId) -> dict[str, int]:
        """Every group's committed offset in ``queue`` (the groups that consumed it here)."""
        ...

    # --- queues that are not lite topics (NORMAL topics, dead letters) -----------------------------------
    def normal_queues(self, start_after: model.QueueId | None = None, limit: int = 1000) -> list[model.QueueId]:
        """Up to ``limit`` queues of this store that are not lite topics, in key order after ``start_after``."""
        ...

    def relocated(self, queue: model.QueueId) -> int:
        """Where a leaving broker's copy of ``queue`` to a remaining broker got to (``cluster.relocating``): every
        message below it was stored there. 0 when none was."""
        ...

    def put_relocated(self, queue: model.QueueId, end: int) -> None:
        """Record ``relocated`` (synced)."""
        ...

    def store_id(self) -> str:
        """A random id this store got when first asked (synced; kept across restarts, new with a new data
        directory): what a leaving broker's offsets are of, for ``relocated_from``."""
        ...

    def relocated_from(self, source: str, queue: model.QueueId) -> int:
        """At a remaining broker: the end (source offsets) of what leaving broker ``source`` stored here of its
        ``queue`` (``cluster.relocating``), so a retried batch is not stored twice. 0 when none was."""
        ...

    def put_relocated_from(self, source: str, queue: model.QueueId, end: int) -> None:
        """Record ``relocated_from`` (synced)."""
        ...

    # --- lite topics ----------------------------------------------------------------------------------
    def lite_topic(self, parent: str, lite: str) -> model.LiteTopicMeta | None: ...

    def lite_topic_count(self, parent: str | None = None) -> int:
        """Lite topics of one parent, or of the whole broker when ``parent`` is None (a stored counter, O(1))."""
        ...

    def scan_lite_topics(
        self,
        parent: str | None = None,
        start_after: str = "",
        end_before: str = "",
        limit: int = 1000,
        idle_since_before_ms: int = 0,
    ) -> list[model.LiteTopicMeta]:
        """Lite topics in key order (parent, then lite name); ``start_after``/``end_before`` are lite names
        within ``parent`` (or ``parent$lite`` keys when ``parent`` is None).

        With ``idle_since_before_ms`` > 0, only topics whose last activity (max of created, last store,
        last consume) is before it; the walk goes on past skipped topics until ``limit`` topics match, so
        the last one returned is still the cursor of the next page.
        """
        ...

    def lite_names(self, parent: str, start_after: str = "", limit: int = 1000) -> list[str]:
        """The names of ``parent``'s lite topics after ``start_after``, in key order, at most ``limit``: what
        ``scan_lite_topics`` pages through, without reading each topic's state (a level index is built from
        them, ``dispatch.level_index``)."""
        ...

    def lite_names_held(self, parent: str, names: Sequence[str]) -> list[bool]:
        """Which of ``names`` are lite topics of ``parent``: keys only, one multi-get (what a match in key order
        looks a filter's last literal level up with, ``dispatch.level_index.matching_in_order``)."""
        ...

    def delete_lite_topic(self, parent: str, lite: str, expected: model.LiteTopicMeta | None = None) -> bool:
        """Delete a lite topic's index entries, offsets and metadata in one batch.

        With ``expected``, delete only if the topic is unchanged since it was read (same max offset, last
        store and last consume time): compare-and-delete for the reclaimer. Returns False when nothing
        was deleted (absent, or changed). Idempotent.
        """
        ...

    def delete_lite_topics(
        self,
        rows: Sequence[tuple[str, str, model.LiteTopicMeta | None]],
        keep: Callable[[], Collection[str]] | None = None,
    ) -> list[bool]:
        """``delete_lite_topic`` for many (parent, lite, expected) rows at once, same per-row semantics.

        One durable write for the whole call (one log write of every tombstone, one fsync in ``sync``
        mode, one index batch): the reclaimer's delete rate is bound by that, not by per-topic fsyncs.

        ``keep`` is called once, under the lock writers take, before any row is compared: the rows whose
        LMQ topic (``%LMQ%$parent$lite``) it returns are left alone (False). It lets a caller decide at the
        last moment, in step with the delete (the reclaimer's "did a subscriber arrive meanwhile").
        """
        ...

    # --- control-plane metadata -----------------------------------------------------------------------
    def put_parent_topic(self, topic: model.ParentTopic) -> None: ...
    def get_parent_topic(self, name: str) -> model.ParentTopic | None: ...
    def delete_parent_topic(self, name: str) -> bool: ...
    def list_parent_topics(self) -> list[model.ParentTopic]: ...

    def put_group(self, group: model.LiteGroup) -> None: ...
    def get_group(self, name: str) -> model.LiteGroup | None: ...
    def delete_group(self, name: str) -> bool: ...
    def list_groups(self) -> list[model.LiteGroup]: ...

    def put_quota(self, quota: model.Quota) -> None: ...
    def get_quota(self, scope: str) -> model.Quota | None: ...
    def delete_quota(self, scope: str) -> bool: ...
    def list_quotas(self) -> list[model.Quota]: ...

    # The newest reclaim run's summary per parent. Plain records: the store neither checks that the parent
    # exists nor drops the record with it; the admin catalog keeps those rules, under its lock.
    def put_reclaim_run(self, run: model.ReclaimRun) -> None: ...
    def get_reclaim_run(self, parent: str) -> model.ReclaimRun | None: ...
    def delete_reclaim_run(self, parent: str) -> bool: ...
    def list_reclaim_runs(self) -> list[model.ReclaimRun]:
        """Every record, in parent-name order."""
        ...

    # This broker's cluster membership as the admin service last set it (``cluster.membership`` JSON): opaque
    # text here. Written synced: a membership change must survive a power cut like the data it places.
    def put_membership(self, text: str) -> None: ...
    def get_membership(self) -> str | None: ...

    # Users and access policies (``access.document`` JSON): opaque text here, one record, written synced.
    def put_access(self, text: str) -> None: ...
    def get_access(self) -> str | None: ...

    # --- maintenance ----------------------------------------------------------------------------------
    def apply_retention(self, stop: Callable[[], bool] | None = None) -> RetentionReport:
        """Drop whole segments older/larger than the retention limits and advance affected queues' min offsets.
        ``stop`` is asked before each segment: True ends the pass early (what was dropped stays dropped)."""
        ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def complete(pending: PendingAppend) -> list[list[model.AppendResult] | BaseException]:
    """Carry a pending append through on the calling thread: its fsync (when needed), then ``finish``."""
    error: Exception | None = None
    if pending.needs_sync:
        try:
            pending.sync()
        except Exception as e:  # whatever it is, ``finish`` must run: it frees the write path
            error = e
    return pending.finish(error)


# --- names both stores refuse (before anything is written) ---------------------------------------------


def check_group(group: str) -> None:
    if not model.is_valid_resource_name(group):
        raise errors.InvalidName(f"invalid group name {group!r}", group=group)


def check_name(name: str) -> None:
    """A parent topic's, group's or reclaim run's name."""
    if not model.is_valid_resource_name(name):
        raise errors.InvalidName(f"invalid name {name!r}", name=name)


def check_scope(scope: str) -> None:
    """A quota's scope (``parent:<topic>``, ``namespace:<ns>``, ``broker``): a kind and a name."""
    if not scope or len(scope.encode()) > model.MAX_RESOURCE_NAME_BYTES * 2 or "\x00" in scope:
        raise errors.InvalidName(f"invalid quota scope {scope!r}", scope=scope)
