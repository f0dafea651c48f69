"""This broker's place in a cluster, and the one place that decides whether it acts as a cluster at all.

The membership comes from the flags (``--peers``, ``--ordinal``/``--advertised-address``, ``--ring-history``)
or from the admin service's last ``SetCluster``, stored (synced) in the store's meta with the flags it replaced,
so a restart with the same flags keeps it; a restart with different flags means someone changed the
deployment since, and the flags win. A broker alone (one member) leaves ``Edge.cluster`` None and every call is
its own; otherwise ``Edge.cluster`` is this package's ``calls.Calls``. A change applies in one step of the event
loop (the next call already sees the new routes, assignments and placements); the new epoch is *confirmed*
(reported by ``GetCluster``, ``cluster.epochs``) once every send begun under an older epoch has finished.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Final

import grpc

from lmq_broker import errors, model
from lmq_broker.cluster import draining, local_hop, native_forward, relocating, trust
from lmq_broker.cluster import membership as mb
from lmq_broker.cluster.calls import Calls
from lmq_broker.cluster.fanout import Subscription
from lmq_broker.cluster.peers import Peers
from lmq_broker.config import BrokerConfig, LocalHop
from lmq_broker.dispatch.dispatcher import Dispatcher
from lmq_broker.protocol import guard, status
from lmq_broker.protocol.admission import Admission
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as admin_pb
from lmq_broker.protocol.handlers import send_message
from lmq_broker.protocol.metrics import Metrics
from lmq_broker.protocol.refusals import RefusalLog
from lmq_broker.storage.api import Store

log = logging.getLogger(__name__)

FLAGS: Final = "flags"
ADMIN: Final = "admin"
RELOCATE_TIMEOUT_S: Final = 30.0  # a StoreRelocated call: up to 500 messages appended and made durable there
COMMITTED_TIMEOUT_S: Final = 10.0  # a CommittedGroups call


def membership_of(config: BrokerConfig) -> tuple[mb.Membership, int] | None:
    """The cluster and this broker's slot from the config; None for a broker alone (no ``peers``)."""
    if not config.peers:
        return None
    membership = mb.Membership.parse(config.peers, config.ring_history)
    if len(membership.members) > 1 and not trust.secret_of(config.cluster_secret, config.admin_secret_key):
        raise errors.InvalidArgument(
            "brokers of a cluster authenticate each other: give every broker the same --cluster-secret, or the same "
            "admin key pair (--admin-access-key/--admin-secret-key)"
        )
    if config.ordinal >= 0:
        if config.ordinal >= len(membership.members):
            raise errors.InvalidArgument(f"ordinal {config.ordinal} but only {len(membership.members)} peers")
        return membership, config.ordinal
    if not config.advertised_address:
        raise errors.InvalidArgument("with peers, set ordinal or advertised_address (this broker's place in them)")
    return membership, membership.slot_of(config.advertised_address)


def grown(current: mb.Membership, new: mb.Membership) -> bool:
    """Whether ``new`` is ``current`` grown (a scale-up): every member kept in its slot, new ones appended, the
    new ring size added to the history, no slot leaving on either side."""
    kept = len(current.members)
    return (
        len(new.members) > kept
        and new.members[:kept] == current.members
        and new.sizes == (*current.sizes, len(new.members))
        and not current.leaving_slots
        and not new.leaving_slots
    )


def marked_leaving(current: mb.Membership, new: mb.Membership) -> bool:
    """Whether ``new`` is ``current`` with its last slots marked leaving (a scale-down's first step): the same
    members, a smaller ring size added to the history, nothing leaving before."""
    return (
        new.members == current.members
        and not current.leaving_slots
        and new.sizes == (*current.sizes, new.size)
        and 1 <= new.size < len(current.members)
    )


def shed(current: mb.Membership, new: mb.Membership) -> bool:
    """Whether ``new`` is ``current`` without its leaving slots (a scale-down's last step, ``Membership.shed``)."""
    if not current.leaving_slots:
        return False
    without = current.shed()
    return (new.members, new.sizes) == (without.members, without.sizes)


def fixed_ring(replicas: int, current: mb.Membership, new: mb.Membership, why_fixed: str | None) -> None:
    """With replication (``--replicas`` above 1) a ring changes only in the shapes whose replicas and leases the
    brokers move (docs/replication.md, *Changing the ring with R > 1*): grown (each broker rebuilds its replica
    sets from the grown membership: the union of the ring before and after until every new replica is in its
    slot's in-sync set), its last slots marked leaving (the same union towards the smaller ring; the leaving
    brokers drain their topics to today's owners, which take them over where they end, and hand the leases of
    the slots that stay over), and those slots removed once the operator found them drained and handed over
    (``SetCluster``'s removal check asks each whether it is drained). Any other ring (slots leaving on top of a
    change, a shrunk ring removed at once, other members) is refused, whatever ``force``. A topic keeps the
    slot its records name. ``why_fixed`` is why this broker cannot take a changed ring now ("": it can; None:
    its replication has not started): a lite topic of its store names no slot on its last record
    (``replication.stamps``). A new epoch of the same ring (the operator numbering it) is accepted."""
    if replicas <= 1 or new == current:
        return
    if not (grown(current, new) or marked_leaving(current, new) or shed(current, new)):
        why = (
            "a replicated ring grows, or shrinks by marking its last slots leaving and then, once they are drained "
            "and their slots' leases handed over, removing them"
        )
    elif marked_leaving(current, new) and new.size < replicas:
        why = f"a ring of {new.size} pods cannot hold {replicas} replicas of each slot"
    elif why_fixed is None:
        why = "replication is not running yet"
    elif why_fixed:
        why = why_fixed
    else:
        return
    raise errors.Conflict(
        f"the ring of a replicated cluster (--replicas {replicas}) cannot change: members "
        f"{list(current.members)} with ring sizes {list(current.sizes)} would become {list(new.members)} with "
        f"{list(new.sizes)}; {why} (docs/replication.md, Changing the ring with R > 1)"
    )


@dataclass(frozen=True, slots=True)
class Place:
    membership: mb.Membership
    slot: int  # this broker's slot; -1: no member (removed, still running)
    source: str  # FLAGS or ADMIN

    @property
    def alone(self) -> bool:
        return len(self.membership.members) == 1 and self.slot == 0


def flags_of(config: BrokerConfig) -> str:
    return json.dumps([config.peers, config.ring_history, config.ordinal, config.advertised_address])


def from_flags(config: BrokerConfig) -> Place:
    found = membership_of(config)
    if found is None:
        return Place(mb.Membership.single(config.advertised_address), 0, FLAGS)
    return Place(found[0], found[1], FLAGS)


def encode(place: Place, config: BrokerConfig) -> str:
    return json.dumps({"membership": place.membership.to_json(), "slot": place.slot, "flags": flags_of(config)})


def decode(text: str, config: BrokerConfig) -> tuple[Place | None, int]:
    """The stored place, or None when it was set over other flags than this broker now has; and its epoch."""
    try:
        value = json.loads(text)
        membership = mb.Membership.from_json(value["membership"])
        if value["flags"] != flags_of(config):
            return None, membership.epoch
        return Place(membership, int(value["slot"]), ADMIN), membership.epoch
    except (ValueError, KeyError, TypeError) as exc:
        raise errors.InvalidArgument(f"the stored cluster membership is not readable: {exc}") from None


def _no_headers() -> tuple[tuple[str, str | bytes], ...]:
    return ()


class Cluster:
    def __init__(
        self,
        config: BrokerConfig,
        store: Store,
        dispatcher: Dispatcher,
        edge: Edge,
        *,
        admin_keys: tuple[str, str] | None,
        metrics: Metrics,
    ) -> None:
        self.config = config
        self._store = store
        self._dispatcher = dispatcher
        self._edge = edge
        self._admin_keys = admin_keys
        self._metrics = metrics
        self.place = from_flags(config)
        self.endpoint = config.advertised_address  # this broker's member endpoint, kept while it is no member
        self.confirmed_epoch = self.place.membership.epoch  # every send of an older epoch has finished
        self.incarnation = uuid.uuid4().hex  # this process's start (peers see a restart)
        self._peers: Peers | None = None
        self._calls: Calls | None = None
        self._changing = asyncio.Lock()
        self._refused_epoch = 0  # a peer's membership refused at --replicas > 1 (logged once per epoch)
        # Why this broker's ring cannot grow now ("": it can; None: replication not started; ``fixed_ring``)
        self.ring_fixed: Callable[[], str | None] = lambda: None
        # With replication: the slot a lite topic (its LMQ name) of this store belongs to, by its records
        # (``replication.owning.Slots.slot_of_topic``; blocking). It decides what a leaving broker drains and
        # whether this broker holds a topic as one slot (placement); None at --replicas 1: every topic here
        self.slot_of_topic: Callable[[str], int] | None = None
        self._serving = False  # the watch starts once this broker answers calls (``serve``)
        self._handing: asyncio.Task[None] | None = None
        # At --replicas 1, from the first time this broker leaves: its consumed topics handed over without waiting
        # for a send (``draining.hand_over_idle``; replication runs its own, of its slot's topics)
        self._idle_hand_over: asyncio.Task[None] | None = None
        # From the first time this broker leaves: its NORMAL topics' messages and dead letters copied to remaining
        # brokers (``relocating``)
        self.relocator = relocating.Relocator(
            store,
            self._store_relocated,
            config.max_body_bytes,
            metrics.registry,
            consumers=self.normal_consumers,
            committed=self._committed_groups,
        )
        self._relocating: asyncio.Task[None] | None = None
        # what leaving brokers relocate here (``StoreRelocated``)
        self.receiver = relocating.Receiver(store, dispatcher.run, dispatcher.ingest.append, dispatcher.metadata)
        self._relocation_source: str | None = None  # this broker as a leaving one, to a StoreRelocated receiver
        self._closing = asyncio.Event()
        self._copying: set[asyncio.Task[None]] = set()  # subscriptions copied to brokers that joined
        self._hop_server: local_hop.HopServer | None = None
        self._native: native_forward.NativeForwarding | None = None  # --native-forward: the edge's table

    @property
    def peers(self) -> Peers | None:
        """The peers this broker acts with; None while it runs alone."""
        return self._peers if self._edge.cluster is not None else None

    @property
    def membership(self) -> mb.Membership:
        return self.place.membership

    @property
    def slot(self) -> int:
        return self.place.slot

    async def start(self) -> None:
        """The stored membership when it was set over the flags this broker has now, else the flags' (at an
        epoch past the stored one: the epoch never goes back); the flags' also when the stored one names this
        broker no more (removed by a scale-down) and the flags do (a scale-up brought it back)."""
        text = await asyncio.to_thread(self._store.get_membership)
        stored, stored_epoch = decode(text, self.config) if text is not None else (None, 0)
        if stored is not None and stored.slot < 0 <= self.place.slot:
            # Removed from the ring by a scale-down (its disk kept), started again by a scale-up whose flags make
            # it a member again (the same flags as when it first joined): it joins as a new pod does, from the
            # flags at their epoch, until the membership source tells it the grown ring
            log.warning("this broker was removed from the ring and its flags make it a member again: flags win")
            stored, text = None, None
        place = stored or self.place
        if text is not None and stored is None:
            log.warning("the flags changed since the cluster membership was last set over the admin service: flags win")
            if place.membership.epoch <= stored_epoch:
                place = Place(place.membership.at(stored_epoch + 1), place.slot, place.source)
        self._apply(place)
        self.confirmed_epoch = place.membership.epoch

    async def listen_locally(self, admission: Admission) -> None:
        """The local hop (``--processes``): this pod's other processes send this one their forwarded sends over a
        Unix socket, served as peers' copies (a broker that runs alone now stores them, as its gRPC edge does)."""
        config = self.config
        if config.local_hop != LocalHop.SOCKET or config.local_hop_dir is None:
            return
        path = local_hop.socket_path(config.local_hop_dir, self.endpoint)
        if path is None:
            log.warning("the local hop socket path is too long for a Unix socket: this pod's processes use gRPC")
            return
        edge = self._edge

        async def send(request: spb.SendMessageRequest, data: bytes) -> spb.SendMessageResponse:
            peers = self.peers
            if peers is None:
                return await send_message.handle(edge, request)
            return await peers.forwarder.send(request, peer_copy=True, data=data)

        refusals = RefusalLog()

        async def client_send(data: bytes) -> spb.SendMessageResponse:
            """A client's send a sibling's native edge forwarded as it came: answered as this broker's client port
            answers it (``native_forward``; the port's admission is the hop server's)."""
            sent = guard.decode_send(data)
            if isinstance(sent, str):
                return spb.SendMessageResponse(status=pb.Status(code=pb.BAD_REQUEST, message=sent))
            try:
                calls = self._calls if self._edge.cluster is not None else None
                if calls is None:
                    return await send_message.handle(edge, sent.request)
                return await calls.send(sent.request, _no_headers, sent.data)  # a client's: no peer header
            except errors.LmqError as exc:
                refused = status.status_of(exc)
                if refused.code != pb.INTERNAL_ERROR and not isinstance(exc, errors.BrokerUnavailable):
                    refusals.note("SendMessage", refused.code, refused.message)
                raise

        secret = trust.secret_of(config.cluster_secret, self._admin_keys[1] if self._admin_keys is not None else "")
        clients = None if config.acl or config.access_key else client_send  # a signature to check: never natively
        server = local_hop.HopServer(path, secret, send, admission, self._metrics, self._metrics.registry, clients)
        await server.start()
        self._hop_server = server

    def forward_natively(self, edge: native_forward.Edge) -> None:
        """``--native-forward on`` with the native edge: keep ``edge``'s forwarding table (``native_forward``)."""
        if not native_forward.wanted(self.config):
            return
        secret = trust.secret_of(
            self.config.cluster_secret, self._admin_keys[1] if self._admin_keys is not None else ""
        )
        self._native = native_forward.NativeForwarding(edge, self.config, secret, self._plain)
        self._native.start()

    def _plain(self) -> tuple[mb.Membership, int] | None:
        """The membership and this broker's slot while placement is plain (``native_forward.plain``), else None."""
        peers = self._peers
        if peers is None or self._edge.cluster is None or self.place.alone:
            return None
        if not native_forward.plain(self.membership, self.slot, peers.owners.handed_over):
            return None
        return self.membership, self.slot

    def serve(self) -> None:
        """This broker answers calls now: its peers are watched (and told at once that it is up)."""
        self._serving = True
        if self._peers is not None:
            self._peers.watch.start()

    def heard_from(self, caller: str, incarnation: str) -> None:
        """A peer asked this broker (``watch``): when it restarted, it is given its subscriptions at once."""
        if self._peers is not None and self._edge.cluster is not None:
            self._peers.watch.heard_from(caller, incarnation)

    async def change(self, place: Place) -> bool:
        """Store ``place`` (synced), then apply it; return once this broker confirms its epoch. False when it is
        the current one. A smaller epoch than the current one, or the same epoch with another ring, is refused."""
        async with self._changing:
            current = self.place
            new = place.membership
            if new.epoch < current.membership.epoch or (
                new.epoch == current.membership.epoch and new != current.membership
            ):
                raise errors.Conflict(
                    f"membership epoch {new.epoch} is older than this broker's {current.membership.epoch} (or the "
                    "same epoch with other members): a newer change has been applied here"
                )
            if (new, new.epoch, place.slot) == (current.membership, current.membership.epoch, current.slot):
                return False
            fixed_ring(self.config.replicas, current.membership, new, self.ring_fixed())
            await asyncio.to_thread(self._store.put_membership, encode(place, self.config))
            self._apply(place)
        if self._peers is not None:
            await self._peers.forwarder.finish_before(new.epoch)
        self.confirmed_epoch = max(self.confirmed_epoch, new.epoch)
        return True

    def next_epoch(self, membership: mb.Membership, slot: int) -> mb.Membership:
        """``membership`` without an epoch of its own (a ``SetCluster`` that gives none): the current epoch when
        it is the current ring, else the next one."""
        current = self.place
        if membership == current.membership and slot == current.slot:
            return membership.at(current.membership.epoch)
        return membership.at(current.membership.epoch + 1)

    async def adopt(self, membership: mb.Membership) -> None:
        """A peer's newer membership: applied here, this broker's slot found by its advertised address or its
        endpoint in the current membership."""
        if membership.epoch <= self.membership.epoch:
            return
        slot = membership.members.index(self.endpoint) if self.endpoint in membership.members else -1
        try:
            await self.change(Place(membership, slot, ADMIN))
        except errors.Conflict as exc:  # a newer one arrived meanwhile, or another ring at --replicas > 1
            if self.config.replicas > 1 and self._refused_epoch != membership.epoch:
                self._refused_epoch = membership.epoch
                log.warning("a peer's membership (epoch %d) not taken: %s", membership.epoch, exc.message)

    def _apply(self, place: Place) -> None:
        peers = self._peers
        was_leaving = self.slot >= 0 and self.membership.leaving(self.slot) and self._edge.cluster is not None
        before = frozenset(self.membership.members) if self.slot >= 0 and self._edge.cluster is not None else None
        sizes_before = self.membership.sizes
        self.place = place
        membership, me = place.membership, place.slot
        if me >= 0 and membership.members[me]:
            self.endpoint = membership.members[me]
        if place.alone:
            self._edge.cluster = None
            if peers is not None:
                peers.apply(membership, me, told=place.source == ADMIN)
        else:
            if peers is None:
                peers = self._peers = self._build()
                peers.apply(membership, me, told=place.source == ADMIN)
                if self._serving:
                    peers.watch.start()
            else:
                peers.apply(membership, me, told=place.source == ADMIN)
            self._edge.cluster = self._calls
        if peers is not None and not place.alone:
            if me >= 0 and membership.leaving(me) and not was_leaving and self._handing is None:
                self._handing = asyncio.get_running_loop().create_task(self._subscribe_at_owners())
            if me >= 0 and membership.leaving(me) and self.config.replicas <= 1 and self._idle_hand_over is None:
                idle = draining.hand_over_idle(peers.handoff, self._store, self._leaving_slot, self._closing)
                self._idle_hand_over = asyncio.get_running_loop().create_task(idle, name="lmq-hand-over-idle")
            if (me < 0 or membership.leaving(me)) and self._relocating is None:
                moving = self.relocator.run(self._leaving_ring, self._closing)
                self._relocating = asyncio.get_running_loop().create_task(moving, name="lmq-relocate")
            if me >= 0 and before is not None and sizes_before != membership.sizes:
                peers.watch.ring_changed()
            joined = [s for s, member in enumerate(membership.members) if before is not None and member not in before]
            if joined and me >= 0:
                task = asyncio.get_running_loop().create_task(self._subscribe_at_owners(joined))
                self._copying.add(task)
                task.add_done_callback(self._copying.discard)
        if self._native is not None:  # the native edge's table follows the membership at once
            self._native.push()
        where = f"slot {me}" if me >= 0 else "no member"
        members = ", ".join(m for m in membership.members if m) or "this broker alone"
        log.info(
            "cluster (%s): %s of %d (ring of %d, epoch %d, %d leaving): %s",
            place.source,
            where,
            len(membership.members),
            membership.size,
            membership.epoch,
            len(membership.leaving_slots),
            members,
        )

    def _leaving_slot(self) -> int:
        """This broker's slot while it is a leaving member of a cluster, else -1."""
        me = self.slot
        leaving = me >= 0 and self._edge.cluster is not None and self.membership.leaving(me)
        return me if leaving else -1

    def _leaving_ring(self) -> int:
        """Today's ring size while this broker is a leaving member of a cluster, or no member (removed, still
        running: a dead letter stored after its last drained check is copied too), else 0."""
        leaving = self._leaving_slot() >= 0 or (self.slot < 0 and self._edge.cluster is not None)
        return self.membership.size if leaving else 0

    def normal_consumers(self) -> dict[str, set[str]]:
        """On the loop. NORMAL topic -> the groups of the consumers that told this broker they consume it (their
        Telemetry settings; the clients it remembers), for what a leaving broker copies (``relocating``)."""
        out: dict[str, set[str]] = {}
        for client in self._dispatcher.registry.clients():
            if client.group:
                for topic in client.topics:
                    out.setdefault(topic, set()).add(client.group)
        return out

    async def _store_relocated(self, slot: int, messages: Sequence[model.StoredMessage]) -> None:
        """``messages`` stored at slot ``slot`` of today's ring (``relocating``), durably once this returns."""
        peers = self.peers
        if peers is None or slot == peers.me:
            raise errors.BrokerUnavailable(f"slot {slot} is no remaining broker of this one's cluster")
        member = peers.membership.members[slot]
        stub, metadata = peers.admin(member, "StoreRelocated")
        wire = [relocating.to_wire(m) for m in messages]
        if self._relocation_source is None:  # its offsets are of this data directory: a new one starts at 0 again
            store_id = await self._dispatcher.run(self._store.store_id)
            self._relocation_source = f"{self.endpoint}/{store_id}"
        request = admin_pb.StoreRelocatedRequest(messages=wire, source=self._relocation_source)
        try:
            await stub.StoreRelocated(request, metadata=metadata, timeout=RELOCATE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            failed = errors.BrokerUnavailable
            if exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                failed = relocating.Unanswered  # it may have stored them
            raise failed(f"{member}: {exc.code().name} {exc.details()}") from None

    async def _committed_groups(self, topics: Collection[str]) -> relocating.Consumers | None:
        """The groups with a commit point in ``topics`` at every other member (``relocating``); None when one
        did not answer."""
        peers = self.peers
        if peers is None:
            return None
        others = [m for slot, m in enumerate(peers.membership.members) if m and slot != peers.me]
        out: dict[str, set[str]] = {}
        for member in others:
            stub, metadata = peers.admin(member, "CommittedGroups")
            request = admin_pb.CommittedGroupsRequest(topics=topics)
            try:
                answer = await stub.CommittedGroups(request, metadata=metadata, timeout=COMMITTED_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                log.info("%s did not say which groups consume NORMAL topics there: %s", member, exc.code().name)
                return None
            for item in answer.topics:
                out.setdefault(item.topic, set()).update(item.groups)
        return out

    async def store_relocated(self, messages: Sequence[admin_pb.RelocatedMessage], source: str = "") -> int:
        """A leaving broker's messages of NORMAL topics and dead letters (``relocating``): appended here, all or
        nothing, no quota applied (they were accepted once already); returns how many. With ``source`` (one
        queue's batch from that broker), what this broker stored of that queue before (a retried batch) is not
        stored again: how far it got is recorded (synced) after the append, before the answer, and one batch
        per queue and source is stored at a time (``relocating.Receiver``, which finishes a cancelled call's)."""
        return await self.receiver.receive(messages, source)

    def _build(self) -> Peers:
        config = self.config
        admin_secret = self._admin_keys[1] if self._admin_keys is not None else ""
        edge = self._edge
        peers = Peers(
            config,
            incarnation=self.incarnation,
            secret=trust.secret_of(config.cluster_secret, admin_secret),
            admin_keys=self._admin_keys,
            holds_locally=self._holds_locally,
            drained_locally=self._drained_locally,
            subscribers=self._subscribers,
            known=lambda client_id: self._dispatcher.client_state(client_id) is not None,
            store_here=lambda messages: send_message.store(edge, messages),
            adopt=self.adopt,
            registry=self._metrics.registry,
        )
        self._calls = Calls(edge, peers, self._metrics.registry)
        return peers

    async def _holds_locally(self, slot: int, parent: str, lite: str) -> bool:
        """Whether this broker holds ``lite`` as ``slot``: it has the topic, and with replication its records name
        that slot (a copy kept as another slot's follower is not held as this one)."""
        of = self.slot_of_topic

        def held() -> bool:
            if self._store.lite_topic(parent, lite) is None:
                return False
            return of is None or of(model.QueueId.lmq(parent, lite).topic) == slot

        return await self._dispatcher.run(held)

    async def _drained_locally(self, parent: str, lite: str) -> bool:
        return await self._dispatcher.run(draining.drained, self._store, parent, lite)

    async def _subscribe_at_owners(self, joined: list[int] | None = None) -> None:
        """Subscriptions this broker has to topics it does not hold (topics not created yet) are made at their
        owners in today's ring, where those topics will be created: all of them when this broker just became a
        leaving one (its own topics take theirs along when they move), those owned by ``joined`` when brokers
        just joined, which also get every client's patterns (a pattern is on every broker). Failures only
        delay: the clients sync every subscription periodically (Python and Java every 30 s)."""
        try:
            wanted: dict[tuple[str, str, str], tuple[list[str], list[str]]] = {}
            for state in list(self._dispatcher.client_states()):
                for lmq in list(state.lite_topics):
                    parent, lite = model.QueueId(lmq).lite_parts()
                    wanted.setdefault((state.client_id, state.group, parent), ([], []))[0].append(lite)
                if joined and state.patterns and state.group and state.bind_topic:
                    key = (state.client_id, state.group, state.bind_topic)
                    wanted.setdefault(key, ([], []))[1].extend(state.patterns)

            def not_held() -> list[Subscription]:
                out = []
                for (client_id, group, parent), (lites, patterns) in wanted.items():
                    missing = [lite for lite in lites if self._store.lite_topic(parent, lite) is None]
                    if missing or patterns:
                        out.append((client_id, group, parent, missing, patterns))
                return out

            found = await self._dispatcher.run(not_held)
            peers = self._peers
            if found and peers is not None:
                failed = await peers.fanout.subscribe_at_owners(found, joined)
                if failed:
                    log.warning("%d subscriptions not copied to new owners: the clients' next sync makes them", failed)
        except Exception:
            log.exception("copying subscriptions to the new owners failed: clients' next sync makes them")
        finally:
            if joined is None:
                self._handing = None

    def _subscribers(self, parent: str, lite: str) -> list[tuple[str, str]]:
        out = []
        for client_id in self._dispatcher.subscribers(model.QueueId.lmq(parent, lite)):
            state = self._dispatcher.client_state(client_id)
            if state is not None and state.group:
                out.append((client_id, state.group))
        return out

    async def close(self) -> None:
        self._closing.set()
        for task in (self._idle_hand_over, self._relocating):
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
        self._idle_hand_over = self._relocating = None
        if self._native is not None:
            await self._native.close()
            self._native = None
        if self._hop_server is not None:
            await self._hop_server.close()
            self._hop_server = None
        if self._handing is not None or self._copying:
            await asyncio.gather(*filter(None, (self._handing, *self._copying)), return_exceptions=True)
        self._edge.cluster = None
        if self._peers is not None:
            await self._peers.close()
            self._peers = None
