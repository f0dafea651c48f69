"""Which brokers hold a copy of each ring slot: a pure function of the membership, so every broker that holds
the same membership computes the same replica sets.

Follower k (1 ≤ k < R) of slot s is slot ``(s + k * processes) mod slots``: the same process number on the
k-th next pod, never another process of the same pod (slots are numbered pod-major). A ring change moves
followers (at R = 2 and 3 → 2 pods, slot 1's follower moves from pod 2 to pod 0), so while the ring changes a
slot's replicas are the *union* of its replicas in the ring before and in the ring after, its preferred owner
first (docs/replication.md, *Changing the ring with R > 1*, step 2): the replicas of the new ring are copied to
and probed into the slot's in-sync set while the old ones still hold every acknowledged message.

The ring before and the ring after are read from the membership: with slots leaving (a scale-down marked,
not yet shed) the ring before is every member and the ring after today's ring; else the ring before is the
previous ring size of the history and the ring after every member (a scale-up). A history outlives its change
(a topic placed by the ring of 2 stays there), so the union is what a change starts from, not where it ends:
narrowing a slot to the new ring's replicas once its in-sync set holds them is step 4 (not built; the ring of
a replicated cluster does not change meanwhile: ``cluster.setup.fixed_ring``, ``setup.one_ring``).
"""

from __future__ import annotations

from lmq_broker import errors
from lmq_broker.cluster import membership as mb

ReplicaSets = list[list[int]]  # per slot of the membership: its replicas, its preferred owner first


def followers_of(slot: int, slots: int, processes: int, replicas: int) -> list[int]:
    """Follower k of ``slot``: the same process on the k-th next pod (never a process of its own pod)."""
    pods = slots // processes
    if replicas > pods:
        raise errors.InvalidArgument(f"--replicas {replicas} needs at least {replicas} pods, the ring has {pods}")
    return [(slot + k * processes) % slots for k in range(1, replicas)]


def ring_sets(slots: int, processes: int, replicas: int) -> ReplicaSets:
    """The replica sets of a ring of ``slots`` that does not change."""
    return [[s, *followers_of(s, slots, processes, replicas)] for s in range(slots)]


def before_and_after(membership: mb.Membership) -> tuple[int, int]:
    """The slot counts of the ring before the change and after it (equal when the ring does not change)."""
    members = len(membership.members)
    if membership.leaving_slots:
        return members, membership.size
    sizes = membership.sizes
    return (sizes[-2] if len(sizes) > 1 else members), members


def sets_of(membership: mb.Membership, processes: int, replicas: int) -> ReplicaSets:
    """Every slot's replicas under ``membership``: the union of the ring before and the ring after, preferred
    owner first, then the new ring's followers, then the old ring's that the new one does not name. A ring
    before the change with fewer pods than ``replicas`` was never replicated that widely: its sets are left
    out. A leaving slot keeps the replicas it had in the ring before."""
    before, after = before_and_after(membership)
    members = len(membership.members)
    new = ring_sets(after, processes, replicas)
    old = ring_sets(before, processes, replicas) if before // processes >= replicas else []
    out: ReplicaSets = []
    for slot in range(members):
        target = new[slot] if slot < after else []
        previous = old[slot] if slot < len(old) else []
        union = list(target) or [slot]
        union += [s for s in previous if s not in union]
        out.append(union)
    return out
