"""The index key layout, table-tested against the bytes documented at the top of keys.py."""

from __future__ import annotations

import pytest

from lmq_broker import errors, model
from lmq_broker.storage import keys

P0 = keys.parse_queue("P", 0)
P7 = keys.parse_queue("P", 7)
LMQ = keys.parse_queue("%LMQ%$P$a", 0)


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (P0.qkey, b"P\x00\x00\x00"),
        (P7.qkey, b"P\x00\x00\x07"),
        (LMQ.qkey, b"%LMQ%$P$a\x00\x00\x00"),
        (keys.entry_key(P7.qkey, 258), b"EP\x00\x00\x07" + b"\x00" * 6 + b"\x01\x02"),
        (P0.state_key, b"SP\x00\x00\x00"),
        (LMQ.state_key, b"LP\x00a"),
        (keys.lite_key("parent-1", "lite_2"), b"Lparent-1\x00lite_2"),
        (keys.offset_key(LMQ.qkey, "GID"), b"O%LMQ%$P$a\x00\x00\x00GID"),
        (keys.count_key("P"), b"NP"),
        (keys.count_key(None), b"N"),
        (keys.name_key(keys.PARENT, "P"), b"TP"),
        (keys.name_key(keys.GROUP, "G"), b"GG"),
        (keys.name_key(keys.QUOTA, "parent:P"), b"Uparent:P"),
        (keys.name_key(keys.RECLAIM, "P"), b"RP"),
        (keys.segment_key(3), b"B\x00\x00\x00\x03"),
        (keys.CHECKPOINT_KEY, b"Xcheckpoint"),
        (keys.DURABLE_KEY, b"Xdurable"),
        (keys.LAYOUT_KEY, b"Xlayout"),
        (LMQ.record, b"\x09%LMQ%$P$a\x00\x00"),
        (P7.record, b"\x01P\x07\x00"),
    ],
)
def test_key_bytes(key: bytes, expected: bytes) -> None:
    assert key == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (
            keys.encode_run(2, 1000, [keys.RUN_ENTRY.pack(16, 80)]),
            b"\x02\0\0\0" + (1000).to_bytes(8, "little") + b"\x10\0\0\0P\0\0\0",
        ),
        (keys.STATE_VALUE.pack(1, 2), (1).to_bytes(8, "little") + (2).to_bytes(8, "little")),
        (keys.CHECKPOINT_VALUE.pack(1, 4096), b"\x01\0\0\0" + (4096).to_bytes(8, "little")),
        (
            keys.encode_lite(model.LiteTopicMeta("P", "a", 1, 2, 3, 4, 5)),
            b"".join(i.to_bytes(8, "little") for i in range(1, 6)),
        ),
    ],
)
def test_value_bytes(value: bytes, expected: bytes) -> None:
    assert value == expected


def test_entry_keys_sort_by_offset_and_never_mix_queues() -> None:
    offsets = [0, 1, 255, 256, 65_536, 2**40]
    ks = [keys.entry_key(P0.qkey, o) for o in offsets]
    assert sorted(ks) == ks
    # "P" queue 0 and "P-x" (a topic starting with "P") never interleave, nor does queue 1
    others = [keys.entry_key(keys.parse_queue("P-x", 0).qkey, 0), keys.entry_key(P7.qkey, 0)]
    assert all(not k.startswith(P0.entry_prefix) for k in others)
    assert all(o > ks[-1] for o in others)


def test_lite_keys_sort_like_parent_dollar_lite_strings() -> None:
    pairs = [("P", "b"), ("P-x", "a"), ("P", "a-1"), ("P", "a"), ("Q", "A"), ("P", "Z")]
    by_key = sorted(pairs, key=lambda p: keys.lite_key(*p))
    by_string = sorted(pairs, key=lambda p: f"{p[0]}${p[1]}")
    assert by_key == by_string
    assert keys.split_lite_key(keys.lite_key("P", "a-1")) == ("P", "a-1")


def test_successor_bounds_a_prefix() -> None:
    assert keys.successor(b"EP\x00") == b"EP\x01"
    assert keys.successor(b"a\xff\xff") == b"b"
    prefix = P0.entry_prefix
    assert keys.entry_key(P0.qkey, 2**64 - 1) < keys.successor(prefix)
    with pytest.raises(ValueError):
        keys.successor(b"\xff")


def test_run_round_trip() -> None:
    value = keys.encode_run(9, 77, [keys.RUN_ENTRY.pack(p, 100 + p) for p in (0, 100, 200)])
    assert keys.decode_run(value) == (9, 77, [(0, 100), (100, 200), (200, 300)])
    assert keys.run_length(value) == 3


@pytest.mark.parametrize(
    ("topic", "queue", "error"),
    [
        ("", 0, errors.InvalidName),
        ("a b", 0, errors.InvalidName),
        ("a$b", 0, errors.InvalidName),
        ("x" * 128, 0, errors.InvalidName),
        ("P", 65_536, errors.InvalidName),
        ("%LMQ%$P", 0, errors.InvalidName),
        ("%LMQ%$P$a$b", 0, errors.InvalidName),
        ("%LMQ%$$a", 0, errors.InvalidName),
        ("%LMQ%$P$", 0, errors.InvalidLiteTopic),
        ("%LMQ%$P$a.b", 0, errors.InvalidLiteTopic),
        ("%LMQ%$P$a", 1, errors.InvalidName),
    ],
)
def test_invalid_queue_names(topic: str, queue: int, error: type[Exception]) -> None:
    with pytest.raises(error):
        keys.parse_queue(topic, queue)


def test_valid_queue_names() -> None:
    assert (LMQ.parent, LMQ.lite, LMQ.is_lmq) == ("P", "a", True)
    assert (P0.parent, P0.is_lmq) == (None, False)
    assert keys.parse_queue("%RETRY%group-1", 3).topic == "%RETRY%group-1"
    assert keys.parse_queue(keys.lmq_topic("P" * 127, "l" * 64), 0).lite == "l" * 64


def test_name_cache_is_bounded() -> None:
    cache = keys.NameCache(capacity=10)
    for i in range(100):
        cache.queue(f"T{i}", 0)
        cache.topic(f"T{i}")
    assert len(cache._queues) <= 10 and len(cache.topics) <= 10 and len(cache.by_topic) <= 10
    with pytest.raises(errors.InvalidName):
        cache.topic("bad topic")


def test_queue_lists_are_memoized_bounded_and_refused_when_a_queue_repeats() -> None:
    cache = keys.NameCache(capacity=640)  # lists bounded at 640 // 64 = 10
    pool = [model.QueueId(f"F{j}", 0) for j in range(20)]
    first = cache.queue_list((pool[0], pool[1], pool[2]))
    assert first is not None
    names, listed = first
    assert [n.topic for n in names] == ["F0", "F1", "F2"]
    assert listed == b"".join(n.record for n in names)
    assert cache.queue_list((pool[0], pool[1], pool[2])) is first
    assert cache.queue_list((pool[3], pool[4], pool[3])) is None
    assert cache.queue_list((pool[3], pool[4], pool[3])) is None  # the refusal is memoized too
    for i in range(100):
        assert cache.queue_list((pool[i % 20], pool[(i + 1) % 20], pool[(i + 2) % 20])) is not None
        assert len(cache.lists) <= 10
    with pytest.raises(errors.InvalidName):
        cache.queue_list((pool[0], model.QueueId("bad topic", 0)))
    assert (pool[0], model.QueueId("bad topic", 0)) not in cache.lists


def test_control_metadata_json_round_trips() -> None:
    pt = model.ParentTopic("P", expiration_minutes=10, max_lite_topics=3, queue_count=2)
    grp = model.LiteGroup("G", "P", model.SubscriptionModel.EXCLUSIVE, 1, 20, model.RetryPolicy(2, (5,)), False, False)
    quota = model.Quota("namespace:n", 1, 2, 3)
    assert keys.decode_parent_topic(keys.encode_parent_topic(pt)) == pt
    assert keys.decode_group(keys.encode_group(grp)) == grp
    assert keys.decode_quota(keys.encode_quota(quota)) == quota
    run = model.ReclaimRun("P", "job-7", 10, 20, 9, 8, 5, 1, 1, 1, 2, dry_run=True)
    assert keys.decode_reclaim_run(keys.encode_reclaim_run(run)) == run
