"""The data types every MQTT packet is made of (3.1.1 section 1.5, 5.0 section 1.5), and the errors a broken
one raises: shared by the packet codec and the MQTT 5 property codec.

A decoding error carries the MQTT 5 reason code the broker answers it with (a DISCONNECT, or a CONNACK while
connecting): 0x81 when the bytes cannot be parsed, 0x82 when they parse but break a rule of the protocol,
0x95 when the packet is over the size limit. A 3.1.1 connection has no reason codes and is just closed.
"""

from __future__ import annotations

from typing import Final

MAX_VARINT: Final = 268_435_455  # 4 base-128 digits
MAX_STRING_BYTES: Final = 65_535
MALFORMED: Final = 0x81
PROTOCOL_ERROR: Final = 0x82
PACKET_TOO_LARGE: Final = 0x95


class MalformedPacket(Exception):
    """The bytes break the spec; ``reason`` says where, ``code`` is the MQTT 5 reason code to answer with."""

    code = MALFORMED

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ProtocolError(MalformedPacket):
    """A well-formed packet that breaks a rule (a duplicated property, a receive maximum of 0...)."""

    code = PROTOCOL_ERROR


class PacketTooLarge(MalformedPacket):
    code = PACKET_TOO_LARGE


class Reader:
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
        at = self.at
        if at >= len(self.data):
            raise MalformedPacket("packet ends inside a field")
        self.at = at + 1
        return self.data[at]

    def u16(self) -> int:
        at = self.at
        if at + 2 > len(self.data):
            raise MalformedPacket("packet ends inside a field")
        self.at = at + 2
        return self.data[at] << 8 | self.data[at + 1]

    def u32(self) -> int:
        return int.from_bytes(self.take(4), "big")

    def varint(self) -> int:
        value = 0
        for shift in (0, 7, 14, 21):
            digit = self.byte()
            value |= (digit & 0x7F) << shift
            if not digit & 0x80:
                return value
        raise MalformedPacket("variable byte integer longer than 4 bytes")

    def binary(self) -> bytes:
        return self.take(self.u16())

    def string(self) -> str:
        raw = self.binary()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedPacket("string is not UTF-8") from None  # MQTT-1.5.3-1 (5.0: MQTT-1.5.4-1)
        if "\x00" in text:
            raise MalformedPacket("string contains U+0000")  # MQTT-1.5.3-2 (5.0: MQTT-1.5.4-2)
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


def varint(n: int) -> bytes:
    if not 0 <= n <= MAX_VARINT:
        raise ValueError(f"{n} does not fit a variable byte integer")
    out = bytearray()
    while True:
        digit, n = n & 0x7F, n >> 7
        out.append(digit | 0x80 if n else digit)
        if not n:
            return bytes(out)


def string(text: str) -> bytes:
    return binary(text.encode("utf-8"))


def binary(data: bytes) -> bytes:
    if len(data) > MAX_STRING_BYTES:
        raise ValueError(f"field of {len(data)} bytes is over the MQTT limit of {MAX_STRING_BYTES}")
    return len(data).to_bytes(2, "big") + data
