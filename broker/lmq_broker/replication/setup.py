"""Replication's place in a broker: which slots it follows, its lease loop, the copy calls between brokers.

Copies travel as one unary gRPC call of raw bytes (``wire``) on the broker's client port, over the cluster's
channels, signed with the peer header (``cluster.trust``) like every call between brokers; a call without a
valid header is refused.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import grpc
from prometheus_client import CollectorRegistry

from lmq_broker import errors
from lmq_broker.cluster import membership as mb
from lmq_broker.cluster import trust
from lmq_broker.cluster.peers import Peers
from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch.dispatcher import Dispatcher
from lmq_broker.replication import copies, kube, owning, wire
from lmq_broker.replication.leadership import Leadership, identity
from lmq_broker.storage.api import Store

if TYPE_CHECKING:
    _GenericHandler: TypeAlias = grpc.GenericRpcHandler[Any, Any]
else:
    _GenericHandler = grpc.GenericRpcHandler

METHOD: Final = "/lmq.replica.v1.Replica/Append"
CALL_TIMEOUT_S: Final = 2.0
IDENTITY_FILE: Final = "replica-identity"


def check(config: BrokerConfig) -> None:
    """Refuse settings that cannot keep their promise (at start)."""
    if config.min_insync_replicas > config.replicas:
        raise errors.InvalidArgument(
            f"--min-insync-replicas {config.min_insync_replicas} exceeds --replicas {config.replicas}"
        )
    if 1 < config.min_insync_replicas < config.replicas:
        # A follower may take over only once it is in sync; with some followers allowed to miss an acknowledged
        # copy, which ones are in sync must be recorded with the lease before acknowledging without them (an
        # ISR as Kafka keeps it). Not built: all replicas, or the owner alone (asynchronous), nothing between.
        raise errors.InvalidArgument(
            f"--min-insync-replicas {config.min_insync_replicas} with --replicas {config.replicas}: give "
            f"{config.replicas} (every replica) or 1 (asynchronous); docs/replication.md"
        )
    if config.replicas > 1 and not config.lease_namespace:
        raise errors.InvalidArgument(
            "--replicas above 1 needs --lease-namespace: without Kubernetes Leases nothing decides which replica "
            "owns a slot (outside Kubernetes a cluster runs with --replicas 1; docs/replication.md)"
        )


def followers_of(slot: int, slots: int, processes: int, replicas: int) -> list[int]:
    """Follower k of ``slot``: the same process on the k-th next pod (never a process of its own pod)."""
    pods = slots // processes
    if replicas > pods:
        raise errors.InvalidArgument(f"--replicas {replicas} needs at least {replicas} pods, the ring has {pods}")
    return [(slot + k * processes) % slots for k in range(1, replicas)]


def identity_of(config: BrokerConfig, slot: int) -> str:
    """This broker's name as a lease holder: kept in its data directory, so a restart with its disk is the same
    holder (it renews its lease and goes on), and one with a new disk (lost) is another (it owns nothing)."""
    path = config.store.data_dir / IDENTITY_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        name = identity(slot, uuid.uuid4().hex[:12])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(name)
        return name


class Replication:
    def __init__(
        self, config: BrokerConfig, peers: Peers, dispatcher: Dispatcher, store: Store, registry: CollectorRegistry
    ) -> None:
        links = peers.links
        slots, me = len(links.membership.members), links.me
        processes = config.pod_processes
        api = kube.ApiServer.of(
            config.kube_api_server, config.kube_token_file, config.kube_ca_file, config.lease_namespace
        )
        replica_sets = [[s, *followers_of(s, slots, processes, config.replicas)] for s in range(slots)]
        self._links = links
        self._counters = copies.Counters(registry)
        self.follower: copies.Follower | None = None
        self.leadership = Leadership(
            api,
            identity_of(config, me),
            me,
            replica_sets,
            lambda slot, epoch: self.follower is not None and self.follower.in_sync(slot, epoch),
            prefix=config.lease_prefix,
            duration_ms=config.lease_duration_ms,
        )

        def commit(point: wire.Commit) -> Awaitable[None]:
            return asyncio.to_thread(store.commit_offset, point.queue, point.group, point.offset, point.acked)

        self.follower = copies.Follower(
            self.leadership, dispatcher.ingest.append_copy, lambda q: store.queue_offsets(q)[1], commit, self._counters
        )
        min_insync = config.min_insync_replicas or config.replicas

        def owner(slot: int) -> copies.Owner:
            endpoints = [links.membership.members[s] for s in replica_sets[slot] if s != me]
            read = lambda queue, offset, n: asyncio.to_thread(store.read, queue, offset, n)  # noqa: E731
            return copies.Owner(self.leadership, slot, endpoints, min_insync, self._send, read, self._counters)

        membership = links.membership
        self.slots = owning.Slots(self.leadership, lambda topic: mb.owner(membership, topic), owner)
        peers.owners.serving = self.leadership.serving
        self._secret = links.secret
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.leadership.run(self._stopping), name="lmq-leases")

    async def close(self) -> None:
        self._stopping.set()
        if self._task is not None:
            await self._task
        await self.slots.close()

    async def _send(self, endpoint: str, data: bytes) -> dict[str, int]:
        call = self._links.channel(endpoint).unary_unary(METHOD, None, None)
        try:
            answer = await call(
                data, metadata=(self._links.peer_header(METHOD),), timeout=CALL_TIMEOUT_S, wait_for_ready=True
            )
        except grpc.aio.AioRpcError as exc:
            raise errors.BrokerUnavailable(f"{endpoint}: {exc.code().name} {exc.details()}") from None
        behind: dict[str, int] = json.loads(answer) if answer else {}
        return behind

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        return _Handler(self)

    async def serve(self, data: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        call, _ = trust.verify(self._secret, METHOD, context.invocation_metadata(), int(time.time() * 1000))
        if call is None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "replica copies come from peers only")
        assert self.follower is not None
        try:
            behind = await self.follower.accept(data)
        except errors.LmqError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, exc.message)
        return json.dumps(behind).encode() if behind else b""


class _Handler(_GenericHandler):
    def __init__(self, replication: Replication) -> None:
        self._replication = replication

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        if handler_call_details.method != METHOD:
            return None
        return grpc.unary_unary_rpc_method_handler(self._replication.serve)
