"""Access control and MQTT sessions (``--acl``, issue 29), with paho-mqtt against a broker process: a persistent
session is its user's (another user taking the client id gets a fresh one, not its queued messages), and a
policy change that takes ``Sub`` away ends the filters and shared subscriptions of live sessions it no longer
allows."""

from __future__ import annotations

import itertools
import re
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from paho.mqtt.enums import MQTTProtocolVersion
from testing_mqtt import Peer
from waiting import eventually

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.admin.results import AclEntry
from lmq_broker.mqtt import durable
from lmq_broker.testing import BrokerProcess, start_broker

V5 = MQTTProtocolVersion.MQTTv5
ALICE, BOB = ("alice", "alice-secret-1"), ("bob", "bob-secret-1")
_ids = itertools.count()


@pytest.fixture(scope="module")
def acl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    process = start_broker(tmp_path_factory.mktemp("acl") / "data", extra_args=["--mqtt-port", "0", "--acl"])
    with AdminClient(process.admin_endpoint, timeout_s=10, **process.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic("chat", model.MessageType.LITE))
        for name, secret in (ALICE, BOB):
            admin.put_user(name, secret)
        admin.put_acl([AclEntry("alice", "Lite:chat/a-*", ("Pub", "Sub"))])
        admin.put_acl([AclEntry("bob", "Lite:chat/b-*", ("Pub", "Sub"))])
    yield process
    assert process.stop() == 0, process.log()[-4000:]


def admin_of(broker: BrokerProcess) -> AdminClient:
    return AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys)


def test_another_user_taking_a_client_id_gets_a_fresh_session(
    acl_broker: BrokerProcess, connect: Callable[..., Peer]
) -> None:
    """Issue 29: a second user connecting with the client id of a persistent session gets a new session
    (session present 0, none of the queued messages); the owner's own reconnect resumes as before."""
    port, client_id = acl_broker.mqtt_port, f"shared-{next(_ids)}"
    alice = connect(port, client_id, clean=False, auth=ALICE)
    assert alice.subscribe(("chat/a-inbox/#", 1)) == [1]
    alice.disconnect()
    sender = connect(port, auth=ALICE)
    assert sender.publish("chat/a-inbox/1", b"queued for alice") == 0
    again = connect(port, client_id, clean=False, auth=ALICE)  # her own reconnect: resumed, the message comes
    assert again.connack == (True, "Success")
    assert [m.payload for m in again.wait_count(1)] == [b"queued for alice"]
    again.disconnect()
    assert sender.publish("chat/a-inbox/2", b"queued again") == 0
    bob = connect(port, client_id, clean=False, auth=BOB)
    assert bob.connack == (False, "Success")  # fresh: not her session
    assert bob.quiet(0.5) == []  # nor her queued message
    assert sender.publish("chat/a-inbox/3", b"after bob took the id") == 0
    assert bob.quiet(0.5) == []  # nor her subscriptions
    bob.disconnect()
    back = connect(port, client_id, clean=False, auth=ALICE)
    assert back.connack == (False, "Success")  # the id's session is bob's now: hers was discarded
    assert back.quiet(0.5) == []


def test_taking_sub_away_ends_a_live_sessions_filters(acl_broker: BrokerProcess, connect: Callable[..., Peer]) -> None:
    """Issue 29: after ``acl delete``/``acl put … Deny``, a live session's filters the user may no longer read
    are dropped (logged at INFO); its other filters keep delivering, and new messages of the dropped ones never
    arrive."""
    port, n = acl_broker.mqtt_port, next(_ids)
    with admin_of(acl_broker) as admin:
        admin.put_user(f"carol{n}", "carol-secret-1")
        admin.put_acl([AclEntry(f"carol{n}", "Lite:chat/c-*", ("Pub", "Sub"))])
    carol = (f"carol{n}", "carol-secret-1")
    reader = connect(port, clean=False, auth=carol, protocol=V5)
    assert reader.subscribe(("chat/c-keep/#", 1), ("chat/c-secret/#", 1)) == [1, 1]
    writer = connect(port, auth=carol, protocol=V5)
    assert writer.publish("chat/c-secret/1", b"before") == 0
    assert [m.payload for m in reader.wait_count(1)] == [b"before"]
    with admin_of(acl_broker) as admin:
        admin.put_acl([AclEntry(f"carol{n}", "Lite:chat/c-secret*", ("Sub",), "Deny")])
    eventually(lambda: re.search(rf"user carol{n}: .*no longer allowed", acl_broker.log()), "the drop logged")
    assert writer.publish("chat/c-secret/2", b"after the deny") == 0  # Pub is still hers
    assert writer.publish("chat/c-keep/1", b"still hers") == 0
    received = reader.wait_count(2)
    assert [m.payload for m in reader.quiet(0.5)] == [b"before", b"still hers"], received


def test_a_resumed_session_keeps_only_the_filters_its_user_may_still_read(
    acl_broker: BrokerProcess, connect: Callable[..., Peer]
) -> None:
    """Issue 29: a persistent session's saved filters are checked again when it resumes: one its user may no
    longer read is dropped before the CONNACK, so its queued messages are not sent."""
    port, n = acl_broker.mqtt_port, next(_ids)
    dave = (f"dave{n}", "dave-secret-1")
    with admin_of(acl_broker) as admin:
        admin.put_user(*dave)
        admin.put_acl([AclEntry(dave[0], "Lite:chat/d-*", ("Pub", "Sub"))])
    client_id = f"dave-{n}"
    reader = connect(port, client_id, clean=False, auth=dave)
    assert reader.subscribe(("chat/d-keep/#", 1), ("chat/d-secret/#", 1)) == [1, 1]
    reader.disconnect()
    with admin_of(acl_broker) as admin:
        admin.put_acl([AclEntry(dave[0], "Lite:chat/d-secret*", ("Sub",), "Deny")])
    writer = connect(port, auth=dave)
    assert writer.publish("chat/d-secret/1", b"queued, now forbidden") == 0
    assert writer.publish("chat/d-keep/1", b"queued, still his") == 0
    back = connect(port, client_id, clean=False, auth=dave)
    assert back.connack == (True, "Success")
    received = back.wait_count(1)
    assert [m.payload for m in back.quiet(0.5)] == [b"queued, still his"], received


def test_taking_sub_away_leaves_a_live_sessions_shares(acl_broker: BrokerProcess, connect: Callable[..., Peer]) -> None:
    """Issue 29: a policy change that takes ``Sub`` away also ends a live session's shared subscriptions
    (``$share/...``) on that filter: the share's messages go to its other members from then on, the session's
    plain filters it may still read keep delivering."""
    port, n = acl_broker.mqtt_port, next(_ids)
    erin, frank = (f"erin{n}", "erin-secret-1"), (f"frank{n}", "frank-secret-1")
    with admin_of(acl_broker) as admin:
        for user in (erin, frank):
            admin.put_user(*user)
            admin.put_acl([AclEntry(user[0], "Lite:chat/e-*", ("Pub", "Sub"))])
    share = f"$share/team{n}/chat/e-jobs/#"
    worker = connect(port, auth=erin, protocol=V5)
    assert worker.subscribe((share, 1), ("chat/e-keep/#", 1)) == [1, 1]
    writer = connect(port, auth=frank, protocol=V5)
    assert writer.publish("chat/e-jobs/0", b"job 0") == 0
    assert [m.payload for m in worker.wait_count(1)] == [b"job 0"]  # erin is the share's only member yet
    other = connect(port, auth=frank, protocol=V5)
    assert other.subscribe((share, 1)) == [1]
    with admin_of(acl_broker) as admin:
        admin.put_acl([AclEntry(erin[0], "Lite:chat/e-jobs*", ("Sub",), "Deny")])
    eventually(
        lambda: re.search(rf"user erin{n}: shared subscriptions no longer allowed left", acl_broker.log()),
        "the leave logged",
    )
    jobs = [f"job {i}".encode() for i in range(1, 5)]
    for i, job in enumerate(jobs, 1):
        assert writer.publish(f"chat/e-jobs/{i}", job) == 0
    assert writer.publish("chat/e-keep/1", b"still hers") == 0
    assert sorted(m.payload for m in other.wait_count(len(jobs))) == jobs  # every job to the member left
    received = worker.wait_count(2)
    assert [m.payload for m in worker.quiet(0.5)] == [b"job 0", b"still hers"], received


def test_the_owner_is_stored_with_the_session_and_an_older_file_gains_the_column(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / durable.FILE_NAME) as old:  # a file from before owners
        old.execute("CREATE TABLE sessions (client_id TEXT PRIMARY KEY, filters TEXT NOT NULL)")
        old.execute("INSERT INTO sessions VALUES ('legacy', '{}')")
    store = durable.Durable(tmp_path)
    try:
        assert store.session_owner("legacy") == (True, None)  # unknown: under --acl it starts fresh
        assert store.session_owner("nobody") == (False, None)
        store.save_session("c1", {"chat/a/#": 1})
        store.own_session("c1", "alice")
        store.save_session("c1", {"chat/a/#": 1, "chat/b/#": 1})  # later saves keep the owner
        assert store.session_owner("c1") == (True, "alice")
    finally:
        store.close()
