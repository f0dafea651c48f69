"""The owner's end of a follower's copy stream (``replication.streams.Link``) against a real gRPC server."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from lmq_broker import errors
from lmq_broker.replication import streams

METHOD = "/test.Replica/Stream"


async def swallow(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    """A follower that reads every copy and answers none (stuck, or cut off behind a kept connection)."""
    async for _ in requests:
        continue
    nothing: tuple[bytes, ...] = ()
    for answer in nothing:  # an async generator that yields nothing
        yield answer


@contextlib.asynccontextmanager
async def follower(serve: Any) -> AsyncIterator[tuple[int, grpc.aio.Channel]]:
    """A real gRPC server whose ``METHOD`` stream is ``serve``, and a channel to it: (port, channel)."""
    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(serve)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Replica", {"Stream": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield port, channel
    finally:
        await channel.close(None)
        await server.stop(None)


@pytest.mark.asyncio
async def test_copies_unanswered_in_time_fail_and_leave_no_future_unretrieved() -> None:
    """Each copy waiting on a stream that stays silent fails BrokerUnavailable after the timeout; the copy whose
    own timeout dropped the stream leaves no failed future behind that nobody awaits (asyncio would report
    "Future exception was never retrieved" for it, as a broker's log showed after its follower died)."""
    loop = asyncio.get_running_loop()
    reported: list[str] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(str(context.get("message"))))
    async with follower(swallow) as (port, channel):
        link = streams.Link(f"127.0.0.1:{port}", opener(channel, METHOD), 0.3)
        outcomes = await asyncio.gather(*(link.send(b"copy") for _ in range(3)), return_exceptions=True)
        assert all(isinstance(o, errors.BrokerUnavailable) for o in outcomes), outcomes
        assert all("no answer in time" in str(o) or "Append stream" in str(o) for o in outcomes)
        assert not link.is_open
        await link.close()
    gc.collect()
    await asyncio.sleep(0)
    assert not [r for r in reported if "never retrieved" in r], reported


async def drop_after_reading(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    """A follower that read a copy (it may have stored it) and then failed the stream."""
    async for _ in requests:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")
    nothing: tuple[bytes, ...] = ()
    for answer in nothing:
        yield answer


def opener(channel: grpc.aio.Channel, method: str) -> streams.Open:
    def open_stream() -> grpc.aio.StreamStreamCall[bytes, bytes]:
        return channel.stream_stream(method, None, None)(None)

    return open_stream


@pytest.mark.asyncio
async def test_only_a_copy_whose_own_stream_had_no_such_method_is_told_it_was_not_read() -> None:
    """``Unimplemented`` (the owner may send that copy again as JSON) only for a copy whose own stream the
    follower did not know; a stream that failed after reading its copy is a plain failure (the follower may have
    stored it: sent again, a normal topic's message would be stored twice there)."""
    for method, unknown in ((METHOD, False), ("/test.Replica/Missing", True)):
        # a server and channel of its own for each case: the first case's aborted stream once made the shared
        # connection go away (GOAWAY), and the second case's call then failed INTERNAL before reaching the server
        async with follower(drop_after_reading) as (port, channel):
            link = streams.Link(f"127.0.0.1:{port}", opener(channel, method), 2.0)
            with pytest.raises(errors.BrokerUnavailable) as failed:
                await link.send(b"copy")
            assert isinstance(failed.value, streams.Unimplemented) is unknown, failed.value
            assert link.unimplemented is unknown
            await link.close()
