"""Receives for a LiteSimpleConsumer in a cluster: the broker it calls gathers from every broker.

The official LiteSimpleConsumer receives from the first readable route queue only, so with several brokers
it would see only the first broker's lite topics. The broker that receives its ReceiveMessage therefore
also receives on its behalf from every other broker (one-hop calls with the client's id, which the client's
subscriptions already reach through the access broker's fan-out), and answers with what it found. A
message from another broker carries a wrapped receipt handle (``via <endpoint> <handle>``): its ack,
change-invisible or dead-letter call, which the client sends here, goes on to that broker.

A long poll must not lose messages: a broker that leased messages for a call that is then cut off would
hide them for their invisible duration. So other brokers are only ever asked without waiting (their
answer is immediate, never cut), for at most what is still missing. While nothing is found anywhere, this
broker waits without leasing: on its own ready set (``Dispatcher.await_ready``) and, through one parked
``AwaitLiteReady`` call per other broker (``readiness``), on theirs; as soon as one says ready, it is asked
again without waiting. A message arriving on another broker is therefore seen within a round trip or two, and
a waiting consumer costs one call per other broker per long poll (not per interval). A normal topic (no ready
sets) is still polled: this broker waits on it ``GATHER_POLL_MS`` between two rounds. Each lite topic lives on
one broker, so its order is its broker's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Final, TypeVar, cast

import grpc
from google.protobuf import duration_pb2
from google.protobuf import message as pb_message

from lmq_broker import errors, model
from lmq_broker.cluster import readiness
from lmq_broker.cluster.links import CALL_TIMEOUT_S, V2
from lmq_broker.cluster.peers import Peers
from lmq_broker.protocol import convert, status
from lmq_broker.protocol.context import Caller
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.handlers import ack_message, receive_message

log = logging.getLogger(__name__)

GATHER_POLL_MS: Final = 200
VIA: Final = "via"  # receipt handles of messages received from another broker: "via <endpoint> <its handle>"
_RECEIVE: Final = V2 + "ReceiveMessage"
_turns = itertools.count()
Resp = TypeVar("Resp", bound=pb_message.Message)


def gathers_for(edge: Edge, caller: Caller) -> bool:
    """A LiteSimpleConsumer known from its telemetry settings, calling this broker of a cluster."""
    if edge.cluster is None or not caller.client_id:
        return False
    state = edge.dispatcher.client_state(caller.client_id)
    return state is not None and state.client_type == pb.LITE_SIMPLE_CONSUMER


def wrap(endpoint: str, handle: str) -> str:
    return f"{VIA} {endpoint} {handle}"


def unwrap(peers: Peers, handle: str) -> tuple[str, str] | None:
    """(endpoint, handle there) of a wrapped handle, None for one of this broker's; only members are called."""
    if not handle.startswith(VIA + " "):
        return None
    _, endpoint, inner = [*handle.split(" ", 2), "", ""][:3]
    if endpoint not in peers.membership.members or not inner:
        raise errors.InvalidReceiptHandle("the receipt handle names no broker of this cluster")
    return endpoint, inner


async def receive(
    edge: Edge, peers: Peers, request: spb.ReceiveMessageRequest, caller: Caller, time_remaining_s: float | None
) -> AsyncIterator[spb.ReceiveMessageResponse]:
    batch = min(max(request.batch_size, 1), edge.config.receive_batch_size)
    poll_ms = edge.config.long_polling_timeout_ms
    if request.HasField("long_polling_timeout"):
        poll_ms = min(poll_ms, max(0, convert.duration_ms(request.long_polling_timeout)))
    if time_remaining_s is not None:
        poll_ms = max(0, min(poll_ms, int(time_remaining_s * 1000) - receive_message.DEADLINE_MARGIN_MS))
    deadline = time.monotonic() + poll_ms / 1000
    others = [m for slot, m in enumerate(peers.membership.members) if slot != peers.me]
    turn = next(_turns) % (len(others) + 1)
    sources: list[str | None] = [*others[:turn], None, *others[turn:]]  # None: this broker; the first asked rotates
    gather = _Gather(edge, peers, request, caller)
    group, parent = convert.group_name(request.group), convert.topic_name(request.message_queue.topic)
    lite = (await edge.dispatcher.metadata()).topic(parent).message_type == model.MessageType.LITE
    waits = readiness.Readiness(lambda: peers, caller.client_id, group, parent)
    found: list[pb.Message] = []
    written = 0
    try:
        try:
            while True:
                for source in sources:
                    if len(found) >= batch:
                        break
                    wanted = batch - len(found)
                    if source is None:
                        found += await gather.here(wanted, 0)
                        continue
                    got = await gather.there_kept(source, wanted)
                    if got is None:
                        waits.failed(source)
                    else:
                        waits.received(source, len(got))
                        found += got
                left_s = deadline - time.monotonic()
                if found or left_s <= 0:
                    break
                if not lite:  # a normal topic has no ready sets to wait on: this broker's, and the others again
                    found += await gather.here(batch, min(GATHER_POLL_MS, int(left_s * 1000)))
                    if found:
                        break
                    continue
                sources = await _ready(edge, waits, others, caller.client_id, group, parent, left_s)
        finally:
            waits.close()  # the waits parked elsewhere lease nothing: ending them loses nothing
        if not found:
            yield spb.ReceiveMessageResponse(status=pb.Status(code=pb.MESSAGE_NOT_FOUND, message="no new message"))
            return
        yield spb.ReceiveMessageResponse(status=status.ok())
        for message in found:
            yield spb.ReceiveMessageResponse(message=message)
            written += 1
    finally:  # cut before they were written (the client went mid-gathering or mid-reply): visible again now
        _give_back(edge, peers, request, caller, found[written:])
    yield spb.ReceiveMessageResponse(delivery_timestamp=convert.timestamp_of(edge.dispatcher.wall_clock()))


def _give_back(
    edge: Edge, peers: Peers, request: spb.ReceiveMessageRequest, caller: Caller, messages: list[pb.Message]
) -> None:
    """Messages gathered for a call that ended before they were written: this broker's visible again at once
    (``Dispatcher.give_back``), another broker's by a ChangeInvisibleDuration of 0 sent to it in the background
    (not awaited: the call is being cancelled); one that does not answer lets the lease expire."""
    here: list[str] = []
    for message in messages:
        handle = message.system_properties.receipt_handle
        try:
            where = unwrap(peers, handle)
        except errors.LmqError:  # a broker that left the cluster meanwhile: its lease expires there
            continue
        if where is None:
            here.append(handle)
            continue
        change = spb.ChangeInvisibleDurationRequest(
            group=request.group, topic=request.message_queue.topic, receipt_handle=where[1],
            invisible_duration=duration_pb2.Duration(), lite_topic=message.system_properties.lite_topic,
        )  # fmt: skip
        edge.dispatcher.runtime.spawn(_change_there(peers, where[0], change, caller))
    if here:
        edge.dispatcher.give_back(request.group.name, here)


async def _change_there(
    peers: Peers, endpoint: str, change: spb.ChangeInvisibleDurationRequest, caller: Caller
) -> None:
    with contextlib.suppress(errors.LmqError):
        await _call(
            peers, endpoint, "ChangeInvisibleDuration", change, spb.ChangeInvisibleDurationResponse, caller=caller
        )


async def _ready(  # noqa: PLR0917 (where, whom, how long)
    edge: Edge,
    waits: readiness.Readiness,
    others: list[str],
    client_id: str,
    group: str,
    parent: str,
    left_s: float,
) -> list[str | None]:
    """Wait, leasing nowhere, until this broker (None) or others have something for the client: the ones that
    do ([] at the deadline). Both waits can be cut at any point."""
    here = asyncio.ensure_future(
        edge.dispatcher.await_ready(client_id, group, parent, int(left_s * 1000), capped=False)
    )
    there = asyncio.ensure_future(waits.wait(others, left_s))
    try:
        await asyncio.wait((here, there), return_when=asyncio.FIRST_COMPLETED)
    finally:
        here.cancel()
        there.cancel()
    ready: list[str | None] = [None] if here.done() and not here.cancelled() and here.result() else []
    return ready + list(waits.take())


def _part(request: spb.ReceiveMessageRequest, batch: int, poll_ms: int) -> spb.ReceiveMessageRequest:
    part = spb.ReceiveMessageRequest()
    part.CopyFrom(request)
    part.batch_size = batch
    part.long_polling_timeout.CopyFrom(duration_pb2.Duration(seconds=poll_ms // 1000, nanos=poll_ms % 1000 * 1_000_000))
    return part


@dataclass(frozen=True, slots=True)
class _Gather:
    edge: Edge
    peers: Peers
    request: spb.ReceiveMessageRequest
    caller: Caller

    async def here(self, batch: int, poll_ms: int) -> list[pb.Message]:
        frames = receive_message.handle(self.edge, _part(self.request, batch, poll_ms), self.caller, None)
        return [frame.message async for frame in frames if frame.HasField("message")]

    async def there_kept(self, endpoint: str, batch: int) -> list[pb.Message] | None:
        """``there``, read to its end even when the receive is cut meanwhile: what that broker leased for it, its
        reply on the way, is then given back there (``_give_back``), not left leased for its invisible time."""
        task = asyncio.ensure_future(self.there(endpoint, batch))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self.edge.dispatcher.runtime.spawn(self._give_back_after(task))
            raise

    async def _give_back_after(self, task: asyncio.Future[list[pb.Message] | None]) -> None:
        got = await task
        if got:
            _give_back(self.edge, self.peers, self.request, self.caller, got)

    async def there(self, endpoint: str, batch: int) -> list[pb.Message] | None:
        """Without waiting: a call cut off after that broker leased messages would hide them. None: that broker
        did not answer, or refused (overloaded)."""
        call = self.peers.links.channel(endpoint).unary_stream(
            _RECEIVE,
            request_serializer=spb.ReceiveMessageRequest.SerializeToString,
            response_deserializer=spb.ReceiveMessageResponse.FromString,
        )
        out: list[pb.Message] = []
        try:
            async for frame in call(
                _part(self.request, batch, 0),
                metadata=self.peers.links.v2_headers("ReceiveMessage", self.caller),
                timeout=CALL_TIMEOUT_S,
            ):
                if frame.HasField("message"):
                    message = frame.message
                    handle = message.system_properties.receipt_handle
                    message.system_properties.receipt_handle = wrap(endpoint, handle)
                    out.append(message)
                elif frame.HasField("status") and frame.status.code not in (pb.OK, pb.MESSAGE_NOT_FOUND):
                    log.debug("gathering for %s from %s refused: %s", self.caller.client_id, endpoint,
                              frame.status.message)  # fmt: skip
                    return None
        except grpc.aio.AioRpcError as exc:  # that broker's topics wait; the others are served meanwhile
            log.debug("gathering for %s from %s failed: %s", self.caller.client_id, endpoint, exc.code().name)
            _give_back(self.edge, self.peers, self.request, self.caller, out)  # what came before it failed
            return None
        return out


# --- settling what was gathered -----------------------------------------------------------------------------
async def ack(edge: Edge, peers: Peers, request: spb.AckMessageRequest, caller: Caller) -> spb.AckMessageResponse:
    """Entries of this broker's messages are settled here, the others by their brokers; answered in order."""
    routed: dict[str | None, list[int]] = {}
    inner: list[str] = []
    for i, entry in enumerate(request.entries):
        where = unwrap(peers, entry.receipt_handle)
        routed.setdefault(None if where is None else where[0], []).append(i)
        inner.append(entry.receipt_handle if where is None else where[1])
    results: list[spb.AckMessageResultEntry | None] = [None] * len(request.entries)

    async def settle(endpoint: str | None, indices: list[int]) -> None:
        part = spb.AckMessageRequest(group=request.group, topic=request.topic)
        for i in indices:
            part.entries.add(message_id=request.entries[i].message_id, receipt_handle=inner[i])
        try:
            if endpoint is None:
                reply = await ack_message.handle(edge, part, caller)
            else:
                reply = await _call(peers, endpoint, "AckMessage", part, spb.AckMessageResponse, caller=caller)
        except errors.LmqError as exc:
            reply = spb.AckMessageResponse(status=status.status_of(exc))
        for n, i in enumerate(indices):
            got = reply.entries[n].status if n < len(reply.entries) else reply.status
            results[i] = spb.AckMessageResultEntry(
                message_id=request.entries[i].message_id, receipt_handle=request.entries[i].receipt_handle, status=got
            )

    await asyncio.gather(*(settle(endpoint, indices) for endpoint, indices in routed.items()))
    entries = [r for r in results if r is not None]
    return spb.AckMessageResponse(status=ack_message.overall(entries), entries=entries)


Settled = TypeVar("Settled", spb.ChangeInvisibleDurationRequest, spb.ForwardMessageToDeadLetterQueueRequest)


async def settle(  # noqa: PLR0917 (the call, and where its two answers come from)
    edge: Edge,
    peers: Peers,
    request: Settled,
    caller: Caller,
    here: Callable[[Edge, Settled, Caller], Awaitable[Resp]],
    response: type[Resp],
) -> tuple[Resp, str]:
    """ChangeInvisibleDuration or ForwardMessageToDeadLetterQueue of one message: here (``here``), or at the
    broker it was gathered from; returns the answer and that broker's endpoint ("" for this one)."""
    where = unwrap(peers, request.receipt_handle)
    if where is None:
        return await here(edge, request, caller), ""
    part = type(request)()
    part.CopyFrom(request)
    part.receipt_handle = where[1]
    method = type(request).__name__.removesuffix("Request")
    return await _call(peers, where[0], method, part, response, caller=caller), where[0]


async def _call(
    peers: Peers, endpoint: str, method: str, request: pb_message.Message, response: type[Resp], *, caller: Caller
) -> Resp:
    call = peers.links.channel(endpoint).unary_unary(
        V2 + method, request_serializer=type(request).SerializeToString, response_deserializer=response.FromString
    )
    # Not waiting for a connection (``wait_for_ready``), unlike other peer calls: that broker answered the receive
    # moments ago, so a connection that fails now is a broker that went down, and a consumer settling a batch one
    # message at a time would wait CALL_TIMEOUT_S per message before its next receive (the new holder delivers
    # the message again meanwhile: at-least-once, as for any refused ack).
    try:
        reply = await call(request, metadata=peers.links.v2_headers(method, caller), timeout=CALL_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        raise errors.BrokerUnavailable(
            f"broker {endpoint} that delivered this message did not answer: {exc.code().name}; try again"
        ) from None
    return cast("Resp", reply)
