"""What a slot's holder reads from its store for a follower that reconciles (blocking: run in a thread)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from lmq_broker import model
from lmq_broker.replication import copies, wire
from lmq_broker.storage.api import Store

SCAN_PAGE: Final = 1_000
FETCH_MAX: Final = 1_000  # messages per fetch


def ends(store: Store, slot: int, slot_of_topic: Callable[[str], int]) -> dict[str, int]:
    """The next offset of every non-empty lite topic of ``slot`` in ``store``."""
    out: dict[str, int] = {}
    cursor = ""
    while True:
        page = store.scan_lite_topics(None, start_after=cursor, limit=SCAN_PAGE)
        for meta in page:
            topic = model.QueueId.lmq(meta.parent, meta.lite).topic
            if meta.max_offset > 0 and slot_of_topic(topic) == slot:
                out[topic] = meta.max_offset
        if len(page) < SCAN_PAGE:
            return out
        cursor = f"{page[-1].parent}{model.LMQ_SEPARATOR}{page[-1].lite}"


def tails(store: Store, slot: int, slot_of_topic: Callable[[str], int]) -> list[model.StoredMessage]:
    """The last message of every non-empty lite topic of ``slot`` (what a probe of a follower sends)."""
    out: list[model.StoredMessage] = []
    for topic, end in ends(store, slot, slot_of_topic).items():
        out.extend(store.read(model.QueueId(topic, 0), end - 1, 1))
    return out


def fetch(store: Store, slot: int, epoch: int, topic: str, start: int) -> bytes:
    """A copy of up to ``FETCH_MAX`` messages of ``topic`` from ``start``."""
    queue = model.QueueId(topic, 0)
    stored = store.read(queue, start, FETCH_MAX)
    messages = [copies.as_new(m) for m in stored]
    results = [model.AppendResult(m.message_id, (queue,), (m.offset,), m.store_timestamp_ms) for m in stored]
    return wire.encode(slot, epoch, messages, results)
