"""Leadership's timing rules with an in-memory Lease API and a manual clock: when an owner stops acknowledging,
when a follower may take over (the real apiserver: tests/broker/replication/test_replication.py)."""

from __future__ import annotations

import itertools

import pytest

from lmq_broker import errors, model
from lmq_broker.replication import kube, owning
from lmq_broker.replication.leadership import Leadership, identity

DURATION_MS = 3000


class Leases:
    """The apiserver's rule for Leases: a write names the resourceVersion it read, else Conflict."""

    def __init__(self) -> None:
        self.items: dict[str, kube.Lease] = {}
        self._versions = itertools.count(1)
        self.down = False
        self.lists = 0  # reads: one LIST per tick, whatever the number of slots

    def list_named(self, prefix: str) -> list[kube.Lease]:
        if self.down:
            raise OSError("apiserver unreachable")
        self.lists += 1
        return [lease for name, lease in self.items.items() if name.startswith(prefix)]

    def create(self, name: str, holder: str, duration_s: int) -> kube.Lease:
        if self.down:
            raise OSError("apiserver unreachable")
        if name in self.items:
            raise kube.Conflict(name)
        lease = self.items[name] = kube.Lease(name, holder, 0, str(next(self._versions)), duration_s)
        return lease

    def write(self, lease: kube.Lease, holder: str, transitions: int, duration_s: int) -> kube.Lease:
        if self.down:
            raise OSError("apiserver unreachable")
        if self.items[lease.name].resource_version != lease.resource_version:
            raise kube.Conflict(lease.name)
        written = kube.Lease(lease.name, holder, transitions, str(next(self._versions)), duration_s)
        self.items[lease.name] = written
        return written


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def broker(
    api: Leases, clock: Clock, me: int, in_sync: bool = True, replica_sets: list[list[int]] | None = None
) -> Leadership:
    return Leadership(
        api,
        identity(me, "x"),
        me,
        replica_sets or [[0, 1], [1, 0]],
        lambda _slot, _epoch: in_sync,
        prefix="t",
        duration_ms=DURATION_MS,
        clock=clock,
    )


@pytest.mark.asyncio
async def test_an_owner_that_cannot_renew_stops_acknowledging_before_anyone_may_take_over() -> None:
    api, clock = Leases(), Clock()
    owner, follower = broker(api, clock, 0), broker(api, clock, 1)
    await owner.tick()
    await follower.tick()
    assert owner.epoch(0) == 0 and follower.serving(0) == 0
    api.down = True  # the owner is cut off from the apiserver; the follower is not (below)
    clock.now += 1.9  # under 2/3 of the 3 s lease since the last renewal began
    await owner.tick()
    assert owner.epoch(0) == 0
    clock.now += 0.2  # past 2/3: fenced, though nobody took the lease
    assert owner.epoch(0) is None
    api.down = False
    await follower.tick()
    assert not follower.holds(0)  # the version it saw has not stood still for a whole lease duration yet
    clock.now += 0.9  # 3.0 s since the follower first saw that version
    await follower.tick()
    assert follower.holds(0) and follower.epoch(0) == 1 and follower.serving(0) == 1
    api.down = True
    await owner.tick()  # still cut off: still fenced, never acknowledging under epoch 0 again
    assert owner.epoch(0) is None
    api.down = False
    await owner.tick()
    assert owner.epoch(0) is None and owner.serving(0) == 1 and owner.epochs[0] == 1


@pytest.mark.asyncio
async def test_a_follower_not_in_sync_never_takes_over() -> None:
    api, clock = Leases(), Clock()
    owner, follower = broker(api, clock, 0), broker(api, clock, 1, in_sync=False)
    await owner.tick()
    await follower.tick()
    clock.now += 10
    await follower.tick()
    assert not follower.holds(0) and follower.serving(0) == 0


@pytest.mark.asyncio
async def test_a_lease_renewed_in_time_is_never_taken() -> None:
    api, clock = Leases(), Clock()
    owner, follower = broker(api, clock, 0), broker(api, clock, 1)
    for _ in range(10):
        await owner.tick()
        await follower.tick()
        clock.now += 1.0  # a third of the lease: the owner's renewal interval
        assert owner.epoch(0) == 0
    assert not follower.holds(0)


@pytest.mark.asyncio
async def test_a_tick_reads_every_slots_lease_in_one_list_of_this_releases_leases() -> None:
    api, clock = Leases(), Clock()
    ring = [[0, 1], [1, 2], [2, 3], [3, 0]]
    api.create("t-slot-10", "slot-1/other-release", 3)  # another release with a longer name: not one of ours
    api.create("u-slot-2", "slot-3/other-release", 3)  # another release: ignored
    brokers = [broker(api, clock, me, replica_sets=ring) for me in range(4)]
    for b in brokers:
        await b.tick()
    assert api.lists == 4  # one read per broker and tick, not one per slot
    await brokers[0].tick()
    assert api.lists == 5
    assert brokers[0].holders == {slot: identity(slot, "x") for slot in range(4)}
    assert [brokers[0].serving(slot) for slot in range(4)] == [0, 1, 2, 3]
    api.down = True
    await brokers[0].tick()  # the LIST failed: nothing written, the fence closes by itself
    clock.now += 2.0
    assert brokers[0].epoch(0) is None


def test_a_slot_taken_over_and_lost_again_fences_its_topics_not_the_brokers_own_slot() -> None:
    """A broker that took slot 1 over (a failover) and lost its lease again must refuse sends and settlements of
    slot 1's topics: they are checked against slot 1's lease, never taken under the broker's own slot 0."""
    held = {0, 1}

    class Leases:
        me = 0

        def holds(self, slot: int) -> bool:
            return slot in held

        def epoch(self, slot: int) -> int | None:
            return 1 if slot in held else None

    class Owner:
        def __init__(self, slot: int) -> None:
            self.slot = slot

        def admit(self) -> None:
            if self.slot not in held:
                raise errors.Fenced(f"slot {self.slot}")

    leases = Leases()
    slots = owning.Slots(leases, lambda topic: 1 if topic.endswith("one") else 0, Owner)  # type: ignore[arg-type]
    one, zero = model.QueueId(model.LMQ_PREFIX + "P%one", 0), model.QueueId(model.LMQ_PREFIX + "P%zero", 0)
    slots.fence(one)  # held: admitted under slot 1
    held.discard(1)
    with pytest.raises(errors.Fenced):
        slots.fence(one)  # lost: refused, not admitted under slot 0
    slots.fence(zero)  # its own slot, still held
