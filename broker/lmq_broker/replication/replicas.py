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
once a slot's in-sync set (its lease) holds every new-ring replica, its holder writes the set without the
others (``narrowed``, step 4), and from then on every broker reads the slot's replicas from that set: exactly
the new ring's. A replicated ring grows, or has its last slots marked leaving and then removed
(``cluster.setup.fixed_ring``): the ring before is a smaller one, or every member while slots are leaving.
"""

from __future__ import annotations

from collections.abc import Mapping

from lmq_broker import errors
from lmq_broker.cluster import membership as mb
from lmq_broker.replication.leadership import InSync

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


def targets_of(membership: mb.Membership, processes: int, replicas: int) -> ReplicaSets:
    """Every slot's replicas in the ring after the change; a leaving slot's are those of the ring before (it
    keeps them until it is shed)."""
    before, after = before_and_after(membership)
    new = ring_sets(after, processes, replicas)
    old = ring_sets(before, processes, replicas) if before > after else []
    return [new[slot] if slot < after else old[slot] for slot in range(len(membership.members))]


def sets_of(
    membership: mb.Membership, processes: int, replicas: int, in_sets: Mapping[int, InSync | None] | None = None
) -> ReplicaSets:
    """Every slot's replicas under ``membership``: the union of the ring before and the ring after, preferred
    owner first, then the new ring's followers, then the old ring's that the new one does not name. A ring
    before the change with fewer pods than ``replicas`` was never replicated that widely: its sets are left
    out. A leaving slot keeps the replicas it had in the ring before. A slot whose in-sync set (``in_sets``,
    as its lease records it) is exactly its new-ring replicas has those only: its holder removed the others
    from the set (``narrowed``) once the new ones were in it (step 4), so nobody copies to them or probes them
    back in, and they follow it no more."""
    before = before_and_after(membership)[0]
    targets = targets_of(membership, processes, replicas)
    old = ring_sets(before, processes, replicas) if before // processes >= replicas else []
    out: ReplicaSets = []
    for slot, target in enumerate(targets):
        recorded = (in_sets or {}).get(slot)
        if recorded is not None and set(recorded) == set(target):
            out.append(list(target))
            continue
        previous = old[slot] if slot < len(old) else []
        out.append([*target, *(s for s in previous if s not in target)])
    return out


def hands_over(target: list[int], recorded: InSync, holder: int, every_member_acks: bool) -> bool:
    """Whether ``holder`` releases its slot's lease (step 5) in a changed ring: it is none of the new ring's
    replicas (``target``: a failover gave it the slot before the change), and every one of them is in the set,
    so a member of the new ring takes it at its next tick and narrows the set. Only where every member of the
    set stored every acknowledged send (``every_member_acks``: --min-insync-replicas = --replicas): whichever
    member takes the lease holds them all. Else the slot stays where it is (the operator waits)."""
    return every_member_acks and holder not in target and set(target) <= set(recorded)


def narrowed(target: list[int], recorded: InSync, floor: int, holder: int) -> InSync | None:
    """The in-sync set a slot's ``holder`` writes once it holds every new-ring replica (``target``): without the
    replicas the new ring does not name, never below ``floor`` (--min-insync-replicas); None when there is
    nothing to write (a new replica is not in yet, or no old one is left), or when the holder is not one of
    the new ring's replicas (the set always holds its holder: it hands the lease over first, step 5)."""
    kept = tuple(sorted(s for s in recorded if s in target))
    if holder not in target or not set(target) <= set(recorded) or kept == tuple(sorted(recorded)):
        return None
    return kept if len(kept) >= floor else None
