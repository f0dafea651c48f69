"""Messages appended lately, so that handing out a message right after it arrived needs no store read.

Every append of this broker, dead letters included, goes through ``ingest``, so it knows, for each queue it
appended to, the next offset and the messages themselves. A delivery whose picks are all covered here skips
the thread-pool hop and the store read (the common case: a consumer parked in a long poll gets the message that just
woke it). The store stays the truth: anything not covered is read from it. Bounded by bytes (each entry is
charged its body plus ``ENTRY_OVERHEAD_BYTES`` for the objects that hold it, so a flood of one-byte
messages is bounded too), by the number of entries, and by the number of queues tracked; entries are the
sent values plus their offset, turned into ``StoredMessage`` only when delivered.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from itertools import chain
from operator import attrgetter
from typing import Final

from lmq_broker import caches, model

DEFAULT_MAX_BYTES: Final = 32 * 1024 * 1024
DEFAULT_MAX_MESSAGES: Final = 65_536
DEFAULT_MAX_QUEUES: Final = 100_000
# What one entry costs besides its body: the NewMessage, its properties dict and tuples, the key tuple and the
# ordered-dict node (tracemalloc: ~820 B for a small lite message; tests/broker/dispatch/test_recent.py checks it).
ENTRY_OVERHEAD_BYTES: Final = 832

QueueKey = tuple[str, int]
_LMQ_NAME_PREFIX: Final = model.LMQ_PREFIX + model.LMQ_SEPARATOR  # what QueueId.is_lmq tests
_Entry = tuple[model.NewMessage, model.QueueId, int]  # message, queue, store timestamp
_queues_of = attrgetter("queues")


class RecentMessages:
    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_queues: int = DEFAULT_MAX_QUEUES,
        max_messages: int = DEFAULT_MAX_MESSAGES,
    ) -> None:
        self.max_bytes = max_bytes
        self.max_messages = max_messages
        self._messages: OrderedDict[tuple[str, int, int], _Entry] = OrderedDict()
        self._ends: caches.LRU[QueueKey, int] = caches.LRU(max_queues)
        self._bytes = 0

    def add(
        self,
        messages: Sequence[model.NewMessage],
        results: Sequence[model.AppendResult],
        readers: AbstractSet[str] | None = None,
    ) -> None:
        """Remember appended messages of the queues someone may read soon: those of the topics in ``readers``
        (None: of every topic). The end of any other queue appended to is forgotten."""
        ends = self._ends
        if (readers is not None and not readers) and (
            not ends or ends.keys().isdisjoint(chain.from_iterable(map(_queues_of, results)))
        ):
            return  # the common case of a busy producer: nobody here reads these topics, nothing to forget
        # Locals and a plain prefix test instead of attribute and property lookups: this runs per message sent.
        cached = self._messages
        added = 0
        for message, result in zip(messages, results, strict=True):
            lite = message.lite_topic is not None
            for queue, offset in zip(result.queues, result.queue_offsets, strict=True):
                topic = queue.topic
                if lite and not topic.startswith(_LMQ_NAME_PREFIX):
                    continue  # a lite message's parent-queue entry is never consumed
                qkey = (topic, queue.queue)
                if readers is not None and topic not in readers:
                    ends.pop(qkey, None)  # its end is no longer known
                    continue
                ends[qkey] = offset + 1
                ends.move_to_end(qkey)
                key = (topic, queue.queue, offset)
                replaced = cached.pop(key, None)  # a deleted-and-recreated queue reuses offsets
                if replaced is not None:
                    added -= len(replaced[0].body) + ENTRY_OVERHEAD_BYTES
                cached[key] = (message, queue, result.store_timestamp_ms)
                added += len(message.body) + ENTRY_OVERHEAD_BYTES
        self._bytes += added
        while (self._bytes > self.max_bytes or len(self._messages) > self.max_messages) and self._messages:
            _, (message, _, _) = self._messages.popitem(last=False)
            self._bytes -= len(message.body) + ENTRY_OVERHEAD_BYTES
        ends.trim()

    def end(self, queue: QueueKey) -> int | None:
        """The queue's next offset if this broker appended to it lately (None: ask the store)."""
        return self._ends.get(queue)

    def window(self, queue: QueueKey, first: int, last: int) -> list[model.StoredMessage] | None:
        """Messages ``first..last`` that exist (the queue may end sooner), or None if any is not cached."""
        end = self._ends.get(queue)
        if end is None:
            return None
        out = []
        for offset in range(first, min(last + 1, end)):
            entry = self._messages.get((queue[0], queue[1], offset))
            if entry is None:
                return None
            message, qid, stored_ms = entry
            out.append(model.StoredMessage.of(message, qid, offset, stored_ms))
        return out

    def clear(self) -> None:
        """The store's index was replaced: an offset cached here may name another message there now."""
        self._messages.clear()
        self._ends.clear()
        self._bytes = 0

    def forget(self, queue: QueueKey) -> None:
        """The queue was deleted. Without its end, ``window`` answers None for it; its cached messages age
        out, and any offset appended again overwrites the old entry before the new end covers it."""
        self._ends.pop(queue, None)
