"""Clients outside the cluster (docs/scale-out.md): the official Python client 5.1.2 reaches a 2-broker cluster
only through one TCP forwarder per broker, as through a LoadBalancer or NodePort per pod (or a port-forward).

The brokers' external listener answers routes with the forwarders' addresses, so the client's calls to the
second broker (its receive loop, the sends round-robin puts there) go through that broker's forwarder; the
client port keeps answering with the brokers' own (in-cluster) endpoints.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from pathlib import Path
from typing import Any

import grpc
from pods import free_block
from rocketmq import ClientConfiguration, Credentials, LitePushConsumer, Message, Producer
from rocketmq.grpc_protocol import definition_pb2 as rpb
from rocketmq.grpc_protocol import service_pb2 as rspb
from rocketmq.grpc_protocol import service_pb2_grpc as rgrpc

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.cluster import membership as mb
from lmq_broker.supervisor import free_ports
from lmq_broker.testing import SHARED_ADMIN_ENV, SHARED_ADMIN_KEYS, BrokerProcess, Inbox, start_broker

TOPIC, GROUP = "OUTSIDE_NS", "outside-group"
PROCESS_RE = re.compile(
    r"lmq-broker process (?P<index>\d+) grpc=(?P<grpc>[^ ]+) metrics=\d+ external=(?P<external>\d+)"
)


class Forwarder:
    """One listening port that pipes every connection to ``target`` (a load balancer's job), counting them."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                inbound, _ = self.listener.accept()
            except OSError:
                return
            outbound = socket.create_connection(self.target)
            self.connections += 1
            self._open += [inbound, outbound]
            for source, sink in ((inbound, outbound), (outbound, inbound)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listener.close()
        for s in self._open:
            with contextlib.suppress(OSError):
                s.close()


def routed(endpoint: str) -> tuple[list[str], list[str]]:
    """(route, assignment) broker endpoints the broker at ``endpoint`` answers, through the official stubs."""
    with grpc.insecure_channel(endpoint) as channel:
        stub = rgrpc.MessagingServiceStub(channel)
        metadata = (("x-mq-client-id", "outside-test"),)
        route = stub.QueryRoute(
            rspb.QueryRouteRequest(topic=rpb.Resource(name=TOPIC), endpoints=rpb.Endpoints()),
            metadata=metadata,
            timeout=10,
        )
        found = stub.QueryAssignment(
            rspb.QueryAssignmentRequest(topic=rpb.Resource(name=TOPIC), group=rpb.Resource(name=GROUP)),
            metadata=metadata,
            timeout=10,
        )
    assert route.status.code == found.status.code == rpb.Code.OK

    def named(queue: Any) -> str:
        address = queue.broker.endpoints.addresses[0]
        return f"{address.host}:{address.port}"

    return [named(q) for q in route.message_queues], [named(a.message_queue) for a in found.assignments]


def first(endpoint: str, listed: list[str]) -> tuple[list[str], list[str]]:
    """(route, assignment) as the broker at ``endpoint`` of ``listed`` answers them: itself first (a
    LiteSimpleConsumer receives from the first route queue only: the broker it asked, which gathers)."""
    ordered = [endpoint, *(e for e in listed if e != endpoint)]
    return ordered, ordered


def create_metadata(admin_endpoints: list[str]) -> None:
    for endpoint in admin_endpoints:  # the operator's job on Kubernetes
        with AdminClient(endpoint, timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
            admin.put_parent_topic(model.ParentTopic(TOPIC, model.MessageType.LITE))
            admin.put_group(model.LiteGroup(GROUP, TOPIC))


def exchange(access_endpoint: str, lites: list[str], clients: list[Any]) -> None:
    """A LitePushConsumer and a Producer configured with ``access_endpoint`` only: 3 messages per lite topic,
    every one received once, in order per topic."""
    access = ClientConfiguration(access_endpoint, Credentials(), request_timeout=5)
    inbox = Inbox()
    consumer = LitePushConsumer(access, GROUP, TOPIC, inbox)
    consumer.startup()
    clients.append(consumer)
    for lite in lites:
        consumer.subscribe_lite(lite)
    producer = Producer(access, (TOPIC,))
    producer.startup()
    clients.append(producer)

    def send_round(n: int) -> set[tuple[str, bytes]]:
        sent = set()
        for lite in lites:
            message = Message()
            message.topic, message.lite_topic = TOPIC, lite
            message.body = f"{lite}/{n}".encode()
            producer.send(message)
            sent.add((lite, message.body))
        return sent

    sent = send_round(0) | send_round(1) | send_round(2)
    assert inbox.wait_for(lambda i: len(i.accepted) >= len(sent), 60), f"{len(inbox.accepted)} of {len(sent)}"
    barrier = send_round(3)  # one more per topic: a duplicate of an earlier message would come before it
    assert inbox.wait_for(lambda i: barrier <= {(m.lite_topic, m.body) for m in i.accepted}, 60)
    sent |= barrier
    got = [(m.lite_topic, m.body) for m in inbox.accepted]
    assert len(got) == len(sent) and set(got) == sent  # nothing lost, nothing twice
    for lite in lites:
        assert [body for name, body in got if name == lite] == sorted(body for name, body in sent if name == lite)


def test_a_client_outside_reaches_every_broker_through_its_external_address(tmp_path: Path, clients: list[Any]) -> None:
    internal_ports = free_ports("127.0.0.1", 2)
    external_ports = free_ports("127.0.0.1", 2)
    forwarders = [Forwarder(("127.0.0.1", port)) for port in external_ports]
    peers = ",".join(f"127.0.0.1:{port}" for port in internal_ports)
    external = ",".join(f.address for f in forwarders)
    brokers: list[BrokerProcess] = []
    try:
        for i, port in enumerate(internal_ports):
            args = ["--peers", peers, "--ordinal", str(i), "--no-bootstrap", "--external-port",
                    str(external_ports[i]), "--external-addresses", external]  # fmt: skip
            brokers.append(start_broker(tmp_path / f"b{i}", port=port, extra_args=args, env=SHARED_ADMIN_ENV))
        assert [b.external_port for b in brokers] == external_ports
        create_metadata([b.admin_endpoint for b in brokers])

        outside = [f.address for f in forwarders]
        inside = peers.split(",")
        for i in range(2):
            assert routed(forwarders[i].address) == first(outside[i], outside)
            assert routed(brokers[i].endpoint) == first(inside[i], inside)

        ring = mb.Membership.parse(peers)
        lites = [f"x-{n}" for n in range(16)]
        owners = {mb.owner(ring, model.QueueId.lmq(TOPIC, lite).topic) for lite in lites}
        assert owners == {0, 1}  # both brokers hold some of them
        exchange(forwarders[0].address, lites, clients)
        assert forwarders[1].connections > 0  # broker 1 was reached only by its external address
    finally:
        for client in reversed(clients):
            client.shutdown()
        clients.clear()
        for broker in brokers:
            broker.stop()
        for forwarder in forwarders:
            forwarder.close()


def test_the_processes_of_a_pod_share_the_external_port(tmp_path: Path, clients: list[Any]) -> None:
    """``--processes 2``: each process is a ring slot with its own external port (the pod's + 1 + i), all sharing
    the pod's external port; routes asked there name the processes' external ports by the pod's template."""
    port, external_port = free_block(3), free_block(3)
    args = ["--processes", "2", "--no-bootstrap", "--external-port", str(external_port),
            "--external-address-template", f"127.0.0.1:{external_port}"]  # fmt: skip
    with start_broker(tmp_path / "data", port=port, extra_args=args, env=SHARED_ADMIN_ENV) as pod:
        assert pod.external_port == external_port
        found = {int(m["index"]): (m["grpc"], int(m["external"])) for m in PROCESS_RE.finditer(pod.log())}
        assert [found[i][1] for i in sorted(found)] == [external_port + 1, external_port + 2]
        inside = [found[i][0] for i in sorted(found)]
        assert inside == [f"127.0.0.1:{port + 1}", f"127.0.0.1:{port + 2}"]
        create_metadata(inside)
        outside = [f"127.0.0.1:{external_port + 1}", f"127.0.0.1:{external_port + 2}"]
        for endpoint in outside:
            assert routed(endpoint) == first(endpoint, outside)
        route, assigned = routed(f"127.0.0.1:{external_port}")  # the pod's port: either process answers
        assert route == assigned and route[0] in outside and route == first(route[0], outside)[0]
        route, assigned = routed(pod.endpoint)
        assert route == assigned and route[0] in inside and route == first(route[0], inside)[0]
        exchange(f"127.0.0.1:{external_port}", [f"p-{n}" for n in range(12)], clients)
