"""The meta store's control-plane records on disk: one key per record, ``T``/``G``/``U``/``R`` + name and
``Xmembership``/``Xaccess``, written by any earlier broker. A data dir written that way (raw RocksDB writes here,
as the per-kind methods before ``meta.Table`` wrote them) loads, and what the store writes lands under the
same keys."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Final

from lmq_broker import model
from lmq_broker.storage import keys, meta, rocks
from lmq_broker.storage import store as store_mod

TOPIC: Final = model.ParentTopic("P", expiration_minutes=30, max_lite_topics=1000)
GROUP: Final = model.LiteGroup("G", bind_topic="P", client_quota=5, retry=model.RetryPolicy(3, (10, 20)))
QUOTA: Final = model.Quota("parent:P", max_lite_topics=10, max_send_rate=100)
RUN: Final = model.ReclaimRun("P", "run-1", 1_000, 5_000, scanned=10, expired=4, reclaimed=3)
MEMBERSHIP: Final = '{"members": ["a:1"]}'
ACCESS: Final = '{"users": []}'
ON_DISK: Final = {
    b"TP": keys.encode_parent_topic(TOPIC),
    b"GG": keys.encode_group(GROUP),
    b"Uparent:P": keys.encode_quota(QUOTA),
    b"RP": keys.encode_reclaim_run(RUN),
    b"Xmembership": MEMBERSHIP.encode(),
    b"Xaccess": ACCESS.encode(),
}


def _meta_records(data_dir: Path) -> dict[bytes, bytes]:
    db = rocks.Rocks(data_dir / "meta", 0, read_only=True)
    try:
        return {k: bytes(v) for k, v in db.items(b"", b"\xff") if k[:1] in b"TGUR" or k in ON_DISK}
    finally:
        db.close(flush=False)


def test_records_written_under_the_old_keys_load(open_lmq: Callable[..., store_mod.LmqStore], tmp_path: Path) -> None:
    open_lmq().close()  # a data dir with every marker an open writes
    db = rocks.Rocks(tmp_path / "data" / "meta", meta.META_CACHE_BYTES)
    wb = db.batch()
    for key, value in ON_DISK.items():
        wb.put(key, value)
    db.write_synced(wb)
    db.close()
    store = open_lmq()
    assert (store.list_parent_topics(), store.list_groups(), store.list_quotas()) == ([TOPIC], [GROUP], [QUOTA])
    assert (store.get_parent_topic("P"), store.get_group("G"), store.get_quota("parent:P")) == (TOPIC, GROUP, QUOTA)
    assert (store.get_reclaim_run("P"), store.list_reclaim_runs()) == (RUN, [RUN])
    assert (store.get_membership(), store.get_access()) == (MEMBERSHIP, ACCESS)
    assert store.delete_group("G") is True and store.get_group("G") is None


def test_the_store_writes_records_under_the_same_keys(
    open_lmq: Callable[..., store_mod.LmqStore], tmp_path: Path
) -> None:
    store = open_lmq()
    store.put_parent_topic(TOPIC)
    store.put_group(GROUP)
    store.put_quota(QUOTA)
    store.put_reclaim_run(RUN)
    store.put_membership(MEMBERSHIP)
    store.put_access(ACCESS)
    store.close()
    assert _meta_records(tmp_path / "data") == ON_DISK
