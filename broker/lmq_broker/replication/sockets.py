"""Copies to a follower over a framed TCP socket, in place of its gRPC stream (``streams``), where both ends have one.

Why: a copy over a gRPC stream is a stream message each way, and each costs both brokers grpc-aio's machinery (a
completion-queue event on grpc's poller thread, a loop wake-up from it, the message objects): in a quiet
microbenchmark about 85 µs of CPU per round trip on each side against about 35 µs for the same bytes on an asyncio
socket; inside the brokers at R=2 the follower's CPU went down by 16 to 23 µs per message (~3 messages per
copy), 2 to 8 % of R=2's CPU (bench/RESULTS.md, issue 32). The socket uses the local hop's framing
(``cluster.local_hop``: ``>II`` length and id, then the payload; frames of one loop tick written at once), over
TCP to the follower's member host.

How an owner finds it: the follower listens on ``--replica-port`` (0, the default: a port the OS picks; -1: no
socket) and answers the peer call ``/lmq.replica.v1.Replica/CopySocket`` with that port (empty: none, as with TLS
on: the socket carries no TLS, so with ``--tls-cert`` copies stay on the cluster's TLS channels). The owner asks
in the background the first time it copies to a follower, and connects in the background: until its socket is
open (and after it closed, until it is open again) copies take the gRPC stream as before, so no copy waits for
a connection. A follower of an older version has no such method (UNIMPLEMENTED), one that answers no port or
whose port cannot be reached (a network policy that admits only the gRPC port) is asked again after
``RETRY_S`` (``FAILED_RETRY_S`` when the question or the connection failed), and meanwhile gets its copies over
gRPC.

Frames: the first frame of a connection is the hello (id 0), the peer header's value over ``HELLO``
(``cluster.trust``: the cluster secret's HMAC, the caller's epoch, its time); the follower closes a connection
whose hello does not verify, serves nothing read from it and counts it in
``lmq_replication_copies_refused_total{reason="not_peer"}``, as it refuses a gRPC copy without a valid peer header;
so is one whose first frame is larger than ``local_hop.HELLO_MAX_BYTES`` or that sends no hello within
``HELLO_TIMEOUT_S`` (an unverified connection holds a few bytes, never a copy's worth).
Every other frame is one copy (``wire``), answered by a frame of the same id: a status byte (``streams.STORED``:
then what the unary call answers; ``streams.REFUSED``: then the refusal, UTF-8) and that payload. Answers are
matched by id, never by order. The follower stores a connection's copies through the same door as the stream's
(``following.Follower.accept``: the epoch checked there, so a deposed owner gets no copy acknowledged), in the
order they arrived (its lock is first come, first served).

Failure: a copy unanswered for ``timeout_s``, or a connection that breaks, fails every copy waiting on it as a
failed call (the follower may have stored them: the shipper counts them failed, the follower leaves the in-sync
set and is probed), and the connection is closed; a copy that finds no open connection was not sent and takes
the gRPC stream (``NotSent``). A copy larger than a frame may be (``local_hop.MAX_FRAME_BYTES``) fails alone, unsent.

Bounds on the follower's end: at most ``MAX_UNVERIFIED`` connections still to send their hello (one more is
closed as soon as it is made, counted in ``lmq_replication_copies_refused_total{reason="crowded"}``), and a
connection's copies being stored are bounded (``local_hop.Serving``: past them it is not read until answers
went out).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Final

from prometheus_client import Counter

from lmq_broker import errors
from lmq_broker.cluster import local_hop, trust
from lmq_broker.replication import streams

log = logging.getLogger(__name__)

HELLO: Final = "lmq replica copies v1"  # what the hello's HMAC is over, in place of a gRPC method
RETRY_S: Final = 60.0  # a follower without a socket is asked again this much later
FAILED_RETRY_S: Final = 5.0  # one that could not be asked or reached there (down, a network policy)
CONNECT_TIMEOUT_S: Final = 2.0
HELLO_TIMEOUT_S: Final = 10.0  # a connection that has not sent its hello by then is closed (and counted)
MAX_UNVERIFIED: Final = 64  # connections still to send their hello at once: one more is closed at once (counted)

Ask = Callable[[str], Awaitable[int | None]]  # a follower's copy socket port; None: it has none
Hello = Callable[[], str]  # the peer header value of a hello made now
Answer = Callable[[bytes], Awaitable[bytes]]  # a copy -> the follower's answer (LmqError: refused)


class NotSent(errors.BrokerUnavailable):
    """No open connection: the copy was not sent (take the gRPC stream)."""


def host_of(endpoint: str) -> str:
    """The host of a member endpoint ``host:port`` (``[v6]:port`` too)."""
    host = endpoint.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class Link:
    """The owner's end of one follower's copy socket: found, opened and opened again in the background."""

    def __init__(self, endpoint: str, ask: Ask, hello: Hello, timeout_s: float) -> None:
        self._endpoint = endpoint
        self._ask = ask
        self._hello = hello
        self._timeout_s = timeout_s
        self._connection: local_hop.Calls | None = None
        self._opening: asyncio.Task[None] | None = None
        self._next_try = 0.0  # monotonic: not before this

    @property
    def is_open(self) -> bool:
        return self._connection is not None and not self._connection.closed

    def ready(self) -> bool:
        """Open now; if not, opening it is started in the background (unless tried lately)."""
        if self.is_open:
            return True
        if self._opening is None and time.monotonic() >= self._next_try:
            name = f"lmq-copy-socket-{self._endpoint}"
            self._opening = asyncio.get_running_loop().create_task(self._open(), name=name)
        return False

    async def _open(self) -> None:
        self._next_try = time.monotonic() + FAILED_RETRY_S  # a failure below: gRPC until then
        try:
            port = await self._ask(self._endpoint)
            if port is None:
                self._next_try = time.monotonic() + RETRY_S
                log.info("%s has no copy socket: copies over gRPC", self._endpoint)
                return
            loop = asyncio.get_running_loop()
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                _, connection = await loop.create_connection(local_hop.Calls, host_of(self._endpoint), port)
            connection.name = f"copy socket to {self._endpoint}"
            connection.send(0, self._hello().encode())
            self._connection = connection
            self._next_try = 0.0
            log.info("copies to %s over its socket (port %d)", self._endpoint, port)
        except Exception as exc:  # not reached, or it would not say: gRPC for now
            log.info("no copy socket to %s (%s): copies over gRPC", self._endpoint, exc or type(exc).__name__)
        finally:
            self._opening = None

    async def send(self, data: bytes) -> bytes:
        """The follower's answer to a copy, as the unary call's; NotSent when no connection is open (nothing was
        sent); BrokerUnavailable when it failed after it was sent, or the follower refused it."""
        connection = self._connection
        if connection is None or connection.closed:
            raise NotSent(f"{self._endpoint}: no copy socket open")
        if len(data) > local_hop.MAX_FRAME_BYTES:  # as the gRPC stream refuses a message past its limit: this copy
            raise errors.BrokerUnavailable(f"{self._endpoint} copy socket: a copy of {len(data)} bytes is too large")
        waiter = connection.call(data)
        try:
            async with asyncio.timeout(self._timeout_s):
                answer = await waiter
        except TimeoutError:
            self._close(connection)
            raise errors.BrokerUnavailable(f"{self._endpoint} copy socket: no answer in time") from None
        except ConnectionError as exc:
            raise errors.BrokerUnavailable(f"{self._endpoint} copy socket: {exc}") from None
        if not answer or answer[0] != streams.STORED:
            refusal = answer[1:].decode(errors="replace")
            raise errors.BrokerUnavailable(f"{self._endpoint} Append: FAILED_PRECONDITION {refusal}")
        return answer[1:]

    def _close(self, connection: local_hop.Calls) -> None:
        """Close it (every copy waiting on it fails); the next copy opens another."""
        if self._connection is connection:
            self._connection = None
        connection.closed = True
        if connection.transport is not None:
            connection.transport.close()
        connection.connection_lost(None)  # fails the waiters now, not when the close comes round

    async def close(self) -> None:
        if self._opening is not None:
            self._opening.cancel()
            with contextlib.suppress(BaseException):
                await self._opening
        if self._connection is not None:
            self._close(self._connection)


class _Closed(asyncio.Protocol):
    """A connection closed as soon as it is made, nothing read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class Server:
    """The follower's copy socket: peers' copies, answered through ``answer`` (``following.Follower.accept``)."""

    def __init__(self, secret: bytes, answer: Answer, refused: Counter, crowded: Counter) -> None:
        self._secret = secret
        self._answer = answer
        self.refused = refused  # hellos that did not verify (``local_hop.Served``)
        self.crowded = crowded  # connections closed at once: MAX_UNVERIFIED others had not said their hello
        self._socket: socket.socket | None = None
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[local_hop.Serving] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def bind(self, host: str, port: int) -> int:
        """Bind now (so the port is known before any owner asks); the port bound."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
        self._socket = sock
        bound: int = sock.getsockname()[1]
        return bound

    async def start(self) -> None:
        assert self._socket is not None, "bind first"
        self._server = await asyncio.get_running_loop().create_server(self._connected, sock=self._socket)

    def _connected(self) -> asyncio.Protocol:
        connection = local_hop.Serving(self)
        connection.name = "copy socket"
        if sum(not c.greeted for c in self._connections) >= MAX_UNVERIFIED:
            self.crowded.inc()
            return _Closed()
        self._connections.add(connection)
        asyncio.get_running_loop().call_later(HELLO_TIMEOUT_S, self._unheard, connection)
        return connection

    @staticmethod
    def _unheard(connection: local_hop.Serving) -> None:
        if not connection.greeted and not connection.closed:
            connection.refuse("no hello in time")

    def forget(self, connection: local_hop.Serving) -> None:
        self._connections.discard(connection)

    def verify(self, hello: bytes) -> bool:
        header = ((trust.HEADER, hello.decode(errors="replace")),)
        peer, _ = trust.verify(self._secret, HELLO, header, time.time_ns() // 1_000_000)
        return peer is not None

    def serve(self, connection: local_hop.Serving, request_id: int, payload: bytes) -> None:
        task = asyncio.get_running_loop().create_task(self._serve(connection, request_id, payload))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: connection.served(payload))

    async def _serve(self, connection: local_hop.Serving, request_id: int, payload: bytes) -> None:
        try:
            answer = await self._answer(payload)
        except errors.LmqError as exc:
            connection.send(request_id, bytes((streams.REFUSED,)) + exc.message.encode())
        except Exception:  # as a gRPC stream whose handler failed: the connection ends, the owner's copies fail
            log.exception("a copy over the copy socket failed")
            connection.abort("a copy failed")
        else:
            connection.send(request_id, bytes((streams.STORED,)) + answer)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        elif self._socket is not None:
            self._socket.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for connection in list(self._connections):
            if connection.transport is not None:
                connection.transport.close()
        self._connections.clear()


class Sockets:
    """This broker's copy sockets: the one it listens on (as a follower) and its links to its followers' ones (as
    an owner)."""

    def __init__(  # noqa: PLR0917 (both ends' parts)
        self,
        bind: tuple[str, int],
        secret: bytes,
        answer: Answer,
        refused: tuple[Counter, Counter],
        ask: Ask,
        hello: Hello,
    ) -> None:
        self._bind = bind
        self.server = Server(secret, answer, *refused)
        self._ask = ask
        self._hello = hello
        self.links: dict[str, Link] = {}  # follower endpoint -> the link to its copy socket
        self.port: int | None = None  # where this broker's listens, once bound
        self._serving: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.port = self.server.bind(*self._bind)  # now: known before any owner asks
        self._serving = asyncio.get_running_loop().create_task(self.server.start(), name="lmq-copy-socket")

    def link(self, endpoint: str, timeout_s: float) -> Link:
        link = self.links.get(endpoint)
        if link is None:
            link = self.links[endpoint] = Link(endpoint, self._ask, self._hello, timeout_s)
        return link

    async def close(self) -> None:
        await asyncio.gather(*(link.close() for link in self.links.values()))
        if self._serving is not None:
            await asyncio.gather(self._serving, return_exceptions=True)
        await self.server.close()
