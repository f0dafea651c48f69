"""The MQTT 3.1.1 codec (5.0: test_codec5.py): every packet survives encode -> decode however the bytes are
split, arbitrary bytes never raise anything but MalformedPacket, and the spec's MUST-close cases are refused."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmq_broker.mqtt import codec

TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=40)
TOPIC = TEXT.filter(lambda t: t and "+" not in t and "#" not in t)
PACKET_ID = st.integers(1, 65535)
QOS = st.integers(0, 2)


@st.composite
def publishes(draw: st.DrawFn) -> codec.Publish:
    qos = draw(QOS)
    return codec.Publish(
        topic=draw(TOPIC),
        payload=draw(st.binary(max_size=300)),
        qos=qos,
        retain=draw(st.booleans()),
        dup=draw(st.booleans()) if qos else False,
        packet_id=draw(PACKET_ID) if qos else None,
    )


@st.composite
def connects(draw: st.DrawFn) -> codec.Connect:
    will = None
    if draw(st.booleans()):
        will = codec.Will(draw(TOPIC), draw(st.binary(max_size=50)), draw(QOS), draw(st.booleans()))
    username = draw(st.none() | TEXT)
    return codec.Connect(
        client_id=draw(TEXT),
        clean_session=draw(st.booleans()),
        keep_alive_s=draw(st.integers(0, 65535)),
        will=will,
        username=username,
        password=None if username is None else draw(st.none() | st.binary(max_size=30)),
        level=draw(st.sampled_from([codec.LEVEL_3_1_1, codec.LEVEL_3_1])),
    )


PACKETS = st.one_of(
    publishes(),
    connects(),
    st.builds(codec.PacketId, st.sampled_from([codec.PUBACK, codec.PUBREC, codec.PUBREL, codec.PUBCOMP]), PACKET_ID),
    st.builds(codec.Subscribe, PACKET_ID, st.lists(st.tuples(TEXT, QOS), min_size=1, max_size=5).map(tuple)),
    st.builds(codec.Unsubscribe, PACKET_ID, st.lists(TEXT, min_size=1, max_size=5).map(tuple)),
    st.builds(codec.SubAck, PACKET_ID, st.lists(st.sampled_from([0, 1, 2, 0x80]), min_size=1).map(tuple)),
    st.builds(codec.ConnAck, st.booleans(), st.sampled_from(list(codec.ConnectCode))),
    st.sampled_from([codec.Bare(codec.PINGREQ), codec.Bare(codec.PINGRESP), codec.Bare(codec.DISCONNECT)]),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(PACKETS, min_size=1, max_size=6), st.data())
def test_packets_survive_a_round_trip_split_anywhere(packets: list[codec.Packet], data: st.DataObject) -> None:
    wire = b"".join(map(codec.encode, packets))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=8)))
    decoder = codec.Decoder()
    out: list[codec.Packet] = []
    for start, end in zip([0, *cuts], [*cuts, len(wire)], strict=True):
        out += decoder.feed(wire[start:end])
    assert out == packets
    assert decoder.pending_bytes == 0


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_raise_malformed_only(junk: bytes) -> None:
    """Anything else escaping (IndexError, UnicodeDecodeError, ValueError...) fails the test; what does decode
    is a packet the encoder writes back to the same value."""
    assert_decodes_consistently(junk)


def assert_decodes_consistently(wire: bytes) -> None:
    try:
        decoded = codec.Decoder(max_packet_bytes=10_000).feed(wire)
    except codec.MalformedPacket as exc:
        assert exc.reason
        return
    for packet in decoded:
        assert codec.Decoder().feed(codec.encode(packet)) == [packet]


@settings(max_examples=200, deadline=None)
@given(publishes(), st.integers(0, 200), st.integers(0, 255))
def test_a_flipped_byte_never_escapes_as_another_error(packet: codec.Publish, at: int, value: int) -> None:
    wire = bytearray(codec.encode(packet))
    wire[at % len(wire)] = value
    assert_decodes_consistently(bytes(wire))


def frame(first: int, body: bytes) -> bytes:
    assert len(body) < 128
    return bytes((first, len(body))) + body


def connect_body(name: bytes = b"MQTT", level: int = 4, flags: int = 0x02, payload: bytes = b"\x00\x01c") -> bytes:
    return len(name).to_bytes(2, "big") + name + bytes((level, flags)) + b"\x00\x3c" + payload


@pytest.mark.parametrize(
    ("wire", "reason"),
    [
        (frame(0x10, connect_body(flags=0x03)), "reserved CONNECT flag"),
        (frame(0x10, connect_body(flags=0x02 | 0x18 | 0x04, payload=b"\x00\x01c\x00\x01t\x00\x00")), "will QoS"),
        (frame(0x10, connect_body(flags=0x02 | 0x20)), "will QoS/retain"),
        (frame(0x10, connect_body(flags=0x02 | 0x40, payload=b"\x00\x01c\x00\x01p")), "password without user"),
        (frame(0x10, connect_body(name=b"XYZW")), "protocol name"),
        (frame(0x10, connect_body() + b"extra"), "left over"),
        (frame(0x30 | 0x06, b"\x00\x01t"), "QoS 3"),
        (frame(0x30 | 0x08, b"\x00\x01t"), "DUP set on a QoS 0"),
        (frame(0x30, b"\x00\x03a/#"), "wildcard"),
        (frame(0x30, b"\x00\x00"), "empty"),
        (frame(0x32, b"\x00\x01t\x00\x00"), "packet id 0"),
        (frame(0x30, b"\x00\x02\xff\xfe"), "not UTF-8"),
        (frame(0x30, b"\x00\x02a\x00"), "U+0000"),
        (frame(0x80, b"\x00\x01\x00\x01a\x00"), "reserved flags"),  # SUBSCRIBE needs flags 0010
        (frame(0x82, b"\x00\x01"), "without a topic filter"),
        (frame(0x82, b"\x00\x01\x00\x01a\x04"), "requested QoS"),
        (frame(0xA2, b"\x00\x01"), "without a topic filter"),
        (frame(0x60, b"\x00\x01"), "reserved flags"),  # PUBREL needs flags 0010
        (frame(0x40, b"\x00\x01\x00"), "left over"),
        (frame(0xC0, b"\x00"), "left over"),
        (bytes((0xF0, 0)), "reserved"),
        (bytes((0x30, 0xFF, 0xFF, 0xFF, 0xFF, 0x01)), "longer than 4 bytes"),
    ],
)
def test_what_the_spec_says_to_close_on_is_refused(wire: bytes, reason: str) -> None:
    with pytest.raises(codec.MalformedPacket) as refused:
        codec.Decoder().feed(wire)
    assert reason in refused.value.reason


def test_a_connect_of_an_unknown_level_is_told_its_version_is_not_supported() -> None:
    with pytest.raises(codec.UnsupportedProtocol) as refused:
        codec.Decoder().feed(frame(0x10, connect_body(level=6) + b"\x00"))
    assert refused.value.level == 6
    assert codec.encode_connack(False, codec.ConnectCode.BAD_PROTOCOL_VERSION, 5) == bytes((0x20, 3, 0, 0x84, 0))
    assert codec.encode_connack(False, codec.ConnectCode.BAD_PROTOCOL_VERSION) == bytes((0x20, 2, 0, 1))


def test_a_packet_over_the_limit_is_refused_from_its_header() -> None:
    decoder = codec.Decoder(max_packet_bytes=100)
    with pytest.raises(codec.MalformedPacket, match="exceeds the limit"):
        decoder.feed(bytes((0x30, 0xE5, 0x00)))  # 101 bytes announced, none sent yet


def test_remaining_length_uses_every_digit() -> None:
    payload = b"x" * 20_000  # three length digits
    wire = codec.encode_publish("a/b", payload, 1, 7, retain=True)
    assert wire[1] & 0x80 and wire[2] & 0x80 and not wire[3] & 0x80
    assert codec.Decoder().feed(wire) == [codec.Publish("a/b", payload, 1, True, False, 7)]
