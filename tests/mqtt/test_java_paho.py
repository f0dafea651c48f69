"""Eclipse Paho for Java (MQTT 3.1.1 and 5.0 clients, from Maven Central) against a broker process: a client
library of another ecosystem, unchanged. The scenarios run in one JVM (tests/clients/mqtt-java, built by
``make clients`` outside the repo); the program reports what each client received and this module judges it.
A missing build (no JDK, no Maven) fails here: it is never skipped."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest
from testing_clients import DriverMissing, driver_argv

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.testing import BrokerProcess

POINTERS: Final = Path(__file__).resolve().parents[2] / "build" / "clients"
RUN_TIMEOUT_S: Final = 240.0
VERSIONS: Final = ("3.1.1", "5.0")
Report = dict[str, Any]
Reports = dict[tuple[str, str], Report]


@pytest.fixture(scope="module")
def reports(broker: BrokerProcess) -> Iterator[Reports]:
    try:
        argv = driver_argv(POINTERS, "mqtt-java")
    except DriverMissing as missing:
        pytest.fail(str(missing))
    parent = "PJ"
    with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic(parent, model.MessageType.LITE))
    done = subprocess.run(
        [*argv, "--port", str(broker.mqtt_port), "--parent", parent],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert lines[-1] == {"event": "done"}, done.stdout[-2000:]
    yield {(r["version"], r["scenario"]): r | {"parent": parent} for r in lines[:-1]}


def received(report: Report) -> list[tuple[str, str, int, bool]]:
    base = f"{report['parent']}/v{report['version'][0]}"
    return [(r["topic"].removeprefix(base), r["payload"], r["qos"], r["retained"]) for r in report["received"]]


@pytest.mark.parametrize("version", VERSIONS)
def test_qos_0_and_1_publishes_reach_exact_and_plus_filters(reports: Reports, version: str) -> None:
    """3.1.1 §3.3 / 5.0 §3.3 (PUBLISH), §4.7.1.3 ('+' matches one level), §3.9.3 (SUBACK grants the QoS asked);
    the delivered QoS is the lower of the publish's and the subscription's (§3.8.4)."""
    report = reports[(version, "pubsub")]
    assert report["granted"] == [1, 0]
    assert received(report) == [
        ("/room1/temp", "t0", 0, False),
        ("/room1/temp", "t1", 1, False),
        ("/room2/hum", "h1", 0, False),
    ]


@pytest.mark.parametrize("version", VERSIONS)
def test_retained_messages_reach_a_later_subscriber_flagged_retained(reports: Reports, version: str) -> None:
    """3.1.1 §3.3.1.3 / 5.0 §3.3.1.3: retained messages are sent on SUBSCRIBE with RETAIN set; a live message is not."""
    got = received(reports[(version, "retained")])
    assert sorted(got[:2]) == [("/ret/a", "r1", 1, True), ("/ret/b", "r2", 1, True)]
    assert got[2:] == [("/ret/a", "live", 1, False)]


@pytest.mark.parametrize("version", VERSIONS)
def test_a_will_is_published_on_a_lost_connection_only(reports: Reports, version: str) -> None:
    """3.1.1 §3.1.2.5 / 5.0 §3.1.2.5: the will of a connection closed without DISCONNECT is published; a DISCONNECT
    (reason 0x00) discards it (3.1.1 §3.14.4, 5.0 §3.14.4)."""
    assert received(reports[(version, "will")]) == [("/will/dying", "dying-gone", 1, False)]


@pytest.mark.parametrize("version", VERSIONS)
def test_a_persistent_session_gets_what_was_published_while_away(reports: Reports, version: str) -> None:
    """3.1.1 §3.1.2.4 (CleanSession 0) / 5.0 §3.1.2.4 with a Session Expiry Interval (§3.1.2.11.2): the subscription
    outlives the connection, QoS 1 messages published meanwhile are delivered at the next connect, and CONNACK's
    Session Present is 1 (§3.2.2.2)."""
    report = reports[(version, "session")]
    assert (report["first_present"], report["resumed_present"]) == (False, True)
    assert received(report) == [("/sess/x", "m1", 1, False), ("/sess/x", "m2", 1, False)]


@pytest.mark.parametrize("version", VERSIONS)
def test_mqtt5_4_8_2_a_shared_subscription_gives_each_message_to_one_member(reports: Reports, version: str) -> None:
    """5.0 §4.8.2 (and 3.1.1 clients as common brokers take them): two members of ``$share/workers/...``
    together get each of ten messages once, under its own topic name."""
    report = reports[(version, "shared")]
    assert report["granted"] == [1, 1]
    got = received(report)
    assert sorted(payload for _, payload, _, _ in got) == sorted(f"job{n}" for n in range(10))
    assert all(topic in ("/jobs/0", "/jobs/1") and qos == 1 for topic, _, qos, _ in got)
