"""LmqStore recovery: restart, re-index after the checkpoint, torn tails, corruption, full rebuild from the log."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from waiting import eventually

from lmq_broker import config, errors, model
from lmq_broker.storage import codec, keys
from lmq_broker.storage import index as index_mod
from lmq_broker.storage import segment as segment_mod
from lmq_broker.storage import store as store_mod
from lmq_broker.storage.memory import ManualClock

Msg = Callable[..., model.NewMessage]
OpenLmq = Callable[..., store_mod.LmqStore]
LMQ_A = model.QueueId.lmq("P", "a")
PARENT_Q = model.QueueId("P", 0)


def segment_files(cfg: config.StoreConfig) -> list[Path]:
    return sorted((cfg.data_dir / "commitlog").glob("*.log"))


def frame_of(cfg: config.StoreConfig, queue: model.QueueId, offset: int) -> tuple[Path, codec.Frame]:
    for seq, frame in store_mod.iter_records(cfg):
        q = (queue.topic, queue.queue)
        if q in frame.queues and frame.offsets[frame.queues.index(q)] == offset:
            return cfg.data_dir / "commitlog" / segment_mod.file_name(seq), frame
    raise AssertionError(f"no record for {queue} @ {offset}")


def flip_byte(path: Path, position: int) -> None:
    with path.open("r+b") as f:
        f.seek(position)
        b = f.read(1)
        f.seek(position)
        f.write(bytes([b[0] ^ 0x40]))


def raw_record(queues: list[tuple[model.QueueId, int]], body: bytes, store_ms: int, message_id: str = "raw") -> bytes:
    """A record as the store writes it, for simulating 'written to the log, never indexed'."""
    names = b"".join(keys.parse_queue(q.topic, q.queue).record for q, _ in queues)
    return codec.encode(
        kind=codec.KIND_MESSAGE,
        message_type=int(model.MessageType.LITE),
        store_ms=store_ms,
        born_ms=0,
        offsets=[o for _, o in queues],
        names=names,
        message_id=message_id.encode(),
        topic=b"P",
        properties=b"",
        body=body,
    )


def snapshot(store: store_mod.LmqStore, queues: list[model.QueueId], created: bool = True) -> dict[str, object]:
    """Everything the log can restore (consumer offsets and last consume times excluded)."""
    return {
        "messages": {q.topic: [(m.offset, m.message_id, m.body) for m in store.read(q, 0, 10_000)] for q in queues},
        "offsets": {q.topic: store.queue_offsets(q) for q in queues},
        "lites": [
            (m.parent, m.lite, m.created_ms if created else 0, m.last_store_ms, m.min_offset, m.max_offset)
            for m in store.scan_lite_topics()
        ],
        "counts": (store.lite_topic_count(), store.lite_topic_count("P"), store.lite_topic_count("Q")),
    }


def test_restart_keeps_messages_offsets_and_metadata(open_lmq: OpenLmq, msg: Msg) -> None:
    s = open_lmq()
    s.append([msg(), msg(lite="b"), msg()])
    s.commit_offset(LMQ_A, "g", 1)
    s.put_parent_topic(model.ParentTopic("P", expiration_minutes=5))
    before = snapshot(s, [LMQ_A, PARENT_Q])
    s.close()
    s = open_lmq()
    assert s.recovery.rebuilt is False and s.recovery.records_reindexed == 0
    assert snapshot(s, [LMQ_A, PARENT_Q]) == before
    assert s.get_offset(LMQ_A, "g") == 1
    assert s.get_parent_topic("P") == model.ParentTopic("P", expiration_minutes=5)
    assert s.append([msg()])[0].offsets == {PARENT_Q: 3, LMQ_A: 2}


def test_deleting_the_index_rebuilds_it_from_the_log(
    open_lmq: OpenLmq, store_config: Callable[..., config.StoreConfig], msg: Msg, clock: ManualClock
) -> None:
    opts = {"segment_max_bytes": 8192, "retention_max_age_ms": 50_000}
    s = open_lmq(**opts)
    queues = [PARENT_Q, model.QueueId("Q", 0), *(model.QueueId.lmq(p, f"t{i}") for p in "PQ" for i in range(6))]
    for i in range(60):
        lite = f"t{i % 6}"
        fan = (model.QueueId.lmq("Q", lite),) if i % 3 == 0 else ()
        s.append([msg("P", lite, body=bytes([i]) * 700, queues=(PARENT_Q, model.QueueId.lmq("P", lite), *fan))])
        clock.advance(1000)
    s.delete_lite_topic("P", "t1")
    s.append([msg("P", "t1", body=b"reborn")])
    assert s.apply_retention().segments_deleted > 0
    before = snapshot(s, queues, created=False)
    s.close()
    shutil.rmtree(store_config().data_dir / "index")
    s = open_lmq(**opts)
    assert s.recovery.rebuilt is True and s.recovery.records_reindexed > 0
    assert snapshot(s, queues, created=False) == before
    # created_ms comes back as the store time of the oldest record that survived retention
    t1 = s.lite_topic("P", "t1")
    assert t1 is not None and t1.created_ms == clock()
    t0 = s.lite_topic("P", "t0")
    assert t0 is not None and t0.created_ms == s.read(model.QueueId.lmq("P", "t0"), 0, 1)[0].store_timestamp_ms
    assert [m.body for m in s.read(model.QueueId.lmq("P", "t1"), 0, 10)] == [b"reborn"]
    (res,) = s.append([msg("P", "t0")])
    assert res.offsets[model.QueueId.lmq("P", "t0")] == before["offsets"]["%LMQ%$P$t0"][1]  # type: ignore[index]


def test_records_whose_index_write_failed_are_cut_off_the_log_and_writes_resume_once_the_index_reopens(
    open_lmq: OpenLmq, msg: Msg, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = open_lmq()
    s.append([msg(), msg()])
    size = s._core.log.active.size
    real_write = index_mod.Index.write
    with monkeypatch.context() as m:

        def crash(self: index_mod.Index, wb: object) -> None:
            raise OSError("simulated failure of the index write after the log write")

        m.setattr(index_mod.Index, "write", crash)
        with pytest.raises(errors.StorageError, match="not stored"):
            s.append([msg(body=b"logged, not indexed")])
        assert s._core.log.active.size == size  # cut off again: "not stored" is true
        with pytest.raises(errors.StorageError, match="index cannot write"):
            s.append([msg()])  # paused until the index is reopened
        assert "index cannot write" in (s.health() or "") and s.fatal() is None
    assert index_mod.Index.write is real_write
    eventually(lambda: s.health() is None, "the index reopened")
    assert s.faults().index_reopens >= 1
    assert s.append([msg(body=b"after")])[0].offsets[LMQ_A] == 2
    s.close()
    s = open_lmq()
    assert s.recovery.records_reindexed == 0
    assert [m.body for m in s.read(LMQ_A, 2, 10)] == [b"after"]


@pytest.mark.parametrize("cut", [1, 10, 44, 60])
def test_a_torn_tail_is_truncated_at_recovery(
    open_lmq: OpenLmq, store_config: Callable[..., config.StoreConfig], msg: Msg, clock: ManualClock, cut: int
) -> None:
    s = open_lmq()
    s.append([msg(), msg()])
    s.close()
    (seg,) = segment_files(store_config())
    good_size = seg.stat().st_size
    torn = raw_record([(PARENT_Q, 2), (LMQ_A, 2)], b"torn" * 20, clock())
    with seg.open("ab") as f:
        f.write(torn[:cut])  # a crash in the middle of a write
    s = open_lmq()
    assert s.recovery.truncated_bytes == cut
    assert seg.stat().st_size == good_size
    assert s.queue_offsets(LMQ_A) == (0, 2)
    (res,) = s.append([msg(body=b"after")])
    assert res.offsets[LMQ_A] == 2
    s.close()
    s = open_lmq()
    assert [m.body for m in s.read(LMQ_A, 0, 10)][-1] == b"after"


@pytest.mark.parametrize("unindexed_record", [False, True])
def test_a_zeroed_tail_is_cut_and_a_whole_record_before_it_kept(
    open_lmq: OpenLmq, store_config: Callable[..., config.StoreConfig], msg: Msg, clock: ManualClock,
    unindexed_record: bool,
) -> None:  # fmt: skip
    """A power cut after the file grew but before its blocks were written (or a preallocated file): the end
    reads back as zeros, which are no record; a whole record before them (written after the checkpoint) is
    re-indexed."""
    s = open_lmq()
    s.append([msg(), msg()])
    s.close()
    (seg,) = segment_files(store_config())
    good_size = seg.stat().st_size
    whole = raw_record([(PARENT_Q, 2), (LMQ_A, 2)], b"whole", clock()) if unindexed_record else b""
    with seg.open("ab") as f:
        f.write(whole + bytes(8192))
    s = open_lmq()
    assert s.recovery.truncated_bytes == 8192 and s.recovery.records_reindexed == int(unindexed_record)
    assert seg.stat().st_size == good_size + len(whole)
    assert s.queue_offsets(LMQ_A) == (0, 2 + unindexed_record)
    (res,) = s.append([msg(body=b"after")])
    assert res.offsets[LMQ_A] == 2 + unindexed_record
    s.close()
    s = open_lmq()
    assert s.recovery.truncated_bytes == 0
    assert [m.body for m in s.read(LMQ_A, 0, 10)][-1] == b"after"


def test_a_flipped_byte_in_the_unindexed_tail_truncates_from_that_record(
    open_lmq: OpenLmq, store_config: Callable[..., config.StoreConfig], msg: Msg, clock: ManualClock
) -> None:
    s = open_lmq()
    s.append([msg()])
    s.close()
    (seg,) = segment_files(store_config())
    ok = raw_record([(PARENT_Q, 1), (LMQ_A, 1)], b"ok", clock(), "ok")
    bad = raw_record([(PARENT_Q, 2), (LMQ_A, 2)], b"bad body", clock(), "bad")
    start_bad = seg.stat().st_size + len(ok)
    with seg.open("ab") as f:
        f.write(ok + bad)
    flip_byte(seg, start_bad + len(bad) - 2)
    s = open_lmq()
    assert (s.recovery.records_reindexed, s.recovery.truncated_bytes) == (1, len(bad))
    assert [m.message_id for m in s.read(LMQ_A, 0, 10)][1:] == ["ok"]


def test_a_flipped_byte_in_an_indexed_record_is_skipped_and_reported_on_read(
    open_lmq: OpenLmq, store_config: Callable[..., config.StoreConfig], msg: Msg
) -> None:
    s = open_lmq()
    s.append([msg(body=b"first"), msg(body=b"second"), msg(body=b"third")])
    s.close()
    path, frame = frame_of(store_config(), LMQ_A, 1)
    flip_byte(path, frame.position + frame.size - 3)
    s = open_lmq()  # indexed records are not rescanned at open: no truncation of acknowledged data
    assert s.recovery.truncated_bytes == 0
    messages, end = s.read_span(LMQ_A, 0, 10)
    assert [m.body for m in messages] == [b"first", b"third"]  # the rest of the topic is not held up
    assert end == 3  # offset 1 lies inside the span read: the reader knows it is gone
    assert s.damage.total("corrupt_read") == 1
    assert s.read_span(LMQ_A, 1, 1) == ([], 2)  # the damaged record alone: nothing, and the span past it


def test_corruption_before_the_last_segment_is_quarantined_not_truncated(
    open_lmq: OpenLmq, store_config: Callable[..., config.StoreConfig], msg: Msg
) -> None:
    s = open_lmq(segment_max_bytes=4096)
    for i in range(10):
        s.append([msg(body=b"%d" % i + b"x" * 1000)])
    s.close()
    first = segment_files(store_config())[0]
    size = first.stat().st_size
    path, frame = frame_of(store_config(), LMQ_A, 0)
    assert path == first
    flip_byte(first, frame.position + 100)
    shutil.rmtree(store_config().data_dir / "index")
    s = open_lmq(segment_max_bytes=4096)
    assert s.recovery.quarantined_records == 1
    assert first.stat().st_size == size  # never truncated
    assert [m.body[:1] for m in s.read(LMQ_A, 0, 100)] == [b"%d" % i for i in range(1, 10)]
    assert (store_config().data_dir / "quarantine" / f"{0:010d}-{frame.position:010d}.bin").exists()


def test_an_unknown_record_version_fails_open_and_touches_nothing(
    open_lmq: OpenLmq, store_config: Callable[..., config.StoreConfig], msg: Msg, clock: ManualClock
) -> None:
    s = open_lmq()
    s.append([msg()])
    s.close()
    (seg,) = segment_files(store_config())
    future = bytearray(raw_record([(LMQ_A, 1)], b"from a newer broker", clock()))
    future[8] = 2  # version
    future[4:8] = codec.crc32c_of(bytes(future[8:])).to_bytes(4, "little")
    with seg.open("ab") as f:
        f.write(future)
    size = seg.stat().st_size
    with pytest.raises(errors.UnsupportedVersion):
        open_lmq()
    assert seg.stat().st_size == size


def test_an_index_ahead_of_the_log_is_rebuilt_keeping_offsets_and_control_metadata(
    open_lmq: OpenLmq, store_config: Callable[..., config.StoreConfig], msg: Msg
) -> None:
    s = open_lmq(flush_mode="async")
    s.append([msg(body=b"kept")])
    s.append([msg(body=b"lost in a power cut")])
    s.commit_offset(LMQ_A, "g", 1)
    s.put_group(model.LiteGroup("G", bind_topic="P"))
    s.close()
    path, frame = frame_of(store_config(), LMQ_A, 1)
    os.truncate(path, frame.position)  # the unsynced tail never reached the disk, the index did
    s = open_lmq(flush_mode="async")
    assert s.recovery.rebuilt is True
    assert [m.body for m in s.read(LMQ_A, 0, 10)] == [b"kept"]
    assert s.queue_offsets(LMQ_A) == (0, 1)
    assert s.get_offset(LMQ_A, "g") == 1
    assert s.get_group("G") == model.LiteGroup("G", bind_topic="P")


def test_an_index_of_an_unknown_layout_is_refused(
    open_lmq: OpenLmq, store_config: Callable[..., config.StoreConfig]
) -> None:
    s = open_lmq()
    s.close()
    idx = index_mod.Index(store_config().data_dir / "index", 0)
    wb = idx.batch()
    wb.put(keys.LAYOUT_KEY, keys.U32.pack(99))
    idx.write(wb)
    idx.close()
    with pytest.raises(errors.UnsupportedVersion):
        open_lmq()


def test_a_batch_delete_is_one_fsync_and_its_tombstones_survive_a_rebuild(
    open_lmq: OpenLmq, store_config: Callable[..., config.StoreConfig], msg: Msg
) -> None:
    s = open_lmq(flush_mode="sync", segment_max_bytes=4096)
    lites = [f"t{i}" for i in range(40)]
    for lite in lites:
        s.append([msg(lite=lite, body=b"x" * 50)])
    fsyncs = s.fsync_count
    done = s.delete_lite_topics([("P", lite, None) for lite in lites[:30]])
    assert done == [True] * 30
    assert s.fsync_count == fsyncs + 1
    kept = snapshot(s, [PARENT_Q])
    assert [m.lite for m in s.scan_lite_topics()] == lites[30:]
    s.close()
    shutil.rmtree(store_config().data_dir / "index")
    s = open_lmq(flush_mode="sync", segment_max_bytes=4096)
    assert s.recovery.rebuilt is True
    assert snapshot(s, [PARENT_Q]) == kept
    assert s.lite_topic_count("P") == 10


def test_a_batch_delete_logged_but_not_indexed_is_replayed(
    open_lmq: OpenLmq, msg: Msg, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = open_lmq()
    for lite in ("a", "b", "c"):
        s.append([msg(lite=lite)])
    s.commit_offset(LMQ_A, "g", 1)
    with monkeypatch.context() as m:

        def crash(self: index_mod.Index, wb: object) -> None:
            raise OSError("simulated crash between the log write and the index write")

        m.setattr(index_mod.Index, "write", crash)
        with pytest.raises(errors.StorageError):
            s.delete_lite_topics([("P", "a", None), ("P", "c", None)])
    s.close()
    s = open_lmq()
    assert s.recovery.records_reindexed == 2
    assert [m.lite for m in s.scan_lite_topics("P")] == ["b"]
    assert s.get_offset(LMQ_A, "g") is None
    assert s.lite_topic_count("P") == 1


def test_deleting_the_index_keeps_offsets_control_metadata_and_consume_times(
    open_lmq: OpenLmq, store_config: Callable[..., config.StoreConfig], msg: Msg, clock: ManualClock
) -> None:
    lmq_b = model.QueueId.lmq("P", "b")
    s = open_lmq()
    s.append([msg(lite="a"), msg(lite="a"), msg(lite="b")])
    s.put_parent_topic(model.ParentTopic("P", expiration_minutes=5))
    s.put_group(model.LiteGroup("G", bind_topic="P"))
    s.put_quota(model.Quota("parent:P", max_lite_topics=10))
    run = model.ReclaimRun("P", "run-1", 1_000, 2_000, scanned=3, expired=2, reclaimed=2)
    s.put_reclaim_run(run)
    s.put_membership('{"members": ["a:1"]}')
    s.put_access('{"users": []}')
    clock.advance(5000)
    s.commit_offset(LMQ_A, "g", 2)
    consumed_a = clock()
    s.commit_offset(lmq_b, "g", 1)
    assert s.delete_lite_topic("P", "b") is True
    s.append([msg(lite="b", body=b"reborn")])
    s.commit_offset(lmq_b, "g2", 1)  # a group of the re-created topic
    s.close()
    shutil.rmtree(store_config().data_dir / "index")
    s = open_lmq()
    assert s.recovery.rebuilt is True
    assert s.get_offset(LMQ_A, "g") == 2
    assert s.get_offset(lmq_b, "g") is None  # belonged to the deleted incarnation
    assert s.get_offset(lmq_b, "g2") == 1  # replaying the old tombstone leaves the new topic's offsets alone
    a = s.lite_topic("P", "a")
    assert a is not None and a.last_consume_ms == consumed_a
    assert s.get_parent_topic("P") == model.ParentTopic("P", expiration_minutes=5)
    assert s.get_group("G") == model.LiteGroup("G", bind_topic="P")
    assert s.get_quota("parent:P") == model.Quota("parent:P", max_lite_topics=10)
    assert s.get_reclaim_run("P") == run
    assert s.get_membership() == '{"members": ["a:1"]}'
    assert s.get_access() == '{"users": []}'  # users and policies are not derived from the log


def test_offsets_and_metadata_in_an_index_from_before_the_meta_store_are_moved(
    open_lmq: OpenLmq, store_config: Callable[..., config.StoreConfig], msg: Msg
) -> None:
    s = open_lmq()
    s.append([msg(lite="a")])
    s.close()
    idx = index_mod.Index(store_config().data_dir / "index", 0)
    wb = idx.batch()
    name = keys.parse_queue(LMQ_A.topic, 0)
    wb.put(keys.offset_key(name.qkey, "g"), keys.U64.pack(1))
    wb.put(keys.name_key(keys.PARENT, "P"), keys.encode_parent_topic(model.ParentTopic("P", expiration_minutes=7)))
    idx.write(wb)
    idx.close()
    s = open_lmq()
    assert s.get_offset(LMQ_A, "g") == 1
    assert s.get_parent_topic("P") == model.ParentTopic("P", expiration_minutes=7)
    s.close()
    idx = index_mod.Index(store_config().data_dir / "index", 0)
    try:
        assert [list(idx.prefix_items(p)) for p in keys.PRIMARY_PREFIXES] == [[]] * len(keys.PRIMARY_PREFIXES)
    finally:
        idx.close()


def test_commits_that_only_move_the_commit_point_keep_the_handouts_across_a_reopen(open_lmq: OpenLmq, msg: Msg) -> None:
    s = open_lmq()
    s.append([msg() for _ in range(6)])
    handouts = model.Handouts(5, ((3, 4),))
    s.commit_offset(LMQ_A, "g", 0, (2,), handouts)
    value = s._meta.get(keys.acked_key(keys.parse_queue(LMQ_A.topic, 0).qkey, "g"))
    s.commit_offset(LMQ_A, "g", 1, (2,), handouts)  # in-order ack: the A value is not written again
    assert s._meta.get(keys.acked_key(keys.parse_queue(LMQ_A.topic, 0).qkey, "g")) == value
    s.close()
    s = open_lmq()
    assert (s.get_offset(LMQ_A, "g"), s.get_acked(LMQ_A, "g"), s.get_handouts(LMQ_A, "g")) == (1, (2,), handouts)
    s.commit_offset(LMQ_A, "g", 1, (2,), handouts)  # first commit after an open: written again (not known)
    s.commit_offset(LMQ_A, "g", 3, (), handouts)
    assert (s.get_acked(LMQ_A, "g"), s.get_handouts(LMQ_A, "g")) == ((), handouts)
    s.commit_offset(LMQ_A, "g", 5)
    assert (s.get_acked(LMQ_A, "g"), s.get_handouts(LMQ_A, "g")) == ((), model.NO_HANDOUTS)
    assert not s._meta._acked_keys
