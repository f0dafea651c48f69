"""The raw send path (``--send-path raw``: SendMessage keeps the request's bytes, forwarded parts are cut out of
them, ``protocol.wire``) against its plain twin (``decoded``: grpcio decodes, forwarded parts are encoded again):
real ``serve --processes 2`` pods, real sockets, real stores. The same requests, valid, malformed or hostile,
each sent to process 0's own port with topics of both processes, get the same answer (status, message, every
entry's code, message id and offset) from both pods, and a request refused whole stores nothing anywhere."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import grpc
import pytest

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.cluster import membership as mb
from lmq_broker.cluster.links import V2
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.testing import SHARED_ADMIN_ENV, SHARED_ADMIN_KEYS, BrokerProcess, start_broker

PARENT: Final = "PATH_NS"
PROCESS_RE: Final = re.compile(r"lmq-broker process (\d+) grpc=(\S+) metrics=")
PATHS: Final = ("raw", "decoded")
Answer = tuple[int, str, list[tuple[int, str, int]]]


def start_pod(data: Path, path: str) -> tuple[BrokerProcess, list[str]]:
    args = ["--processes", "2", "--no-bootstrap", "--send-path", path, "--native-forward", "off"]  # Python's paths
    broker = start_broker(data, extra_args=args, env=SHARED_ADMIN_ENV)
    found = {int(m[1]): m[2] for m in PROCESS_RE.finditer(broker.log())}
    with AdminClient(broker.endpoint, timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
        admin.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
    return broker, [found[0], found[1]]


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[dict[str, tuple[BrokerProcess, list[str]]]]:
    started: dict[str, tuple[BrokerProcess, list[str]]] = {}
    try:
        for path in PATHS:
            started[path] = start_pod(tmp_path / path, path)
        yield started
    finally:
        for broker, _ in started.values():
            broker.stop()


def owned_by(endpoints: list[str], slot: int, prefix: str, count: int) -> list[str]:
    membership = mb.Membership(tuple(endpoints), (len(endpoints),))
    names = (f"{prefix}-{i}" for i in range(100_000))
    return [n for n in names if mb.owner(membership, model.QueueId.lmq(PARENT, n).topic) == slot][:count]


def message(lite: str, message_id: str, **user: str) -> pb.Message:
    props = pb.SystemProperties(message_id=message_id, message_type=pb.LITE, lite_topic=lite, body_encoding=pb.IDENTITY)
    return pb.Message(topic=pb.Resource(name=PARENT), body=b"b", system_properties=props, user_properties=user)


def encoded(*messages: pb.Message) -> bytes:
    return spb.SendMessageRequest(messages=messages).SerializeToString()


def requests(here: list[str], there: list[str]) -> list[bytes]:
    """Each as bytes: ``here`` topics owned by process 0, ``there`` by process 1 (names differ per pod)."""
    both = encoded(message(there[0], "m-1"), message(here[0], "m-2"), message(there[1], "m-3"))
    not_utf8 = encoded(message(here[1], "bad-1"), message(there[2], "bad-2")).replace(b"bad-2", b"bad\xff2")
    topic_not_utf8 = encoded(message(there[3], "bad-3")).replace(PARENT.encode(), PARENT[:-1].encode() + b"\xfe")
    return [
        both,
        encoded(message(there[0], "m-4")),  # forwarded whole, as it came
        both + bytes((2 << 3, 5)),  # an unknown field of the request: decodes, and is forwarded
        b"\xff\xff\xff",  # not protobuf
        not_utf8,  # a forwarded message's id is not UTF-8: the whole request refused, nothing stored
        topic_not_utf8,
        both[:-1],  # cut short
        b"",  # no messages
        encoded(message(there[4], "m-5", **{model.EMPTY_BODY_PROPERTY: "1"}), message(here[2], "m-6")),  # reserved
        encoded(message("x" * 200, "m-7"), message(here[3], "m-8")),  # a lite topic too long
        encoded(message(there[5], "m-9"), pb.Message(topic=pb.Resource(name=PARENT), body=b"n")),  # not LITE
        encoded(message(there[6], "m-10"), message(there[6], "m-11"), message(here[4], "m-12")),
    ]


def answer(endpoint: str, payload: bytes) -> Answer:
    with grpc.insecure_channel(endpoint) as channel:
        call = channel.unary_unary(
            V2 + "SendMessage", request_serializer=None, response_deserializer=spb.SendMessageResponse.FromString
        )
        reply: spb.SendMessageResponse = call(payload, timeout=10)
    entries = [(int(e.status.code), e.message_id, e.offset) for e in reply.entries]
    return int(reply.status.code), reply.status.message, entries


def stored(endpoints: list[str], roles: dict[str, str]) -> dict[str, int]:
    """Each lite topic of PARENT stored on either process, by its role (``h1``: here[1]), with its max offset."""
    out = {}
    for slot, endpoint in enumerate(endpoints):
        with AdminClient(endpoint, timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
            for topic in admin.list_lite_topics(PARENT, limit=1000).topics:
                meta = topic.meta
                out[f"{slot}:{roles.get(meta.lite, meta.lite)}"] = meta.max_offset
    return out


def test_every_request_gets_the_same_answer_on_both_send_paths(
    pods: dict[str, tuple[BrokerProcess, list[str]]],
) -> None:
    answers: dict[str, list[Answer]] = {}
    topics: dict[str, dict[str, int]] = {}
    for path, (_, endpoints) in pods.items():
        here, there = owned_by(endpoints, 0, "h", 5), owned_by(endpoints, 1, "t", 7)
        roles = {lite: f"h{i}" for i, lite in enumerate(here)} | {lite: f"t{i}" for i, lite in enumerate(there)}
        answers[path] = [answer(endpoints[0], payload) for payload in requests(here, there)]
        topics[path] = stored(endpoints, roles)
        codes = [code for code, _, _ in answers[path]]
        assert codes[:3] == [pb.OK] * 3, answers[path]
        assert codes[3:7] == [pb.BAD_REQUEST] * 4, answers[path]  # refused whole, before anything is stored
        assert all(code != pb.OK for code in codes[7:11]), answers[path]
        assert codes[11] == pb.OK, answers[path]
        assert topics[path]["1:t0"] == 3  # three requests carried it, the one forwarded whole among them
        assert topics[path]["1:t6"] == 2
        for refused in ("0:h1", "1:t2", "1:t3", "1:t4", "0:h2"):  # of requests refused whole
            assert refused not in topics[path], topics[path]
    assert topics["raw"] == topics["decoded"]
    for raw, plain in zip(answers["raw"], answers["decoded"], strict=True):
        assert raw[0] == plain[0]
        assert raw[2] == plain[2]  # every entry's code, message id and offset
        if raw[0] == pb.BAD_REQUEST:  # protobuf's text, the same parser on both paths
            assert raw[1] == plain[1]
