"""Replication's place in a broker: which slots it follows, its lease loop, the copy calls between brokers.

Copies travel as raw bytes (``wire``) on the broker's client port, over the cluster's channels, signed with the
peer header (``cluster.trust``) like every call between brokers; a call without a valid header is refused.
Message copies and commit copies go over one stream per follower (``streams``: a call set-up per copy was most
of a follower's CPU) in ``wire``'s binary layout. A follower of an older version has no binary stream
(UNIMPLEMENTED): it gets the JSON layout, over its stream or, without one, one unary call per copy; the binary
stream is tried again every ``BINARY_RETRY_S`` (the follower may have been upgraded since).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import grpc
from prometheus_client import CollectorRegistry, Counter

from lmq_broker import errors, model
from lmq_broker.admin import expiry
from lmq_broker.cluster import draining, trust
from lmq_broker.cluster import membership as mb
from lmq_broker.cluster.peers import Peers
from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch.dispatcher import Dispatcher
from lmq_broker.mqtt.durable import Durable
from lmq_broker.replication import (
    copies,
    divergence,
    events,
    following,
    gauges,
    handover,
    kube,
    moved,
    owning,
    reconciling,
    replicas,
    sockets,
    sources,
    stamps,
    stating,
    streams,
    wire,
)
from lmq_broker.replication.leadership import InSync, Leadership, identity
from lmq_broker.storage.api import Store

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    _GenericHandler: TypeAlias = grpc.GenericRpcHandler[Any, Any]
else:
    _GenericHandler = grpc.GenericRpcHandler

SERVICE: Final = "/lmq.replica.v1.Replica/"
METHOD: Final = SERVICE + "Append"  # a copy (wire) -> b"" stored, or JSON {topic: end} where this broker is behind
STREAM: Final = SERVICE + "AppendStream"  # copies -> their answers, as ``METHOD``'s (``streams`` frames them)
STREAM_BINARY: Final = SERVICE + "AppendStreamBinary"  # as ``STREAM``; its follower reads the binary layout
COPY_SOCKET: Final = SERVICE + "CopySocket"  # b"" -> the port of this broker's copy socket (``sockets``), b"": none
BINARY_RETRY_S: Final = 60.0  # a follower without ``STREAM_BINARY`` gets JSON this long, then it is asked again
ENDS: Final = SERVICE + "Ends"  # JSON {"slot"} -> JSON {topic: end} of the holder's lite topics of the slot
FETCH: Final = SERVICE + "Fetch"  # JSON {"slot", "topic", "from", "layout"?} -> a copy (wire) of what follows
STATES: Final = SERVICE + "States"  # a batch of state rows (``states``) -> b"" applied, b"behind": not the next
STATE_FETCH: Final = SERVICE + "StateFetch"  # JSON {"slot"} -> every state row of the slot (``states``, full)
# JSON {"slot", "epoch", "topics": {topic: epoch of a replica's last record}} -> JSON {topic: [epoch|null, offset]}
DIVERGE: Final = SERVICE + "Diverge"
# JSON {"slot", "topic", "leaving"} -> b"": the holder of ``slot`` took the drained lite topic over from the leaving
# slot (``Replication.adopt``), before its holder sends it the topic's next message (``cluster.draining``)
ADOPT: Final = SERVICE + "Adopt"
DIVERGE_TOPICS: Final = 1_000  # topics per Diverge call
ENDS_SCAN: Final = 10_000  # lite topics of the holder's store one Ends call looks through (a page)
CALL_TIMEOUT_S: Final = 2.0
# Ends, Fetch and StateFetch while reconciling: off the acknowledgement path, each a bounded page of work, so a
# holder that is loaded but alive answers within it; one that is down fails at once (not waited for)
RECONCILE_TIMEOUT_S: Final = 10.0
IDENTITY_FILE: Final = "replica-identity"
FAILPOINT_ENV: Final = "LMQ_FAILPOINT_LOSE_COPIES"
FAILPOINT_RECONCILE_ENV: Final = "LMQ_FAILPOINT_FAIL_RECONCILE"


def check(config: BrokerConfig) -> None:
    """Refuse settings that cannot keep their promise (at start)."""
    if config.min_insync_replicas > config.replicas:
        raise errors.InvalidArgument(
            f"--min-insync-replicas {config.min_insync_replicas} exceeds --replicas {config.replicas}"
        )
    if config.replicas > 1 and not config.lease_namespace:
        raise errors.InvalidArgument(
            "--replicas above 1 needs --lease-namespace: without Kubernetes Leases nothing decides which replica "
            "owns a slot (outside Kubernetes a cluster runs with --replicas 1; docs/replication.md)"
        )


def one_ring(replicas: int, membership: mb.Membership, why_fixed: str = "") -> None:
    """Refuse, at --replicas above 1, a ring whose history this broker cannot follow: a history (a ring change
    behind it, or slots leaving) while a lite topic of its store names no slot on its last record (``why_fixed``,
    from ``stamps``): a topic placed by an older ring stays on a slot that is not its slot in today's ring, and
    only its records say which (docs/replication.md, *Changing the ring with R > 1*)."""
    if replicas <= 1:
        return
    if len(set(membership.sizes)) > 1 and why_fixed:
        raise errors.InvalidArgument(
            f"--replicas {replicas} needs every lite topic to record its slot when the ring has a history (ring "
            f"sizes {list(membership.sizes)}: --ring-history, or a membership set since): {why_fixed} "
            "(docs/replication.md, Changing the ring with R > 1); run this ring at --replicas 1"
        )


def _stamps(config: BrokerConfig, store: Store, membership: mb.Membership) -> stamps.Stamps:
    """Whether every lite topic of ``store`` records its slot; the start refused when its ring needs that."""
    found = stamps.Stamps(store, config.store.data_dir)
    one_ring(config.replicas, membership, found.why_fixed())
    return found


def idle_gauges() -> gauges.Collector:
    """The replication gauges of a broker at --replicas 1: declared, without samples."""
    return gauges.Collector(1)


followers_of = replicas.followers_of
forget_stamps = stamps.forget  # a start at --replicas 1 (app)


def _failpoint(env: str = FAILPOINT_ENV) -> Callable[[], bool] | None:
    """Tests with broker processes: while the file ``$LMQ_FAILPOINT_LOSE_COPIES`` names exists, this broker's
    follower loses every copy of messages sent to it (as if the network dropped it: the owner's send is refused
    and the owner keeps what it stored); while ``$LMQ_FAILPOINT_FAIL_RECONCILE``'s exists, every reconcile it
    tries fails (as a call that timed out would). Unset (always, outside tests): no check at all."""
    path = os.environ.get(env)
    if not path:
        return None
    return lambda: os.path.exists(path)


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
        self.stamps = _stamps(config, store, links.membership)
        processes = config.pod_processes
        api = kube.ApiServer.of(
            config.kube_api_server, config.kube_token_file, config.kube_ca_file, config.lease_namespace
        )
        replica_sets = replicas.sets_of(links.membership, processes, config.replicas)
        self._links = links
        self._api = api
        self._counters = copies.Counters(registry)
        self.ack_refused = self._counters.ack_refused  # ``dispatch.settlement.copy_refused``
        self.follower: following.Follower | None = None
        self.leadership = Leadership(
            api,
            identity_of(config, me),
            me,
            replica_sets,
            lambda slot, epoch: self.follower is not None and self.follower.in_sync(slot, epoch),
            prefix=config.lease_prefix,
            duration_ms=config.lease_duration_ms,
            min_insync=config.min_insync_replicas or config.replicas,
        )

        async def stored_id(queue: model.QueueId, offset: int) -> str | None:
            found = await asyncio.to_thread(store.read, queue, offset, 1)
            return found[0].message_id if found and found[0].offset == offset else None

        self._cuts, copied, stores = _follower_counters(registry)

        async def append_copy(messages: Sequence[model.NewMessage]) -> list[model.AppendResult]:
            results = await dispatcher.ingest.append_copy(messages)
            self.slots.note(messages)
            self.stamps.note(messages)
            copied.inc(len(messages))
            stores.inc()
            return results

        self.follower = follower = following.Follower(
            self.leadership,
            append_copy,
            lambda q: store.queue_offsets(q)[1],
            stored_id,
            functools.partial(_store_commit, store, dispatcher),
            self._counters,
            _Local(store, dispatcher, lambda t: self.slots.followed_slot(t), self._cuts, self._forget),  # noqa: PLW0108 (slots: below)
            self._diverge,
            _failpoint(),
            functools.partial(_expire_copy, store, dispatcher, config.lite_ttl_min_age_ms),
        )
        self._store = store
        min_insync = config.min_insync_replicas or config.replicas

        def owner(slot: int) -> copies.Owner:
            endpoints = self._followers(slot)
            read = lambda queue, offset, n: asyncio.to_thread(store.read, queue, offset, n)  # noqa: E731
            tails = lambda: asyncio.to_thread(sources.tails, store, slot, self.slots.slot_of_topic)  # noqa: E731
            points = lambda: asyncio.to_thread(sources.points, store, slot, self.slots.slot_of_topic)  # noqa: E731
            return copies.Owner(
                self.leadership,
                slot,
                endpoints,
                min_insync,
                (self.send, read, tails, points),
                self._counters,
                queue_messages=config.replica_queue_messages,
                lag_max_s=config.replica_lag_max_ms / 1000,
                probe_interval_s=config.lease_duration_ms / 3000,
            )

        self.moved = taken = moved.Moved(config.store.data_dir)  # topics taken over from leaving slots
        self.slots = owning.Slots(
            self.leadership,
            lambda topic: mb.owner(links.membership, topic),
            owner,
            lambda topic: taken.slot_of(topic, *sources.last_record(store, topic)),
            lambda: len(links.membership.members),
            moved=taken.slot_of,
        )
        peers.owners.serving = self.leadership.serving
        self.handover = handover.Handover(self.leadership.serving, slots, peers.fanout.repush)
        self.mqtt: Callable[[], Durable | None] = lambda: None  # the MQTT listener's store, once it runs (app)
        self.states = stating.States(
            self.leadership,
            self.slots.slot_of_topic,
            dispatcher.export_subscriptions,
            dispatcher.restore_subscriptions,
            lambda: dispatcher.registry.version,
            lambda: self.mqtt(),  # noqa: PLW0108 (set by the app once MQTT runs)
            dispatcher.wall_clock,
        )
        registry.register(stating.Collector(self.states))
        self.states.on_stale, self.states.moved, self.states.moved_in, self.states.refused = (
            self._not_in_sync,
            taken,
            self._moved_in,
            lambda reason: self._counters.copies_refused.labels(reason).inc(),
        )
        self._replica_sets = replica_sets
        self._processes, self._replicas = processes, config.replicas
        self._min_insync = config.min_insync_replicas or config.replicas
        peers.changed, peers.forwarder.adopt, peers.handoff.taken_over = self.rebuild, self.adopt, self.hand_over
        self.copy_links: dict[str, streams.Link] = {}  # follower endpoint -> the stream its binary copies take
        self.json_links: dict[str, streams.Link] = {}  # follower endpoint -> its stream of JSON copies (older)
        # The copy sockets (``sockets``): not with TLS, which they do not carry (copies stay on the TLS channels)
        self.sockets = (
            sockets.Sockets(
                (config.host, config.replica_port),
                links.secret,
                self._accept,
                (self._counters.copies_refused.labels("not_peer"), self._counters.copies_refused.labels("crowded")),
                self._copy_socket_of,
                self._hello,
            )
            if config.replica_port >= 0 and config.tls_cert is None
            else None
        )
        self.methods = frozenset(
            (METHOD, STREAM, STREAM_BINARY, COPY_SOCKET, ENDS, FETCH, STATES, STATE_FETCH, DIVERGE, ADOPT)
        )
        self._shipping: asyncio.Task[None] | None = None
        self._secret = links.secret
        self._stopping = events.Signal()  # ``events.nap`` wakes on it without a task
        self._task: asyncio.Task[None] | None = None
        self._reconciling: asyncio.Task[None] | None = None
        self.reconciler = reconciling.Reconciler(
            self.leadership,
            follower,
            self._reconcile,
            registry,
            config.lease_duration_ms / 3000,
            _failpoint(FAILPOINT_RECONCILE_ENV),
        )
        self._handing: asyncio.Task[None] | None = None
        # topics of a leaving slot taken over (``adopt``), one at a time, and how many since start; follower
        # endpoint -> when to ask for its binary stream again; a leaving slot's hand-overs (``draining.hand_over_idle``)
        self._adopting, self.adopted, self._json_until = asyncio.Lock(), 0, dict[str, float]()
        self._handoff, self._sweeping = peers.handoff, list[asyncio.Task[None]]()
        self._interval_s = config.lease_duration_ms / 3000
        registry.register(gauges.Collector(config.replicas, self.leadership, lambda: self.follower, lambda: self.slots))

    def _followers(self, slot: int) -> dict[int, str]:
        """The endpoints a holder of ``slot`` copies to: its replicas but this broker, by the in-sync sets as
        last read (not the sets of the last rebuild: a slot taken at start must not copy to, and probe back
        in, a replica its set no longer names)."""
        membership, me = self._links.membership, self.leadership.me
        sets = replicas.sets_of(membership, self._processes, self._replicas, self.leadership.in_sets)
        return {s: membership.members[s] for s in sets[slot] if s != me}

    def rebuild(self, membership: mb.Membership, me: int) -> None:
        """A membership applied (``cluster.peers.Peers.apply``): every slot's replicas computed again from it
        (``replicas.sets_of``: during a change, the union of the ring before and after), and everything that
        follows from them made to match: the slots this broker follows and may take (``Leadership``), the
        followers its held slots copy to (a new one is probed into the in-sync set before a send waits for it),
        the followers of its state rows (read from the sets each batch), each slot's serving broker checked
        for handovers, and the ring slot of topics without a recorded slot. A replica that is no longer one
        keeps its copies. Run again after each lease tick (``_after_tick``): a slot whose lease names exactly its
        new-ring replicas has those only. A replicated ring grows, or has its last slots marked leaving and then
        removed (``cluster.setup.fixed_ring``); a new epoch of the same ring changes nothing here."""
        if me != self.leadership.me:
            log.warning(
                "replication: this broker is slot %d in the new membership, was %d: not rebuilt", me, self.leadership.me
            )
            return
        # A pod being removed (its slot leaving) hands the slots that stay over and takes none (step 5)
        self.leadership.may_take = membership.leaving if membership.leaving(me) else _any_slot
        sets = replicas.sets_of(membership, self._processes, self._replicas, self.leadership.in_sets)
        if sets == self._replica_sets:
            return
        self._replica_sets = sets
        self.leadership.follow(sets)
        self.slots.ring_changed()
        self.states.forget_slots()
        self.handover.resize(len(sets))
        for slot, owner in self.slots.owners().items():
            owner.follow(self._followers(slot))
        log.info("replication: replica sets rebuilt for ring epoch %d: %s", membership.epoch, sets)

    async def _after_tick(self) -> None:
        """Steps 4 and 5 of a ring change, after each lease tick. A broker whose slot is leaving releases the
        leases it holds of slots that stay (``Leadership.release``: a replica in the set takes each at once), and
        so does one holding a slot of which it is no new-ring replica once they are all in its set (at M = R). A
        held slot whose in-sync set holds every replica of the new ring gets the set without the others (a lease
        write, never below --min-insync-replicas); then the replica sets follow the sets just read or written,
        and each held slot stops copying to replicas it no longer has (they are out of the set by then: nothing
        waits for them). Outside a ring change the new ring's replicas are all there are: nothing is written."""
        membership, me = self._links.membership, self._links.me
        if me != self.leadership.me:
            return
        if membership.leaving(me):  # step 5: this pod is being removed; the slots that stay are handed over
            for slot in self.leadership.held():
                if not membership.leaving(slot):
                    await self.release(slot)
        targets = replicas.targets_of(membership, self._processes, self._replicas)
        every_member_acks = self._min_insync >= self._replicas
        for slot in self.leadership.held():  # step 5: a slot a failover gave this broker, none of its new replicas
            if slot < len(targets) and replicas.hands_over(
                targets[slot], self.leadership.in_sync(slot), me, every_member_acks
            ):
                await self.leadership.release(slot)
                log.info("slot %d: released to its new ring's replicas %s (this broker is none)", slot, targets[slot])
        for slot in self.leadership.held():
            if slot < len(targets):
                target = targets[slot]
                if replicas.narrowed(target, self.leadership.in_sync(slot), self._min_insync, me) is not None:
                    written = await self.leadership.record(slot, functools.partial(self._narrowed, target))
                    log.info("slot %d: in-sync set narrowed to the new ring's replicas: %s", slot, written)
        self.rebuild(membership, me)
        for slot, owner in self.slots.owners().items():
            if self.leadership.holds(slot):
                await owner.unfollow(set(owner.followers) - set(self._followers(slot)))

    async def release(self, slot: int) -> bool:
        """``Leadership.release``, the copies still queued for the in-sync set stored there first (bounded by the
        copy timeout and half a lease: a taker finds them all, also at --min-insync-replicas 1)."""
        owner = self.slots.owners().get(slot)
        if owner is None:  # nothing was ever copied under it here
            return await self.leadership.release(slot)
        drain_s = min(copies.ACK_TIMEOUT_S, self._interval_s * 3 / 2)
        return await self.leadership.release(slot, lambda epoch, members: owner.drain(epoch, members, drain_s))

    async def adopt(self, topic: str, leaving: int, slot: int) -> None:
        """A lite topic of the leaving slot ``leaving`` handed over to this broker, the holder of ``slot``, its
        owner in today's ring (the leaving holder found it drained: ``hand_over``; Fenced unless this broker holds
        ``slot``). Its log goes on here where it ends there, so every replica of ``slot`` agrees on its offsets
        and its consumers' commit points go on: what this broker lacks of it (all of it, unless it follows the
        leaving slot) is fetched from that slot's holder with the commit points; then the topic as this broker
        has it is copied to ``slot``'s followers (those that follow the leaving slot have it: passed over), then
        its commit points; only then is its slot this broker's (``Slots.adopt``): its next message is stamped
        with it. A failure on the way (a follower down at --min-insync-replicas R) leaves it as it was, to be
        tried again. Storing the topic afresh at offset 0 instead (as at --replicas 1) would put other messages
        at offsets where ``slot``'s followers hold the leaving slot's copies, and a broker that follows the
        leaving slot would find the topic recorded under a slot whose lease it does not hold (docs/replication.md,
        *Changing the ring with R > 1*)."""
        owner = self.slots.owner(slot)
        async with self._adopting:
            owner.admit()
            if await asyncio.to_thread(self.slots.recorded, topic) == slot:
                if self.moved.left(topic) == leaving:  # taken over idle: its row on the followers too (a retry)
                    await self._write_down(topic, leaving, slot, wait=True)
                return
            holder, queue, store = self.leadership.serving(leaving), model.QueueId(topic, 0), self._store
            if holder != self._links.me:
                assert self.follower is not None
                while True:
                    start = (await asyncio.to_thread(store.queue_offsets, queue))[1]
                    if not await self.follower.take_over(await self._fetch(holder, leaving, topic, start)):
                        break
            start = (await asyncio.to_thread(store.queue_offsets, queue))[0]
            while True:
                messages, results = await asyncio.to_thread(sources.page, store, topic, start)
                if not messages:
                    break
                await owner.copy(messages, results)
                start = results[-1].queue_offsets[0] + 1
            groups = [g.name for g in await asyncio.to_thread(store.list_groups)]
            for point in await asyncio.to_thread(sources.points_of, store, topic, groups):
                noted = owner.note_commit(point)
                if noted is not None:
                    await noted
            await self._write_down(topic, leaving, slot, wait=True)
            self.slots.adopt(topic, slot)
            self.adopted += 1
            log.info("lite topic %s: taken over from leaving slot %d (held by %d) as slot %d's", topic, leaving,
                     holder, slot)  # fmt: skip

    async def _write_down(self, topic: str, leaving: int, slot: int, *, wait: bool) -> None:
        """A topic of ``leaving`` taken over by ``slot``: when its last record here still names ``leaving`` (taken
        over idle), the take-over written down for good (``moved``) and shipped as a state row of the slots this
        broker holds (at the next look); with ``wait``, until their in-sync followers hold it
        (``errors.BrokerUnavailable`` after the flush timeout: the take-over is tried again). A later scale-up
        that brings ``leaving`` back does not file the topic under it then."""
        recorded, last = await asyncio.to_thread(sources.last_record, self._store, topic)
        if recorded != leaving:
            return  # a record stored under ``slot`` since names it
        if await asyncio.to_thread(self.moved.put, topic, moved.Move(leaving, slot, last)):
            self.slots.forget(topic)
        if wait and not await self.states.flushed(own=False):
            raise errors.BrokerUnavailable(
                f"lite topic {topic}: its take-over from slot {leaving} is not on slot {slot}'s in-sync replicas yet"
            )

    def _moved_in(self, topics: list[str]) -> None:
        for topic in topics:  # their slot is read again, with their take-over
            self.slots.forget(topic)

    def _leaves(self, topic: str) -> bool:
        """Whether a lite topic is of this broker's own (leaving) slot by its records, or was taken over from it:
        only those are handed over (again: found done)."""
        me = self._links.me
        return self.slots.slot_of_topic(topic) == me or self.moved.left(topic) == me

    async def hand_over(self, topic: str, leaving: int, slot: int) -> None:
        """At the holder of the leaving slot ``leaving``: its drained lite topic ``topic`` taken over by the holder
        of ``slot``, its owner in today's ring (``adopt`` there), before the topic counts as handed over and its
        next message is sent there (``cluster.draining``). A failure (that holder down, or not holding ``slot``
        any more) leaves the topic here: the send fails and is tried again."""
        holder = self.leadership.serving(slot)
        request = json.dumps({"slot": slot, "topic": topic, "leaving": leaving}).encode()
        if holder == self._links.me:
            await self.adopt(topic, leaving, slot)
        else:
            await self._call(holder, ADOPT, request, reconciling=True)
        # here too, and on this slot's followers: this pod, or a follower of its slot, may hold the slot again once
        # a later scale-up brings it back (its copies of the topic must not be taken for that slot's then)
        await self._write_down(topic, leaving, slot, wait=True)

    def _narrowed(self, target: list[int], now: InSync) -> InSync:
        return replicas.narrowed(target, now, self._min_insync, self.leadership.me) or now

    def _forget(self, topic: str) -> None:
        self.slots.forget(topic)

    def _not_in_sync(self, slot: int) -> None:
        if self.follower is not None:
            self.follower.out_of_sync(slot)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.sockets is not None:
            self.sockets.start()
        self._task = loop.create_task(self.leadership.run(self._stopping, self._after_tick), name="lmq-leases")
        self._reconciling = loop.create_task(self.reconciler.run(self._stopping, self._own), name="lmq-reconcile")
        self._handing = loop.create_task(self.handover.run(self._stopping, self._interval_s), name="lmq-handover")
        self._handoff.leaves = self._leaves  # a leaving slot hands over only its own topics
        me = self.leadership.me
        followers = lambda slot: [s for s in self._replica_sets[slot] if s != me]  # noqa: E731
        call = lambda slot, data: self._call(slot, STATES, data)  # noqa: E731
        self._shipping = loop.create_task(self.states.run(self._stopping, followers, call), name="lmq-states")
        # While this slot is leaving, its consumed topics are handed over without waiting for their next message
        # (``hand_over`` above), so a topic nobody sends to any more does not hold the scale-down up (its count in
        # ``undrained``); only this slot's own topics, by their records
        idle = draining.hand_over_idle(self._handoff, self._store, self._leaving_slot, self._stopping, self._of_slot)
        self._sweeping.append(loop.create_task(idle, name="lmq-hand-over-idle"))

    def _leaving_slot(self) -> int:
        membership, me = self._links.membership, self._links.me
        return me if me >= 0 and membership.leaving(me) else -1

    def _of_slot(self, me: int) -> Callable[[str], bool]:
        return lambda topic: self.slots.slot_of_topic(topic) == me

    async def close(self) -> None:
        self._stopping.set()
        await asyncio.gather(*self._sweeping, return_exceptions=True)
        if self._task is not None:
            await self._task
        self._api.close()  # the lease loop is done: its kept connections
        if self._shipping is not None:
            await self._shipping
        await self.states.close()
        if self._reconciling is not None:
            self._reconciling.cancel()
            await asyncio.gather(self._reconciling, return_exceptions=True)
        if self._handing is not None:
            await self._handing
        await self.handover.close()
        await self.slots.close()
        await asyncio.gather(*(link.close() for link in (*self.copy_links.values(), *self.json_links.values())))
        if self.sockets is not None:
            await self.sockets.close()

    def _own(self) -> None:
        for slot in self.leadership.held():
            self.slots.owner(slot)  # its shippers start probing the followers outside the in-sync set

    async def _reconcile(self, slot: int) -> bool:
        """One attempt (``reconciling``): the holder's state rows, then its lite topics' messages; True once in
        sync, False when to be done again (no holder known, it changed, or the slot fell out of sync meanwhile:
        a copy found it behind, a batch of state rows missed)."""
        leadership, follower = self.leadership, self.follower
        assert follower is not None
        mark = follower.mark(slot)
        holder = leadership.serving(slot)
        if holder == leadership.me or slot not in leadership.holders:
            return False
        await self.states.fetch(slot, holder, self._state_fetch)
        return await follower.reconcile(slot, self._ends, self._fetch, since=mark)

    async def _call(self, slot: int, method: str, data: bytes, *, reconciling: bool = False) -> bytes:
        """A copy call to the broker of ``slot``. The copy path waits for a connection within its 2 s; while
        reconciling, a broker that is down fails the call at once (``reconciling`` tries again)."""
        endpoint = self._links.membership.members[slot]
        call = self._links.channel(endpoint).unary_unary(method, None, None)
        timeout_s = RECONCILE_TIMEOUT_S if reconciling else CALL_TIMEOUT_S
        try:
            answer: bytes = await call(
                data, metadata=(self._links.peer_header(method),), timeout=timeout_s, wait_for_ready=not reconciling
            )
        except grpc.aio.AioRpcError as exc:
            raise errors.BrokerUnavailable(
                f"{endpoint} {method.rsplit('/', 1)[-1]}: {exc.code().name} {exc.details()}"
            ) from None
        return answer

    async def _ends(self, holder: int, slot: int, after: str) -> tuple[dict[str, int], str | None]:
        request = json.dumps({"slot": slot, "after": after}).encode()
        found = json.loads(await self._call(holder, ENDS, request, reconciling=True))
        following = found["next"]
        return {str(t): int(e) for t, e in found["ends"].items()}, None if following is None else str(following)

    async def _state_fetch(self, holder: int, slot: int, page: str, start: int) -> bytes:
        request = json.dumps({"slot": slot, "page": page, "from": start}).encode()
        return await self._call(holder, STATE_FETCH, request, reconciling=True)

    async def _fetch(self, holder: int, slot: int, topic: str, start: int) -> bytes:
        request = json.dumps({"slot": slot, "topic": topic, "from": start, "layout": "binary"}).encode()
        return await self._call(holder, FETCH, request, reconciling=True)  # an older holder answers JSON

    async def _diverge(self, holder: int, slot: int, epoch: int, topics: dict[str, int]) -> dict[str, following.Answer]:
        out: dict[str, following.Answer] = {}
        names = list(topics)
        for i in range(0, len(names), DIVERGE_TOPICS):
            chunk = {t: topics[t] for t in names[i : i + DIVERGE_TOPICS]}
            request = json.dumps({"slot": slot, "epoch": epoch, "topics": chunk}).encode()
            found = json.loads(await self._call(holder, DIVERGE, request))
            for topic in chunk:
                same, offset = found[topic]
                out[topic] = (None if same is None else int(same), int(offset))
        return out

    async def _accept(self, data: bytes) -> bytes:
        """A copy (a unary call's or a stream's): b"" once stored, else JSON {topic: end} where this broker is
        behind; LmqError for a refusal."""
        assert self.follower is not None
        behind = await self.follower.accept(data)
        return json.dumps(behind).encode() if behind else b""

    async def _answer(self, method: str, data: bytes) -> bytes:
        """A peer's call, its header verified; LmqError for a refusal."""
        if method == METHOD:
            return await self._accept(data)
        if method == STATES:
            return b"" if self.states.accept(data) else b"behind"
        if method == COPY_SOCKET:
            port = None if self.sockets is None else self.sockets.port
            return b"" if port is None else str(port).encode()
        try:
            request = json.loads(data)
            slot = int(request["slot"])
        except (ValueError, KeyError, TypeError) as exc:
            raise errors.InvalidArgument(f"unreadable request: {exc}") from None
        epoch = self.leadership.epoch(slot)
        if epoch is None:
            raise errors.Fenced(f"this broker does not hold the lease of slot {slot}")
        if method == ADOPT:
            await self.adopt(str(request["topic"]), int(request["leaving"]), slot)
            return b""
        if method == DIVERGE:
            if int(request["epoch"]) != epoch:
                raise errors.Fenced(f"slot {slot} is at epoch {epoch} here, not {request['epoch']}")
            epochs = {str(t): int(e) for t, e in dict(request["topics"]).items()}
            return json.dumps(await asyncio.to_thread(sources.answers, self._store, epochs)).encode()
        if method == STATE_FETCH:
            return await self.states.snapshot(slot, epoch, str(request.get("page", "")), int(request.get("from", 0)))
        if method == ENDS:
            after, of = str(request.get("after", "")), self.slots.slot_of_topic
            found, following = await asyncio.to_thread(sources.ends_page, self._store, slot, of, after, ENDS_SCAN)
            return json.dumps({"ends": found, "next": following}).encode()
        topic, start, binary = str(request["topic"]), int(request["from"]), request.get("layout") == "binary"
        return await asyncio.to_thread(sources.fetch, self._store, slot, epoch, topic, start, binary=binary)

    async def send(self, endpoint: str, data: bytes) -> dict[str, int]:
        """A copy to a follower, over its copy socket while one is open (``sockets``), else over gRPC
        (``send_stream``, the plain twin)."""
        if self.sockets is not None:
            link = self.sockets.link(endpoint, CALL_TIMEOUT_S)
            if link.ready():
                try:
                    return _behind(await link.send(data))
                except sockets.NotSent:  # closed meanwhile: not sent, so over gRPC
                    pass
        return await self.send_stream(endpoint, data)

    def _hello(self) -> str:
        return self._links.peer_header(sockets.HELLO)[1]

    async def _copy_socket_of(self, endpoint: str) -> int | None:
        """The port of ``endpoint``'s copy socket; None when it has none (an older version: UNIMPLEMENTED)."""
        call = self._links.channel(endpoint).unary_unary(COPY_SOCKET, None, None)
        try:
            metadata = (self._links.peer_header(COPY_SOCKET),)
            answer = await call(b"", metadata=metadata, timeout=CALL_TIMEOUT_S, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise
        return int(answer) if answer else None

    async def send_stream(self, endpoint: str, data: bytes) -> dict[str, int]:
        """A copy to a follower, over its binary stream; a follower of an older version (no such method: the
        copy was not read there) gets it again at once in the JSON layout, over its stream or a unary call."""
        link = self._link(self.copy_links, endpoint, STREAM_BINARY)
        if link.unimplemented and time.monotonic() >= self._json_until.get(endpoint, 0.0):
            link.unimplemented = False  # asked again: it may have been upgraded since
        if not link.unimplemented:
            try:
                return _behind(await link.send(data))
            except streams.Unimplemented:  # not read there; any other failure may be after it was stored
                self._json_until[endpoint] = time.monotonic() + BINARY_RETRY_S
                log.info("%s reads no binary copies (an older version): JSON copies for now", endpoint)
        data = wire.as_json(data)
        link = self._link(self.json_links, endpoint, STREAM)
        if link.unimplemented:
            return await self.send_unary(endpoint, data)
        return _behind(await link.send(data))

    def _link(self, links: dict[str, streams.Link], endpoint: str, method: str) -> streams.Link:
        link = links.get(endpoint)
        if link is None:
            link = links[endpoint] = streams.Link(endpoint, self._opener(endpoint, method), CALL_TIMEOUT_S)
        return link

    def _opener(self, endpoint: str, method: str) -> streams.Open:
        def open_stream() -> grpc.aio.StreamStreamCall[bytes, bytes]:
            call = self._links.channel(endpoint).stream_stream(method, None, None)
            return call(None, metadata=(self._links.peer_header(method),), wait_for_ready=True)  # copies: ``write``

        return open_stream

    async def send_unary(self, endpoint: str, data: bytes) -> dict[str, int]:
        """A copy as one unary call: the plain twin of the stream (a follower without one, and the tests)."""
        call = self._links.channel(endpoint).unary_unary(METHOD, None, None)
        try:
            answer = await call(
                data, metadata=(self._links.peer_header(METHOD),), timeout=CALL_TIMEOUT_S, wait_for_ready=True
            )
        except grpc.aio.AioRpcError as exc:
            raise errors.BrokerUnavailable(f"{endpoint} Append: {exc.code().name} {exc.details()}") from None
        return _behind(answer)

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        return _Handler(self)

    async def _not_a_peer(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """A replica call without a valid peer header (a client's signature is no peer's): refused, counted."""
        self._counters.copies_refused.labels("not_peer").inc()
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "replica calls come from peers only")

    def serving(self, method: str) -> Callable[[bytes, grpc.aio.ServicerContext[Any, Any]], Awaitable[bytes]]:
        async def serve(data: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            now = int(time.time() * 1000)
            call, _ = trust.verify(self._secret, method, context.invocation_metadata(), now)
            if call is None:
                await self._not_a_peer(context)
            try:
                return await self._answer(method, data)
            except errors.LmqError as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, exc.message)
            raise AssertionError("unreachable: abort raises")

        return serve

    def streaming(
        self, method: str
    ) -> Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext[Any, Any]], AsyncIterator[bytes]]:
        async def serve(
            requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[bytes]:
            call, _ = trust.verify(self._secret, method, context.invocation_metadata(), int(time.time() * 1000))
            if call is None:
                await self._not_a_peer(context)
            async for answer in streams.serve(requests, self._accept):
                yield answer

        return serve


def _behind(answer: bytes) -> dict[str, int]:
    """A follower's answer to a copy: {} stored, else where its lite topics end (it is behind)."""
    behind: dict[str, int] = json.loads(answer) if answer else {}
    return behind


def _any_slot(slot: int) -> bool:
    return True


class _Handler(_GenericHandler):
    def __init__(self, replication: Replication) -> None:
        self._replication = replication

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method
        if method not in self._replication.methods:
            return None
        if method in (STREAM, STREAM_BINARY):  # either reads both layouts (``wire.decode``)
            return grpc.stream_stream_rpc_method_handler(self._replication.streaming(method))
        return grpc.unary_unary_rpc_method_handler(self._replication.serving(method))


async def _store_commit(store: Store, dispatcher: Dispatcher, point: wire.Commit) -> None:
    """A follower's store takes its holder's commit point: on the loop when no writer holds the store (as the
    owner's settlement does: an ack waits for it); then what the dispatcher keeps of the key in memory goes, so
    that should this broker hold the slot again it serves the key from its store."""
    at = (point.queue, point.group, point.offset, point.acked, point.handouts)
    if not store.try_commit_offset(*at):
        await asyncio.to_thread(store.commit_offset, *at)
    dispatcher.settlement.copied_in(point.queue, point.group)


async def _expire_copy(store: Store, dispatcher: Dispatcher, min_age_ms: int, topic: str) -> bool:
    """``following.Follower``'s ``expired``: this broker's copy of a lite topic its holder deleted and created
    again goes once it is expired here by the in-broker expiry's rule (``expiry.expire_one``)."""
    queue = model.QueueId(topic, 0)
    return await expiry.expire_one(store, dispatcher, queue, dispatcher.wall_clock(), min_age_ms)


class _Local:
    """``following.Local``: this broker's store, read and cut in a thread; a cut topic's cached messages and
    consumer state are dropped from the dispatcher too (they were of the records cut)."""

    def __init__(
        self,
        store: Store,
        dispatcher: Dispatcher,
        slot_of_topic: Callable[[str], int],
        cuts: Counter,
        forget: Callable[[str], None],
    ) -> None:
        self._store = store
        self._dispatcher = dispatcher
        self._slot_of_topic = slot_of_topic
        self._cuts = cuts
        self._forget = forget

    async def tails(self, slot: int) -> dict[str, int]:
        return await asyncio.to_thread(sources.tail_epochs, self._store, slot, self._slot_of_topic)

    async def last_epoch(self, topic: str) -> int | None:
        return await asyncio.to_thread(divergence.last_epoch, sources.StoreLog(self._store, topic))

    async def cut_point(self, topic: str, epoch: int, theirs: following.Answer) -> int:
        return await asyncio.to_thread(divergence.cut_point, sources.StoreLog(self._store, topic), epoch, theirs)

    async def truncate(self, topic: str, end: int) -> int:
        queue = model.QueueId(topic, 0)
        cut = await asyncio.to_thread(self._store.truncate_queue, queue, end)
        if cut:
            self._forget(topic)
            self._cuts.inc(cut)
            self._dispatcher.recent.forget(queue)
            self._dispatcher.settlement.forget_topic(topic)
        return cut


def _follower_counters(registry: CollectorRegistry) -> tuple[Counter, Counter, Counter]:
    """A follower's counters: offsets cut at a rejoin, messages copied, store appends of copies."""
    return (
        Counter(
            "lmq_replication_truncated",
            "Offsets a rejoining replica cut from its lite topics (stored, never acknowledged)",
            registry=registry,
        ),
        Counter(
            "lmq_replication_copied",
            "Messages this broker stored from its slots' owners' copies (live, catch-up and fetched)",
            registry=registry,
        ),
        Counter(
            "lmq_replication_copy_appends",
            "Store appends of copied messages on this broker (each one write and, in sync mode, one fsync); "
            "lmq_replication_copied_total over this is the messages per copy",
            registry=registry,
        ),
    )
