"""The in-broker expiry of idle lite topics, on a real broker process, with the official client producing and
consuming: with a short minimum age and a parent expiration of 0 minutes, a topic nobody touches disappears
(DescribeLiteTopic and ``lmq-admin`` say so) while a busy one and one of a never-expiring parent stay."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rocketmq import ClientConfiguration, Credentials, LitePushConsumer, Message, Producer
from waiting import eventually

from lmq_broker import errors, model
from lmq_broker.admin import cli
from lmq_broker.admin.client import AdminClient
from lmq_broker.testing import BrokerProcess, Inbox, start_broker

MIN_AGE_MS = 3000  # a topic idle this long expires (the parent's expiration is 0 minutes)
BUSY_EVERY_S = 0.3
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    flags = ["--lite-ttl-interval-ms", "250", "--lite-ttl-min-age-ms", str(MIN_AGE_MS), "--lite-ttl-batch", "2"]
    flags += ["--lite-ttl-cpu-share", "0"]  # the rule is tested here; the pacing's longer pauses, in test_expiry
    process = start_broker(tmp_path_factory.mktemp("ttl") / "data", extra_args=flags)
    yield process
    assert process.stop() == 0, process.log()[-4000:]


def send(producer: Any, topic: str, lite: str, body: bytes) -> None:
    message = Message()
    message.topic, message.lite_topic, message.body = topic, lite, body
    producer.send(message)


def gone(admin: AdminClient, parent: str, lite: str) -> bool:
    try:
        admin.describe_lite_topic(parent, lite)
    except errors.NotFound:
        return True
    return False


def metric(broker: BrokerProcess, name: str) -> float:
    with urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found is not None, f"{name} not exported"
    return float(found.group(1))


def lmq_admin(broker: BrokerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, cli.ENDPOINT_ENV: broker.admin_endpoint, **broker.admin_env()}
    return subprocess.run(
        [sys.executable, "-m", "lmq_broker.admin.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_an_idle_lite_topic_expires_in_the_broker_while_busy_ones_stay(
    broker: BrokerProcess, admin: AdminClient, clients: list[Any], tmp_path: Path
) -> None:
    admin.put_parent_topic(model.ParentTopic("Sessions", model.MessageType.LITE, expiration_minutes=0))
    admin.put_parent_topic(model.ParentTopic("Forever", model.MessageType.LITE))
    admin.put_group(model.LiteGroup("workers", "Sessions"))
    config = ClientConfiguration(broker.endpoint, Credentials(), request_timeout=5)
    producer = Producer(config, ("Sessions", "Forever"))
    producer.startup()
    clients.append(producer)
    inbox = Inbox()
    consumer = LitePushConsumer(config, "workers", "Sessions", inbox)
    consumer.startup()
    clients.append(consumer)
    for lite in ("idle-0", "idle-1", "idle-2", "busy"):
        consumer.subscribe_lite(lite)
    for lite in ("idle-0", "idle-1", "idle-2", "busy"):
        send(producer, "Sessions", lite, f"{lite}/first".encode())
    send(producer, "Forever", "idle-forever", b"kept")
    assert inbox.wait_for(lambda i: len(i.accepted) >= 4, 30), f"got {len(inbox.accepted)} of 4"

    deadline = time.monotonic() + DEADLINE_S
    sent = 0
    while not all(gone(admin, "Sessions", f"idle-{i}") for i in range(3)):
        assert time.monotonic() < deadline, f"idle topics still there; broker log:\n{broker.log()[-3000:]}"
        send(producer, "Sessions", "busy", f"busy/{sent}".encode())
        sent += 1
        time.sleep(BUSY_EVERY_S)

    busy = admin.describe_lite_topic("Sessions", "busy")
    assert busy.meta.max_offset == sent + 1  # every message the busy topic was sent is still there
    assert admin.describe_lite_topic("Forever", "idle-forever").meta.max_offset == 1
    assert inbox.wait_for(lambda i: len(i.accepted) >= 4 + sent, 30)
    # counted as each step ends, just after its deletes: a read of the store can come between the two
    eventually(lambda: metric(broker, "lmq_lite_ttl_deleted_total") == 3, "the deletes counted", 10)
    assert metric(broker, "lmq_lite_ttl_deleted_total") == 3  # and no more
    eventually(lambda: metric(broker, "lmq_lite_ttl_pass_duration_seconds_count") >= 1, "a pass timed", 10)
    assert "lite-topic expiry:" in broker.log()  # the pass summary line

    shown = lmq_admin(broker, "lite-topic", "describe", "Sessions", "idle-0")
    assert shown.returncode == 1 and "NotFound" in shown.stderr, shown
    listed = lmq_admin(broker, "-o", "json", "lite-topic", "list", "Sessions")
    assert listed.returncode == 0, listed.stderr
    assert '"busy"' in listed.stdout and "idle-" not in listed.stdout

    # A producer that sends again re-creates an expired topic; the consumer's periodic full sync re-subscribes.
    send(producer, "Sessions", "idle-0", b"idle-0/again")
    assert admin.describe_lite_topic("Sessions", "idle-0").meta.max_offset == 1
