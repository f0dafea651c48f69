"""Crash safety: SIGKILL a writer at random points, many times; every append it reported durable survives."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from lmq_broker import config, model
from lmq_broker.storage import recovery
from lmq_broker.storage import store as store_mod

WRITER = Path(__file__).with_name("crash_writer.py")
KILLS = 30
VERIFY_EVERY = 5  # in between, the next writer recovers from the previous crash by itself


@dataclass(frozen=True)
class Ack:
    message_id: str
    parent_offset: int
    lite: str
    lmq_offset: int
    crc: int


def run_and_kill(data_dir: Path, run: int, acks_before_kill: int) -> tuple[list[Ack], int]:
    """Start a writer, let it acknowledge at least ``acks_before_kill`` messages, SIGKILL it mid-stream.

    Returns the acknowledged messages and how many records the writer re-indexed when it started (records
    its predecessor had logged but not yet indexed when it was killed)."""
    proc = subprocess.Popen(
        [sys.executable, str(WRITER), str(data_dir), str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None
    lines: list[bytes] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if len(lines) >= acks_before_kill:
                break
        proc.send_signal(signal.SIGKILL)
        rest = proc.stdout.read()  # acknowledged lines already in the pipe count too
    finally:
        proc.kill()
        _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err.decode()
    lines.extend(rest.splitlines(keepends=True))
    acks = []
    for line in lines:
        if not line.endswith(b"\n"):
            continue  # cut mid-print: the append returned, but checking fewer acks is always safe
        mid, poff, lite, loff, crc = line.split()
        acks.append(Ack(mid.decode(), int(poff), lite.decode(), int(loff), int(crc)))
    reindexed = sum(int(w.split(b"=")[1]) for w in err.split() if w.startswith(b"reindexed="))
    return acks, reindexed


def verify(data_dir: Path, acked: list[Ack]) -> recovery.RecoveryReport:
    cfg = config.StoreConfig(data_dir=data_dir, segment_max_bytes=64 * 1024)
    store = store_mod.open_store(cfg)
    try:
        parent = {m.offset: m for m in store.read(model.QueueId("P", 0), 0, 1_000_000)}
        by_lite = {
            lite: {m.offset: m for m in store.read(model.QueueId.lmq("P", lite), 0, 1_000_000)}
            for lite in {a.lite for a in acked}
        }
        for a in acked:
            got = parent.get(a.parent_offset)
            assert got is not None, f"acknowledged {a.message_id} lost from the parent queue"
            assert (got.message_id, zlib.crc32(got.body)) == (a.message_id, a.crc)
            got = by_lite[a.lite].get(a.lmq_offset)
            assert got is not None, f"acknowledged {a.message_id} lost from its lite topic"
            assert got.message_id == a.message_id
        # offsets stayed dense: no offset handed out twice, none skipped
        assert sorted(parent) == list(range(min(parent, default=0), max(parent, default=-1) + 1))
        return store.recovery
    finally:
        store.close()


@pytest.mark.slow
def test_sigkill_at_random_points_loses_no_acknowledged_append(tmp_path: Path) -> None:
    rng = random.Random(20_240_601)
    data_dir = tmp_path / "data"
    acked: list[Ack] = []
    reindexed = 0
    for run in range(KILLS):
        acks, n = run_and_kill(data_dir, run, rng.randint(1, 400))
        acked.extend(acks)
        reindexed += n
        if run % VERIFY_EVERY == VERIFY_EVERY - 1:
            reindexed += verify(data_dir, acked).records_reindexed
    verify(data_dir, acked)
    assert len({a.message_id for a in acked}) == len(acked) > KILLS
    print(f"{KILLS} kills, {len(acked)} acknowledged appends checked, {reindexed} records re-indexed at restarts")
