"""Every slot's replicas from the membership (``replication.replicas``): during a ring change the union of the
ring before and the ring after (docs/replication.md, *Changing the ring with R > 1*, step 2)."""

from __future__ import annotations

import pytest

from lmq_broker import errors
from lmq_broker.cluster import membership as mb
from lmq_broker.cluster import setup as cluster_setup
from lmq_broker.replication import replicas

THREE = ("a:1", "b:1", "c:1")


def test_a_ring_without_history_has_its_own_replica_sets() -> None:
    assert replicas.sets_of(mb.Membership(THREE, (3,)), 1, 2) == [[0, 1], [1, 2], [2, 0]]
    assert replicas.sets_of(mb.Membership(THREE, (3,)), 1, 3) == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    assert replicas.sets_of(mb.Membership(THREE[:1], (1,)), 1, 1) == [[0]]


def test_a_scale_up_keeps_the_old_followers_beside_the_new_ones() -> None:
    """2 → 3 pods at R = 2: slot 1's follower moves from pod 0 to pod 2, so both follow it; the new slot 2 has
    the new ring's replicas only."""
    grown = mb.Membership(THREE[:2], (2,)).grown(THREE[2])
    assert replicas.before_and_after(grown) == (2, 3)
    assert replicas.sets_of(grown, 1, 2) == [[0, 1], [1, 2, 0], [2, 0]]
    # R = 3: the ring of 2 never had three replicas; the new ring's sets are every pod anyway
    assert replicas.sets_of(grown, 1, 3) == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]


def test_a_scale_down_keeps_the_leaving_pods_copies_until_the_slots_are_shed() -> None:
    """3 → 2 pods at R = 2 (fact 2 of *Why a ring change is more than SetCluster*): slot 1's follower moves from
    pod 2 (leaving) to pod 0, which holds nothing of slot 1 yet, so pod 2 stays a replica of slot 1 meanwhile;
    the leaving slot 2 keeps its replicas. Once shed, the ring of 2's sets."""
    shrunk = mb.Membership(THREE, (3,)).shrunk(2)
    assert replicas.before_and_after(shrunk) == (3, 2)
    assert replicas.sets_of(shrunk, 1, 2) == [[0, 1], [1, 0, 2], [2, 0]]
    assert replicas.sets_of(shrunk.shed(), 1, 2) == [[0, 1], [1, 0]]


def test_processes_of_a_pod_follow_the_same_process_of_other_pods_across_a_change() -> None:
    """2 processes a pod, 2 → 3 pods (4 → 6 slots), R = 2: slot 3 (pod 1, process 1) is followed by slot 5 in
    the new ring and slot 1 in the old one; never by slot 2 (its own pod)."""
    four = mb.Membership(("a:1", "a:2", "b:1", "b:2"), (4,))
    grown = four.grown("c:1", "c:2")
    sets = replicas.sets_of(grown, 2, 2)
    assert sets[3] == [3, 5, 1]
    assert all(s // 2 != slot // 2 for slot, found in enumerate(sets) for s in found[1:])


def test_more_replicas_than_pods_in_the_new_ring_is_refused() -> None:
    with pytest.raises(errors.InvalidArgument, match="needs at least 3 pods"):
        replicas.sets_of(mb.Membership(THREE, (3,)).shrunk(2), 1, 3)


def test_a_slot_whose_set_is_exactly_the_new_rings_replicas_has_those_only() -> None:
    """Step 4: once the holder wrote the set without the old replicas, every broker reads the slot's replicas
    from it; while the set lacks a new replica (or still names an old one) the union stays."""
    grown = mb.Membership(THREE[:2], (2,)).grown(THREE[2])
    assert replicas.sets_of(grown, 1, 2, {1: (0, 1)})[1] == [1, 2, 0]  # the new follower not in yet
    assert replicas.sets_of(grown, 1, 2, {1: (0, 1, 2)})[1] == [1, 2, 0]  # in, the old one not out yet
    assert replicas.sets_of(grown, 1, 2, {1: (1, 2)})[1] == [1, 2]
    assert replicas.sets_of(grown, 1, 2, {1: (1,)})[1] == [1, 2, 0]  # a new replica fell out: both again
    shrunk = mb.Membership(THREE, (3,)).shrunk(2)
    assert replicas.sets_of(shrunk, 1, 2, {1: (0, 1), 2: (0, 2)}) == [[0, 1], [1, 0], [2, 0]]


def test_the_holder_narrows_the_set_only_once_every_new_replica_is_in_and_never_below_its_floor() -> None:
    assert replicas.narrowed([1, 2], (0, 1), 2, 1) is None  # 2 not in yet: 0 stays, it holds the slot's copies
    assert replicas.narrowed([1, 2], (0, 1, 2), 2, 1) == (1, 2)
    assert replicas.narrowed([1, 2], (1, 2), 2, 1) is None  # nothing to remove
    assert replicas.narrowed([1, 2, 3], (0, 1, 2, 3), 2, 1) == (1, 2, 3)
    assert replicas.narrowed([1], (0, 1), 2, 1) is None  # below --min-insync-replicas: not written
    # A holder the new ring does not name (it took the slot over) keeps itself in the set: it hands over first.
    assert replicas.narrowed([1, 2], (0, 1, 2), 2, 0) is None


def test_a_holder_that_is_no_replica_of_the_new_ring_releases_once_every_new_one_is_in() -> None:
    """Slot 1 held by broker 0 (a failover) when the ring of 2 grows to 3: its new replicas are (1, 2)."""
    assert not replicas.hands_over([1, 2], (0, 1), 0, True)  # 2 not in yet: it holds no copy to take over from
    assert replicas.hands_over([1, 2], (0, 1, 2), 0, True)
    assert not replicas.hands_over([1, 2], (0, 1, 2), 1, True)  # a new-ring replica keeps it and narrows the set
    assert not replicas.hands_over([1, 2], (0, 1, 2), 0, False)  # M < R: a member may lack acknowledged sends


def test_a_broker_refuses_a_marking_that_leaves_fewer_pods_than_replicas() -> None:
    """SetCluster's check (``cluster.setup.fixed_ring``), not only the operator's: a person's ``lmq-admin cluster
    set`` that marks slots leaving down to fewer pods than R is refused before anything changes."""
    three = mb.Membership(THREE, (3,))
    cluster_setup.fixed_ring(2, three, three.shrunk(2), "")  # 3 -> 2 at R = 2: taken
    with pytest.raises(errors.Conflict, match="a ring of 2 pods cannot hold 3 replicas"):
        cluster_setup.fixed_ring(3, three, three.shrunk(2), "")
