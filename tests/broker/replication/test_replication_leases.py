"""Leadership's timing rules with an in-memory Lease API and a manual clock: when an owner stops acknowledging,
when a follower may take over (the real apiserver: tests/broker/replication/test_replication.py)."""

from __future__ import annotations

import asyncio

import pytest
from waiting import eventually_async

from lmq_broker import errors, model
from lmq_broker.replication import kube, memory, owning
from lmq_broker.replication.leadership import Leadership, identity

DURATION_MS = 3000


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def broker(
    api: memory.Leases, clock: Clock, me: int, in_sync: bool = True, replica_sets: list[list[int]] | None = None
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


class SlowLeases(memory.Leases):
    """An apiserver on a loaded host: each LIST takes ``cost_s`` of the broker's clock."""

    def __init__(self, clock: Clock, cost_s: float) -> None:
        super().__init__()
        self._clock, self._cost_s = clock, cost_s

    def list_named(self, prefix: str) -> list[kube.Lease]:
        self._clock.now += self._cost_s
        return super().list_named(prefix)


@pytest.mark.asyncio
async def test_a_slow_renewal_delays_the_next_one_by_nothing_more() -> None:
    """Renewals run a third of a duration apart from when each *began*: after one that took half a duration,
    the next starts at once (waiting another third would leave the owner fenced between them, its sends refused
    though nobody could take its lease)."""
    clock, duration_s = Clock(), 60.0
    api = SlowLeases(clock, duration_s / 2)
    owner = Leadership(api, identity(0, "x"), 0, [[0, 1], [1, 0]], lambda _s, _e: True, prefix="t",
                       duration_ms=int(duration_s * 1000), clock=clock)  # fmt: skip
    stopping = asyncio.Event()
    running = asyncio.create_task(owner.run(stopping))
    try:
        # A third of this duration is 20 s of real time: four ticks within the wait only if none waited after
        # a slow one.
        await eventually_async(lambda: api.lists >= 4, "four renewals, each right after the last", 10)
    finally:
        stopping.set()
        await running
    assert owner.epoch(0) == 0  # renewed by the last tick (while one runs, its LIST moves the clock on)


@pytest.mark.asyncio
async def test_an_owner_that_cannot_renew_stops_acknowledging_before_anyone_may_take_over() -> None:
    api, clock = memory.Leases(), Clock()
    owner, follower = broker(api, clock, 0), broker(api, clock, 1)
    await owner.tick()
    assert await owner.record(0, lambda now: (*now, 1)) == (0, 1)  # the follower joined the in-sync set
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
    api, clock = memory.Leases(), Clock()
    owner, follower = broker(api, clock, 0), broker(api, clock, 1, in_sync=False)
    await owner.tick()
    await follower.tick()
    clock.now += 10
    await follower.tick()
    assert not follower.holds(0) and follower.serving(0) == 0


@pytest.mark.asyncio
async def test_a_lease_renewed_in_time_is_never_taken() -> None:
    api, clock = memory.Leases(), Clock()
    owner, follower = broker(api, clock, 0), broker(api, clock, 1)
    for _ in range(10):
        await owner.tick()
        await follower.tick()
        clock.now += 1.0  # a third of the lease: the owner's renewal interval
        assert owner.epoch(0) == 0
    assert not follower.holds(0)


@pytest.mark.asyncio
async def test_a_follower_whose_read_was_slow_still_takes_over_only_after_the_owner_stopped_acknowledging() -> None:
    """The follower's LIST takes longer than a third of the lease and the owner renews while it is under way:
    the renewal began after the follower's tick did. The lease's version must count as seen when the LIST
    answered, not when the tick began, or the follower takes over while the owner still acknowledges."""
    api, clock = memory.Leases(), Clock()
    owner, follower = broker(api, clock, 0), broker(api, clock, 1)
    await owner.tick()
    assert await owner.record(0, lambda now: (*now, 1)) == (0, 1)
    loop = asyncio.get_running_loop()
    listing = api.list_named

    def slow_list(prefix: str) -> list[kube.Lease]:  # the follower's read, 1.5 s long, the owner renewing in it
        api.list_named = listing  # type: ignore[method-assign]
        clock.now += 1.2
        asyncio.run_coroutine_threadsafe(owner.tick(), loop).result()
        clock.now += 0.3
        return listing(prefix)

    api.list_named = slow_list  # type: ignore[method-assign]
    await follower.tick()  # began at 100.0; saw the version the owner's renewal (began at 101.2) wrote
    for _ in range(40):  # the owner renews no more
        clock.now += 0.1
        if owner.epoch(0) is not None:  # it acknowledges until 2/3 of a lease after 101.2
            await follower.tick()
            assert not follower.holds(0), f"taken over at {clock.now:.1f} while the owner still acknowledges"
    await follower.tick()
    assert follower.holds(0) and owner.epoch(0) is None


@pytest.mark.asyncio
async def test_a_tick_reads_every_slots_lease_in_one_list_of_this_releases_leases() -> None:
    api, clock = memory.Leases(), Clock()
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


@pytest.mark.asyncio
async def test_a_released_lease_is_taken_at_once_by_a_member_of_its_set_and_never_by_the_releaser() -> None:
    """Step 5 of a ring change (lease handover by release): the holder stops acknowledging before it writes the
    lease with no holder (same epoch, same set); a follower in the set takes it at its next tick, with no
    clock moved (no expiry waited for), at the next epoch; a broker told not to take the slot (its pod is being
    removed) leaves it alone, expired or not. A lease whose holder a person cleared by hand promises no fence:
    it is taken only once expired."""
    api, clock = memory.Leases(), Clock()
    owner, follower = broker(api, clock, 0), broker(api, clock, 1)
    await owner.tick()
    assert await owner.record(0, lambda now: (*now, 1)) == (0, 1)
    await follower.tick()
    owner.may_take = lambda slot: False
    assert await owner.release(0)
    assert owner.epoch(0) is None and not owner.holds(0)  # fenced before the write
    lease = api.items["t-slot-0"]
    assert (lease.holder, lease.transitions, lease.in_sync) == ("released/" + owner.identity, 0, (0, 1))
    await owner.tick()
    assert not owner.holds(0)
    await follower.tick()  # first sight of the released version: taken at once
    # the releaser leaves the set as a deposed holder does (min-insync 1 here): it rejoins only once caught up
    assert follower.epoch(0) == 1 and follower.in_sync(0) == (1,)
    assert not await owner.release(0)  # nothing held: nothing written
    clock.now += 2 * DURATION_MS / 1000  # the follower stops renewing (dies): expired, but not for the releaser
    await owner.tick()
    await owner.tick()
    assert not owner.holds(0)
    lease = api.items["t-slot-0"]
    assert lease.in_sync == (1,)  # the releaser is out of the set: not eligible, expired or not
    api.write(lease, "", lease.transitions, 60, (0, 1))  # cleared by hand, the releaser put back in the set
    owner.may_take = lambda slot: True
    await owner.tick()
    await owner.tick()  # seen twice, not yet for a whole duration: not taken
    assert not owner.holds(0)
    clock.now += DURATION_MS / 1000
    await owner.tick()
    assert owner.holds(0)


@pytest.mark.asyncio
async def test_a_removed_slot_is_forgotten_so_its_lease_created_again_starts_afresh() -> None:
    """Slot 2 of a ring of 3 reached epoch 4, then a scale-down removed it and its Lease was deleted (the
    operator). A broker that lived through it forgets what it saw of slot 2; when a scale-up brings slot 2 back
    its owner creates the Lease at epoch 0, and that epoch is what the follower goes by (not refused as older)."""
    api, clock = memory.Leases(), Clock()
    three = [[0, 1], [1, 2], [2, 0]]
    owner, follower = broker(api, clock, 2, replica_sets=three), broker(api, clock, 0, replica_sets=three)
    await owner.tick()
    lease = api.items["t-slot-2"]
    api.items["t-slot-2"] = api.write(lease, lease.holder, 4, 3, (0, 2))
    await follower.tick()
    assert follower.epochs[2] == 4 and follower.in_sets[2] == (0, 2) and follower.serving(2) == 2
    follower.follow([[0, 1], [1, 0]])  # the ring of 2: slot 2 removed
    assert 2 not in follower.epochs and 2 not in follower.in_sets and 2 not in follower.holders
    del api.items["t-slot-2"]
    follower.follow(three)  # the ring of 3 again: slot 2's owner creates its Lease afresh
    fresh = broker(api, clock, 2, replica_sets=three)
    await fresh.tick()
    await follower.tick()
    assert follower.epochs[2] == 0 and fresh.epoch(2) == 0
