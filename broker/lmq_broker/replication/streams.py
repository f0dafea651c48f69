"""Copies to a follower over one long-lived gRPC stream per follower, in place of one unary call per copy.

Why: a unary call costs both brokers a call set-up in grpcio (the call objects, metadata, a peer header signed
and verified, several completion-queue events and loop wake-ups), about as much as a client's SendMessage; at
R=2 a send's copy shares its call with a few others at most, so that set-up was most of what a follower cost
(bench/RESULTS.md, issue 32). A stream pays it once; then a copy is one message each way. The unary call is
the plain twin (``setup.Replication.send_unary``): tests/broker/replication/test_replication_streams.py sends
the same copies both ways and compares the answers.

Frames (the stream's messages, raw bytes): a copy is ``id`` (8 bytes, big-endian, per stream) then the copy
(``wire``); its answer is the same ``id``, a status byte (0 stored: then what the unary call answers, the
follower's ends as JSON or nothing; 1 refused: then the refusal, UTF-8, which the unary call gave as
FAILED_PRECONDITION) and that payload. Answers are matched by ``id``, never by order, so a copy whose caller
gave up (its timeout) can never have its answer taken for another's.

A stream that fails (the follower restarting, a copy unanswered for ``timeout_s``) fails every copy waiting on
it, as failed calls, and is dropped; the next copy opens a new one. The follower answers a stream's copies one
after another, in order, as it stored unary copies one at a time (``following.Follower`` holds a lock).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

import grpc

from lmq_broker import errors

log = logging.getLogger(__name__)

_ID: Final = struct.Struct(">Q")
STORED: Final = 0
REFUSED: Final = 1


class Unimplemented(errors.BrokerUnavailable):
    """The stream a copy was written on had no such method at the follower (an older version): the copy was not
    read there, so it may be sent again another way. Any other failure may come after the follower stored it."""


Open = Callable[[], "grpc.aio.StreamStreamCall[bytes, bytes]"]  # a new stream to the follower (header signed)


def copy_frame(ident: int, data: bytes) -> bytes:
    return _ID.pack(ident) + data


def answer_frame(ident: bytes, status: int, payload: bytes) -> bytes:
    return ident + bytes((status,)) + payload


def read_answer(frame: bytes) -> tuple[int, int, bytes]:
    """(id, status, payload) of an answer frame."""
    if len(frame) < _ID.size + 1:
        raise errors.BrokerUnavailable(f"a replica stream answered {len(frame)} bytes: not an answer")
    (ident,) = _ID.unpack_from(frame)
    return ident, frame[_ID.size], frame[_ID.size + 1 :]


class Link:
    """The owner's end of one follower's stream, opened on first use and again after a failure."""

    def __init__(self, endpoint: str, open_stream: Open, timeout_s: float) -> None:
        self._endpoint = endpoint
        self._open = open_stream
        self._timeout_s = timeout_s
        self._call: grpc.aio.StreamStreamCall[bytes, bytes] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._waiting: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self._next = 0
        self._writing = asyncio.Lock()  # one write at a time on a stream (grpcio's rule)
        self.unimplemented = False  # the follower has no stream method

    @property
    def is_open(self) -> bool:
        return self._call is not None

    async def send(self, data: bytes) -> bytes:
        """The follower's answer to a copy, as the unary call's; BrokerUnavailable when the stream failed or the
        follower refused it (the unary call's FAILED_PRECONDITION)."""
        call = self._call if self._call is not None else self._start()
        self._next += 1
        ident = self._next
        future: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        self._waiting[ident] = future
        try:
            async with asyncio.timeout(self._timeout_s):
                async with self._writing:
                    await call.write(copy_frame(ident, data))
                status, payload = await future
        except BaseException as exc:  # failed, timed out or cancelled: the stream's state is unknown, drop it
            self._waiting.pop(ident, None)
            future.cancel()  # nobody awaits it any more: the stream's failure is not set on it (never retrieved)
            # This copy's own stream had no such method: it was not read there (a write to a finished call fails
            # with a state error, not its status, hence the call's code)
            own = isinstance(exc, Exception) and call.done() and await _code(call) == grpc.StatusCode.UNIMPLEMENTED
            if own:
                self.unimplemented = True
            self._drop(call, exc)
            if not isinstance(exc, Exception):
                raise
            if own:
                raise Unimplemented(f"{self._endpoint} Append stream: UNIMPLEMENTED") from None
            if isinstance(exc, errors.LmqError):
                raise
            raise errors.BrokerUnavailable(f"{self._endpoint} Append stream: {_why(exc)}") from None
        finally:
            self._waiting.pop(ident, None)
        if status != STORED:
            raise errors.BrokerUnavailable(f"{self._endpoint} Append: FAILED_PRECONDITION {payload.decode()}")
        return payload

    def _start(self) -> grpc.aio.StreamStreamCall[bytes, bytes]:
        call = self._call = self._open()
        self._reader = asyncio.get_running_loop().create_task(self._read(call), name=f"lmq-replica-{self._endpoint}")
        return call

    async def _read(self, call: grpc.aio.StreamStreamCall[bytes, bytes]) -> None:
        try:
            async for frame in call:
                ident, status, payload = read_answer(frame)
                future = self._waiting.get(ident)
                if future is not None and not future.done():
                    future.set_result((status, payload))
            exc: BaseException = errors.BrokerUnavailable("the follower ended the stream")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the stream failed (the follower went away)
            exc = e
        self._drop(call, exc)

    def _drop(self, call: grpc.aio.StreamStreamCall[bytes, bytes], exc: BaseException) -> None:
        """Fail every copy waiting on ``call`` and forget it (a new copy opens a new stream)."""
        if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            self.unimplemented = True  # a follower of an older version (a rolling upgrade): the caller falls back
        if self._call is not call:
            return
        self._call = None
        call.cancel()
        failure = errors.BrokerUnavailable(f"{self._endpoint} Append stream: {_why(exc)}")
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(failure)
        reader, self._reader = self._reader, None
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()

    async def close(self) -> None:
        call, reader = self._call, self._reader
        if call is not None:
            self._drop(call, errors.BrokerUnavailable("the broker is stopping"))
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader


async def _code(call: grpc.aio.StreamStreamCall[bytes, bytes]) -> grpc.StatusCode | None:
    try:
        return await call.code()
    except Exception:
        return None


def _why(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name} {exc.details()}"
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    return str(exc) or type(exc).__name__


Answer = Callable[[bytes], Awaitable[bytes]]  # a copy -> the follower's answer (LmqError: refused)


async def serve(requests: AsyncIterator[Any], answer: Answer) -> AsyncIterator[bytes]:
    """The follower's end: each copy of the stream answered in turn (the caller verified the stream's header)."""
    async for frame in requests:
        ident, data = frame[: _ID.size], frame[_ID.size :]
        try:
            payload = await answer(data)
        except errors.LmqError as exc:
            yield answer_frame(ident, REFUSED, exc.message.encode())
        else:
            yield answer_frame(ident, STORED, payload)
