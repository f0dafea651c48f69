"""What a slot's holder reads from its store for a follower that reconciles (blocking: run in a thread)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from lmq_broker import model
from lmq_broker.replication import copies, divergence, wire
from lmq_broker.storage.api import Store

SCAN_PAGE: Final = 1_000
FETCH_MAX: Final = 1_000  # messages per fetch
FETCH_BYTES: Final = 16 * 1024 * 1024  # bodies per fetch, beyond its first message (the peer channels carry 64 MiB)


def ends(store: Store, slot: int, slot_of_topic: Callable[[str], int]) -> dict[str, int]:
    """The next offset of every non-empty lite topic of ``slot`` in ``store``."""
    out: dict[str, int] = {}
    cursor: str | None = ""
    while cursor is not None:
        found, cursor = ends_page(store, slot, slot_of_topic, cursor, SCAN_PAGE)
        out.update(found)
    return out


def ends_page(
    store: Store, slot: int, slot_of_topic: Callable[[str], int], after: str, scan: int
) -> tuple[dict[str, int], str | None]:
    """One page of ``ends``: the lite topics of ``slot`` among the next ``scan`` lite topics of the store after
    the cursor ``after`` ("" first), and the cursor of the next page (None: that was the last). A follower that
    reconciles asks page by page, so no call scans more than ``scan`` topics whatever the store holds."""
    out: dict[str, int] = {}
    page = store.scan_lite_topics(None, start_after=after, limit=scan)
    for meta in page:
        topic = model.QueueId.lmq(meta.parent, meta.lite).topic
        if meta.max_offset > 0 and slot_of_topic(topic) == slot:
            out[topic] = meta.max_offset
    if len(page) < scan:
        return out, None
    return out, f"{page[-1].parent}{model.LMQ_SEPARATOR}{page[-1].lite}"


def tails(store: Store, slot: int, slot_of_topic: Callable[[str], int]) -> list[model.StoredMessage]:
    """The last message of every non-empty lite topic of ``slot`` that reads (what a probe of a follower sends): a
    topic left out for a last record lost here would not be checked at all."""
    out: list[model.StoredMessage] = []
    for topic in ends(store, slot, slot_of_topic):
        out.extend(_last_message(store, model.QueueId(topic, 0)))
    return out


def points(store: Store, slot: int, slot_of_topic: Callable[[str], int]) -> list[wire.Commit]:
    """Every group's commit point (offset and acked offsets above it) in every non-empty lite topic of ``slot``
    (what a probe of a follower sends after the messages)."""
    groups = [g.name for g in store.list_groups()]
    return [p for topic in ends(store, slot, slot_of_topic) for p in points_of(store, topic, groups)]


def points_of(store: Store, topic: str, groups: list[str]) -> list[wire.Commit]:
    queue = model.QueueId(topic, 0)
    out: list[wire.Commit] = []
    for group in groups:
        offset = store.get_offset(queue, group)
        if offset is not None:
            acked, handouts = tuple(store.get_acked(queue, group)), store.get_handouts(queue, group)
            out.append(wire.Commit(queue, group, offset, acked, handouts))
    return out


def fetch(store: Store, slot: int, epoch: int, topic: str, start: int, *, binary: bool = False) -> bytes:
    """A copy of up to ``FETCH_MAX`` messages of ``topic`` from ``start`` (and ``FETCH_BYTES`` of bodies), with
    the topic's commit points that fall within them (read first: none points past the messages; a follower on
    an empty disk gets them back), without the offsets they ack past them. In ``wire``'s JSON layout unless the
    follower asked for the binary one (an older follower does not)."""
    queue = model.QueueId(topic, 0)
    found = points_of(store, topic, [g.name for g in store.list_groups()])
    stored = _within_bytes(store.read(queue, start, FETCH_MAX))
    messages = [copies.as_new(m) for m in stored]
    results = [model.AppendResult(m.message_id, (queue,), (m.offset,), m.store_timestamp_ms) for m in stored]
    end = stored[-1].offset + 1 if stored else start
    encode = wire.encode if binary else wire.encode_json
    # acked offsets past the page's end are left for the page that carries their messages (a follower answers a
    # point that acks records it lacks as not stored: its reconcile would fail at every page but the last)
    within = [wire.Commit(p.queue, p.group, p.offset, wire.acked_below(p.acked, end), p.handouts) for p in found]
    return encode(slot, epoch, messages, results, [p for p in within if p.offset <= end])


def page(store: Store, topic: str, start: int) -> tuple[list[model.NewMessage], list[model.AppendResult]]:
    """Up to ``FETCH_MAX`` messages of ``topic`` from ``start`` (and ``FETCH_BYTES`` of bodies) as a copy carries
    them: what a holder copies to its followers of a topic it took over (``setup.Replication.adopt``)."""
    queue = model.QueueId(topic, 0)
    stored = _within_bytes(store.read(queue, start, FETCH_MAX))
    results = [model.AppendResult(m.message_id, (queue,), (m.offset,), m.store_timestamp_ms) for m in stored]
    return [copies.as_new(m) for m in stored], results


def _within_bytes(stored: list[model.StoredMessage]) -> list[model.StoredMessage]:
    total = 0
    for i, message in enumerate(stored):
        total += len(message.body)
        if total > FETCH_BYTES and i > 0:
            return stored[:i]
    return stored


LOOK_BACK: Final = 64  # offsets ``StoreLog.last_below`` reads back through (lost ranges are rare and short)


class StoreLog:
    """``divergence.Log`` over one lite topic of a store (blocking reads)."""

    def __init__(self, store: Store, topic: str) -> None:
        self._store = store
        self._queue = model.QueueId(topic, 0)

    def bounds(self) -> tuple[int, int]:
        return self._store.queue_offsets(self._queue)

    def first_from(self, offset: int) -> divergence.Record | None:
        found = self._store.read(self._queue, offset, 1)
        return (found[0].offset, found[0].epoch) if found else None

    def last_below(self, offset: int) -> divergence.Record | None:
        low = max(self.bounds()[0], offset - LOOK_BACK)
        if offset <= low:
            return None
        found = [m for m in self._store.read(self._queue, low, offset - low) if m.offset < offset]
        return (found[-1].offset, found[-1].epoch) if found else None


def recorded_slot(store: Store, topic: str) -> int:
    """The slot recorded on the last record of ``topic`` in ``store`` (-1: it has none, or one stored before
    slots were recorded)."""
    return last_record(store, topic)[0]


def last_record(store: Store, topic: str) -> tuple[int, str]:
    """The slot recorded on the last record of ``topic`` in ``store`` (-1: it has none, or one stored before slots
    were recorded) and its message id ("" without a record). A record past a lost range is found by reading back
    (``LOOK_BACK``)."""
    found = _last_message(store, model.QueueId(topic, 0))
    return (found[-1].slot, found[-1].message_id) if found else (-1, "")


def _last_message(store: Store, queue: model.QueueId) -> list[model.StoredMessage]:
    """The last message of ``queue`` that reads, read back through ``LOOK_BACK`` offsets past a lost last record."""
    low, end = store.queue_offsets(queue)
    if end <= low:
        return []
    found = store.read(queue, end - 1, 1)
    if not found:
        found = [m for m in store.read(queue, max(low, end - LOOK_BACK), LOOK_BACK) if m.offset < end][-1:]
    return found


def answers(store: Store, epochs: dict[str, int]) -> dict[str, tuple[int | None, int]]:
    """The holder's ``divergence.answer`` for each topic a rejoining replica names with its last epoch."""
    return {topic: divergence.answer(StoreLog(store, topic), epoch) for topic, epoch in epochs.items()}


def tail_epochs(store: Store, slot: int, slot_of_topic: Callable[[str], int]) -> dict[str, int]:
    """The epoch of the last record of every non-empty lite topic of ``slot`` in ``store``."""
    out: dict[str, int] = {}
    for topic in ends(store, slot, slot_of_topic):
        epoch = divergence.last_epoch(StoreLog(store, topic))
        if epoch is not None:
            out[topic] = epoch
    return out
