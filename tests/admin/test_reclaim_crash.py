"""kill -9 of a broker process in the middle of a CompareAndDeleteLiteTopics (the reclaimer's delete), on its
real store: at restart every lite topic is either whole (index entry, message, the group's commit point) or
wholly gone (none of them, and a send re-creates it from offset 0), the lite-topic count is the topics there,
and the same request sent again deletes the rest and finds the others gone."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import grpc
from waiting import eventually

from lmq_broker import errors, model
from lmq_broker.admin.client import AdminClient, DeleteOutcome
from lmq_broker.config import FlushMode, StoreConfig
from lmq_broker.storage import store as lmq_store
from lmq_broker.storage.api import Store
from lmq_broker.testing import start_broker

PARENT, GROUP = "P", "G"
TOPICS = 20_000
ARGS = ["--no-bootstrap", "--flush-mode", "sync", "--lite-ttl-interval-ms", "0", "--admin-anonymous"]


def lite(i: int) -> str:
    return f"t{i:05d}"


def fill(data_dir: Path) -> None:
    store = lmq_store.open_store(StoreConfig(data_dir=data_dir, flush_mode=FlushMode.ASYNC))
    try:
        store.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE, expiration_minutes=0))
        store.put_group(model.LiteGroup(GROUP, PARENT))
        for start in range(0, TOPICS, 1000):
            names = [lite(i) for i in range(start, start + 1000)]
            store.append([message(name, f"old-{name}") for name in names])
            store.commit_offsets([(model.QueueId.lmq(PARENT, name), GROUP, 1) for name in names])
        store.flush()
    finally:
        store.close()


def message(name: str, message_id: str) -> model.NewMessage:
    return model.NewMessage(
        message_id=message_id,
        topic=PARENT,
        body=message_id.encode(),
        queues=(model.QueueId.lmq(PARENT, name),),
        lite_topic=name,
        message_type=model.MessageType.LITE,
    )


def columns_of(admin: AdminClient) -> dict[str, list[Any]]:
    joined: dict[str, list[Any]] = {}
    for batch in admin.scan_lite_topics_columns(PARENT, batch_size=10_000):
        for name, values in batch.items():
            joined.setdefault(name, []).extend(values)
    return joined


def count(admin: AdminClient) -> int:
    return next(p.lite_topic_count for p in admin.list_parent_topics() if p.topic.name == PARENT)


def whole_or_gone(store: Store, name: str) -> bool:
    queue = model.QueueId.lmq(PARENT, name)
    meta = store.lite_topic(PARENT, name)
    stored = [m.message_id for m in store.read(queue, 0, 10)]
    committed = store.get_offset(queue, GROUP)
    if meta is None:
        return stored == [] and committed is None and store.queue_offsets(queue) == (0, 0)
    return meta.max_offset == 1 and stored == [f"old-{name}"] and committed == 1


def test_kill_9_in_the_middle_of_a_reclaim_leaves_every_topic_whole_or_gone(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    fill(data_dir)
    broker = start_broker(data_dir, extra_args=ARGS)
    try:
        with AdminClient(broker.admin_endpoint, 60.0) as admin:
            columns = columns_of(admin)
            assert len(columns["lite"]) == TOPICS
            deleting = threading.Thread(target=_delete_until_killed, args=(broker.admin_endpoint, columns))
            deleting.start()
            eventually(lambda: count(admin) < TOPICS, "the delete under way", interval_s=0.005)
        broker.kill()
        deleting.join(60)
    finally:
        broker.stop()

    store = lmq_store.open_store(StoreConfig(data_dir=data_dir, flush_mode=FlushMode.SYNC))
    try:
        there = [m.lite for m in store.scan_lite_topics(PARENT, limit=TOPICS)]
        assert 0 < len(there) < TOPICS, "the kill did not land in the middle of the delete"
        assert store.lite_topic_count(PARENT) == len(there)
        assert [name for name in map(lite, range(TOPICS)) if not whole_or_gone(store, name)] == []
        gone = next(name for name in map(lite, range(TOPICS)) if name not in set(there))
        (result,) = store.append([message(gone, "new")])
        assert result.queue_offsets == (0,)  # re-created from offset 0, no commit point hiding it
        assert store.get_offset(model.QueueId.lmq(PARENT, gone), GROUP) is None
    finally:
        store.close()

    broker = start_broker(data_dir, extra_args=ARGS)
    try:
        with AdminClient(broker.admin_endpoint, 60.0) as admin:
            outcomes = admin.compare_and_delete(columns, require_no_subscribers=False)
            expected = [
                DeleteOutcome.DELETED if name in set(there) and name != gone else
                DeleteOutcome.KEPT_CHANGED if name == gone else DeleteOutcome.NOT_FOUND
                for name in columns["lite"]
            ]  # fmt: skip
            assert outcomes == expected
            assert count(admin) == 1  # the re-created one
    finally:
        broker.stop()


def _delete_until_killed(endpoint: str, columns: dict[str, list[Any]]) -> None:
    try:
        with AdminClient(endpoint, 60.0) as admin:
            admin.compare_and_delete(columns, require_no_subscribers=False)
    except (errors.LmqError, grpc.RpcError):  # the broker is killed under it: expected, not looked at
        return
