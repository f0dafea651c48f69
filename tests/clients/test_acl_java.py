"""Access control with the official Java client (``--acl``, issue 29): a producer signed as tenant A's user
sends to A's lite topics and gets FORBIDDEN for tenant B's, where nothing is stored; its consumer is refused
B's lite topics the same way. The Java driver signs with ``--access-key`` and ``LMQ_DRIVER_SECRET_KEY``."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from testing_clients import Driver, DriverError, DriverMissing, b64, driver_argv, start_driver, unb64
from waiting import eventually

from lmq_broker import errors, model
from lmq_broker.admin.client import AdminClient
from lmq_broker.admin.results import AclEntry
from lmq_broker.testing import BrokerProcess, start_broker

POINTERS = Path(__file__).resolve().parents[2] / "build" / "clients"
PARENT = "chat"
ALICE, BOB = ("alice", "alice-secret-1"), ("bob", "bob-secret-1")


@pytest.fixture(scope="module")
def acl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    process = start_broker(
        tmp_path_factory.mktemp("acl-java") / "data", extra_args=["--acl", "--long-polling-timeout-ms", "5000"]
    )
    with AdminClient(process.admin_endpoint, timeout_s=10, **process.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
        for tenant, (name, secret) in (("a", ALICE), ("b", BOB)):
            admin.put_group(model.LiteGroup(f"{tenant}-group", PARENT))
            admin.put_user(name, secret)
            admin.put_acl(
                [
                    AclEntry(name, f"Lite:{PARENT}/{tenant}-*", ("Pub", "Sub")),
                    AclEntry(name, f"Group:{tenant}-group", ("Sub",)),
                ]
            )
    yield process
    assert process.stop() == 0, process.log()[-4000:]


@pytest.fixture
def alice_java(acl_broker: BrokerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Driver]:
    try:
        argv = driver_argv(POINTERS, "java")
    except DriverMissing as missing:
        pytest.fail(str(missing))
    monkeypatch.setenv("LMQ_DRIVER_SECRET_KEY", ALICE[1])  # the driver process inherits it
    driver = start_driver([*argv, "--access-key", ALICE[0]], "java", acl_broker.endpoint, tmp_path)
    yield driver
    assert driver.close() == 0, driver.tail()


def refused(broker: BrokerProcess, user: str, action: str) -> float:
    with urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.search(rf'^lmq_acl_refused_total\{{action="{action}",user="{user}"\}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_java_producer_sends_to_its_tenants_lite_topics_and_is_forbidden_the_others(
    acl_broker: BrokerProcess, alice_java: Driver
) -> None:
    alice_java.call("producer", name="p", topics=[PARENT])
    alice_java.call("lite_push", name="c", group="a-group", topic=PARENT)
    alice_java.call("subscribe_lite", consumer="c", lite_topic="a-session")
    alice_java.call("send", producer="p", topic=PARENT, lite_topic="a-session", body=b64(b"hers"))
    got = alice_java.wait_events(
        lambda events: any(e.get("event") == "message" for e in events), 30, "her own message delivered"
    )
    assert [unb64(e["body"]) for e in got if e.get("event") == "message"] == [b"hers"]
    before = refused(acl_broker, "alice", "Pub")
    with pytest.raises(DriverError) as forbidden:
        alice_java.call("send", producer="p", topic=PARENT, lite_topic="b-session", body=b64(b"intrusion"))
    error = str(forbidden.value.reply.get("error"))
    assert "ForbiddenException" in error and "user alice may not Pub on Lite:chat/b-session" in error, error
    eventually(lambda: refused(acl_broker, "alice", "Pub") > before, "the refusal counted")
    with pytest.raises(DriverError, match="may not Sub on Lite:chat/b-session"):
        alice_java.call("subscribe_lite", consumer="c", lite_topic="b-session")
    with AdminClient(acl_broker.admin_endpoint, **acl_broker.admin_keys) as admin:
        with pytest.raises(errors.NotFound):
            admin.describe_lite_topic(PARENT, "b-session")  # nothing stored
        assert admin.describe_lite_topic(PARENT, "a-session").meta.max_offset == 1
