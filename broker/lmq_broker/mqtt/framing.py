"""One MQTT packet off a socket: its fixed header first, then exactly its remaining length.

The size is checked against the limit before a byte of the body is read, so a client announcing a packet
over it costs nothing, and a connection holds only what the packet it reads needs: no buffer grown to the
largest packet the broker accepts and kept (before CONNECT the limit is the CONNECT's, ``limits``). The
stream reader's own buffer stays at its small default limit between packets.

``idle_s`` (keep-alive) bounds each wait for bytes, not the whole packet: a large PUBLISH on a slow link is
not cut off while its bytes keep coming; once a packet has begun, its bytes must keep coming within
``STALL_S`` even without a keep-alive, so a packet left unfinished does not hold its memory for ever.

A body over ``CHUNK_BYTES`` is read against the broker-wide ``Budget`` (``--mqtt-max-read-bytes``): what all
connections hold of packets they are reading is bounded, not only each one's; a packet the budget cannot
take is refused (``OverBudget``) before it is read.
"""

from __future__ import annotations

import asyncio
from typing import Final

from lmq_broker.mqtt import wire

VARINT_BYTES: Final = 4
CHUNK_BYTES: Final = 64 * 1024  # a body larger than this is read in pieces, each within ``idle_s``
STALL_S: Final = 60.0  # a packet begun: its next bytes within this long, keep-alive or not


class OverBudget(Exception):
    """The packet announced does not fit what the broker's connections may hold of packets being read."""


class Budget:
    """Bytes of packet bodies being read, in all (over ``CHUNK_BYTES`` each: smaller ones are not counted)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held = 0

    def take(self, n: int) -> None:
        if self.held + n > self.max_bytes:
            raise OverBudget(f"a packet of {n} bytes: {self.held} of {self.max_bytes} bytes are being read")
        self.held += n

    def give(self, n: int) -> None:
        self.held -= n


async def read_frame(
    reader: asyncio.StreamReader, max_bytes: int, budget: Budget, idle_s: float | None = None
) -> tuple[int, bytes] | None:
    """(first byte, body) of the next packet; None when the peer closed between two packets. A body over
    ``max_bytes`` raises ``PacketTooLarge`` before it is read, one ``budget`` cannot take ``OverBudget``; no
    byte for ``idle_s`` (within a packet: ``STALL_S`` at most) raises TimeoutError."""
    async with asyncio.timeout(idle_s):
        head = await reader.read(1)
        if not head:
            return None
        length, shift = 0, 0
        for _ in range(VARINT_BYTES):
            digit = (await reader.readexactly(1))[0]
            length |= (digit & 0x7F) << shift
            if not digit & 0x80:
                break
            shift += 7
        else:
            raise wire.MalformedPacket("remaining length longer than 4 bytes")
        if length > max_bytes:
            raise wire.PacketTooLarge(f"packet of {length} bytes exceeds the limit of {max_bytes}")
    stall_s = STALL_S if idle_s is None else min(idle_s, STALL_S)
    if length <= CHUNK_BYTES:
        async with asyncio.timeout(stall_s):
            return head[0], await reader.readexactly(length) if length else b""
    budget.take(length)
    try:
        return head[0], await _body(reader, length, stall_s)
    finally:
        budget.give(length)


async def _body(reader: asyncio.StreamReader, length: int, stall_s: float) -> bytes:
    """Read into one buffer of the packet's size (one large allocation, handed back whole when freed: pieces
    kept until the end would be many heap blocks that stay resident after the packet is gone)."""
    body = bytearray(length)
    view = memoryview(body)
    at = 0
    while at < length:
        async with asyncio.timeout(stall_s):
            chunk = await reader.read(min(length - at, CHUNK_BYTES))
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(view[:at]), length)
        view[at : at + len(chunk)] = chunk
        at += len(chunk)
    view.release()
    return bytes(body)
