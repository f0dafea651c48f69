"""Recovery's resync (``codec.resync``): after a bad record, the next valid one is found without skipping a valid
record, without taking a frame copied inside a body for a record, and in time linear in the segment."""

from __future__ import annotations

import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from lmq_broker import config, errors, model
from lmq_broker.storage import codec, keys
from lmq_broker.storage import store as store_mod

Msg = Callable[..., model.NewMessage]
OpenLmq = Callable[..., store_mod.LmqStore]
QUEUE = keys.parse_queue("P", 0)
LITES = [keys.parse_queue(f"%LMQ%$P$t{i}", 0) for i in range(3)]
BODY_LENGTH_AT = 40  # the header's body length field (codec's layout table)


def record(offset: int, body: bytes, queues: tuple[keys.QueueName, ...] = (QUEUE,), kind: int = 0) -> bytes:
    return codec.encode(
        kind=kind,
        message_type=int(model.MessageType.NORMAL),
        store_ms=1,
        born_ms=1,
        offsets=[offset] * len(queues),
        names=b"".join(q.record for q in queues),
        message_id=b"id%06d" % offset,
        topic=b"P",
        properties=b"",
        body=body,
    )


def recover(buf: bytes) -> list[int]:
    """Positions of the records recovery keeps, as ``recovery.replay`` walks a segment (scan, resync, scan)."""
    kept: list[int] = []
    at = 0
    while at < len(buf):
        try:
            for f in codec.scan(buf, at, len(buf)):
                kept.append(f.position)
                at = f.position + f.size
        except errors.CorruptRecord as e:
            bad = e.fields["position"]
            assert isinstance(bad, int) and bad >= at
            resume = codec.resync(buf, bad, len(buf))
            if resume is None:
                break
            assert resume > bad
            at = resume
    return kept


def positions(records: list[bytes]) -> list[int]:
    out, at = [], 0
    for r in records:
        out.append(at)
        at += len(r)
    return out


def add_to_u32(buf: bytearray, at: int, delta: int) -> None:
    (value,) = struct.unpack_from("<I", buf, at)
    struct.pack_into("<I", buf, at, (value + delta) % 2**32)


# --- A: a damaged length field never skips the valid records after it -------------------------------------


@pytest.mark.parametrize("bit", [8, 9, 10, 11, 12])
@pytest.mark.parametrize("k", [0, 3, 7])
def test_a_bit_flip_in_a_length_field_among_equal_size_records_loses_that_record_only(k: int, bit: int) -> None:
    records = [record(i, b"x" * 191) for i in range(8)]
    size = len(records[0])
    assert size == 256 and all(len(r) == size for r in records)
    buf = bytearray(b"".join(records))
    buf[k * size + bit // 8] ^= 1 << (bit % 8)  # +256..+4096: exactly 1..16 records further
    expected = [p for i, p in enumerate(positions(records)) if i != k]
    assert recover(bytes(buf)) == expected


def test_a_length_pointing_exactly_at_a_later_record_boundary_is_not_trusted() -> None:
    records = [record(i, b"x" * 200) for i in range(8)]
    size = len(records[0])
    buf = bytearray(b"".join(records))
    add_to_u32(buf, 0, 2 * size)  # the review's case: resync used to answer 3 * size
    assert codec.resync(bytes(buf), 0, len(buf)) == size
    add_to_u32(buf, 4, 1)  # its CRC field too: its header no longer vouches for it, the scan finds record 1
    assert codec.resync(bytes(buf), 0, len(buf)) == size


# --- B: candidates are checked structurally before any CRC: linear work ------------------------------------


def test_resync_after_a_damaged_16_mib_record_crcs_each_byte_about_once(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(7)
    big = record(0, rng.randbytes(16 * 1024 * 1024))
    small = [record(i, b"y" * 100) for i in range(1, 50)]
    buf = bytearray(big + b"".join(small))
    struct.pack_into("<I", buf, 0, 0xFFFFFFF0)  # its length
    buf[4] ^= 0xFF  # and its CRC: neither its length nor its header can vouch for its extent, the scan runs
    crc_bytes = 0
    crc = codec.crc32c_of

    def counting(data: bytes | memoryview, value: int = 0) -> int:
        nonlocal crc_bytes
        crc_bytes += len(data)
        return crc(data, value)

    monkeypatch.setattr(codec, "crc32c_of", counting)
    assert codec.resync(bytes(buf), 0, len(buf)) == len(big)
    # the own-extent check reads the record once; the scan only the chain of small records after it
    assert crc_bytes <= len(big) + (1 + codec.CHAIN_RECORDS) * len(small[0])


def test_the_normal_frame_check_refuses_bad_lengths_without_a_crc(monkeypatch: pytest.MonkeyPatch) -> None:
    buf = bytearray(record(0, b"z" * 1000))
    add_to_u32(buf, BODY_LENGTH_AT, 1)
    calls: list[int] = []

    def counting(data: bytes | memoryview, value: int = 0) -> int:
        calls.append(len(data))
        return 0

    monkeypatch.setattr(codec, "crc32c_of", counting)
    with pytest.raises(errors.CorruptRecord, match="lengths do not add up"):
        list(codec.scan(bytes(buf), 0, len(buf)))
    assert calls == []


# --- C: a frame inside a body is not a record; a crafted frame is CorruptRecord, not a crash ---------------


def test_a_frame_embedded_in_a_body_is_not_taken_when_its_hosts_length_is_damaged() -> None:
    embedded = record(99, b"inner", (LITES[0],))
    host = record(1, b"pre" + embedded + b"post")
    records = [record(0, b"a" * 50), host, record(2, b"b" * 50), record(3, b"c" * 50)]
    at = positions(records)
    for damage in ("length", "length and body length"):
        buf = bytearray(b"".join(records))
        add_to_u32(buf, at[1], 1000)
        if damage == "length and body length":  # its header cannot vouch for it either: the scan must refuse
            add_to_u32(buf, at[1] + BODY_LENGTH_AT, 7)  # the embedded frame (its chain breaks at "post")
        assert recover(bytes(buf)) == [at[0], at[2], at[3]], damage


def test_a_crafted_frame_with_invalid_utf8_names_is_corrupt_not_a_crash() -> None:
    bad_name = bytes((2,)) + b"\xff\xfe" + struct.pack("<H", 0)
    crafted = codec.encode(
        kind=0,
        message_type=1,
        store_ms=1,
        born_ms=1,
        offsets=[0],
        names=bad_name,
        message_id=b"x",
        topic=b"P",
        properties=b"",
        body=b"b",
    )
    with pytest.raises(errors.CorruptRecord) as e:
        list(codec.scan(crafted, 0, len(crafted)))
    assert e.value.fields["position"] == 0
    with pytest.raises(errors.CorruptRecord):
        codec.decode(crafted)
    overrun = bytearray(record(0, b"b"))  # a name length running past its section (CRC made valid again)
    overrun[codec.FIXED_BYTES + 8] = 200
    overrun[4:8] = codec.crc32c_of(bytes(overrun[8:])).to_bytes(4, "little")
    with pytest.raises(errors.CorruptRecord):
        list(codec.scan(bytes(overrun), 0, len(overrun)))
    props = codec.encode(
        kind=0,
        message_type=1,
        store_ms=1,
        born_ms=1,
        offsets=[0],
        names=QUEUE.record,
        message_id=b"\xc3",
        topic=b"P",
        properties=codec.PROPERTY.pack(codec.TAG_TAG, 9) + b"\xff",
        body=b"b",
    )
    with pytest.raises(errors.CorruptRecord):
        codec.decode(props)
    with pytest.raises(errors.CorruptRecord):
        codec.decode_message(props, model.QueueId("P", 0), 0)


# --- property: a single damaged byte anywhere loses exactly the record it hit ------------------------------


def random_log(rng: random.Random) -> list[bytes]:
    out: list[bytes] = []
    for i in range(rng.randrange(2, 12)):
        if rng.random() < 0.1:
            out.append(codec.encode_tombstone(rng.choice(LITES), i, 1))
            continue
        body = rng.randbytes(rng.randrange(1, 300)) if rng.random() < 0.7 else b"\x01\x00" * rng.randrange(1, 150)
        if out and rng.random() < 0.2:  # a body holding an earlier record, with bytes of its own after it
            body = rng.randbytes(rng.randrange(0, 50)) + rng.choice(out) + rng.randbytes(rng.randrange(4, 50))
        queues = tuple(rng.sample([QUEUE, *LITES], rng.randrange(1, 4)))
        out.append(record(i, body, queues))
    return out


def test_a_random_byte_damaged_at_a_random_position_loses_the_record_it_hit_and_no_other() -> None:
    rng = random.Random(20240611)
    for _ in range(400):
        records = random_log(rng)
        buf = bytearray(b"".join(records))
        at = rng.randrange(len(buf))
        buf[at] ^= rng.randrange(1, 256)
        starts = positions(records)
        hit = max(i for i, p in enumerate(starts) if p <= at)
        expected = [p for i, p in enumerate(starts) if i != hit]
        assert recover(bytes(buf)) == expected, (at, hit, [len(r) for r in records])


# --- the store: a record is indexed whole or not at all -----------------------------------------------------


def test_a_record_whose_second_queue_is_invalid_leaves_no_entry_in_its_first(
    open_lmq: OpenLmq, store_config: Callable[..., config.StoreConfig], msg: Msg
) -> None:
    s = open_lmq()
    s.append([msg(body=b"m%d" % i) for i in range(5)])
    s.close()
    (seg,) = sorted((store_config().data_dir / "commitlog").glob("*.log"))
    invalid = bytes((3,)) + b"a b" + struct.pack("<H", 0)  # valid UTF-8, not a valid topic name
    crafted = codec.encode(
        kind=0,
        message_type=1,
        store_ms=1,
        born_ms=1,
        offsets=[5, 0],
        names=QUEUE.record + invalid,
        message_id=b"crafted",
        topic=b"P",
        properties=b"",
        body=b"crafted",
    )
    with seg.open("ab") as f:  # after the checkpoint: replayed at open
        f.write(crafted + record(6, b"after"))
    s = open_lmq()
    assert s.recovery.quarantined_records == 1
    bodies = [m.body for m in s.read(model.QueueId("P", 0), 0, 100)]
    assert b"crafted" not in bodies and bodies[:5] == [b"m%d" % i for i in range(5)]


def test_an_embedded_tombstone_is_not_replayed_when_its_hosts_length_is_damaged(
    open_lmq: OpenLmq, store_config: Callable[..., config.StoreConfig], msg: Msg
) -> None:
    s = open_lmq()
    s.append([msg(lite="t0", body=b"keep-%d" % i, parent_queue=False) for i in range(3)])
    tombstone = codec.encode_tombstone(keys.parse_queue("%LMQ%$P$t0", 0), 3, 1)
    s.append([msg(lite="t1", body=b"<" + tombstone + b">", parent_queue=False)])
    s.append([msg(lite="t0", body=b"keep-3", parent_queue=False)])
    s.close()
    cfg = store_config()
    (seg,) = sorted((cfg.data_dir / "commitlog").glob("*.log"))
    _, host, _ = max(_records(cfg), key=lambda r: r[2])  # the record holding the tombstone
    data = bytearray(seg.read_bytes())
    add_to_u32(data, host, 1 << 20)
    seg.write_bytes(bytes(data))
    _rebuild(cfg.data_dir)
    s = open_lmq()
    assert s.recovery.quarantined_records == 1
    got = [m.body for m in s.read(model.QueueId.lmq("P", "t0"), 0, 100)]
    assert got == [b"keep-0", b"keep-1", b"keep-2", b"keep-3"]


def _records(cfg: config.StoreConfig) -> list[tuple[int, int, int]]:
    return [(seq, f.position, f.size) for seq, f in store_mod.iter_records(cfg)]


def _rebuild(data_dir: Path) -> None:
    shutil.rmtree(data_dir / "index")
