"""The local hop: forwarded sends between the broker processes of one pod over a Unix domain socket.

``serve --processes N`` runs N brokers in one pod. A send whose lite topic a sibling owns was forwarded over
gRPC, which costs a gRPC client call here and a gRPC server call at the owner: more CPU than storing the message.
Siblings share a host and a data directory, so each process also listens on ``<pod data dir>/hop/<port>.sock``
(``--local-hop socket``, the default; the directory is 0700, the socket 0600) and its siblings send it the very
bytes of the SendMessageRequest they would have sent over gRPC (``forwarding`` gathers them per owner per loop
tick). Brokers in other pods, and a sibling whose socket is not there (not started yet, or a path too long for a
socket), are still reached over gRPC, the plain twin (``--local-hop grpc``: gRPC for all).

Wire format (both ways): frames of ``>II`` (payload length, request id) then the payload. Many requests are in
flight on one connection per pair of processes; the frames written in one loop tick go in one write. The first
frame a connection carries is the hello: request id 0, the peer header's value (``cluster.trust``: epoch, time,
HMAC with the cluster secret over ``HELLO``), which the owner verifies as it verifies a gRPC peer header; a
connection without a valid hello is closed, nothing read from it is served (counted in
``lmq_local_hop_refused``). Every other frame is one SendMessageRequest, answered by a frame of the same id
carrying the owner's SendMessageResponse: the owner serves it exactly as a peer's gRPC copy (admission, its own
view of ownership with NOT_OWNER refusals, the send counted under its membership epoch, the same statuses).

A connection whose hello is signed over ``HELLO_CLIENTS`` instead carries clients' sends: the native edge of a
sibling writes a client's SendMessage there as it came (``--native-forward``, ``cluster.native_forward``), and
each frame is served as a client's call would be here (admission, the reserved properties refused, a topic this
broker does not own forwarded on; ``ClientSend``), never as a peer's copy.

A connection that breaks fails every request waiting on it ("did not answer; nothing was stored, try again", as
a gRPC peer that does not answer): a request the owner had stored may then be stored again by the client's
retry, the at-least-once of any send whose answer was lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final, Protocol

from prometheus_client import CollectorRegistry, Counter

from lmq_broker import errors
from lmq_broker.cluster import trust
from lmq_broker.protocol import status
from lmq_broker.protocol.admission import Admission
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.metrics import Metrics

log = logging.getLogger(__name__)

HELLO: Final = "lmq local hop v1"  # what the hello's HMAC is over, in place of a gRPC method
HELLO_CLIENTS: Final = "lmq local hop v1 clients"  # the hello of a connection carrying clients' sends
MAX_FRAME_BYTES: Final = 64 * 1024 * 1024  # as the gRPC channels' message limit
HELLO_MAX_BYTES: Final = 1024  # a frame before the hello verified (nothing of an unverified peer is buffered)
READ_AHEAD_FRAMES: Final = 1024  # frames of one connection being served at once: past it, reading pauses
READ_AHEAD_BYTES: Final = MAX_FRAME_BYTES  # their bytes: past it, reading pauses (one frame may reach it alone)
MAX_SOCKET_PATH_BYTES: Final = 107  # sun_path holds 108 bytes with its terminating NUL
CONNECT_RETRY_S: Final = 0.05
_FRAME: Final = struct.Struct(">II")

# a peer copy's send: the request decoded and the bytes it was decoded from (``protocol.wire``)
Send = Callable[[spb.SendMessageRequest, bytes], Awaitable[spb.SendMessageResponse]]
# a client's send as it came (its bytes, not yet decoded): answered as the client port would answer it
ClientSend = Callable[[bytes], Awaitable[spb.SendMessageResponse]]


def socket_path(directory: Path, endpoint: str) -> Path | None:
    """Where the process with member endpoint ``endpoint`` listens; None when the path is too long for a socket."""
    path = directory / f"{endpoint.rpartition(':')[2]}.sock"
    return path if len(os.fsencode(path)) <= MAX_SOCKET_PATH_BYTES else None


def frame(request_id: int, payload: bytes) -> bytes:
    return _FRAME.pack(len(payload), request_id) + payload


class Frames(asyncio.Protocol):
    """Frames in and out of one connection: what arrives is split into frames, what is queued in a tick is
    written at once. Also the framing of ``replication.sockets`` (copies to a follower over TCP)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._out: list[bytes] = []
        self.closed = False
        self.name = "local hop"  # in its log lines
        self.max_frame = MAX_FRAME_BYTES
        self.splitting = False  # within ``split`` (a frame answered at once there must not split again)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def send(self, request_id: int, payload: bytes) -> None:
        if self.closed:
            return
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(_FRAME.pack(len(payload), request_id))
        self._out.append(payload)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self.transport is not None and not self.closed:
            self.transport.write(b"".join(out))

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self.split()

    def split(self) -> None:
        """Hand on the whole frames buffered, until ``holding`` (not again from within: see ``splitting``)."""
        if self.splitting:
            return
        self.splitting = True
        try:
            self._split()
        finally:
            self.splitting = False

    def _split(self) -> None:
        buffer = self._buffer
        start = 0
        end = len(buffer)
        while end - start >= _FRAME.size and not self.holding():
            length, request_id = _FRAME.unpack_from(buffer, start)
            if length > self.max_frame:
                self.oversized(length)
                return
            if end - start - _FRAME.size < length:
                break
            body = start + _FRAME.size
            self.received(request_id, bytes(buffer[body : body + length]))
            start = body + length
            if self.closed:
                return
        del buffer[:start]

    def received(self, request_id: int, payload: bytes) -> None:
        raise NotImplementedError

    def holding(self) -> bool:
        """Whether to stop handing on frames (what is buffered waits for ``split``)."""
        return False

    def oversized(self, length: int) -> None:
        self.abort(f"a frame of {length} bytes")

    def abort(self, why: str) -> None:
        log.warning("%s connection closed: %s", self.name, why)
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True


# --- the sending side ----------------------------------------------------------------------------------------
class Calls(Frames):
    """The calling end: each payload sent under a new id, its answer the frame that comes back with that id."""

    def __init__(self) -> None:
        super().__init__()
        self._waiters: dict[int, asyncio.Future[bytes]] = {}
        self._next = 0

    def call(self, payload: bytes) -> asyncio.Future[bytes]:
        waiter: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        if self.closed:
            waiter.set_exception(ConnectionResetError("the local hop connection is closed"))
            return waiter
        self._next = self._next % 0xFFFF_FFFF + 1  # 0 is the hello's
        self._waiters[self._next] = waiter
        self.send(self._next, payload)
        return waiter

    def received(self, request_id: int, payload: bytes) -> None:
        waiter = self._waiters.pop(request_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(payload)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        waiters, self._waiters = self._waiters, {}
        for waiter in waiters.values():
            if not waiter.done():
                waiter.set_exception(ConnectionResetError("the local hop connection closed"))


class Hop:
    """This process's connections to its siblings, one per sibling, opened on first use."""

    def __init__(self, directory: Path, secret: bytes, epoch: Callable[[], int], home: str) -> None:
        self._directory = directory
        self._secret = secret
        self._epoch = epoch
        # The host of this broker's member endpoint: a sibling is a member on it. Sockets are named by port, and
        # every pod of a StatefulSet uses the same ports, so another pod's member must never be taken for one.
        self._home = home.rpartition(":")[0]
        self._connections: dict[str, Calls] = {}
        self._connecting: dict[str, asyncio.Task[Calls]] = {}

    def reaches(self, target: str) -> bool:
        """Whether ``target`` is a sibling listening on the local hop (its socket file is there)."""
        connection = self._connections.get(target)
        if connection is not None and not connection.closed:
            return True
        path = self._path(target)
        return path is not None and path.exists()

    def _path(self, target: str) -> Path | None:
        """The socket of sibling ``target``; None when it is no sibling (another host) or has no socket path."""
        if target.rpartition(":")[0] != self._home:
            return None
        return socket_path(self._directory, target)

    async def call(self, target: str, payload: bytes, timeout_s: float) -> bytes:
        """The owner's answer (SendMessageResponse bytes) to ``payload``; OSError or TimeoutError when it did
        not answer within ``timeout_s`` (waiting that long for a sibling that is restarting, as gRPC's
        wait_for_ready does)."""
        if len(payload) > MAX_FRAME_BYTES:  # as gRPC refuses a message past the channel's limit: this call only
            raise OSError(errno.EMSGSIZE, f"a forward of {len(payload)} bytes")
        deadline = time.monotonic() + timeout_s
        async with asyncio.timeout_at(asyncio.get_running_loop().time() + timeout_s):
            connection = self._connections.get(target)
            if connection is None or connection.closed:
                connection = await self._connect(target, deadline)
            return await connection.call(payload)

    async def _connect(self, target: str, deadline: float) -> Calls:
        connecting = self._connecting.get(target)
        if connecting is None:
            connecting = self._connecting[target] = asyncio.ensure_future(self._open(target, deadline))
            connecting.add_done_callback(lambda _: self._connecting.pop(target, None))
        return await asyncio.shield(connecting)

    async def _open(self, target: str, deadline: float) -> Calls:
        path = self._path(target)
        if path is None:
            raise FileNotFoundError(f"no local hop socket for {target} (no sibling of {self._home})")
        loop = asyncio.get_running_loop()
        while True:
            try:
                _, connection = await loop.create_unix_connection(Calls, str(path))
                break
            except OSError as exc:  # a sibling restarting: its old socket file refuses, or is gone for a moment
                if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT) or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(CONNECT_RETRY_S)
        _, value = trust.header(self._secret, HELLO, self._epoch(), time.time_ns() // 1_000_000)
        connection.send(0, value.encode())
        self._connections[target] = connection
        return connection

    async def close(self) -> None:
        for task in list(self._connecting.values()):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        for connection in self._connections.values():
            if connection.transport is not None:
                connection.transport.close()
        self._connections.clear()


# --- the owning side -----------------------------------------------------------------------------------------
def hello_kind(secret: bytes, hello: bytes, *, clients: bool) -> str | None:
    """What ``hello`` is signed over: ``HELLO``, or ``HELLO_CLIENTS`` where clients' sends are taken
    (``clients``); None when it does not verify."""
    header = ((trust.HEADER, hello.decode(errors="replace")),)
    now_ms = time.time_ns() // 1_000_000
    for kind in (HELLO, HELLO_CLIENTS) if clients else (HELLO,):
        peer, _ = trust.verify(secret, kind, header, now_ms)
        if peer is not None:
            return kind
    return None


class Served(Protocol):
    """What a serving connection needs of its server."""

    refused: Counter  # connections whose hello did not verify

    def verify(self, hello: bytes) -> bool: ...
    def serve(self, connection: Serving, request_id: int, payload: bytes) -> None: ...
    def forget(self, connection: Serving) -> None: ...


class Serving(Frames):
    """The serving end: its first frame must be a hello that verifies, every later one is served. Frames being
    served are bounded (``READ_AHEAD_FRAMES``, ``READ_AHEAD_BYTES``): past either, the connection is not read
    until answers went out (TCP's window then holds the peer's writes), so a peer sending faster than it is
    served costs the socket's buffers, not a task and a payload per frame."""

    def __init__(self, server: Served) -> None:
        super().__init__()
        self._server = server
        self.greeted = False
        self.max_frame = HELLO_MAX_BYTES  # until the hello verified
        self.serving = 0  # frames handed to the server and not yet answered
        self._serving_bytes = 0
        self.paused = False

    def received(self, request_id: int, payload: bytes) -> None:
        if not self.greeted:
            if request_id != 0 or not self._server.verify(payload):
                self.refuse("its hello does not verify (another cluster secret?)")
                return
            self.greeted = True
            self.max_frame = MAX_FRAME_BYTES
            return
        self.serving += 1
        self._serving_bytes += len(payload)
        if not self.paused and (self.serving >= READ_AHEAD_FRAMES or self._serving_bytes >= READ_AHEAD_BYTES):
            self.paused = True
            if self.transport is not None:
                self.transport.pause_reading()
        self._server.serve(self, request_id, payload)

    def holding(self) -> bool:
        return self.paused

    def served(self, payload: bytes) -> None:
        """A frame ``received`` handed to the server was answered (or dropped): read on once below half."""
        self.serving -= 1
        self._serving_bytes -= len(payload)
        if (
            self.paused
            and self.serving <= READ_AHEAD_FRAMES // 2
            and self._serving_bytes <= READ_AHEAD_BYTES // 2
            and not self.closed
        ):
            self.paused = False
            self.split()  # what was buffered first: it may pause again
            if not self.paused and not self.closed and self.transport is not None:
                self.transport.resume_reading()

    def oversized(self, length: int) -> None:
        if self.greeted:
            super().oversized(length)
        else:
            self.refuse(f"a frame of {length} bytes before its hello")

    def refuse(self, why: str) -> None:
        """Closed unverified, nothing read from it served: counted."""
        self._server.refused.inc()
        self.abort(why)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._server.forget(self)


class _HopServing(Serving):
    """A connection of the local hop: its hello also says whether its frames are clients' sends."""

    def __init__(self, server: HopServer) -> None:
        super().__init__(server)
        self._hop = server
        self.clients = False  # its hello was HELLO_CLIENTS

    def received(self, request_id: int, payload: bytes) -> None:
        if not self.greeted and request_id == 0:
            self.clients = self._hop.kind(payload) == HELLO_CLIENTS
        super().received(request_id, payload)


class HopServer:
    """The local hop socket of this process, serving its siblings' forwarded sends as peers' copies."""

    def __init__(  # noqa: PLR0917 (its parts, each once)
        self,
        path: Path,
        secret: bytes,
        send: Send,
        admission: Admission,
        metrics: Metrics,
        registry: CollectorRegistry,
        client_send: ClientSend | None = None,
    ) -> None:
        self.path = path
        self._secret = secret
        self._send = send
        self._client_send = client_send  # None: a connection of clients' sends is refused at its hello
        self._admission = admission
        self._metrics = metrics
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._connections: set[Serving] = set()
        self._closing = False
        self.refused = Counter(
            "lmq_local_hop_refused",
            "Local hop connections closed because their hello did not verify with the cluster secret",
            registry=registry,
        )

    async def start(self) -> None:
        directory = self.path.parent
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory.chmod(0o700)  # only this pod's processes (one user) reach the sockets in it
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # the socket of this process's previous run
        self._server = await asyncio.get_running_loop().create_unix_server(self._connected, str(self.path))
        self.path.chmod(0o600)

    def _connected(self) -> Serving:
        connection = _HopServing(self)
        self._connections.add(connection)
        return connection

    def forget(self, connection: Serving) -> None:
        self._connections.discard(connection)

    def verify(self, hello: bytes) -> bool:
        return self.kind(hello) is not None

    def kind(self, hello: bytes) -> str | None:
        return hello_kind(self._secret, hello, clients=self._client_send is not None)

    def serve(self, connection: Serving, request_id: int, payload: bytes) -> None:
        if self._closing:  # as a stopping gRPC server refuses new calls: this request only, nothing stored
            refused = errors.BrokerUnavailable("this broker is stopping; nothing was stored, try again")
            connection.send(request_id, spb.SendMessageResponse(status=status.status_of(refused)).SerializeToString())
            connection.served(payload)
            return
        task = asyncio.get_running_loop().create_task(self._answer(connection, request_id, payload))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: connection.served(payload))

    async def _answer(self, connection: Serving, request_id: int, payload: bytes) -> None:
        started = time.perf_counter()
        admission = self._admission
        if not admission.enter():
            admission.refuse("SendMessage")
            reply = spb.SendMessageResponse(status=pb.Status(code=pb.TOO_MANY_REQUESTS, message=admission.message))
        else:
            try:
                if isinstance(connection, _HopServing) and connection.clients and self._client_send is not None:
                    reply = await self._client_send(payload)
                else:
                    reply = await self._send(spb.SendMessageRequest.FromString(payload), payload)
            except Exception as exc:
                if status.code_of(exc) == pb.INTERNAL_ERROR and not isinstance(exc, errors.BrokerUnavailable):
                    log.exception("a forwarded send over the local hop failed")
                reply = spb.SendMessageResponse(status=status.status_of(exc))
            finally:
                admission.leave()
        self._metrics.observe("SendMessage", reply.status.code, time.perf_counter() - started)
        connection.send(request_id, reply.SerializeToString())

    async def close(self) -> None:
        """Stop taking connections, answer what was asked already, then close."""
        if self._server is None:
            return
        self._closing = True
        self._server.close()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.sleep(0)  # the answers' write, scheduled for the end of the tick
        for connection in list(self._connections):
            if connection.transport is not None:
                connection.transport.close()
        self._connections.clear()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._server = None
