"""Cutting a queue back to an offset: a replica that held records its slot's new owner never had (stored, never
acknowledged) drops them before it copies the owner's (``replication.following``).

The log is the truth, so the cut is a record in it first (``codec.KIND_TRUNCATION``: the queue and its new next
offset), fsynced in either flush mode, and only then applied: the queue's index runs at or above the offset are
deleted (a run across it is rewritten shorter), its lost ranges (``H``) there dropped, its next offset (and its
min, when the cut goes below it) set to the offset, and every group's commit point clamped to it (``meta``). The
records' bytes stay in their segments as garbage until retention deletes the segments. A kill -9 anywhere in
between is repaired at the next open: the index checkpoint is before the truncation record, so recovery replays
it (the same steps again; each is idempotent). A rebuild of the index replays it at its place in the log, after
the records it cuts and before those appended at the same offsets later.
"""

from __future__ import annotations

import logging

from lmq_broker import errors
from lmq_broker.storage import codec, keys
from lmq_broker.storage import core as core_mod
from lmq_broker.storage import index as index_mod
from lmq_broker.storage import meta as meta_mod

log = logging.getLogger(__name__)


def truncate(core: core_mod.Core, meta: meta_mod.Meta, name: keys.QueueName, end: int) -> int:
    """Cut ``name`` back so that its next offset is ``end``; how many offsets were cut (0: nothing to do)."""
    if end < 0:
        raise errors.InvalidArgument("a queue is cut back to an offset >= 0", offset=end)
    with core.write_lock:
        core.check_writable()
        st = core.state(name)
        if st is None or st.next <= end:
            return 0
        cut = st.next - max(end, st.min)
        # fsynced in either mode (``write_records``); a failed fsync cuts the record off again
        core.write_records([codec.encode_tombstone(name, end, core.clock(), codec.KIND_TRUNCATION)])
        meta.clamp_consumer_state(name, end)
        apply(core, name, end, core.log_end())
    log.warning("%s queue %d cut back to offset %d (%d offsets dropped)", name.topic, name.queue, end, cut)
    return cut


def apply(core: core_mod.Core, name: keys.QueueName, end: int, checkpoint: tuple[int, int]) -> None:
    """The index part of a cut (under the write lock, or in recovery), written with ``checkpoint``."""
    st = core.state(name)
    index = core.index
    wb = index.batch()
    if st is not None and st.next > end:
        for key, value in list(index.prefix_items(name.entry_prefix)):
            first = keys.U64BE.unpack_from(key, len(key) - 8)[0]
            if first >= end:
                wb.delete(key)
            elif first + keys.run_length(value) > end:
                wb.put(key, value[: keys.RUN_HEAD.size + (end - first) * keys.RUN_ENTRY.size])
        for key, value in list(index.prefix_items(keys.HOLE + name.qkey)):
            first = keys.U64BE.unpack_from(key, len(key) - 8)[0]
            if first >= end:
                wb.delete(key)
            elif keys.U64.unpack(value)[0] > end:
                wb.put(key, keys.U64.pack(end))
        low = min(st.min, end)
        if name.is_lmq:
            wb.put(name.state_key, keys.LITE_VALUE.pack(st.created, st.last_store, st.last_consume, low, end))
        else:
            wb.put(name.state_key, keys.STATE_VALUE.pack(low, end))
    index_mod.put_checkpoint(wb, checkpoint, core.log.durable_at)
    core.write_index(lambda: index.write(wb))
    core.states.drop(name)  # read again from the index
