"""One MQTT packet off a socket: its fixed header first, then exactly its remaining length.

The size is checked against the limit before a byte of the body is read, so a client announcing a packet
over it costs nothing, and a connection holds only what the packet it reads needs: no buffer grown to the
largest packet the broker accepts and kept (before CONNECT the limit is the CONNECT's, ``limits``). The
stream reader's own buffer stays at its small default limit between packets.

``idle_s`` (keep-alive) bounds each wait for bytes, not the whole packet: a large PUBLISH on a slow link is
not cut off while its bytes keep coming.
"""

from __future__ import annotations

import asyncio
from typing import Final

from lmq_broker.mqtt import wire

VARINT_BYTES: Final = 4
CHUNK_BYTES: Final = 64 * 1024  # a body larger than this is read in pieces, each within ``idle_s``


async def read_frame(
    reader: asyncio.StreamReader, max_bytes: int, idle_s: float | None = None
) -> tuple[int, bytes] | None:
    """(first byte, body) of the next packet; None when the peer closed between two packets. A body over
    ``max_bytes`` raises ``PacketTooLarge`` before it is read; no byte for ``idle_s`` raises TimeoutError."""
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
        if length <= CHUNK_BYTES:
            return head[0], await reader.readexactly(length) if length else b""
    chunks = []
    left = length
    while left:
        async with asyncio.timeout(idle_s):
            chunk = await reader.read(min(left, CHUNK_BYTES))
        if not chunk:
            raise asyncio.IncompleteReadError(b"", left)
        chunks.append(chunk)
        left -= len(chunk)
    return head[0], b"".join(chunks)
