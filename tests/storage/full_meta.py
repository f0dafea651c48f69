"""A broker whose ``meta/`` is a small tmpfs that fills up, for test_full_disk.py (run as a script inside a
private mount namespace, never collected). Prints one JSON object of what it observed."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from lmq_broker import app, config, errors, model
from lmq_broker.storage import meta as meta_store

META_FS_BYTES = 16 * 1024 * 1024


async def main(data_dir: Path) -> dict[str, object]:
    meta = data_dir / "meta"
    meta.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={META_FS_BYTES}", "tmpfs", str(meta)], check=True)
    cfg = config.BrokerConfig(
        store=config.StoreConfig(data_dir=data_dir), host="127.0.0.1", port=0, metrics_port=-1, bootstrap=False
    )
    broker = app.Broker(cfg)
    await broker.start()
    store, dispatcher = broker.store, broker.dispatcher
    assert store is not None and dispatcher is not None
    out: dict[str, object] = {}
    queue = model.QueueId("orders", 0)
    store.put_parent_topic(model.ParentTopic("orders", model.MessageType.NORMAL))
    store.append([model.NewMessage(message_id=f"m{i}", topic="orders", body=b"x", queues=(queue,)) for i in range(10)])
    store.commit_offset(queue, "g", 1)
    out["ready_before"] = broker._http_answer("/readyz")[0]
    filler = meta / "filler"
    with filler.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as e:
            out["fill_errno"] = e.errno
    failed_at = None
    for i in range(2, 100_000):
        try:
            store.commit_offset(queue, "g", i % 10)
        except errors.StorageError as e:
            failed_at, out["error"] = i, e.message
            break
    out["failed_after_commits"] = failed_at
    code, _, body = broker._http_answer("/readyz")
    out["ready_while_full"], out["ready_body_while_full"] = code, body.decode()
    try:
        store.commit_offset(queue, "g", 7)
        out["commit_while_full"] = "ok"
    except errors.StorageError:
        out["commit_while_full"] = "refused"
    # While the disk stays full the store's retrier closes and reopens meta/ (read-write fails, read-only
    # serves): reads of offsets and metadata keep working, and readiness answers without doing I/O.
    time.sleep(2.5 * meta_store.META_RETRY_S)
    try:
        out["offset_while_full"] = store.get_offset(queue, "g")
        out["topics_while_full"] = [t.name for t in store.list_parent_topics()]
        out["messages_while_full"] = len(store.read(queue, 0, 32))
    except errors.StorageError as e:
        out["read_error_while_full"] = e.message
    started = time.perf_counter()
    out["ready_still_full"] = broker._http_answer("/readyz")[0]
    out["readyz_ms"] = (time.perf_counter() - started) * 1000
    filler.unlink()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and broker._http_answer("/readyz")[0] != "200 OK":
        await asyncio.sleep(0.1)
    out["ready_after_space_returns"] = broker._http_answer("/readyz")[0]
    store.commit_offset(queue, "g", 9)
    out["offset_after"] = store.get_offset(queue, "g")
    await broker.stop(grace_s=0.1)
    reopened = app.Broker(cfg)
    await reopened.start()
    assert reopened.store is not None
    out["offset_after_restart"] = reopened.store.get_offset(queue, "g")
    await reopened.stop(grace_s=0.1)
    return out


if __name__ == "__main__":
    result = asyncio.run(main(Path(sys.argv[1])))
    print(json.dumps(result), flush=True)
    os._exit(0)
