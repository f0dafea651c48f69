"""Consumers after a failover with the official clients (docs/replication.md): two broker processes with
--replicas 2 on a real kube-apiserver + etcd, a producer sending all along and a consumer, both through the
broker that survives (a Service's pick). kill -9 of the topics' owner, its disk deleted: the consumer keeps
receiving from the new lease holder with the clients' own retries, and every acknowledged send is delivered.

* the Python client 5.1.2's Producer and LitePushConsumer (acked messages not delivered again is counted with
  lmq's own stubs there, where the test sees each ack's answer: tests/broker/replication/test_replication_failover.py);
* the Java client 5.2.0's Producer (its driver, tests/clients/java) and the Python client's LiteSimpleConsumer
  (Java 5.2.0 has none), whose acks the test sees: none of a message whose ack was answered OK comes again;
* the Java client 5.2.0's LitePushConsumer (which acks on its own: the test sees no ack's answer, so it checks that
  messages whose commit points were on both replicas before the kill are not delivered again).
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from rocketmq import ClientConfiguration, Credentials, LitePushConsumer, LiteSimpleConsumer, Message, Producer
from testing_clients import Driver, DriverError, DriverMissing, b64, driver_argv, start_driver, unb64
from waiting import eventually

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.cluster import membership as mb
from lmq_broker.replication import kube as kube_api
from lmq_broker.supervisor import free_ports
from lmq_broker.testing import BrokerProcess, Inbox, start_broker, start_lite_simple_consumer
from lmq_operator import testing as kube_testing

PARENT, GROUP = "AGENT_TASK_NS", "executor-group"  # the bootstrap parent and lite group
LEASE_MS = 1500
FIRST_DELIVERY_BOUND_S = 6.0  # well under the client's route refresh (10 s after start, then every 30 s)
POINTERS = Path(__file__).resolve().parents[2] / "build" / "clients"


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


def start(
    tmp_path: Path, kube: kube_testing.KubeAPI, members: list[str], slot: int, prefix: str = "e2e-consumers"
) -> BrokerProcess:
    token = tmp_path / "token"
    token.write_text(kube.token)
    port = members[slot].rsplit(":", 1)[1]
    flags = ["--peers", ",".join(members), "--ordinal", str(slot), "--advertised-address", members[slot]]
    flags += ["--admin-access-key", "ak", "--admin-secret-key", "sk", "--flush-mode", "sync"]
    flags += ["--replicas", "2", "--lease-namespace", "default", "--lease-prefix", prefix]
    flags += ["--lease-duration-ms", str(LEASE_MS), "--kube-api-server", kube.server]
    flags += ["--kube-token-file", str(token), "--kube-ca-file", str(kube.ca_file)]
    return start_broker(tmp_path / f"b{slot}", int(port), flags)


def pair(
    tmp_path: Path, kube: kube_testing.KubeAPI, prefix: str, letter: str
) -> tuple[list[str], list[BrokerProcess], list[str], Callable[[int], bool]]:
    """Two brokers with --replicas 2 (leases ``<prefix>-slot-<s>``): their addresses, the processes, four lite
    topics of slot 0 (``<letter><i>``), and whether slot 0's lease is held by the broker of a slot."""
    members = [f"127.0.0.1:{p}" for p in free_ports("127.0.0.1", 2)]
    brokers = [start(tmp_path, kube, members, slot, prefix) for slot in (0, 1)]
    api = kube_api.ApiServer(kube.server, kube.token, kube.ca_file, "default")
    membership = mb.Membership.parse(",".join(members))
    lites = [
        f"{letter}{i}"
        for i in range(1000)
        if mb.owner(membership, model.QueueId.lmq(PARENT, f"{letter}{i}").topic) == 0
    ]

    def holder_is(slot: int) -> bool:
        got = api.get(f"{prefix}-slot-0")
        return got is not None and got.holder.startswith(f"slot-{slot}/")

    return members, brokers, lites[:4], holder_is


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
    members, brokers, lites, holder_is = pair(tmp_path, kube, "e2e-consumers", "t")
    listener = Listener(members[1])
    consumed, by_holder, flowing = listener.consumed, listener.by_holder, listener.flowing
    inbox = Inbox(listener.accept)
    clients: list[Any] = []
    stop, sent = threading.Event(), list[bytes]()
    thread = threading.Thread(target=lambda: None)
    first, waiting = 0.0, 0

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


def java_produce(driver: Driver, lites: list[str], stop: threading.Event, sent: list[bytes], at: list[float]) -> None:
    """The Java client's sends, one at a time, each with the client's own retries; those answered OK in ``sent``
    (and when, in ``at``)."""
    n = 0
    while not stop.is_set():
        body = f"j{n}".encode()
        try:
            driver.call("send", 30, producer="p", topic=PARENT, body=b64(body), lite_topic=lites[n % len(lites)])
        except DriverError:
            time.sleep(0.05)  # refused after the client's retries (no lease holder, too few replicas): not acked
        else:
            sent.append(body)
            at.append(time.monotonic())
        n += 1


def record_of(message: Any) -> tuple[str, int]:
    """The stored record a delivery is of: its lite topic and offset, from lmq's receipt handle (the replicas
    hold each record at the same offset). A send the client retried after it was stored is two records with
    one body (at-least-once for a send that failed), each delivered once."""
    tokens = str(message.receipt_handle).split(" ")
    at = next(i for i, t in enumerate(tokens) if t.startswith(model.LMQ_PREFIX))
    return tokens[at], int(tokens[at + 2])


class SimpleReader:
    """A LiteSimpleConsumer's receive-and-ack loop (on a thread): each delivery with when its receive began and
    when it came, the records whose ack was answered OK, and every delivery of one of those again."""

    def __init__(self, consumer: Any) -> None:
        self._consumer = consumer
        self.deliveries: list[tuple[bytes, float, float]] = []  # (body, its receive began, received)
        self.acked: set[tuple[str, int]] = set()  # records whose ack was answered OK
        self.again_after_ack: list[tuple[str, int]] = []
        self.records: dict[bytes, set[tuple[str, int]]] = {}  # body -> the records it came as
        self.log: list[str] = []  # each delivery and ack, for a failure's message
        self.failed_acks = 0
        self.flowing, self.stop = threading.Event(), threading.Event()
        self.flowing.set()

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.flowing.wait(0.2):
                continue
            began = time.monotonic()
            try:
                batch = self._consumer.receive(16, 15)
            except Exception as exc:  # the broker it reads from is down: the client's next receive goes on
                self.log.append(f"{time.monotonic():.2f} receive failed: {exc}")
                time.sleep(0.1)
                continue
            for message in batch:
                body, record = bytes(message.body), record_of(message)
                if record in self.acked:
                    self.again_after_ack.append(record)
                self.records.setdefault(body, set()).add(record)
                self.deliveries.append((body, began, time.monotonic()))
                self.log.append(f"{time.monotonic():.2f} got {body!r} {record} attempt {message.delivery_attempt}")
                try:
                    self._consumer.ack(message)
                except Exception as exc:  # refused (too few replicas stored it): delivered again, at-least-once
                    self.failed_acks += 1
                    self.log.append(f"{time.monotonic():.2f} ack {body!r} refused: {exc}")
                else:
                    self.acked.add(record)
                    self.log.append(f"{time.monotonic():.2f} ack {body!r} OK")

    def received_since(self, moment: float) -> list[float]:
        """When deliveries came whose receive began after ``moment``."""
        return [got for _, began, got in self.deliveries if began > moment]

    def consumed(self) -> set[bytes]:
        return {body for body, _, _ in self.deliveries}


def java_producer(tmp_path: Path, endpoint: str) -> Driver:
    """The Java driver with a Producer "p" of the parent, dialling ``endpoint``."""
    try:
        argv = driver_argv(POINTERS, "java")
    except DriverMissing as missing:
        pytest.fail(str(missing), pytrace=False)
    driver = start_driver(argv, "java", endpoint, tmp_path)
    driver.call("producer", name="p", topics=[PARENT])
    return driver


def lite_simple(endpoint: str, lites: list[str]) -> Any:
    consumer = LiteSimpleConsumer(PARENT, config(endpoint), GROUP, await_duration=2)
    start_lite_simple_consumer(consumer)
    for lite in lites:
        consumer.subscribe_lite(lite)
    return consumer


def in_sync(broker: BrokerProcess, slot: int) -> bool:
    with urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=5) as response:
        return f'lmq_replication_in_sync{{slot="{slot}"}} 1.0' in response.read().decode().splitlines()


def goes_on_after(  # noqa: PLR0917 (the reader, the kill, the restart, the producer)
    reader: SimpleReader,
    killed: float,
    taken: tuple[Callable[[], bool], str],
    restart: Callable[[], None],
    sent: list[bytes],
    stop: threading.Event,
    producer: threading.Thread,
) -> float:
    """After a kill -9 with a backlog held at the reader: the first delivery's delay after the kill; then, once
    the lease is ``taken``, the killed broker back (``restart``), sends acknowledged again, the producer
    stopped, and every acknowledged send received."""
    reader.flowing.set()
    eventually(lambda: reader.received_since(killed), "a delivery after the kill", 60)
    first = reader.received_since(killed)[0] - killed
    eventually(*taken)
    restart()
    before = len(sent)
    eventually(lambda: len(sent) >= before + 20, "sends acknowledged again", 60)
    stop.set()
    producer.join()
    eventually(lambda: set(sent) <= reader.consumed(), "every acknowledged send received", 60)
    return first


def stop_reading(stop: threading.Event, reader: SimpleReader | None, threads: list[threading.Thread]) -> None:
    stop.set()
    if reader is not None:
        reader.stop.set()
        reader.flowing.set()
    for thread in threads:
        thread.join()


def test_a_java_producer_and_a_lite_simple_consumer_go_on_across_kill_9_of_the_owner(tmp_path: Path, kube: Any) -> None:
    members, brokers, lites, holder_is = pair(tmp_path, kube, "e2e-java", "j")
    stop, sent, sent_at = threading.Event(), list[bytes](), list[float]()
    threads: list[threading.Thread] = []
    driver: Driver | None = None
    consumer: Any = None
    reader: SimpleReader | None = None
    first, waiting, killed = 0.0, 0, 0.0

    try:
        eventually(lambda: holder_is(0), "the owner holds its lease")
        eventually(lambda: in_sync(brokers[1], 0), "the follower in sync")
        driver = java_producer(tmp_path, members[1])
        consumer = lite_simple(members[1], lites)
        reader = SimpleReader(consumer)
        threads = [
            threading.Thread(target=reader.run, name="reader"),
            threading.Thread(target=java_produce, args=(driver, lites, stop, sent, sent_at), name="producer"),
        ]
        for thread in threads:
            thread.start()
        eventually(lambda: len(reader.acked) >= 20, "20 messages received and acked", 30)
        reader.flowing.clear()  # a backlog at the owner: acknowledged, not received yet
        eventually(lambda: len(set(sent) - reader.consumed()) >= 20, "a backlog at the owner", 30)
        brokers[0].kill()
        killed = time.monotonic()
        reader.log.append(f"{killed:.2f} kill -9 of the owner")
        shutil.rmtree(tmp_path / "b0")  # its disk is gone too
        waiting = len(set(sent) - reader.consumed())

        def restart() -> None:
            brokers[0] = start(tmp_path, kube, members, 0, "e2e-java")  # a follower, on an empty disk

        taken = (functools.partial(holder_is, 1), "the follower holds the lease")
        first = goes_on_after(reader, killed, taken, restart, sent, stop, threads[1])
    finally:
        stop_reading(stop, reader, threads)
        if consumer is not None:
            consumer.shutdown()
        if driver is not None:
            driver.close()
        for b in brokers:
            if b.alive():
                b.stop()
    assert reader is not None
    print(
        f"\njava producer + LiteSimpleConsumer: first delivery {first:.2f} s after kill -9 (lease {LEASE_MS} ms, "
        f"load {os.getloadavg()[0]:.1f}; "
        f"{waiting} acknowledged but not received at the kill); first send acknowledged after it "
        f"{next((t for t in sent_at if t > killed), killed) - killed:.2f} s (the old owner back on an empty disk); "
        f"{len(sent)} sends acknowledged, "
        f"{len(reader.deliveries)} deliveries, {len(reader.acked)} acks answered OK, {reader.failed_acks} refused, "
        f"{len(set(sent) - reader.consumed())} lost, {sum(len(r) > 1 for r in reader.records.values())} stored twice "
        f"(a send retried), {len(reader.again_after_ack)} acked ones delivered again"
    )
    # It receives from the first route queue only: the broker it dialled, which gathers and follows the lease.
    assert first <= FIRST_DELIVERY_BOUND_S, "\n".join(reader.log[-40:])
    again = set(reader.again_after_ack)
    assert not again, "\n".join(line for line in reader.log if any(str(a) in line for a in again))


def drained(endpoint: str, lites: list[str]) -> bool:
    """The group's commit point of each lite topic is its end in the store of the broker at ``endpoint``: every
    message stored there was acknowledged, and (at a follower) that commit point was copied to it."""
    with AdminClient(endpoint, timeout_s=5, access_key="ak", secret_key="sk") as admin:
        for lite in lites:
            topic = admin.describe_lite_topic(PARENT, lite)
            if topic.group_offsets.get(GROUP) != topic.meta.max_offset:
                return False
    return True


def test_a_java_lite_push_consumer_consumes_every_acknowledged_send_across_kill_9_of_the_owner(
    tmp_path: Path, kube: Any
) -> None:
    """The Java client 5.2.0's LitePushConsumer and Producer (one driver) through the broker that survives. First
    20 sends consumed and their commit points on both replicas; then sends all along, kill -9 of the owner with
    its disk deleted, the old owner back on an empty disk. Every acknowledged send is consumed, and none of the
    first 20 (acked, their commit points on both replicas) is delivered again by the new holder."""
    members, brokers, lites, holder_is = pair(tmp_path, kube, "e2e-java-push", "k")
    stop, sent, sent_at = threading.Event(), list[bytes](), list[float]()
    producing = threading.Thread(target=lambda: None)
    driver: Driver | None = None
    first, killed, before_kill = 0.0, 0.0, 0

    def consumed() -> list[bytes]:
        assert driver is not None
        return [unb64(m["body"]) for m in driver.messages("c")]

    try:
        eventually(lambda: holder_is(0), "the owner holds its lease")
        eventually(lambda: in_sync(brokers[1], 0), "the follower in sync")
        driver = java_producer(tmp_path, members[1])
        driver.call("lite_push", name="c", group=GROUP, topic=PARENT)
        for lite in lites:
            driver.call("subscribe_lite", consumer="c", lite_topic=lite)
        for n in range(20):
            driver.call("send", 30, producer="p", topic=PARENT, body=b64(f"a{n}".encode()), lite_topic=lites[n % 4])
        early = {f"a{n}".encode() for n in range(20)}
        eventually(lambda: early <= set(consumed()), "the first 20 consumed", 30)
        eventually(lambda: all(drained(m, lites) for m in members), "their commit points on both replicas", 30)
        producing = threading.Thread(target=java_produce, args=(driver, lites, stop, sent, sent_at), name="producer")
        producing.start()
        eventually(lambda: len(set(sent) & set(consumed())) >= 20, "sends consumed under load", 30)
        brokers[0].kill()
        killed, before_kill = time.monotonic(), len(consumed())
        shutil.rmtree(tmp_path / "b0")  # its disk is gone too
        eventually(lambda: len(consumed()) > before_kill, "a delivery after the kill", 60, interval_s=0.01)
        first = time.monotonic() - killed
        eventually(lambda: holder_is(1), "the follower holds the lease")
        brokers[0] = start(tmp_path, kube, members, 0, "e2e-java-push")  # a follower, on an empty disk
        before = len(sent)
        eventually(lambda: len(sent) >= before + 20, "sends acknowledged again", 60)
        stop.set()
        producing.join()
        eventually(lambda: set(sent) <= set(consumed()), "every acknowledged send consumed", 60)
    finally:
        stop.set()
        if producing.is_alive():
            producing.join()
        if driver is not None:
            driver.close()
        for b in brokers:
            if b.alive():
                b.stop()
    got = consumed()
    again = [body for body in got if body in early and got.count(body) > 1]
    print(
        f"\njava LitePushConsumer: a delivery {first:.2f} s after kill -9 (lease {LEASE_MS} ms, load "
        f"{os.getloadavg()[0]:.1f}); first send acknowledged after it "
        f"{next((t for t in sent_at if t > killed), killed) - killed:.2f} s; {len(sent)} sends acknowledged, "
        f"{len(got)} deliveries of {len(set(got))} bodies, {len(set(sent) - set(got))} lost, "
        f"{len(set(again))} of the 20 acked before delivered again"
    )
    assert not again, f"acked before the kill, their commit points on both replicas, delivered again: {again}"


def test_a_lite_simple_consumer_through_a_broker_holding_no_lease_goes_on_when_the_holder_dies(
    tmp_path: Path, kube: Any
) -> None:
    """The old owner back as a follower holds no lease. A LiteSimpleConsumer that dialled it reads its first
    readable route queue only: that broker itself (listed READ, first, in its route of a LITE parent), which
    gathers from the holder. When the holder dies (kill -9), the consumer goes on from the same broker, which
    takes the lease over, well within its client's route refresh; no record whose ack was answered OK comes again."""
    members, brokers, lites, holder_is = pair(tmp_path, kube, "e2e-leaseless", "n")
    stop, sent = threading.Event(), list[bytes]()
    threads: list[threading.Thread] = []
    clients: list[Any] = []
    reader: SimpleReader | None = None
    first, killed = 0.0, 0.0

    try:
        eventually(lambda: holder_is(0), "the owner holds its lease")
        eventually(lambda: in_sync(brokers[1], 0), "the follower in sync")
        brokers[0].kill()
        eventually(lambda: holder_is(1), "the follower holds the lease")
        brokers[0] = start(tmp_path, kube, members, 0, "e2e-leaseless")  # back on its disk: a follower
        eventually(lambda: in_sync(brokers[0], 0) and in_sync(brokers[0], 1), "the old owner in sync again", 60)
        producer = Producer(config(members[0]), (PARENT,))
        producer.startup()
        clients.append(producer)
        consumer = lite_simple(members[0], lites)
        clients.append(consumer)
        reader = SimpleReader(consumer)
        threads = [
            threading.Thread(target=reader.run, name="reader"),
            threading.Thread(target=produce, args=(producer, lites, stop, sent), name="producer"),
        ]
        for thread in threads:
            thread.start()
        eventually(lambda: len(reader.acked) >= 20, "20 messages received and acked", 30)
        reader.flowing.clear()  # a backlog at the holder: acknowledged, not received yet
        eventually(lambda: len(set(sent) - reader.consumed()) >= 20, "a backlog at the holder", 30)
        brokers[1].kill()
        killed = time.monotonic()
        reader.log.append(f"{killed:.2f} kill -9 of the holder")

        def restart() -> None:
            brokers[1] = start(tmp_path, kube, members, 1, "e2e-leaseless")  # on its disk: sends go on (M = 2)

        taken = (functools.partial(holder_is, 0), "the old owner holds the lease again")
        first = goes_on_after(reader, killed, taken, restart, sent, stop, threads[1])
    finally:
        stop_reading(stop, reader, threads)
        for client in clients:
            client.shutdown()
        for b in brokers:
            if b.alive():
                b.stop()
    assert reader is not None
    print(
        f"\nLiteSimpleConsumer through a broker holding no lease: first delivery {first:.2f} s after kill -9 of the "
        f"holder (lease {LEASE_MS} ms, load {os.getloadavg()[0]:.1f}); {len(sent)} sends acknowledged, "
        f"{len(reader.deliveries)} deliveries, {len(set(sent) - reader.consumed())} lost, "
        f"{len(reader.again_after_ack)} acked ones delivered again"
    )
    at_kill = next(i for i, line in enumerate(reader.log) if "kill -9" in line)
    assert first <= FIRST_DELIVERY_BOUND_S, "\n".join(reader.log[max(0, at_kill - 10) : at_kill + 30])
    again = set(reader.again_after_ack)
    assert not again, "\n".join(line for line in reader.log if any(str(a) in line for a in again))
