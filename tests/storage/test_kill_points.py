"""kill -9 at each step of a segment roll, a retention pass and a lite-topic delete (real processes, files and
RocksDB; ``kill_points.py`` is the writer). Whatever step the process dies at, the next open keeps every
acknowledged message at its offset, offsets stay dense, the interrupted write is there once or not at all,
a retired segment is not reported lost, and a deleted topic stays deleted with its offsets."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from lmq_broker import config, model
from lmq_broker.storage import store as store_mod
from lmq_broker.storage.memory import ManualClock

WRITER = Path(__file__).with_name("kill_points.py")
POINTS = [
    "roll.old_synced",
    "roll.created",
    "roll.written",
    "roll.synced",
    "roll.indexed",
    "retention.runs_dropped",
    "retention.forgotten",
    "retention.unlinked",
    "delete.tombstone_synced",
    "delete.meta_dropped",
]
A, B = model.QueueId.lmq("P", "a"), model.QueueId.lmq("P", "b")


def run_and_kill(data_dir: Path, point: str) -> dict[str, tuple[str, int]]:
    proc = subprocess.run(
        [sys.executable, str(WRITER), str(data_dir), point], capture_output=True, text=True, timeout=60, check=False
    )
    assert "alive" not in proc.stdout, f"{point} was never reached"
    assert proc.returncode == -9, proc.stderr
    acks = [line.split() for line in proc.stdout.splitlines() if line.startswith("ack ")]
    return {mid: (lite, int(offset)) for _, mid, lite, offset in acks}


@pytest.mark.parametrize("point", POINTS)
def test_a_kill_9_at_any_step_loses_nothing_acknowledged_and_duplicates_nothing(
    tmp_path: Path, point: str, caplog: pytest.LogCaptureFixture
) -> None:
    data_dir = tmp_path / "data"
    acked = run_and_kill(data_dir, point)
    cfg = config.StoreConfig(data_dir=data_dir, segment_max_bytes=4096, retention_max_age_ms=60_000)
    with caplog.at_level(logging.WARNING, logger="lmq_broker"):
        s = store_mod.open_store(cfg, ManualClock(ManualClock().now_ms + 120_000))
    try:
        assert s.recovery.lost_entries == 0 and s.damage.total("lost") == 0  # a retired segment is not lost
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
        queues = {"a": A, "b": B}
        seen: dict[str, list[tuple[int, str]]] = {}
        for lite, q in queues.items():
            lo, hi = s.queue_offsets(q)
            got, end = s.read_span(q, 0, 1000)
            assert end == hi and [m.offset for m in got] == list(range(lo, hi)), (lite, lo, hi)  # dense
            seen[lite] = [(m.offset, m.message_id) for m in got]
        ids = [mid for rows in seen.values() for _, mid in rows]
        assert len(ids) == len(set(ids))  # nothing twice
        kind = point.partition(".")[0]
        for mid, (lite, offset) in acked.items():
            lo = s.queue_offsets(queues[lite])[0]
            if offset >= lo and not (kind == "delete" and lite == "b"):  # below the min: retired by retention
                assert (offset, mid) in seen[lite], (mid, lite, offset)
        assert s.get_offset(A, "g") == 3
        if kind == "delete":  # the tombstone was fsynced: the delete is done, offsets included
            assert s.lite_topic("P", "b") is None and s.get_offset(B, "g") is None
            [r] = s.append([model.NewMessage("again", "P", b"x", (B,), lite_topic="b")])
            assert r.offsets[B] == 0
        else:
            assert s.get_offset(B, "g") == 2
        if kind == "retention":
            s.apply_retention()  # the interrupted pass is finished
            assert s.queue_offsets(A)[0] > 0
        [r] = s.append([model.NewMessage("after", "P", b"x", (A,), lite_topic="a")])
        assert r.offsets[A] == s.queue_offsets(A)[1] - 1 == (seen["a"][-1][0] + 1 if seen["a"] else 0)
    finally:
        s.close()
