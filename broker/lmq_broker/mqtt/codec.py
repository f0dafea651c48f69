"""MQTT 3.1.1 (and 3.1) and MQTT 5.0 control packets as values: ``Decoder.feed`` takes bytes, ``encode`` returns
bytes.

Sans-io, so that the broker's connection handler owns every await and the codec is testable byte for byte.
Written here rather than taken from PyPI (docs/mqtt.md says why: amqtt's packet classes, the one maintained
3.1.1 codec that serves a broker, read field by field from a stream without bounding a packet by its remaining
length and bring an exact ``websockets`` pin into the broker; the MQTT 5 ones, ``mqtt5`` and ``moat-lib-mqtt``,
speak 5.0 only and accept packets the spec says to refuse, and ``mqtt5`` panics on invalid UTF-8).

Frame (section 2 of both): one byte type << 4 | flags, the remaining length as 1-4 base-128 digits (low first,
bit 7 = more), then the variable header and payload. Strings are a 2-byte big-endian length and UTF-8
without U+0000; packet ids are 2 bytes, never 0. MQTT 5 adds a property section (``properties``) to most
packets and reason codes to the acknowledgements; a packet value is in the 5.0 form exactly when its
``properties`` is not None. The level a connection speaks is its CONNECT's: the ``Decoder`` reads every later
packet at that level. Anything that does not follow the spec raises ``MalformedPacket`` (or its
``ProtocolError``): the caller answers with its ``code`` where 5.0 allows and closes the connection
(MQTT-4.8.0-1), nothing is half-decoded.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from lmq_broker.mqtt import properties, wire
from lmq_broker.mqtt.properties import Context, Properties
from lmq_broker.mqtt.wire import MalformedPacket, PacketTooLarge, ProtocolError

__all__ = ["MalformedPacket", "PacketTooLarge", "ProtocolError"]

MAX_REMAINING_LENGTH: Final = wire.MAX_VARINT
MAX_STRING_BYTES: Final = wire.MAX_STRING_BYTES
LEVEL_3_1: Final = 3  # protocol name "MQIsdp"
LEVEL_3_1_1: Final = 4  # protocol name "MQTT"
LEVEL_5: Final = 5

CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT, AUTH = 8, 9, 10, 11, 12, 13, 14, 15
SUBACK_FAILURE: Final = 0x80
_FLAGS_0010: Final = frozenset({PUBREL, SUBSCRIBE, UNSUBSCRIBE})  # MQTT-3.6.1-1, 3.8.1-1, 3.10.1-1
_ACK_CONTEXT: Final = {PUBACK: Context.PUBACK, PUBREC: Context.PUBACK, PUBREL: Context.PUBREL, PUBCOMP: Context.PUBREL}
# subscription options (5.0 section 3.8.3.1); a 3.1.1 SUBSCRIBE carries the QoS bits only
OPTION_QOS: Final = 0x03
OPTION_NO_LOCAL: Final = 0x04
OPTION_RETAIN_AS_PUBLISHED: Final = 0x08
OPTION_RETAIN_HANDLING_SHIFT: Final = 4


class ConnectCode(enum.IntEnum):
    """CONNACK return codes (3.1.1 table 3.1)."""

    ACCEPTED = 0
    BAD_PROTOCOL_VERSION = 1
    IDENTIFIER_REJECTED = 2
    SERVER_UNAVAILABLE = 3
    BAD_USERNAME_OR_PASSWORD = 4
    NOT_AUTHORIZED = 5


# what a 3.1.1 refusal is called in 5.0 (CONNACK reason codes, 5.0 section 3.2.2.2)
V5_CONNACK: Final = {0: 0x00, 1: 0x84, 2: 0x85, 3: 0x88, 4: 0x86, 5: 0x87}


class UnsupportedProtocol(MalformedPacket):
    """A well-formed CONNECT of a protocol level this codec does not speak (``level``): answer it, then close."""

    def __init__(self, level: int) -> None:
        super().__init__(f"protocol level {level} is not supported (5.0, 3.1.1 and 3.1 are)")
        self.level = level


@dataclass(frozen=True, slots=True)
class Will:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    properties: Properties | None = None


@dataclass(frozen=True, slots=True)
class Connect:
    client_id: str
    clean_session: bool = True  # 5.0: clean start
    keep_alive_s: int = 0
    will: Will | None = None
    username: str | None = None
    password: bytes | None = None
    level: int = LEVEL_3_1_1
    properties: Properties | None = None  # set exactly when level is 5


@dataclass(frozen=True, slots=True)
class ConnAck:
    session_present: bool
    code: int  # a ConnectCode, or a 5.0 reason code
    properties: Properties | None = None


@dataclass(frozen=True, slots=True)
class Publish:
    topic: str  # 5.0: may be empty when properties.topic_alias names it
    payload: bytes
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None  # set exactly when qos > 0
    properties: Properties | None = None


@dataclass(frozen=True, slots=True)
class PacketId:
    """PUBACK, PUBREC, PUBREL, PUBCOMP, and a 3.1.1 UNSUBACK: a type and a packet id (5.0: and a reason)."""

    kind: int
    packet_id: int
    reason: int = 0
    properties: Properties | None = None


@dataclass(frozen=True, slots=True)
class Subscribe:
    packet_id: int
    filters: tuple[tuple[str, int], ...]  # (topic filter, options: the requested QoS in 3.1.1)
    properties: Properties | None = None


@dataclass(frozen=True, slots=True)
class SubAck:
    packet_id: int
    codes: tuple[int, ...]  # granted QoS, or SUBACK_FAILURE (5.0: a reason code)
    properties: Properties | None = None


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    packet_id: int
    filters: tuple[str, ...]
    properties: Properties | None = None


@dataclass(frozen=True, slots=True)
class UnsubAck:
    """5.0 only: one reason code per filter."""

    packet_id: int
    codes: tuple[int, ...]
    properties: Properties = properties.NONE


@dataclass(frozen=True, slots=True)
class Bare:
    """PINGREQ, PINGRESP, and a 3.1.1 DISCONNECT: a type and no body."""

    kind: int


@dataclass(frozen=True, slots=True)
class Disconnect:
    """5.0 only: a DISCONNECT with its reason (either side may send one)."""

    reason: int = 0
    properties: Properties = properties.NONE


@dataclass(frozen=True, slots=True)
class Auth:
    """5.0 only: enhanced authentication, which this broker refuses (docs/mqtt.md)."""

    reason: int = 0
    properties: Properties = properties.NONE


Packet = Connect | ConnAck | Publish | PacketId | Subscribe | SubAck | Unsubscribe | UnsubAck | Bare | Disconnect | Auth


# --- decoding --------------------------------------------------------------------------------------------------
class Decoder:
    """Incremental: ``feed`` whatever the socket gave, get every packet completed by it, in order.

    ``level`` is the protocol level later packets are read at; a CONNECT sets it to its own."""

    def __init__(self, max_packet_bytes: int = MAX_REMAINING_LENGTH, level: int = LEVEL_3_1_1) -> None:
        self.max_packet_bytes = max_packet_bytes
        self.level = level
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Packet]:
        buffer = self._buffer
        buffer += data
        out: list[Packet] = []
        at = 0
        while True:
            header = _frame_header(buffer, at)
            if header is None:
                break
            first, start, length = header
            if length > self.max_packet_bytes:
                raise PacketTooLarge(f"packet of {length} bytes exceeds the limit of {self.max_packet_bytes}")
            if len(buffer) < start + length:
                break
            packet = decode_packet(first, bytes(buffer[start : start + length]), self.level)
            if isinstance(packet, Connect):
                self.level = packet.level
            out.append(packet)
            at = start + length
        del buffer[:at]
        return out

    @property
    def pending_bytes(self) -> int:
        return len(self._buffer)


def _frame_header(buffer: bytearray, at: int) -> tuple[int, int, int] | None:
    """(first byte, body start, remaining length) of the frame at ``at``, or None while incomplete."""
    if len(buffer) < at + 2:
        return None
    length, shift = 0, 0
    for i in range(at + 1, at + 5):
        if i >= len(buffer):
            return None
        digit = buffer[i]
        length |= (digit & 0x7F) << shift
        if not digit & 0x80:
            return buffer[at], i + 1, length
        shift += 7
    raise MalformedPacket("remaining length longer than 4 bytes")


def decode_packet(first: int, body: bytes, level: int = LEVEL_3_1_1) -> Packet:  # noqa: PLR0912 (a branch per CONNECT field, in the spec's order)
    """One packet from its first byte and its ``remaining length`` bytes, read at protocol ``level``."""
    kind, flags = first >> 4, first & 0x0F
    v5 = level == LEVEL_5
    if kind == PUBLISH:
        return _publish(flags, wire.Reader(body), v5)
    if flags != (0b0010 if kind in _FLAGS_0010 else 0):
        raise MalformedPacket(f"reserved flags {flags:#06b} of packet type {kind}")
    r = wire.Reader(body)
    packet: Packet
    if kind == CONNECT:
        packet = _connect(r)
    elif kind in _ACK_CONTEXT:
        packet = _ack(kind, r, v5)
    elif kind == SUBSCRIBE:
        packet = _subscribe(r, v5)
    elif kind == UNSUBSCRIBE:
        packet = _unsubscribe(r, v5)
    elif kind == UNSUBACK:
        packet_id = r.packet_id()
        if v5:
            props = properties.decode(r, Context.UNSUBACK)
            codes = tuple(properties.check_reason(c, Context.UNSUBACK) for c in r.rest())
            if not codes:
                raise MalformedPacket("UNSUBACK without a reason code")
            packet = UnsubAck(packet_id, codes, props)
        else:
            packet = PacketId(kind, packet_id)
    elif kind in (PINGREQ, PINGRESP):
        packet = Bare(kind)
    elif kind == DISCONNECT:
        packet = _disconnect(r) if v5 else Bare(kind)
    elif kind == AUTH and v5:
        reason = properties.check_reason(r.byte(), Context.AUTH) if r.left else 0
        packet = Auth(reason, properties.decode(r, Context.AUTH) if r.left else properties.NONE)
    elif kind == CONNACK:
        packet = _connack(r, v5)
    elif kind == SUBACK:
        packet_id = r.packet_id()
        ack_props = properties.decode(r, Context.SUBACK) if v5 else None
        codes = tuple(r.rest())
        if v5:
            for c in codes:
                properties.check_reason(c, Context.SUBACK)
        elif any(c not in (0, 1, 2, SUBACK_FAILURE) for c in codes):
            raise MalformedPacket("SUBACK codes")
        if not codes:
            raise MalformedPacket("SUBACK codes")
        packet = SubAck(packet_id, codes, ack_props)
    else:
        raise MalformedPacket(f"packet type {kind} is reserved")
    r.end()
    return packet


def _connect(r: wire.Reader) -> Connect:
    name = r.string()
    level = r.byte()
    if (name, level) not in (("MQTT", LEVEL_5), ("MQTT", LEVEL_3_1_1), ("MQIsdp", LEVEL_3_1)):
        if name in ("MQTT", "MQIsdp"):
            raise UnsupportedProtocol(level)  # MQTT-3.1.2-2: answered with code 1 (5.0: 0x84), then closed
        raise MalformedPacket(f"protocol name {name!r}")  # MQTT-3.1.2-1: closed without an answer
    v5 = level == LEVEL_5
    flags = r.byte()
    if flags & 0x01:
        raise MalformedPacket("reserved CONNECT flag")  # MQTT-3.1.2-3
    will_flag, will_qos, will_retain = bool(flags & 0x04), (flags >> 3) & 0x03, bool(flags & 0x20)
    has_user, has_password = bool(flags & 0x80), bool(flags & 0x40)
    if will_qos == 3 or (not will_flag and (will_qos or will_retain)):
        raise MalformedPacket("will QoS/retain flags")  # MQTT-3.1.2-11, -13, -14, -15
    if has_password and not has_user and level == LEVEL_3_1_1:
        raise MalformedPacket("password without user name")  # MQTT-3.1.2-22 (5.0 allows it)
    keep_alive = r.u16()
    props = properties.decode(r, Context.CONNECT) if v5 else None
    client_id = r.string()
    will = None
    if will_flag:
        will_props = properties.decode(r, Context.WILL) if v5 else None
        will = Will(r.string(), r.binary(), will_qos, will_retain, will_props)
    username = r.string() if has_user else None
    password = r.binary() if has_password else None
    return Connect(client_id, bool(flags & 0x02), keep_alive, will, username, password, level, props)


def _connack(r: wire.Reader, v5: bool) -> ConnAck:
    ack_flags, code = r.take(2)
    if ack_flags & 0xFE:
        raise MalformedPacket("reserved CONNACK flags")
    if v5:
        props = properties.decode(r, Context.CONNACK)
        if ack_flags and code:
            raise ProtocolError("session present with a refusal")  # MQTT-3.2.2-6
        return ConnAck(bool(ack_flags), properties.check_reason(code, Context.CONNACK), props)
    try:
        return ConnAck(bool(ack_flags), ConnectCode(code))
    except ValueError:
        raise MalformedPacket(f"unknown CONNACK code {code}") from None


def _publish(flags: int, r: wire.Reader, v5: bool) -> Publish:
    qos = (flags >> 1) & 0x03
    if qos == 3:
        raise MalformedPacket("PUBLISH QoS 3")  # MQTT-3.3.1-4
    dup = bool(flags & 0x08)
    if dup and qos == 0:
        raise MalformedPacket("DUP set on a QoS 0 PUBLISH")  # MQTT-3.3.1-2
    topic = r.string()
    if "+" in topic or "#" in topic:
        raise MalformedPacket("PUBLISH topic holds a wildcard")  # MQTT-3.3.2-2, 4.7.3-1
    packet_id = r.packet_id() if qos else None
    props = None
    if v5:
        props = properties.decode(r, Context.PUBLISH)
        if not topic and props.topic_alias is None:
            raise ProtocolError("PUBLISH topic is empty and names no topic alias")  # MQTT-3.3.2-1
    elif not topic:
        raise MalformedPacket("PUBLISH topic is empty")  # MQTT-4.7.3-1
    return Publish(topic, r.rest(), qos, bool(flags & 0x01), dup, packet_id, props)


def _ack(kind: int, r: wire.Reader, v5: bool) -> PacketId:
    packet_id = r.packet_id()
    if not v5:
        return PacketId(kind, packet_id)
    context = _ACK_CONTEXT[kind]
    reason = properties.check_reason(r.byte(), context) if r.left else 0  # 5.0 section 3.4.2.1: may be absent
    props = properties.decode(r, context) if r.left else properties.NONE
    return PacketId(kind, packet_id, reason, props)


def _subscribe(r: wire.Reader, v5: bool) -> Subscribe:
    packet_id = r.packet_id()
    props = properties.decode(r, Context.SUBSCRIBE) if v5 else None
    filters = []
    while r.left:
        topic_filter = r.string()
        options = r.byte()
        if v5:
            if options & 0xC0:
                raise MalformedPacket("reserved subscription option bits")  # MQTT-3.8.3-5
            if options & OPTION_QOS == 3 or options >> OPTION_RETAIN_HANDLING_SHIFT == 3:
                raise ProtocolError("subscription QoS or retain handling 3")
        elif options > 2:
            raise MalformedPacket("requested QoS")  # MQTT-3.8.3-4: also the 6 reserved bits
        filters.append((topic_filter, options))
    if not filters:
        raise ProtocolError("SUBSCRIBE without a topic filter")  # MQTT-3.8.3-3 (5.0: a protocol error)
    return Subscribe(packet_id, tuple(filters), props)


def _unsubscribe(r: wire.Reader, v5: bool) -> Unsubscribe:
    packet_id = r.packet_id()
    props = properties.decode(r, Context.UNSUBSCRIBE) if v5 else None
    filters = []
    while r.left:
        filters.append(r.string())
    if not filters:
        raise ProtocolError("UNSUBSCRIBE without a topic filter")  # MQTT-3.10.3-2
    return Unsubscribe(packet_id, tuple(filters), props)


def _disconnect(r: wire.Reader) -> Disconnect:
    reason = properties.check_reason(r.byte(), Context.DISCONNECT) if r.left else 0
    return Disconnect(reason, properties.decode(r, Context.DISCONNECT) if r.left else properties.NONE)


# --- encoding --------------------------------------------------------------------------------------------------
def _frame(first: int, body: bytes) -> bytes:
    if len(body) > MAX_REMAINING_LENGTH:
        raise ValueError(f"packet body of {len(body)} bytes is over the MQTT limit")
    return bytes((first,)) + wire.varint(len(body)) + body


def encode_publish(
    topic: str,
    payload: bytes,
    qos: int = 0,
    packet_id: int | None = None,
    *,
    retain: bool = False,
    dup: bool = False,
    props: bytes | None = None,
) -> bytes:
    """The server's hot path (every delivery): no Publish value built. ``props``: an encoded 5.0 property
    section (``properties.encode``), None for 3.1.1."""
    first = PUBLISH << 4 | (0x08 if dup else 0) | qos << 1 | (0x01 if retain else 0)
    head = wire.string(topic)
    if qos:
        assert packet_id is not None, "a QoS 1/2 PUBLISH needs a packet id"
        head += packet_id.to_bytes(2, "big")
    if props is not None:
        head += props
    size = len(head) + len(payload)
    if size > MAX_REMAINING_LENGTH:
        raise ValueError(f"packet body of {size} bytes is over the MQTT limit")
    return bytes((first,)) + wire.varint(size) + head + payload


def encode_connack(
    session_present: bool, code: int, level: int = LEVEL_3_1_1, props: Properties | None = None
) -> bytes:
    """A 5.0 client gets the 5.0 form (also when refused for its version: it reads that one); a 3.1.1 code is
    translated (``V5_CONNACK``)."""
    if level >= LEVEL_5:
        reason = V5_CONNACK[code] if isinstance(code, ConnectCode) else code
        flags = 1 if session_present and reason == 0 else 0
        return _frame(CONNACK << 4, bytes((flags, reason)) + properties.encode(props or properties.NONE))
    return _frame(CONNACK << 4, bytes((1 if session_present else 0, code)))


def encode_packet_id(kind: int, packet_id: int, reason: int = 0, props: Properties | None = None) -> bytes:
    """PUBACK, PUBREC, PUBREL, PUBCOMP (and a 3.1.1 UNSUBACK); in the 5.0 form when ``props`` is given, as
    short as the spec allows."""
    first = kind << 4 | (0b0010 if kind == PUBREL else 0)
    body = packet_id.to_bytes(2, "big")
    if props is not None and props != properties.NONE:
        body += bytes((reason,)) + properties.encode(props)
    elif props is not None and reason:
        body += bytes((reason,))
    return _frame(first, body)


def encode_suback(packet_id: int, codes: Sequence[int], props: Properties | None = None) -> bytes:
    head = packet_id.to_bytes(2, "big") + (b"" if props is None else properties.encode(props))
    return _frame(SUBACK << 4, head + bytes(codes))


def encode_unsuback(packet_id: int, codes: Sequence[int], props: Properties = properties.NONE) -> bytes:
    return _frame(UNSUBACK << 4, packet_id.to_bytes(2, "big") + properties.encode(props) + bytes(codes))


def encode_disconnect(reason: int = 0, props: Properties = properties.NONE) -> bytes:
    if props == properties.NONE:
        return _frame(DISCONNECT << 4, bytes((reason,)) if reason else b"")
    return _frame(DISCONNECT << 4, bytes((reason,)) + properties.encode(props))


PINGRESP_BYTES: Final = bytes((PINGRESP << 4, 0))


def encode(packet: Packet) -> bytes:  # noqa: PLR0911 (a return per reason code: a table written as code)
    """Any packet, either direction (clients in tests, and the codec's round-trip property)."""
    if isinstance(packet, Publish):
        props = None if packet.properties is None else properties.encode(packet.properties)
        return encode_publish(
            packet.topic,
            packet.payload,
            packet.qos,
            packet.packet_id,
            retain=packet.retain,
            dup=packet.dup,
            props=props,
        )
    if isinstance(packet, PacketId):
        return encode_packet_id(packet.kind, packet.packet_id, packet.reason, packet.properties)
    if isinstance(packet, ConnAck):
        level = LEVEL_3_1_1 if packet.properties is None else LEVEL_5
        return encode_connack(packet.session_present, packet.code, level, packet.properties)
    if isinstance(packet, SubAck):
        return encode_suback(packet.packet_id, packet.codes, packet.properties)
    if isinstance(packet, UnsubAck):
        return encode_unsuback(packet.packet_id, packet.codes, packet.properties)
    if isinstance(packet, Bare):
        return _frame(packet.kind << 4, b"")
    if isinstance(packet, Disconnect):
        return encode_disconnect(packet.reason, packet.properties)
    if isinstance(packet, Auth):
        if packet.reason == 0 and packet.properties == properties.NONE:
            return _frame(AUTH << 4, b"")
        return _frame(AUTH << 4, bytes((packet.reason,)) + properties.encode(packet.properties))
    if isinstance(packet, Subscribe):
        head = packet.packet_id.to_bytes(2, "big") + _props(packet.properties)
        body = b"".join(wire.string(f) + bytes((o,)) for f, o in packet.filters)
        return _frame(SUBSCRIBE << 4 | 0b0010, head + body)
    if isinstance(packet, Unsubscribe):
        head = packet.packet_id.to_bytes(2, "big") + _props(packet.properties)
        return _frame(UNSUBSCRIBE << 4 | 0b0010, head + b"".join(map(wire.string, packet.filters)))
    return _encode_connect(packet)


def _props(p: Properties | None) -> bytes:
    return b"" if p is None else properties.encode(p)


def _encode_connect(c: Connect) -> bytes:
    name = "MQIsdp" if c.level == LEVEL_3_1 else "MQTT"
    flags = (0x02 if c.clean_session else 0) | (0x80 if c.username is not None else 0)
    flags |= 0x40 if c.password is not None else 0
    payload = wire.string(c.client_id)
    if c.will is not None:
        flags |= 0x04 | c.will.qos << 3 | (0x20 if c.will.retain else 0)
        payload += _props(c.will.properties) + wire.string(c.will.topic) + wire.binary(c.will.payload)
    if c.username is not None:
        payload += wire.string(c.username)
    if c.password is not None:
        payload += wire.binary(c.password)
    head = wire.string(name) + bytes((c.level, flags)) + c.keep_alive_s.to_bytes(2, "big") + _props(c.properties)
    return _frame(CONNECT << 4, head + payload)
