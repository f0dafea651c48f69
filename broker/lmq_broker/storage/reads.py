"""Reads: the one place that decides what a reader may pass over. The dispatcher settles an offset a span
leaves without a message (no delivery, the commit point moves past it), so a span shows a hole only where
the store knows the record is gone; anything else is an error to try again later.
"""

from __future__ import annotations

import logging

from lmq_broker import errors, model
from lmq_broker.storage import codec, keys
from lmq_broker.storage import core as core_mod
from lmq_broker.storage import index as index_mod

log = logging.getLogger(__name__)


def read_span(
    core: core_mod.Core, queue: model.QueueId, offset: int, max_count: int
) -> tuple[list[model.StoredMessage], int]:
    """The messages from ``offset`` and the end of the span covered. An offset in the span without a message
    is one the store can vouch is gone (below the queue's min, a known-lost ``H`` range, a record that
    fails its CRC, a segment retention dropped): the dispatcher settles it. Anything else raises (the
    caller tries later) or ends the span before it: never a false hole.

    The index, its states and its generation are taken once: a rebuild that swaps the index meanwhile
    (the new one partly replayed) makes the answer an error, not a span of holes."""
    core.check_open()
    name = core.resolve(queue.topic, queue.queue)
    generation = core.generation
    core.check_readable()
    index, states = core.index, core.states
    if max_count <= 0:
        return [], offset
    try:
        st = states.get(name)
        if st is None:
            core.check_same_index(generation)
            return [], offset
        lo, hi = st.min, st.next  # one state, read once (the write path replaces its fields in place)
        start = max(offset, lo)
        if start >= hi:
            core.check_same_index(generation)
            return [], start
        entries = index.entries(name, start, hi, max_count)
        end = entries[-1][0] + 1 if len(entries) >= max_count else hi
        end = _vouched_end(index=index, states=states, name=name, start=start, end=end, entries=entries)
    except Exception as e:
        core.check_same_index(generation)  # a swapped (closed) index fails its readers: say why
        if isinstance(e, errors.StorageError):
            raise
        raise errors.StorageError(f"index read failed: {e}") from e
    if entries and entries[-1][0] >= end:
        entries = [e for e in entries if e[0] < end]
    bufs = core.log.read_entries(entries)
    core.check_same_index(generation)
    decode = codec.decode_message
    out: list[model.StoredMessage] = []
    for entry, buf in zip(entries, bufs, strict=True):
        if buf is None:  # the segment is gone: dropped by retention after the lookup
            if core.log.seqs()[0] <= entry[1]:
                end = entry[0]  # not a segment retention dropped: do not vouch for the rest
                break
            continue
        try:
            out.append(decode(buf, queue, entry[0]))
        except errors.StorageError as e:
            core.damage.report(
                "corrupt_read",
                f"{queue.topic} queue {queue.queue} offset {entry[0]}: {e.message} "
                f"(segment {entry[1]} position {entry[2]}); the message is skipped",
            )
    return out, end


def _vouched_end(
    *,
    index: index_mod.Index,
    states: index_mod.StateCache,
    name: keys.QueueName,
    start: int,
    end: int,
    entries: list[index_mod.Entry],
) -> int:
    """``end``, or the first offset of [start, end) that has no entry and is not in a known-lost range.
    Raises when that is ``start`` itself (nothing to answer but a hole the store cannot vouch for)."""
    n = len(entries)
    if n and entries[0][0] == start and entries[-1][0] == start + n - 1 == end - 1:
        return end  # the usual answer: dense (entries are in offset order, distinct), no extra read
    expected = start
    gaps: list[tuple[int, int]] = []
    for entry in entries:
        if entry[0] > expected:
            gaps.append((expected, entry[0]))
        expected = entry[0] + 1
    if end > expected:
        gaps.append((expected, end))
    if not gaps:
        return end  # the usual answer: dense, no extra read
    holes = index.holes(name, gaps[0][0], end)
    now = states.get(name)
    floor = 0 if now is None else now.min  # retention may have advanced it since (its runs deleted first)
    for first, last in gaps:
        at = max(first, floor)
        for h_first, h_end in holes:
            if h_first <= at < h_end:
                at = h_end
        if at < last:  # an offset without an entry that no recorded loss explains
            log.error(
                "%s queue %d: no index entry for offset %d and no record of its loss; not reported as gone",
                name.topic, name.queue, at,
            )  # fmt: skip
            if at == start:
                raise errors.StorageError(f"{name.topic} queue {name.queue}: no index entry for offset {at}", offset=at)
            return at
    return end
