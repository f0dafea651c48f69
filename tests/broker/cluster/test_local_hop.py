"""The local hop (``cluster.local_hop``) against its plain twin, gRPC between the processes of one pod: real
``serve --processes 2`` pods, real sockets, real stores. The same sends give the same receipts and placements;
a peer's copy of a topic the process does not own is refused the same way; a forged hello is refused and
counted; and a kill -9 of the owner mid-stream loses no acknowledged message (the client gets an error, its
retry succeeds once the supervisor has started the owner again)."""

from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import grpc
import pytest
from pods import Pod, child_pid, free_block, pods_of
from pods import start_pod as start_any_pod
from waiting import eventually

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.cluster import local_hop, trust
from lmq_broker.cluster import membership as mb
from lmq_broker.cluster.links import V2
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.testing import SHARED_ADMIN_ENV, SHARED_ADMIN_KEYS, BrokerProcess, start_broker

PARENT: Final = "HOP_NS"
SECRET: Final = "local-hop-test-secret"
ENV: Final = {**SHARED_ADMIN_ENV, "LMQ_CLUSTER_SECRET": SECRET}
HOPS: Final = ("socket", "grpc")


def start_pod(data: Path, hop: str) -> Pod:
    """``hop``: socket or grpc, every send through Python (``--native-forward off``); ``native``: the socket,
    with the native edge forwarding single-owner sends itself (``--native-forward on``)."""
    native = ["--edge", "native", "--native-forward", "on"] if hop == "native" else ["--native-forward", "off"]
    return start_any_pod(data, PARENT, ["--local-hop", "socket" if hop == "native" else hop, *native], ENV)


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[dict[str, Pod]]:
    with pods_of(tmp_path, HOPS, start_pod) as started:
        yield started


def message(lite: str, message_id: str) -> pb.Message:
    props = pb.SystemProperties(
        message_id=message_id, message_type=pb.LITE, lite_topic=lite, body_encoding=pb.IDENTITY, born_host="t"
    )
    return pb.Message(topic=pb.Resource(name=PARENT), body=message_id.encode(), system_properties=props)


def send(
    endpoint: str, messages: list[pb.Message], metadata: tuple[tuple[str, str], ...] = ()
) -> spb.SendMessageResponse:
    with grpc.insecure_channel(endpoint) as channel:
        call = channel.unary_unary(
            V2 + "SendMessage",
            request_serializer=spb.SendMessageRequest.SerializeToString,
            response_deserializer=spb.SendMessageResponse.FromString,
        )
        reply: spb.SendMessageResponse = call(spb.SendMessageRequest(messages=messages), metadata=metadata, timeout=10)
        return reply


def receipts(reply: spb.SendMessageResponse) -> list[tuple[int, str, int]]:
    return [(e.status.code, e.message_id, e.offset) for e in reply.entries]


def max_offsets(pod: Pod, slot: int, lites: list[str]) -> dict[str, int]:
    with AdminClient(pod.endpoints[slot], timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
        return {lite: admin.describe_lite_topic(PARENT, lite).meta.max_offset for lite in lites}


def test_forwarded_sends_give_the_same_receipts_over_both_hops(pods: dict[str, Pod]) -> None:
    """Single sends and a batch across both owners, each through process 0's own port: the same statuses,
    message ids and offsets over the socket as over gRPC, each message stored at its owner, and only the socket
    pod's forwards counted as local hop calls."""
    answers: dict[str, list[list[tuple[int, str, int]]]] = {}
    for hop, pod in pods.items():
        here, there = pod.owned_by(0, "h", 3), pod.owned_by(1, "t", 3)
        requests = [[message(lite, f"{lite}-{n}")] for n in range(3) for lite in (*here, *there)]
        requests.append([message(lite, f"{lite}-batch") for lite in (*there, *here)])
        answers[hop] = [receipts(send(pod.endpoints[0], request)) for request in requests]
        assert all(code == pb.OK for answer in answers[hop] for code, _, _ in answer), answers[hop]
        assert max_offsets(pod, 1, there) == dict.fromkeys(there, 4)  # three single sends and the batch's
        assert max_offsets(pod, 0, here) == dict.fromkeys(here, 4)
    assert answers["socket"] == answers["grpc"]
    assert pods["socket"].metric(0, "lmq_local_hop_calls_total") > 0
    assert pods["grpc"].metric(0, "lmq_local_hop_calls_total") == 0


def _exchange(path: Path, frames: bytes) -> bytes:
    """Write ``frames`` to the local hop socket at ``path``; what comes back until the owner closes or one
    answer frame is complete."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(frames)
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk
            if len(data) >= 8 and len(data) >= 8 + struct.unpack_from(">I", data)[0]:
                return data


def _hello(secret: str) -> bytes:
    _, value = trust.header(secret.encode(), local_hop.HELLO, 1, time.time_ns() // 1_000_000)
    return local_hop.frame(0, value.encode())


def test_a_peer_copy_not_owned_is_refused_alike_and_a_forged_hello_is_refused(pods: dict[str, Pod]) -> None:
    """Process 1 gets a peer's copy of a send whose topic process 0 owns: over the socket (a valid hello) and
    over gRPC (a valid peer header) the same NOT_OWNER refusal, nothing stored. A hello signed with another
    secret closes the connection unanswered, counted in ``lmq_local_hop_refused``."""
    pod = pods["socket"]
    lite = pod.owned_by(0, "r", 1)[0]
    request = spb.SendMessageRequest(messages=[message(lite, "refused-1")])
    path = local_hop.socket_path(pod.broker.data_dir / "hop", pod.endpoints[1])
    assert path is not None and path.exists()
    answer = _exchange(path, _hello(SECRET) + local_hop.frame(7, request.SerializeToString()))
    length, request_id = struct.unpack_from(">II", answer)
    assert request_id == 7
    over_socket = spb.SendMessageResponse.FromString(answer[8 : 8 + length])
    header = trust.header(SECRET.encode(), V2 + "SendMessage", 1, time.time_ns() // 1_000_000)
    over_grpc = send(pod.endpoints[1], list(request.messages), (header,))
    assert over_socket.status.code == over_grpc.status.code == pb.INTERNAL_ERROR
    assert over_socket.status.message.startswith("not the owner")
    assert over_socket.status.message == over_grpc.status.message
    with AdminClient(pod.endpoints[1], timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
        assert not admin.list_lite_topics(PARENT).topics

    assert pod.metric(1, "lmq_local_hop_refused_total") == 0
    forged = _exchange(path, _hello("another-secret") + local_hop.frame(8, request.SerializeToString()))
    assert forged == b""
    assert pod.metric(1, "lmq_local_hop_refused_total") == 1


@dataclass
class Ledger:
    attempts: dict[str, int]
    acked: dict[str, list[int]]  # offsets of the receipts
    errors: int = 0


def _send_until_stopped(endpoint: str, lites: list[str], stop: threading.Event, ledger: Ledger) -> None:
    """One message at a time, round the lite topics, each sent again until acknowledged."""
    with grpc.insecure_channel(endpoint) as channel:
        call = channel.unary_unary(
            V2 + "SendMessage",
            request_serializer=spb.SendMessageRequest.SerializeToString,
            response_deserializer=spb.SendMessageResponse.FromString,
        )
        n = 0
        while not stop.is_set():
            lite = lites[n % len(lites)]
            request = spb.SendMessageRequest(messages=[message(lite, f"{lite}-{n}")])
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                ledger.attempts[lite] += 1
                try:
                    reply = call(request, timeout=10)
                except grpc.RpcError:
                    ledger.errors += 1
                    continue
                if reply.status.code == pb.OK:
                    ledger.acked[lite].append(reply.entries[0].offset)
                    break
                ledger.errors += 1
            n += 1


@pytest.mark.parametrize("hop", (*HOPS, "native"))
def test_kill_9_of_the_owner_mid_stream_loses_nothing_acknowledged(tmp_path: Path, hop: str) -> None:
    """Sends through process 0 to topics process 1 owns while process 1 is killed -9 and started again by its
    supervisor: some sends fail meanwhile and are sent again; every acknowledged message is in the owner's store
    afterwards (at least once: no topic holds fewer messages than were acknowledged, none more than sent). With
    ``native`` the edge forwards them itself, falling back to Python while the owner's socket is gone."""
    pod = start_pod(tmp_path / "pod", hop)
    try:
        lites = pod.owned_by(1, "k", 8)
        ledger = Ledger(dict.fromkeys(lites, 0), {lite: [] for lite in lites})
        stop = threading.Event()
        sender = threading.Thread(target=_send_until_stopped, args=(pod.endpoints[0], lites, stop, ledger))
        sender.start()
        try:
            eventually(lambda: sum(map(len, ledger.acked.values())) >= 40, "sends acknowledged before the kill")
            victim = child_pid(pod.broker, 1)
            assert victim is not None
            os.kill(victim, signal.SIGKILL)
            eventually(lambda: ledger.errors > 0, "a send failing while the owner is down", timeout_s=30)
            restarted = eventually(lambda: (child_pid(pod.broker, 1) or victim) != victim, "the owner started again")
            assert restarted
            before = sum(map(len, ledger.acked.values()))
            eventually(
                lambda: sum(map(len, ledger.acked.values())) >= before + 40, "sends acknowledged after the restart", 60
            )
            if hop == "native":  # its connection opened again (Python serves the sends of the first 0.5 s after a
                # refused connect, enough for 40 sends on a quick host)
                eventually(lambda: pod.metric(0, "lmq_edge_forward_connections_total") >= 2, "the edge reconnected")
        finally:
            stop.set()
            sender.join(90)
        stored = max_offsets(pod, 1, lites)
        for lite in lites:
            offsets = ledger.acked[lite]
            assert len(set(offsets)) == len(offsets), f"two receipts with one offset in {lite}"
            assert len(offsets) <= stored[lite] <= ledger.attempts[lite], (lite, len(offsets), stored[lite])
            assert all(offset < stored[lite] for offset in offsets)
    finally:
        pod.broker.stop()


def test_a_socket_path_too_long_leaves_the_pod_on_grpc(tmp_path: Path) -> None:
    """A data directory so deep that the socket's path would not fit a Unix socket address: the pod warns once
    and its processes forward over gRPC, every send still stored at its owner."""
    data = tmp_path / ("d" * 100)
    assert local_hop.socket_path(data / "hop", "127.0.0.1:65535") is None
    pod = start_pod(data, "socket")
    try:
        there = pod.owned_by(1, "long", 2)
        for n, lite in enumerate(there):
            assert send(pod.endpoints[0], [message(lite, f"{lite}-{n}")]).status.code == pb.OK
        assert max_offsets(pod, 1, there) == dict.fromkeys(there, 1)
        assert pod.metric(0, "lmq_local_hop_calls_total") == 0
        assert "the local hop socket path is too long" in pod.broker.log()
    finally:
        pod.broker.stop()


@pytest.mark.parametrize("hop", ("socket", "native"))
def test_pods_on_the_same_ports_forward_to_each_others_processes_not_to_their_own(tmp_path: Path, hop: str) -> None:
    """Two ``--processes 2`` pods on the same ports, as a StatefulSet's pods are (here on 127.0.0.1 and 127.0.0.2):
    a send through pod 0 to a topic of pod 1's process on port p is stored there, not offered to pod 0's own
    process on p over the local hop (sockets are named by port)."""
    base = free_block(3)
    peers = f"127.0.0.1:{base},127.0.0.2:{base}"
    native = ["--edge", "native", "--native-forward", "on"] if hop == "native" else ["--native-forward", "off"]
    started: dict[int, BrokerProcess] = {}

    def start(i: int) -> None:
        host = f"127.0.0.{i + 1}"
        args = ["--processes", "2", "--no-bootstrap", "--host", host, "--peers", peers, *native]
        args += ["--advertised-address", f"{host}:{base}"]
        started[i] = start_broker(tmp_path / f"pod{i}", port=base, extra_args=args, env=ENV)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert len(started) == 2, "both pods started"
        members = [f"127.0.0.{pod + 1}:{base + 1 + process}" for pod in range(2) for process in range(2)]
        for access in (f"127.0.0.1:{base}", f"127.0.0.2:{base}"):
            with AdminClient(access, timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
                admin.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
        ring = mb.Membership(tuple(members), (len(members),))
        names = (f"far-{i}" for i in range(100_000))
        far = [n for n in names if mb.owner(ring, model.QueueId.lmq(PARENT, n).topic) == 3][:3]
        for n, lite in enumerate(far):  # through pod 0's process 0: its sibling listens on the owner's port
            reply = send(members[0], [message(lite, f"{lite}-{n}")])
            assert reply.status.code == pb.OK, reply.status
        with AdminClient(members[3], timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
            assert {lite: admin.describe_lite_topic(PARENT, lite).meta.max_offset for lite in far} == dict.fromkeys(
                far, 1
            )
    finally:
        for broker in started.values():
            broker.stop()
