"""One MQTT packet off a socket: its fixed header first, then exactly its remaining length.

The size is checked against the limit before a byte of the body is read, so a client announcing a packet
over it costs nothing, and a connection holds only what the packet it reads needs: no buffer grown to the
largest packet the broker accepts and kept (before CONNECT the limit is the CONNECT's, ``limits``). The
stream reader's own buffer stays at its small default limit between packets.

Keep-alive (``KeepAlive``) bounds the wait for a packet with one timer per keep-alive period, not one per
packet (a timer per packet cost more than reading it). A large body's bytes count as activity while they
keep coming, and must keep coming within ``STALL_S`` even without a keep-alive, so a large packet left
unfinished does not hold its memory for ever.

A body over ``CHUNK_BYTES`` is read against the broker-wide ``Budget`` (``--mqtt-max-read-bytes``): what all
connections hold of packets they are reading is bounded, not only each one's; a packet the budget cannot
take is refused (``OverBudget``) before it is read. So that no one holds the budget from the others: the
connections of one client address hold at most ``--mqtt-max-read-bytes-per-address`` of it, and a packet
begun must arrive at ``--mqtt-min-read-rate`` bytes a second on average, falling at most ``CHUNK_BYTES``
behind that pace (``TooSlow``; a byte every 59 s would otherwise hold its share for ever). An honest client on
a slow link sends as fast as its link goes, well above the pace; a client that trickles gives its share
back in (length + 64 KiB) / rate seconds at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import Callable
from typing import Final

from lmq_broker.mqtt import wire

VARINT_BYTES: Final = 4
CHUNK_BYTES: Final = 64 * 1024  # a body larger than this is read in pieces, each within ``idle_s``
STALL_S: Final = 60.0  # a packet begun: its next bytes within this long, keep-alive or not
LINGER_S: Final = 1.0  # a connection the broker ends: what the client still sends is read and dropped this long


class OverBudget(Exception):
    """The packet announced does not fit what the broker's connections (or its address's) may hold of packets
    being read; ``flag`` names the cap."""

    def __init__(self, message: str, flag: str) -> None:
        super().__init__(message)
        self.flag = flag


class TooSlow(Exception):
    """A large packet begun arrives slower than ``--mqtt-min-read-rate``."""


class Budget:
    """Bytes of packet bodies being read, in all and per client address (over ``CHUNK_BYTES`` each: smaller
    ones are not counted), and the pace a begun one must keep (bytes a second; 0: none)."""

    def __init__(self, max_bytes: int, per_address: int | None = None, min_rate: int = 0) -> None:
        self.max_bytes = max_bytes
        self.per_address = max_bytes if per_address is None else per_address
        self.min_rate = min_rate
        self.held = 0
        self._by_address: dict[str, int] = {}

    def take(self, n: int, address: str = "") -> None:
        if self.held + n > self.max_bytes:
            raise OverBudget(
                f"a packet of {n} bytes: {self.held} of {self.max_bytes} bytes are being read", "--mqtt-max-read-bytes"
            )
        mine = self._by_address.get(address, 0)
        if mine + n > self.per_address:
            raise OverBudget(
                f"a packet of {n} bytes: {mine} of the {self.per_address} bytes one address may hold are being read "
                "from it",
                "--mqtt-max-read-bytes-per-address",
            )
        self.held += n
        self._by_address[address] = mine + n

    def give(self, n: int, address: str = "") -> None:
        self.held -= n
        left = self._by_address[address] - n
        if left:
            self._by_address[address] = left
        else:
            del self._by_address[address]


async def read_frame(
    reader: asyncio.StreamReader,
    max_bytes: int,
    budget: Budget,
    stall_s: float = STALL_S,
    progress: Callable[[], None] | None = None,
    *,
    address: str = "",
) -> tuple[int, bytes] | None:
    """(first byte, body) of the next packet; None when the peer closed between two packets. A body over
    ``max_bytes`` raises ``PacketTooLarge`` before it is read, one ``budget`` cannot take (in all, or of what
    the client's ``address`` may hold) ``OverBudget``. A large body's bytes must keep coming within ``stall_s``
    (else TimeoutError) and at the budget's pace (else ``TooSlow``); ``progress`` is told of each piece (the
    keep-alive check counts them as activity). The wait for a packet itself has no timer here: the caller's
    ``KeepAlive`` bounds it, one timer per keep-alive period rather than one per packet."""
    header = await _header(reader, max_bytes)
    if header is None:
        return None
    first, length = header
    if length <= CHUNK_BYTES:
        return first, await reader.readexactly(length) if length else b""
    budget.take(length, address)
    try:
        return first, await _body(reader, length, min(stall_s, STALL_S), progress, budget.min_rate)
    finally:
        budget.give(length, address)


class KeepAlive:
    """The keep-alive check of a connection's reads (MQTT-3.1.2-24): ``idle_s`` without a packet while
    reading expires ``timeout`` (the read is cancelled and the ``asyncio.timeout`` block raises TimeoutError).
    Time spent handling a packet does not count. One timer per period, however many packets arrive."""

    def __init__(self, timeout: asyncio.Timeout, idle_s: float) -> None:
        self._timeout = timeout
        self._idle_s = idle_s
        self._loop = asyncio.get_running_loop()
        self._since: float | None = self._loop.time()  # when the read under way began; None while handling
        self._timer = self._loop.call_later(idle_s, self._check)

    def reading(self) -> None:
        self._since = self._loop.time()

    def handling(self) -> None:
        self._since = None

    def stop(self) -> None:
        self._timer.cancel()

    def _check(self) -> None:
        now = self._loop.time()
        if self._since is not None and now - self._since >= self._idle_s:
            self._timeout.reschedule(now)  # expires now
            return
        self._timer = self._loop.call_at((self._since or now) + self._idle_s, self._check)


async def linger(writer: asyncio.StreamWriter, reader: asyncio.StreamReader, seconds: float = LINGER_S) -> None:
    """End a connection the broker closes so that the client reads its last packet (a DISCONNECT with the
    reason): closing a socket with unread input sends a reset, which makes the client's stack drop what it had
    not read yet. So: flush, shut down writing, read and drop the client's input until it closes (or
    ``seconds``), then the caller closes."""
    with contextlib.suppress(ConnectionError, OSError, TimeoutError, asyncio.IncompleteReadError):
        async with asyncio.timeout(seconds):
            await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
            while await reader.read(CHUNK_BYTES):
                pass


_TCP_INFO_BYTES_ACKED: Final = 120  # offset of tcpi_bytes_acked (u64) in Linux's struct tcp_info (since 4.1)


def taken(writer: asyncio.StreamWriter) -> int:
    """How much of what was written the client has taken so far, for telling progress: the bytes its TCP
    acknowledged (Linux's ``TCP_INFO``), else minus what still waits in the transport (which new writes blur)."""
    sock = writer.get_extra_info("socket")
    if sock is not None and hasattr(socket, "TCP_INFO"):
        with contextlib.suppress(OSError):
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES_ACKED + 8)
            if len(info) >= _TCP_INFO_BYTES_ACKED + 8:
                return int.from_bytes(info[_TCP_INFO_BYTES_ACKED : _TCP_INFO_BYTES_ACKED + 8], sys.byteorder)
    return -writer.transport.get_write_buffer_size()


async def shut(writer: asyncio.StreamWriter, seconds: float = LINGER_S) -> None:
    """Close a connection: what is still buffered for the client is sent if it takes it within ``seconds``, else
    dropped (a client that reads nothing would keep the socket, and whoever waits for its end, for ever)."""
    writer.close()
    with contextlib.suppress(Exception):
        try:
            async with asyncio.timeout(seconds):
                await writer.wait_closed()
        except TimeoutError:
            writer.transport.abort()
            await writer.wait_closed()


async def _header(reader: asyncio.StreamReader, max_bytes: int) -> tuple[int, int] | None:
    """(first byte, remaining length); None at a clean end. Every packet's fixed header has 2 bytes at least."""
    try:
        two = await reader.readexactly(2)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    digit = two[1]
    length, shift = digit & 0x7F, 7
    while digit & 0x80:
        if shift == 7 * VARINT_BYTES:
            raise wire.MalformedPacket("remaining length longer than 4 bytes")
        digit = (await reader.readexactly(1))[0]
        length |= (digit & 0x7F) << shift
        shift += 7
    if length > max_bytes:
        raise wire.PacketTooLarge(f"packet of {length} bytes exceeds the limit of {max_bytes}")
    return two[0], length


async def _small(reader: asyncio.StreamReader, length: int) -> bytes:
    return await reader.readexactly(length) if length else b""


async def _body(
    reader: asyncio.StreamReader, length: int, stall_s: float, progress: Callable[[], None] | None, min_rate: int
) -> bytes:
    """Read into one buffer of the packet's size (one large allocation, handed back whole when freed: pieces
    kept until the end would be many heap blocks that stay resident after the packet is gone). With
    ``min_rate``, what has come by each moment must be at least ``min_rate`` bytes a second since the start,
    less ``CHUNK_BYTES``: each read waits at most until then."""
    body = bytearray(length)
    view = memoryview(body)
    at = 0
    loop = asyncio.get_running_loop()
    started = loop.time()
    while at < length:
        wait_s = stall_s
        if min_rate:
            behind_at = started + (at + CHUNK_BYTES) / min_rate  # when what came so far falls behind the pace
            wait_s = min(wait_s, behind_at - loop.time())
            if wait_s <= 0:
                raise TooSlow(f"{at} of a packet of {length} bytes came in {loop.time() - started:.1f} s")
        try:
            async with asyncio.timeout(wait_s):
                chunk = await reader.read(min(length - at, CHUNK_BYTES))
        except TimeoutError:
            if wait_s < stall_s:
                raise TooSlow(f"{at} of a packet of {length} bytes came in {loop.time() - started:.1f} s") from None
            raise
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(view[:at]), length)
        view[at : at + len(chunk)] = chunk
        at += len(chunk)
        if progress is not None:
            progress()
    view.release()
    return bytes(body)
