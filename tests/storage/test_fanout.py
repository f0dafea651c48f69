"""Multi-dispatch appends (one record, 3+ queues: the store API allows up to 255, the broker itself lists one,
or two with ``index_parent_queue``) take a per-queue loop beside LmqStore's unrolled one- and two-queue path;
these check it against MemoryStore, which assigns offsets one queue at a time, on mixed batches: queue lists
that share queues, one- and two-queue messages touching their queues in between, and segment cuts in the
middle of a batch."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmq_broker import config, errors, model
from lmq_broker.storage import api
from lmq_broker.storage import memory as memory_mod
from lmq_broker.storage import store as store_mod

POOL = (
    model.QueueId("P", 0),
    model.QueueId("P", 1),
    *(model.QueueId.lmq("P", f"t{i}") for i in range(6)),
)
LISTS = st.lists(st.sampled_from(range(len(POOL))), min_size=1, max_size=6, unique=True).map(
    lambda idx: tuple(POOL[i] for i in idx)
)
# A few recurring lists (the fan-out case: the same list over and over) mixed with arbitrary ones.
BATCHES = st.lists(st.lists(LISTS, min_size=1, max_size=40), min_size=1, max_size=6)


def _messages(batches: list[list[tuple[model.QueueId, ...]]]) -> list[list[model.NewMessage]]:
    out, n = [], 0
    for batch in batches:
        msgs = []
        for queues in batch:
            msgs.append(model.NewMessage(f"m{n}", "P", b"x" * (50 + n % 200), queues))
            n += 1
        out.append(msgs)
    return out


def _contents(s: api.Store) -> dict[model.QueueId, list[tuple[int, str]]]:
    return {q: [(m.offset, m.message_id) for m in s.read(q, 0, 10_000)] for q in POOL}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=BATCHES)
def test_fan_out_batches_match_one_queue_at_a_time_assignment(
    batches: list[list[tuple[model.QueueId, ...]]], tmp_path: Path
) -> None:
    root = tmp_path / "run"
    shutil.rmtree(root, ignore_errors=True)
    clock = memory_mod.ManualClock()
    cfg = config.StoreConfig(data_dir=root, segment_max_bytes=4096)  # a cut every dozen messages
    lmq = store_mod.LmqStore(cfg, clock)
    twin = memory_mod.MemoryStore(cfg, clock)
    try:
        for msgs in _messages(batches):
            got = lmq.append(msgs)
            want = twin.append(msgs)
            assert [(r.message_id, r.offsets) for r in got] == [(r.message_id, r.offsets) for r in want]
        expected = _contents(twin)
        assert _contents(lmq) == expected
        for q in POOL:  # dense from 0, nothing skipped or doubled
            assert [off for off, _ in expected[q]] == list(range(len(expected[q])))
    finally:
        lmq.close()
        twin.close()
    reopened = store_mod.LmqStore(cfg, clock)
    try:
        assert _contents(reopened) == expected
    finally:
        reopened.close()
    shutil.rmtree(root / "index")
    rebuilt = store_mod.LmqStore(cfg, clock)
    try:
        assert _contents(rebuilt) == expected  # the offsets written in the records agree with the index
    finally:
        rebuilt.close()


def test_a_fan_out_list_naming_a_queue_twice_is_refused(make_store: Callable[..., api.Store]) -> None:
    s = make_store()
    q = model.QueueId.lmq("P", "a")
    bad = model.NewMessage("m1", "P", b"x", (model.QueueId("P", 0), q, model.QueueId("P", 1), q))
    with pytest.raises(errors.InvalidArgument) as refused:
        s.append([bad])
    assert type(refused.value) is errors.InvalidArgument  # not a name error: every name is valid
    assert s.read(q, 0, 10) == []
