"""MQTT 3.1.1 (and 3.1) control packets as values: ``Decoder.feed`` takes bytes, ``encode`` returns bytes.

Sans-io, so that the broker's connection handler owns every await and the codec is testable byte for byte.
Written here rather than taken from PyPI (docs/mqtt.md says why: the one maintained 3.1.1 codec that
serves a broker, amqtt's packet classes, reads field by field from a stream without bounding a packet by its
remaining length, turns invalid UTF-8 into the text ``"b'...'"`` instead of refusing it, and brings an
exact ``websockets`` pin and a CLI framework into the broker; the sans-io ones speak MQTT 5 only).

Frame (MQTT 3.1.1 section 2): one byte type << 4 | flags, the remaining length as 1-4 base-128 digits (low
first, bit 7 = more), then the variable header and payload. Strings are a 2-byte big-endian length and UTF-8
without U+0000; packet ids are 2 bytes, never 0. Anything that does not follow the spec raises
``MalformedPacket``: the caller closes the connection (MQTT-4.8.0-1), nothing is half-decoded.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

MAX_REMAINING_LENGTH: Final = 268_435_455  # 4 length digits
MAX_STRING_BYTES: Final = 65_535
LEVEL_3_1: Final = 3  # protocol name "MQIsdp"
LEVEL_3_1_1: Final = 4  # protocol name "MQTT"
LEVEL_5: Final = 5

CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT = 8, 9, 10, 11, 12, 13, 14
SUBACK_FAILURE: Final = 0x80
_FLAGS_0010: Final = frozenset({PUBREL, SUBSCRIBE, UNSUBSCRIBE})  # MQTT-3.6.1-1, 3.8.1-1, 3.10.1-1


class ConnectCode(enum.IntEnum):
    """CONNACK return codes (3.1.1 table 3.1)."""

    ACCEPTED = 0
    BAD_PROTOCOL_VERSION = 1
    IDENTIFIER_REJECTED = 2
    SERVER_UNAVAILABLE = 3
    BAD_USERNAME_OR_PASSWORD = 4
    NOT_AUTHORIZED = 5


class MalformedPacket(Exception):
    """The bytes break the spec; ``reason`` says where."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class UnsupportedProtocol(MalformedPacket):
    """A well-formed CONNECT of a protocol level this codec does not speak (``level``): answer it, then close."""

    def __init__(self, level: int) -> None:
        super().__init__(f"protocol level {level} is not supported (3.1.1 and 3.1 are)")
        self.level = level


@dataclass(frozen=True, slots=True)
class Will:
    topic: str
    payload: bytes
    qos: int
    retain: bool


@dataclass(frozen=True, slots=True)
class Connect:
    client_id: str
    clean_session: bool = True
    keep_alive_s: int = 0
    will: Will | None = None
    username: str | None = None
    password: bytes | None = None
    level: int = LEVEL_3_1_1


@dataclass(frozen=True, slots=True)
class ConnAck:
    session_present: bool
    code: ConnectCode


@dataclass(frozen=True, slots=True)
class Publish:
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None  # set exactly when qos > 0


@dataclass(frozen=True, slots=True)
class PacketId:
    """PUBACK, PUBREC, PUBREL, PUBCOMP and UNSUBACK: a type and a packet id, nothing else."""

    kind: int
    packet_id: int


@dataclass(frozen=True, slots=True)
class Subscribe:
    packet_id: int
    filters: tuple[tuple[str, int], ...]  # (topic filter, requested QoS)


@dataclass(frozen=True, slots=True)
class SubAck:
    packet_id: int
    codes: tuple[int, ...]  # granted QoS, or SUBACK_FAILURE


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    packet_id: int
    filters: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Bare:
    """PINGREQ, PINGRESP and DISCONNECT: a type and no body."""

    kind: int


Packet = Connect | ConnAck | Publish | PacketId | Subscribe | SubAck | Unsubscribe | Bare


# --- decoding --------------------------------------------------------------------------------------------------
class Decoder:
    """Incremental: ``feed`` whatever the socket gave, get every packet completed by it, in order."""

    def __init__(self, max_packet_bytes: int = MAX_REMAINING_LENGTH) -> None:
        self.max_packet_bytes = max_packet_bytes
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
                raise MalformedPacket(f"packet of {length} bytes exceeds the limit of {self.max_packet_bytes}")
            if len(buffer) < start + length:
                break
            out.append(decode_packet(first, bytes(buffer[start : start + length])))
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


class _Reader:
    __slots__ = ("at", "data")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, n: int) -> bytes:
        end = self.at + n
        if end > len(self.data):
            raise MalformedPacket("packet ends inside a field")
        chunk = self.data[self.at : end]
        self.at = end
        return chunk

    def byte(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        high, low = self.take(2)
        return high << 8 | low

    def binary(self) -> bytes:
        return self.take(self.u16())

    def string(self) -> str:
        raw = self.binary()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedPacket("string is not UTF-8") from None  # MQTT-1.5.3-1
        if "\x00" in text:
            raise MalformedPacket("string contains U+0000")  # MQTT-1.5.3-2
        return text

    def packet_id(self) -> int:
        value = self.u16()
        if value == 0:
            raise MalformedPacket("packet id 0")  # MQTT-2.3.1-1
        return value

    def rest(self) -> bytes:
        chunk = self.data[self.at :]
        self.at = len(self.data)
        return chunk

    @property
    def left(self) -> int:
        return len(self.data) - self.at

    def end(self) -> None:
        if self.at != len(self.data):
            raise MalformedPacket(f"{len(self.data) - self.at} bytes left over after the packet")


def decode_packet(first: int, body: bytes) -> Packet:
    """One packet from its first byte and its ``remaining length`` bytes."""
    kind, flags = first >> 4, first & 0x0F
    if kind == PUBLISH:
        return _publish(flags, _Reader(body))
    if flags != (0b0010 if kind in _FLAGS_0010 else 0):
        raise MalformedPacket(f"reserved flags {flags:#06b} of packet type {kind}")
    r = _Reader(body)
    packet: Packet
    if kind == CONNECT:
        packet = _connect(r)
    elif kind in (PUBACK, PUBREC, PUBREL, PUBCOMP, UNSUBACK):
        packet = PacketId(kind, r.packet_id())
    elif kind == SUBSCRIBE:
        packet = _subscribe(r)
    elif kind == UNSUBSCRIBE:
        packet = _unsubscribe(r)
    elif kind in (PINGREQ, PINGRESP, DISCONNECT):
        packet = Bare(kind)
    elif kind == CONNACK:
        ack_flags, code = r.take(2)
        if ack_flags & 0xFE:
            raise MalformedPacket("reserved CONNACK flags")
        try:
            packet = ConnAck(bool(ack_flags), ConnectCode(code))
        except ValueError:
            raise MalformedPacket(f"unknown CONNACK code {code}") from None
    elif kind == SUBACK:
        packet_id = r.packet_id()
        codes = tuple(r.rest())
        if not codes or any(c not in (0, 1, 2, SUBACK_FAILURE) for c in codes):
            raise MalformedPacket("SUBACK codes")
        packet = SubAck(packet_id, codes)
    else:
        raise MalformedPacket(f"packet type {kind} is reserved")
    r.end()
    return packet


def _connect(r: _Reader) -> Connect:
    name = r.string()
    level = r.byte()
    if (name, level) not in (("MQTT", LEVEL_3_1_1), ("MQIsdp", LEVEL_3_1)):
        if name in ("MQTT", "MQIsdp"):
            raise UnsupportedProtocol(level)  # MQTT-3.1.2-2: answered with code 1, then closed
        raise MalformedPacket(f"protocol name {name!r}")  # MQTT-3.1.2-1: closed without an answer
    flags = r.byte()
    if flags & 0x01:
        raise MalformedPacket("reserved CONNECT flag")  # MQTT-3.1.2-3
    will_flag, will_qos, will_retain = bool(flags & 0x04), (flags >> 3) & 0x03, bool(flags & 0x20)
    has_user, has_password = bool(flags & 0x80), bool(flags & 0x40)
    if will_qos == 3 or (not will_flag and (will_qos or will_retain)):
        raise MalformedPacket("will QoS/retain flags")  # MQTT-3.1.2-11, -13, -14, -15
    if has_password and not has_user and level == LEVEL_3_1_1:
        raise MalformedPacket("password without user name")  # MQTT-3.1.2-22
    keep_alive = r.u16()
    client_id = r.string()
    will = Will(r.string(), r.binary(), will_qos, will_retain) if will_flag else None
    username = r.string() if has_user else None
    password = r.binary() if has_password else None
    return Connect(client_id, bool(flags & 0x02), keep_alive, will, username, password, level)


def _publish(flags: int, r: _Reader) -> Publish:
    qos = (flags >> 1) & 0x03
    if qos == 3:
        raise MalformedPacket("PUBLISH QoS 3")  # MQTT-3.3.1-4
    dup = bool(flags & 0x08)
    if dup and qos == 0:
        raise MalformedPacket("DUP set on a QoS 0 PUBLISH")  # MQTT-3.3.1-2
    topic = r.string()
    if not topic or "+" in topic or "#" in topic:
        raise MalformedPacket("PUBLISH topic is empty or holds a wildcard")  # MQTT-3.3.2-2, 4.7.3-1
    packet_id = r.packet_id() if qos else None
    return Publish(topic, r.rest(), qos, bool(flags & 0x01), dup, packet_id)


def _subscribe(r: _Reader) -> Subscribe:
    packet_id = r.packet_id()
    filters = []
    while r.left:
        topic_filter = r.string()
        qos = r.byte()
        if qos > 2:
            raise MalformedPacket("requested QoS")  # MQTT-3.8.3-4: also the 6 reserved bits
        filters.append((topic_filter, qos))
    if not filters:
        raise MalformedPacket("SUBSCRIBE without a topic filter")  # MQTT-3.8.3-3
    return Subscribe(packet_id, tuple(filters))


def _unsubscribe(r: _Reader) -> Unsubscribe:
    packet_id = r.packet_id()
    filters = []
    while r.left:
        filters.append(r.string())
    if not filters:
        raise MalformedPacket("UNSUBSCRIBE without a topic filter")  # MQTT-3.10.3-2
    return Unsubscribe(packet_id, tuple(filters))


# --- encoding --------------------------------------------------------------------------------------------------
def _remaining_length(n: int) -> bytes:
    if n > MAX_REMAINING_LENGTH:
        raise ValueError(f"packet body of {n} bytes is over the MQTT limit")
    out = bytearray()
    while True:
        digit, n = n & 0x7F, n >> 7
        out.append(digit | 0x80 if n else digit)
        if not n:
            return bytes(out)


def _frame(first: int, body: bytes) -> bytes:
    return bytes((first,)) + _remaining_length(len(body)) + body


def _string(text: str) -> bytes:
    return _binary(text.encode("utf-8"))


def _binary(data: bytes) -> bytes:
    if len(data) > MAX_STRING_BYTES:
        raise ValueError(f"field of {len(data)} bytes is over the MQTT limit of {MAX_STRING_BYTES}")
    return len(data).to_bytes(2, "big") + data


def encode_publish(
    topic: str, payload: bytes, qos: int = 0, packet_id: int | None = None, *, retain: bool = False, dup: bool = False
) -> bytes:
    """The server's hot path (every delivery): no Publish value built."""
    first = PUBLISH << 4 | (0x08 if dup else 0) | qos << 1 | (0x01 if retain else 0)
    head = _string(topic)
    if qos:
        assert packet_id is not None, "a QoS 1/2 PUBLISH needs a packet id"
        head += packet_id.to_bytes(2, "big")
    return bytes((first,)) + _remaining_length(len(head) + len(payload)) + head + payload


def encode_connack(session_present: bool, code: int, level: int = LEVEL_3_1_1) -> bytes:
    """A level-5 client refused for its version gets the MQTT 5 form (reason 0x84) that it can read."""
    if level == LEVEL_5:
        return _frame(CONNACK << 4, bytes((0, 0x84, 0)))
    return _frame(CONNACK << 4, bytes((1 if session_present else 0, code)))


def encode_packet_id(kind: int, packet_id: int) -> bytes:
    return _frame(kind << 4 | (0b0010 if kind == PUBREL else 0), packet_id.to_bytes(2, "big"))


def encode_suback(packet_id: int, codes: Sequence[int]) -> bytes:
    return _frame(SUBACK << 4, packet_id.to_bytes(2, "big") + bytes(codes))


PINGRESP_BYTES: Final = bytes((PINGRESP << 4, 0))


def encode(packet: Packet) -> bytes:
    """Any packet, either direction (clients in tests, and the codec's round-trip property)."""
    if isinstance(packet, Publish):
        return encode_publish(
            packet.topic, packet.payload, packet.qos, packet.packet_id, retain=packet.retain, dup=packet.dup
        )
    if isinstance(packet, PacketId):
        return encode_packet_id(packet.kind, packet.packet_id)
    if isinstance(packet, ConnAck):
        return encode_connack(packet.session_present, packet.code)
    if isinstance(packet, SubAck):
        return encode_suback(packet.packet_id, packet.codes)
    if isinstance(packet, Bare):
        return _frame(packet.kind << 4, b"")
    if isinstance(packet, Subscribe):
        body = packet.packet_id.to_bytes(2, "big") + b"".join(_string(f) + bytes((q,)) for f, q in packet.filters)
        return _frame(SUBSCRIBE << 4 | 0b0010, body)
    if isinstance(packet, Unsubscribe):
        body = packet.packet_id.to_bytes(2, "big") + b"".join(map(_string, packet.filters))
        return _frame(UNSUBSCRIBE << 4 | 0b0010, body)
    return _encode_connect(packet)


def _encode_connect(c: Connect) -> bytes:
    name = "MQTT" if c.level == LEVEL_3_1_1 else "MQIsdp"
    flags = (0x02 if c.clean_session else 0) | (0x80 if c.username is not None else 0)
    flags |= 0x40 if c.password is not None else 0
    payload = _string(c.client_id)
    if c.will is not None:
        flags |= 0x04 | c.will.qos << 3 | (0x20 if c.will.retain else 0)
        payload += _string(c.will.topic) + _binary(c.will.payload)
    if c.username is not None:
        payload += _string(c.username)
    if c.password is not None:
        payload += _binary(c.password)
    head = _string(name) + bytes((c.level, flags)) + c.keep_alive_s.to_bytes(2, "big")
    return _frame(CONNECT << 4, head + payload)
