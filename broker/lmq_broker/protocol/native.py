"""The native edge (``serve --edge native``; docs/design/native-edge.md, milestone 1): the client port served by
``lmq_edge``, a Rust extension (hyper's HTTP/2 on tokio threads, built by ``make native``), in place of
grpcio's asyncio server. The native side does HTTP/2, gRPC framing, deadlines and cancellation; every call
comes here as its method, metadata and request bytes, and runs the very handlers grpcio would run (the same
generic handlers and interceptors, the same servicer context calls), so each RPC has one implementation
whichever edge carries it.

Calls cross in batches: the native side queues what happened (a call opened, a request message, the end of the
requests, a cancellation) and makes one socket readable; one reader callback on the event loop takes every
queued event in one call. Replies go back without waiting: ``Call.send`` and ``Call.finish`` hand frames to
the native side. A call's request messages are read ahead of its handler up to ``--max-unread-requests``; past
that the native side stops reading the call's stream, and HTTP/2 flow control stops the client.

TLS (``--tls-cert``, rustls; the certificate follows its files as on grpcio's edge) and the shared access port
of ``--processes`` (a second listener of the same server, SO_REUSEPORT) are served natively. The admin listener
(``--admin-port``) and the external listener stay on grpcio.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import importlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NoReturn, TypeAlias

import grpc

from lmq_broker.config import BrokerConfig

lmq_edge: Any
try:
    lmq_edge = importlib.import_module("lmq_edge")  # a Rust extension: no stubs, Any
except ImportError:  # not built: `make native`
    lmq_edge = None

if TYPE_CHECKING:
    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]
    GenericHandler: TypeAlias = grpc.GenericRpcHandler[Any, Any]
    Interceptor: TypeAlias = grpc.aio.ServerInterceptor[Any, Any]

log = logging.getLogger(__name__)

MISSING: Final = "--edge native: the native edge (module lmq_edge) is not built in this environment: run `make native`"
# --edge left at its default (native) without the module: `serve` goes on with grpcio's edge (__main__.edge_of)
FALLBACK: Final = (
    "the native edge, the default, is not built in this environment (module lmq_edge; `make native`): "
    "the client port is served by grpcio's edge (--edge grpcio)"
)
THREADS: Final = 1  # tokio worker threads: the event loop has the other core of a 2-core pod
OK: Final = 0
CANCELLED: Final = 1
UNKNOWN: Final = 2
INTERNAL: Final = 13
UNAVAILABLE: Final = 14
UNIMPLEMENTED: Final = 12
OPEN: Final = 0
MESSAGE: Final = 1
HALF_CLOSE: Final = 2
CANCEL: Final = 3
DRAINED: Final = 4
LOG: Final = 5  # a line for the log from the native side (TLS certificate reloads)
FIRST_REQUEST_WAIT_S: Final = 0.5  # a request stream refused at once: its status waits this long for a first message
PENDING_HIGH: Final = 64 * 1024  # reply bytes not yet taken by HTTP/2 past which a writer checks must_wait (lib.rs)


def available() -> bool:
    return lmq_edge is not None


def unavailable(config: BrokerConfig) -> str | None:
    """Why ``--edge native`` cannot serve ``config``, in one line; None when it can."""
    del config  # every combination of flags is served since TLS and --processes are (docs/design/native-edge.md)
    if lmq_edge is None:
        return MISSING
    return None


@dataclass(frozen=True, slots=True)
class _Details:
    """What grpcio's generic handlers and interceptors read of a call (``grpc.HandlerCallDetails``)."""

    method: str
    invocation_metadata: tuple[tuple[str, str | bytes], ...]


class _Inbox:
    """A call's request messages (None: the client sent its last). Each one taken is told to the native side
    (``Call.took``), which reads at most ``max_unread_requests`` ahead of the handler."""

    __slots__ = ("call", "items", "seen", "waiter")

    def __init__(self, call: Any) -> None:
        self.call = call
        self.items: deque[bytes | None] = deque()
        self.seen = False  # a request message or the end of the requests has arrived
        self.waiter: asyncio.Future[None] | None = None

    def put(self, item: bytes | None) -> None:
        self.items.append(item)
        self.seen = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def first(self, timeout_s: float) -> None:
        """Waits at most ``timeout_s`` for the client's first request message (or the end of its requests)."""
        if self.seen:
            return
        self.waiter = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.waiter, timeout_s)

    async def get(self) -> bytes | None:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        item = self.items.popleft()
        if item is not None:
            self.call.took()
        return item


class Context:
    """The servicer context the handlers use (the subset of ``grpc.aio.ServicerContext`` lmq calls)."""

    __slots__ = (
        "_cancelled",
        "_deadline",
        "_metadata",
        "_peer",
        "call",
        "code",
        "details",
        "drained",
        "inbox",
        "task",
        "trailing",
    )

    def __init__(self, call: Any, metadata: Sequence[tuple[str, str | bytes]], peer: str, timeout: float | None):
        self.call = call
        self._metadata = tuple(metadata)
        self._peer = peer
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailing: list[tuple[str, str]] = []  # sent with the status (the admin service's ``lmq-error``)
        self.inbox = _Inbox(call)
        self.task: asyncio.Task[None] | None = None
        self._cancelled = False
        self.drained: asyncio.Future[None] | None = None  # set when the native side took the pending replies

    async def write(self, data: bytes) -> bool:
        """One reply message; waits while the client has not taken ``PENDING_HIGH`` bytes (HTTP/2 flow
        control), as grpcio's writes wait, so a handler's own caps see unread replies as unread. False: ended."""
        pending = self.call.send(data)
        if pending < 0:  # the call is over: the handler is closed by its caller, not cancelled mid-cleanup
            self._cancelled = True
            return False
        if pending > PENDING_HIGH and self.call.must_wait():
            self.drained = asyncio.get_running_loop().create_future()
            await self.drained
        return True

    def drain(self) -> None:
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, trailing_metadata: Iterable[tuple[str, str | bytes]]) -> None:
        self.trailing = _trailers(trailing_metadata)

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Iterable[tuple[str, str | bytes]] = ()
    ) -> NoReturn:
        self.code, self.details = code, details
        if trailing_metadata:
            self.set_trailing_metadata(trailing_metadata)
        raise grpc.aio.AbortError(f"aborted: {code}")

    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """The client went (or the server stops): the handler's task is cancelled once, never again while its
        ``finally`` runs (a second cancel would cut that cleanup short)."""
        if self._cancelled:
            return
        self._cancelled = True
        if self.task is not None and not self.task.done():
            self.task.cancel()


class NativeServer:
    """The parts of ``grpc.aio.Server`` the broker uses (``add_generic_rpc_handlers``, ``start``, ``stop``), over
    ``lmq_edge.Server``; ``listen`` binds (``protocol.server.bind``)."""

    def __init__(
        self, max_message_bytes: int, max_unread_requests: int, interceptors: Sequence[Interceptor] = ()
    ) -> None:
        if lmq_edge is None:
            raise RuntimeError(MISSING)
        self._core = lmq_edge.Server(max_message_bytes, max_unread_requests, THREADS)
        self._handlers: list[GenericHandler] = []
        self._interceptors = tuple(interceptors)
        self._calls: dict[int, Context] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def stats(self) -> list[tuple[str, int]]:
        """The native edge's counters, read in one call (``native_metrics.EdgeCollector``)."""
        return list(self._core.stats())

    def limit_streams(self, streams: int) -> None:
        """HTTP/2 streams one connection may have open at once (0: no cap; ``--max-streams-per-connection``); a
        module built before the cap existed serves every stream (``make native`` builds the current one)."""
        if hasattr(self._core, "limit_streams"):
            self._core.limit_streams(streams)

    def limit_connections(self, total: int, per_address: int) -> None:
        """Connections open at once, in all and from one IP address (0: no cap; ``--max-connections``,
        ``--max-connections-per-address``): one past either is closed at its accept (``limits.rs``)."""
        self._limit("limit_connections", total, per_address)

    def limit_request_buffers(self, total: int, per_connection: int) -> None:
        """Request bytes of messages not yet whole, in all and per connection (0: no cap;
        ``--max-request-buffer-bytes``, ``--max-request-buffer-bytes-per-connection``)."""
        self._limit("limit_request_buffers", total, per_connection)

    def _limit(self, name: str, *values: int) -> None:
        """A module built before the cap existed serves without it, said in the log (``make native``)."""
        if hasattr(self._core, name):
            getattr(self._core, name)(*values)
        else:
            log.warning("the native edge module lacks %s (built before it): its cap is off; run `make native`", name)

    @property
    def forwards(self) -> bool:
        """Whether this build of the module forwards sends natively (a module built before it does not)."""
        return hasattr(self._core, "forward_to")

    def forward_to(self, size: int, me: int, timeout_s: float, routes: list[tuple[int, str, bytes, bytes]]) -> None:
        """``--native-forward``: the plain-placement table (``cluster.native_forward``; ``forward.rs``)."""
        self._core.forward_to(size, me, timeout_s, routes)

    def forward_off(self) -> None:
        """Every call to Python from now on."""
        self._core.forward_off()

    def add_generic_rpc_handlers(self, handlers: Iterable[GenericHandler]) -> None:
        self._handlers.extend(handlers)

    def serve_tls(self, cert: Path, key: Path) -> None:
        """TLS on every listener; OSError when the pair does not load now (as grpcio's edge refuses it)."""
        try:
            self._core.tls(str(cert), str(key))
        except ValueError as exc:
            raise OSError(f"TLS certificate {cert} and key {key}: {exc}") from exc

    def listen(self, host: str, port: int, *, shared: bool = False) -> int:
        """``shared``: SO_REUSEPORT, the access port of ``--processes``."""
        return int(self._core.listen(host, port, shared))

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._core.wake_fd(), self._take)
        self._core.start()

    async def stop(self, grace: float | None) -> None:
        """Stop taking connections, let running calls end for ``grace`` seconds, then cancel the rest (sends
        forwarded natively and still unanswered end with the native threads; none is forwarded from now on)."""
        if self.forwards:
            self._core.forward_off()
        self._core.stop_accepting()
        tasks = [c.task for c in self._calls.values() if c.task is not None]
        if tasks and grace:
            await asyncio.wait(tasks, timeout=grace)
        for context in list(self._calls.values()):
            context.call.finish(UNAVAILABLE, "the broker is shutting down")
            context.cancel()
        tasks = [c.task for c in self._calls.values() if c.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        if self._loop is not None:
            self._loop.remove_reader(self._core.wake_fd())
            self._loop = None
        self._core.close()

    def _take(self) -> None:
        calls = self._calls
        for event in self._core.take():
            kind = event[0]
            if kind == OPEN:
                self._open(*event[1:])
            elif kind == LOG:  # (LOG, is_warning, text): before the lookup, True would find call 1
                log.log(logging.WARNING if event[1] else logging.INFO, "%s", event[2])
            elif (context := calls.get(event[1])) is not None:
                if kind == MESSAGE:
                    context.inbox.put(event[2])
                elif kind == HALF_CLOSE:
                    context.inbox.put(None)
                elif kind == DRAINED:
                    context.drain()
                else:
                    context.cancel()

    def _open(
        self, call: Any, method: str, metadata: list[tuple[str, str | bytes]], peer: str, timeout: float | None
    ) -> None:
        context = Context(call, metadata, peer, timeout)
        self._calls[call.id] = context
        context.task = asyncio.create_task(self._run(method, context))

    async def _handler(self, method: str, context: Context) -> Handler | None:
        details = _Details(method, context.invocation_metadata())  # generic handlers may read it (AdminGuard)
        if not self._interceptors:
            return self._find(details)
        return await self._intercepted(0, details)

    def _find(self, details: Any) -> Handler | None:
        for generic in self._handlers:
            handler = generic.service(details)
            if handler is not None:
                return handler
        return None

    async def _intercepted(self, index: int, details: Any) -> Handler | None:
        if index == len(self._interceptors):
            return self._find(details)

        def following(next_details: Any) -> Awaitable[Handler | None]:
            return self._intercepted(index + 1, next_details)

        return await self._interceptors[index].intercept_service(following, details)  # type: ignore[arg-type]

    async def _run(self, method: str, context: Context) -> None:
        call = context.call
        handler = None
        try:
            handler = await self._handler(method, context)
            if handler is None:  # the status waits for the request, as for a refused stream (below)
                await context.inbox.first(FIRST_REQUEST_WAIT_S)
                call.finish(UNIMPLEMENTED, "Method not found!")
                return
            await _serve(handler, context)
            code = context.code
            call.finish(OK if code is None else code.value[0], context.details, context.trailing)
        except grpc.aio.AbortError:
            code = context.code
            if handler is not None and handler.request_streaming:
                # A stream refused before its client sent anything (Telemetry past the caps, a replica stream
                # refused, an unknown method): the status waits for its first message, since grpcio's client, when
                # the status comes before its first write is done, reports the failed write (INTERNAL) instead.
                await context.inbox.first(FIRST_REQUEST_WAIT_S)
            call.finish(UNKNOWN if code is None else code.value[0], context.details, context.trailing)
        except asyncio.CancelledError:
            call.finish(CANCELLED, "Cancelled")
            if not context.cancelled():
                raise
        except Exception as exc:
            log.exception("%s failed on the native edge", method)
            call.finish(UNKNOWN, f"Unexpected {type(exc).__name__}: {exc}")
        finally:
            self._calls.pop(call.id, None)


def _trailers(metadata: Iterable[tuple[str, str | bytes]]) -> list[tuple[str, str]]:
    """Trailing metadata as HTTP/2 trailers: a binary value (a ``-bin`` key) base64-encoded, as grpcio sends it."""
    return [(k, base64.b64encode(v).decode() if isinstance(v, bytes) else v) for k, v in metadata]


async def _serve(handler: Any, context: Context) -> None:
    """Runs one call's behaviour (``handler``, a ``grpc.RpcMethodHandler`` of async behaviours) the way grpcio
    would, sending each reply message as it comes."""
    decode: Callable[[bytes], Any] = handler.request_deserializer or _same
    encode: Callable[[Any], bytes] = handler.response_serializer or _same
    if handler.request_streaming:
        requests = _requests(context.inbox, decode)
        if handler.stream_stream is not None:
            await _write_all(context, encode, handler.stream_stream(requests, context))
        elif handler.stream_unary is not None:
            _reply(context, encode, await handler.stream_unary(requests, context))
        return
    data = await context.inbox.get()
    if data is None:
        context.set_code(grpc.StatusCode.INTERNAL)
        context.set_details("the call ended before its request")
        return
    request = decode(data)
    if handler.unary_stream is not None:
        await _write_all(context, encode, handler.unary_stream(request, context))
    elif handler.unary_unary is not None:
        _reply(context, encode, await handler.unary_unary(request, context))


async def _write_all(context: Context, encode: Callable[[Any], bytes], replies: AsyncIterator[Any]) -> None:
    """Send each reply as it comes, until the call ended (the client went); the handler's generator is closed
    then and now, not left suspended at its ``yield`` until collected: its ``finally`` (a Telemetry stream's
    client removed, a long poll's lease given back) runs before the call is finished."""
    try:
        async for reply in replies:
            if not await context.write(encode(reply)):
                return
    finally:
        close = getattr(replies, "aclose", None)
        if close is not None:
            await close()


def _reply(context: Context, encode: Callable[[Any], bytes], reply: Any) -> None:
    if reply is not None and context.code in (None, grpc.StatusCode.OK):
        context.call.send(encode(reply))


async def _requests(inbox: _Inbox, decode: Callable[[bytes], Any]) -> AsyncIterator[Any]:
    while (data := await inbox.get()) is not None:
        yield decode(data)


def _same(value: Any) -> Any:
    return value
