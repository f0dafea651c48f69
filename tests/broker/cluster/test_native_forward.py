"""Sends forwarded by the native edge (``--native-forward on``, ``cluster.native_forward``) against the plain
twin (``off``: every call reaches Python, which forwards over the local hop): real ``serve --processes 2`` pods,
real sockets, real stores. The same requests, valid, malformed or hostile, each sent to process 0's own port,
get the same answers (status, message, every entry's code, message id and offset) and leave the same messages
stored; only the requests the edge can route alone are counted as forwarded natively, each once. A membership
whose placement is not plain withdraws the edge's table at once (sends are Python's again, still stored)."""

from __future__ import annotations

import asyncio
import importlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pods import Pod, pods_of
from pods import start_pod as start_any_pod
from waiting import eventually, eventually_async

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.cluster import local_hop, native_forward, ring, trust
from lmq_broker.cluster import membership as mb
from lmq_broker.cluster.links import V2
from lmq_broker.config import BrokerConfig, NativeForward
from lmq_broker.protocol import native
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.testing import SHARED_ADMIN_ENV, SHARED_ADMIN_KEYS

EDGE = importlib.import_module("lmq_edge")  # a Rust extension (make native): no stubs, Any

PARENT: Final = "NFWD_NS"
SECRET: Final = "native-forward-test-secret"
ENV: Final = {**SHARED_ADMIN_ENV, "LMQ_CLUSTER_SECRET": SECRET}
MODES: Final = ("on", "off")
FORWARDED: Final = "lmq_edge_forwarded_calls_total"
Answer = tuple[int, str, list[tuple[int, str, int]]]


def start_pod(data: Path, mode: str) -> Pod:
    return start_any_pod(data, PARENT, ["--edge", "native", "--native-forward", mode], ENV)


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[dict[str, Pod]]:
    with pods_of(tmp_path, MODES, start_pod) as started:
        yield started


def message(lite: str, message_id: str, **user: str) -> pb.Message:
    props = pb.SystemProperties(message_id=message_id, message_type=pb.LITE, lite_topic=lite, body_encoding=pb.IDENTITY)
    return pb.Message(topic=pb.Resource(name=PARENT), body=b"b", system_properties=props, user_properties=user)


def encoded(*messages: pb.Message) -> bytes:
    return spb.SendMessageRequest(messages=messages).SerializeToString()


def requests(here: list[str], there: list[str]) -> list[tuple[bytes, bool | None]]:
    """Each as bytes, and whether the edge forwards it alone (None: if process 1 owns it): ``here`` topics owned
    by process 0 (where every request is sent), ``there`` by process 1."""
    one = encoded(message(there[0], "m-1"))
    three = encoded(message(there[0], "m-2"), message(there[1], "m-3"), message(there[1], "m-4"))
    return [
        (one, True),
        (three, True),
        (three + bytes((2 << 3, 5)), True),  # an unknown field of the request: decodes, forwarded as it came
        (encoded(*(message(there[2], f"many-{i}") for i in range(32))), True),
        (encoded(*(message(there[2], f"more-{i}") for i in range(33))), False),  # more: Python's (forward.rs)
        (encoded(message(there[3], "bad-1")).replace(b"bad-1", b"bad\xff1"), True),  # the owner: not UTF-8
        (encoded(message(there[4], "r-1", **{model.EMPTY_BODY_PROPERTY: "1"})), True),  # reserved: refused there
        (encoded(message(there[5], "r-2"), message(there[5], "r-3", **{model.EMPTY_BODY_PROPERTY: ""})), True),
        (encoded(message(there[6], "m-5")).replace(PARENT.encode(), b"NFWD_N\xfe"), False),  # parent not UTF-8
        (encoded(message(there[0], "m-6"), message(here[0], "m-7")), False),  # two owners
        (encoded(message(here[1], "m-8")), False),  # this process's own
        (encoded(message(there[0], "m-9"), pb.Message(topic=pb.Resource(name=PARENT), body=b"n")), False),  # not LITE
        (one[:-1], False),  # cut short: the scanner does not follow it
        (b"\xff\xff\xff", False),
        (b"", False),  # no messages
        (encoded(message("x" * 200, "m-10")), None),  # a lite topic too long: refused by whoever owns it
    ]


def answer(endpoint: str, payload: bytes, metadata: tuple[tuple[str, str], ...] = ()) -> Answer:
    with grpc.insecure_channel(endpoint) as channel:
        call = channel.unary_unary(
            V2 + "SendMessage", request_serializer=None, response_deserializer=spb.SendMessageResponse.FromString
        )
        reply: spb.SendMessageResponse = call(payload, metadata=metadata, timeout=10)
    entries = [(int(e.status.code), e.message_id, e.offset) for e in reply.entries]
    return int(reply.status.code), reply.status.message, entries


def stored(pod: Pod, roles: dict[str, str]) -> dict[str, int]:
    out = {}
    for slot, endpoint in enumerate(pod.endpoints):
        with AdminClient(endpoint, timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
            for topic in admin.list_lite_topics(PARENT, limit=1000).topics:
                meta = topic.meta
                out[f"{slot}:{roles.get(meta.lite, meta.lite)}"] = meta.max_offset
    return out


def warm_up(pod: Pod, lite: str) -> int:
    """Sends to ``lite`` (process 1's) until one is forwarded natively: the edge opens its connection to process 1
    at its first such call, which Python serves meanwhile. How many were sent."""
    sent = 0

    def forwarded() -> bool:
        nonlocal sent
        sent += 1
        assert answer(pod.endpoints[0], encoded(message(lite, f"w-{sent}")))[0] == pb.OK
        return pod.metric(0, FORWARDED) > 0

    eventually(forwarded, "a send forwarded natively")
    return sent


def test_every_request_gets_the_same_answer_and_store_with_native_forwarding_on_and_off(
    pods: dict[str, Pod],
) -> None:
    answers: dict[str, list[Answer]] = {}
    topics: dict[str, dict[str, int]] = {}
    warm = 0
    for mode, pod in pods.items():  # "on" first: "off" gets as many warm-up sends, for the same stores
        here, there = pod.owned_by(0, "h", 2), pod.owned_by(1, "t", 8)
        roles = {lite: f"h{i}" for i, lite in enumerate(here)} | {lite: f"t{i}" for i, lite in enumerate(there)}
        if mode == "on":
            warm = warm_up(pod, there[7])
        else:
            for n in range(warm):
                assert answer(pod.endpoints[0], encoded(message(there[7], f"w-{n + 1}")))[0] == pb.OK
        before = pod.metric(0, FORWARDED)
        cases = requests(here, there)
        answers[mode] = [answer(pod.endpoints[0], payload) for payload, _ in cases]
        # a client's forged peer header: no peer's copy (the edge leaves it to Python, which serves a client)
        forged = ((trust.HEADER, f"1;{time.time_ns() // 1_000_000};{'0' * 64}"),)
        answers[mode].append(answer(pod.endpoints[0], encoded(message(there[0], "m-11")), forged))
        topics[mode] = stored(pod, roles)
        natively = pod.metric(0, FORWARDED) - before
        if mode == "on":
            too_long = model.QueueId.lmq(PARENT, "x" * 200).topic
            expected = sum(1 for _, alone in cases if alone is True) + (
                mb.owner(mb.Membership(tuple(pod.endpoints), (2,)), too_long) == 1
            )
            assert natively == expected
        else:
            assert natively == 0
        codes = [code for code, _, _ in answers[mode]]
        assert codes[:5] == [pb.OK] * 5, answers[mode]
        assert codes[5] == pb.BAD_REQUEST, answers[mode]  # protobuf's refusal, at the owner when forwarded natively
        assert pb.OK not in codes[6:8], answers[mode]
        assert codes[-1] == pb.OK, answers[mode]
        for refused in ("1:t3", "1:t4", "1:t5"):  # of requests refused whole
            assert refused not in topics[mode], topics[mode]
    assert topics["on"] == topics["off"]
    assert answers["on"] == answers["off"]


def test_a_placement_that_is_not_plain_withdraws_the_table_at_once(tmp_path: Path) -> None:
    """Process 0 is given an older ring (a scale-up's history): the edge forwards nothing from then on, every send
    still stored at its owner by Python's forwarding."""
    pod = start_pod(tmp_path / "on", "on")
    try:
        there = pod.owned_by(1, "t", 2)
        warm_up(pod, there[0])
        with AdminClient(pod.endpoints[0], timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
            admin.set_cluster(pod.endpoints, (1, 2), slot=0, force=True)
        before = pod.metric(0, FORWARDED)
        for n in range(5):
            assert answer(pod.endpoints[0], encoded(message(there[1], f"after-{n}")))[0] == pb.OK
        assert pod.metric(0, FORWARDED) == before
        with AdminClient(pod.endpoints[1], timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
            assert admin.describe_lite_topic(PARENT, there[1]).meta.max_offset == 5
    finally:
        pod.broker.stop()


def test_the_flags_and_placements_that_allow_it() -> None:
    config = BrokerConfig(native_forward=NativeForward.ON, local_hop_dir=Path("/tmp/hop"))
    assert native_forward.wanted(config)
    assert not native_forward.wanted(config.model_copy(update={"native_forward": NativeForward.OFF}))
    assert not native_forward.wanted(config.model_copy(update={"acl": True}))
    assert not native_forward.wanted(config.model_copy(update={"access_key": "ak"}))
    assert not native_forward.wanted(config.model_copy(update={"replicas": 2}))
    assert not native_forward.wanted(config.model_copy(update={"local_hop_dir": None}))
    ring = mb.Membership(("a:1", "a:2"), (2,))
    assert native_forward.plain(ring, 0, handed_over=False)
    assert not native_forward.plain(ring, -1, handed_over=False)
    assert not native_forward.plain(ring, 0, handed_over=True)
    assert not native_forward.plain(mb.Membership(("a:1", "a:2"), (1, 2)), 0, handed_over=False)


def test_a_clients_hello_is_refused_where_clients_sends_are_not_taken() -> None:
    """A hop server without a client send (``--acl`` or ``--access-key``) verifies only the peers' hello."""
    secret = SECRET.encode()
    now = time.time_ns() // 1_000_000
    clients = trust.header(secret, local_hop.HELLO_CLIENTS, 1, now)[1].encode()
    peers = trust.header(secret, local_hop.HELLO, 1, now)[1].encode()
    assert local_hop.hello_kind(secret, peers, clients=False) == local_hop.HELLO
    assert local_hop.hello_kind(secret, clients, clients=False) is None
    assert local_hop.hello_kind(secret, clients, clients=True) == local_hop.HELLO_CLIENTS
    assert local_hop.hello_kind(b"other", clients, clients=True) is None


@settings(max_examples=2_000, deadline=None)
@given(name=st.text(max_size=400), slots=st.integers(min_value=1, max_value=512))
def test_the_edges_ring_hash_is_pythons(name: str, slots: int) -> None:
    """The slot the native edge computes for a name (BLAKE2b, 8-byte digest, then jump hashing) is
    ``ring.slot_of``'s, for names of any length (BLAKE2b's blocks are 128 bytes) and any text."""
    assert EDGE.ring_slot(name, slots) == ring.slot_of(name, slots)


@pytest.mark.asyncio
async def test_forwards_past_what_one_sibling_connection_carries_are_left_to_python(tmp_path: Path) -> None:
    """A sibling that never answers (here: a socket that reads nothing): the edge keeps at most 1,024 forwards
    waiting on its connection; the calls past them go to Python (where admission applies), counted as crowded,
    so a client opening calls faster than the owner answers holds a bounded amount in the edge."""
    python_served: list[bytes] = []

    async def served(request: bytes, _context: object) -> bytes:
        python_served.append(request)
        return spb.SendMessageResponse(status=pb.Status(code=pb.OK)).SerializeToString()

    handler = grpc.unary_unary_rpc_method_handler(served)
    server = native.NativeServer(1 << 20, 64)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("apache.rocketmq.v2.MessagingService", {"SendMessage": handler}),)
    )
    port = server.listen("127.0.0.1", 0)
    await server.start()
    silent = tmp_path / "silent.sock"
    accepted: list[asyncio.StreamWriter] = []

    async def hold(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # reads nothing, answers nothing

    sibling = await asyncio.start_unix_server(hold, path=str(silent))
    server.forward_to(2, 0, 60.0, [(1, str(silent), b"hello", b"")])
    theirs = [n for n in (f"x{i}" for i in range(10_000)) if ring.slot_of(f"%LMQ%${PARENT}${n}", 2) == 1]
    calls: list[asyncio.Future[spb.SendMessageResponse]] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            send = channel.unary_unary(
                V2 + "SendMessage",
                request_serializer=spb.SendMessageRequest.SerializeToString,
                response_deserializer=spb.SendMessageResponse.FromString,
            )

            def request(n: int) -> spb.SendMessageRequest:
                return spb.SendMessageRequest(messages=[message(theirs[n % len(theirs)], f"m{n}")])

            await send(request(0), timeout=10)  # no connection yet: Python's, and the edge connects
            await eventually_async(lambda: dict(server.stats())["forward_connections"] == 1, "connected")
            before = len(python_served)
            calls = [asyncio.ensure_future(send(request(n), timeout=60)) for n in range(1, 1_101)]
            await eventually_async(
                lambda: len(python_served) - before == 1_100 - 1_024, "the calls past 1,024 served by Python", 30
            )
            stats = dict(server.stats())
            assert (stats["forwarded_calls"], stats["forwards_crowded"]) == (1_024, 76)
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
    finally:
        await server.stop(0)
        sibling.close()
        for writer in accepted:
            writer.close()
