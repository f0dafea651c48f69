"""Whether every lite topic of this broker's store records its slot: what a ring change at --replicas above 1
needs (docs/replication.md, *Changing the ring with R > 1*).

A replicated owner stamps each lite record with the slot its topic was placed on (``owning.Slots.admit``), and a
topic's slot is read from its last record. A topic whose last record has none (stored at --replicas 1, by a
version before slots were recorded, or copied from such an owner) is filed by today's ring: right only while the
ring has no history. So a broker at --replicas above 1 takes a ring with a history (at start, or a grown ring by
``SetCluster``) only while no lite topic of its store is *unstamped*.

Finding that out walks the store's lite topics (one read of a last record each, ~37 µs); it stops at the first
unstamped one. A store found with none gets a marker file in its data directory, so later starts do not walk
it again; the marker goes as soon as an unstamped lite record is stored here (a copy from an older owner) and at
every start at --replicas 1 (which stamps nothing).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from lmq_broker import model
from lmq_broker.replication import sources
from lmq_broker.storage.api import Store

log = logging.getLogger(__name__)

MARKER: Final = "replication-stamped"  # in the data directory: every lite topic's last record names its slot


def forget(data_dir: Path) -> None:
    """A start at --replicas 1: records stored from now on name no slot."""
    (data_dir / MARKER).unlink(missing_ok=True)


def first_unstamped(store: Store) -> str | None:
    """A lite topic of ``store`` that ever held a record and whose last record names no slot (the first found;
    one whose records are all gone counts: nothing names its slot), else None."""
    after = ""
    while True:
        page = store.scan_lite_topics(None, start_after=after, limit=sources.SCAN_PAGE)
        for meta in page:
            topic = model.QueueId.lmq(meta.parent, meta.lite).topic
            if meta.max_offset > 0 and sources.recorded_slot(store, topic) < 0:
                return topic
        if len(page) < sources.SCAN_PAGE:
            return None
        after = f"{page[-1].parent}{model.LMQ_SEPARATOR}{page[-1].lite}"


class Stamps:
    """This broker's answer to "does every lite topic here record its slot?", kept up to date as it stores."""

    def __init__(self, store: Store, data_dir: Path) -> None:
        self._marker = data_dir / MARKER
        self.unstamped: str | None = None  # a lite topic whose last record names no slot
        if not self._marker.exists():
            self.unstamped = first_unstamped(store)
            if self.unstamped is None:
                self._marker.parent.mkdir(parents=True, exist_ok=True)
                self._marker.write_text("every lite topic's last record names its slot\n")
            else:
                log.info("replication: lite topic %s names no slot on its last record: the ring stays", self.unstamped)

    def note(self, messages: Sequence[model.NewMessage]) -> None:
        """``messages`` stored here: an unstamped lite record (a copy from an owner of an older version) makes
        the store unstamped from now on."""
        if self.unstamped is not None:
            return
        for m in messages:
            topic = next((q.topic for q in m.queues if q.topic.startswith(model.LMQ_PREFIX)), None)
            if topic is not None and m.slot < 0:
                self.unstamped = topic
                self._marker.unlink(missing_ok=True)
                log.warning("replication: a copy of %s names no slot: this broker's ring stays", topic)
                return

    def why_fixed(self) -> str:
        """Why this broker's ring cannot change ("" when it can)."""
        if self.unstamped is None:
            return ""
        return (
            f"lite topic {self.unstamped} was stored without its slot (at --replicas 1, or by an older version): "
            "it would be filed under another ring's slot after a ring change; the ring of this cluster stays "
            "until such topics are gone (expired or deleted)"
        )
