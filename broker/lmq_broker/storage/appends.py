"""Appends: the store's write rounds (group commit), the one way messages reach the log and the index.

One *round* at a time under the write lock: callers queue their request and whoever gets the lock first takes
every queued request (leader/follower group commit), validates each (a bad request fails alone, nothing of
it written), assigns offsets, encodes, writes each touched segment with one write, fsyncs once (``sync``
mode), then writes one WriteBatch with every index run, queue state, lite-topic record, counter,
segment-table row and the checkpoint. Followers find their request done when they get the lock. Index after
fsync means the index never points past the durable log in ``sync`` mode. ``try_begin`` runs the same round
in steps for an event loop: validate and write (lock taken without waiting), then the caller's ``sync``,
then index and publish (``finish``, lock freed). In ``async`` mode a thread fsyncs every flush interval.

Per-queue state (min/next and lite-topic times) lives in the index; a bounded LRU keeps the hot ones. Only
the write path fills the LRU (under the lock), so a reader can never put a stale state in it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import NamedTuple

from lmq_broker import errors, model
from lmq_broker.storage import api, codec, keys
from lmq_broker.storage import core as core_mod
from lmq_broker.storage import index as index_mod

log = logging.getLogger(__name__)


class _Request:
    __slots__ = ("done", "error", "messages", "prepared", "results")

    def __init__(self, messages: Sequence[model.NewMessage]) -> None:
        self.messages = messages
        self.prepared: list[codec.Prepared] = []
        self.results: list[model.AppendResult] = []
        self.error: BaseException | None = None
        self.done = False


class _Staged(NamedTuple):
    """Requests of one round written to the log, neither fsynced nor indexed yet (under the write lock)."""

    live: list[_Request]
    batch: index_mod.Batch
    chunks: list[tuple[int, list[bytes]]]
    store_ms: int
    start: tuple[int, int]  # where the log ended before the round: cut back to it if the round fails


class _Pending:
    """``Appender.try_begin``'s answer: holds the store's write lock from ``try_begin`` until ``finish``."""

    __slots__ = ("_appender", "_finished", "_reqs", "_staged")

    def __init__(self, appender: Appender, reqs: list[_Request], staged: _Staged | None) -> None:
        self._appender = appender
        self._reqs = reqs
        self._staged = staged
        self._finished = False

    @property
    def needs_sync(self) -> bool:
        return self._staged is not None and self._appender._core.sync

    def sync(self) -> None:
        self._appender._core.log.sync()

    def finish(self, sync_error: BaseException | None = None) -> list[list[model.AppendResult] | BaseException]:
        if self._finished:
            raise RuntimeError("a pending append is finished once")
        self._finished = True
        try:
            if self._staged is not None:
                self._appender._index_staged(self._staged, sync_error)
        finally:
            for r in self._reqs:
                r.done = True
            self._appender._core.write_lock.release()
        return [r.results if r.error is None else r.error for r in self._reqs]


class Appender:
    """The write rounds of one store, and its background fsync in ``async`` mode."""

    def __init__(self, core: core_mod.Core) -> None:
        self._core = core
        self._max_record = min(core.cfg.max_record_bytes, core.cfg.segment_max_bytes)
        self._queue_lock = threading.Lock()
        self._queue: list[_Request] = []
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        if not core.sync:
            self._flusher = threading.Thread(target=self._flush_loop, name="lmq-store-flusher", daemon=True)
            self._flusher.start()

    def append(self, messages: Sequence[model.NewMessage]) -> list[model.AppendResult]:
        core = self._core
        core.check_open()
        core.check_not_rebuilding()
        if not messages:
            return []
        req = _Request(messages)
        with self._queue_lock:
            self._queue.append(req)
        with core.write_lock:
            if not req.done:
                with self._queue_lock:
                    reqs, self._queue = self._queue, []
                self._round(reqs)
        if req.error is not None:
            raise req.error
        return req.results

    def try_begin(self, requests: Sequence[Sequence[model.NewMessage]]) -> api.PendingAppend | None:
        core = self._core
        core.check_open()
        # Never queued: a request queued and then withdrawn could already have been taken by another leader,
        # and would be stored twice when the caller hands it to its thread. Nor does it take the queued
        # requests of others along (as a leader would): one may be a large batch its thread is waiting to
        # write, which must not run on the caller's event loop. Each waiter writes its own once it has the lock.
        if not core.write_lock.acquire(blocking=False):
            return None
        reqs = [_Request(messages) for messages in requests]
        try:
            staged = self._stage(reqs)
        except BaseException:
            core.write_lock.release()
            raise
        return _Pending(self, reqs, staged)

    def stop(self) -> None:
        """Stop the background fsync (a close: the caller syncs the log itself)."""
        self._stop.set()
        if self._flusher is not None:
            self._flusher.join()

    def _round(self, reqs: list[_Request]) -> None:
        try:
            staged = self._stage(reqs)
            if staged is not None:
                error: Exception | None = None
                if self._core.sync:
                    try:
                        self._core.log.sync()
                    except Exception as e:
                        error = e
                self._index_staged(staged, error)
        finally:
            for r in reqs:
                r.done = True

    def _stage(self, reqs: list[_Request]) -> _Staged | None:
        """Validate the requests and write the valid ones to the log, neither fsynced nor indexed yet (the
        caller holds the write lock until ``_index_staged``). A failure lands on its requests; None when
        nothing was written."""
        try:
            self._core.check_writable()
            store_ms = self._core.clock()
            prepare, names, max_record = codec.prepare, self._core.names, self._max_record
            live: list[_Request] = []
            for r in reqs:
                try:
                    r.prepared = [prepare(m, names, max_record, store_ms) for m in r.messages]
                    live.append(r)
                except errors.LmqError as e:
                    r.error = e
            if not any(r.prepared for r in live):  # nothing valid to write (or only empty requests)
                return None
            return self._write_log(live, store_ms)
        except Exception as e:
            for r in reqs:
                if r.error is None:
                    r.error = e
                    r.results = []
            return None

    def _index_staged(self, staged: _Staged, sync_error: BaseException | None) -> None:
        """After the fsync (``sync`` mode): index the staged records and publish their queues' new states. If
        the fsync or the index write failed, the records are cut off the log again: "not stored" is true."""
        core = self._core
        batch = staged.batch
        try:
            if sync_error is not None:
                raise core.fsync_failed(sync_error)
            for s, written in staged.chunks:
                if written:
                    batch.touch_segment(s, staged.store_ms)
            checkpoint = core.log_end()
            core.write_index(lambda: batch.write(checkpoint, core.log.durable_at))
        except Exception as e:
            core.undo_round(staged.start)
            error = errors.StorageError(f"not stored: {e.message if isinstance(e, errors.LmqError) else e}")
            error.__cause__ = e
            for r in staged.live:
                r.error = error
                r.results = []
            return
        batch.publish()

    def _write_log(self, reqs: list[_Request], store_ms: int) -> _Staged:
        """Give each prepared message its offsets and frame it; write the round to the log (one write per
        segment touched). A record never spans two segments: one that does not fit starts the next."""
        commitlog = self._core.log
        start = (commitlog.active.seq, commitlog.active.size)
        seg, pos = start
        batch = self._core.batch()
        chunks: list[tuple[int, list[bytes]]] = []
        parts: list[bytes] = []
        for r in reqs:
            r.results = []
            for p in r.prepared:
                if pos + p.size > commitlog.segment_max_bytes:
                    chunks.append((seg, parts))
                    parts, seg, pos = [], seg + 1, 0
                    batch.cut(seg, store_ms)
                offsets = _take_offsets(batch, p.queues, keys.RUN_ENTRY.pack(pos, p.size), seg=seg, store_ms=store_ms)
                parts += [*codec.frame(p, offsets), p.message.body]
                pos += p.size
                m = p.message
                r.results.append(
                    model.AppendResult(
                        message_id=m.message_id, queues=m.queues, queue_offsets=offsets, store_timestamp_ms=store_ms
                    )
                )
        chunks.append((seg, parts))
        self._core.write_chunks(chunks, start)
        return _Staged(reqs, batch, chunks, store_ms, start)

    def _flush_loop(self) -> None:
        """``async`` mode: fsync every flush interval. A failure pauses writes like one in ``sync`` mode (the
        healer retries it, under the write lock); meanwhile this loop leaves the log alone."""
        core = self._core
        interval = core.cfg.flush_interval_ms / 1000
        while not self._stop.wait(interval):
            if core.undurable is not None:
                continue
            try:
                core.log.sync()
            except OSError as e:
                core.fsync_failed(e)


def _take_offsets(
    batch: index_mod.Batch, names: Sequence[keys.QueueName], entry: bytes, *, seg: int, store_ms: int
) -> tuple[int, ...]:
    """The next offset of each queue a record is indexed into, each queue's index run given its entry."""
    offsets = []
    for name in names:
        q = batch.pending.get(name.qkey)
        if q is None:
            q = batch.queue(name, seg, store_ms)
        offsets.append(q.next)
        q.next += 1
        q.ents.append(entry)
    return tuple(offsets)
