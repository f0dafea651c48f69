"""Metadata changed through one member reaches every member (``admin.everywhere``; docs/scale-out.md): real
broker processes with ``--peers`` and ``serve --processes 2``, the real admin service and ``lmq-admin``."""

from __future__ import annotations

import io
import re
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
from waiting import eventually

from lmq_broker import errors, model
from lmq_broker.admin import cli
from lmq_broker.admin.client import AdminClient
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as v2
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as v2s
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as v2_grpc
from lmq_broker.supervisor import free_ports
from lmq_broker.testing import SHARED_ADMIN_ENV, SHARED_ADMIN_KEYS, BrokerProcess, start_broker

PROCESS_RE = re.compile(r"lmq-broker process (?P<index>\d+) grpc=(?P<grpc>[^ ]+) metrics=")


def started(data_dir: Path, port: int, args: list[str]) -> BrokerProcess:
    return start_broker(data_dir, port=port, extra_args=args, env=SHARED_ADMIN_ENV)


def stopped(broker: BrokerProcess) -> None:
    broker.stop()
    if broker.process.stdout is not None:  # start_broker leaves its log pipe open (a ResourceWarning)
        broker.process.stdout.close()


@pytest.fixture(scope="module")
def brokers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[BrokerProcess]]:
    """Three ``--peers`` brokers on 127.0.0.1, started side by side."""
    root = tmp_path_factory.mktemp("everywhere")
    ports = free_ports("127.0.0.1", 3)
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    found: dict[int, BrokerProcess] = {}

    def start(i: int) -> None:
        args = ["--peers", peers, "--ordinal", str(i), "--no-bootstrap", "--flush-mode", "async"]
        found[i] = started(root / f"b{i}", ports[i], args)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    running = [found[i] for i in sorted(found)]
    assert len(running) == 3
    yield running  # a test that stops one puts its restarted process back in this list
    for broker in running:
        stopped(broker)


def admin(endpoint: str, *, here_only: bool = False) -> AdminClient:
    return AdminClient(endpoint, timeout_s=10, **SHARED_ADMIN_KEYS, here_only=here_only)


def catalog(endpoint: str) -> tuple[set[str], set[str], set[str]]:
    """(parent topics, groups, quota scopes) the broker at ``endpoint`` holds."""
    with admin(endpoint) as each:
        return (
            {t.topic.name for t in each.list_parent_topics()},
            {g.group.name for g in each.list_groups()},
            {q.scope for q in each.list_quotas()},
        )


def lmq_admin(endpoint: str, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    keys = ["--access-key", SHARED_ADMIN_KEYS["access_key"], "--secret-key", SHARED_ADMIN_KEYS["secret_key"]]
    code = cli.main(["--endpoint", endpoint, *keys, *argv], out, err)
    return code, out.getvalue(), err.getvalue()


def test_created_through_one_member_and_deleted_through_another_reaches_every_member(
    brokers: list[BrokerProcess],
) -> None:
    endpoints = [b.admin_endpoint for b in brokers]
    assert lmq_admin(endpoints[0], "parent-topic", "put", "orders")[0] == cli.EXIT_OK
    assert lmq_admin(endpoints[0], "group", "put", "billing", "--bind-topic", "orders")[0] == cli.EXIT_OK
    assert lmq_admin(endpoints[0], "quota", "put", "parent:orders", "--max-lite-topics", "10")[0] == cli.EXIT_OK
    for endpoint in endpoints:
        topics, groups, quotas = catalog(endpoint)
        assert "orders" in topics and "billing" in groups and "parent:orders" in quotas, endpoint
    with admin(endpoints[2]) as third:  # a change reaches them too, not only a creation
        assert third.get_parent_topic("orders").topic.expiration_minutes == -1
    assert lmq_admin(endpoints[1], "parent-topic", "put", "orders", "--expiration-minutes", "30")[0] == cli.EXIT_OK
    for endpoint in endpoints:
        with admin(endpoint) as each:
            assert each.get_parent_topic("orders").topic.expiration_minutes == 30, endpoint

    with admin(endpoints[1]) as second:
        assert second.delete_quota("parent:orders")
        assert second.delete_group("billing")
        assert second.delete_parent_topic("orders").deleted
    for endpoint in endpoints:
        topics, groups, quotas = catalog(endpoint)
        assert "orders" not in topics and "billing" not in groups and "parent:orders" not in quotas, endpoint


def test_here_only_changes_one_member(brokers: list[BrokerProcess]) -> None:
    """The operator's way (it calls every broker itself): the marked call is applied where it lands, only."""
    endpoints = [b.admin_endpoint for b in brokers]
    with admin(endpoints[0], here_only=True) as first:
        first.put_parent_topic(model.ParentTopic("only-here"))
    assert [("only-here" in catalog(e)[0]) for e in endpoints] == [True, False, False]
    code, _, _ = lmq_admin(endpoints[1], "--here-only", "parent-topic", "put", "only-here")
    assert code == cli.EXIT_OK
    assert [("only-here" in catalog(e)[0]) for e in endpoints] == [True, True, False]
    with admin(endpoints[2]) as third:  # repeating it without the marker completes it everywhere
        assert third.put_parent_topic(model.ParentTopic("only-here")).created
        assert third.delete_parent_topic("only-here").deleted
    assert not any("only-here" in catalog(e)[0] for e in endpoints)


def test_a_member_refusing_a_copy_fails_the_call_naming_it(brokers: list[BrokerProcess]) -> None:
    """A group whose bind topic one member lacks (it was told here-only): that member refuses its copy."""
    endpoints = [b.admin_endpoint for b in brokers]
    with admin(endpoints[0], here_only=True) as first:
        first.put_parent_topic(model.ParentTopic("lopsided"))
    with admin(endpoints[0]) as first, pytest.raises(errors.Conflict) as refused:
        first.put_group(model.LiteGroup("lopsided-group", "lopsided"))
    message = refused.value.message
    assert message.startswith(f"PutLiteGroup is applied on {endpoints[0]} (this broker) but not on ")
    assert f"{endpoints[1]} (NOT_FOUND: group.bind_topic: parent topic 'lopsided' not found)" in message
    assert endpoints[2] in message and "safe to repeat" in message
    assert ["lopsided-group" in catalog(e)[1] for e in endpoints] == [True, False, False]
    with admin(endpoints[1]) as second:
        second.put_parent_topic(model.ParentTopic("lopsided"))  # now on every member
        second.put_group(model.LiteGroup("lopsided-group", "lopsided"))
        assert second.delete_group("lopsided-group") and second.delete_parent_topic("lopsided").deleted
    assert not any({"lopsided", "lopsided-group"} & (catalog(e)[0] | catalog(e)[1]) for e in endpoints)


def test_an_unsigned_call_is_refused_whatever_its_marker(brokers: list[BrokerProcess]) -> None:
    unsigned = AdminClient(brokers[0].admin_endpoint, timeout_s=10, here_only=True)
    with unsigned, pytest.raises(errors.Unauthorized):
        unsigned.put_parent_topic(model.ParentTopic("sneaky"))
    assert not any("sneaky" in catalog(b.admin_endpoint)[0] for b in brokers)


def send(endpoint: str, parent: str, lite: str) -> None:
    """One LITE message through ``endpoint``'s v2 service (stored on the lite topic's owner)."""
    message = v2.Message(topic=v2.Resource(name=parent), body=b"m")
    props = message.system_properties
    props.message_id = uuid.uuid4().hex.upper()
    props.lite_topic = lite
    props.message_type = v2.LITE
    props.body_encoding = v2.IDENTITY
    props.born_host = "test"
    props.born_timestamp.FromDatetime(datetime.now(UTC))
    with grpc.insecure_channel(endpoint) as channel:
        reply = v2_grpc.MessagingServiceStub(channel).SendMessage(
            v2s.SendMessageRequest(messages=[message]), metadata=(("x-mq-client-id", "everywhere@1@0@x"),), timeout=10
        )
    assert reply.status.code == v2.OK, reply.status


def test_a_parent_with_lite_topics_on_any_member_is_deleted_nowhere_unless_purged(
    brokers: list[BrokerProcess],
) -> None:
    endpoints = [b.admin_endpoint for b in brokers]
    with admin(endpoints[0]) as first:
        first.put_parent_topic(model.ParentTopic("held"))
    send(brokers[0].endpoint, "held", "s-1")
    counts = []
    for endpoint in endpoints:
        with admin(endpoint) as each:
            counts.append(each.get_parent_topic("held").lite_topic_count)
    assert sorted(counts) == [0, 0, 1]
    holder, empty = endpoints[counts.index(1)], endpoints[counts.index(0)]
    with admin(empty) as there, pytest.raises(errors.Conflict) as refused:
        there.delete_parent_topic("held")
    assert holder in refused.value.message and "Nothing was deleted" in refused.value.message
    assert all("held" in catalog(e)[0] for e in endpoints)
    with admin(empty) as there:
        assert there.delete_parent_topic("held", purge_lite_topics=True).deleted
    assert not any("held" in catalog(e)[0] for e in endpoints)
    with admin(holder) as there:
        assert there.list_lite_topics("held").topics == ()  # the holder purged its own


def test_a_member_down_fails_the_call_naming_it_and_the_others_keep_the_change(
    brokers: list[BrokerProcess],
) -> None:
    endpoints = [b.admin_endpoint for b in brokers]
    down = brokers[2]
    stopped(down)
    try:
        code, _, err = lmq_admin(endpoints[0], "parent-topic", "put", "while-down")
        assert code == cli.EXIT_FAILED
        assert err.startswith("error: BrokerUnavailable: ") and "PutParentTopic is applied on " in err
        assert f"but not on {endpoints[2]} (UNAVAILABLE" in err and "safe to repeat" in err
        assert endpoints[0] in err and endpoints[1] in err
        assert all("while-down" in catalog(e)[0] for e in endpoints[:2])  # the members reached keep it
        # A delete that cannot ask every member deletes nowhere.
        with admin(endpoints[1]) as second, pytest.raises(errors.BrokerUnavailable) as unasked:
            second.delete_parent_topic("while-down")
        assert endpoints[2] in unasked.value.message and "nothing was deleted" in unasked.value.message
        assert unasked.value.fields["code"] == "UNAVAILABLE"
        assert all("while-down" in catalog(e)[0] for e in endpoints[:2])
    finally:
        brokers[2] = down.restart()
    assert "while-down" not in catalog(endpoints[2])[0]  # it was down: it does not have it

    def put_everywhere() -> bool:  # refused until the restarted broker answers (a peer's channel backs off)
        code, _, err = lmq_admin(endpoints[0], "parent-topic", "put", "while-down")
        assert code == cli.EXIT_OK or "BrokerUnavailable" in err, err
        return code == cli.EXIT_OK

    eventually(put_everywhere, "the put repeated once the restarted broker answers", timeout_s=15, interval_s=0.1)
    assert all("while-down" in catalog(e)[0] for e in endpoints)
    with admin(endpoints[2]) as third:
        assert third.delete_parent_topic("while-down").deleted
    assert not any("while-down" in catalog(e)[0] for e in endpoints)


def test_processes_of_one_pod_share_what_one_of_them_was_told(tmp_path: Path) -> None:
    """``serve --processes 2``: ``lmq-admin`` on the pod's shared port reaches one process (the kernel picks);
    both have the topic, group and quota; a delete through the other process removes them from both."""
    pod = start_broker(tmp_path / "data", extra_args=["--processes", "2", "--no-bootstrap"], env=SHARED_ADMIN_ENV)
    try:
        found = {int(m["index"]): m["grpc"] for m in PROCESS_RE.finditer(pod.log())}
        endpoints = [found[i] for i in sorted(found)]
        assert len(endpoints) == 2
        assert lmq_admin(pod.endpoint, "parent-topic", "put", "jobs")[0] == cli.EXIT_OK
        assert lmq_admin(pod.endpoint, "group", "put", "workers", "--bind-topic", "jobs")[0] == cli.EXIT_OK
        assert lmq_admin(pod.endpoint, "quota", "put", "parent:jobs", "--max-lite-topics", "5")[0] == cli.EXIT_OK
        for endpoint in endpoints:
            assert catalog(endpoint) == ({"jobs"}, {"workers"}, {"parent:jobs"}), endpoint
        with admin(endpoints[1]) as second:
            assert second.delete_group("workers") and second.delete_quota("parent:jobs")
            assert second.delete_parent_topic("jobs").deleted
        for endpoint in endpoints:
            assert catalog(endpoint) == (set(), set(), set()), endpoint
    finally:
        stopped(pod)
