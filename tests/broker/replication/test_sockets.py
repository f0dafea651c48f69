"""The owner's end of a follower's copy socket (``replication.sockets.Link``) against real TCP servers: a silent
follower, one with no socket, one that closes; the follower's end (``sockets.Server``) with the brokers in
test_replication.py."""

from __future__ import annotations

import asyncio
import gc

import pytest
from waiting import eventually_async

from lmq_broker import errors
from lmq_broker.cluster import local_hop
from lmq_broker.replication import sockets


async def silent_follower() -> tuple[asyncio.AbstractServer, int, list[bytes]]:
    """A TCP server that reads everything and answers nothing (stuck, or cut off behind a kept connection)."""
    read: list[bytes] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            read.append(data)
        writer.close()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], read


def link_to(port: int | None, timeout_s: float) -> sockets.Link:
    async def ask(endpoint: str) -> int | None:
        return port

    return sockets.Link("127.0.0.1:1", ask, lambda: "hello", timeout_s)


@pytest.mark.asyncio
async def test_copies_unanswered_in_time_fail_close_the_socket_and_leave_no_future_unretrieved() -> None:
    loop = asyncio.get_running_loop()
    reported: list[str] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(str(context.get("message"))))
    server, port, read = await silent_follower()
    link = link_to(port, 0.3)
    try:
        with pytest.raises(sockets.NotSent):  # nothing open yet: not sent (the caller takes the gRPC stream)
            await link.send(b"copy")
        await eventually_async(link.ready, "the socket open")
        outcomes = await asyncio.gather(*(link.send(b"copy") for _ in range(3)), return_exceptions=True)
        assert all(type(o) is errors.BrokerUnavailable for o in outcomes), outcomes
        assert not link.is_open
        await eventually_async(lambda: sum(map(len, read)) >= len(b"hello") + 3 * len(b"copy"), "all of it sent")
    finally:
        await link.close()
        server.close()
    gc.collect()
    await asyncio.sleep(0)
    assert not [r for r in reported if "never retrieved" in r], reported


@pytest.mark.asyncio
async def test_a_follower_without_a_socket_is_not_asked_again_at_once() -> None:
    asked: list[str] = []

    async def ask(endpoint: str) -> int | None:
        asked.append(endpoint)
        return None

    link = sockets.Link("127.0.0.1:1", ask, lambda: "hello", 1.0)
    assert not link.ready()
    await eventually_async(lambda: asked == ["127.0.0.1:1"], "asked once")
    for _ in range(5):
        assert not link.ready()
        await asyncio.sleep(0.01)
    assert asked == ["127.0.0.1:1"]  # not before RETRY_S
    await link.close()


@pytest.mark.asyncio
async def test_copies_waiting_on_a_socket_the_follower_closes_fail_and_the_next_is_not_sent() -> None:
    async def close_after_the_copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(len(local_hop.frame(0, b"hello") + local_hop.frame(1, b"copy")))
        writer.close()

    server = await asyncio.start_server(close_after_the_copy, "127.0.0.1", 0)
    link = link_to(server.sockets[0].getsockname()[1], 2.0)
    try:
        await eventually_async(link.ready, "the socket open")
        with pytest.raises(errors.BrokerUnavailable) as failed:
            await link.send(b"copy")
        assert type(failed.value) is errors.BrokerUnavailable  # it may have been read: a failure, not NotSent
        await eventually_async(lambda: not link.is_open, "closed")
        with pytest.raises(sockets.NotSent):
            await link.send(b"copy")
    finally:
        await link.close()
        server.close()


@pytest.mark.asyncio
async def test_a_copy_too_large_for_a_frame_fails_alone_and_the_socket_stays_open() -> None:
    server, port, read = await silent_follower()
    link = link_to(port, 2.0)
    try:
        await eventually_async(link.ready, "the socket open")
        with pytest.raises(errors.BrokerUnavailable, match="too large"):
            await link.send(bytes(local_hop.MAX_FRAME_BYTES + 1))
        assert link.is_open
        assert sum(map(len, read)) < local_hop.MAX_FRAME_BYTES  # not sent
    finally:
        await link.close()
        server.close()
        await asyncio.sleep(0.05)  # the follower's end sees the close and closes too


class Counted:
    """A prometheus Counter's ``inc`` as a count (what ``sockets.Server`` calls)."""

    def __init__(self) -> None:
        self.value = 0

    def inc(self) -> None:
        self.value += 1


def hello_ok() -> str:
    return "the hello"


async def copy_server(answer: sockets.Answer) -> tuple[sockets.Server, Counted, Counted, int]:
    refused, crowded = Counted(), Counted()
    server = sockets.Server(b"secret", answer, refused, crowded)  # type: ignore[arg-type]
    server.verify = lambda hello: hello == b"the hello"  # type: ignore[method-assign]
    port = server.bind("127.0.0.1", 0)
    await server.start()
    return server, refused, crowded, port


@pytest.mark.asyncio
async def test_connections_still_to_say_their_hello_are_capped_and_one_more_is_closed_at_once() -> None:
    async def answer(copy: bytes) -> bytes:
        return b""

    server, refused, crowded, port = await copy_server(answer)
    opened: list[asyncio.StreamWriter] = []
    try:
        for _ in range(sockets.MAX_UNVERIFIED):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            opened.append(writer)
        await eventually_async(lambda: len(server._connections) == sockets.MAX_UNVERIFIED, "all of them taken")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        opened.append(writer)
        assert await asyncio.wait_for(reader.read(1), 5) == b""  # closed, nothing read or answered
        assert crowded.value == 1
        assert refused.value == 0
        # a peer that says its hello is served all the same once one of them went
        opened[0].close()
        await eventually_async(lambda: len(server._connections) < sockets.MAX_UNVERIFIED, "one gone")
        link = link_to(port, 2.0)
        link._hello = hello_ok
        await eventually_async(link.ready, "the socket open")
        assert await link.send(b"copy") == b""
        await link.close()
    finally:
        for writer in opened:
            writer.close()
        await server.close()
        await asyncio.sleep(0.05)  # the transports' closes, scheduled by close()


@pytest.mark.asyncio
async def test_a_peer_sending_faster_than_its_copies_are_stored_is_not_read_past_the_bound() -> None:
    stored = asyncio.Event()
    waiting: list[bytes] = []

    async def answer(copy: bytes) -> bytes:
        waiting.append(copy)
        await stored.wait()
        return b"ends"

    server, _, _, port = await copy_server(answer)
    link = link_to(port, 30.0)
    link._hello = hello_ok
    copies = 3 * local_hop.READ_AHEAD_FRAMES
    try:
        await eventually_async(link.ready, "the socket open")
        sends = [asyncio.ensure_future(link.send(b"copy %d" % n)) for n in range(copies)]
        await eventually_async(lambda: len(waiting) >= local_hop.READ_AHEAD_FRAMES, "the bound reached")
        for _ in range(20):  # the follower reads no further while they wait
            await asyncio.sleep(0.01)
            assert len(waiting) == local_hop.READ_AHEAD_FRAMES  # the rest stays in the socket and the buffer
        (connection,) = server._connections
        assert connection.paused
        stored.set()
        assert await asyncio.gather(*sends) == [b"ends"] * copies
        assert len(waiting) == copies
        (after,) = server._connections
        assert after is connection
        assert not after.paused
        assert after.serving == 0
    finally:
        await link.close()
        await server.close()
        await asyncio.sleep(0.05)  # the transports' closes, scheduled by close()
