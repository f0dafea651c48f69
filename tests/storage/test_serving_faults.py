"""Faults while serving: a reader racing the background index rebuild, a failed rebuild, commits during a
rebuild, index damage found by a write, a failed delete. The rule behind each: a reader is told "try later"
rather than shown holes it cannot vouch for, and an error never leaves the store refusing work for good."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import pytest
from waiting import eventually

from lmq_broker import errors, model
from lmq_broker.storage import core as core_mod
from lmq_broker.storage import index as index_mod
from lmq_broker.storage import keys, recovery
from lmq_broker.storage import store as store_mod

Msg = Callable[..., model.NewMessage]
LMQ_A = model.QueueId.lmq("P", "a")
OpenLmq = Callable[..., store_mod.LmqStore]


def five(s: store_mod.LmqStore, msg: Msg) -> None:
    for i in range(5):  # one append each: one run key per offset
        s.append([msg(lite="a", body=b"m%d" % i, parent_queue=False)])


def start_rebuild_during_read(s: store_mod.LmqStore, *, finish: bool) -> None:
    """On the reader's state lookup, run the rebuild thread's first steps: the index swapped for a new one,
    three records replayed into it so far (``finish``: the whole rebuild, to its end)."""
    states = s._core.states
    real_get = states.get
    fired: list[bool] = []

    def racing_get(name: keys.QueueName) -> index_mod.QueueState | None:
        st = real_get(name)
        if not fired:
            fired.append(True)
            s._core.rebuilding = "test: damaged block"
            with s._core.write_lock:
                s._core.replace_index()
                if finish:
                    recovery.recover(s._core)
                    s._core.rebuilding = None
                else:
                    full = s._core.log.scan
                    s._core.log.scan = lambda a, b: itertools.islice(full(a, b), 3)  # type: ignore[method-assign,assignment]
                    recovery.replay(s._core, (s._core.log.seqs()[0], 0), s._core.log.seqs()[-1], True)
                    s._core.log.scan = full  # type: ignore[method-assign]
        return st

    states.get = racing_get  # type: ignore[method-assign]


@pytest.mark.parametrize("finish", [False, True], ids=["rebuild-under-way", "rebuild-done"])
def test_a_read_racing_an_index_swap_fails_instead_of_reporting_holes(
    open_lmq: OpenLmq, msg: Msg, finish: bool
) -> None:
    s = open_lmq()
    five(s, msg)
    start_rebuild_during_read(s, finish=finish)
    with pytest.raises(errors.StorageError, match="rebuilding"):
        s.read_span(LMQ_A, 0, 32)
    if not finish:
        with pytest.raises(errors.StorageError, match="rebuilding"):
            s.read_span(LMQ_A, 0, 32)  # the partial index is never read
        with s._core.write_lock:
            recovery.recover(s._core)
        s._core.rebuilding = None
    got, end = s.read_span(LMQ_A, 0, 32)
    assert [m.body for m in got] == [b"m%d" % i for i in range(5)] and end == 5


def test_after_a_failed_rebuild_reads_keep_failing(
    open_lmq: OpenLmq, msg: Msg, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = open_lmq()
    five(s, msg)

    def broken_recover(core: core_mod.Core) -> recovery.Pass:
        raise errors.StorageError("test: replay failed")

    monkeypatch.setattr(recovery, "recover", broken_recover)
    s._rebuilder.index_corrupt(errors.IndexCorrupt("test: damaged block"))
    assert s.wait_rebuilt(30)
    for _ in range(2):
        with pytest.raises(errors.StorageError, match="index unusable"):
            s.read_span(LMQ_A, 0, 32)
    health = s.health()
    assert health is not None and "rebuild failed" in health


def test_an_entry_missing_without_a_recorded_loss_is_never_reported_as_gone(open_lmq: OpenLmq, msg: Msg) -> None:
    s = open_lmq()
    five(s, msg)
    name = keys.parse_queue(LMQ_A.topic, 0)
    wb = s._core.index.batch()
    wb.delete(keys.entry_key(name.qkey, 2))  # an inconsistency, not a loss the store knows of
    s._core.index.write(wb)
    got, end = s.read_span(LMQ_A, 0, 32)
    assert [m.offset for m in got] == [0, 1] and end == 2  # the span stops before it
    with pytest.raises(errors.StorageError, match="no index entry for offset 2"):
        s.read_span(LMQ_A, 2, 32)


def test_commits_go_to_meta_while_the_index_is_rebuilt(open_lmq: OpenLmq, msg: Msg) -> None:
    s = open_lmq()
    five(s, msg)
    s.commit_offset(model.QueueId("P", 0), "g", 0)
    s._core.rebuilding = "test: damaged block"
    with s._core.write_lock:  # the rebuild holds the write lock for its duration
        done = threading.Event()

        def commit() -> None:
            s.commit_offset(LMQ_A, "g", 3, (4,))
            s.commit_offset(model.QueueId("P", 0), "g", 2)
            done.set()

        t = threading.Thread(target=commit)
        t.start()
        assert done.wait(10), "a meta-only commit waited for the rebuild"
        assert s.try_commit_offset(LMQ_A, "g", 4)
        t.join()
    s._core.rebuilding = None
    assert s.get_offset(LMQ_A, "g") == 4 and s.get_acked(LMQ_A, "g") == ()
    assert s.get_offset(model.QueueId("P", 0), "g") == 2
    name = keys.parse_queue(LMQ_A.topic, 0)
    assert s._meta.get(keys.consumed_key(name.qkey)) is not None  # the rebuild copies it into the index


def test_index_damage_found_by_a_write_is_rebuilt_and_writes_resume(open_lmq: OpenLmq, msg: Msg) -> None:
    s = open_lmq()
    five(s, msg)
    index = s._core.index
    real = index.get_u64

    def damaged(key: bytes) -> int | None:
        index.get_u64 = real  # type: ignore[method-assign]
        raise index.failed(Exception("Corruption: block checksum mismatch (test)"))

    index.get_u64 = damaged  # type: ignore[method-assign]
    with pytest.raises(errors.StorageError):
        s.append([msg(lite="new-topic")])  # a new lite topic: its batch reads the counters
    assert s.wait_rebuilt(60)
    assert s.health() is None
    s.append([msg(lite="b")])
    got = s.read(LMQ_A, 0, 32)
    assert [m.body for m in got] == [b"m%d" % i for i in range(5)]


def test_a_failed_delete_keeps_the_acked_set_until_it_succeeds(open_lmq: OpenLmq, msg: Msg) -> None:
    s = open_lmq()
    five(s, msg)
    s.commit_offset(LMQ_A, "g", 1, (3,))
    meta = s._meta._db
    real = meta.write

    def full(wb: object) -> None:
        meta.write = real  # type: ignore[method-assign]
        raise Exception("IO error: No space left on device (test)")

    meta.write = full  # type: ignore[method-assign]
    with pytest.raises(errors.StorageError):
        s.delete_lite_topic("P", "a")
    assert s.get_acked(LMQ_A, "g") == (3,)  # neither the set nor meta lost it
    eventually(lambda: s.health() is None, "the retrier reopened meta")  # writes resume without a restart
    assert s.delete_lite_topic("P", "a")
    assert s.get_acked(LMQ_A, "g") == () and not s._meta._acked_keys
