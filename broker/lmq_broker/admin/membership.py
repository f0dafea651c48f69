"""GetCluster and SetCluster: read and change this broker's cluster membership while it runs.

A scale-down takes two changes on every broker (docs/scale-out.md): first the leaving slots are marked
(today's ring shrinks, the members stay), which they then drain; then, once each reports drained, they are
removed. SetCluster refuses to remove a member that is not leaving or not drained (asked over its admin
service, or this broker's own store when it is the one removed), and refuses to change the endpoint of a
slot that stays, which would silently re-place every topic on it; ``force`` skips both checks. A broker with an
external listener refuses members it has no external address for, whatever ``force``.
"""

from __future__ import annotations

import grpc

from lmq_broker import errors
from lmq_broker.admin import inspection
from lmq_broker.cluster import links
from lmq_broker.cluster import membership as mb
from lmq_broker.cluster.setup import ADMIN, Cluster, Place
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as pb
from lmq_broker.storage.api import Store

UNDRAINED_TIMEOUT_S = 60.0  # a member counting its undrained messages walks all of its lite topics


async def view(cluster: Cluster, store: Store, *, with_undrained: bool) -> pb.GetClusterResponse:
    place = cluster.place
    leaving = place.slot >= 0 and place.membership.leaving(place.slot)
    undrained = await _undrained(cluster, store) if with_undrained else -1
    return pb.GetClusterResponse(
        members=place.membership.members,
        ring_sizes=place.membership.sizes,
        slot=place.slot,
        leaving=leaving,
        undrained_messages=undrained,
        drained=leaving and undrained == 0,
        source=place.source,
        admin_port=max(cluster.config.admin_port, 0),
        epoch=cluster.confirmed_epoch,
        incarnation=cluster.incarnation,
        ring_fixed=ring_fixed(cluster),
    )


async def _undrained(cluster: Cluster, store: Store) -> int:
    """This broker's undrained messages (``inspection.undrained``); leaving, with those of its NORMAL topics and
    dead letters not copied yet for the groups its consumers said they consume (``cluster.relocating``)."""
    moved = handed_over(cluster)
    consumers = cluster.relocator.groups() if moved is not None else None
    return await inspection.undrained(store, drains(cluster), moved, relocated=consumers)


def drains(cluster: Cluster) -> inspection.Drains | None:
    """Which lite topics of its store a broker drains when leaving: every one at --replicas 1; with replication,
    those of its own slot by the slot their records name (its copies of the slots it follows drain at their
    holders)."""
    of = cluster.slot_of_topic
    return None if of is None else lambda topic: of(topic) == cluster.slot


def handed_over(cluster: Cluster) -> inspection.Drains | None:
    """At a leaving broker: whether a topic (of its own slot, with replication) was handed over to its owner in
    today's ring (``cluster.draining``, this process's memory); None elsewhere. A consumed topic not handed over
    yet counts as undrained: once this broker is removed, the topic's next message is stored at today's owner,
    where only the hand-over subscribes its consumers (the leaving broker hands consumed topics over by itself,
    ``draining.hand_over_idle``)."""
    peers, place = cluster.peers, cluster.place
    if peers is None or place.slot < 0 or not place.membership.leaving(place.slot):
        return None
    return peers.handoff.moved


def ring_fixed(cluster: Cluster) -> str:
    """Why this broker refuses a grown ring now ("" when it takes one, and always at --replicas 1)."""
    if cluster.config.replicas <= 1:
        return ""
    why = cluster.ring_fixed()
    return "replication is not running yet" if why is None else why


async def change(cluster: Cluster, store: Store, request: pb.SetClusterRequest) -> pb.SetClusterResponse:
    if not request.members or not request.ring_sizes:
        raise errors.InvalidArgument("a cluster needs its members and at least today's ring size")
    new = mb.of(tuple(request.members), tuple(request.ring_sizes), request.epoch)
    for member in new.members:
        mb.Membership.parse(member)  # host:port each
    external = links.external_of(cluster.config)
    if external is not None:  # every member needs the address clients outside reach it by (cluster.external)
        external.of_slots(len(new.members))
    old = cluster.place
    slot = _slot_in(new, old, cluster, request.slot if request.HasField("slot") else None)
    if not request.force and not old.alone:
        kept = min(len(old.membership.members), len(new.members))
        if old.membership.members[:kept] != new.members[:kept]:
            raise errors.Conflict(
                f"slots that stay must keep their endpoints: {', '.join(old.membership.members[:kept])} would "
                f"become {', '.join(new.members[:kept])} (force to re-place their topics anyway)"
            )
        for gone, member in enumerate(old.membership.members):
            if member not in new.members:
                await _check_removable(cluster, store, old, gone, member)
    if not request.epoch:
        new = cluster.next_epoch(new, slot)
    changed = await cluster.change(Place(new, slot, ADMIN))
    return pb.SetClusterResponse(cluster=await view(cluster, store, with_undrained=False), changed=changed)


def _slot_in(new: mb.Membership, old: Place, cluster: Cluster, asked: int | None) -> int:
    if asked is not None:
        if not -1 <= asked < len(new.members):
            raise errors.InvalidArgument(f"slot {asked} is not one of the {len(new.members)} members (or -1)")
        return asked
    mine = cluster.endpoint  # --advertised-address, else its endpoint when it was last a member
    if not mine and old.alone:
        raise errors.InvalidArgument("this broker runs alone and does not know its endpoint: give its slot")
    return new.members.index(mine) if mine in new.members else -1


async def _check_removable(cluster: Cluster, store: Store, old: Place, slot: int, member: str) -> None:
    if not old.membership.leaving(slot):
        raise errors.Conflict(
            f"{member} is not leaving: shrink the ring first (ring size {slot} or less), let it drain, then remove it"
        )
    if slot == old.slot:
        undrained = await _undrained(cluster, store)
    else:
        peers = cluster.peers
        if peers is None:
            raise errors.Conflict(f"cannot ask {member} whether it is drained")
        stub, metadata = peers.admin(member, "GetCluster")
        try:
            reply = await stub.GetCluster(
                pb.GetClusterRequest(with_undrained=True), metadata=metadata, timeout=UNDRAINED_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            raise errors.Conflict(
                f"cannot ask {member} whether it is drained ({exc.code().name}: {exc.details()}); force removes "
                "it anyway, and whatever it holds undrained is then no longer delivered"
            ) from None
        undrained = reply.undrained_messages
    if undrained != 0:
        raise errors.Conflict(f"{member} still holds {undrained} undrained messages: wait until it is drained")
