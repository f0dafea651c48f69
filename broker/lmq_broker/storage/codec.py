"""Commit-log record codec: pure functions from values to bytes and back; no I/O.

Record format, version 1 (integers little-endian)::

    off  size  field
    0    4     length        bytes after this field: 4 (crc) + 36 (header) + the variable part
    4    4     crc           CRC32C of every byte after this field (header + variable part)
    8    1     version       1; anything else is UnsupportedVersion
    9    1     kind          0 message, 1 queue tombstone (a lite topic deleted at the listed offset),
                             2 queue truncation (a queue cut back: its next offset becomes the listed one)
    10   1     message type  model.MessageType
    11   1     n             number of queues, 1..255
    12   8     store_ms
    20   8     born_ms
    28   2     message id length
    30   2     topic length
    32   4     queue names length
    36   4     properties length
    40   4     body length
    44   8n    u64 offset of the record in each queue, in queue order (RocketMQ's INNER_MULTI_QUEUE_OFFSET)
    ..         queue names: n x (u8 length | topic | u16 queue id)
    ..         message id | topic | properties | body

    properties: a sequence of (u8 tag | u32 length | value); tags 1 lite topic, 2 born host, 3 tag,
    4 key (repeated), 5 message group, 6 user property (u16 key length | key | value), 7 replication epoch
    (u64; absent: 0, the epoch the slot's owner stored the record in: ``replication.divergence``), 8 ring slot
    (u32; absent: not recorded, the slot the record's lite topic was placed on: ``replication.owning``). Unknown
    tags are skipped so that version 1 can grow optional fields.

A record is stored once whatever the number of queues: an extra queue costs 8 bytes of offset plus its
name here, and one index entry. The queue offsets live in the record so that the index can be rebuilt
from the log with the same offsets. A record never spans two segment files.

Recovery (``resync``) finds the record after a bad one: from the bad record's own frame when its header
vouches for its extent, else by a scan that accepts a frame only if the records after it check too (a frame
copied inside a message body is followed by the rest of that body, which does not parse).
"""

from __future__ import annotations

import mmap
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final, NamedTuple, TypedDict

import crc32c as _crc32c

from lmq_broker import errors, model
from lmq_broker.storage import keys

VERSION: Final = 1
KIND_MESSAGE: Final = 0
KIND_TOMBSTONE: Final = 1
KIND_TRUNCATION: Final = 2
MAX_QUEUES_PER_RECORD: Final = 255
MAX_MESSAGE_ID_BYTES: Final = 128
# A frame found by the resync scan is taken only if this many records after it check as well (or all of them
# up to the segment end, when fewer are left).
CHAIN_RECORDS: Final = 4

PREFIX: Final = struct.Struct("<II")  # length, crc
HEADER: Final = struct.Struct("<BBBBQQHHIII")
FIXED_BYTES: Final = PREFIX.size + HEADER.size  # 44
PROPERTY: Final = struct.Struct("<BI")
USER_KEY: Final = struct.Struct("<H")
SLOT: Final = struct.Struct("<I")  # TAG_SLOT's value
OFFSETS: Final = tuple(struct.Struct(f"<{n}Q") for n in range(MAX_QUEUES_PER_RECORD + 1))
QUEUE_NAME_TAIL: Final = struct.Struct("<H")

TAG_LITE_TOPIC: Final = 1
TAG_BORN_HOST: Final = 2
TAG_TAG: Final = 3
TAG_KEY: Final = 4
TAG_MESSAGE_GROUP: Final = 5
TAG_USER_PROPERTY: Final = 6
TAG_EPOCH: Final = 7
TAG_SLOT: Final = 8


def crc32c_of(data: bytes | memoryview, value: int = 0) -> int:
    return int(_crc32c.crc32c(data, value))


class Prepared(NamedTuple):
    """A message validated and encoded except for its offsets and store time (a tuple: cheap to build)."""

    message: model.NewMessage
    queues: tuple[keys.QueueName, ...]
    header: bytes  # the fixed header, packed (store time included: the store reads its clock first)
    tail: bytes  # queue names | message id | topic | properties
    size: int  # the whole framed record


@dataclass(frozen=True, slots=True)
class Record:
    """A decoded record (the read path builds StoredMessage directly; this is for tools and tests)."""

    kind: int
    message_type: model.MessageType
    store_ms: int
    born_ms: int
    queues: tuple[tuple[str, int], ...]
    offsets: tuple[int, ...]
    message_id: str
    topic: str
    body: bytes
    lite_topic: str | None = None
    born_host: str = ""
    tag: str | None = None
    keys: tuple[str, ...] = ()
    message_group: str | None = None
    user_properties: dict[str, str] = field(default_factory=dict)
    epoch: int = 0
    slot: int = -1


class Frame(NamedTuple):
    """What the recovery scan needs of a record: where it is and which queue offsets it holds."""

    position: int
    size: int
    kind: int
    store_ms: int
    queues: tuple[tuple[str, int], ...]
    offsets: tuple[int, ...]


# --- encoding ----------------------------------------------------------------------------------------


def record_size(*, n_queues: int, names: int, message_id: int, topic: int, properties: int, body: int) -> int:
    return FIXED_BYTES + 8 * n_queues + names + message_id + topic + properties + body


def _prop(tag: int, value: bytes) -> bytes:
    return PROPERTY.pack(tag, len(value)) + value


def encode_properties(m: model.NewMessage) -> bytes:
    parts: list[bytes] = []
    if m.lite_topic is not None:
        parts.append(_prop(TAG_LITE_TOPIC, m.lite_topic.encode()))
    if m.born_host:
        parts.append(_prop(TAG_BORN_HOST, m.born_host.encode()))
    if m.tag is not None:
        parts.append(_prop(TAG_TAG, m.tag.encode()))
    for k in m.keys:
        parts.append(_prop(TAG_KEY, k.encode()))
    if m.message_group is not None:
        parts.append(_prop(TAG_MESSAGE_GROUP, m.message_group.encode()))
    for k, v in m.user_properties.items():
        kb = k.encode()
        parts.append(_prop(TAG_USER_PROPERTY, USER_KEY.pack(len(kb)) + kb + v.encode()))
    if m.epoch:
        parts.append(_prop(TAG_EPOCH, keys.U64.pack(m.epoch)))
    if m.slot >= 0:
        parts.append(_prop(TAG_SLOT, SLOT.pack(m.slot)))
    return b"".join(parts)


def prepare_plain(m: model.NewMessage, names: keys.NameCache, max_record_bytes: int, store_ms: int) -> Prepared:
    """Validate one message and encode all but its offsets. Raises InvalidArgument subclasses."""
    if not m.body and m.user_properties.get(model.EMPTY_BODY_PROPERTY) != "1":  # an MQTT publish may be empty
        raise errors.BodyEmpty("message body is empty", message_id=m.message_id)
    qnames = queue_names_of(m, names)
    mid = m.message_id.encode()
    if not 0 < len(mid) <= MAX_MESSAGE_ID_BYTES:
        raise errors.InvalidArgument(f"message id must be 1..{MAX_MESSAGE_ID_BYTES} bytes", message_id=m.message_id)
    topic = names.topics.get(m.topic) or names.topic(m.topic)
    lite = m.lite_topic
    if lite is not None and not any(qn.lite == lite for qn in qnames) and not model.is_valid_lite_topic(lite):
        raise errors.InvalidLiteTopic(f"invalid lite topic {lite!r}", lite_topic=lite)
    queue_names = b"".join([qn.record for qn in qnames])
    props = encode_properties(m)
    size = record_size(
        n_queues=len(qnames),
        names=len(queue_names),
        message_id=len(mid),
        topic=len(topic),
        properties=len(props),
        body=len(m.body),
    )
    if size > max_record_bytes:
        raise errors.RecordTooLarge(
            f"record of {size} bytes exceeds {max_record_bytes}", message_id=m.message_id, size=size
        )
    fields = (len(mid), len(topic), len(queue_names), len(props), len(m.body))
    header = HEADER.pack(VERSION, KIND_MESSAGE, m.message_type, len(qnames), store_ms, m.born_timestamp_ms, *fields)
    return Prepared(message=m, queues=qnames, header=header, tail=queue_names + mid + topic + props, size=size)


def queue_names_of(m: model.NewMessage, names: keys.NameCache) -> tuple[keys.QueueName, ...]:
    """The validated names of a message's queues (1..``MAX_QUEUES_PER_RECORD``, none twice)."""
    n = len(m.queues)
    if n == 0 or n > MAX_QUEUES_PER_RECORD:
        raise errors.InvalidArgument(
            f"a message needs 1..{MAX_QUEUES_PER_RECORD} queues, got {n}", message_id=m.message_id
        )
    qnames = tuple([names.queue(q.topic, q.queue) for q in m.queues])
    if len({qn.qkey for qn in qnames}) != n:
        raise errors.InvalidArgument("a message lists the same queue twice", message_id=m.message_id)
    return qnames


def prepare(m: model.NewMessage, names: keys.NameCache, max_record_bytes: int, store_ms: int) -> Prepared:  # noqa: PLR0912 (a branch per message field)
    """``prepare_plain``'s fast twin, the one both stores run: the one- and two-queue cases unrolled, a lite
    topic's encoded property memoized in ``names``, the tuple built without NamedTuple's Python-level
    ``__new__``. Measured in the same sitting (bench/RESULTS.md, 2026-11-28 15:00): 2.8 against 6.8-10.6 us per
    message. tests/storage/test_codec.py checks it against ``prepare_plain``, values and errors alike."""
    body = m.body
    if not body and m.user_properties.get(model.EMPTY_BODY_PROPERTY) != "1":  # an MQTT publish may be empty
        raise errors.BodyEmpty("message body is empty", message_id=m.message_id)
    queues = m.queues
    n = len(queues)
    if n == 0 or n > MAX_QUEUES_PER_RECORD:
        raise errors.InvalidArgument(
            f"a message needs 1..{MAX_QUEUES_PER_RECORD} queues, got {n}", message_id=m.message_id
        )
    if n > 2:  # a list the store allows (RIP-28 multi-dispatch); the broker's own messages name one or two queues
        listed = names.lists.get(queues) or names.queue_list(queues)
        if listed is None:
            raise errors.InvalidArgument("a message lists the same queue twice", message_id=m.message_id)
        qnames, queue_names = listed
    else:  # one or two queues (the LMQ; the parent queue too with ``index_parent_queue``), unrolled
        cached = names.by_topic.get
        qn = cached(queues[0].topic)
        if qn is None or qn.queue != queues[0].queue:
            qn = names.queue(queues[0].topic, queues[0].queue)
        if n == 1:
            qnames = (qn,)
            queue_names = qn.record
        else:
            qn2 = cached(queues[1].topic)
            if qn2 is None or qn2.queue != queues[1].queue:
                qn2 = names.queue(queues[1].topic, queues[1].queue)
            if qn.qkey == qn2.qkey:
                raise errors.InvalidArgument("a message lists the same queue twice", message_id=m.message_id)
            qnames = (qn, qn2)
            queue_names = qn.record + qn2.record
    mid = m.message_id.encode()
    if not 0 < len(mid) <= MAX_MESSAGE_ID_BYTES:
        raise errors.InvalidArgument(f"message id must be 1..{MAX_MESSAGE_ID_BYTES} bytes", message_id=m.message_id)
    topic = names.topics.get(m.topic) or names.topic(m.topic)
    lite = m.lite_topic
    if (
        m.born_host
        or m.tag is not None
        or m.keys
        or m.message_group is not None
        or m.user_properties
        or m.epoch
        or m.slot >= 0
    ):
        props = encode_properties(m)
    elif lite is not None:
        found = names.lite_properties.get(lite)
        if found is None:
            raw = lite.encode()
            found = names.lite_properties.put(lite, PROPERTY.pack(TAG_LITE_TOPIC, len(raw)) + raw)
        props = found
    else:
        props = b""
    # A LITE message's LMQ is its last queue and already validated: that test settles it without a scan.
    if (
        lite is not None
        and qnames[-1].lite != lite
        and not any(qn.lite == lite for qn in qnames)
        and not model.is_valid_lite_topic(lite)
    ):
        raise errors.InvalidLiteTopic(f"invalid lite topic {lite!r}", lite_topic=lite)
    n_mid, n_topic, n_names, n_props, n_body = len(mid), len(topic), len(queue_names), len(props), len(body)
    size = FIXED_BYTES + 8 * n + n_names + n_mid + n_topic + n_props + n_body
    if size > max_record_bytes:
        raise errors.RecordTooLarge(
            f"record of {size} bytes exceeds {max_record_bytes}", message_id=m.message_id, size=size
        )
    return tuple.__new__(
        Prepared,
        (
            m,
            qnames,
            HEADER.pack(
                VERSION,
                KIND_MESSAGE,
                m.message_type,
                n,
                store_ms,
                m.born_timestamp_ms,
                n_mid,
                n_topic,
                n_names,
                n_props,
                n_body,
            ),
            queue_names + mid + topic + props,
            size,
        ),
    )


def frame(p: Prepared, offsets: tuple[int, ...]) -> tuple[bytes, bytes]:
    """(length | crc, header | offsets | tail) of a prepared message; the body follows them on disk."""
    head = p.header + OFFSETS[len(offsets)].pack(*offsets) + p.tail
    return PREFIX.pack(p.size - 4, _crc32c.crc32c(p.message.body, _crc32c.crc32c(head))), head


def encode(  # noqa: PLR0913 (a record's fields, written without building an object (send path))
    *,
    kind: int,
    message_type: int,
    store_ms: int,
    born_ms: int,
    offsets: list[int],
    names: bytes,
    message_id: bytes,
    topic: bytes,
    properties: bytes,
    body: bytes,
) -> bytes:
    """One whole framed record from its parts (tombstones, tests and tools; messages go through ``frame``)."""
    n = len(offsets)
    head = (
        HEADER.pack(
            VERSION,
            kind,
            message_type,
            n,
            store_ms,
            born_ms,
            len(message_id),
            len(topic),
            len(names),
            len(properties),
            len(body),
        )
        + OFFSETS[n].pack(*offsets)
        + names
        + message_id
        + topic
        + properties
    )
    crc = crc32c_of(body, crc32c_of(head))
    return PREFIX.pack(4 + len(head) + len(body), crc) + head + body


def encode_tombstone(queue: keys.QueueName, offset: int, store_ms: int, kind: int = KIND_TOMBSTONE) -> bytes:
    """A record that deletes a queue (a lite topic): replayed by a rebuild so deleted topics stay deleted. With
    ``kind`` KIND_TRUNCATION, one that cuts the queue back to ``offset`` (``truncation``)."""
    return encode(
        kind=kind,
        message_type=0,
        store_ms=store_ms,
        born_ms=store_ms,
        offsets=[offset],
        names=queue.record,
        message_id=b"",
        topic=b"",
        properties=b"",
        body=b"",
    )


# --- decoding ----------------------------------------------------------------------------------------


def _check(buf: bytes | memoryview | mmap.mmap, pos: int, end: int) -> tuple[int, tuple[int, ...]]:
    """Validate the frame at ``pos``; return (size, header fields). CorruptRecord / UnsupportedVersion.

    The structure (lengths adding up to the frame, a known kind) is checked before the CRC: a few comparisons
    that spare resync a CRC over random lengths at each candidate position. A record of another version is
    only judged by its CRC (its layout is not ours): UnsupportedVersion if that checks, else CorruptRecord."""
    if end - pos < FIXED_BYTES:
        raise errors.CorruptRecord("truncated record header", position=pos)
    length, crc = PREFIX.unpack_from(buf, pos)
    size = 4 + length
    if length < 4 + HEADER.size or pos + size > end:
        raise errors.CorruptRecord("record length out of bounds", position=pos, length=length)
    header = HEADER.unpack_from(buf, pos + PREFIX.size)
    if header[0] == VERSION:
        n = header[3]
        if FIXED_BYTES + 8 * n + sum(header[6:]) != size or n == 0 or header[1] > KIND_TRUNCATION:
            if header[1] > KIND_TRUNCATION:
                raise errors.CorruptRecord(f"unknown record kind {header[1]}", position=pos)
            raise errors.CorruptRecord("record field lengths do not add up", position=pos)  # must fill the frame
        if crc32c_of(memoryview(buf)[pos + PREFIX.size : pos + size]) != crc:
            raise errors.CorruptRecord("record CRC mismatch", position=pos)
        return size, header
    if crc32c_of(memoryview(buf)[pos + PREFIX.size : pos + size]) != crc:
        raise errors.CorruptRecord("record CRC mismatch", position=pos)
    version = header[0]
    raise errors.UnsupportedVersion(f"record version {version} not supported", position=pos, version=version)


def _queues(buf: bytes | memoryview | mmap.mmap, at: int, n: int, stop: int, pos: int) -> tuple[tuple[str, int], ...]:
    """The queue names section from ``at`` to ``stop``: CorruptRecord (at ``pos``) unless it is exactly ``n``
    names of UTF-8. A CRC only proves the bytes are as written, and a crafted frame copied in a body may be
    taken for a record by resync: nothing it holds may escape as another exception."""
    out = []
    try:
        for _ in range(n):
            ln = buf[at]
            name = bytes(buf[at + 1 : at + 1 + ln]).decode()
            (qid,) = QUEUE_NAME_TAIL.unpack_from(buf, at + 1 + ln)
            out.append((name, qid))
            at += 3 + ln
    except (ValueError, IndexError, struct.error) as e:  # UnicodeDecodeError is a ValueError
        raise errors.CorruptRecord(f"record queue names do not decode: {e}", position=pos) from None
    if at != stop:
        raise errors.CorruptRecord("record queue names do not fill their section", position=pos)
    return tuple(out)


def scan(buf: bytes | memoryview, pos: int, end: int) -> Iterator[Frame]:
    """Frames from ``pos`` up to ``end``; raises CorruptRecord (with ``position``) at the first bad one."""
    while pos < end:
        size, header = _check(buf, pos, end)
        n = header[3]
        at = pos + FIXED_BYTES
        offsets = OFFSETS[n].unpack_from(buf, at)
        at += 8 * n
        queues = _queues(buf, at, n, at + header[8], pos)
        yield Frame(pos, size, header[1], header[4], queues, offsets)
        pos += size


# Where a header may start: version 1 and kind message, or a tombstone's or a truncation's version, kind, type 0
# and one queue.
_CANDIDATE: Final = re.compile(rb"\x01\x00|\x01[\x01\x02]\x00\x01")


def resync(buf: bytes | mmap.mmap, pos: int, end: int) -> int | None:
    """After the bad record at ``pos``: where to go on, or None (nothing valid follows: a torn tail).

    1. The bad record's own extent, when its frame vouches for it: its length field agrees with its header's
       lengths (the damage is elsewhere: body, CRC, times), or the header's lengths delimit bytes whose CRC32C
       checks (the length field itself is the damaged part). The position returned may hold another bad
       record; the caller resyncs again from there.
    2. Else the earliest position after ``pos`` where a record starts and the CHAIN_RECORDS records after it
       (or all of them up to ``end``) check too. A frame embedded in a message body is followed by the rest of
       that body and is refused; a valid frame is skipped whole (no record starts inside bytes whose CRC
       checks), so the CRC work stays linear in the segment.

    Never the bad record's length field alone: a damaged length may land on a later record boundary and
    skip the valid records in between."""
    extent = _extent(buf, pos, end)
    if extent is not None:
        return extent if extent < end else None
    at = pos + 1
    while at + FIXED_BYTES <= end:
        found = _CANDIDATE.search(buf, at + PREFIX.size, end)  # the header's first bytes: version, kind
        if found is None:
            return None
        candidate = found.start() - PREFIX.size
        broken = _broken_chain(buf, candidate, end)
        if broken is None:
            return candidate
        at = max(candidate + 1, broken)
    return None


def _extent(buf: bytes | mmap.mmap, pos: int, end: int) -> int | None:
    """Where the bad record at ``pos`` ends, when its frame says so reliably (see ``resync``), else None."""
    if end - pos < FIXED_BYTES:
        return None
    length, crc = PREFIX.unpack_from(buf, pos)
    header = HEADER.unpack_from(buf, pos + PREFIX.size)
    n: int = header[3]
    size: int = FIXED_BYTES + 8 * n + sum(header[6:])
    if n == 0 or pos + size > end:
        return None
    if size == 4 + length or crc32c_of(memoryview(buf)[pos + PREFIX.size : pos + size]) == crc:
        return pos + size
    return None


def _broken_chain(buf: bytes | mmap.mmap, pos: int, end: int) -> int | None:
    """None if a valid record starts at ``pos`` and the CHAIN_RECORDS after it (or all up to ``end``) are
    valid; else the position of the first one that is not."""
    at = pos
    for _ in range(1 + CHAIN_RECORDS):
        if at == end:
            return None
        try:
            size, header = _check(buf, at, end)
            n = header[3]
            names = at + FIXED_BYTES + 8 * n
            _queues(buf, names, n, names + header[8], at)
        except (errors.CorruptRecord, errors.UnsupportedVersion):
            return at
        at += size
    return None


class _Properties(TypedDict, total=False):
    """The optional fields of a record, by their ``Record``/``StoredMessage`` names; absent ones are left out."""

    lite_topic: str
    born_host: str
    tag: str
    keys: tuple[str, ...]
    message_group: str
    user_properties: dict[str, str]
    epoch: int
    slot: int


def _properties(raw: bytes) -> _Properties:
    out: _Properties = {}
    keys_: list[str] = []
    user: dict[str, str] = {}
    at = 0
    while at < len(raw):
        tag, ln = PROPERTY.unpack_from(raw, at)
        at += PROPERTY.size
        value = raw[at : at + ln]
        at += ln
        if tag == TAG_LITE_TOPIC:
            out["lite_topic"] = value.decode()
        elif tag == TAG_BORN_HOST:
            out["born_host"] = value.decode()
        elif tag == TAG_TAG:
            out["tag"] = value.decode()
        elif tag == TAG_KEY:
            keys_.append(value.decode())
        elif tag == TAG_MESSAGE_GROUP:
            out["message_group"] = value.decode()
        elif tag == TAG_USER_PROPERTY:
            (kl,) = USER_KEY.unpack_from(value)
            user[value[2 : 2 + kl].decode()] = value[2 + kl :].decode()
        elif tag == TAG_EPOCH:
            out["epoch"] = keys.U64.unpack(value)[0]
        elif tag == TAG_SLOT:
            out["slot"] = SLOT.unpack(value)[0]
    if keys_:
        out["keys"] = tuple(keys_)
    if user:
        out["user_properties"] = user
    return out


_MESSAGE_TYPES: Final = {int(t): t for t in model.MessageType}


def _message_type(value: int, pos: int) -> model.MessageType:
    mtype = _MESSAGE_TYPES.get(value)
    if mtype is None:
        raise errors.CorruptRecord(f"unknown message type {value}", position=pos)
    return mtype


def decode(buf: bytes) -> Record:
    _, header = _check(buf, 0, len(buf))
    _, kind, mtype, n, store_ms, born_ms, mid_len, topic_len, names_len, props_len, body_len = header
    at = FIXED_BYTES
    offsets = OFFSETS[n].unpack_from(buf, at)
    at += 8 * n
    queues = _queues(buf, at, n, at + names_len, 0)
    at += names_len
    try:
        mid = buf[at : at + mid_len].decode()
        at += mid_len
        topic = buf[at : at + topic_len].decode()
        at += topic_len
        props = _properties(buf[at : at + props_len])
    except (ValueError, struct.error) as e:  # a CRC-valid frame written by something else than ``encode``
        raise errors.CorruptRecord(f"record fields do not decode: {e}", position=0) from None
    at += props_len
    body = buf[at : at + body_len]
    return Record(
        kind,
        _message_type(mtype, 0) if kind == KIND_MESSAGE else model.MessageType.NORMAL,
        store_ms,
        born_ms,
        queues,
        offsets,
        mid,
        topic,
        body,
        **props,
    )


def decode_message(buf: bytes, queue: model.QueueId, offset: int) -> model.StoredMessage:
    """The read path: one record (exactly ``buf``) as the message stored at ``offset`` of ``queue``.

    Same checks as ``decode``, specialised for one whole buffer."""
    if len(buf) < FIXED_BYTES:
        raise errors.CorruptRecord("truncated record header", offset=offset)
    length, crc = PREFIX.unpack_from(buf)
    if length + 4 != len(buf):
        raise errors.CorruptRecord("record length does not match its index entry", offset=offset)
    if _crc32c.crc32c(buf[8:]) != crc:
        raise errors.CorruptRecord("record CRC mismatch", offset=offset)
    version, kind, mtype, n, store_ms, born_ms, mid_len, topic_len, names_len, props_len, body_len = HEADER.unpack_from(
        buf, 8
    )
    if version != VERSION:
        raise errors.UnsupportedVersion(f"record version {version} not supported", offset=offset, version=version)
    if kind != KIND_MESSAGE or n == 0:
        raise errors.CorruptRecord("index points at a record that is not a message", offset=offset)
    at = FIXED_BYTES + 8 * n + names_len
    if at + mid_len + topic_len + props_len + body_len != len(buf):
        raise errors.CorruptRecord("record field lengths do not add up", offset=offset)
    try:  # free unless raised: a CRC-valid frame not written by ``prepare`` must not escape as another error
        message_id = buf[at : at + mid_len].decode()
        at += mid_len
        topic = buf[at : at + topic_len].decode()
        at += topic_len
        message_type = _message_type(mtype, 0)
        tag = ln = 0
        if props_len:
            tag, ln = PROPERTY.unpack_from(buf, at)
        if not props_len or (tag == TAG_LITE_TOPIC and ln + PROPERTY.size == props_len):
            # the common case: no property but (maybe) the lite topic
            lite = buf[at + PROPERTY.size : at + props_len].decode() if props_len else None
            at += props_len
            return model.StoredMessage(  # positional: a keyword call costs about 1 us more per message
                queue, offset, message_id, topic, buf[at : at + body_len], store_ms, born_ms, lite, message_type
            )
        props = _properties(buf[at : at + props_len])
    except (ValueError, struct.error) as e:  # UnicodeDecodeError is a ValueError
        raise errors.CorruptRecord(f"record fields do not decode: {e}", offset=offset) from None
    at += props_len
    return model.StoredMessage(
        queue,
        offset,
        message_id,
        topic,
        buf[at : at + body_len],
        store_ms,
        born_ms,
        props.get("lite_topic"),
        message_type,
        props.get("born_host", ""),
        props.get("tag"),
        props.get("keys", ()),
        props.get("message_group"),
        props.get("user_properties", {}),
        props.get("epoch", 0),
        props.get("slot", -1),
    )
