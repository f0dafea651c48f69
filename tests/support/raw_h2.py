"""A bare HTTP/2 client over a plain socket, for what a gRPC client library never does: streams opened and never
sent on, a receive window of 0, a reset in the middle of a reply, frames read one by one, a request message sent in
part and never finished (test_hostile_clients.py, test_native_edge_metrics.py, test_edge_caps.py). Header blocks
are HPACK literals without indexing or Huffman; replies' header blocks are not decoded."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterable
from typing import Final, NamedTuple

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE = 3, 4  # SETTINGS parameters
REFUSED_STREAM, CANCEL = 7, 8  # RST_STREAM error codes
V2: Final = "/apache.rocketmq.v2.MessagingService/"
MAX_FRAME: Final = 16_384  # the protocol's default SETTINGS_MAX_FRAME_SIZE, which both edges keep
DEFAULT_WINDOW: Final = 65_535


class Frame(NamedTuple):
    kind: int
    flags: int
    stream: int
    payload: bytes


def _integer(value: int, prefix_bits: int) -> bytes:
    """An HPACK integer with an N-bit prefix (RFC 7541, 5.1)."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([value])
    out = [limit]
    value -= limit
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    return bytes([*out, value])


def literal(name: str, value: str) -> bytes:
    """One HPACK header field, literal without indexing, no Huffman."""
    n, v = name.encode(), value.encode()
    return b"\x00" + _integer(len(n), 7) + n + _integer(len(v), 7) + v


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def grpc_message(data: bytes) -> bytes:
    """One gRPC length-prefixed message, not compressed."""
    return b"\x00" + struct.pack(">I", len(data)) + data


def settings_of(payload: bytes) -> dict[int, int]:
    return {key: value for key, value in struct.iter_unpack(">HI", payload)}


class Connection:
    """One HTTP/2 connection to ``127.0.0.1:port``; ``window``: the receive window the server may fill per
    stream (SETTINGS_INITIAL_WINDOW_SIZE; None: the protocol's 65,535); ``source``: the local address to connect
    from (another of 127.0.0.0/8 is another client address). ``write`` keeps to the server's flow-control windows;
    ``ended`` holds the streams the server ended (their trailers or a reset) as ``read`` saw them."""

    def __init__(
        self, port: int, *, window: int | None = None, timeout_s: float = 10.0, source: str | None = None
    ) -> None:
        self.port = port
        self.sock = socket.create_connection(
            ("127.0.0.1", port), timeout=timeout_s, source_address=None if source is None else (source, 0)
        )
        ours = struct.pack(">HI", INITIAL_WINDOW_SIZE, window) if window is not None else b""
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0, ours))
        self._buffer = b""
        self.ended: dict[int, Frame] = {}
        self._initial = DEFAULT_WINDOW  # the server's SETTINGS_INITIAL_WINDOW_SIZE
        self._connection_window = DEFAULT_WINDOW
        self._stream_windows: dict[int, int] = {}  # per stream: WINDOW_UPDATEs less bytes sent, over the initial

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def open(self, stream: int, method: str, metadata: Iterable[tuple[str, str]] = (), *, end: bool = False) -> None:
        """HEADERS of a gRPC call of ``method`` (``end``: and no request at all)."""
        fields = (
            (":method", "POST"), (":scheme", "http"), (":path", V2 + method), (":authority", f"127.0.0.1:{self.port}"),
            ("content-type", "application/grpc"), ("te", "trailers"), *metadata,
        )  # fmt: skip
        block = b"".join(literal(n, v) for n, v in fields)
        self.sock.sendall(frame(HEADERS, END_HEADERS | (END_STREAM if end else 0), stream, block))

    def send(self, stream: int, data: bytes) -> None:
        """One gRPC request message and the end of the requests."""
        self.sock.sendall(frame(DATA, END_STREAM, stream, grpc_message(data)))

    def reset(self, stream: int, code: int = CANCEL) -> None:
        self.sock.sendall(frame(RST_STREAM, 0, stream, struct.pack(">I", code)))

    def read(self) -> Frame | None:
        """The next frame (None: the server closed the connection); SETTINGS and PING are acknowledged."""
        while len(self._buffer) < 9 or len(self._buffer) < 9 + int.from_bytes(self._buffer[:3], "big"):
            received = self.sock.recv(65536)
            if not received:
                return None
            self._buffer += received
        size = int.from_bytes(self._buffer[:3], "big")
        got = Frame(
            self._buffer[3], self._buffer[4], int.from_bytes(self._buffer[5:9], "big") & 0x7FFFFFFF,
            self._buffer[9 : 9 + size],
        )  # fmt: skip
        self._buffer = self._buffer[9 + size :]
        if got.kind in (SETTINGS, PING) and not got.flags & ACK:
            self.sock.sendall(frame(got.kind, ACK, 0, got.payload if got.kind == PING else b""))
        if got.kind == SETTINGS and not got.flags & ACK:
            self._initial = settings_of(got.payload).get(INITIAL_WINDOW_SIZE, self._initial)
        elif got.kind == WINDOW_UPDATE:
            increment = int.from_bytes(got.payload, "big") & 0x7FFFFFFF
            if got.stream == 0:
                self._connection_window += increment
            else:
                self._stream_windows[got.stream] = self._stream_windows.get(got.stream, 0) + increment
        elif got.kind == RST_STREAM or (got.kind == HEADERS and got.flags & END_STREAM):
            self.ended.setdefault(got.stream, got)
        return got

    def write(self, stream: int, data: bytes, *, end: bool = False) -> bool:
        """``data`` on ``stream`` in DATA frames as the server's windows let them go (reading its frames while they
        are shut); False, the rest not sent, once the server ended the stream (or closed the connection)."""
        sent = 0
        while sent < len(data):
            if stream in self.ended:
                return False
            room = min(self._connection_window, self._initial + self._stream_windows.get(stream, 0), MAX_FRAME)
            if room <= 0:
                if self.read() is None:
                    return False
                continue
            chunk = data[sent : sent + room]
            sent += len(chunk)
            self.sock.sendall(frame(DATA, END_STREAM if end and sent == len(data) else 0, stream, chunk))
            self._connection_window -= len(chunk)
            self._stream_windows[stream] = self._stream_windows.get(stream, 0) - len(chunk)
        return stream not in self.ended
