"""``lmq-admin backup`` against a real broker process and ``lmq-admin restore`` of what it wrote: the metadata
and credentials come back, and every snapshot that is partial, altered, of a newer format or aimed at a
non-empty or live data directory is refused with a clear line, leaving the target as it was."""

from __future__ import annotations

import io
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from durability import fsyncs
from waiting import eventually

from lmq_broker import errors, model
from lmq_broker.admin import cli, restoring
from lmq_broker.admin.client import AdminClient
from lmq_broker.config import StoreConfig
from lmq_broker.storage import markers
from lmq_broker.storage import store as storage_store
from lmq_broker.testing import BrokerProcess, start_broker


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    process = start_broker(tmp_path / "data", extra_args=["--no-bootstrap", "--mqtt-port", "0"])
    yield process
    if process.alive():
        process.stop()
    if process.process.stdout is not None:
        process.process.stdout.close()


def _admin(broker: BrokerProcess, *args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    keys = broker.admin_keys
    flags = ["--endpoint", broker.admin_endpoint, "--access-key", keys["access_key"], "--secret-key"]
    code = cli.main([*flags, keys["secret_key"], *args], out, err)
    return code, out.getvalue(), err.getvalue()


def _restore(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["restore", *args], out, err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def snapshot(broker: BrokerProcess, tmp_path: Path) -> Path:
    """A snapshot of a broker holding a parent topic and a group, taken with ``lmq-admin backup``; the broker
    is stopped afterwards."""
    with AdminClient(broker.admin_endpoint, **broker.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic("P", model.MessageType.LITE))
        admin.put_group(model.LiteGroup("G", "P"))
    code, out, err = _admin(broker, "-o", "json", "backup", str(tmp_path / "snap"))
    assert code == 0, err
    summary = json.loads(out)
    assert summary["files"] >= 4 and summary["bytes"] > 0
    assert "commitlog/0000000000.log" in err and "meta/CURRENT" in err  # a progress line per file
    assert not (broker.data_dir / "backup-staging").exists()  # the staging links went with the stream
    with urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=10) as answer:
        assert 'lmq_backups_total{outcome="done"} 1.0' in answer.read().decode()
    broker.stop()
    return tmp_path / "snap"


def test_restore_brings_metadata_and_credentials_back(snapshot: Path, tmp_path: Path) -> None:
    manifest = restoring.read_manifest(snapshot)
    names = {f["path"] for f in manifest["files"]}
    assert {"admin-credentials.json", "mqtt.sqlite3", "meta/CURRENT", "index/CURRENT"} <= names
    code, _out, err = _restore(str(snapshot), "--data-dir", str(tmp_path / "restored"), "--quiet")
    assert code == 0, err
    assert (tmp_path / "restored" / "admin-credentials.json").stat().st_mode & 0o777 == 0o600
    restored = start_broker(tmp_path / "restored", extra_args=["--no-bootstrap"])
    try:
        with AdminClient(restored.admin_endpoint, **restored.admin_keys) as admin:
            assert admin.get_group("G").group.bind_topic == "P"
            # P, and the default parent the MQTT listener made at start (docs/mqtt.md, "Topic mapping")
            assert [t.topic.name for t in admin.list_parent_topics()] == ["P", "mqtt-default"]
    finally:
        restored.stop()


def test_a_restore_is_durable_once_it_returns(snapshot: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The data directory is fsynced after the restored files were moved into it: a power cut right after the
    restore returned leaves them there, not part of them in the staging directory."""
    target = tmp_path / "restored"
    with fsyncs(monkeypatch) as synced:
        restoring.restore(snapshot, target)
    assert synced[-1] == Path(f"{target}/")


def test_a_backup_cut_off_midway_has_no_manifest_and_is_refused(broker: BrokerProcess, tmp_path: Path) -> None:
    def stop_after_first(name: str, files: int, total: int) -> None:
        raise KeyboardInterrupt  # the operator pressed ^C after the first file

    with AdminClient(broker.admin_endpoint, **broker.admin_keys) as admin:
        with pytest.raises(KeyboardInterrupt):
            admin.backup(tmp_path / "partial", progress=stop_after_first)
        assert not (tmp_path / "partial" / restoring.MANIFEST).exists()
        eventually(  # the broker lets go of the first one once it sees the call cancelled
            lambda: admin.backup(tmp_path / f"next-{time.monotonic_ns()}") or True,
            "the cut-off backup let go of the broker",
            ignoring=(errors.Conflict,),
            interval_s=0.05,
        )
    code, _, err = _restore(str(tmp_path / "partial"), "--data-dir", str(tmp_path / "target"))
    assert code == cli.EXIT_FAILED
    assert "no manifest.json: not a complete snapshot" in err
    assert not (tmp_path / "target").exists()


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_an_altered_snapshot_is_refused_and_the_target_left_alone(snapshot: Path, tmp_path: Path, damage: str) -> None:
    largest = max(restoring.read_manifest(snapshot)["files"], key=lambda f: int(f["size"]))
    segment = snapshot / largest["path"]
    data = bytearray(segment.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        segment.write_bytes(bytes(data))
    elif damage == "truncate":
        segment.write_bytes(bytes(data[:-1]))
    else:
        segment.unlink()
    code, _, err = _restore(str(snapshot), "--data-dir", str(tmp_path / "target"))
    assert code == cli.EXIT_FAILED
    assert largest["path"] in err and ("does not match its manifest" in err or "is missing" in err)
    assert not (tmp_path / "target").exists()


def test_a_damaged_manifest_is_refused_with_a_line_and_the_target_left_alone(snapshot: Path, tmp_path: Path) -> None:
    """A manifest that parses but is not one (a list, no files, a file entry without its size, a duplicate path,
    a taken_ms that is no number) is refused before any file is copied: before 2026-11-30 these ended in a Python
    traceback, and the last one after the data directory had been replaced."""
    good = json.loads((snapshot / restoring.MANIFEST).read_text())
    first = good["files"][0]
    damaged: list[object] = [
        good["files"],
        {**good, "files": None},
        {k: v for k, v in good.items() if k != "files"},
        {**good, "files": [1]},
        {**good, "files": [{"path": first["path"], "sha256": first["sha256"]}]},
        {**good, "files": [first, first]},
        {**good, "files": [{**first, "size": -1}]},
        {**good, "taken_ms": "yesterday"},
    ]
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    for manifest in damaged:
        (snapshot / restoring.MANIFEST).write_text(json.dumps(manifest))
        code, _, err = _restore(str(snapshot), "--data-dir", str(target), "--force", "--quiet")
        assert code == cli.EXIT_FAILED, manifest
        assert "manifest.json is" in err and "Traceback" not in err, err
        assert [p.name for p in target.iterdir()] == ["keep.txt"], manifest


def test_a_snapshot_inside_the_data_directory_is_not_restored_over_itself(snapshot: Path, tmp_path: Path) -> None:
    """``lmq-admin backup data/snap`` on the broker's host, then ``restore data/snap --data-dir data --force``:
    before 2026-11-30 the restore emptied the data directory, the snapshot with it, after copying it. Refused,
    the snapshot and the directory left as they were (and a data directory inside the snapshot too)."""
    data = tmp_path / "data"
    inside = data / "snap"
    snapshot.rename(inside)
    files = sorted(p.name for p in data.iterdir())
    for args in ([str(inside), "--data-dir", str(data)], [str(inside), "--data-dir", str(inside / "sub")]):
        code, _, err = _restore(*args, "--force", "--quiet")
        assert code == cli.EXIT_FAILED and "overlap" in err, err
        assert sorted(p.name for p in data.iterdir()) == files
        restoring.read_manifest(inside)  # still whole
    assert not (inside / "sub").exists()


def test_a_restore_cut_off_while_moving_files_in_is_not_opened_half_done(
    snapshot: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore cut off (a crash, a power cut) after it removed the old contents and moved some of the restored
    files in leaves a marker the store refuses to open (before 2026-11-30 a broker started on such a directory
    with, say, its commit log and no meta); the same restore run again completes it."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "old.txt").write_text("old")
    moved: list[Path] = []
    rename = Path.rename

    def cut_after_one(self: Path, to: Path) -> Path:
        if moved:
            raise OSError("the host lost power")
        moved.append(to)
        return rename(self, to)

    with monkeypatch.context() as patched:
        patched.setattr(Path, "rename", cut_after_one)
        code, _, err = _restore(str(snapshot), "--data-dir", str(target), "--force", "--quiet")
    assert code == cli.EXIT_FAILED and "the host lost power" in err
    assert len(moved) == 1 and not (target / "old.txt").exists()
    with pytest.raises(errors.StorageError, match="restore that did not finish"):
        storage_store.open_store(StoreConfig(data_dir=target))
    code, _, err = _restore(str(snapshot), "--data-dir", str(target), "--force", "--quiet")
    assert code == 0, err
    assert not (target / markers.RESTORE_MARKER).exists()
    store = storage_store.open_store(StoreConfig(data_dir=target))
    try:
        assert store.get_group("G") is not None
    finally:
        store.close()


def test_non_empty_target_newer_format_and_a_live_broker_are_refused(snapshot: Path, tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    code, _, err = _restore(str(snapshot), "--data-dir", str(target))
    assert code == cli.EXIT_FAILED and "is not empty" in err and "--force" in err
    assert (target / "keep.txt").read_text() == "mine"

    live = start_broker(tmp_path / "live", extra_args=["--no-bootstrap"])
    try:
        code, _, err = _restore(str(snapshot), "--data-dir", str(tmp_path / "live"), "--force")
        assert code == cli.EXIT_FAILED and "in use by a running broker" in err
    finally:
        live.stop()
    code, _, err = _restore(str(snapshot), "--data-dir", str(tmp_path / "live"), "--force", "--quiet")
    assert code == 0, err  # stopped: --force replaces its contents

    manifest = json.loads((snapshot / restoring.MANIFEST).read_text())
    manifest["format"] = restoring.FORMAT + 1
    (snapshot / restoring.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(errors.UnsupportedVersion, match="newer than this lmq-admin reads"):
        restoring.restore(snapshot, tmp_path / "other")


def test_a_backup_into_a_non_empty_directory_is_refused(broker: BrokerProcess, tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    code, _, err = _admin(broker, "backup", str(tmp_path / "full"))
    assert code == cli.EXIT_FAILED and "is not empty" in err


def test_a_restored_store_is_a_new_source_of_relocated_offsets(broker: BrokerProcess, tmp_path: Path) -> None:
    """A store restored from a backup may number new messages with offsets its first life used after the
    backup was taken; a remaining broker that took a scale-down's copy of those (``StoreRelocated``, kept per
    source store) would pass the new messages over as already held. So each restore gets an id of its own, and
    the store's id includes it: the original and every restore of one snapshot are different sources."""
    broker.stop()
    store = storage_store.open_store(StoreConfig(data_dir=broker.data_dir))
    try:
        original = store.store_id()  # what a cluster member asks for at its start
    finally:
        store.close()
    again = start_broker(broker.data_dir, extra_args=["--no-bootstrap", "--mqtt-port", "0"])
    try:
        code, _out, err = _admin(again, "backup", str(tmp_path / "snap"))
        assert code == 0, err
    finally:
        again.stop()
    ids = []
    for name in ("first", "second"):
        restoring.restore(tmp_path / "snap", tmp_path / name)
        store = storage_store.open_store(StoreConfig(data_dir=tmp_path / name))
        try:
            ids.append(store.store_id())
            assert store.store_id() == ids[-1]  # kept while it lives
        finally:
            store.close()
    assert all(i.startswith(original + ".") for i in ids) and len(set(ids)) == 2, (original, ids)
