"""MQTT 5 properties (5.0 section 2.2.2) and reason codes (section 2.4), as values.

A property section is a variable byte integer length, then (identifier, value) pairs. One table below gives
each identifier its field, its data type and the packets it may appear in; everything else follows from it:
an identifier unknown or out of place is a malformed packet (0x81), a second copy of one that may appear once
is a protocol error (0x82), and so are the out-of-range values the spec names (a receive maximum of 0...).
Encoding writes fields in identifier order, so that a decoded value encodes back to the same bytes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any, Final

from lmq_broker.mqtt import wire


class Reason(enum.IntEnum):
    SUCCESS = 0x00  # also "normal disconnection", "granted QoS 0"
    GRANTED_QOS_1 = 0x01
    GRANTED_QOS_2 = 0x02
    DISCONNECT_WITH_WILL = 0x04
    NO_MATCHING_SUBSCRIBERS = 0x10
    NO_SUBSCRIPTION_EXISTED = 0x11
    CONTINUE_AUTHENTICATION = 0x18
    RE_AUTHENTICATE = 0x19
    UNSPECIFIED_ERROR = 0x80
    MALFORMED_PACKET = 0x81
    PROTOCOL_ERROR = 0x82
    IMPLEMENTATION_SPECIFIC_ERROR = 0x83
    UNSUPPORTED_PROTOCOL_VERSION = 0x84
    CLIENT_ID_NOT_VALID = 0x85
    BAD_USER_NAME_OR_PASSWORD = 0x86
    NOT_AUTHORIZED = 0x87
    SERVER_UNAVAILABLE = 0x88
    SERVER_BUSY = 0x89
    BANNED = 0x8A
    SERVER_SHUTTING_DOWN = 0x8B
    BAD_AUTHENTICATION_METHOD = 0x8C
    KEEP_ALIVE_TIMEOUT = 0x8D
    SESSION_TAKEN_OVER = 0x8E
    TOPIC_FILTER_INVALID = 0x8F
    TOPIC_NAME_INVALID = 0x90
    PACKET_ID_IN_USE = 0x91
    PACKET_ID_NOT_FOUND = 0x92
    RECEIVE_MAXIMUM_EXCEEDED = 0x93
    TOPIC_ALIAS_INVALID = 0x94
    PACKET_TOO_LARGE = 0x95
    MESSAGE_RATE_TOO_HIGH = 0x96
    QUOTA_EXCEEDED = 0x97
    ADMINISTRATIVE_ACTION = 0x98
    PAYLOAD_FORMAT_INVALID = 0x99
    RETAIN_NOT_SUPPORTED = 0x9A
    QOS_NOT_SUPPORTED = 0x9B
    USE_ANOTHER_SERVER = 0x9C
    SERVER_MOVED = 0x9D
    SHARED_SUBSCRIPTIONS_NOT_SUPPORTED = 0x9E
    CONNECTION_RATE_EXCEEDED = 0x9F
    MAXIMUM_CONNECT_TIME = 0xA0
    SUBSCRIPTION_IDS_NOT_SUPPORTED = 0xA1
    WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED = 0xA2


class Context(enum.Enum):
    """Where a property section sits: which identifiers it may hold, which reason codes go with it."""

    CONNECT = enum.auto()
    CONNACK = enum.auto()
    PUBLISH = enum.auto()
    WILL = enum.auto()
    PUBACK = enum.auto()  # and PUBREC
    PUBREL = enum.auto()  # and PUBCOMP
    SUBSCRIBE = enum.auto()
    SUBACK = enum.auto()
    UNSUBSCRIBE = enum.auto()
    UNSUBACK = enum.auto()
    DISCONNECT = enum.auto()
    AUTH = enum.auto()


REASONS: Final[dict[Context, frozenset[int]]] = {
    Context.CONNACK: frozenset({0, *range(0x80, 0x8B), 0x8C, 0x90, 0x95, 0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F}),
    Context.PUBACK: frozenset({0, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99}),
    Context.PUBREL: frozenset({0, 0x92}),
    Context.SUBACK: frozenset({0, 1, 2, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2}),
    Context.UNSUBACK: frozenset({0, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91}),
    Context.DISCONNECT: frozenset({0, 4, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, *range(0x8B, 0x92), *range(0x93, 0xA3)}),
    Context.AUTH: frozenset({0, 0x18, 0x19}),
}


@dataclass(frozen=True, slots=True)
class Properties:
    """Every MQTT 5 property; None (or empty) = absent. Which ones a packet may carry: ``_ALLOWED``."""

    payload_format: int | None = None  # 0x01: 1 = UTF-8 text
    message_expiry_s: int | None = None  # 0x02
    content_type: str | None = None  # 0x03
    response_topic: str | None = None  # 0x08
    correlation_data: bytes | None = None  # 0x09
    subscription_ids: tuple[int, ...] = ()  # 0x0B, repeatable in PUBLISH
    session_expiry_s: int | None = None  # 0x11
    assigned_client_id: str | None = None  # 0x12
    server_keep_alive_s: int | None = None  # 0x13
    auth_method: str | None = None  # 0x15
    auth_data: bytes | None = None  # 0x16
    request_problem_info: int | None = None  # 0x17
    will_delay_s: int | None = None  # 0x18
    request_response_info: int | None = None  # 0x19
    response_info: str | None = None  # 0x1A
    server_reference: str | None = None  # 0x1C
    reason_string: str | None = None  # 0x1F
    receive_max: int | None = None  # 0x21
    topic_alias_max: int | None = None  # 0x22
    topic_alias: int | None = None  # 0x23
    maximum_qos: int | None = None  # 0x24
    retain_available: int | None = None  # 0x25
    user: tuple[tuple[str, str], ...] = ()  # 0x26, repeatable everywhere, order kept
    max_packet_size: int | None = None  # 0x27
    wildcard_subscription_available: int | None = None  # 0x28
    subscription_ids_available: int | None = None  # 0x29
    shared_subscription_available: int | None = None  # 0x2A


NONE: Final = Properties()


class _Type(enum.Enum):
    BYTE = enum.auto()
    U16 = enum.auto()
    U32 = enum.auto()
    VARINT = enum.auto()
    STRING = enum.auto()
    BINARY = enum.auto()
    PAIR = enum.auto()


_C = Context
_PUBLISH_LIKE = (_C.PUBLISH, _C.WILL)
_ACKS = (_C.PUBACK, _C.PUBREL, _C.SUBACK, _C.UNSUBACK)
_TABLE: Final[dict[int, tuple[str, _Type, tuple[Context, ...]]]] = {
    0x01: ("payload_format", _Type.BYTE, _PUBLISH_LIKE),
    0x02: ("message_expiry_s", _Type.U32, _PUBLISH_LIKE),
    0x03: ("content_type", _Type.STRING, _PUBLISH_LIKE),
    0x08: ("response_topic", _Type.STRING, _PUBLISH_LIKE),
    0x09: ("correlation_data", _Type.BINARY, _PUBLISH_LIKE),
    0x0B: ("subscription_ids", _Type.VARINT, (_C.PUBLISH, _C.SUBSCRIBE)),
    0x11: ("session_expiry_s", _Type.U32, (_C.CONNECT, _C.CONNACK, _C.DISCONNECT)),
    0x12: ("assigned_client_id", _Type.STRING, (_C.CONNACK,)),
    0x13: ("server_keep_alive_s", _Type.U16, (_C.CONNACK,)),
    0x15: ("auth_method", _Type.STRING, (_C.CONNECT, _C.CONNACK, _C.AUTH)),
    0x16: ("auth_data", _Type.BINARY, (_C.CONNECT, _C.CONNACK, _C.AUTH)),
    0x17: ("request_problem_info", _Type.BYTE, (_C.CONNECT,)),
    0x18: ("will_delay_s", _Type.U32, (_C.WILL,)),
    0x19: ("request_response_info", _Type.BYTE, (_C.CONNECT,)),
    0x1A: ("response_info", _Type.STRING, (_C.CONNACK,)),
    0x1C: ("server_reference", _Type.STRING, (_C.CONNACK, _C.DISCONNECT)),
    0x1F: ("reason_string", _Type.STRING, (_C.CONNACK, *_ACKS, _C.DISCONNECT, _C.AUTH)),
    0x21: ("receive_max", _Type.U16, (_C.CONNECT, _C.CONNACK)),
    0x22: ("topic_alias_max", _Type.U16, (_C.CONNECT, _C.CONNACK)),
    0x23: ("topic_alias", _Type.U16, (_C.PUBLISH,)),
    0x24: ("maximum_qos", _Type.BYTE, (_C.CONNACK,)),
    0x25: ("retain_available", _Type.BYTE, (_C.CONNACK,)),
    0x26: ("user", _Type.PAIR, tuple(Context)),
    0x27: ("max_packet_size", _Type.U32, (_C.CONNECT, _C.CONNACK)),
    0x28: ("wildcard_subscription_available", _Type.BYTE, (_C.CONNACK,)),
    0x29: ("subscription_ids_available", _Type.BYTE, (_C.CONNACK,)),
    0x2A: ("shared_subscription_available", _Type.BYTE, (_C.CONNACK,)),
}
_ALLOWED: Final = {c: frozenset(i for i, (_, _, where) in _TABLE.items() if c in where) for c in Context}
_REPEATABLE: Final = frozenset({"user", "subscription_ids"})
_ZERO_OR_ONE: Final = frozenset(
    {"payload_format", "request_problem_info", "request_response_info", "maximum_qos", "retain_available"}
    | {"wildcard_subscription_available", "subscription_ids_available", "shared_subscription_available"}
)
_NOT_ZERO: Final = frozenset({"receive_max", "max_packet_size", "topic_alias", "subscription_ids"})
_FIELD_ORDER: Final = [(i, name, kind) for i, (name, kind, _) in sorted(_TABLE.items())]
assert {f.name for f in fields(Properties)} == {name for name, _, _ in _TABLE.values()}


def decode(r: wire.Reader, context: Context) -> Properties:
    """The property section at ``r``'s position (its length included)."""
    length = r.varint()
    if not length:
        return NONE
    section = wire.Reader(r.take(length))
    allowed = _ALLOWED[context]
    found: dict[str, Any] = {}
    while section.left:
        identifier = section.varint()
        if identifier not in allowed:
            raise wire.MalformedPacket(f"property {identifier:#04x} is not one of a {context.name}")
        name, kind, _ = _TABLE[identifier]
        value = _read(section, kind)
        if name in _ZERO_OR_ONE and value not in (0, 1):
            raise wire.ProtocolError(f"property {name} = {value}: 0 or 1 only")
        if name in _NOT_ZERO and value == 0:
            raise wire.ProtocolError(f"property {name} = 0")
        if name == "response_topic" and ("+" in value or "#" in value):
            raise wire.ProtocolError("property response_topic holds a wildcard")  # MQTT-3.3.2-14, a topic name
        if name in _REPEATABLE:
            found[name] = (*found.get(name, ()), value)
        elif name in found:
            raise wire.ProtocolError(f"property {name} appears twice")  # 5.0 section 2.2.2.2
        else:
            found[name] = value
    if context == Context.SUBSCRIBE and len(found.get("subscription_ids", ())) > 1:
        raise wire.ProtocolError("property subscription_ids appears twice")
    return Properties(**found) if found else NONE


def _read(r: wire.Reader, kind: _Type) -> Any:
    if kind is _Type.BYTE:
        return r.byte()
    if kind is _Type.U16:
        return r.u16()
    if kind is _Type.U32:
        return r.u32()
    if kind is _Type.VARINT:
        return r.varint()
    if kind is _Type.STRING:
        return r.string()
    if kind is _Type.BINARY:
        return r.binary()
    return (r.string(), r.string())


_EMPTY: Final = b"\x00"


def encode(p: Properties) -> bytes:
    """The property section of ``p``, its length first."""
    if p is NONE or p == NONE:
        return _EMPTY
    out = bytearray()
    for identifier, name, kind in _FIELD_ORDER:
        value = getattr(p, name)
        if value is None or value == ():
            continue
        for one in value if name in _REPEATABLE else (value,):
            out += wire.varint(identifier)
            out += _write(kind, one)
    return wire.varint(len(out)) + bytes(out)


def _write(kind: _Type, value: Any) -> bytes:
    if kind is _Type.BYTE:
        return bytes((value,))
    if kind is _Type.U16:
        return int(value).to_bytes(2, "big")
    if kind is _Type.U32:
        return int(value).to_bytes(4, "big")
    if kind is _Type.VARINT:
        return wire.varint(value)
    if kind is _Type.STRING:
        return wire.string(value)
    if kind is _Type.BINARY:
        return wire.binary(value)
    key, text = value
    return wire.string(key) + wire.string(text)


def check_reason(code: int, context: Context) -> int:
    if code not in REASONS[context]:
        raise wire.MalformedPacket(f"reason code {code:#04x} is not one of a {context.name}")
    return code
