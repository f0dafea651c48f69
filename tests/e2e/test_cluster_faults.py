"""The cluster at its seams (issue 25), with real broker processes, the official Python client 5.1.2 and
paho-mqtt (the official Java client: tests/clients/test_cluster_faults_java.py).

One scenario per test, each bounded in time, each counting per lite topic what was sent (attempts), acknowledged
(the producer's receipt, a PUBACK), received, received twice (``stored_twice``: a send retried after it was
stored) and received out of order, and failing on any acknowledged message not delivered, any message whose
ack the owner had committed before a kill delivered again, any lite topic held by two brokers, or any
subscription not restored:

* a forged peer marker on a client's send (``x-lmq-forwarded``, a made-up ``x-lmq-peer``) stores nothing
  anywhere but at the owner;
* kill -9 of an owner while a consumer (through another broker) is subscribed to its topics, a subscription to
  more of its topics made while it is down, and its restart: every acknowledged message is delivered, nothing
  the consumer acknowledged comes back, and the restarted owner holds every subscription again within
  ``RESTORE_GOAL_S`` of its readiness with no client action (delivery then waits for the client's own
  reconnect); meanwhile QoS 1 MQTT publishes go through a broker that owns none of their topics (to the killed
  owner's and to a live one's), each published again until PUBACKed: every PUBACKed one is delivered;
* the same kill -9 of one process of a ``serve --processes 2`` pod (two such pods, one per ``--peers`` entry),
  which its supervisor starts again;
* a ring change 2 -> 3 told to the brokers ``STAGGER_S`` apart while producers send to brand-new topics
  through both old brokers: no topic ever lands on two brokers;
* a scale-down 3 -> 2 whose leaving broker drains and is removed while four threads keep sending through two
  brokers: nothing acknowledged lost or out of order, nothing left unconsumed on the removed broker;
* kill -9 of a process of a ``serve --processes 2`` pod whose shared port every client uses (an access process,
  the native edge's forwarder and an owner at once) under four sending threads: nothing acknowledged lost;
* a client's full sync (``COMPLETE_ADD``) crossing its subscription made while the owner is down: the
  deterministic form of what the long runs met now and then (before the fix, restored only by the next full
  sync, ~30 s later).

``LMQ_CLUSTER_FAULT_ROUNDS`` repeats the kill/restart scenarios (``make torture`` runs them long).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import os
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import grpc
from pods import child_pid, free_block
from rocketmq import ClientConfiguration, Credentials, LitePushConsumer, Message, Producer
from rocketmq.grpc_protocol import definition_pb2 as rpb
from rocketmq.grpc_protocol import service_pb2 as rspb
from rocketmq.grpc_protocol import service_pb2_grpc as rgrpc
from testing_mqtt import Peer

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.cluster import membership as mb
from lmq_broker.supervisor import free_ports
from lmq_broker.testing import SHARED_ADMIN_ENV, SHARED_ADMIN_KEYS, BrokerProcess, Inbox, holders, start_broker

TOPIC, GROUP = "FAULT_NS", "fault-group"
RESTORE_GOAL_S: Final = 3.0  # the broker's part: every subscription back at the restarted owner
# Delivery also waits for the official client's own gRPC reconnect backoff to the restarted broker (1 s, x1.6
# per failed attempt while it was down: 2.6-4 s after a 6 s outage), which no broker can shorten.
DELIVERY_BOUND_S: Final = 15.0
STAGGER_S: Final = float(os.environ.get("LMQ_CLUSTER_FAULT_STAGGER_S", "4"))
ROUNDS: Final = int(os.environ.get("LMQ_CLUSTER_FAULT_ROUNDS", "1"))
MEANWHILE: Final = 100  # messages per lite topic and round sent (MQTT, gRPC) through the kill and restart
MQTT_ACK_WAIT_S: Final = 5.0  # a non-owner gives up on an owner it cannot reach after 2 s


def start(
    tmp_path: Path, ports: list[int], index: int, *, history: str = "", members: int = 0, mqtt: bool = False
) -> BrokerProcess:
    peers = ",".join(f"127.0.0.1:{p}" for p in ports[: members or len(ports)])
    args = ["--peers", peers, "--ordinal", str(index), "--no-bootstrap", "--ring-history", history]
    args += ["--mqtt-port", "0"] if mqtt else []
    return start_broker(tmp_path / f"b{index}", port=ports[index], extra_args=args, env=SHARED_ADMIN_ENV)


def create_metadata(endpoint: str) -> None:
    """Through one broker: it reaches every member (admin.everywhere)."""
    with AdminClient(endpoint, timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
        admin.put_parent_topic(model.ParentTopic(TOPIC, model.MessageType.LITE))
        admin.put_group(model.LiteGroup(GROUP, TOPIC))


def owned_by(members: list[str], slot: int, prefix: str, count: int) -> list[str]:
    membership = mb.Membership(tuple(members), (len(members),))
    names = (f"{prefix}-{i}" for i in range(100_000))
    return [n for n in names if mb.owner(membership, model.QueueId.lmq(TOPIC, n).topic) == slot][:count]


def config(endpoint: str) -> Any:
    return ClientConfiguration(endpoint, Credentials(), request_timeout=5)


@dataclass
class Ledger:
    """Per lite topic: what was sent (attempts) and acknowledged (the producer's receipt, a PUBACK), and what the
    consumer received; ``settle`` marks what was received so far as acknowledged at its owner, so that its
    delivery again is a failure (a redelivery is allowed only for a message whose ack was not committed)."""

    acked: dict[str, list[bytes]] = field(default_factory=dict)
    sent: Counter[str] = field(default_factory=Counter)
    failed: int = 0  # attempts not acknowledged (retried)
    settled: dict[tuple[str, bytes], int] = field(default_factory=dict)  # -> deliveries when its ack was committed
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, producer: Any, lite: str, body: bytes) -> bool:
        message = Message()
        message.topic, message.lite_topic, message.body = TOPIC, lite, body
        try:
            producer.send(message)
        except Exception:
            self.attempt(lite, ok=False)
            return False
        self.attempt(lite, ok=True)
        self.ack(lite, body)
        return True

    def attempt(self, lite: str, ok: bool) -> None:
        with self.lock:
            self.sent[lite] += 1
            self.failed += not ok

    def ack(self, lite: str, body: bytes) -> None:
        with self.lock:
            self.acked.setdefault(lite, []).append(body)

    def settle(self, inbox: Inbox, lites: list[str]) -> None:
        self.settled.update(Counter((m.lite_topic, m.body) for m in list(inbox.accepted) if m.lite_topic in lites))

    def check(self, inbox: Inbox, timeout: float = 60, table: bool = False) -> dict[str, int]:
        with self.lock:
            mine = {lite: list(bodies) for lite, bodies in self.acked.items()}
            sent = Counter(self.sent)
        acked = {(lite, body) for lite, bodies in mine.items() for body in bodies}
        inbox.wait_for(lambda i: acked <= {(m.lite_topic, m.body) for m in i.accepted}, timeout)
        got: dict[str, list[bytes]] = {}
        ids: dict[str, set[tuple[bytes, str]]] = {}  # distinct (body, message id) delivered
        for m in list(inbox.accepted):
            got.setdefault(m.lite_topic, []).append(m.body)
            ids.setdefault(m.lite_topic, set()).add((m.body, m.message_id))
        rows = {}
        for lite in sorted(set(mine) | set(got)):
            bodies = got.get(lite, [])
            firsts = list(dict.fromkeys(bodies))  # first deliveries, in arrival order
            times = Counter(bodies)
            row = {"sent": sent[lite], "acked": len(mine.get(lite, [])), "received": len(bodies)}
            row["lost"] = sum(1 for body in mine.get(lite, []) if body not in times)
            row["duplicated"] = len(bodies) - len(firsts)
            row["stored_twice"] = len(ids.get(lite, ())) - len(firsts)  # a send retried after it was stored
            row["out_of_order"] = sum(1 for x, y in itertools.pairwise(firsts) if x > y)
            row["redelivered_after_commit"] = sum(
                1 for body, n in times.items() if n > self.settled.get((lite, body), n)
            )
            rows[lite] = row
            if table:
                print(f"  {lite:>12} {row}")
        counts = {key: sum(row[key] for row in rows.values()) for key in next(iter(rows.values()))}
        counts |= {"topics": len(rows), "failed_attempts": self.failed}
        print("ledger", counts)
        lost = sorted((lite, body) for lite, body in acked if body not in got.get(lite, []))
        assert not lost, f"acknowledged but never delivered: {lost[:10]}"
        assert counts["out_of_order"] == 0, got
        assert counts["redelivered_after_commit"] == 0, "a message whose ack was committed before the kill came again"
        return counts


class MqttPublisher:
    """QoS 1 publishes through one broker's MQTT listener (paho-mqtt), counted in ``ledger``: acknowledged only
    once PUBACKed. Without a PUBACK (the owner down: the listener closes the connection) the message is
    published again on a new connection, until ``retry_s`` passes."""

    def __init__(self, broker: BrokerProcess, name: str, ledger: Ledger) -> None:
        self.broker, self.name, self.ledger = broker, name, ledger
        self.peer: Peer | None = None
        self.connections = 0

    def publish(self, lite: str, body: bytes, retry_s: float = 30) -> bool:
        deadline = time.monotonic() + retry_s
        while True:
            if self.peer is None or self.peer.disconnected:
                self.close()
                self.connections += 1
                self.peer = Peer(self.broker.mqtt_port, f"{self.name}-{self.connections}")
            info = self.peer.client.publish(f"{TOPIC}/{lite}", body, qos=1)
            with contextlib.suppress(RuntimeError, ValueError):
                info.wait_for_publish(MQTT_ACK_WAIT_S)
            if info.is_published():
                self.ledger.attempt(lite, ok=True)
                self.ledger.ack(lite, body)
                return True
            self.ledger.attempt(lite, ok=False)
            self.close()
            if time.monotonic() > deadline:
                return False

    def close(self) -> None:
        if self.peer is not None:
            self.peer.disconnect()
            self.peer = None


def publish_until(stop: threading.Event, via: MqttPublisher, lites: list[str], mark: str, out: Counter[bool]) -> None:
    """Publish to ``lites`` in turn until ``stop`` (``MEANWHILE`` each at most), each message until PUBACKed
    (60 s at most)."""
    k = 0
    while not stop.is_set() and k < MEANWHILE:
        for lite in lites:
            out[via.publish(lite, f"{mark}{k:05d}-{lite}".encode(), 60)] += 1
        k += 1


def send_until(
    stop: threading.Event, ledger: Ledger, producer: Any, lites: list[str], *, mark: str, out: Counter[bool]
) -> None:
    """Send to ``lites`` in turn until ``stop`` (``MEANWHILE`` each at most), each message until the producer
    acknowledges it (60 s at most); counts in ``out`` the acknowledged ones (True) and those given up (False)."""
    k = 0
    while not stop.is_set() and k < MEANWHILE:
        for lite in lites:
            body, deadline = f"{mark}{k:05d}-{lite}".encode(), time.monotonic() + 60
            while not (ok := ledger.send(producer, lite, body)) and time.monotonic() < deadline:
                pass  # the client waited for its own retries already
            out[ok] += 1
        k += 1


def subscriptions_back(endpoint: str, want: int, since: float) -> float:
    """Seconds from ``since`` until the broker at ``endpoint`` counts ``want`` subscriptions of GROUP (the
    broker's part of a restore; delivering also needs the consumer's receive calls back there); -1: never."""
    deadline = time.monotonic() + RESTORE_GOAL_S + 30
    with AdminClient(endpoint, timeout_s=5, **SHARED_ADMIN_KEYS) as admin:
        while time.monotonic() < deadline:
            if sum(c.subscription_count for c in admin.list_clients(GROUP)) >= want:
                return time.monotonic() - since
            time.sleep(0.05)
    return -1.0


def drained(endpoint: str, lites: list[str], timeout: float = 30) -> None:
    """Wait until the group's committed offset of each lite topic held at ``endpoint`` is its end: every stored
    message was delivered and its ack committed at the owner."""
    deadline = time.monotonic() + timeout
    with AdminClient(endpoint, timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
        for lite in lites:
            while True:
                topic = admin.describe_lite_topic(TOPIC, lite)
                if topic.group_offsets.get(GROUP) == topic.meta.max_offset:
                    break
                assert time.monotonic() < deadline, f"{lite}: {topic.group_offsets} never reached {topic.meta}"
                time.sleep(0.05)


def forged_send(endpoint: str, lite: str, body: bytes, header: tuple[str, str]) -> int:
    with grpc.insecure_channel(endpoint) as channel:
        reply = rgrpc.MessagingServiceStub(channel).SendMessage(
            rspb.SendMessageRequest(
                messages=[
                    rpb.Message(
                        topic=rpb.Resource(name=TOPIC),
                        body=body,
                        system_properties=rpb.SystemProperties(
                            message_id=body.decode(), message_type=rpb.LITE, lite_topic=lite, body_encoding=rpb.IDENTITY
                        ),
                    )
                ]
            ),
            metadata=(("x-mq-client-id", "forger"), header),
            timeout=10,
        )
    return int(reply.status.code)


def test_forged_markers_kill_9_and_a_subscription_made_while_the_owner_is_down(  # noqa: PLR0912, PLR0915 (one scenario told start to end)
    tmp_path: Path, clients: list[Any]
) -> None:
    ports = free_ports("127.0.0.1", 3)
    brokers = [start(tmp_path, ports, i, mqtt=True) for i in range(3)]
    endpoints = [b.endpoint for b in brokers]
    publishers: list[MqttPublisher] = []
    try:
        create_metadata(endpoints[0])
        first = {slot: owned_by(endpoints, slot, "f", 3) for slot in range(3)}
        # MQTT topics of each owner, published to through a broker that does not own them
        by_mqtt = {slot: owned_by(endpoints, slot, "m", 2) for slot in range(3)}
        inbox = Inbox()
        consumer = LitePushConsumer(config(endpoints[0]), GROUP, TOPIC, inbox)
        consumer.startup()
        clients.append(consumer)
        for lites in [*first.values(), *by_mqtt.values()]:
            for lite in lites:
                consumer.subscribe_lite(lite)
        producer = Producer(config(endpoints[1]), (TOPIC,))
        producer.startup()
        clients.append(producer)
        ledger = Ledger()
        via0 = MqttPublisher(brokers[0], "via-0", ledger)  # owns none of by_mqtt[1] + by_mqtt[2]
        via0b = MqttPublisher(brokers[0], "via-0b", ledger)  # a second connection: broker 1's topics meanwhile
        via1 = MqttPublisher(brokers[1], "via-1", ledger)  # owns none of by_mqtt[0]
        publishers += [via0, via0b, via1]
        figures = []

        # a client-supplied marker never changes where a message is stored
        for n, header in enumerate([("x-lmq-forwarded", "1"), ("x-lmq-peer", "1;0;" + "0" * 64)]):
            lite, body = first[2][0], f"-forged-{n}".encode()  # sorts before what is sent later
            assert forged_send(endpoints[0], lite, body, header) == rpb.Code.OK
            ledger.attempt(lite, ok=True)
            ledger.ack(lite, body)
        for n in range(ROUNDS):
            later = owned_by(endpoints, 2, f"late{n}", 2)  # subscribed while their owner is down
            owned = [lite for lite in ledger.acked if lite in first[2] + by_mqtt[2] or lite.startswith("late")]
            for lites in first.values():
                for lite in lites:
                    ledger.send(producer, lite, f"{n:02d}a-{lite}".encode())
            for via, lites in ((via0, by_mqtt[2]), (via0b, by_mqtt[1])):
                for lite in lites:
                    assert via.publish(lite, f"{n:02d}a-{lite}".encode())
            for lite in by_mqtt[0]:
                assert via1.publish(lite, f"{n:02d}a-{lite}".encode())
            ledger.check(inbox)
            drained(endpoints[2], owned + first[2] + by_mqtt[2])  # its acks are committed before the kill
            ledger.settle(inbox, owned + first[2] + by_mqtt[2])

            # MQTT publishes through broker 0 to broker 2's and broker 1's topics all through the kill and the
            # restart: each retried until PUBACKed; a PUBACKed one must arrive
            stop, published = threading.Event(), Counter[bool]()
            meanwhile = [
                threading.Thread(target=publish_until, args=(stop, via, lites, f"{n:02d}b", published))
                for via, lites in ((via0, by_mqtt[2]), (via0b, by_mqtt[1]))
            ]
            for thread in meanwhile:
                thread.start()
            brokers[2].kill()  # kill -9 of the owner of first[2] and by_mqtt[2]
            for lite in later:  # through the access broker: kept, applied when the owner returns
                consumer.subscribe_lite(lite)
            for lite in first[0] + first[1]:
                ledger.send(producer, lite, f"{n:02d}b-{lite}".encode())
            brokers[2] = brokers[2].restart()
            ready = time.monotonic()
            want = len(first[2]) + len(by_mqtt[2]) + 2 * (n + 1)  # first[2], by_mqtt[2], the late topics so far
            probe = concurrent.futures.ThreadPoolExecutor(1)
            subscribed = probe.submit(subscriptions_back, endpoints[2], want, ready)
            for lite in first[2] + later:
                body = f"{n:02d}c-{lite}".encode()
                deadline = time.monotonic() + 10
                while not ledger.send(producer, lite, body) and time.monotonic() < deadline:
                    time.sleep(0.1)
            acked_after = time.monotonic() - ready  # the sends' part of the figure
            mark, wanted = f"{n:02d}c".encode(), set(first[2] + later)
            restored = inbox.wait_for(
                lambda i: {m.lite_topic for m in i.accepted if m.body.startswith(mark)} >= wanted,  # noqa: B023
                RESTORE_GOAL_S + 30,
            )
            took = time.monotonic() - ready
            figures.append(took)
            back = subscribed.result()
            probe.shutdown()
            print(
                f"round {n}: the restarted owner's topics delivered {took:.2f} s after its readiness",
                f"(its {want} subscriptions back after {back:.2f} s, sent and acknowledged after {acked_after:.2f} s)",
            )
            stop.set()
            for thread in meanwhile:
                thread.join(90)
                assert not thread.is_alive()
            print(f"round {n}: MQTT publishes through broker 0 meanwhile: {dict(published)} (True: PUBACKed)")
            assert 0 <= back <= RESTORE_GOAL_S, f"its subscriptions were given back after {back:.2f} s (-1: never)"
            assert restored, "a subscription was not restored on the restarted owner"
            assert not published[False], "an MQTT publish was never PUBACKed within 60 s"
            ledger.check(inbox, table=n == ROUNDS - 1)
        print(f"restore figures (s): {', '.join(f'{t:.2f}' for t in figures)}")
        print(
            f"MQTT connections: via broker 0 {via0.connections} + {via0b.connections}, via broker 1 {via1.connections}"
        )
        placed = holders(endpoints, TOPIC, SHARED_ADMIN_KEYS)
        assert all(len(where) == 1 for where in placed.values()), placed  # no topic on two brokers
        for slot in range(3):
            assert all(placed[lite] == [slot] for lite in first[slot] + by_mqtt[slot])
        assert all(placed[lite] == [2] for lite in ledger.acked if lite.startswith("late"))
        assert max(figures) <= DELIVERY_BOUND_S, f"delivered after {max(figures):.2f} s"
    finally:
        for publisher in publishers:
            publisher.close()
        for broker in brokers:
            broker.stop()


def test_a_ring_change_told_to_brokers_apart_never_places_a_topic_twice(tmp_path: Path, clients: list[Any]) -> None:
    ports = free_ports("127.0.0.1", 3)
    brokers = [start(tmp_path, ports, i, members=2) for i in range(2)]
    endpoints = [b.endpoint for b in brokers]
    members = [f"127.0.0.1:{p}" for p in ports]
    try:
        create_metadata(endpoints[0])
        brokers.append(start(tmp_path, ports, 2, history="2"))  # the joiner starts with the grown ring
        endpoints.append(brokers[2].endpoint)
        create_metadata(endpoints[2])
        inbox = Inbox()
        consumer = LitePushConsumer(config(endpoints[0]), GROUP, TOPIC, inbox)
        consumer.startup()
        clients.append(consumer)
        consumer.subscribe_lite("s-*")
        producers = started_producers(endpoints[:2], clients)
        ledger = Ledger()
        stop = threading.Event()

        def load(producer: Any, me: int) -> None:  # brand-new topics all along, 4 messages each, in turn
            n = 0
            while not stop.is_set():
                ledger.send(producer, f"s-{me}-{n // 12}-{n % 3}", f"{n:06d}".encode())
                n += 1

        threads = [threading.Thread(target=load, args=(p, i)) for i, p in enumerate(producers)]
        for thread in threads:
            thread.start()
        time.sleep(1)
        for i in (0, 1):  # told one at a time, STAGGER_S apart
            with AdminClient(endpoints[i], timeout_s=30, **SHARED_ADMIN_KEYS) as admin:
                admin.set_cluster(members, (2, 3))
            time.sleep(STAGGER_S)
        stop.set()
        for thread in threads:
            thread.join(30)
        counts = ledger.check(inbox)
        assert counts["acked"] > 100
        placed = holders(endpoints, TOPIC, SHARED_ADMIN_KEYS)
        assert all(len(where) == 1 for where in placed.values()), placed  # never on two brokers
        assert any(where == [2] for where in placed.values())  # the joiner took new topics
    finally:
        for broker in brokers:
            broker.stop()


def answering(endpoint: str) -> bool:
    try:
        with AdminClient(endpoint, timeout_s=1, **SHARED_ADMIN_KEYS) as admin:
            admin.cluster()
    except Exception:
        return False
    return True


def listening(endpoint: str) -> bool:
    host, _, port = endpoint.rpartition(":")
    try:
        socket.create_connection((host, int(port)), 0.5).close()
    except OSError:
        return False
    return True


def test_kill_9_of_one_process_of_a_processes_2_pod(tmp_path: Path, clients: list[Any]) -> None:  # noqa: PLR0915 (one scenario told start to end)
    """Two pods of ``serve --processes 2``, one per ``--peers`` entry (4 ring slots), the clients on pod 0's
    shared port. Each round kill -9 one process of pod 1 (its supervisor starts it again on its data) while a
    second producer sends to its topics and another slot's, each message until acknowledged: nothing
    acknowledged is lost, a subscription made while it is down is applied, and its topics flow again within
    ``RESTORE_GOAL_S`` of the new process answering."""
    bases = [free_block(3), free_block(3)]
    peers = ",".join(f"127.0.0.1:{b}" for b in bases)
    pods: list[BrokerProcess] = []
    try:
        for i, base in enumerate(bases):
            args = ["--processes", "2", "--peers", peers, "--ordinal", str(i), "--no-bootstrap"]
            pods.append(start_broker(tmp_path / f"pod{i}", port=base, extra_args=args, env=SHARED_ADMIN_ENV))
        slots = [f"127.0.0.1:{base + 1 + i}" for base in bases for i in range(2)]  # ring.process_port
        victim, supervisor = 3, pods[1].pid  # pod 1, process 1
        create_metadata(pods[0].endpoint)
        first = {slot: owned_by(slots, slot, "p", 2) for slot in range(4)}
        others = [lite for slot in (0, 1, 2) for lite in first[slot]]
        busy = owned_by(slots, victim, "pb", 1) + owned_by(slots, 2, "pb", 1)  # sent to through the kill
        arrived: dict[tuple[str, bytes], float] = {}  # first delivery's time (diagnosis of a slow restore)
        inbox = Inbox(lambda m: arrived.setdefault((m.lite_topic, m.body), time.monotonic()) > 0)
        consumer = LitePushConsumer(config(pods[0].endpoint), GROUP, TOPIC, inbox)
        consumer.startup()
        clients.append(consumer)
        for lite in [*others, *first[victim], *busy]:
            consumer.subscribe_lite(lite)
        producer, loader = Producer(config(pods[0].endpoint), (TOPIC,)), Producer(config(pods[0].endpoint), (TOPIC,))
        for started in (producer, loader):
            started.startup()
            clients.append(started)
        ledger = Ledger()
        figures = []
        for n in range(ROUNDS):
            later = owned_by(slots, victim, f"plate{n}", 2)  # subscribed while their owner is down
            owned = first[victim] + busy[:1] + [lite for lite in ledger.acked if lite.startswith("plate")]
            for lite in [*others, *first[victim], *busy]:
                assert ledger.send(producer, lite, f"{n:02d}a-{lite}".encode())
            ledger.check(inbox)
            drained(slots[victim], owned)  # its acks are committed before the kill
            ledger.settle(inbox, owned)

            stop, sent_meanwhile = threading.Event(), Counter[bool]()
            meanwhile = threading.Thread(
                target=send_until,
                args=(stop, ledger, loader, busy),
                kwargs={"mark": f"{n:02d}b", "out": sent_meanwhile},
            )
            meanwhile.start()
            pid = child_pid(pods[1], victim)
            assert pid is not None, "no process of pod 1 serves the victim's slot"
            # The supervisor is held (SIGSTOP) from the kill until the subscription was answered, so that the
            # subscription is made while the process is down: else it would be back within about 2 s, before
            # the access process gave up waiting for it.
            os.kill(supervisor, signal.SIGSTOP)
            try:
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while listening(slots[victim]):  # gone: its port refuses
                    assert time.monotonic() < deadline, "the killed process still listens"
                    time.sleep(0.02)
                # through the access process: kept, applied when the owner returns. Each call waits up to 2 s
                # for the dead process, so they go at once: the longer a process is down, the longer the
                # clients' gRPC channels back off before dialling it again (1 s x 1.6 per attempt)
                with concurrent.futures.ThreadPoolExecutor(len(later)) as pool:
                    list(pool.map(consumer.subscribe_lite, later))
                down_when_subscribed = not listening(slots[victim])
            finally:
                os.kill(supervisor, signal.SIGCONT)  # it finds the process dead and starts it again
            for lite in others:  # the other slots' topics keep flowing
                assert ledger.send(producer, lite, f"{n:02d}b-{lite}".encode())
            deadline = time.monotonic() + 60
            while not answering(slots[victim]):  # the supervisor starts it again (after 1 s)
                assert time.monotonic() < deadline, "the supervisor did not start the killed process again"
                time.sleep(0.05)
            ready = time.monotonic()
            assert child_pid(pods[1], victim) not in (None, pid)
            want = len(first[victim]) + 1 + 2 * (n + 1)  # first[victim], busy[0], the plate topics so far
            probe = concurrent.futures.ThreadPoolExecutor(1)
            subscribed = probe.submit(subscriptions_back, slots[victim], want, ready)
            for lite in first[victim] + later:
                body = f"{n:02d}c-{lite}".encode()
                deadline = time.monotonic() + 10
                while not ledger.send(producer, lite, body) and time.monotonic() < deadline:
                    time.sleep(0.1)
            acked_after = time.monotonic() - ready  # the sends' part of the figure
            mark, wanted = f"{n:02d}c".encode(), set(first[victim] + later)
            restored = inbox.wait_for(
                lambda i: {m.lite_topic for m in i.accepted if m.body.startswith(mark)} >= wanted,  # noqa: B023
                RESTORE_GOAL_S + 30,
            )
            took = time.monotonic() - ready
            figures.append(took)
            back = subscribed.result()
            probe.shutdown()
            if took > RESTORE_GOAL_S:  # the broker's part is ``back``; the rest is the client reconnecting
                late = {lite: round(arrived.get((lite, f"{n:02d}c-{lite}".encode()), -1) - ready, 2) for lite in wanted}
                print(f"round {n}: slow; each topic's delivery after the answer (s): {late}")
            print(
                f"round {n}: the restarted process's topics delivered {took:.2f} s after it answered",
                f"(its {want} subscriptions back after {back:.2f} s, sent and acknowledged after {acked_after:.2f} s)",
            )
            stop.set()
            meanwhile.join(120)
            assert not meanwhile.is_alive()
            print(f"round {n}: sends through the kill {dict(sent_meanwhile)} (True: acknowledged)")
            assert down_when_subscribed, "the process was back before the subscription: the scenario did not run"
            assert 0 <= back <= RESTORE_GOAL_S, f"its subscriptions were given back after {back:.2f} s (-1: never)"
            assert restored, "a subscription was not restored on the restarted process"
            assert not sent_meanwhile[False], "a send was never acknowledged within 60 s"
            ledger.check(inbox, table=n == ROUNDS - 1)
        print(f"restore figures (s): {', '.join(f'{t:.2f}' for t in figures)}")
        placed = holders(slots, TOPIC, SHARED_ADMIN_KEYS)
        assert all(len(where) == 1 for where in placed.values()), placed  # no topic on two slots
        for slot in range(4):
            assert all(placed[lite] == [slot] for lite in first[slot])
        assert all(placed[lite] == [victim] for lite in busy[:1] + [x for x in ledger.acked if x.startswith("plate")])
        assert max(figures) <= DELIVERY_BOUND_S, f"delivered after {max(figures):.2f} s"
    finally:
        for pod in pods:
            pod.stop()


@contextlib.contextmanager
def consumer_of_three(
    tmp_path: Path, clients: list[Any], other: str
) -> Iterator[tuple[list[BrokerProcess], list[str], str, str, Inbox, Any]]:
    """Three brokers; a push consumer through broker 0 subscribed to ``known`` (a topic broker 2 owns); and the
    name of another topic broker 2 owns (prefix ``other``). The brokers (replaced in the list by a restart) are
    stopped at the end."""
    ports = free_ports("127.0.0.1", 3)
    brokers = [start(tmp_path, ports, i) for i in range(3)]
    endpoints = [b.endpoint for b in brokers]
    try:
        create_metadata(endpoints[0])
        known, second = owned_by(endpoints, 2, "known", 1)[0], owned_by(endpoints, 2, other, 1)[0]
        inbox = Inbox()
        consumer = LitePushConsumer(config(endpoints[0]), GROUP, TOPIC, inbox)
        consumer.startup()
        clients.append(consumer)
        consumer.subscribe_lite(known)
        yield brokers, endpoints, known, second, inbox, consumer
    finally:
        for broker in brokers:
            broker.stop()


def test_a_full_sync_crossing_a_subscription_made_while_its_owner_is_down(tmp_path: Path, clients: list[Any]) -> None:
    """The official clients send their whole set (``COMPLETE_ADD``, ``subscribe_lite_all``: the Python client's
    scheduler calls it every 30 s) built from the subscriptions answered so far. While an owner is down the
    access broker answers a subscription only after waiting up to 2 s for it, so a full sync built before such
    a ``PARTIAL_ADD`` was answered may reach the access broker after it: its intents then lack the topic, and the
    restarted owner gets it only with the client's next full sync, ~30 s later, not within ``RESTORE_GOAL_S``.
    (The long runs of the scenarios above meet this when the client's timer falls into the 2 s window.)"""
    with consumer_of_three(tmp_path, clients, "crossing") as (brokers, endpoints, known, crossing, inbox, consumer):
        producer = Producer(config(endpoints[1]), (TOPIC,))
        producer.startup()
        clients.append(producer)
        brokers[2].kill()
        subscribing = threading.Thread(target=consumer.subscribe_lite, args=(crossing,))
        subscribing.start()
        time.sleep(0.3)  # the interleaving under test: the PARTIAL_ADD is at the access broker, not yet answered
        assert subscribing.is_alive(), "the subscription was answered at once: the window under test is gone"
        consumer.subscribe_lite_all()  # what the client's 30 s timer does: its set without ``crossing``
        subscribing.join(30)  # answered OK: the client holds it subscribed
        brokers[2] = brokers[2].restart()
        ready = time.monotonic()
        probe = concurrent.futures.ThreadPoolExecutor(1)
        subscribed = probe.submit(subscriptions_back, endpoints[2], 2, ready)
        ledger = Ledger()
        for lite in (known, crossing):
            deadline = time.monotonic() + 10
            while not ledger.send(producer, lite, f"after-{lite}".encode()) and time.monotonic() < deadline:
                time.sleep(0.1)
        print(f"sent and acknowledged {time.monotonic() - ready:.2f} s after the owner's readiness")
        got: dict[str, float] = {}  # -1: not within RESTORE_GOAL_S + 35 s
        for lite in (known, crossing):
            came = inbox.wait_for(lambda i: any(m.lite_topic == lite for m in i.accepted), RESTORE_GOAL_S + 35)  # noqa: B023
            got[lite] = round(time.monotonic() - ready, 2) if came else -1.0
        print(
            f"delivered after the owner's readiness (s): {got};",
            f"both subscriptions at the owner after {subscribed.result():.2f} s",
        )
        back = subscribed.result()
        probe.shutdown()
        ledger.check(inbox)
        # the broker's part within the goal; delivery also waits for the client's own reconnect backoff, and the
        # failure under test is the next full sync, ~30 s: DELIVERY_BOUND_S (15 s) tells them apart
        assert 0 <= back <= RESTORE_GOAL_S, f"both subscriptions back at the owner after {back:.2f} s (-1: never)"
        assert all(0 <= took <= DELIVERY_BOUND_S for took in got.values()), f"not delivered in time: {got}"


def full_sync(endpoint: str, client_id: str, lites: list[str]) -> int:
    """A COMPLETE_ADD of ``lites`` for ``client_id``, as its client sends one (the Node client's at start)."""
    with grpc.insecure_channel(endpoint) as channel:
        reply = rgrpc.MessagingServiceStub(channel).SyncLiteSubscription(
            rspb.SyncLiteSubscriptionRequest(
                action=rpb.COMPLETE_ADD,
                topic=rpb.Resource(name=TOPIC),
                group=rpb.Resource(name=GROUP),
                lite_topic_set=lites,
            ),
            metadata=(("x-mq-client-id", client_id), ("x-mq-language", "PYTHON")),
            timeout=10,
        )
    return int(reply.status.code)


def test_a_full_sync_built_before_a_subscribe_was_answered_does_not_undo_it_at_a_restarted_owner(
    tmp_path: Path, clients: list[Any]
) -> None:
    """Node 1.0.8 sends its first full sync unawaited at start, so it can reach the access broker just after a
    ``subscribeLite`` sent after it was answered (a set built without the topic). Within --full-sync-grace-ms
    the owner keeps the subscription, and so does the access broker's intent: when the owner is then killed -9
    and restarted, the access broker makes it there again, not the client's next full sync 30 s later."""
    with consumer_of_three(tmp_path, clients, "late") as (brokers, endpoints, known, late, inbox, consumer):
        consumer.subscribe_lite(late)  # answered: the owner and the access broker's intent hold it
        assert full_sync(endpoints[0], consumer.client_id, [known]) == rpb.OK  # built before that answer
        producer = Producer(config(endpoints[1]), (TOPIC,))
        producer.startup()
        clients.append(producer)
        brokers[2].kill()
        brokers[2] = brokers[2].restart()
        ready = time.monotonic()
        back = subscriptions_back(endpoints[2], 2, ready)
        ledger = Ledger()
        for lite in (known, late):
            deadline = time.monotonic() + 10
            while not ledger.send(producer, lite, f"after-{lite}".encode()) and time.monotonic() < deadline:
                time.sleep(0.1)
        came = inbox.wait_for(lambda i: any(m.lite_topic == late for m in i.accepted), DELIVERY_BOUND_S)
        print(f"both subscriptions back at the restarted owner after {back:.2f} s; delivered: {came}")
        assert 0 <= back <= RESTORE_GOAL_S, f"both subscriptions back at the owner after {back:.2f} s (-1: never)"
        assert came, f"nothing of {late} delivered within {DELIVERY_BOUND_S} s of the owner's readiness"
        ledger.check(inbox)


def started_producers(endpoints: list[str], clients: list[Any]) -> list[Any]:
    """One started producer per entry of ``endpoints``, each shut down with ``clients``."""
    producers = []
    for endpoint in endpoints:
        producer = Producer(config(endpoint), (TOPIC,))
        producer.startup()
        clients.append(producer)
        producers.append(producer)
    return producers


def sending(
    producers: list[Any],
    lites: list[str],
    ledger: Ledger,
    *,
    stop: threading.Event,
    given_up: Counter[bool],
    retry_s: float,
) -> list[threading.Thread]:
    """Four threads started, sending until ``stop`` through ``producers`` in turn, each to its own topics of
    ``lites`` (every fourth one: a topic's order is then checked), each message until acknowledged or
    ``retry_s`` passed (counted True in ``given_up``)."""

    def load(producer: Any, mine: list[str], mark: str) -> None:
        n = 0
        while not stop.is_set():
            for lite in mine:
                body, deadline = f"{mark}{n:05d}-{lite}".encode(), time.monotonic() + retry_s
                while not ledger.send(producer, lite, body) and time.monotonic() < deadline:
                    time.sleep(0.05)
                given_up[time.monotonic() >= deadline] += 1
            n += 1

    threads = [
        threading.Thread(target=load, args=(producers[k % len(producers)], lites[k::4], f"{k}-")) for k in range(4)
    ]
    for thread in threads:
        thread.start()
    return threads


def test_a_scale_down_removes_the_leaving_broker_while_sends_keep_coming(tmp_path: Path, clients: list[Any]) -> None:
    """3 -> 2 with the load never stopping, through the removal too: four threads send (two producers, through
    brokers 0 and 1; each message until acknowledged) each to its own topics, of every broker; a push consumer
    (through broker 0) consumes. Slot 2 is marked leaving (told first), drains, and is removed (told last)
    while sends go on, then stopped. Every acknowledged message is delivered, in order, none whose ack was
    committed comes again, every topic goes on at one broker that stays, and the removed broker holds nothing
    unconsumed (nothing stranded where nobody reads)."""
    ports = free_ports("127.0.0.1", 3)
    brokers = [start(tmp_path, ports, i) for i in range(3)]
    endpoints = [b.endpoint for b in brokers]
    stop = threading.Event()
    try:
        create_metadata(endpoints[0])
        lites = [lite for slot in range(3) for lite in owned_by(endpoints, slot, "sd", 4)]
        inbox = Inbox()
        consumer = LitePushConsumer(config(endpoints[0]), GROUP, TOPIC, inbox)
        consumer.startup()
        clients.append(consumer)
        for lite in lites:
            consumer.subscribe_lite(lite)
        producers = started_producers(endpoints[:2], clients)
        ledger, given_up = Ledger(), Counter[bool]()
        threads = sending(producers, lites, ledger, stop=stop, given_up=given_up, retry_s=30)
        time.sleep(1)
        with AdminClient(endpoints[0], timeout_s=30, **SHARED_ADMIN_KEYS) as admin:
            assert admin.cluster().epoch == 1
        for i in (2, 0, 1):  # slot 2 leaves: the leaving broker first
            with AdminClient(endpoints[i], timeout_s=30, **SHARED_ADMIN_KEYS) as admin:
                admin.set_cluster(endpoints, (3, 2))
        with AdminClient(endpoints[2], timeout_s=30, **SHARED_ADMIN_KEYS) as admin:
            deadline = time.monotonic() + 40
            while not admin.cluster(with_undrained=True).drained:  # its topics drain as the consumer keeps up
                assert time.monotonic() < deadline, "slot 2 never drained under the load"
                time.sleep(0.2)
        for i in (0, 1, 2):  # removed, the leaving broker last, the sends going on
            with AdminClient(endpoints[i], timeout_s=30, **SHARED_ADMIN_KEYS) as admin:
                admin.set_cluster(endpoints[:2], (3, 2))
            time.sleep(0.5)
        with AdminClient(endpoints[2], timeout_s=30, **SHARED_ADMIN_KEYS) as admin:
            left = admin.broker_info(with_undrained=True).undrained_messages
        brokers[2].stop()
        time.sleep(2)  # the load goes on with two brokers
        stop.set()
        for thread in threads:
            thread.join(60)
        assert not given_up[True], "a send was never acknowledged within 30 s"
        counts = ledger.check(inbox)
        assert counts["acked"] > 200
        assert left == 0, f"the removed broker holds {left} messages nobody consumed"
        placed = holders(endpoints[:2], TOPIC, SHARED_ADMIN_KEYS)
        assert all(len(where) == 1 for where in placed.values()), placed
        assert set(placed) == set(lites)  # every topic goes on at a broker that stays
    finally:
        stop.set()
        while clients:  # the clients first, while the brokers answer their last acks
            clients.pop().shutdown()
        for broker in brokers:
            broker.stop()


def test_kill_9_of_a_process_behind_the_shared_port_under_concurrent_sends(tmp_path: Path, clients: list[Any]) -> None:
    """One ``serve --processes 2`` pod, every client on its shared port (the kernel picks the process: each is the
    access process of some connections, runs the native edge's forwarding, and owns half of the topics). Four
    threads send, each to its own topics of both processes, each message until acknowledged; process 0 is killed
    (kill -9) mid-load and its supervisor starts it again. Every acknowledged message is delivered, in order."""
    base = free_block(3)
    pod = start_broker(
        tmp_path / "pod", port=base, extra_args=["--processes", "2", "--no-bootstrap"], env=SHARED_ADMIN_ENV
    )
    slots = [f"127.0.0.1:{base + 1 + i}" for i in range(2)]
    stop = threading.Event()
    try:
        create_metadata(pod.endpoint)
        lites = [lite for slot in (0, 1) for lite in owned_by(slots, slot, "k", 4)]
        inbox = Inbox()
        consumer = LitePushConsumer(config(pod.endpoint), GROUP, TOPIC, inbox)
        consumer.startup()
        clients.append(consumer)
        for lite in lites:
            consumer.subscribe_lite(lite)
        producers = started_producers([pod.endpoint] * 2, clients)
        ledger, given_up = Ledger(), Counter[bool]()
        threads = sending(producers, lites, ledger, stop=stop, given_up=given_up, retry_s=60)
        time.sleep(2)
        pid = child_pid(pod, 0)
        assert pid is not None
        before = sum(len(bodies) for bodies in list(ledger.acked.values()))
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while child_pid(pod, 0) in (None, pid) or not answering(slots[0]):  # its supervisor starts it again
            assert time.monotonic() < deadline, "the killed process was not started again"
            time.sleep(0.1)
        time.sleep(3)  # the load goes on with the restarted process
        stop.set()
        for thread in threads:
            thread.join(90)
        assert not given_up[True], "a send was never acknowledged within 60 s"
        counts = ledger.check(inbox, timeout=90)
        assert before > 50 and counts["acked"] > before, (before, counts)
    finally:
        stop.set()
        while clients:  # the clients first, while the brokers answer their last acks
            clients.pop().shutdown()
        pod.stop()
