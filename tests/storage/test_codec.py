"""The commit-log record format: exact bytes, round trips, and every way a frame can be refused."""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmq_broker import errors, model
from lmq_broker.storage import codec, keys

Q = model.QueueId("P", 0)
LMQ = model.QueueId.lmq("P", "a")


def prepared(*, store_ms: int = 1000, **kw: object) -> codec.Prepared:
    fields: dict[str, object] = {
        "message_id": "id-1",
        "topic": "P",
        "body": b"body",
        "queues": (Q, LMQ),
        "lite_topic": "a",
        "message_type": model.MessageType.LITE,
        "born_timestamp_ms": 7,
    }
    fields.update(kw)
    return codec.prepare(model.NewMessage(**fields), keys.NameCache(), 1 << 20, store_ms)  # type: ignore[arg-type]


def framed(p: codec.Prepared, offsets: tuple[int, ...] = (5, 0)) -> bytes:
    prefix, head = codec.frame(p, offsets)
    return prefix + head + p.message.body


def test_fixed_layout_is_as_documented() -> None:
    assert (codec.PREFIX.size, codec.HEADER.size, codec.FIXED_BYTES) == (8, 36, 44)
    buf = framed(prepared())
    length, crc = struct.unpack_from("<II", buf)
    assert length == len(buf) - 4
    assert crc == codec.crc32c_of(buf[8:])
    version, kind, mtype, n, store_ms, born_ms, mid_len, topic_len, names_len, props_len, body_len = struct.unpack_from(
        "<BBBBQQHHIII", buf, 8
    )
    assert (version, kind, mtype, n, store_ms, born_ms) == (1, 0, 5, 2, 1000, 7)
    assert struct.unpack_from("<2Q", buf, 44) == (5, 0)
    names = buf[60 : 60 + names_len]
    assert names == b"\x01P\x00\x00" + b"\x09%LMQ%$P$a\x00\x00"
    rest = buf[60 + names_len :]
    assert rest[:mid_len] == b"id-1"
    assert rest[mid_len : mid_len + topic_len] == b"P"
    assert rest[mid_len + topic_len : mid_len + topic_len + props_len] == b"\x01\x01\x00\x00\x00a"  # tag 1, len 1
    assert rest[-body_len:] == b"body"
    assert len(buf) == prepared().size


def test_round_trip_of_every_field() -> None:
    p = prepared(
        store_ms=99,
        born_host="h:1",
        tag="t",
        keys=("k1", "k2"),
        message_group="grp",
        user_properties={"a": "1", "long": "v" * 300},
        body=bytes(range(256)),
    )
    rec = codec.decode(framed(p, (1, 2)))
    assert rec == codec.Record(
        kind=codec.KIND_MESSAGE,
        message_type=model.MessageType.LITE,
        store_ms=99,
        born_ms=7,
        queues=(("P", 0), ("%LMQ%$P$a", 0)),
        offsets=(1, 2),
        message_id="id-1",
        topic="P",
        body=bytes(range(256)),
        lite_topic="a",
        born_host="h:1",
        tag="t",
        keys=("k1", "k2"),
        message_group="grp",
        user_properties={"a": "1", "long": "v" * 300},
    )
    stored = codec.decode_message(framed(p, (1, 2)), LMQ, 2)
    assert (stored.queue, stored.offset, stored.keys, stored.store_timestamp_ms) == (LMQ, 2, ("k1", "k2"), 99)


def test_a_recorded_ring_slot_round_trips_and_slot_0_is_not_absent() -> None:
    for slot in (-1, 0, 7):
        p = prepared(slot=slot)
        assert codec.decode(framed(p, (1, 2))).slot == slot
        assert codec.decode_message(framed(p, (1, 2)), LMQ, 2).slot == slot


def test_tombstone_round_trip() -> None:
    rec = codec.decode(codec.encode_tombstone(keys.parse_queue(LMQ.topic, 0), 42, 5))
    assert (rec.kind, rec.queues, rec.offsets, rec.body) == (codec.KIND_TOMBSTONE, ((LMQ.topic, 0),), (42,), b"")
    with pytest.raises(errors.CorruptRecord):
        codec.decode_message(codec.encode_tombstone(keys.parse_queue(LMQ.topic, 0), 42, 5), LMQ, 0)


def test_unknown_property_tags_are_skipped() -> None:
    buf = codec.encode(
        kind=0,
        message_type=1,
        store_ms=1,
        born_ms=1,
        offsets=[0],
        names=keys.parse_queue("P", 0).record,
        message_id=b"x",
        topic=b"P",
        properties=codec.PROPERTY.pack(200, 3) + b"new" + codec.PROPERTY.pack(3, 1) + b"t",
        body=b"b",
    )
    assert codec.decode(buf).tag == "t"


def with_crc(buf: bytearray) -> bytes:
    buf[4:8] = codec.crc32c_of(bytes(buf[8:])).to_bytes(4, "little")
    return bytes(buf)


GOOD = framed(prepared())


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (GOOD[:43], errors.CorruptRecord),  # shorter than the fixed header
        (GOOD[:-1], errors.CorruptRecord),  # length runs past the end
        (GOOD[:-1] + bytes([GOOD[-1] ^ 1]), errors.CorruptRecord),  # body bit flip
        (GOOD[:20] + bytes([GOOD[20] ^ 1]) + GOOD[21:], errors.CorruptRecord),  # header bit flip
        (bytes(64), errors.CorruptRecord),  # zeros (a preallocated or never-written tail)
        (with_crc(bytearray(GOOD[:8]) + bytes([2]) + GOOD[9:]), errors.UnsupportedVersion),
        (with_crc(bytearray(GOOD[:9]) + bytes([0, 99]) + GOOD[11:]), errors.CorruptRecord),  # unknown type
        (with_crc(bytearray(GOOD[:40]) + struct.pack("<I", 3) + GOOD[44:]), errors.CorruptRecord),  # lengths
    ],
)
def test_bad_frames_are_refused(data: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        codec.decode(data)


def test_scan_yields_frames_and_stops_at_the_first_bad_one_with_its_position() -> None:
    a, b = framed(prepared(store_ms=1), (0, 0)), framed(prepared(store_ms=2, message_id="id-2"), (1, 1))
    frames = list(codec.scan(a + b, 0, len(a + b)))
    assert [(f.position, f.size, f.store_ms, f.offsets) for f in frames] == [
        (0, len(a), 1, (0, 0)),
        (len(a), len(b), 2, (1, 1)),
    ]
    assert frames[0].queues == (("P", 0), ("%LMQ%$P$a", 0))
    torn = a + b[:10]
    got: list[codec.Frame] = []
    with pytest.raises(errors.CorruptRecord) as e:
        got.extend(codec.scan(torn, 0, len(torn)))
    assert len(got) == 1 and e.value.fields["position"] == len(a)


def test_prepare_sizes_exactly_and_limits_the_whole_record() -> None:
    p = prepared()
    assert p.size == len(framed(p))
    limit = p.size
    msg = p.message
    assert codec.prepare(msg, keys.NameCache(), limit, 0).size == limit
    with pytest.raises(errors.RecordTooLarge):
        codec.prepare(msg, keys.NameCache(), limit - 1, 0)


# --- prepare (the fast twin both stores run) against prepare_plain ----------------------------------------------
_NAMES = st.sampled_from(["P", "Q", "P2", "bad name", "%LMQ%P%a", "%LMQ%P%b", "%LMQ%P%bad lite", ""])
_QUEUES = st.lists(st.builds(model.QueueId, _NAMES, st.sampled_from([0, 0, 1, 70_000])), max_size=4)
_TEXT = st.text(alphabet="ab-_ é|", max_size=6)


@st.composite
def new_messages(draw: st.DrawFn) -> model.NewMessage:
    lite = draw(st.one_of(st.none(), st.sampled_from(["a", "b", "c", "bad lite", ""])))
    return model.NewMessage(
        message_id=draw(st.sampled_from(["id-1", "", "x" * 300, "é"])),
        topic=draw(_NAMES),
        body=draw(st.sampled_from([b"body", b"", b"x" * 900])),
        queues=tuple(draw(_QUEUES)),
        lite_topic=lite,
        message_type=draw(st.sampled_from(list(model.MessageType))),
        born_timestamp_ms=draw(st.sampled_from([0, 7, 2**40])),
        born_host=draw(_TEXT),
        tag=draw(st.one_of(st.none(), _TEXT)),
        keys=tuple(draw(st.lists(_TEXT, max_size=2))),
        message_group=draw(st.one_of(st.none(), _TEXT)),
        user_properties=draw(st.dictionaries(_TEXT, _TEXT, max_size=2)),
        slot=draw(st.sampled_from([-1, 0, 3])),
    )


def outcome(prepare: Callable[[], codec.Prepared]) -> object:
    try:
        return prepare()
    except errors.LmqError as e:
        return type(e), str(e)


@settings(max_examples=600, deadline=None)
@given(messages=st.lists(new_messages(), min_size=1, max_size=6), max_record=st.sampled_from([1 << 20, 1000]))
def test_prepare_equals_prepare_plain(messages: list[model.NewMessage], max_record: int) -> None:
    fast_names, plain_names = keys.NameCache(), keys.NameCache()  # each twin fills its own memos
    for m in messages:
        fast = outcome(lambda m=m: codec.prepare(m, fast_names, max_record, 1000))  # type: ignore[misc]
        plain = outcome(lambda m=m: codec.prepare_plain(m, plain_names, max_record, 1000))  # type: ignore[misc]
        assert fast == plain
