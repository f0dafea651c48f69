"""``protocol.wire``: a request's messages cut out of its bytes and joined again decode exactly as protobuf's own
decode of the request has them, for any request (property-based, against ``SendMessageRequest.FromString``),
including bytes no client's encoder writes (unknown fields, a field given twice, fields out of order), and
bytes that do not decode are refused by ``wire.sent`` as by protobuf."""

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
    """One Message's encoding: sometimes with a lite topic, user properties, an unknown field or a field twice."""
    props = pb.SystemProperties(message_id=draw(st.text(max_size=20)), message_type=pb.LITE)
    if draw(st.booleans()):
        props.lite_topic = draw(st.text(max_size=30))
    message = pb.Message(
        topic=pb.Resource(name=draw(st.text(max_size=20))),
        system_properties=props,
        body=draw(st.binary(max_size=64)),
        user_properties=draw(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2)),
    )
    encoded = message.SerializeToString()
    extra = draw(st.sampled_from(["", "unknown", "twice", "reversed"]))
    if extra == "unknown":  # field 15, varint: kept by protobuf as an unknown field
        encoded += bytes((15 << 3, draw(st.integers(0, 127))))
    elif extra == "twice":  # a second system_properties: protobuf merges it into the first
        again = pb.Message(system_properties=pb.SystemProperties(lite_topic=draw(st.text(max_size=10))))
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
