"""The MQTT 5.0 side of the codec: properties and reason codes survive encode -> decode however the bytes are
split, arbitrary bytes never raise anything but MalformedPacket, and what 5.0 calls a malformed packet (0x81)
or a protocol error (0x82) is refused with that code."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmq_broker.mqtt import codec, mapping, properties, wire
from lmq_broker.mqtt.properties import Properties

TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=20)
TOPIC = TEXT.filter(lambda t: t and "+" not in t and "#" not in t)
PACKET_ID = st.integers(1, 65535)
QOS = st.integers(0, 2)
U32 = st.integers(0, 2**32 - 1)
USER = st.lists(st.tuples(TEXT, TEXT), max_size=3).map(tuple)


def _maybe(strategy: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.none() | strategy


publish_properties = st.builds(
    Properties,
    payload_format=_maybe(st.integers(0, 1)),
    message_expiry_s=_maybe(U32),
    content_type=_maybe(TEXT),
    response_topic=_maybe(TOPIC),
    correlation_data=_maybe(st.binary(max_size=20)),
    topic_alias=_maybe(st.integers(1, 65535)),
    user=USER,
)
reason_properties = st.builds(Properties, reason_string=_maybe(TEXT), user=USER)


@st.composite
def publishes(draw: st.DrawFn) -> codec.Publish:
    qos = draw(QOS)
    return codec.Publish(
        topic=draw(TOPIC),
        payload=draw(st.binary(max_size=200)),
        qos=qos,
        retain=draw(st.booleans()),
        dup=draw(st.booleans()) if qos else False,
        packet_id=draw(PACKET_ID) if qos else None,
        properties=draw(publish_properties),
    )


@st.composite
def connects(draw: st.DrawFn) -> codec.Connect:
    will = None
    if draw(st.booleans()):
        will_props = draw(st.builds(Properties, will_delay_s=_maybe(U32), content_type=_maybe(TEXT), user=USER))
        will = codec.Will(draw(TOPIC), draw(st.binary(max_size=50)), draw(QOS), draw(st.booleans()), will_props)
    props = draw(
        st.builds(
            Properties,
            session_expiry_s=_maybe(U32),
            receive_max=_maybe(st.integers(1, 65535)),
            max_packet_size=_maybe(st.integers(1, 2**32 - 1)),
            topic_alias_max=_maybe(st.integers(0, 65535)),
            request_problem_info=_maybe(st.integers(0, 1)),
            user=USER,
        )
    )
    return codec.Connect(
        client_id=draw(TEXT),
        clean_session=draw(st.booleans()),
        keep_alive_s=draw(st.integers(0, 65535)),
        will=will,
        username=draw(st.none() | TEXT),
        password=draw(st.none() | st.binary(max_size=30)),  # 5.0: a password without a user name is allowed
        level=codec.LEVEL_5,
        properties=props,
    )


OPTIONS = st.builds(lambda q, nl, rap, rh: q | nl << 2 | rap << 3 | rh << 4, QOS, st.integers(0, 1), st.integers(0, 1),
                    st.integers(0, 2))  # fmt: skip
SERVER_PACKETS = st.one_of(
    publishes(),
    st.builds(codec.PacketId, st.sampled_from([codec.PUBACK, codec.PUBREC]), PACKET_ID,
              st.sampled_from(sorted(properties.REASONS[properties.Context.PUBACK])), reason_properties),
    st.builds(codec.PacketId, st.sampled_from([codec.PUBREL, codec.PUBCOMP]), PACKET_ID, st.sampled_from([0, 0x92]),
              reason_properties),
    st.builds(codec.SubAck, PACKET_ID, st.lists(st.sampled_from(sorted(properties.REASONS[properties.Context.SUBACK])),
              min_size=1, max_size=4).map(tuple), reason_properties),
    st.builds(codec.UnsubAck, PACKET_ID, st.lists(st.sampled_from([0, 0x11, 0x80, 0x8F]), min_size=1, max_size=4)
              .map(tuple), reason_properties),
    st.builds(codec.ConnAck, st.just(False), st.sampled_from([0, 0x80, 0x85, 0x87, 0x8C]),
              st.builds(Properties, receive_max=_maybe(st.integers(1, 65535)), assigned_client_id=_maybe(TEXT),
                        max_packet_size=_maybe(st.integers(1, 2**32 - 1)), topic_alias_max=_maybe(st.integers(0, 9)),
                        shared_subscription_available=_maybe(st.integers(0, 1)), user=USER)),
    st.builds(codec.ConnAck, st.just(True), st.just(0), st.just(properties.NONE)),
    st.builds(codec.Disconnect, st.sampled_from([0, 4, 0x81, 0x82, 0x8E, 0x93]),
              st.builds(Properties, session_expiry_s=_maybe(U32), reason_string=_maybe(TEXT), user=USER)),
    st.builds(codec.Auth, st.sampled_from([0, 0x18]), st.builds(Properties, auth_method=_maybe(TEXT))),
    st.builds(codec.Subscribe, PACKET_ID, st.lists(st.tuples(TEXT, OPTIONS), min_size=1, max_size=4).map(tuple),
              st.builds(Properties, subscription_ids=st.lists(st.integers(1, 2**28 - 1), max_size=1).map(tuple))),
    st.builds(codec.Unsubscribe, PACKET_ID, st.lists(TEXT, min_size=1, max_size=4).map(tuple), reason_properties
              .map(lambda p: Properties(user=p.user))),
    st.sampled_from([codec.Bare(codec.PINGREQ), codec.Bare(codec.PINGRESP)]),
)  # fmt: skip


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(connects(), st.lists(SERVER_PACKETS, max_size=6), st.data())
def test_v5_packets_survive_a_round_trip_split_anywhere(
    connect: codec.Connect, packets: list[codec.Packet], data: st.DataObject
) -> None:
    """After a level-5 CONNECT the decoder reads every packet in the 5.0 form."""
    wire_bytes = b"".join(map(codec.encode, [connect, *packets]))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire_bytes)), max_size=8)))
    decoder = codec.Decoder()
    out: list[codec.Packet] = []
    for start, end in zip([0, *cuts], [*cuts, len(wire_bytes)], strict=True):
        out += decoder.feed(wire_bytes[start:end])
    assert out == [connect, *packets]
    assert decoder.level == codec.LEVEL_5


def assert_v5_decodes_consistently(junk: bytes) -> None:
    try:
        decoded = codec.Decoder(max_packet_bytes=10_000, level=codec.LEVEL_5).feed(junk)
    except codec.MalformedPacket as exc:
        assert exc.reason and exc.code in (wire.MALFORMED, wire.PROTOCOL_ERROR, wire.PACKET_TOO_LARGE)
        return
    for packet in decoded:
        assert codec.Decoder(level=codec.LEVEL_5).feed(codec.encode(packet)) == [packet]


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200))
def test_v5_arbitrary_bytes_decode_or_raise_malformed_only(junk: bytes) -> None:
    assert_v5_decodes_consistently(junk)


@settings(max_examples=150, deadline=None)
@given(publishes(), st.integers(0, 300), st.integers(0, 255))
def test_v5_a_flipped_byte_never_escapes_as_another_error(packet: codec.Publish, at: int, value: int) -> None:
    data = bytearray(codec.encode(packet))
    data[at % len(data)] = value
    assert_v5_decodes_consistently(bytes(data))


def frame(first: int, body: bytes) -> bytes:
    assert len(body) < 128
    return bytes((first, len(body))) + body


def publish(props: bytes, topic: bytes = b"\x00\x01t") -> bytes:
    return frame(0x30, topic + bytes((len(props),)) + props + b"x")


@pytest.mark.parametrize(
    ("data", "code", "reason"),
    [
        (publish(b"\x02\x00\x00\x00\x01\x02\x00\x00\x00\x01"), 0x82, "appears twice"),  # message expiry twice
        (publish(b"\x11\x00\x00\x00\x01"), 0x81, "not one of a PUBLISH"),  # session expiry in a PUBLISH
        (publish(b"\x7f\x00"), 0x81, "not one of a PUBLISH"),  # an unknown identifier
        (publish(b"\x01\x02"), 0x82, "0 or 1 only"),  # payload format indicator 2
        (publish(b"\x23\x00\x00"), 0x82, "topic_alias = 0"),
        (publish(b"", topic=b"\x00\x00"), 0x82, "no topic alias"),
        (publish(b"\x03\x00\x09ab"), 0x81, "ends inside a field"),  # a string running past its section
        (frame(0x30, b"\x00\x01t\x09\x00"), 0x81, "ends inside a field"),  # a section longer than the packet
        (frame(0x10, b"\x00\x04MQTT\x05\x02\x00\x3c\x03\x21\x00\x00\x00\x01c"), 0x82, "receive_max = 0"),
        (frame(0x10, b"\x00\x04MQTT\x05\x02\x00\x3c\x05\x27\x00\x00\x00\x00\x00\x01c"), 0x82, "max_packet_size = 0"),
        (frame(0x10, b"\x00\x04MQTT\x05\x02\x00\x3c\x02\x17\x05\x00\x01c"), 0x82, "0 or 1 only"),
        (frame(0x82, b"\x00\x01\x00\x00\x01a\x41"), 0x81, "reserved subscription option"),
        (frame(0x82, b"\x00\x01\x00\x00\x01a\x31"), 0x82, "retain handling 3"),
        (frame(0x82, b"\x00\x01\x00\x00\x01a\x03"), 0x82, "QoS or retain handling 3"),
        (frame(0x82, b"\x00\x01\x04\x0b\x01\x0b\x02\x00\x01a\x01"), 0x82, "subscription_ids appears twice"),
        (frame(0x82, b"\x00\x01\x02\x0b\x00\x00\x01a\x01"), 0x82, "subscription_ids = 0"),
        (frame(0x82, b"\x00\x01\x00"), 0x82, "without a topic filter"),
        (frame(0x40, b"\x00\x01\x05"), 0x81, "reason code 0x05"),  # not a PUBACK reason
        (frame(0xE0, b"\x03"), 0x81, "reason code 0x03"),
        (frame(0xE0, b"\x00\x02\x11\x00"), 0x81, "ends inside a field"),
        (frame(0xB0, b"\x00\x01\x00"), 0x81, "without a reason code"),
        (frame(0x20, b"\x01\x80\x00"), 0x82, "session present"),
        (frame(0x30, b"\x00\x01t\xff\xff\xff\xff\x01"), 0x81, "longer than 4 bytes"),
    ],
)
def test_v5_refusals_carry_their_reason_code(data: bytes, code: int, reason: str) -> None:
    with pytest.raises(codec.MalformedPacket) as refused:
        codec.Decoder(level=codec.LEVEL_5).feed(data)
    assert reason in refused.value.reason
    assert refused.value.code == code


def test_a_packet_over_the_limit_is_refused_as_too_large() -> None:
    with pytest.raises(codec.PacketTooLarge) as refused:
        codec.Decoder(max_packet_bytes=100, level=codec.LEVEL_5).feed(bytes((0x30, 0xE5, 0x00)))
    assert refused.value.code == 0x95


def test_short_forms_of_acknowledgements_and_disconnect() -> None:
    """5.0 section 3.4.2.1, 3.14.2.1: a success without properties may leave out the reason and the properties."""
    decoder = codec.Decoder(level=codec.LEVEL_5)
    assert decoder.feed(frame(0x40, b"\x00\x07")) == [codec.PacketId(codec.PUBACK, 7, 0, properties.NONE)]
    assert decoder.feed(frame(0x40, b"\x00\x07\x97")) == [codec.PacketId(codec.PUBACK, 7, 0x97, properties.NONE)]
    assert decoder.feed(bytes((0xE0, 0))) == [codec.Disconnect(0, properties.NONE)]
    assert decoder.feed(bytes((0xF0, 0))) == [codec.Auth(0, properties.NONE)]
    assert codec.encode_packet_id(codec.PUBACK, 7, 0, properties.NONE) == bytes((0x40, 2, 0, 7))
    assert codec.encode_packet_id(codec.PUBACK, 7, 0x97, properties.NONE) == bytes((0x40, 3, 0, 7, 0x97))
    assert codec.encode_disconnect() == bytes((0xE0, 0))


def test_user_properties_keep_order_and_repeats() -> None:
    props = Properties(user=(("k", "1"), ("a", "x"), ("k", "2")), content_type="text/plain")
    packet = codec.Publish("a/b", b"body", 1, False, False, 9, props)
    (back,) = codec.Decoder(level=codec.LEVEL_5).feed(codec.encode(packet))
    assert isinstance(back, codec.Publish)
    assert back.properties == props


def test_a_3_1_1_decoder_reads_no_property_section() -> None:
    """The same bytes mean different packets by level: the property length is payload in 3.1.1."""
    data = frame(0x30, b"\x00\x01t\x00body")
    assert codec.Decoder().feed(data) == [codec.Publish("t", b"\x00body")]
    assert codec.Decoder(level=codec.LEVEL_5).feed(data) == [codec.Publish("t", b"body", properties=properties.NONE)]


def test_publish_properties_become_message_properties_and_back() -> None:
    """``mapping``: what a 5.0 publish carries is stored as RocketMQ properties and delivered from them."""
    sent = Properties(
        payload_format=1,
        message_expiry_s=10,
        content_type="text/plain",
        response_topic="P/replies",
        correlation_data=b"\x00\xffid",
        user=(("k", "1"), ("MQTT_QOS", "forged"), ("k", "2"), ("a", "x")),
    )
    stored = mapping.incoming(sent, qos=1, retain=True, client_id="me", now_ms=1_000)
    assert stored["k"] == "2" and stored["a"] == "x"  # a repeated name keeps its last value
    assert (stored[mapping.CLIENT], stored[mapping.RETAIN], stored[mapping.EXPIRES_AT]) == ("me", "1", "11000")
    assert mapping.QOS not in stored  # MQTT_* names are the broker's own: the forged one is dropped
    section = mapping.outgoing({**stored, "bad\x00name": "v"}, now_ms=4_500)  # U+0000 cannot travel in MQTT
    back = properties.decode(wire.Reader(section), properties.Context.PUBLISH)
    assert back == Properties(
        payload_format=1,
        message_expiry_s=7,  # 6.5 s left, rounded up
        content_type="text/plain",
        response_topic="P/replies",
        correlation_data=b"\x00\xffid",
        user=(("k", "2"), ("a", "x")),
    )
    assert mapping.expired(stored, 11_000) and not mapping.expired(stored, 10_999)
    old = mapping.incoming(None, qos=0, retain=False, client_id="old", now_ms=0)
    assert old == {"MQTT_QOS": "0"}  # 3.1.1: nothing but what it always stored
    with pytest.raises(mapping.PropertiesTooLarge):
        mapping.incoming(Properties(user=(("big", "x" * 20_000),)), qos=1, retain=False, client_id="c", now_ms=0)
