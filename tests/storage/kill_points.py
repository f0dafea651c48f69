"""A writer process for test_kill_points.py (run as a script, never collected).

It fills a store with small segments, then SIGKILLs itself at one named step of a segment roll, a retention
pass or a lite-topic delete. It prints ``ack <message id> <lite> <lmq offset>`` for every append answered,
and ``alive`` if the kill point was never reached (the test fails then)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmq_broker import config, model
from lmq_broker.storage import commitlog, index, meta, retention, segment, store
from lmq_broker.storage.memory import ManualClock

SEGMENT_BYTES = 4096
OLD = 12  # messages before the kill point: a few segments


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def wrap(owner: Any, attr: str, *, before: bool, when: Callable[..., bool] = lambda *a: True) -> None:
    real = getattr(owner, attr)

    def hooked(*args: Any, **kw: Any) -> Any:
        if before and when(*args):
            die()
        out = real(*args, **kw)
        if not before and when(*args):
            die()
        return out

    setattr(owner, attr, hooked)


def main() -> None:
    data_dir, point = Path(sys.argv[1]), sys.argv[2]
    cfg = config.StoreConfig(data_dir=data_dir, segment_max_bytes=SEGMENT_BYTES, retention_max_age_ms=60_000)
    clock = ManualClock()
    s = store.open_store(cfg, clock)

    def append(lite: str, mid: str, size: int) -> None:
        [r] = s.append([model.NewMessage(mid, "P", b"x" * size, (model.QueueId.lmq("P", lite),), lite_topic=lite)])
        print(f"ack {mid} {lite} {r.offsets[model.QueueId.lmq('P', lite)]}", flush=True)

    for i in range(OLD):
        append("ab"[i % 2], f"old{i}", 700)
    s.commit_offset(model.QueueId.lmq("P", "a"), "g", 3)
    s.commit_offset(model.QueueId.lmq("P", "b"), "g", 2)
    first = s._core.log.active.seq
    rolled = lambda *a: s._core.log.active.seq > first  # noqa: E731 - a hook's condition
    kind, _, step = point.partition(".")
    hooks = {
        "roll.old_synced": (segment.Segment, "create", True, None),
        "roll.created": (segment.Segment, "create", False, None),
        "roll.written": (commitlog.CommitLog, "append", False, rolled),
        "roll.synced": (commitlog.CommitLog, "sync", False, None),
        "roll.indexed": (index.Batch, "write", False, None),
        "retention.runs_dropped": (retention.Retention, "_drop_segment", False, None),
        "retention.forgotten": (commitlog.CommitLog, "drop", True, None),
        "retention.unlinked": (commitlog.CommitLog, "drop", False, None),
        "delete.tombstone_synced": (meta.Meta, "drop_consumer_state", True, None),
        "delete.meta_dropped": (meta.Meta, "drop_consumer_state", False, None),
    }
    owner, attr, before, when = hooks[point]
    if kind == "roll":  # the next append does not fit in the active segment
        room = SEGMENT_BYTES - s._core.log.active.size
        wrap(owner, attr, before=before, when=when or (lambda *a: True))
        append("a", "new", min(max(room, 700), SEGMENT_BYTES - 300))
    elif kind == "retention":
        clock.advance(120_000)
        append("a", "fresh", 10)
        wrap(owner, attr, before=before, when=when or (lambda *a: True))
        s.apply_retention()
    else:
        wrap(owner, attr, before=before, when=when or (lambda *a: True))
        s.delete_lite_topic("P", "b")
    print("alive", step, flush=True)


if __name__ == "__main__":
    main()
