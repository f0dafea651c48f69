"""Consumers after a failover with the official Python client 5.1.2 (docs/replication.md): two broker processes
with --replicas 2 on a real kube-apiserver + etcd, a Producer sending all along and a LitePushConsumer, both
through the broker that survives (a Service's pick). kill -9 of the topics' owner, its disk deleted: the
consumer keeps receiving from the new lease holder with the client's own retries, and every acknowledged send
is delivered. (Acked messages not delivered again is counted with lmq's own stubs, where the test sees each
ack's answer: tests/broker/replication/test_replication_failover.py.)"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rocketmq import ClientConfiguration, Credentials, LitePushConsumer, Message, Producer
from waiting import eventually

from lmq_broker import model
from lmq_broker.cluster import membership as mb
from lmq_broker.replication import kube as kube_api
from lmq_broker.supervisor import free_ports
from lmq_broker.testing import BrokerProcess, Inbox, start_broker
from lmq_operator import testing as kube_testing

PARENT, GROUP = "AGENT_TASK_NS", "executor-group"  # the bootstrap parent and lite group
LEASE_MS = 1500


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[kube_testing.KubeAPI]:
    try:
        env = kube_testing.testenv(tmp_path_factory.mktemp("consumers-testenv"))
        api = env.__enter__()
    except kube_testing.TestenvMissing as missing:
        pytest.fail(str(missing), pytrace=False)
    try:
        yield api
    finally:
        env.__exit__(None, None, None)


def start(tmp_path: Path, kube: kube_testing.KubeAPI, members: list[str], slot: int) -> BrokerProcess:
    token = tmp_path / "token"
    token.write_text(kube.token)
    port = members[slot].rsplit(":", 1)[1]
    flags = ["--peers", ",".join(members), "--ordinal", str(slot), "--advertised-address", members[slot]]
    flags += ["--admin-access-key", "ak", "--admin-secret-key", "sk", "--flush-mode", "sync"]
    flags += ["--replicas", "2", "--lease-namespace", "default", "--lease-prefix", "e2e-consumers"]
    flags += ["--lease-duration-ms", str(LEASE_MS), "--kube-api-server", kube.server]
    flags += ["--kube-token-file", str(token), "--kube-ca-file", str(kube.ca_file)]
    return start_broker(tmp_path / f"b{slot}", int(port), flags)


def config(endpoint: str) -> Any:
    return ClientConfiguration(endpoint, Credentials(), request_timeout=5)


def produce(producer: Any, lites: list[str], stop: threading.Event, sent: list[bytes]) -> None:
    n = 0
    while not stop.is_set():
        message = Message()
        message.topic, message.lite_topic, message.body = PARENT, lites[n % len(lites)], f"{n}".encode()
        try:
            producer.send(message)
        except Exception:
            time.sleep(0.05)  # refused (no lease holder, too few replicas): not acknowledged, the next one goes
        else:
            sent.append(message.body)
        n += 1


class Listener:
    """What the consumer consumed and when; which of it the survivor (``holder``) delivered; ``flowing`` cleared
    holds the listener on, so a backlog builds up at the owner."""

    def __init__(self, holder: str) -> None:
        self._port = holder.rsplit(":", 1)[1]
        self.consumed: dict[bytes, float] = {}
        self.by_holder: list[float] = []
        self.flowing = threading.Event()
        self.flowing.set()

    def accept(self, message: Any) -> bool:
        self.flowing.wait()
        self.consumed.setdefault(message.body, time.monotonic())
        if str(message.endpoints).endswith(self._port):
            self.by_holder.append(time.monotonic())
        return True


def test_an_official_push_consumer_keeps_receiving_from_the_new_holder(tmp_path: Path, kube: Any) -> None:
    members = [f"127.0.0.1:{p}" for p in free_ports("127.0.0.1", 2)]
    brokers = [start(tmp_path, kube, members, slot) for slot in (0, 1)]
    api = kube_api.ApiServer(kube.server, kube.token, kube.ca_file, "default")
    membership = mb.Membership.parse(",".join(members))
    lites = [f"t{i}" for i in range(1000) if mb.owner(membership, model.QueueId.lmq(PARENT, f"t{i}").topic) == 0][:4]
    listener = Listener(members[1])
    consumed, by_holder, flowing = listener.consumed, listener.by_holder, listener.flowing
    inbox = Inbox(listener.accept)
    clients: list[Any] = []
    stop, sent = threading.Event(), list[bytes]()
    thread = threading.Thread(target=lambda: None)
    first, waiting = 0.0, 0

    def holder_is(slot: int) -> bool:
        got = api.get("e2e-consumers-slot-0")
        return got is not None and got.holder.startswith(f"slot-{slot}/")

    try:
        eventually(lambda: holder_is(0), "the owner holds its lease")
        consumer = LitePushConsumer(config(members[1]), GROUP, PARENT, inbox)
        consumer.startup()
        clients.append(consumer)
        for lite in lites:
            consumer.subscribe_lite(lite)
        producer = Producer(config(members[1]), (PARENT,))
        producer.startup()
        clients.append(producer)
        thread = threading.Thread(target=produce, args=(producer, lites, stop, sent))
        thread.start()
        assert inbox.wait_for(lambda i: len(i.accepted) >= 20, 30), "the consumer received 20 messages"
        assert not by_holder  # the owner delivers its topics
        flowing.clear()
        held = len(sent)
        eventually(lambda: len(sent) >= held + 20, "a backlog at the owner", 30)
        brokers[0].kill()
        killed = time.monotonic()
        shutil.rmtree(tmp_path / "b0")  # its disk is gone too
        waiting = len(set(sent) - set(consumed))
        flowing.set()
        assert inbox.wait_for(lambda i: bool(by_holder), 60), "a delivery from the new holder"
        first = by_holder[0] - killed
        eventually(lambda: holder_is(1), "the follower holds the lease")
        brokers[0] = start(tmp_path, kube, members, 0)  # a follower, on an empty disk: sends acknowledged again
        before = len(sent)
        eventually(lambda: len(sent) >= before + 20, "sends acknowledged again", 60)
        stop.set()
        thread.join()
        assert inbox.wait_for(lambda i: set(sent) <= set(consumed), 60), "every acknowledged send consumed"
    finally:
        stop.set()
        flowing.set()
        if thread.is_alive():
            thread.join()
        for client in clients:
            client.shutdown()
        for b in brokers:
            if b.alive():
                b.stop()
    print(
        f"\nofficial client: first consumed from the new holder {first:.2f} s after kill -9 (lease {LEASE_MS} ms; "
        f"{waiting} acknowledged but not consumed at the kill); {len(sent)} sends acknowledged, "
        f"{len(inbox.seen)} deliveries, {len(set(sent) - set(consumed))} lost"
    )
