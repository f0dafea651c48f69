"""``protocol.wire``: a request's messages cut out of its bytes and joined again decode exactly as protobuf's own
decode of the request has them, for any request (property-based, against ``SendMessageRequest.FromString``),
including bytes no client's encoder writes (unknown fields, a field given twice, fields out of order), and
bytes that do not decode are refused by ``wire.sent`` as by protobuf. What routing reads natively of the bytes
(``wire.routes``) is what it reads off protobuf's decoded messages (the plain reading), on the same inputs."""

from __future__ import annotations

import pytest
from google.protobuf import message as pb_message
from hypothesis import given, settings
from hypothesis import strategies as st

from lmq_broker.protocol import wire
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb

PROPERTY = settings(max_examples=300, deadline=None)


@st.composite
def messages(draw: st.DrawFn) -> bytes:
    """One Message's encoding: sometimes with a lite topic, user properties, an unknown field or a field twice;
    its parent often one of two names, so that requests of one parent are common."""
    props = pb.SystemProperties(message_id=draw(st.text(max_size=20)), message_type=pb.LITE)
    if draw(st.integers(0, 3)):
        props.lite_topic = draw(st.text(max_size=30))
    message = pb.Message(
        topic=pb.Resource(name=draw(st.sampled_from(["P", "Q"]) | st.text(max_size=20))),
        system_properties=props,
        body=draw(st.binary(max_size=64)),
        user_properties=draw(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2)),
    )
    encoded = message.SerializeToString()
    extra = draw(st.sampled_from(["", "unknown", "twice", "reversed"]))
    if extra == "unknown":  # field 15, varint: kept by protobuf as an unknown field
        encoded += bytes((15 << 3, draw(st.integers(0, 127))))
    elif extra == "twice":  # a second system_properties (or topic): protobuf merges it into the first
        again = pb.Message(system_properties=pb.SystemProperties(lite_topic=draw(st.text(max_size=10))))
        if draw(st.booleans()):
            again = pb.Message(topic=pb.Resource(resource_namespace="ns", name=draw(st.sampled_from(["P", "Q"]))))
        encoded += again.SerializeToString()
    elif extra == "reversed":  # the body first
        body_first = pb.Message(body=message.body).SerializeToString()
        message.ClearField("body")
        encoded = body_first + message.SerializeToString()
    return encoded


def _field1(encoded: bytes) -> bytes:
    """``encoded`` as field 1 of a SendMessageRequest (tag, length varint, bytes)."""
    length, out = len(encoded), bytearray((1 << 3 | 2,))
    while length >= 0x80:
        out.append(length & 0x7F | 0x80)
        length >>= 7
    out.append(length)
    return bytes(out) + encoded


@PROPERTY
@given(st.lists(messages(), max_size=8), st.data())
def test_parts_cut_from_the_bytes_decode_as_the_request_does(encodings: list[bytes], data: st.DataObject) -> None:
    raw = b"".join(_field1(e) for e in encodings)
    if data.draw(st.booleans()):
        raw += bytes((2 << 3, 7))  # an unknown top-level field: the request still decodes
    sent = wire.sent(raw)
    assert sent.data is raw
    decoded = spb.SendMessageRequest.FromString(raw)
    assert sent.request == decoded
    cut = wire.messages_of(raw)
    assert len(cut) == len(decoded.messages)
    indices = data.draw(st.lists(st.integers(0, max(len(cut) - 1, 0)), max_size=8)) if cut else []
    part = spb.SendMessageRequest.FromString(wire.request_of([cut[i] for i in indices]))
    assert list(part.messages) == [decoded.messages[i] for i in indices]
    # each message read where routing reads it: its parent and lite topic, as the whole request has them
    for i in indices:
        one = spb.SendMessageRequest.FromString(wire.request_of([cut[i]])).messages[0]
        assert one.topic.name == decoded.messages[i].topic.name
        assert one.system_properties.HasField("lite_topic") == decoded.messages[i].system_properties.HasField(
            "lite_topic"
        )
        assert one.system_properties.lite_topic == decoded.messages[i].system_properties.lite_topic


def plain_routes(request: spb.SendMessageRequest) -> tuple[str, list[str]] | None:
    """What routing reads off the decoded messages (``forwarding.Forwarder._owners_of``'s plain reading), in
    ``wire.routes``'s shape: None unless every message is a lite one of one parent."""
    parents = {m.topic.name for m in request.messages}
    if len(parents) != 1 or not all(m.system_properties.HasField("lite_topic") for m in request.messages):
        return None
    return parents.pop(), [m.system_properties.lite_topic for m in request.messages]


def test_the_native_reading_is_there() -> None:
    """``make native`` builds it (``make test`` depends on it): without it the property below would compare the
    plain reading with itself."""
    assert wire._native is not None


@PROPERTY
@given(st.lists(messages(), max_size=8), st.booleans())
def test_routes_read_from_the_bytes_are_those_of_the_decoded_messages(encodings: list[bytes], unknown: bool) -> None:
    raw = b"".join(_field1(e) for e in encodings) + (bytes((2 << 3, 7)) if unknown else b"")
    assert wire.routes(raw) == plain_routes(spb.SendMessageRequest.FromString(raw))


@PROPERTY
@given(st.binary(max_size=200))
def test_routes_of_any_bytes_that_decode_are_those_of_the_decoded_messages(raw: bytes) -> None:
    """Any bytes protobuf takes (a group, a field of another wire type than declared: the scanner may give up,
    None, and the plain reading routes them; it never reads something else)."""
    try:
        decoded = spb.SendMessageRequest.FromString(raw)
    except pb_message.DecodeError:
        return
    found = wire.routes(raw)
    assert found is None or found == plain_routes(decoded)


@pytest.mark.parametrize(
    "message",
    [
        pb.Message(topic=pb.Resource(name="P"), system_properties=pb.SystemProperties(lite_topic="")),
        pb.Message(topic=pb.Resource(name="P"), system_properties=pb.SystemProperties(lite_topic="話題/é")),
        pb.Message(system_properties=pb.SystemProperties(lite_topic="t")),  # no parent: ""
    ],
)
def test_routes_of_edge_values(message: pb.Message) -> None:
    raw = spb.SendMessageRequest(messages=[message, message]).SerializeToString()
    assert wire.routes(raw) == plain_routes(spb.SendMessageRequest.FromString(raw))
    assert wire.routes(raw) is not None


def test_no_routes_for_a_message_that_is_not_lite_or_another_parent() -> None:
    lite = pb.Message(topic=pb.Resource(name="P"), system_properties=pb.SystemProperties(lite_topic="t"))
    normal = pb.Message(topic=pb.Resource(name="P"), system_properties=pb.SystemProperties(message_id="m"))
    other = pb.Message(topic=pb.Resource(name="Q"), system_properties=pb.SystemProperties(lite_topic="t"))
    for messages in ([lite, normal], [lite, other], []):
        assert wire.routes(spb.SendMessageRequest(messages=messages).SerializeToString()) is None


@PROPERTY
@given(st.binary(max_size=200))
def test_any_bytes_are_refused_or_taken_as_protobuf_does(raw: bytes) -> None:
    try:
        decoded = spb.SendMessageRequest.FromString(raw)
    except pb_message.DecodeError as exc:
        with pytest.raises(pb_message.DecodeError) as refused:
            wire.sent(raw)
        assert str(refused.value) == str(exc)
        return
    assert wire.sent(raw).request == decoded
    cut = wire.messages_of(raw)
    assert spb.SendMessageRequest.FromString(wire.request_of(cut)).messages == decoded.messages


@pytest.mark.parametrize(
    "raw",
    [
        b"\x0a\x05\x0a\x03\x12\x01",  # a message cut short inside its topic
        b"\x0a\x04\x1a\x02\xaa\x01",  # a lite topic's length missing
        b"\x0a\x06\x0a\x04\x12\x02\xff\xfe",  # a topic name that is not UTF-8
        b"\x0a\x80",  # a length varint cut short
        b"\x0a\x7f",  # a length past the end
    ],
)
def test_malformed_requests_are_refused_as_protobuf_refuses_them(raw: bytes) -> None:
    with pytest.raises(pb_message.DecodeError):
        spb.SendMessageRequest.FromString(raw)
    with pytest.raises(pb_message.DecodeError):
        wire.sent(raw)
