"""Key layout: every RocksDB key and value the store writes, and nothing else.

Two RocksDB instances under the data dir: ``index`` holds what the commit log can recreate (E S L N B X);
``meta`` holds what no log holds (O C T G U R), so deleting ``index`` loses nothing. In each, one keyspace (the
default column family); the first byte of a key says what it is. Integers inside keys
are big-endian so byte order is numeric order; values are little-endian. Names are UTF-8 and never hold
0x00, so ``0x00`` ends a name and no key of one queue is a prefix of another queue's.

    qkey = topic | 0x00 | u16be queue id          (an LMQ is queue 0 of "%LMQ%$<parent>$<lite>")

    prefix key                              value
    E      E qkey u64be(first_offset)       a *run* of consecutive offsets stored by one append:
                                            u32 segment | u64 store_ms | n x (u32 position | u32 size)
    S      S qkey                           u64 min | u64 next                  (queues that are not LMQs)
    L      L parent 0x00 lite               u64 created_ms | u64 last_store_ms | u64 last_consume_ms |
                                            u64 min | u64 next                  (lite topic = LMQ state)
    O      O qkey group                     u64 next offset to consume          (consumer offsets; meta)
    A      A qkey group                     acked offsets above O, as runs, and what the group handed out
                                            above O (``encode_acked``; meta)
    C      C qkey                           u64 last_consume_ms of an LMQ       (copied into L on a rebuild; meta)
    N      N parent                         u64 lite topics of the parent; ``N`` alone is the broker total
    T      T name                           JSON ParentTopic                    (meta)
    G      G name                           JSON LiteGroup                      (meta)
    U      U scope                          JSON Quota                          (meta)
    R      R parent                         JSON ReclaimRun: the newest reclaim run's summary (meta)
    B      B u32be segment                  u64 first_store_ms | u64 last_store_ms   (segment table)
    X      X "checkpoint"                   u32 segment | u64 position: the log is indexed up to here
    X      X "durable"                      u32 segment | u64 position: the log was fsynced up to here (<= the
                                            checkpoint) when the batch with the checkpoint was written
    X      X "layout"                       u32 layout version (LAYOUT_VERSION)
    X      X "clean"                        u64 close time: written (synced) by a clean close, removed at open (meta)
    X      X "membership"                   JSON cluster membership set over the admin service (synced; meta)
    X      X "access"                       JSON users and access policies (``access.document``; synced; meta)
    X      X "relocated" qkey               u64: a leaving broker stored every message of this queue below it
                                            at a remaining broker (``cluster.relocating``; synced; meta)
    X      X "storeid"                      a random hex id of this store, made when first asked (synced; meta)
    X      X "relocfrom" source 0 topic 0   u64: at a remaining broker, the end (source offsets) of what leaving
             u32be queue                    broker ``source`` stored here of that queue (synced; meta)
    H      H qkey u64be(first_offset)       u64 end: offsets [first, end) of the queue the log lost (a
                                            quarantined record, a missing segment, a reconciled next):
                                            the only offsets between min and next a reader may skip

Offsets of a queue are dense from its min to its next except inside ``H`` ranges: an offset there has no
entry because the store knows its record is gone; any other missing entry is an inconsistency, never
reported to a reader as a hole.

Why runs: one append of a batch puts one key per queue, not one per message, and an extra queue of a
message (multi-dispatch) adds 8 bytes to a run. Offsets of a queue are dense from its min to its next, so
``offset -> run`` is ``seek_for_prev(E qkey offset)``. ``E``, ``S``, ``L``, ``N``, ``B``, ``H`` and the
checkpoint derive from the log (a rebuild recreates them); ``O``, ``C``, ``T``, ``G``, ``U``, ``R`` do not.
``L`` sorts by (parent, lite) because 0x00 sorts below every name character, exactly like the string
``parent$lite`` does ('$' sorts below every character a name may hold).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from typing import Final, NamedTuple

from lmq_broker import caches, errors, model
from lmq_broker.storage import ranges

LAYOUT_VERSION: Final = 1
MAX_QUEUE_NAME_BYTES: Final = 255  # a queue name is length-prefixed by one byte in the record
MAX_QUEUE_ID: Final = 0xFFFF

ENTRY: Final = b"E"
HOLE: Final = b"H"
STATE: Final = b"S"
LITE: Final = b"L"
OFFSET: Final = b"O"
COUNT: Final = b"N"
PARENT: Final = b"T"
GROUP: Final = b"G"
QUOTA: Final = b"U"
RECLAIM: Final = b"R"
SEGMENT: Final = b"B"
SYSTEM: Final = b"X"
CHECKPOINT_KEY: Final = b"Xcheckpoint"
DURABLE_KEY: Final = b"Xdurable"  # in async mode the log bytes between it and the checkpoint may be lost
LAYOUT_KEY: Final = b"Xlayout"
CLEAN_KEY: Final = b"Xclean"  # meta: present only between a clean close and the next open
SYNC_SESSION_KEY: Final = b"Xsync"  # meta: the session that wrote last ran with sync flush throughout
MEMBERSHIP_KEY: Final = b"Xmembership"  # meta: the cluster membership the admin service last set
ACCESS_KEY: Final = b"Xaccess"  # meta: users and access policies (``access.document``)
RELOCATED: Final = b"Xrelocated"  # meta: + qkey -> u64 end of what a leaving broker copied to a remaining one
STORE_ID_KEY: Final = b"Xstoreid"  # meta: a random id of this store (``Store.store_id``)
RELOCATED_FROM: Final = b"Xrelocfrom"  # meta: + source, topic, queue -> u64 end of what a leaving one stored here
META_PROBE_KEY: Final = b"Xprobe"  # written by a readiness probe to learn whether the meta store can write
TOTAL_COUNT_KEY: Final = COUNT

CONSUMED: Final = b"C"
ACKED: Final = b"A"  # acknowledged offsets above a group's committed offset (meta store)

# Prefixes whose keys are derived from the log: a rebuild deletes and recreates exactly these.
DERIVED_PREFIXES: Final = (ENTRY, STATE, LITE, COUNT, SEGMENT, HOLE)
# Prefixes of the meta store: what no log holds.
PRIMARY_PREFIXES: Final = (OFFSET, CONSUMED, PARENT, GROUP, QUOTA, RECLAIM, ACKED)

U16BE: Final = struct.Struct(">H")
U32BE: Final = struct.Struct(">I")
U64BE: Final = struct.Struct(">Q")
U32: Final = struct.Struct("<I")
U64: Final = struct.Struct("<Q")
RUN_HEAD: Final = struct.Struct("<IQ")  # segment, store_ms
RUN_ENTRY: Final = struct.Struct("<II")  # position, size
RUN_SINGLE: Final = struct.Struct("<IQII")  # a run of one entry, unpacked in one call
STATE_VALUE: Final = struct.Struct("<QQ")  # min, next
LITE_VALUE: Final = struct.Struct("<QQQQQ")  # created, last_store, last_consume, min, next
SEGMENT_VALUE: Final = struct.Struct("<QQ")  # first_store_ms, last_store_ms
CHECKPOINT_VALUE: Final = struct.Struct("<IQ")  # segment, position


class QueueName(NamedTuple):
    """A validated queue with its encodings precomputed once (the store caches these, bounded).

    A tuple of strings, bytes and ints: cheap to build, and untracked by the cyclic GC once it has looked at it,
    so thousands of cached names cost the collector nothing."""

    topic: str
    queue: int
    qkey: bytes  # topic | 0x00 | u16be queue
    record: bytes  # how the record names it: u8 len | topic | u16 queue (little-endian)
    parent: str | None  # set for an LMQ
    lite: str | None
    state_key: bytes  # where min/next live: the lite-topic record for an LMQ, ``S qkey`` otherwise
    entry_prefix: bytes  # E qkey
    offset_prefix: bytes  # O qkey

    @property
    def is_lmq(self) -> bool:
        return self.parent is not None


def parse_queue(
    topic: str, queue: int, valid_parent: Callable[[str], bool] = model.is_valid_resource_name
) -> QueueName:
    """Validate a queue and precompute its keys. InvalidName / InvalidLiteTopic on a bad name. ``valid_parent``:
    how an LMQ's parent is validated (``NameCache.valid_parent`` memoizes it)."""
    if topic.startswith(model.LMQ_PREFIX + model.LMQ_SEPARATOR):
        parts = topic.split(model.LMQ_SEPARATOR)
        if len(parts) != 3 or parts[0] != model.LMQ_PREFIX:
            raise errors.InvalidName(f"malformed LMQ name {topic!r}", topic=topic)
        parent, lite = parts[1], parts[2]
        if not valid_parent(parent):
            raise errors.InvalidName(f"invalid parent topic in LMQ name {topic!r}", topic=topic)
        if not model.is_valid_lite_topic(lite):
            raise errors.InvalidLiteTopic(f"invalid lite topic in LMQ name {topic!r}", topic=topic)
        if queue != 0:
            raise errors.InvalidName(f"an LMQ has only queue 0, not {queue}", topic=topic, queue=queue)
        lmq_parent: str | None = parent
        lmq_lite: str | None = lite
    else:
        if not model.is_valid_resource_name(topic):
            raise errors.InvalidName(f"invalid topic name {topic!r}", topic=topic)
        if not 0 <= queue <= MAX_QUEUE_ID:
            raise errors.InvalidName(f"queue id {queue} out of range", topic=topic, queue=queue)
        lmq_parent = lmq_lite = None
    raw = topic.encode()
    if len(raw) > MAX_QUEUE_NAME_BYTES:
        raise errors.InvalidName(f"queue name longer than {MAX_QUEUE_NAME_BYTES} bytes", topic=topic)
    qkey = raw + b"\x00" + U16BE.pack(queue)
    return QueueName(
        topic=topic,
        queue=queue,
        qkey=qkey,
        record=bytes((len(raw),)) + raw + struct.pack("<H", queue),
        parent=lmq_parent,
        lite=lmq_lite,
        state_key=STATE + qkey if lmq_parent is None or lmq_lite is None else lite_key(lmq_parent, lmq_lite),
        entry_prefix=ENTRY + qkey,
        offset_prefix=OFFSET + qkey,
    )


PARENTS_CACHED: Final = 1024  # parent topics whose validity a NameCache remembers


class NameCache:
    """Validated queue names and topic encodings, memoized; one per store. Bounded: each map is cleared when
    full (``caches.BoundedDict``: names are cheap to re-validate; what matters is that a 1M-topic broker never
    holds 1M of them).

    ``by_topic`` maps a topic to the queue of it resolved last: a lookup keyed by the string alone (its hash
    is cached in the str) is the hot path; (topic, queue id) pairs go through ``queue``."""

    def __init__(self, capacity: int = 65_536) -> None:
        self.capacity = capacity
        self.by_topic: caches.BoundedDict[str, QueueName] = caches.BoundedDict(capacity)
        self._queues: caches.BoundedDict[tuple[str, int], QueueName] = caches.BoundedDict(capacity)
        self.topics: caches.BoundedDict[str, bytes] = caches.BoundedDict(capacity)  # topic -> its encoding
        # lite topic -> its encoded record property (codec's)
        self.lite_properties: caches.BoundedDict[str, bytes] = caches.BoundedDict(capacity)
        # Records of 3+ queues (a multi-dispatch the broker itself never sends): their names and how the record
        # lists them, or None when a queue is listed twice. A list holds up to 255 names: capacity // 64 lists.
        self.lists: caches.BoundedDict[tuple[model.QueueId, ...], tuple[tuple[QueueName, ...], bytes] | None] = (
            caches.BoundedDict(max(1, capacity // 64))
        )
        self._parents: caches.BoundedDict[str, bool] = caches.BoundedDict(PARENTS_CACHED)

    def queue(self, topic: str, queue: int) -> QueueName:
        name = self.by_topic.get(topic)
        if name is not None and name.queue == queue:
            return name
        key = (topic, queue)
        name = self._queues.get(key)
        if name is None:
            name = self._queues.put(key, parse_queue(topic, queue, self.valid_parent))
        return self.by_topic.put(topic, name)

    def queue_list(self, queues: tuple[model.QueueId, ...]) -> tuple[tuple[QueueName, ...], bytes] | None:
        """The names of a record's 3+ queues and how the record lists them, memoized in ``lists``; None when one
        is listed twice (InvalidName & co on a bad name)."""
        found = self.lists.get(queues)
        if found is None and queues not in self.lists:
            resolved = tuple([self.queue(q.topic, q.queue) for q in queues])
            if len({qn.qkey for qn in resolved}) == len(resolved):
                found = (resolved, b"".join([qn.record for qn in resolved]))
            self.lists.put(queues, found)
        return found

    def valid_parent(self, name: str) -> bool:
        """Whether ``name`` is a valid parent topic, memoized: parents are few, a million LMQ names share them."""
        valid = self._parents.get(name)
        return self._parents.put(name, model.is_valid_resource_name(name)) if valid is None else valid

    def topic(self, topic: str) -> bytes:
        raw = self.topics.get(topic)
        if raw is None:
            if not model.is_valid_resource_name(topic):
                raise errors.InvalidName(f"invalid topic name {topic!r}", topic=topic)
            raw = self.topics.put(topic, topic.encode())
        return raw

    def clear(self) -> None:
        self.by_topic.clear()
        self._queues.clear()
        self.topics.clear()
        self.lite_properties.clear()
        self.lists.clear()
        self._parents.clear()


def lmq_topic(parent: str, lite: str) -> str:
    return f"{model.LMQ_PREFIX}{model.LMQ_SEPARATOR}{parent}{model.LMQ_SEPARATOR}{lite}"


# --- keys --------------------------------------------------------------------------------------------


def relocated_from(source: str, queue: model.QueueId) -> bytes:
    """The meta key of what leaving broker ``source`` stored here of its ``queue`` (``RELOCATED_FROM``)."""
    return RELOCATED_FROM + source.encode() + b"\0" + queue.topic.encode() + b"\0" + U32BE.pack(queue.queue)


def entry_key(qkey: bytes, first_offset: int) -> bytes:
    return ENTRY + qkey + U64BE.pack(first_offset)


LMQ_QKEY_PREFIX: Final = (model.LMQ_PREFIX + model.LMQ_SEPARATOR).encode()


def state_key_of(qkey: bytes) -> bytes | None:
    """The state key of a stored qkey without validating its name (a hot loop over stored keys); None for a
    malformed LMQ name."""
    if not qkey.startswith(LMQ_QKEY_PREFIX):
        return STATE + qkey
    parts = qkey[:-3].split(model.LMQ_SEPARATOR.encode())
    return LITE + parts[1] + b"\x00" + parts[2] if len(parts) == 3 and qkey[-2:] == b"\x00\x00" else None


def next_of_state(state_key: bytes, value: bytes) -> int:
    """The next offset in a stored ``S`` or ``L`` value."""
    return int(LITE_VALUE.unpack(value)[4] if state_key[:1] == LITE else STATE_VALUE.unpack(value)[1])


def hole_key(qkey: bytes, first_offset: int) -> bytes:
    return HOLE + qkey + U64BE.pack(first_offset)


def lite_key(parent: str, lite: str) -> bytes:
    return LITE + parent.encode() + b"\x00" + lite.encode()


def lite_prefix(parent: str | None) -> bytes:
    return LITE if parent is None else LITE + parent.encode() + b"\x00"


def split_lite_key(key: bytes) -> tuple[str, str]:
    parent, _, lite = key[1:].partition(b"\x00")
    return parent.decode(), lite.decode()


def offset_key(qkey: bytes, group: str) -> bytes:
    return OFFSET + qkey + group.encode()


def consumed_key(qkey: bytes) -> bytes:
    return CONSUMED + qkey


def acked_key(qkey: bytes, group: str) -> bytes:
    return ACKED + qkey + group.encode()


def split_group_key(key: bytes) -> tuple[bytes, str]:
    """(qkey, group) of an ``offset_key`` or ``acked_key``: the qkey ends two bytes after its NUL."""
    end = key.index(b"\x00", 1) + 3
    return key[1:end], key[end:].decode()


ACKED_RANGES_FLAG: Final = 1 << 63  # set in the u64 of an ``A`` value in the runs format (offsets stay below 2**62)
ACKED_HANDOUTS_FLAG: Final = 1 << 62  # set too when the value carries a hand-out section (``encode_acked``)
ACKED_MAX_RUNS: Final = 4096  # runs an ``A`` value may hold: the dispatcher persists at most this many
HANDOUTS_MAX_COUNTS: Final = 1024  # attempt counts an ``A`` value may hold (a lease window's worth)
VARINT_MAX_BYTES: Final = 10
ACKED_MAX_BYTES: Final = (  # hard cap of an ``A`` value (~100 KiB)
    8 + ACKED_MAX_RUNS * 2 * VARINT_MAX_BYTES + (2 + HANDOUTS_MAX_COUNTS * 2) * VARINT_MAX_BYTES
)


def encode_acked(committed: int, acked: Sequence[int], handouts: model.Handouts = model.NO_HANDOUTS) -> bytes:
    """Acked offsets above ``committed`` (an ``OffsetRanges`` or ascending offsets) as run lengths, after what
    the group had handed out above it (``model.Handouts``): ``u64(committed | ACKED_RANGES_FLAG [|
    ACKED_HANDOUTS_FLAG])``; with the hand-out flag, ``uvarint(mark - committed) uvarint(n)`` then per count
    ``uvarint(offset - previous) uvarint(attempts)`` (``previous``: ``committed``, then one past the offset
    before); then per run ``uvarint(start - previous end) uvarint(length)`` up to the end of the value, the
    first run measured from ``committed``. O(runs + counts): a lost segment of millions of offsets is one run.
    Without hand-outs above ``committed`` the value is the runs format as it was before hand-outs were kept.

    More than ``ACKED_MAX_RUNS`` runs or ``HANDOUTS_MAX_COUNTS`` counts is refused (InvalidArgument), never cut
    short: a dropped run would be an ack lost at the next restart. The dispatcher persists the oldest
    ``ACKED_MAX_RUNS`` runs and keeps the rest in memory, refusing the acks it could not persist until the runs
    merge (see ``settlement.commit``); it caps the counts itself (``QueueLeases.handouts``)."""
    runs = ranges.OffsetRanges.of(acked).runs
    if len(runs) > ACKED_MAX_RUNS:
        raise errors.InvalidArgument(
            f"{len(runs)} acknowledged ranges above the commit point; at most {ACKED_MAX_RUNS} are stored",
            offset=committed,
        )
    if runs and runs[0][0] <= committed:
        raise errors.InvalidArgument("acked offsets lie above the committed offset", offset=committed)
    handouts = checked_handouts(committed, handouts)
    if handouts.mark <= committed:
        out = bytearray(U64.pack(committed | ACKED_RANGES_FLAG))
    else:
        out = bytearray(U64.pack(committed | ACKED_RANGES_FLAG | ACKED_HANDOUTS_FLAG))
        _put_uvarint(out, handouts.mark - committed)
        _put_uvarint(out, len(handouts.counts))
        previous = committed
        for offset, count in handouts.counts:
            _put_uvarint(out, offset - previous)
            _put_uvarint(out, count)
            previous = offset + 1
    previous = committed
    for start, end in runs:
        _put_uvarint(out, start - previous)
        _put_uvarint(out, end - start)
        previous = end
    return bytes(out)


def checked_handouts(committed: int, handouts: model.Handouts) -> model.Handouts:
    """``handouts`` as a store keeps them above ``committed``: nothing when the mark is not above it (then no
    count may be given); else counts at or above ``committed``, below the mark, ascending, at most
    ``HANDOUTS_MAX_COUNTS``, each >= 0 (InvalidArgument otherwise). Both stores check with this."""
    if not handouts.counts:  # the usual case (every message out once): nothing to walk
        return handouts if handouts.mark > committed else model.NO_HANDOUTS
    if handouts.mark <= committed:
        raise errors.InvalidArgument("attempt counts given without a hand-out mark above them", offset=committed)
    if len(handouts.counts) > HANDOUTS_MAX_COUNTS:
        raise errors.InvalidArgument(
            f"{len(handouts.counts)} attempt counts; at most {HANDOUTS_MAX_COUNTS} are stored", offset=committed
        )
    previous = committed
    for offset, count in handouts.counts:
        if offset < previous or offset >= handouts.mark or count < 0:
            raise errors.InvalidArgument(
                "attempt counts must lie between the committed offset and the hand-out mark, ascending",
                offset=offset,
            )
        previous = offset + 1
    return handouts


def decode_acked(value: bytes) -> tuple[int, ranges.OffsetRanges]:
    """(committed, acked offsets above it) of an ``A`` value: the runs format (with or without hand-outs), or
    the bitmap one written before it (``u64 committed`` then bit i of the bitmap: offset committed + 1 + i)."""
    committed, acked, _ = decode_progress(value)
    return committed, acked


def decode_progress(value: bytes) -> tuple[int, ranges.OffsetRanges, model.Handouts]:
    """(committed, acked offsets above it, hand-outs above it) of an ``A`` value. Values written before
    hand-outs were kept (the runs format without the hand-out flag, the bitmap format before it) hold none:
    ``NO_HANDOUTS``, as if nothing above the commit point had been delivered (what every restart assumed
    then)."""
    (head,) = U64.unpack_from(value)
    if not head & ACKED_RANGES_FLAG:
        return head, _decode_bitmap(head, value[U64.size :]), model.NO_HANDOUTS
    committed = head & ~(ACKED_RANGES_FLAG | ACKED_HANDOUTS_FLAG)
    at = U64.size
    handouts = model.NO_HANDOUTS
    if head & ACKED_HANDOUTS_FLAG:
        above, at = _get_uvarint(value, at)
        n, at = _get_uvarint(value, at)
        counts: list[tuple[int, int]] = []
        previous = committed
        for _ in range(n):
            gap, at = _get_uvarint(value, at)
            count, at = _get_uvarint(value, at)
            counts.append((previous + gap, count))
            previous += gap + 1
        handouts = model.Handouts(committed + above, tuple(counts))
    runs: list[tuple[int, int]] = []
    previous = committed
    while at < len(value):
        gap, at = _get_uvarint(value, at)
        length, at = _get_uvarint(value, at)
        start = previous + gap
        previous = start + length
        runs.append((start, previous))
    return committed, ranges.OffsetRanges(runs), handouts


def _decode_bitmap(committed: int, bits: bytes) -> ranges.OffsetRanges:
    runs: list[tuple[int, int]] = []
    start = end = -1
    base = committed + 1
    for i, byte in enumerate(bits):
        if byte == 0:
            continue
        at = base + (i << 3)
        if byte == 0xFF and end == at:
            end = at + 8  # a full byte extends the current run
            continue
        for b in range(8):
            if byte >> b & 1:
                if at + b == end:
                    end += 1
                else:
                    if end > start:
                        runs.append((start, end))
                    start, end = at + b, at + b + 1
    if end > start:
        runs.append((start, end))
    return ranges.OffsetRanges(runs)


def _put_uvarint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)


def _get_uvarint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift >= 7 * VARINT_MAX_BYTES:
            raise errors.CorruptRecord("truncated acked-offsets value")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def split_qkey(qkey: bytes) -> tuple[str, int]:
    """(topic, queue id) of a qkey."""
    return qkey[:-3].decode(), U16BE.unpack_from(qkey, len(qkey) - 2)[0]


def count_key(parent: str | None) -> bytes:
    return TOTAL_COUNT_KEY if parent is None else COUNT + parent.encode()


def segment_key(segment: int) -> bytes:
    return SEGMENT + U32BE.pack(segment)


def name_key(prefix: bytes, name: str) -> bytes:
    return prefix + name.encode()


def queue_of_qkey(qkey: bytes) -> model.QueueId:
    """The queue a ``qkey`` names (topic | 0x00 | u16be queue id)."""
    return model.QueueId(qkey[:-3].decode(), U16BE.unpack(qkey[-2:])[0])


def successor(prefix: bytes) -> bytes:
    """The smallest key greater than every key that starts with ``prefix``."""
    trimmed = prefix.rstrip(b"\xff")
    if not trimmed:
        raise ValueError("no successor of an all-0xff prefix")
    return trimmed[:-1] + bytes((trimmed[-1] + 1,))


# --- values ------------------------------------------------------------------------------------------


def encode_run(segment: int, store_ms: int, entries: list[bytes]) -> bytes:
    return RUN_HEAD.pack(segment, store_ms) + b"".join(entries)


def decode_run(value: bytes) -> tuple[int, int, list[tuple[int, int]]]:
    """(segment, store_ms, [(position, size), ...])."""
    segment, store_ms = RUN_HEAD.unpack_from(value)
    entries = [RUN_ENTRY.unpack_from(value, off) for off in range(RUN_HEAD.size, len(value), RUN_ENTRY.size)]
    return segment, store_ms, entries


def run_length(value: bytes) -> int:
    return (len(value) - RUN_HEAD.size) // RUN_ENTRY.size


def encode_lite(meta: model.LiteTopicMeta) -> bytes:
    return LITE_VALUE.pack(meta.created_ms, meta.last_store_ms, meta.last_consume_ms, meta.min_offset, meta.max_offset)


def decode_lite(parent: str, lite: str, value: bytes) -> model.LiteTopicMeta:
    created, last_store, last_consume, min_offset, max_offset = LITE_VALUE.unpack(value)
    return model.LiteTopicMeta(parent, lite, created, last_store, last_consume, min_offset, max_offset)


def encode_parent_topic(topic: model.ParentTopic) -> bytes:
    return json.dumps(
        {
            "name": topic.name,
            "message_type": int(topic.message_type),
            "expiration_minutes": topic.expiration_minutes,
            "max_lite_topics": topic.max_lite_topics,
            "queue_count": topic.queue_count,
        },
        sort_keys=True,
    ).encode()


def decode_parent_topic(value: bytes) -> model.ParentTopic:
    d = json.loads(value)
    return model.ParentTopic(
        name=d["name"],
        message_type=model.MessageType(d["message_type"]),
        expiration_minutes=d["expiration_minutes"],
        max_lite_topics=d["max_lite_topics"],
        queue_count=d["queue_count"],
    )


def encode_group(group: model.LiteGroup) -> bytes:
    return json.dumps(
        {
            "name": group.name,
            "bind_topic": group.bind_topic,
            "model": str(group.model),
            "client_quota": group.client_quota,
            "ready_capacity": group.ready_capacity,
            "retry": {"max_attempts": group.retry.max_attempts, "backoff_ms": list(group.retry.backoff_ms)},
            "fifo": group.fifo,
            "consume_enabled": group.consume_enabled,
            "wildcard": group.wildcard,
            "lite_patterns": list(group.lite_patterns),
        },
        sort_keys=True,
    ).encode()


def decode_group(value: bytes) -> model.LiteGroup:
    d = json.loads(value)
    return model.LiteGroup(
        name=d["name"],
        bind_topic=d["bind_topic"],
        model=model.SubscriptionModel(d["model"]),
        client_quota=d["client_quota"],
        ready_capacity=d["ready_capacity"],
        retry=model.RetryPolicy(max_attempts=d["retry"]["max_attempts"], backoff_ms=tuple(d["retry"]["backoff_ms"])),
        fifo=d["fifo"],
        consume_enabled=d["consume_enabled"],
        wildcard=d.get("wildcard", False),  # absent in groups stored before wildcard groups existed
        lite_patterns=tuple(d.get("lite_patterns", ())),  # absent in groups stored before group patterns
    )


def encode_quota(quota: model.Quota) -> bytes:
    return json.dumps(
        {
            "scope": quota.scope,
            "max_lite_topics": quota.max_lite_topics,
            "max_subscriptions_per_client": quota.max_subscriptions_per_client,
            "max_send_rate": quota.max_send_rate,
        },
        sort_keys=True,
    ).encode()


def decode_quota(value: bytes) -> model.Quota:
    d = json.loads(value)
    return model.Quota(
        scope=d["scope"],
        max_lite_topics=d["max_lite_topics"],
        max_subscriptions_per_client=d["max_subscriptions_per_client"],
        max_send_rate=d["max_send_rate"],
    )


def encode_reclaim_run(run: model.ReclaimRun) -> bytes:
    return json.dumps({name: getattr(run, name) for name in model.RECLAIM_RUN_FIELDS}, sort_keys=True).encode()


def decode_reclaim_run(value: bytes) -> model.ReclaimRun:
    d = json.loads(value)
    return model.ReclaimRun(**{name: d[name] for name in model.RECLAIM_RUN_FIELDS})
