"""A backup taken under official-client load, restored into a fresh data directory, holds every message the
broker acknowledged and every offset the consumers committed before the backup began (docs/backup.md).

The official Python client sends to eight lite topics from a thread and a LitePushConsumer consumes and acks
them, while ``lmq-admin backup`` (a separate process, as an operator runs it) streams the snapshot. Then the
broker stops, ``lmq-admin restore`` writes the snapshot into a new directory and a broker starts there: a new
group reading every lite topic from its start finds each acknowledged body, and the consuming group's
offsets are at least what they were."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from lmq_broker import model
from lmq_broker.admin import cli
from lmq_broker.admin.client import AdminClient, OffsetPolicy, OffsetReset
from lmq_broker.testing import (
    BrokerProcess,
    Inbox,
    send_lite,
    start_broker,
    started_lite_consumer,
    started_producer,
)

PARENT, GROUP, AUDIT = "Orders", "workers", "audit"
LITES = tuple(f"o-{i}" for i in range(8))


def lmq_admin(broker: BrokerProcess | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if broker is not None:
        env |= {cli.ENDPOINT_ENV: broker.admin_endpoint, **broker.admin_env()}
    run = [sys.executable, "-m", "lmq_broker.admin.cli", *args]
    return subprocess.run(run, check=False, capture_output=True, text=True, env=env, timeout=120)


class Load:
    """Sends to the lite topics in turn from a thread; ``sent`` holds the bodies the broker acknowledged."""

    def __init__(self, producer: Any) -> None:
        self._producer = producer
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.sent: list[bytes] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="load")
        self._thread.start()

    def _run(self) -> None:
        n = 0
        try:
            while not self._stop.is_set():
                lite = LITES[n % len(LITES)]
                body = f"{lite}/{n}".encode()
                send_lite(self._producer, PARENT, lite, body)
                with self._lock:
                    self.sent.append(body)
                n += 1
        except BaseException as exc:
            self.error = exc

    def acked(self) -> list[bytes]:
        with self._lock:
            return list(self.sent)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        assert self.error is None, self.error


def committed(admin: AdminClient, group: str) -> dict[str, int]:
    return {lite: admin.describe_lite_topic(PARENT, lite).group_offsets.get(group, 0) for lite in LITES}


def test_a_snapshot_taken_under_load_restores_every_acked_message_and_committed_offset(tmp_path: Path) -> None:
    broker = start_broker(tmp_path / "data")
    clients: list[Any] = []
    try:
        with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
            admin.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
            admin.put_group(model.LiteGroup(GROUP, PARENT))
            admin.put_group(model.LiteGroup(AUDIT, PARENT))
            inbox = Inbox()
            consumer = started_lite_consumer(broker, clients, GROUP, PARENT, inbox)
            for lite in LITES:
                consumer.subscribe_lite(lite)
            load = Load(started_producer(broker, clients, PARENT))
            try:
                assert inbox.wait_for(lambda i: len(i.accepted) >= 200, 60), f"consumed {len(inbox.accepted)}"
                acked_before = load.acked()
                offsets_before = committed(admin, GROUP)
                backup = lmq_admin(broker, "-o", "json", "backup", str(tmp_path / "snap"))
                sent_during = len(load.acked()) - len(acked_before)
            finally:
                load.stop()
        assert backup.returncode == 0, backup.stderr
        assert sent_during > 0, "no send completed while the backup ran: not taken under load"
        assert sum(offsets_before.values()) > 0, "no offset committed before the backup"
        print(f"backup: {json.loads(backup.stdout)}; {sent_during} sends completed while it ran")
    finally:
        for client in reversed(clients):
            client.shutdown()
        broker.stop()

    restore = lmq_admin(None, "restore", str(tmp_path / "snap"), "--data-dir", str(tmp_path / "restored"))
    assert restore.returncode == 0, restore.stderr
    restored = start_broker(tmp_path / "restored")
    clients = []
    try:
        with AdminClient(restored.admin_endpoint, timeout_s=10, **restored.admin_keys) as admin:
            after = committed(admin, GROUP)
            assert all(after[lite] >= offsets_before[lite] for lite in LITES), (offsets_before, after)
            admin.reset_lite_offsets(AUDIT, LITES, OffsetReset(OffsetPolicy.MIN))
            audit = Inbox()
            consumer = started_lite_consumer(restored, clients, AUDIT, PARENT, audit)
            for lite in LITES:
                consumer.subscribe_lite(lite)
            wanted = set(acked_before)
            found = audit.wait_for(lambda i: wanted <= set(i.bodies()), 90)
            missing = wanted - set(audit.bodies())
            assert found, f"{len(missing)} of {len(wanted)} acknowledged messages missing after restore"
    finally:
        for client in reversed(clients):
            client.shutdown()
        restored.stop()
