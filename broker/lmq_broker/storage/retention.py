"""Retention: the oldest closed segments go once past the age or size limit, and queues' min offsets follow.

Whole segments only, oldest first, never the active one: a segment goes when its last store time is older
than ``retention_max_age_ms`` or while the log is larger than ``retention_max_bytes``. Before a segment is
unlinked, every queue with records in it has its min offset advanced past them and its runs in it deleted,
then the segment's key leaves the index, synced: after a power cut between that and the unlink, the index
must not still know the segment (its file gone, recovery would report it lost). A pass runs mostly without
the write lock, taking it per segment and per RETENTION_BATCH_QUEUES queues, so appends go on meanwhile.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Final

from lmq_broker import errors
from lmq_broker.storage import api, codec, keys
from lmq_broker.storage import core as core_mod
from lmq_broker.storage import index as index_mod

log = logging.getLogger(__name__)

RETENTION_BATCH_QUEUES: Final = 10_000


class Retention:
    """The retention passes of one store, one at a time."""

    def __init__(self, core: core_mod.Core) -> None:
        self._core = core
        self._lock = threading.Lock()

    def apply(self, stop: Callable[[], bool] | None = None) -> api.RetentionReport:
        self._core.check_open()
        with self._lock:
            return self._apply(stop)

    def _apply(self, stop: Callable[[], bool] | None) -> api.RetentionReport:
        core = self._core
        with core.write_lock:
            core.check_writable()
            core.log.reap()  # descriptors of segments dropped by the previous pass
            victims = self._victims(core.clock())
        segments = deleted = 0
        advanced: set[bytes] = set()
        for seq in victims:
            if stop is not None and stop():
                break
            advanced |= self._drop_segment(seq)
            with core.write_lock:
                wb = core.index.batch()
                wb.delete(keys.segment_key(seq))
                # Synced: after a power cut between this and the unlink, the index must not still know the
                # segment (its file gone, it would be reported lost).
                core.write_index(lambda: core.index.write_synced(wb))  # noqa: B023 - called at once
                core.segments.pop(seq, None)
                deleted += core.log.drop(seq)
            segments += 1
        return api.RetentionReport(segments, deleted, len(advanced))

    def _victims(self, now: int) -> list[int]:
        """Oldest closed segments past the age or size limit; always a prefix of the log, never the active one."""
        core = self._core
        max_age = core.cfg.retention_max_age_ms
        max_bytes = core.cfg.retention_max_bytes
        total = core.log.total_bytes()
        victims: list[int] = []
        for seq in core.log.seqs():
            if seq == core.log.active.seq:
                break
            last_store = core.segments.get(seq, [0, 0])[1]
            too_old = max_age >= 0 and last_store + max_age < now
            too_big = max_bytes >= 0 and total > max_bytes
            if not (too_old or too_big):
                break
            victims.append(seq)
            total -= core.log.size_of(seq)
        return victims

    def _queues_of(self, seq: int) -> set[tuple[str, int]]:
        """The queues with messages in segment ``seq``. A bad record is passed over as recovery does (from its
        own frame, or the next position where records check): the queues named after it must have their
        runs in the segment deleted and their min advanced too, or their entries would outlive the file."""
        log_ = self._core.log
        queues: set[tuple[str, int]] = set()
        at: int | None = 0
        while at is not None:
            try:
                for frame in log_.scan_segment(seq, at):
                    if frame.kind == codec.KIND_MESSAGE:
                        queues.update(frame.queues)
                at = None
            except errors.CorruptRecord as e:
                bad = e.fields.get("position")
                at = log_.resync(seq, bad) if isinstance(bad, int) else None
                log.warning("retention: bad record in segment %d at %s; resuming at %s", seq, bad, at)
        return queues

    def _drop_segment(self, seq: int) -> set[bytes]:
        """Advance the min offset of every queue with entries in ``seq``; returns those that advanced."""
        core = self._core
        queues = self._queues_of(seq)
        advanced: set[bytes] = set()
        todo = sorted(queues)
        for i in range(0, len(todo), RETENTION_BATCH_QUEUES):
            with core.write_lock:
                core.check_writable()
                index = core.index
                wb = index.batch()
                updates: list[tuple[index_mod.QueueState, int]] = []
                for topic, qid in todo[i : i + RETENTION_BATCH_QUEUES]:
                    try:
                        name = core.resolve(topic, qid)
                    except errors.InvalidArgument:
                        continue
                    st = core.state(name)
                    if st is None:
                        continue  # deleted since (a reclaimed lite topic)
                    new_min = st.next
                    for first, rseg, _ in index.runs(name):
                        if rseg > seq:
                            new_min = first
                            break
                        # point deletes, not a range: range tombstones pile up and slow every later read
                        wb.delete(keys.entry_key(name.qkey, first))
                    new_min = max(new_min, st.min)
                    if new_min > st.min:
                        wb.put(name.state_key, st.value(min_=new_min))
                        updates.append((st, new_min))
                core.write_index(lambda: index.write(wb))  # noqa: B023 - called at once
                for st, new_min in updates:
                    st.min = new_min
                    advanced.add(st.name.qkey)
        return advanced
