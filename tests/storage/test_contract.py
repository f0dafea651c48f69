"""The api.Store contract, run against LmqStore and MemoryStore alike (the ``make_store`` fixture)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from lmq_broker import errors, model
from lmq_broker.storage import api
from lmq_broker.storage.memory import ManualClock
from lmq_broker.storage.testing import another_writer, append_if_free

Msg = Callable[..., model.NewMessage]
LMQ_A = model.QueueId.lmq("P", "a")
PARENT_Q = model.QueueId("P", 0)


# --- append and read ---------------------------------------------------------------------------------


def test_append_assigns_consecutive_offsets_per_queue(store: api.Store, msg: Msg, clock: ManualClock) -> None:
    results = store.append([msg(lite="a"), msg(lite="b"), msg(lite="a")])
    assert [r.offsets for r in results] == [
        {PARENT_Q: 0, LMQ_A: 0},
        {PARENT_Q: 1, model.QueueId.lmq("P", "b"): 0},
        {PARENT_Q: 2, LMQ_A: 1},
    ]
    assert {r.store_timestamp_ms for r in results} == {clock()}
    assert results[0] == model.AppendResult(results[0].message_id, (PARENT_Q, LMQ_A), (0, 0), clock())
    assert store.queue_offsets(PARENT_Q) == (0, 3)
    assert store.queue_offsets(LMQ_A) == (0, 2)


def test_empty_append_is_a_no_op(store: api.Store) -> None:
    assert store.append([]) == []
    assert append_if_free(store, []) == []


def test_append_if_free_with_no_other_writer_is_an_append(store: api.Store, msg: Msg, clock: ManualClock) -> None:
    store.append([msg(lite="a")])
    results = append_if_free(store, [msg(lite="a"), msg(lite="b")])
    assert results is not None
    assert [r.offsets for r in results] == [{PARENT_Q: 1, LMQ_A: 1}, {PARENT_Q: 2, model.QueueId.lmq("P", "b"): 0}]
    assert [m.message_id for m in store.read(LMQ_A, 1, 10)] == [results[0].message_id]
    assert store.queue_offsets(LMQ_A) == (0, 2)
    with pytest.raises(errors.BodyEmpty):
        append_if_free(store, [msg(lite="c", body=b"")])
    assert store.lite_topic("P", "c") is None


def test_append_if_free_writes_nothing_while_another_writer_holds_the_path(store: api.Store, msg: Msg) -> None:
    with another_writer(store):
        assert append_if_free(store, [msg()]) is None
    assert store.queue_offsets(LMQ_A) == (0, 0)
    assert append_if_free(store, [msg()]) is not None
    assert store.queue_offsets(LMQ_A) == (0, 1)


def test_read_round_trips_every_field(store: api.Store, msg: Msg, clock: ManualClock) -> None:
    m = msg(
        body=b"\x00\xffpayload",
        born_timestamp_ms=123,
        born_host="10.0.0.1",
        tag="TagA",
        keys=("k1", "k2"),
        message_group="g1",
        user_properties={"x": "1", "ünï": "cödé"},
    )
    store.append([m])
    for queue in (PARENT_Q, LMQ_A):
        (got,) = store.read(queue, 0, 10)
        assert got == model.StoredMessage(
            queue=queue,
            offset=0,
            message_id=m.message_id,
            topic="P",
            body=b"\x00\xffpayload",
            store_timestamp_ms=clock(),
            born_timestamp_ms=123,
            lite_topic="a",
            message_type=model.MessageType.LITE,
            born_host="10.0.0.1",
            tag="TagA",
            keys=("k1", "k2"),
            message_group="g1",
            user_properties={"x": "1", "ünï": "cödé"},
        )


def test_read_by_batch_from_an_offset(store: api.Store, msg: Msg) -> None:
    store.append([msg(body=f"b{i}".encode()) for i in range(10)])
    assert [m.offset for m in store.read(LMQ_A, 3, 4)] == [3, 4, 5, 6]
    assert [m.body for m in store.read(LMQ_A, 8, 32)] == [b"b8", b"b9"]
    assert store.read(LMQ_A, 10, 32) == []
    assert store.read(LMQ_A, 0, 0) == []


def test_read_sees_only_its_own_queue(store: api.Store, msg: Msg) -> None:
    store.append([msg(lite="a", body=b"A"), msg(lite="b", body=b"B"), msg(lite="a", body=b"A2")])
    assert [m.body for m in store.read(LMQ_A, 0, 10)] == [b"A", b"A2"]
    assert [m.body for m in store.read(model.QueueId.lmq("P", "b"), 0, 10)] == [b"B"]
    assert [m.body for m in store.read(PARENT_Q, 0, 10)] == [b"A", b"B", b"A2"]
    assert store.read(model.QueueId.lmq("P", "zzz"), 0, 10) == []
    assert store.queue_offsets(model.QueueId("Other", 3)) == (0, 0)


def test_multi_dispatch_indexes_one_message_into_every_queue(store: api.Store, msg: Msg) -> None:
    extra = tuple(model.QueueId.lmq("P", f"fan{i}") for i in range(20))
    (res,) = store.append([msg(queues=(PARENT_Q, *extra), body=b"once")])
    assert res.offsets == {q: 0 for q in (PARENT_Q, *extra)}
    for q in extra:
        (got,) = store.read(q, 0, 5)
        assert (got.queue, got.offset, got.body) == (q, 0, b"once")
    assert store.lite_topic_count("P") == 20


def test_fan_out_to_queues_of_the_same_topic(store: api.Store, msg: Msg) -> None:
    p1, p2, q0 = model.QueueId("P", 1), model.QueueId("P", 2), model.QueueId("Q", 0)
    store.append([msg()])  # P queue 0 resolved (and cached) first
    (res,) = store.append([msg(queues=(PARENT_Q, p1, LMQ_A, p2, q0), body=b"fan")])
    assert res.offsets == {PARENT_Q: 1, p1: 0, LMQ_A: 1, p2: 0, q0: 0}
    (res,) = store.append([msg(queues=(p2, p1, q0, PARENT_Q), body=b"again")])
    assert res.offsets == {p2: 1, p1: 1, q0: 1, PARENT_Q: 2}
    assert [m.body for m in store.read(p1, 0, 10)] == [b"fan", b"again"]


def test_appends_from_many_threads_get_unique_dense_offsets(store: api.Store, msg: Msg) -> None:
    n_threads, n_batches, batch = 4, 10, 5
    results: list[model.AppendResult] = []
    lock = threading.Lock()

    def work() -> None:
        for _ in range(n_batches):
            got = store.append([msg() for _ in range(batch)])
            with lock:
                results.extend(got)

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = n_threads * n_batches * batch
    assert sorted(r.offsets[LMQ_A] for r in results) == list(range(total))
    by_offset = {r.offsets[LMQ_A]: r.message_id for r in results}
    assert [m.message_id for m in store.read(LMQ_A, 0, total)] == [by_offset[i] for i in range(total)]


def test_readers_never_see_a_queue_ahead_of_its_messages(store: api.Store, msg: Msg) -> None:
    """While a writer appends, every (min, max) a reader sees is readable in full, in order."""
    done = threading.Event()
    problems: list[str] = []

    def read_loop() -> None:
        while not done.is_set():
            lo, hi = store.queue_offsets(LMQ_A)
            got = [m.offset for m in store.read(LMQ_A, lo, hi - lo)]
            if got != list(range(lo, hi)):
                problems.append(f"queue at ({lo}, {hi}) read back {got[:3]}...")

    reader = threading.Thread(target=read_loop)
    reader.start()
    try:
        for _ in range(100):
            store.append([msg() for _ in range(5)])
    finally:
        done.set()
        reader.join()
    assert problems == []


# --- bad input: a typed error and nothing written ---------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        ({"body": b""}, errors.BodyEmpty),
        ({"body": b"x" * 70_000}, errors.RecordTooLarge),
        ({"queues": ()}, errors.InvalidArgument),
        ({"queues": (PARENT_Q, PARENT_Q)}, errors.InvalidArgument),
        ({"queues": (PARENT_Q, LMQ_A, model.QueueId("P", 1), LMQ_A)}, errors.InvalidArgument),
        ({"queues": (PARENT_Q, LMQ_A, model.QueueId("bad name", 0))}, errors.InvalidName),
        ({"queues": (PARENT_Q, LMQ_A, model.QueueId("%LMQ%$P$a", 1))}, errors.InvalidName),
        ({"message_id": ""}, errors.InvalidArgument),
        ({"topic": "bad topic"}, errors.InvalidName),
        ({"lite_topic": "bad lite!"}, errors.InvalidLiteTopic),
        ({"queues": (model.QueueId("%LMQ%$P", 0),)}, errors.InvalidName),
        ({"queues": (model.QueueId("%LMQ%$P$a$b", 0),)}, errors.InvalidName),
        ({"queues": (model.QueueId("%LMQ%$P$bad lite", 0),)}, errors.InvalidLiteTopic),
        ({"queues": (model.QueueId("%LMQ%$P$" + "x" * 65, 0),)}, errors.InvalidLiteTopic),
        ({"queues": (model.QueueId("%LMQ%$P$a", 1),)}, errors.InvalidName),
        ({"queues": (model.QueueId("%LMQ%$$a", 0),)}, errors.InvalidName),
        ({"queues": (model.QueueId("", 0),)}, errors.InvalidName),
        ({"queues": (model.QueueId("has space", 0),)}, errors.InvalidName),
        ({"queues": (model.QueueId("P", 70_000),)}, errors.InvalidName),
        ({"queues": (model.QueueId("P", -1),)}, errors.InvalidName),
    ],
)
def test_bad_message_is_refused_and_nothing_is_written(
    make_store: Callable[..., api.Store], msg: Msg, overrides: dict[str, object], error: type[Exception]
) -> None:
    store = make_store(max_record_bytes=64 * 1024)
    good = msg()
    with pytest.raises(error):
        store.append([good, msg(**overrides)])
    assert store.queue_offsets(PARENT_Q) == (0, 0)
    assert store.queue_offsets(LMQ_A) == (0, 0)
    assert store.lite_topic_count() == 0
    assert store.append([good])[0].offsets == {PARENT_Q: 0, LMQ_A: 0}


def test_a_bad_call_does_not_fail_a_concurrent_good_one(store: api.Store, msg: Msg) -> None:
    errors_seen: list[BaseException] = []

    def bad() -> None:
        for _ in range(20):
            try:
                store.append([msg(body=b"")])
            except errors.BodyEmpty as e:
                errors_seen.append(e)

    t = threading.Thread(target=bad)
    t.start()
    for _ in range(20):
        store.append([msg()])
    t.join()
    assert len(errors_seen) == 20
    assert store.queue_offsets(LMQ_A) == (0, 20)


# --- consumer offsets --------------------------------------------------------------------------------


def test_consumer_offsets_per_queue_and_group(store: api.Store, msg: Msg, clock: ManualClock) -> None:
    store.append([msg(), msg(lite="b")])
    assert store.get_offset(LMQ_A, "g1") is None
    store.commit_offset(LMQ_A, "g1", 1)
    store.commit_offset(LMQ_A, "g2", 0)
    store.commit_offset(PARENT_Q, "g1", 2)
    store.commit_offset(LMQ_A, "g1", 2)
    assert store.get_offset(LMQ_A, "g1") == 2
    assert store.get_offset(LMQ_A, "g2") == 0
    assert store.get_offset(PARENT_Q, "g1") == 2
    assert store.get_offset(model.QueueId.lmq("P", "b"), "g1") is None


def test_queues_that_are_not_lite_topics_their_commit_points_and_how_far_they_were_relocated(
    store: api.Store, msg: Msg
) -> None:
    """What a leaving broker walks to copy its NORMAL queues and dead letters (``cluster.relocating``)."""
    assert store.normal_queues() == []
    store.append([msg(), msg(lite="b", parent="Q"), msg(lite="c", parent="Q", parent_queue=False)])
    store.append([msg(lite=None, parent="Q", parent_queue=False, queues=(model.QueueId("Q", 3),))])
    assert store.normal_queues() == [PARENT_Q, model.QueueId("Q", 0), model.QueueId("Q", 3)]  # no lite topic
    assert store.normal_queues(PARENT_Q, 1) == [model.QueueId("Q", 0)]
    assert store.normal_queues(model.QueueId("Q", 3)) == []
    assert store.commit_points(PARENT_Q) == {}
    store.commit_offset(PARENT_Q, "g1", 1)
    store.commit_offset(PARENT_Q, "g2", 0)
    store.commit_offset(model.QueueId("P", 1), "g3", 0)
    assert store.commit_points(PARENT_Q) == {"g1": 1, "g2": 0}
    assert store.relocated(PARENT_Q) == 0
    store.put_relocated(PARENT_Q, 1)
    assert (store.relocated(PARENT_Q), store.relocated(model.QueueId("Q", 0))) == (1, 0)


def test_commit_on_an_lmq_records_last_consume_time(store: api.Store, msg: Msg, clock: ManualClock) -> None:
    store.append([msg()])
    clock.advance(5000)
    store.commit_offset(LMQ_A, "g", 1)
    meta = store.lite_topic("P", "a")
    assert meta is not None
    assert meta.last_consume_ms == clock()
    assert meta.last_store_ms == clock() - 5000


def test_commit_on_a_missing_lite_topic_is_ignored(store: api.Store) -> None:
    store.commit_offset(LMQ_A, "g", 3)
    assert store.get_offset(LMQ_A, "g") is None
    assert store.lite_topic("P", "a") is None


def test_try_commit_offset_with_no_other_writer_is_a_commit(store: api.Store, msg: Msg, clock: ManualClock) -> None:
    store.append([msg(), msg()])
    clock.advance(7000)
    assert store.try_commit_offset(LMQ_A, "g", 2)
    assert store.try_commit_offset(PARENT_Q, "g", 1)
    assert store.get_offset(LMQ_A, "g") == 2 and store.get_offset(PARENT_Q, "g") == 1
    meta = store.lite_topic("P", "a")
    assert meta is not None and meta.last_consume_ms == clock()
    assert store.try_commit_offset(model.QueueId.lmq("P", "gone"), "g", 1)  # a missing lite topic: ignored
    assert store.get_offset(model.QueueId.lmq("P", "gone"), "g") is None


def test_try_commit_offset_writes_nothing_while_another_writer_holds_the_path(
    store: api.Store, msg: Msg, clock: ManualClock
) -> None:
    store.append([msg()])
    store.commit_offset(LMQ_A, "g", 0)
    clock.advance(7000)
    with another_writer(store):
        assert not store.try_commit_offset(LMQ_A, "g", 1)
    assert store.get_offset(LMQ_A, "g") == 0
    meta = store.lite_topic("P", "a")
    assert meta is not None and meta.last_consume_ms == clock() - 7000
    assert store.try_commit_offset(LMQ_A, "g", 1)
    assert store.get_offset(LMQ_A, "g") == 1


@pytest.mark.parametrize(
    ("group", "offset", "error"), [("bad group", 0, errors.InvalidName), ("g", -1, errors.InvalidArgument)]
)
def test_try_commit_offset_refuses_bad_input(store: api.Store, group: str, offset: int, error: type[Exception]) -> None:
    with pytest.raises(error):
        store.try_commit_offset(PARENT_Q, group, offset)
    assert store.get_offset(PARENT_Q, "g") is None


@pytest.mark.parametrize(
    ("group", "offset", "error"), [("bad group", 0, errors.InvalidName), ("g", -1, errors.InvalidArgument)]
)
def test_commit_offset_refuses_bad_input(store: api.Store, group: str, offset: int, error: type[Exception]) -> None:
    with pytest.raises(error):
        store.commit_offset(PARENT_Q, group, offset)


# --- lite topics -------------------------------------------------------------------------------------


def test_lite_topic_metadata_follows_appends(store: api.Store, msg: Msg, clock: ManualClock) -> None:
    created = clock()
    store.append([msg()])
    clock.advance(1000)
    store.append([msg(), msg()])
    assert store.lite_topic("P", "a") == model.LiteTopicMeta("P", "a", created, created + 1000, 0, 0, 3)
    assert store.lite_topic("P", "nope") is None


def test_lite_topic_counts_are_per_parent_and_total(store: api.Store, msg: Msg) -> None:
    store.append([msg("P", "a"), msg("P", "b"), msg("Q", "a"), msg("P", "a")])
    assert store.lite_topic_count("P") == 2
    assert store.lite_topic_count("Q") == 1
    assert store.lite_topic_count("R") == 0
    assert store.lite_topic_count() == 3
    store.delete_lite_topic("P", "a")
    assert (store.lite_topic_count("P"), store.lite_topic_count()) == (1, 2)


def test_scan_lite_topics_in_key_order_with_bounds(store: api.Store, msg: Msg) -> None:
    for parent, lite in [("P", "b"), ("P", "a"), ("P-x", "a"), ("Q", "c"), ("P", "a-1"), ("P", "c")]:
        store.append([msg(parent, lite)])

    def names(metas: list[model.LiteTopicMeta]) -> list[str]:
        return [f"{m.parent}${m.lite}" for m in metas]

    assert names(store.scan_lite_topics()) == ["P$a", "P$a-1", "P$b", "P$c", "P-x$a", "Q$c"]
    assert names(store.scan_lite_topics("P")) == ["P$a", "P$a-1", "P$b", "P$c"]
    assert names(store.scan_lite_topics("P", start_after="a")) == ["P$a-1", "P$b", "P$c"]
    assert names(store.scan_lite_topics("P", start_after="a", end_before="c")) == ["P$a-1", "P$b"]
    assert names(store.scan_lite_topics("P", limit=2)) == ["P$a", "P$a-1"]
    assert names(store.scan_lite_topics(None, start_after="P$c")) == ["P-x$a", "Q$c"]
    assert names(store.scan_lite_topics(None, start_after="P", end_before="Q")) == [
        "P$a",
        "P$a-1",
        "P$b",
        "P$c",
        "P-x$a",
    ]
    assert store.scan_lite_topics("Nope") == []


def test_delete_lite_topic_removes_entries_offsets_and_metadata(store: api.Store, msg: Msg) -> None:
    store.append([msg(), msg(lite="b"), msg()])
    store.commit_offset(LMQ_A, "g", 1)
    assert store.delete_lite_topic("P", "a") is True
    assert store.lite_topic("P", "a") is None
    assert store.read(LMQ_A, 0, 10) == []
    assert store.queue_offsets(LMQ_A) == (0, 0)
    assert store.get_offset(LMQ_A, "g") is None
    assert store.delete_lite_topic("P", "a") is False  # idempotent
    assert [m.offset for m in store.read(PARENT_Q, 0, 10)] == [0, 1, 2]  # the parent's queue is not touched
    assert store.lite_topic("P", "b") is not None


def test_a_deleted_lite_topic_starts_again_at_offset_zero(store: api.Store, msg: Msg) -> None:
    store.append([msg(body=b"old"), msg(body=b"old")])
    store.delete_lite_topic("P", "a")
    (res,) = store.append([msg(body=b"new")])
    assert res.offsets[LMQ_A] == 0
    assert [m.body for m in store.read(LMQ_A, 0, 10)] == [b"new"]


def test_compare_and_delete_keeps_a_topic_changed_since_the_scan(
    store: api.Store, msg: Msg, clock: ManualClock
) -> None:
    store.append([msg()])
    seen = store.lite_topic("P", "a")
    assert seen is not None
    clock.advance(10)
    store.append([msg()])  # a message arrived after the reclaimer's scan
    assert store.delete_lite_topic("P", "a", expected=seen) is False
    seen = store.lite_topic("P", "a")
    assert seen is not None
    clock.advance(10)
    store.commit_offset(LMQ_A, "g", 1)  # consumed after the scan
    assert store.delete_lite_topic("P", "a", expected=seen) is False
    seen = store.lite_topic("P", "a")
    assert seen is not None
    assert store.delete_lite_topic("P", "a", expected=seen) is True
    assert store.delete_lite_topic("P", "a", expected=seen) is False


def test_delete_lite_topics_leaves_the_topics_keep_names_at_the_last_moment(store: api.Store, msg: Msg) -> None:
    for lite in ("a", "b", "c"):
        store.append([msg(lite=lite)])
    rows = [("P", lite, store.lite_topic("P", lite)) for lite in ("a", "b", "c")]
    calls: list[str] = []

    def keep() -> set[str]:
        calls.append("keep")
        return {model.QueueId.lmq("P", "b").topic}

    assert store.delete_lite_topics(rows, keep=keep) == [True, False, True]
    assert calls == ["keep"]  # once per call, not once per row
    assert store.lite_topic("P", "b") is not None
    assert store.lite_topic("P", "a") is None and store.lite_topic("P", "c") is None
    assert store.lite_topic_count("P") == 1


def test_scan_with_an_idle_filter_returns_only_topics_idle_since_before_it(
    store: api.Store, msg: Msg, clock: ManualClock
) -> None:
    for lite in ("a", "b", "c", "d", "e"):
        store.append([msg(lite=lite)])
    clock.advance(100)
    store.append([msg(lite="b")])  # stored after the cut
    store.commit_offset(model.QueueId.lmq("P", "d"), "g", 1)  # consumed after the cut
    clock.advance(100)
    store.append([msg(lite="f")])  # created after the cut
    cut = clock() - 150

    def lites(metas: list[model.LiteTopicMeta]) -> list[str]:
        return [m.lite for m in metas]

    assert lites(store.scan_lite_topics("P", idle_since_before_ms=cut)) == ["a", "c", "e"]
    assert lites(store.scan_lite_topics(None, idle_since_before_ms=cut)) == ["a", "c", "e"]
    # limit counts matches, so the last row returned is the next page's cursor
    assert lites(store.scan_lite_topics("P", limit=1, idle_since_before_ms=cut)) == ["a"]
    assert lites(store.scan_lite_topics("P", start_after="a", limit=1, idle_since_before_ms=cut)) == ["c"]
    assert lites(store.scan_lite_topics("P", start_after="c", end_before="e", idle_since_before_ms=cut)) == []
    # strictly before: a topic last active exactly at the cut is not idle since before it
    first = store.lite_topic("P", "a")
    assert first is not None
    assert lites(store.scan_lite_topics("P", idle_since_before_ms=first.created_ms)) == []
    assert lites(store.scan_lite_topics("P", idle_since_before_ms=0)) == ["a", "b", "c", "d", "e", "f"]
    (row,) = store.scan_lite_topics("P", limit=1, idle_since_before_ms=cut)
    assert row == store.lite_topic("P", "a")  # every field decoded as in an unfiltered read


def test_batch_delete_compares_each_row_like_a_single_delete(store: api.Store, msg: Msg, clock: ManualClock) -> None:
    for lite in ("a", "b", "c", "d"):
        store.append([msg(lite=lite)])
    store.commit_offset(model.QueueId.lmq("P", "a"), "g", 1)
    seen = {m.lite: m for m in store.scan_lite_topics("P")}
    clock.advance(10)
    store.append([msg(lite="b")])  # changed since the scan
    assert store.delete_lite_topic("P", "c") is True  # absent by the time of the batch
    done = store.delete_lite_topics(
        [
            ("P", "a", seen["a"]),
            ("P", "b", seen["b"]),
            ("P", "c", seen["c"]),
            ("P", "d", None),  # unconditional
            ("P", "a", seen["a"]),  # the same topic twice: only the first row deletes it
            ("P", "never", None),
        ]
    )
    assert done == [True, False, False, True, False, False]
    assert [m.lite for m in store.scan_lite_topics("P")] == ["b"]
    assert store.lite_topic_count("P") == 1 and store.lite_topic_count() == 1
    assert store.get_offset(model.QueueId.lmq("P", "a"), "g") is None
    assert store.read(model.QueueId.lmq("P", "d"), 0, 10) == []
    assert [m.offset for m in store.read(PARENT_Q, 0, 10)] == [0, 1, 2, 3, 4]  # the parent queue is kept
    assert store.delete_lite_topics([]) == []
    (res,) = store.append([msg(lite="a")])
    assert res.offsets[model.QueueId.lmq("P", "a")] == 0  # a deleted topic starts again at zero


def test_batch_delete_with_an_invalid_name_deletes_nothing(store: api.Store, msg: Msg) -> None:
    store.append([msg(lite="a")])
    with pytest.raises(errors.InvalidLiteTopic):
        store.delete_lite_topics([("P", "a", None), ("P", "bad name", None)])
    assert store.lite_topic("P", "a") is not None


def test_lite_topic_lookups_refuse_invalid_names(store: api.Store) -> None:
    with pytest.raises(errors.InvalidLiteTopic):
        store.lite_topic("P", "bad name")
    with pytest.raises(errors.InvalidName):
        store.delete_lite_topic("bad parent", "a")


# --- control-plane metadata --------------------------------------------------------------------------


def test_parent_topics_groups_and_quotas_round_trip(store: api.Store) -> None:
    pt = model.ParentTopic("P", expiration_minutes=30, max_lite_topics=1000)
    grp = model.LiteGroup(
        "G",
        bind_topic="P",
        model=model.SubscriptionModel.EXCLUSIVE,
        client_quota=5,
        retry=model.RetryPolicy(3, (10, 20)),
        fifo=False,
    )
    quota = model.Quota("parent:P", max_lite_topics=10, max_send_rate=100)
    store.put_parent_topic(pt)
    store.put_parent_topic(model.ParentTopic("A"))
    store.put_group(grp)
    store.put_quota(quota)
    assert store.get_parent_topic("P") == pt
    assert [t.name for t in store.list_parent_topics()] == ["A", "P"]
    assert store.get_group("G") == grp
    assert store.list_groups() == [grp]
    assert store.get_quota("parent:P") == quota
    assert store.list_quotas() == [quota]
    store.put_parent_topic(model.ParentTopic("P", expiration_minutes=60))
    assert store.get_parent_topic("P") == model.ParentTopic("P", expiration_minutes=60)
    assert store.delete_parent_topic("P") is True
    assert store.delete_parent_topic("P") is False
    assert store.delete_group("G") is True
    assert store.delete_quota("parent:P") is True
    assert (store.get_parent_topic("P"), store.get_group("G"), store.get_quota("parent:P")) == (None, None, None)
    assert store.list_groups() == [] and store.list_quotas() == []


def test_control_metadata_refuses_invalid_names(store: api.Store) -> None:
    with pytest.raises(errors.InvalidName):
        store.put_parent_topic(model.ParentTopic("bad$name"))
    with pytest.raises(errors.InvalidName):
        store.put_group(model.LiteGroup("G", bind_topic="bad topic"))
    with pytest.raises(errors.InvalidName):
        store.put_quota(model.Quota(""))
    with pytest.raises(errors.InvalidName):
        store.put_reclaim_run(model.ReclaimRun("bad$name", "run", 0, 0))


def test_reclaim_runs_are_one_record_per_parent(store: api.Store) -> None:
    first = model.ReclaimRun("P", "run-1", 1_000, 5_000, scanned=10, expired=4, reclaimed=3, kept_changed=1)
    other = model.ReclaimRun("A", "run-1", 1_000, 5_000, kept_subscribed=2, not_found=1, errors=1, dry_run=True)
    assert store.get_reclaim_run("P") is None and store.list_reclaim_runs() == []
    store.put_reclaim_run(first)
    store.put_reclaim_run(other)
    assert store.get_reclaim_run("P") == first
    assert store.list_reclaim_runs() == [other, first]  # parent-name order
    second = model.ReclaimRun("P", "run-2", 9_000, 9_500, scanned=1)
    store.put_reclaim_run(second)  # the store keeps what it is given; ordering rules are the catalog's
    assert store.get_reclaim_run("P") == second
    # Records are independent of the parent topics themselves.
    assert store.get_parent_topic("P") is None and store.list_parent_topics() == []
    assert store.delete_reclaim_run("P") is True
    assert store.delete_reclaim_run("P") is False
    assert store.get_reclaim_run("P") is None and store.list_reclaim_runs() == [other]


def test_the_membership_is_one_opaque_text(store: api.Store) -> None:
    assert store.get_membership() is None
    store.put_membership('{"members": ["a:1", "b:2"]}')
    store.put_membership('{"members": ["a:1"]}')
    assert store.get_membership() == '{"members": ["a:1"]}'


def test_users_and_policies_are_one_opaque_text(store: api.Store) -> None:
    assert store.get_access() is None
    store.put_access('{"users": [{"name": "a"}]}')
    store.put_access('{"users": []}')
    assert store.get_access() == '{"users": []}'
    assert store.get_membership() is None  # a record of its own


# --- retention ---------------------------------------------------------------------------------------


def test_retention_by_age_advances_min_offsets_past_expired_messages_only(
    make_store: Callable[..., api.Store], msg: Msg, clock: ManualClock
) -> None:
    store = make_store(segment_max_bytes=4096, retention_max_age_ms=60_000)
    store.append([msg(body=b"x" * 1000)])
    for _ in range(11):
        store.append([msg(body=b"x" * 1000)])  # old: 12 messages, several segments
    clock.advance(120_000)
    (fresh,) = store.append([msg(body=b"fresh")])
    first_fresh = fresh.offsets[LMQ_A]
    report = store.apply_retention()
    assert report.segments_deleted > 0 and report.bytes_deleted > 0 and report.queues_advanced == 2
    lo, hi = store.queue_offsets(LMQ_A)
    assert 0 < lo <= first_fresh and hi == first_fresh + 1
    assert store.queue_offsets(PARENT_Q)[0] == lo
    meta = store.lite_topic("P", "a")
    assert meta is not None and meta.min_offset == lo
    got = store.read(LMQ_A, 0, 100)
    assert got[0].offset == lo and got[-1].body == b"fresh"
    assert store.apply_retention().segments_deleted == 0  # idempotent


def test_retention_by_size_keeps_the_newest_messages(make_store: Callable[..., api.Store], msg: Msg) -> None:
    store = make_store(segment_max_bytes=4096, retention_max_bytes=5000, retention_max_age_ms=-1)
    for i in range(20):
        store.append([msg(body=bytes([i]) * 1000)])
    report = store.apply_retention()
    assert report.segments_deleted > 0
    lo, hi = store.queue_offsets(LMQ_A)
    assert lo > 10 and hi == 20
    assert [m.body[0] for m in store.read(LMQ_A, 0, 100)] == list(range(lo, 20))


def test_a_stopped_retention_pass_ends_between_segments(make_store: Callable[..., api.Store], msg: Msg) -> None:
    store = make_store(segment_max_bytes=4096, retention_max_bytes=5000, retention_max_age_ms=-1)
    for i in range(20):
        store.append([msg(body=bytes([i]) * 1000)])
    assert store.apply_retention(stop=lambda: True) == api.RetentionReport(0, 0, 0)
    assert store.queue_offsets(LMQ_A) == (0, 20)
    asked = iter([False, True])
    one = store.apply_retention(stop=lambda: next(asked))
    assert one.segments_deleted == 1
    rest = store.apply_retention()
    assert rest.segments_deleted > 0 and store.queue_offsets(LMQ_A)[0] > 10


def test_nothing_expires_before_its_time(make_store: Callable[..., api.Store], msg: Msg, clock: ManualClock) -> None:
    store = make_store(segment_max_bytes=4096, retention_max_age_ms=60_000)
    for _ in range(10):
        store.append([msg(body=b"x" * 1000)])
    clock.advance(30_000)
    assert store.apply_retention() == api.RetentionReport(0, 0, 0)
    assert store.queue_offsets(LMQ_A) == (0, 10)


def test_retention_skips_lite_topics_deleted_meanwhile(
    make_store: Callable[..., api.Store], msg: Msg, clock: ManualClock
) -> None:
    store = make_store(segment_max_bytes=4096, retention_max_age_ms=1000)
    for _ in range(8):
        store.append([msg(lite="gone", body=b"x" * 1000, parent_queue=False)])
    store.delete_lite_topic("P", "gone")
    store.append([msg(lite="gone", body=b"x" * 1000, parent_queue=False)])  # recreated, offsets from 0
    clock.advance(5000)
    store.append([msg(lite="other", body=b"y", parent_queue=False)])
    store.apply_retention()
    assert store.lite_topic("P", "gone") is not None
    assert store.queue_offsets(model.QueueId.lmq("P", "gone"))[1] == 1


# --- lifecycle ---------------------------------------------------------------------------------------


def test_a_closed_store_refuses_calls(store: api.Store, msg: Msg) -> None:
    store.close()
    with pytest.raises(errors.StorageError):
        store.append([msg()])
    with pytest.raises(errors.StorageError):
        store.read(LMQ_A, 0, 1)
    store.close()  # idempotent


# --- acknowledged offsets above the commit point --------------------------------------------------------


def test_acked_offsets_above_the_commit_point_are_kept_and_replaced(store: api.Store, msg: Msg) -> None:
    store.append([msg() for _ in range(10)])
    assert store.get_acked(LMQ_A, "g") == ()
    store.commit_offset(LMQ_A, "g", 2, (4, 7, 9))
    assert (store.get_offset(LMQ_A, "g"), store.get_acked(LMQ_A, "g")) == (2, (4, 7, 9))
    assert store.try_commit_offset(LMQ_A, "g", 5, (7,))
    assert store.get_acked(LMQ_A, "g") == (7,)
    assert store.get_acked(LMQ_A, "other") == ()
    store.commit_offset(LMQ_A, "g", 8)  # an in-order commit (or a reset) clears the set
    assert store.get_acked(LMQ_A, "g") == ()
    with pytest.raises(errors.InvalidArgument):
        store.commit_offset(LMQ_A, "g", 8, (8,))


def test_a_deleted_lite_topic_forgets_its_acked_offsets(store: api.Store, msg: Msg) -> None:
    store.append([msg() for _ in range(5)])
    store.commit_offset(LMQ_A, "g", 1, (3,))
    assert store.delete_lite_topic("P", "a")
    store.append([msg() for _ in range(5)])
    assert store.get_acked(LMQ_A, "g") == ()


# --- hand-outs above the commit point (delivery attempts that survive a restart) ------------------------------


def test_handouts_are_kept_with_the_commit_point_and_replaced(store: api.Store, msg: Msg) -> None:
    store.append([msg() for _ in range(10)])
    assert store.get_handouts(LMQ_A, "g") == model.NO_HANDOUTS
    handouts = model.Handouts(6, ((2, 3), (4, 0)))
    store.commit_offset(LMQ_A, "g", 2, (), handouts)
    assert (store.get_offset(LMQ_A, "g"), store.get_acked(LMQ_A, "g")) == (2, ())
    assert store.get_handouts(LMQ_A, "g") == handouts
    assert store.try_commit_offset(LMQ_A, "g", 3, (5,), model.Handouts(7))
    assert (store.get_acked(LMQ_A, "g"), store.get_handouts(LMQ_A, "g")) == ((5,), model.Handouts(7))
    assert store.get_handouts(LMQ_A, "other") == model.NO_HANDOUTS
    store.commit_offset(LMQ_A, "g", 4, (5,))  # without hand-outs: none kept, the acked set stays
    assert (store.get_acked(LMQ_A, "g"), store.get_handouts(LMQ_A, "g")) == ((5,), model.NO_HANDOUTS)
    store.commit_offset(LMQ_A, "g", 7, (), model.Handouts(7))  # a mark not above the commit point: nothing
    assert (store.get_acked(LMQ_A, "g"), store.get_handouts(LMQ_A, "g")) == ((), model.NO_HANDOUTS)


@pytest.mark.parametrize(
    "handouts",
    [model.Handouts(2, ((1, 2),)), model.Handouts(9, ((1, 2),)), model.Handouts(9, ((5, 2), (4, 2)))],
    ids=["counts-without-mark", "count-below-commit", "not-ascending"],
)
def test_bad_handouts_are_refused_and_nothing_is_written(store: api.Store, msg: Msg, handouts: model.Handouts) -> None:
    store.append([msg() for _ in range(10)])
    store.commit_offset(LMQ_A, "g", 1, (), model.Handouts(3))
    for commit in (store.commit_offset, store.try_commit_offset):
        with pytest.raises(errors.InvalidArgument):
            commit(LMQ_A, "g", 2, (), handouts)
    assert (store.get_offset(LMQ_A, "g"), store.get_handouts(LMQ_A, "g")) == (1, model.Handouts(3))


def test_a_deleted_lite_topic_forgets_its_handouts(store: api.Store, msg: Msg) -> None:
    store.append([msg() for _ in range(5)])
    store.commit_offset(LMQ_A, "g", 1, (), model.Handouts(4, ((2, 5),)))
    assert store.delete_lite_topic("P", "a")
    store.append([msg() for _ in range(5)])
    assert store.get_handouts(LMQ_A, "g") == model.NO_HANDOUTS


def test_read_span_covers_what_it_passed_over(store: api.Store, msg: Msg) -> None:
    store.append([msg(body=b"%d" % i) for i in range(6)])
    messages, end = store.read_span(LMQ_A, 2, 3)
    assert ([m.offset for m in messages], end) == ([2, 3, 4], 5)
    assert store.read_span(LMQ_A, 4, 10)[1] == 6  # up to the queue's end
    assert store.read_span(LMQ_A, 9, 10) == ([], 9)  # past the end: nothing covered
    assert store.read_span(model.QueueId.lmq("P", "none"), 0, 10) == ([], 0)
    assert store.health() is None


def test_commit_offsets_is_commit_offset_of_each(store: api.Store, msg: Msg, clock: ManualClock) -> None:
    """The batch of an offset reset: each row committed, acked offsets above them dropped, the lite topics'
    consume time recorded; a gone lite topic gets no offsets (as with ``commit_offset``)."""
    store.append([msg() for _ in range(6)])
    store.commit_offset(LMQ_A, "g", 1, (3, 4))
    clock.advance(3000)
    gone = model.QueueId.lmq("P", "gone")
    store.commit_offsets([(LMQ_A, "g", 5), (LMQ_A, "g2", 2), (PARENT_Q, "g", 4), (gone, "g", 1)])
    assert [store.get_offset(LMQ_A, "g"), store.get_offset(LMQ_A, "g2"), store.get_offset(PARENT_Q, "g")] == [5, 2, 4]
    assert store.get_acked(LMQ_A, "g") == ()
    assert store.get_offset(gone, "g") is None and store.lite_topic("P", "gone") is None
    meta = store.lite_topic("P", "a")
    assert meta is not None and meta.last_consume_ms == clock()
    store.commit_offsets([])
    with pytest.raises(errors.InvalidArgument):
        store.commit_offsets([(LMQ_A, "g", 6), (LMQ_A, "g", -1)])
    assert store.get_offset(LMQ_A, "g") == 5  # a bad row: none written


def test_capped_commit_offsets_keep_each_offset_at_most_its_queues_end(store: api.Store, msg: Msg) -> None:
    """An MQTT start at the ends read earlier (``offsets.reset`` with ends): each offset capped at its queue's
    end as the write finds it, read once there; the rows written come back (a gone lite topic: not among them)."""
    store.append([msg() for _ in range(6)])
    lo, hi = store.queue_offsets(LMQ_A)
    gone = model.QueueId.lmq("P", "gone")
    rows = [(LMQ_A, "g", hi - 2), (LMQ_A, "g2", hi + 5), (PARENT_Q, "g", 10**6), (gone, "g", 1)]
    written = store.commit_offsets(rows, capped=True)
    parent_end = store.queue_offsets(PARENT_Q)[1]
    assert list(written) == [(LMQ_A, "g", hi - 2), (LMQ_A, "g2", hi), (PARENT_Q, "g", parent_end)]
    assert [store.get_offset(LMQ_A, "g"), store.get_offset(LMQ_A, "g2")] == [hi - 2, hi]
    assert store.get_offset(gone, "g") is None
    assert list(store.commit_offsets([(LMQ_A, "g", lo), (gone, "g", 0)])) == [(LMQ_A, "g", lo)]


# --- truncation (a replica's records its slot's owner never had) ----------------------------------------


def test_truncating_a_queue_cuts_its_end_and_the_next_append_takes_the_offset_again(store: api.Store, msg: Msg) -> None:
    store.append([msg(body=f"{n}".encode(), parent_queue=False) for n in range(5)])
    store.commit_offset(LMQ_A, "ahead", 4, acked=[])
    store.commit_offset(LMQ_A, "behind", 1, acked=[3])
    store.commit_offset(LMQ_A, "early", 1)
    assert store.truncate_queue(LMQ_A, 2) == 3
    assert store.truncate_queue(LMQ_A, 2) == 0  # idempotent
    assert store.truncate_queue(LMQ_A, 9) == 0  # nothing past its end
    assert store.queue_offsets(LMQ_A) == (0, 2)
    assert [m.body for m in store.read(LMQ_A, 0, 10)] == [b"0", b"1"]
    assert store.get_offset(LMQ_A, "ahead") == 2  # clamped: offsets 2.. will hold other messages
    assert store.get_offset(LMQ_A, "behind") == 1
    assert list(store.get_acked(LMQ_A, "behind")) == []  # an ack at 3 was of a message that is gone
    assert store.get_offset(LMQ_A, "early") == 1
    (res,) = store.append([msg(body=b"new", parent_queue=False)])
    assert res.offsets[LMQ_A] == 2
    assert [m.body for m in store.read(LMQ_A, 0, 10)] == [b"0", b"1", b"new"]
    meta = store.lite_topic("P", "a")
    assert meta is not None and meta.max_offset == 3


def test_a_records_replication_epoch_reads_back(store: api.Store, msg: Msg) -> None:
    store.append([msg(parent_queue=False), msg(parent_queue=False, epoch=7), msg(parent_queue=False, tag="x", epoch=1)])
    assert [m.epoch for m in store.read(LMQ_A, 0, 10)] == [0, 7, 1]


def test_a_records_ring_slot_reads_back_and_absent_is_not_slot_0(store: api.Store, msg: Msg) -> None:
    store.append(
        [
            msg(parent_queue=False),
            msg(parent_queue=False, slot=0),
            msg(parent_queue=False, slot=5, epoch=2),
            msg(parent_queue=False, tag="x", slot=70_000),
        ]
    )
    assert [(m.slot, m.epoch) for m in store.read(LMQ_A, 0, 10)] == [(-1, 0), (0, 0), (5, 2), (70_000, 0)]
