"""The v2 calls in a cluster of brokers (``protocol.calls.ClusterCalls``): routes and assignments list every
broker (the one asked first), sends and subscription changes go to the owners of their lite topics, a
LiteSimpleConsumer's receives gather from every broker and the settlements of what it gathered go back where
each message came from.

A call that carries a valid peer header (``cluster.trust``) is another broker's copy: applied here, never
passed on (a send is still checked against this broker's own view of who owns it, ``forwarding``). A call whose
peer header does not verify is served as a client's, counted (``lmq_peer_header_refused``) and logged at most
once a minute: a client that forges the header gains nothing, a broker with another secret is misconfigured.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Final

from prometheus_client import CollectorRegistry, Counter

from lmq_broker import errors
from lmq_broker.cluster import gathering, trust
from lmq_broker.cluster.links import V2, now_ms
from lmq_broker.cluster.peers import Peers
from lmq_broker.protocol import convert
from lmq_broker.protocol.calls import Headers
from lmq_broker.protocol.context import Caller
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.handlers import (
    ack_message,
    change_invisible_duration,
    forward_to_dead_letter_queue,
    receive_message,
    send_message,
)
from lmq_broker.protocol.handlers import sync_lite_subscription as sync_handler

log = logging.getLogger(__name__)

REFUSED_LOG_INTERVAL_S: Final = 60.0


def refuse_normal_sends(messages: Sequence[pb.Message]) -> None:
    """A leaving broker (or one removed, still running) takes no message of a NORMAL topic: its route lists it
    READ (RocketMQ's write permission taken away), and what it holds of them is being copied to the remaining
    brokers (``relocating``). A client on an older route gets a retriable refusal, nothing stored; the
    official producers then send to another queue of their route."""
    for message in messages:
        if not message.system_properties.lite_topic:
            raise errors.BrokerUnavailable(
                f"this broker is leaving the cluster and takes no message of {message.topic.name}: send it to "
                "another broker of the route; nothing was stored, try again"
            )


class Calls:
    def __init__(self, edge: Edge, peers: Peers, registry: CollectorRegistry) -> None:
        self._edge = edge
        self._peers = peers
        self._logged_at = -REFUSED_LOG_INTERVAL_S
        self.refused = Counter(
            "lmq_peer_header_refused",
            "Calls whose peer header did not verify (forged, another cluster secret, or too old): served as a client's",
            ["method"],
            registry=registry,
        )

    def _peer(self, method: str, headers: Headers) -> trust.PeerCall | None:
        peer, present = trust.verify(self._peers.links.secret, V2 + method, headers(), now_ms())
        if present and peer is None:
            self.refused.labels(method).inc()
            now = time.monotonic()
            if now - self._logged_at >= REFUSED_LOG_INTERVAL_S:
                self._logged_at = now
                log.warning(
                    "a %s call carried a peer header that does not verify (forged, or a broker with another "
                    "cluster secret): served as a client's call (lmq_peer_header_refused counts them)",
                    method,
                )
        return peer

    def brokers(self, *, external: bool, lite_route: bool = False) -> Sequence[tuple[pb.Broker, int]]:
        """This broker first when it is listed writable, then the others in slot order. With replication, only the
        brokers that hold some slot's lease: a slot whose lease another broker took (a failover) is served by that
        one, listed already, so routes and assignments follow the lease as sends do.

        This broker first because the official LiteSimpleConsumer receives from the first readable route queue
        only: it then keeps calling the broker it asked for the route, which gathers from every other for it
        (``gathering``) and so follows each slot's lease, instead of the broker of slot 0 until its next route
        refresh (tens of seconds when that one is down). Producers and push consumers use every queue, in any
        order. A broker that holds no lease (an old owner back as a follower) still comes first in a route of a
        LITE parent (``lite_route``), READ: that consumer keeps calling it, and it gathers from the holders, while
        producers (writable queues only) and assignments (push consumers) leave it out."""
        routed = self._peers.links.routed(external)
        serving = self._peers.owners.serving
        holding = set(range(len(routed))) if serving is None else {serving(slot) for slot in range(len(routed))}
        listed = [slot for slot in range(len(routed)) if slot in holding]
        me = self._peers.me
        if me in listed and routed[me][1] == pb.READ_WRITE:  # a leaving broker stays in its place
            listed = [me, *(slot for slot in listed if slot != me)]
        brokers = [routed[slot] for slot in listed]
        lease_less = serving is not None and 0 <= me < len(routed) and me not in holding  # a member, not a leaver
        if lite_route and lease_less and routed[me][1] == pb.READ_WRITE:
            brokers.insert(0, (routed[me][0], pb.READ))
        return brokers

    async def send(
        self, request: spb.SendMessageRequest, headers: Headers, data: bytes | None = None
    ) -> spb.SendMessageResponse:
        peer = self._peer("SendMessage", headers)
        if peer is None:
            send_message.refuse_internal_properties(request.messages)
            if self._peers.links.routes_forwarded:
                refuse_normal_sends(request.messages)
        return await self._peers.forwarder.send(request, peer_copy=peer is not None, data=data)

    def receive(
        self, request: spb.ReceiveMessageRequest, caller: Caller, headers: Headers, time_remaining_s: float | None
    ) -> AsyncIterator[spb.ReceiveMessageResponse]:
        if gathering.gathers_for(self._edge, caller) and self._peer("ReceiveMessage", headers) is None:
            return gathering.receive(self._edge, self._peers, request, caller, time_remaining_s)
        return receive_message.handle(self._edge, request, caller, time_remaining_s)

    async def sync_lite(
        self, request: spb.SyncLiteSubscriptionRequest, caller: Caller, headers: Headers
    ) -> spb.SyncLiteSubscriptionResponse:
        """A peer's part is applied here as it is; a client's is checked here, then split by owner."""
        edge = self._edge
        if self._peer("SyncLiteSubscription", headers) is not None:
            return await sync_handler.handle(edge, request, caller)
        client_id = caller.require_client_id()
        if request.action not in (pb.PARTIAL_ADD, pb.PARTIAL_REMOVE, pb.COMPLETE_ADD, pb.COMPLETE_REMOVE):
            raise errors.InvalidArgument(f"unknown lite subscription action {request.action}")
        group = convert.group_name(request.group)
        names = await sync_handler.lite_topics(request, caller, edge.config.max_lite_topic_size)
        plain = dataclasses.replace(caller, language="", version="")  # the parts are already read literally
        # Known here (and forgotten with the usual client expiry), so the intents this broker keeps for it
        # (``fanout``) live as long as the client does, even when none of its topics is this broker's.
        edge.dispatcher.client_seen(client_id, group=group)

        async def apply_here(part: spb.SyncLiteSubscriptionRequest) -> spb.SyncLiteSubscriptionResponse:
            return await sync_handler.handle(edge, part, plain)

        return await self._peers.fanout.sync_lite(request, names, caller, apply_here)

    # --- settling messages a LiteSimpleConsumer received through this broker from others ----------------------
    async def ack(self, request: spb.AckMessageRequest, caller: Caller) -> spb.AckMessageResponse:
        if not any(e.receipt_handle.startswith(gathering.VIA) for e in request.entries):
            return await ack_message.handle(self._edge, request, caller)
        return await gathering.ack(self._edge, self._peers, request, caller)

    async def change_invisible(
        self, request: spb.ChangeInvisibleDurationRequest, caller: Caller
    ) -> spb.ChangeInvisibleDurationResponse:
        reply, via = await gathering.settle(
            self._edge,
            self._peers,
            request,
            caller,
            change_invisible_duration.handle,
            spb.ChangeInvisibleDurationResponse,
        )
        if via and reply.status.code == pb.OK:
            reply.receipt_handle = gathering.wrap(via, reply.receipt_handle)
        return reply

    async def dead_letter(
        self, request: spb.ForwardMessageToDeadLetterQueueRequest, caller: Caller
    ) -> spb.ForwardMessageToDeadLetterQueueResponse:
        reply, _ = await gathering.settle(
            self._edge,
            self._peers,
            request,
            caller,
            forward_to_dead_letter_queue.handle,
            spb.ForwardMessageToDeadLetterQueueResponse,
        )
        return reply
