"""Failures with no client to tell are logged and counted (``lmq_mqtt_errors``), and a connection's end never
swallows the cancellation of whoever waits for it (issue 26, item 7)."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import sqlite3
import time
import urllib.request
from pathlib import Path

import pytest

from lmq_broker.mqtt import codec, durable, stats
from lmq_broker.testing import BrokerProcess, start_broker


def errors_counted(broker: BrokerProcess, kind: str) -> float:
    with urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.search(rf'^lmq_mqtt_errors_total\{{kind="{kind}"\}} (\S+)$', text, re.MULTILINE)
    assert found is not None, f"lmq_mqtt_errors_total{{kind={kind}}} not exported"
    return float(found.group(1))


def test_a_session_end_the_store_refuses_is_logged_and_counted(tmp_path: Path) -> None:
    with start_broker(tmp_path / "data", extra_args=["--mqtt-port", "0"]) as broker:
        sock = socket.create_connection(("127.0.0.1", broker.mqtt_port), timeout=10)
        sock.sendall(codec.encode(codec.Connect("persistent", clean_session=False)))
        assert sock.recv(4) == b"\x20\x02\x00\x00"  # CONNACK, accepted, no session yet
        lock = sqlite3.connect(broker.data_dir / durable.FILE_NAME, timeout=0, isolation_level=None)
        lock.execute("BEGIN EXCLUSIVE")  # another writer holds the file: the broker's write fails (busy)
        try:
            sock.close()  # the session's end is to be recorded now
            deadline = time.monotonic() + 20
            while errors_counted(broker, stats.SESSION_EXPIRY_WRITE) < 1:
                assert time.monotonic() < deadline, "the failed write was not counted"
                time.sleep(0.1)
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        assert "persistent: the end of its session not recorded" in broker.log()


def test_waiting_for_a_connection_s_task_never_swallows_a_cancellation() -> None:
    asyncio.run(_cancelled_while_waiting())


async def _cancelled_while_waiting() -> None:
    release = asyncio.Event()

    async def publisher() -> None:
        await release.wait()

    inner = asyncio.get_running_loop().create_task(publisher())
    outer = asyncio.get_running_loop().create_task(stats.wait_ended(inner, "storing", stats.Stats()))
    await asyncio.sleep(0)  # the outer wait is parked on the inner task
    outer.cancel()
    release.set()  # the inner task ends as the cancellation arrives
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert outer.cancelled()
    await inner


def test_a_connection_s_task_that_failed_is_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    async def publisher() -> None:
        raise RuntimeError("disk gone")

    async def end() -> None:
        inner = asyncio.get_running_loop().create_task(publisher())
        await stats.wait_ended(inner, "mqtt client c1: storing what was read", counts)

    counts = stats.Stats()
    with caplog.at_level(logging.ERROR, logger=stats.__name__):
        asyncio.run(end())
    assert counts.errors[stats.CONNECTION_END] == 1
    assert "mqtt client c1: storing what was read failed as the connection ended" in caplog.text
    assert "disk gone" in caplog.text
