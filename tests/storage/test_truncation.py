"""Truncation on the real store (segments + RocksDB): the cut is a record in the log, so it survives a reopen,
an index rebuilt from the log, and a kill -9 anywhere between its record and its index write."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from lmq_broker import config, model
from lmq_broker.storage import store as store_mod

Msg = Callable[..., model.NewMessage]
LMQ_A = model.QueueId.lmq("P", "a")


def bodies(store: store_mod.LmqStore) -> list[bytes]:
    return [m.body for m in store.read(LMQ_A, 0, 100)]


def test_a_cut_inside_a_run_survives_a_reopen_and_a_rebuild_of_the_index(
    open_lmq: Callable[..., store_mod.LmqStore], msg: Msg, tmp_path: Path
) -> None:
    store = open_lmq()
    store.append([msg(body=f"old-{n}".encode(), parent_queue=False) for n in range(6)])  # one run of 6
    store.commit_offset(LMQ_A, "g", 5)
    assert store.truncate_queue(LMQ_A, 3) == 3
    store.append([msg(body=f"new-{n}".encode(), parent_queue=False) for n in range(2)])
    expected = [b"old-0", b"old-1", b"old-2", b"new-0", b"new-1"]
    assert bodies(store) == expected
    store.close()
    reopened = open_lmq()
    assert bodies(reopened) == expected
    assert reopened.queue_offsets(LMQ_A) == (0, 5)
    assert reopened.get_offset(LMQ_A, "g") == 3
    reopened.close()
    shutil.rmtree(tmp_path / "data" / "index")  # the index is a cache: rebuilt from the log, cut included
    rebuilt = open_lmq()
    assert rebuilt.recovery.rebuilt
    assert bodies(rebuilt) == expected
    assert rebuilt.queue_offsets(LMQ_A) == (0, 5)
    assert rebuilt.get_offset(LMQ_A, "g") == 3  # a rebuild does not clamp again what meta kept


CRASHER = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from lmq_broker import config, model
    from lmq_broker.storage import meta, store, truncation

    data_dir, stage = Path(sys.argv[1]), sys.argv[2]
    cfg = config.StoreConfig(data_dir=data_dir, flush_mode=config.FlushMode.ASYNC)
    s = store.open_store(cfg)
    lmq = model.QueueId.lmq("P", "a")
    s.append([model.NewMessage(f"m{n}", "P", b"old", (lmq,), lite_topic="a") for n in range(6)])
    s.commit_offset(lmq, "g", 5)
    s.flush()

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if stage == "before-meta":
        meta.Meta.clamp_consumer_state = die
    else:
        truncation.apply = die
    s.truncate_queue(lmq, 2)
    """
)


@pytest.mark.parametrize("stage", ["before-meta", "before-index"])
def test_a_kill_9_in_the_middle_of_a_cut_is_finished_at_the_next_open(
    open_lmq: Callable[..., store_mod.LmqStore], msg: Msg, tmp_path: Path, stage: str
) -> None:
    data_dir = tmp_path / "data"
    done = subprocess.run(
        [sys.executable, "-c", CRASHER, str(data_dir), stage], capture_output=True, check=False, timeout=60
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    store = open_lmq(flush_mode=config.FlushMode.ASYNC)
    assert store.queue_offsets(LMQ_A) == (0, 2)  # the record was in the log: recovery applied it
    assert len(store.read(LMQ_A, 0, 10)) == 2
    assert store.get_offset(LMQ_A, "g") == 2
    assert store.truncate_queue(LMQ_A, 2) == 0  # and again is nothing
    (res,) = store.append([msg(body=b"new", parent_queue=False)])
    assert res.offsets[LMQ_A] == 2
    assert bodies(store)[-1] == b"new"
