"""A snapshot taken while writers append and commit opens as a store holding every append and commit that
returned before it was taken, with nothing to replay (the index checkpoint is the copied log's end)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from lmq_broker import config, model
from lmq_broker.storage import snapshots
from lmq_broker.storage import store as store_mod


def _copy(snap: snapshots.Snapshot, target: Path) -> None:
    for f in snap.files:
        path = target / f.name
        path.parent.mkdir(parents=True, exist_ok=True)
        with f.source.open("rb") as src:
            path.write_bytes(src.read(f.size))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_snapshot_under_writes_keeps_every_acknowledged_append_and_commit(tmp_path: Path, mode: str) -> None:
    cfg = config.StoreConfig.model_validate(
        {"data_dir": tmp_path / "data", "flush_mode": mode, "segment_max_bytes": 64 * 1024}
    )
    s = store_mod.open_store(cfg)
    lites = [f"l{i}" for i in range(4)]
    queues = [model.QueueId.lmq("P", lite) for lite in lites]
    done: dict[model.QueueId, list[int]] = {q: [] for q in queues}
    committed: dict[model.QueueId, int] = {}
    stop = threading.Event()
    appended = threading.Event()

    def write() -> None:
        n = 0
        while not stop.is_set() and n < 100_000:
            q, lite = queues[n % len(queues)], lites[n % len(queues)]
            [res] = s.append([model.NewMessage(f"m{n}", "P", b"x" * 700, (q,), lite_topic=lite)])
            done[q].append(res.offsets[q])
            if len(done[q]) % 3 == 0:
                s.commit_offset(q, "g", done[q][-1] // 2)
                committed[q] = done[q][-1] // 2
            n += 1
            if n == 400:
                appended.set()
        appended.set()  # (also when an append failed: the test then fails on what is missing)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert appended.wait(30)
        before = {q: list(v) for q, v in done.items()}
        commits_before = dict(committed)
        snap = s.snapshot(tmp_path / "staging")
        stop.set()
        writer.join()
        assert len(snap.log_end) == 2 and any(f.name.startswith("commitlog/") for f in snap.files)
        assert sum(f.name.startswith("commitlog/") for f in snap.files) > 1  # several segments (64 KiB each)
        _copy(snap, tmp_path / "restored")
    finally:
        stop.set()
        writer.join()
        s.close()
    r = store_mod.open_store(cfg.model_copy(update={"data_dir": tmp_path / "restored"}))
    try:
        assert r.recovery.records_reindexed == 0 and not r.recovery.rebuilt
        for q, offsets in before.items():
            got = {m.offset for m in r.read(q, 0, 100_000)}
            assert set(offsets) <= got, f"{q}: acknowledged appends missing after restore"
            assert (r.get_offset(q, "g") or 0) >= commits_before.get(q, 0)
    finally:
        r.close()
