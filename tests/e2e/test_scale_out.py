"""Scale-out (docs/scale-out.md): N brokers behind ONE access endpoint, the official Python client 5.1.2.

Each broker owns a share of the lite topics; a send reaching another broker is forwarded to the owner, a
subscription is split by owner, every broker lists every broker in routes and assignments (itself first). Real
processes: ``--processes N`` (one access port shared with SO_REUSEPORT) and explicit ``--peers``.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from rocketmq import (
    ClientConfiguration,
    Credentials,
    FilterExpression,
    LitePushConsumer,
    LiteSimpleConsumer,
    Message,
    Producer,
    SimpleConsumer,
)
from rocketmq.grpc_protocol import definition_pb2 as rpb
from rocketmq.grpc_protocol import service_pb2 as rspb
from rocketmq.grpc_protocol import service_pb2_grpc as rgrpc
from waiting import eventually

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.cluster import membership as mb
from lmq_broker.supervisor import free_ports
from lmq_broker.testing import (
    SHARED_ADMIN_ENV,
    SHARED_ADMIN_KEYS,
    BrokerProcess,
    Inbox,
    holders,
    start_broker,
    start_lite_simple_consumer,
)

PROCESS_RE = re.compile(r"lmq-broker process (?P<index>\d+) grpc=(?P<grpc>[^ ]+) metrics=")
TOPIC, GROUP = "SCALE_NS", "scale-group"
BARRIER = b"barrier/"  # the body prefix of check_received's barrier messages
BARRIER_IDS = itertools.count()


def process_endpoints(broker: BrokerProcess) -> list[str]:
    found = {int(m["index"]): m["grpc"] for m in PROCESS_RE.finditer(broker.log())}
    return [found[i] for i in sorted(found)]


def create_metadata(endpoints: list[str], keys: Any) -> None:
    """Topics and groups go to every broker (the operator does this on Kubernetes)."""
    for endpoint in endpoints:
        with AdminClient(endpoint, timeout_s=10, **keys) as admin:
            admin.put_parent_topic(model.ParentTopic(TOPIC, model.MessageType.LITE))
            admin.put_group(model.LiteGroup(GROUP, TOPIC))


def assignments_of(endpoint: str) -> list[tuple[str, str]]:
    with grpc.insecure_channel(endpoint) as channel:
        reply = rgrpc.MessagingServiceStub(channel).QueryAssignment(
            rspb.QueryAssignmentRequest(
                topic=rpb.Resource(name=TOPIC), group=rpb.Resource(name=GROUP), endpoints=rpb.Endpoints()
            ),
            metadata=(("x-mq-client-id", "scale-test"),),
            timeout=10,
        )
    assert reply.status.code == rpb.Code.OK, reply.status
    return [
        (a.message_queue.broker.name, f"{a.message_queue.broker.endpoints.addresses[0].host}:"
         f"{a.message_queue.broker.endpoints.addresses[0].port}")
        for a in reply.assignments
    ]  # fmt: skip


def config(endpoint: str) -> Any:
    return ClientConfiguration(endpoint, Credentials(), request_timeout=5)


def send(producer: Any, lite: str, body: bytes) -> Any:
    message = Message()
    message.topic = TOPIC
    message.lite_topic = lite
    message.body = body
    return producer.send(message)


def exchange(
    access: str, lites: list[str], per_topic: int, clients: list[Any], inbox: Inbox, *, run: str = "a"
) -> set[tuple[str, bytes]]:
    """Subscribe ``lites`` and send ``per_topic`` messages to each, all through ``access``."""
    consumer = LitePushConsumer(config(access), GROUP, TOPIC, inbox)
    consumer.startup()
    clients.append(consumer)
    for lite in lites:
        consumer.subscribe_lite(lite)
    producer = Producer(config(access), (TOPIC,))
    producer.startup()
    clients.append(producer)
    sent: set[tuple[str, bytes]] = set()
    for n in range(per_topic):
        for lite in lites:
            body = f"{lite}/{run}/{n:04d}".encode()
            send(producer, lite, body)
            sent.add((lite, body))
    return sent


def check_received(
    inbox: Inbox, sent: set[tuple[str, bytes]], producer: Any, lites: list[str] | None = None, timeout: float = 60
) -> None:
    """Every message of ``sent`` came once, in order per lite topic, and nothing else. Once they are in, one
    barrier message on each of ``lites`` (the consumer takes them; default: the lite topics of ``sent``) must
    come too: a duplicate or an unwanted message would come before it. Barriers are left out of the count."""

    def payload(i: Inbox) -> list[tuple[str, bytes]]:
        return [(m.lite_topic, m.body) for m in i.accepted if not m.body.startswith(BARRIER)]

    assert inbox.wait_for(lambda i: len(payload(i)) >= len(sent), timeout), f"got {len(inbox.accepted)} of {len(sent)}"
    barrier = set()
    for lite in sorted({lite for lite, _ in sent} if lites is None else lites):
        body = BARRIER + str(next(BARRIER_IDS)).encode()
        send(producer, lite, body)
        barrier.add((lite, body))
    assert inbox.wait_for(lambda i: barrier <= {(m.lite_topic, m.body) for m in i.accepted}, timeout)
    got = payload(inbox)
    assert len(got) == len(sent) and set(got) == sent  # every message once
    per_topic: dict[str, list[bytes]] = {}
    for lite, body in got:
        per_topic.setdefault(lite, []).append(body)
    assert all(bodies == sorted(bodies) for bodies in per_topic.values())  # in order per lite topic


@pytest.fixture
def clients() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for client in reversed(started):
        client.shutdown()


def stop_all(clients: list[Any], brokers: Sequence[Any]) -> None:
    """The clients first, while the brokers still answer: a push consumer shut down after its brokers keeps
    retrying the acks of what it was still consuming, and its shutdown waits on that for ever."""
    while clients:
        clients.pop().shutdown()
    for broker in brokers:
        broker.stop()


@pytest.mark.parametrize(("processes", "edge"), [(1, "grpcio"), (2, "grpcio"), (3, "grpcio"), (2, "native")])
def test_processes_behind_one_access_port(tmp_path: Path, clients: list[Any], processes: int, edge: str) -> None:
    """``edge``: the server of every process's client ports, the shared access port among them (SO_REUSEPORT)."""
    args = ["--processes", str(processes), "--no-bootstrap", "--edge", edge]
    with start_broker(tmp_path / "data", extra_args=args, env=SHARED_ADMIN_ENV) as pod:
        endpoints = process_endpoints(pod) if processes > 1 else [pod.endpoint]
        assert len(endpoints) == processes
        create_metadata(endpoints, SHARED_ADMIN_KEYS)
        expected = assignments_of(endpoints[0])
        assert len(expected) == processes
        for endpoint in endpoints:  # the same brokers from every broker, the one asked first
            found = assignments_of(endpoint)
            assert sorted(found) == sorted(expected), (endpoint, found)
            assert processes == 1 or found[0][1] == endpoint, (endpoint, found)
        if processes > 1:
            assert sorted(address for _, address in expected) == sorted(endpoints)
        lites = [f"s-{i}" for i in range(24)]
        inbox = Inbox()
        sent = exchange(pod.endpoint, lites, 3, clients, inbox)
        check_received(inbox, sent, clients[-1])
        placed = holders(endpoints, TOPIC, SHARED_ADMIN_KEYS)
        assert sorted(placed) == sorted(lites)
        assert all(len(where) == 1 for where in placed.values()), placed  # each topic on exactly one broker
        if processes > 1:
            assert len({where[0] for where in placed.values()}) == processes  # and every broker owns some
        for client in reversed(clients):
            client.shutdown()
        clients.clear()


def start_cluster(
    tmp_path: Path, ports: list[int], history: str = "", only: list[int] | None = None
) -> list[BrokerProcess]:
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    brokers = []
    for i in only if only is not None else range(len(ports)):
        args = ["--peers", peers, "--ordinal", str(i), "--no-bootstrap", "--ring-history", history]
        brokers.append(start_broker(tmp_path / f"b{i}", port=ports[i], extra_args=args, env=SHARED_ADMIN_ENV))
    return brokers


def test_kill_9_of_one_broker_leaves_the_others_flowing(tmp_path: Path, clients: list[Any]) -> None:
    ports = free_ports("127.0.0.1", 3)
    brokers = start_cluster(tmp_path, ports)
    try:
        endpoints = [b.endpoint for b in brokers]
        create_metadata(endpoints, SHARED_ADMIN_KEYS)
        lites = [f"k-{i}" for i in range(18)]
        inbox = Inbox()
        sent = exchange(endpoints[0], lites, 2, clients, inbox)
        check_received(inbox, sent, clients[-1])
        placed = {lite: where[0] for lite, where in holders(endpoints, TOPIC, SHARED_ADMIN_KEYS).items()}
        assert len(set(placed.values())) == 3
        brokers[2].kill()
        survivors = [lite for lite in lites if placed[lite] != 2]
        lost = [lite for lite in lites if placed[lite] == 2]
        producer = clients[-1]
        more = set()
        for lite in survivors:
            body = f"{lite}/after".encode()
            send(producer, lite, body)
            more.add((lite, body))
        for lite in lost[:1]:  # the dead owner's topics fail (the client's retries included), nothing stored
            with pytest.raises(Exception):  # noqa: B017 - the client raises its InternalErrorException
                send(producer, lite, b"nowhere")
        check_received(inbox, sent | more, producer, survivors)
    finally:
        stop_all(clients, brokers)


def test_scale_up_keeps_old_topics_where_they_are(tmp_path: Path, clients: list[Any]) -> None:
    ports = free_ports("127.0.0.1", 3)
    two = start_cluster(tmp_path, ports[:2])
    endpoints = [b.endpoint for b in two]
    create_metadata(endpoints, SHARED_ADMIN_KEYS)
    lites = [f"u-{i}" for i in range(30)]
    inbox = Inbox()
    sent = exchange(endpoints[0], lites, 2, clients, inbox)
    check_received(inbox, sent, clients[-1])
    before = {lite: where[0] for lite, where in holders(endpoints, TOPIC, SHARED_ADMIN_KEYS).items()}
    for client in reversed(clients):
        client.shutdown()
    clients.clear()
    for broker in two:
        broker.stop()
    three = start_cluster(tmp_path, ports, history="2")  # the two restart with the new ring; a third joins
    try:
        endpoints = [b.endpoint for b in three]
        create_metadata(endpoints[2:], SHARED_ADMIN_KEYS)
        new_lites = [f"n-{i}" for i in range(30)]
        inbox = Inbox()
        more = exchange(endpoints[1], lites + new_lites, 1, clients, inbox, run="b")
        check_received(inbox, more, clients[-1])
        after = holders(endpoints, TOPIC, SHARED_ADMIN_KEYS)
        assert all(len(where) == 1 for where in after.values()), after  # no topic on two brokers
        assert {lite: after[lite][0] for lite in lites} == before  # old topics stayed (no data moved)
        assert any(after[lite][0] == 2 for lite in new_lites)  # new topics use the new broker
    finally:
        for broker in three:
            broker.stop()


def set_cluster(endpoints: list[str], order: list[int], members: list[str], sizes: tuple[int, ...]) -> None:
    """``lmq-admin cluster set --everywhere`` as a test does it: broker by broker, in the safe order."""
    for i in order:
        with AdminClient(endpoints[i], timeout_s=30, **SHARED_ADMIN_KEYS) as admin:  # a peer may have passed it on
            info, _ = admin.set_cluster(members, sizes)
        assert (info.members, info.ring_sizes) == (tuple(members), mb.of(members, sizes).sizes)


class Load:
    """One producer sending to its topics in turn, from a thread, until stopped; bodies number each topic's
    messages so order can be checked."""

    def __init__(self, access: str, lites: list[str], clients: list[Any]) -> None:
        self.producer = Producer(config(access), (TOPIC,))
        self.producer.startup()
        clients.append(self.producer)
        self.lites = list(lites)
        self.sent: set[tuple[str, bytes]] = set()
        self.failures: list[str] = []
        self.count: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def add(self, lites: list[str]) -> None:
        self.lites = self.lites + lites  # one assignment: the sending thread reads either list whole

    def send(self, lite: str) -> None:
        n = self.count.get(lite, 0)
        body = f"{lite}/{n:05d}".encode()
        try:
            send(self.producer, lite, body)
        except Exception as exc:  # recorded: the test asserts there is none
            self.failures.append(f"{lite}: {exc}")
            return
        self.count[lite] = n + 1
        self.sent.add((lite, body))

    def _run(self) -> None:
        while not self._stop.is_set():
            for lite in self.lites:
                self.send(lite)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def test_scale_down_3_to_2_under_load(tmp_path: Path, clients: list[Any]) -> None:
    """Sends and consumption never stop: slot 2 is marked leaving on every broker, takes no new topic, hands
    its topics over one by one as they drain, reports drained, and is removed; nothing is lost or duplicated
    and each topic keeps its order, all through one access endpoint."""
    ports = free_ports("127.0.0.1", 3)
    brokers = start_cluster(tmp_path, ports)
    try:
        endpoints = [b.endpoint for b in brokers]
        create_metadata(endpoints, SHARED_ADMIN_KEYS)
        access = endpoints[0]
        lites, new_lites = [f"d-{i}" for i in range(24)], [f"e-{i}" for i in range(24)]
        inbox = Inbox()
        consumer = LitePushConsumer(config(access), GROUP, TOPIC, inbox)
        consumer.startup()
        clients.append(consumer)
        for lite in lites:
            consumer.subscribe_lite(lite)
        load = Load(access, lites, clients)
        time.sleep(3)  # the load runs a while before the change: the behaviour under test is a change under load
        before = holders(endpoints, TOPIC, SHARED_ADMIN_KEYS)
        assert {where[0] for where in before.values()} == {0, 1, 2}
        set_cluster(endpoints, [2, 0, 1], endpoints, (3, 2))  # slot 2 leaves: the leaving broker first
        for lite in new_lites:
            consumer.subscribe_lite(lite)
        load.add(new_lites)
        time.sleep(6)  # the handover runs while the load goes on (topics move under load, asserted below)
        load.stop()
        assert not load.failures, load.failures[:5]
        with AdminClient(endpoints[2], timeout_s=30, **SHARED_ADMIN_KEYS) as admin:
            eventually(
                lambda: admin.cluster(with_undrained=True).drained, "slot 2 drained", timeout_s=60, interval_s=0.5
            )
        set_cluster(endpoints, [0, 1, 2], endpoints[:2], (3, 2))  # drained: removed, the leaving broker last
        placed = holders(endpoints, TOPIC, SHARED_ADMIN_KEYS)
        assert all(where in ([0], [1]) for lite, where in placed.items() if lite in new_lites), placed
        handed_over = [lite for lite, where in placed.items() if 2 in where and len(where) == 2]
        assert handed_over, placed  # topics moved while the load ran, not only once it stopped
        brokers[2].stop()
        after = Load(access, [], clients)  # a producer started now has only the two brokers in its routes
        after.stop()
        for lite in lites + new_lites:
            after.count[lite] = load.count.get(lite, 0)
            after.send(lite)
        assert not after.failures, after.failures[:5]
        check_received(inbox, load.sent | after.sent, after.producer)
    finally:
        stop_all(clients, brokers)


def test_lite_simple_consumer_gets_every_brokers_topics(tmp_path: Path, clients: list[Any]) -> None:
    """The official LiteSimpleConsumer reads only the first route queue (the broker it dialled, here broker 1),
    which gathers from the others for it; its acks and invisible-time changes go back, through broker 1, to where
    each message is."""
    ports = free_ports("127.0.0.1", 3)
    brokers = start_cluster(tmp_path, ports)
    try:
        endpoints = [b.endpoint for b in brokers]
        create_metadata(endpoints, SHARED_ADMIN_KEYS)
        access = endpoints[1]  # the first route queue's: routes list the broker asked first
        consumer = LiteSimpleConsumer(TOPIC, config(access), GROUP, await_duration=2)
        clients.append(consumer)
        start_lite_simple_consumer(consumer)
        lites = [f"q-{i}" for i in range(18)]
        for lite in lites:
            consumer.subscribe_lite(lite)
        producer = Producer(config(access), (TOPIC,))
        producer.startup()
        clients.append(producer)
        sent = set()
        for n in range(3):
            for lite in lites:
                body = f"{lite}/{n:04d}".encode()
                send(producer, lite, body)
                sent.add((lite, body))
        placed = {lite: where[0] for lite, where in holders(endpoints, TOPIC, SHARED_ADMIN_KEYS).items()}
        assert set(placed.values()) == {0, 1, 2}
        got: list[tuple[str, bytes]] = []
        nacked_topic = ""
        nacked: set[tuple[str, bytes]] = set()
        deadline = time.monotonic() + 60
        while len(got) < len(sent) and time.monotonic() < deadline:
            batch = consumer.receive(16, 10)
            if not nacked_topic:  # a topic of another broker: what came of it comes back later, in order
                nacked_topic = next((m.lite_topic for m in batch if placed[m.lite_topic] != 1), "")
                for message in (m for m in batch if m.lite_topic == nacked_topic):
                    consumer.change_invisible_duration(message, 1)
                    nacked.add((message.lite_topic, message.body))
            for message in batch:
                key = (message.lite_topic, message.body)
                if key in nacked and message.delivery_attempt == 1:
                    continue  # nacked just now: it comes back
                if message.lite_topic == nacked_topic:  # nothing of it after the nacked ones before they came back
                    assert key in nacked or nacked <= set(got), (key, nacked)
                assert message.delivery_attempt == (2 if key in nacked else 1)
                consumer.ack(message)
                got.append(key)
        assert len(got) == len(sent) and set(got) == sent, f"got {len(got)} of {len(sent)}"  # each once
        assert nacked
        for lite in lites:
            bodies = [body for name, body in got if name == lite]
            assert bodies == sorted(bodies)  # in order per lite topic
        for i, endpoint in enumerate(endpoints):  # every ack reached the broker holding the message
            with AdminClient(endpoint, timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
                for lite in (lite for lite in lites if placed[lite] == i):
                    assert admin.describe_lite_topic(TOPIC, lite).group_offsets[GROUP] == 3
    finally:
        stop_all(clients, brokers)


# --- lite topic patterns across brokers ----------------------------------------------------------------------
@contextlib.contextmanager
def two_brokers(tmp_path: Path, kind: str) -> Iterator[tuple[str, list[str]]]:
    """(access endpoint, each broker's endpoint): two ``--peers`` brokers (the client dials the second), or one
    ``serve --processes 2`` pod (the client dials the shared port, the kernel picks the process)."""
    if kind == "processes":
        with start_broker(
            tmp_path / "data", extra_args=["--processes", "2", "--no-bootstrap"], env=SHARED_ADMIN_ENV
        ) as pod:
            yield pod.endpoint, process_endpoints(pod)
        return
    brokers = start_cluster(tmp_path, free_ports("127.0.0.1", 2))
    try:
        yield brokers[1].endpoint, [b.endpoint for b in brokers]
    finally:
        for broker in brokers:
            broker.stop()


def wait_committed(endpoints: list[str], lites: list[str], group: str, want: int) -> None:
    placed = holders(endpoints, TOPIC, SHARED_ADMIN_KEYS)
    for lite in lites:
        with AdminClient(endpoints[placed[lite][0]], timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
            eventually(
                lambda: admin.describe_lite_topic(TOPIC, lite).group_offsets.get(group) == want,  # noqa: B023
                f"{lite}: offset {want} committed",
                interval_s=0.05,
            )


def send_each(producer: Any, lites: list[str], n: int) -> set[tuple[str, bytes]]:
    sent = set()
    for lite in lites:
        body = f"{lite}/p/{n:04d}".encode()
        send(producer, lite, body)
        sent.add((lite, body))
    return sent


@pytest.mark.parametrize("kind", ["peers", "processes"])
def test_patterns_take_the_matching_topics_of_every_broker(tmp_path: Path, clients: list[Any], kind: str) -> None:
    """``subscribe_lite("job-*")`` and ``("dev/+/cmd")`` through one access endpoint reach both brokers: each
    delivers its matching topics (waiting messages first), none of the others, each message once and in order
    per topic; unsubscribing stops it on both; a restarted consumer resumes from both brokers' offsets."""
    with two_brokers(tmp_path, kind) as (access, endpoints):
        create_metadata(endpoints, SHARED_ADMIN_KEYS)
        jobs, devs = [f"job-{i}" for i in range(12)], [f"dev_{i}_cmd" for i in range(8)]
        others = [f"jo-{i}" for i in range(4)] + [f"dev_{i}_cmd_x" for i in range(4)] + ["dev_cmd", "other"]
        producer = Producer(config(access), (TOPIC,))
        producer.startup()
        clients.append(producer)
        wanted = send_each(producer, jobs, 0)  # waiting when the pattern comes: each broker finds its own
        inbox = Inbox()
        consumer = LitePushConsumer(config(access), GROUP, TOPIC, inbox)
        consumer.startup()
        clients.append(consumer)
        consumer.subscribe_lite("job-*")
        consumer.subscribe_lite("dev/+/cmd")
        for n in (1, 2):
            wanted |= send_each(producer, jobs + devs, n)
            send_each(producer, others, n)
        check_received(inbox, wanted, producer)
        placed = holders(endpoints, TOPIC, SHARED_ADMIN_KEYS)
        assert {placed[lite][0] for lite in jobs} == {0, 1} and {placed[lite][0] for lite in devs} == {0, 1}
        consumer.unsubscribe_lite("job-*")
        send_each(producer, jobs, 3)
        wanted |= send_each(producer, devs, 3)
        check_received(inbox, wanted, producer, devs)  # no job-* message since, from either broker
        wait_committed(endpoints, devs, GROUP, 5)  # rounds 1-3 and two barriers: every ack arrived, none comes again
        consumer.shutdown()
        clients.remove(consumer)
        restarted = send_each(producer, devs, 4)
        again = Inbox()
        consumer = LitePushConsumer(config(access), GROUP, TOPIC, again)
        consumer.startup()
        clients.append(consumer)
        consumer.subscribe_lite("dev/+/cmd")
        check_received(again, restarted, producer)  # only what came since: nothing acked is delivered again
        for client in reversed(clients):
            client.shutdown()
        clients.clear()


def test_a_wildcard_groups_patterns_apply_on_every_broker(tmp_path: Path, clients: list[Any]) -> None:
    """A wildcard group with ``litePatterns``: ``subscribe_lite_all()`` through one access endpoint registers
    the client on both brokers, and each delivers its topics the group's patterns match, waiting ones too."""
    with two_brokers(tmp_path, "peers") as (access, endpoints):
        create_metadata(endpoints, SHARED_ADMIN_KEYS)
        for endpoint in endpoints:
            with AdminClient(endpoint, timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
                admin.put_group(model.LiteGroup("wild-group", TOPIC, wildcard=True, lite_patterns=("eu/+",)))
        eu, us = [f"eu_{i}" for i in range(10)], [f"us_{i}" for i in range(4)] + ["eu_1_x"]
        producer = Producer(config(access), (TOPIC,))
        producer.startup()
        clients.append(producer)
        wanted = send_each(producer, eu, 0)
        inbox = Inbox()
        consumer = LitePushConsumer(config(access), "wild-group", TOPIC, inbox)
        consumer.startup()
        clients.append(consumer)
        consumer.subscribe_lite_all()
        wanted |= send_each(producer, eu, 1)
        send_each(producer, us, 1)
        check_received(inbox, wanted, producer)
        assert {holders(endpoints, TOPIC, SHARED_ADMIN_KEYS)[lite][0] for lite in eu} == {0, 1}
        for client in reversed(clients):
            client.shutdown()
        clients.clear()


def test_a_lite_simple_consumers_pattern_gathers_from_every_broker(tmp_path: Path, clients: list[Any]) -> None:
    """The LiteSimpleConsumer receives through the broker it dialled, which gathers from the other for it: a pattern the
    client subscribed through one endpoint is known on both, so both brokers' matching topics come."""
    with two_brokers(tmp_path, "peers") as (access, endpoints):
        create_metadata(endpoints, SHARED_ADMIN_KEYS)
        consumer = LiteSimpleConsumer(TOPIC, config(access), GROUP, await_duration=2)
        clients.append(consumer)
        start_lite_simple_consumer(consumer)
        consumer.subscribe_lite("q/#")
        producer = Producer(config(access), (TOPIC,))
        producer.startup()
        clients.append(producer)
        lites = [f"q_{i}" for i in range(10)]
        sent = send_each(producer, lites, 0) | send_each(producer, lites, 1)
        send_each(producer, ["qq_1", "r_1", "other"], 0)
        got: list[tuple[str, bytes]] = []

        def take() -> None:
            for message in consumer.receive(16, 10):
                consumer.ack(message)
                got.append((message.lite_topic, message.body))

        deadline = time.monotonic() + 60
        while len(got) < len(sent) and time.monotonic() < deadline:
            take()
        take()  # one more long poll (2 s): a duplicate or a message of another topic would come now
        assert sorted(got) == sorted(sent)  # each once, nothing of the others
        for lite in lites:
            assert [body for name, body in got if name == lite] == sorted(body for name, body in sent if name == lite)
        assert {holders(endpoints, TOPIC, SHARED_ADMIN_KEYS)[lite][0] for lite in lites} == {0, 1}
        for client in reversed(clients):
            client.shutdown()
        clients.clear()


@pytest.mark.parametrize("kind", ["peers", "processes"])
def test_a_topic_created_through_one_endpoint_takes_sends_through_every_broker(
    tmp_path: Path, clients: list[Any], kind: str
) -> None:
    """Issue 25: a parent topic created with one admin call (on the access endpoint: one broker, or the process
    the kernel picked) takes the official producer's sends through every broker; before, every broker but the
    one told answered "failed to fetch topic route" (40 of 40 sends failed)."""
    with two_brokers(tmp_path, kind) as (access, endpoints):
        with AdminClient(access, timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
            admin.put_parent_topic(model.ParentTopic(TOPIC, model.MessageType.LITE))
        lites = [f"e-{i}" for i in range(20)]
        for n, endpoint in enumerate(endpoints):
            producer = Producer(config(endpoint), (TOPIC,))
            producer.startup()
            clients.append(producer)
            for lite in lites:
                assert send(producer, lite, f"{lite}/{n}".encode()).message_id
        placed = holders(endpoints, TOPIC, SHARED_ADMIN_KEYS)
        assert sorted(placed) == sorted(lites) and {where[0] for where in placed.values()} == {0, 1}
        for endpoint in endpoints:
            with AdminClient(endpoint, timeout_s=10, **SHARED_ADMIN_KEYS) as each:
                assert each.get_parent_topic(TOPIC).topic.message_type is model.MessageType.LITE


def test_scale_down_3_to_2_moves_normal_messages_nobody_consumed_yet(tmp_path: Path, clients: list[Any]) -> None:
    """A NORMAL topic with the official Producer and SimpleConsumer: messages sent before slot 2 leaves land on
    all three brokers; sends go on while it leaves (it refuses them, the producer sends them elsewhere), then it
    drains (its messages are copied to the remaining brokers) and is removed and stopped. A consumer that
    starts only then receives every message sent, from the two brokers left."""
    ports = free_ports("127.0.0.1", 3)
    brokers = start_cluster(tmp_path, ports)
    try:
        endpoints = [b.endpoint for b in brokers]
        with AdminClient(endpoints[0], timeout_s=10, **SHARED_ADMIN_KEYS) as admin:  # sent on to every member
            admin.put_parent_topic(model.ParentTopic("orders", model.MessageType.NORMAL))
        producer = Producer(config(endpoints[0]), ("orders",))
        producer.startup()
        clients.append(producer)
        sent: set[str] = set()

        def send_normal(n: int) -> None:
            message = Message()
            message.topic, message.body = "orders", f"order-{n}".encode()
            producer.send(message)
            sent.add(f"order-{n}")

        for n in range(60):
            send_normal(n)
        set_cluster(endpoints, [2, 0, 1], endpoints, (3, 2))
        for n in range(60, 90):  # slot 2 refuses them now: the producer's retry sends them to another broker
            send_normal(n)
        with AdminClient(endpoints[2], timeout_s=30, **SHARED_ADMIN_KEYS) as admin:
            eventually(
                lambda: admin.cluster(with_undrained=True).drained, "slot 2 drained", timeout_s=60, interval_s=0.5
            )
        set_cluster(endpoints, [0, 1, 2], endpoints[:2], (3, 2))
        with urllib.request.urlopen(f"{brokers[2].metrics_url}/metrics", timeout=10) as answer:
            copied = re.search(r"^lmq_relocated_messages_total (\S+)$", answer.read().decode(), re.MULTILINE)
        assert copied is not None and float(copied.group(1)) >= 10  # about a third of the first 60 were there
        brokers[2].stop()
        consumer = SimpleConsumer(config(endpoints[0]), "order-readers", {"orders": FilterExpression()}, 5)
        consumer.startup()
        clients.append(consumer)
        got: list[str] = []

        def received_all() -> bool:
            for message in consumer.receive(32, 15):
                got.append(message.body.decode())
                consumer.ack(message)
            return set(got) >= sent

        eventually(received_all, "every order received from the brokers left", timeout_s=120, interval_s=0)
        assert len(got) == len(sent)  # nobody consumed before: none copied twice
    finally:
        stop_all(clients, brokers)
