"""The in-sync set recorded with the lease (docs/replication.md, "In-sync replicas"), three replicas, on the
in-memory Lease API with a manual clock: the owner shrinks the set in the lease before it acknowledges without a
follower, a follower joins again once a probe proved it holds everything, only a member takes an expired lease
over, and at --min-insync-replicas 1 a send waits for nobody. Copies go to followers that are functions here
(the same with broker processes: tests/broker/replication/test_replication_failover.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry
from waiting import eventually_async

from lmq_broker import errors, model
from lmq_broker.dispatch import testing as dispatch_testing
from lmq_broker.replication import copies, memory, owning, wire
from lmq_broker.replication.leadership import Leadership, identity

DURATION_MS = 3000
RING = [[0, 1, 2], [1, 2, 0], [2, 0, 1]]  # R = 3: every broker is a replica of every slot


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Followers:
    """Brokers 1 and 2 as the owner's copies reach them: what each stored, and which are down or slow."""

    stored: dict[str, list[str]] = field(default_factory=lambda: {"b1": [], "b2": []})
    commits: dict[str, list[tuple[str, int]]] = field(default_factory=lambda: {"b1": [], "b2": []})
    down: set[str] = field(default_factory=set)
    gate: asyncio.Event = field(default_factory=asyncio.Event)  # cleared: every copy waits
    waiting: int = 0  # copies waiting at the gate
    messages_gate: asyncio.Event = field(default_factory=asyncio.Event)  # cleared: copies of messages wait
    arrived: dict[str, list[str]] = field(default_factory=lambda: {"b1": [], "b2": []})  # message ids, "commit"
    copies: dict[str, list[int]] = field(default_factory=lambda: {"b1": [], "b2": []})  # messages per copy of some
    slow: set[str] = field(default_factory=set)  # copies to these wait for ``slow_gate``
    slow_gate: asyncio.Event = field(default_factory=asyncio.Event)

    async def send(self, endpoint: str, data: bytes) -> dict[str, int]:
        if endpoint in self.down:
            raise errors.BrokerUnavailable(f"{endpoint}: UNAVAILABLE")
        self.waiting += 1
        try:
            await self.gate.wait()
        finally:
            self.waiting -= 1
        if endpoint in self.slow:
            await self.slow_gate.wait()
        copy = wire.decode(data)
        if copy.messages:
            await self.messages_gate.wait()
        if copy.messages:
            self.copies[endpoint].append(len(copy.messages))
        self.arrived[endpoint].extend([m.message_id for m in copy.messages] + ["commit"] * len(copy.commits))
        self.stored[endpoint].extend(m.message_id for m in copy.messages)
        self.commits[endpoint].extend((c.group, c.offset) for c in copy.commits)
        return {}


def broker(api: memory.Leases, clock: Clock, me: int) -> Leadership:
    """A broker's leases with --min-insync-replicas 2; every broker reconciled (locally in sync)."""
    return Leadership(
        api,
        identity(me, "x"),
        me,
        RING,
        lambda _s, _e: True,
        prefix="t",
        duration_ms=DURATION_MS,
        min_insync=2,
        clock=clock,
    )


async def nothing(_queue: model.QueueId, _offset: int, _n: int) -> list[model.StoredMessage]:
    return []


async def no_tails() -> list[model.StoredMessage]:
    return []  # an empty slot: a probe that reaches the follower proves it holds everything


@dataclass
class Slot0:
    api: memory.Leases
    clock: Clock
    leaders: list[Leadership]
    followers: Followers
    registry: CollectorRegistry
    owners: list[copies.Owner] = field(default_factory=list)
    points: list[wire.Commit] = field(default_factory=list)  # the commit points in the owner's store

    async def stored_points(self) -> list[wire.Commit]:
        return list(self.points)

    def owner(self, min_insync: int, queue_messages: int = 100, lag_max_s: float = 0.0) -> copies.Owner:
        found = copies.Owner(
            self.leaders[0],
            0,
            {1: "b1", 2: "b2"},
            min_insync,
            (self.followers.send, nothing, no_tails, self.stored_points),
            copies.Counters(self.registry),
            queue_messages=queue_messages,
            probe_interval_s=0.05,
            lag_max_s=lag_max_s,
        )
        self.owners.append(found)
        return found

    def recorded(self) -> tuple[int, ...] | None:
        return self.api.items["t-slot-0"].in_sync

    def counted(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.registry.get_sample_value(name, labels or {}) or 0.0


@pytest_asyncio.fixture
async def slot0() -> AsyncIterator[Slot0]:
    api, clock = memory.Leases(), Clock()
    leaders = [broker(api, clock, me) for me in range(3)]
    for leader in leaders:
        await leader.tick()
    followers = Followers()
    followers.gate.set()
    followers.messages_gate.set()
    found = Slot0(api, clock, leaders, followers, CollectorRegistry())
    assert found.recorded() == (0,)  # a new lease: its owner alone, the followers join once probed
    yield found
    for owner in found.owners:
        await owner.close()


def batch(n: int) -> tuple[list[model.NewMessage], list[model.AppendResult]]:
    m = dispatch_testing.lite_message("x", message_id=f"m{n}")
    return [m], [model.AppendResult(m.message_id, m.queues, (n, n), 0)]


@pytest.mark.asyncio
async def test_a_follower_that_fails_is_recorded_out_of_the_set_before_the_send_is_acknowledged(
    slot0: Slot0,
) -> None:
    owner = slot0.owner(min_insync=2)
    await eventually_async(lambda: slot0.recorded() == (0, 1, 2), "both followers probed into the set")
    await owner.copy(*batch(0))
    assert slot0.followers.stored == {"b1": ["m0"], "b2": ["m0"]}  # every member answered before the ack
    slot0.followers.down.add("b2")
    await owner.copy(*batch(1))  # acknowledged: stored here and on broker 1, both in the set
    assert slot0.recorded() == (0, 1)  # ... and the lease said so before the answer went out
    assert slot0.followers.stored["b1"] == ["m0", "m1"]
    await owner.copy(*batch(2))  # no waiting for broker 2 any more
    slot0.followers.down.add("b1")
    with pytest.raises(errors.NotEnoughReplicas, match="not enough in-sync replicas of slot 0: 1 of 2"):
        await owner.copy(*batch(3))
    # Never recorded below 2: broker 1 holds every acknowledged message, so it may still take over.
    assert slot0.recorded() == (0, 1)
    assert slot0.counted("lmq_replication_refused_total", {"reason": "insync"}) == 1
    slot0.followers.down.discard("b1")
    await owner.copy(*batch(4))  # back: its copy caught up is counted again
    assert slot0.followers.stored["b1"][-1] == "m4"


@pytest.mark.asyncio
async def test_a_follower_back_joins_the_set_once_a_probe_reached_it(slot0: Slot0) -> None:
    slot0.followers.down.add("b2")
    owner = slot0.owner(min_insync=2)
    await owner.copy(*batch(0))  # broker 1 joins; broker 2 is down
    assert slot0.recorded() == (0, 1)
    slot0.followers.down.clear()
    await eventually_async(lambda: slot0.recorded() == (0, 1, 2), "broker 2 probed back into the set")
    await owner.copy(*batch(1))
    assert slot0.followers.stored["b2"][-1] == "m1"


@pytest.mark.asyncio
async def test_only_a_member_of_the_recorded_set_takes_an_expired_lease_over(slot0: Slot0) -> None:
    """Both followers say they are in sync (reconciled); broker 2 missed a copy, so the owner recorded it out:
    when the owner dies, broker 1 takes the slot, never broker 2."""
    owner = slot0.owner(min_insync=2)
    await eventually_async(lambda: slot0.recorded() == (0, 1, 2), "both followers in the set")
    slot0.followers.down.add("b2")
    await owner.copy(*batch(0))
    assert slot0.recorded() == (0, 1)
    first, second = slot0.leaders[1], slot0.leaders[2]
    await second.tick()
    await first.tick()  # both see the version the owner wrote last; the owner writes no more (dead)
    slot0.clock.now += DURATION_MS / 1000
    await second.tick()  # expired, reconciled, but not in the set: it waits
    assert not second.holds(0)
    await first.tick()
    assert first.holds(0) and first.epoch(0) == 1
    # The deposed owner stays in the set: without it the set would be below 2 (it holds every acknowledged one).
    assert slot0.recorded() == (0, 1) and first.in_sync(0) == (0, 1)
    await second.tick()
    assert not second.holds(0) and second.serving(0) == 1


@pytest.mark.asyncio
async def test_the_set_survives_renewals_and_a_deposed_owner_records_nothing(slot0: Slot0) -> None:
    leader = slot0.leaders[0]
    assert await leader.record(0, lambda now: (*now, 2)) == (0, 2)
    slot0.clock.now += 1.0
    await leader.tick()  # a renewal keeps the set it last wrote
    assert slot0.recorded() == (0, 2)
    lease = slot0.api.items["t-slot-0"]
    slot0.api.write(lease, "someone-else", lease.transitions + 1, 60, (1,))  # taken by force
    assert await leader.record(0, lambda now: (*now, 1)) is None  # the write conflicts: not written
    assert not leader.holds(0) and slot0.recorded() == (1,)


@pytest.mark.asyncio
async def test_at_min_insync_1_a_send_waits_for_nobody_and_a_full_queue_drops_the_follower_out(
    slot0: Slot0,
) -> None:
    owner = slot0.owner(min_insync=1, queue_messages=3)
    await eventually_async(lambda: slot0.recorded() == (0, 1, 2), "both followers in the set")
    slot0.followers.gate.clear()  # the followers stop answering: copies queue up
    for n in range(6):
        await asyncio.wait_for(owner.copy(*batch(n)), 1)  # answered at once, no future kept per send
    assert slot0.followers.stored == {"b1": [], "b2": []}
    assert slot0.counted("lmq_replication_copies_dropped_total") > 0  # past 3 queued messages per follower
    await eventually_async(lambda: slot0.recorded() == (0,), "both followers out of the set (they missed copies)")
    slot0.followers.gate.set()
    await eventually_async(lambda: slot0.recorded() == (0, 1, 2), "both followers probed back in")
    assert slot0.followers.stored["b1"][:3] == ["m0", "m1", "m2"]


@pytest.mark.asyncio
async def test_an_ack_is_answered_once_every_member_of_the_set_stored_its_commit_point(slot0: Slot0) -> None:
    """Any member of the set may take the slot over and delivers from the commit point it holds: an ack that
    reached broker 1 but not broker 2 (a member) is answered only once broker 2 was recorded out of the set;
    when that would take the set below 2, the ack is refused instead."""
    owner = slot0.owner(min_insync=2)
    await eventually_async(lambda: slot0.recorded() == (0, 1, 2), "both followers in the set")
    queue = dispatch_testing.lite_message("x", message_id="m0").queues[0]
    slot0.followers.down.add("b2")
    future = owner.note_commit(wire.Commit(queue, "g", 1, ()))
    assert future is not None
    await asyncio.wait_for(future, 5)  # answered: stored on broker 1 ...
    assert slot0.recorded() == (0, 1)  # ... and broker 2, which lacks it, out of the set before that
    slot0.followers.down.add("b1")
    refused = owner.note_commit(wire.Commit(queue, "g", 2, ()))
    assert refused is not None
    with pytest.raises(errors.NotEnoughReplicas, match="stored the ack: 1 of 2"):
        await asyncio.wait_for(refused, 5)
    assert slot0.recorded() == (0, 1)  # never below 2: broker 1 holds every commit point answered


@pytest.mark.asyncio
async def test_an_ack_whose_commit_copies_outlast_the_fence_is_refused(slot0: Slot0) -> None:
    """The followers stored the commit point, but the owner's fence closed while it waited for them: a follower
    may have taken the slot over without it, so the ack is refused (as a send's would be)."""
    owner = slot0.owner(min_insync=2)
    await eventually_async(lambda: slot0.recorded() == (0, 1, 2), "both followers in the set")
    queue = dispatch_testing.lite_message("x", message_id="m0").queues[0]
    slot0.followers.gate.clear()  # the commit copies wait
    future = owner.note_commit(wire.Commit(queue, "g", 1, ()))
    assert future is not None
    await eventually_async(lambda: slot0.followers.waiting == 2, "both commit copies under way")
    slot0.clock.now += DURATION_MS / 1000  # no renewal since: the fence closed
    assert slot0.leaders[0].epoch(0) is None
    slot0.followers.gate.set()
    with pytest.raises(errors.Fenced):
        await asyncio.wait_for(future, 5)
    # Counted by each ack it refuses (``Counters.ack_refused``, told by dispatch.settlement), not here: nobody may
    # be waiting (a hand-out write), and a count here would be one refusal more than clients saw.
    assert slot0.counted("lmq_replication_refused_total", {"reason": "fenced"}) == 0
    registry = CollectorRegistry()
    counters = copies.Counters(registry)
    counters.ack_refused(errors.Fenced("fenced"))
    counters.ack_refused(errors.NotEnoughReplicas("1 of 2"))
    counters.ack_refused(errors.BrokerUnavailable("stopping"))  # not a refusal of replication's
    name = "lmq_replication_refused_total"
    counted = {r: registry.get_sample_value(name, {"reason": r}) for r in ("fenced", "insync")}
    assert counted == {"fenced": 1, "insync": 1}


@pytest.mark.asyncio
async def test_a_follower_back_joins_the_set_only_once_it_stored_the_commit_points_it_missed(slot0: Slot0) -> None:
    """Broker 2 is recorded out of the set while a consumer acks (its commit copy failed); back, it answers a
    send at once, yet joins only after a probe gave it every commit point of the slot: a member without the ack
    would deliver the acked message again once it took the slot over."""
    owner = slot0.owner(min_insync=2)
    await eventually_async(lambda: slot0.recorded() == (0, 1, 2), "both followers in the set")
    queue = dispatch_testing.lite_message("x", message_id="m0").queues[0]
    slot0.followers.down.add("b2")
    slot0.points.append(wire.Commit(queue, "g", 1, ()))  # persisted by the owner, then noted
    future = owner.note_commit(wire.Commit(queue, "g", 1, ()))
    assert future is not None
    await asyncio.wait_for(future, 5)
    assert slot0.recorded() == (0, 1) and slot0.followers.commits["b2"] == []
    slot0.followers.down.clear()
    await owner.copy(*batch(0))  # broker 2 stores this one: it answers again
    await eventually_async(lambda: slot0.recorded() == (0, 1, 2), "broker 2 back in the set")
    assert slot0.followers.commits["b2"] == [("g", 1)]  # stored there before it joined


@pytest.mark.asyncio
async def test_a_commit_copy_waits_for_the_copy_of_the_messages_it_counts(slot0: Slot0) -> None:
    """A consumer may receive a message once it is stored here, before its copies reached the followers, and ack
    it: the commit copy must not overtake the message's copy (a follower clamps a commit point to its end, and
    would hold a lower one than the ack answered), so it is sent once the message's copy was stored there."""
    owner = slot0.owner(min_insync=2)
    await eventually_async(lambda: slot0.recorded() == (0, 1, 2), "both followers in the set")
    messages, results = batch(0)
    slot0.followers.messages_gate.clear()  # the message copies are slow
    send = asyncio.create_task(owner.copy(messages, results))
    await eventually_async(lambda: owner.lag() == [("b1", 1), ("b2", 1)], "the message copies under way")
    future = owner.note_commit(wire.Commit(messages[0].queues[0], "g", 1, ()))
    assert future is not None
    await asyncio.sleep(0.05)  # room for a commit copy that would overtake (none may)
    assert slot0.followers.arrived == {"b1": [], "b2": []}
    slot0.followers.messages_gate.set()
    await asyncio.wait_for(asyncio.gather(send, future), 5)
    assert slot0.followers.arrived == {"b1": ["m0", "commit"], "b2": ["m0", "commit"]}


@pytest.mark.asyncio
async def test_sends_stored_a_few_loop_passes_apart_go_to_each_follower_in_one_copy(slot0: Slot0) -> None:
    """A woken shipper lets a few event-loop passes go by before it takes its queue: sends stored in those
    passes share one copy (one stream message each way and one append on the follower), and each is
    acknowledged once that copy was stored on every member."""
    owner = slot0.owner(min_insync=2)
    await eventually_async(lambda: slot0.recorded() == (0, 1, 2), "both followers in the set")

    async def send(n: int) -> None:
        for _ in range(n):  # send n is stored n passes after the first
            await asyncio.sleep(0)
        await owner.copy(*batch(n))

    await asyncio.wait_for(asyncio.gather(*(send(n) for n in range(3))), 5)
    assert slot0.followers.copies == {"b1": [3], "b2": [3]}
    assert slot0.followers.stored == {"b1": ["m0", "m1", "m2"], "b2": ["m0", "m1", "m2"]}


@pytest.mark.asyncio
async def test_a_topics_ring_slot_is_reckoned_once_and_sends_go_on_under_its_slot(slot0: Slot0) -> None:
    """``Slots`` asks the ring for a topic's slot once (a hash of the name) and remembers it: the next sends of
    that topic take the same slot without asking again."""
    asked: list[str] = []

    def ring_slot(topic: str) -> int:
        asked.append(topic)
        return 0

    slots = owning.Slots(slot0.leaders[0], ring_slot, lambda _slot: slot0.owner(min_insync=1))
    for n in range(3):
        messages, results = batch(n)
        await slots.copy(slots.admit(messages), results)
    assert asked == [batch(0)[0][0].queues[1].topic]
    await eventually_async(lambda: slot0.followers.stored["b1"] == ["m0", "m1", "m2"], "the copies stored")


@pytest.mark.asyncio
async def test_a_member_answering_for_earlier_batches_wakes_only_their_waiters(slot0: Slot0) -> None:
    """A send at M > 1 waits for its batch: an answer for an earlier batch of the same member, all stored,
    leaves it waiting (nothing changed for it); its own answer wakes it."""
    owner = slot0.owner(min_insync=2)
    await eventually_async(lambda: slot0.recorded() == (0, 1, 2), "both followers in the set")
    keeper, shipper, epoch = owner.keeper, owner.keeper.shippers[1], slot0.leaders[0].epoch(0)
    assert epoch is not None
    slot0.followers.gate.clear()
    first = shipper.put(epoch, *batch(0))
    await eventually_async(lambda: slot0.followers.waiting == 1, "the first copy at the follower")
    second = shipper.put(epoch, *batch(1))
    early = asyncio.create_task(keeper.wait(5, (1, first)))
    late = asyncio.create_task(keeper.wait(5, (1, second)))
    await asyncio.sleep(0)
    slot0.followers.gate.set()
    await asyncio.sleep(0)  # the first copy passes the gate (its task was woken before this one)
    slot0.followers.gate.clear()
    await asyncio.wait_for(early, 5)
    assert shipper.done == first and not late.done()
    await eventually_async(lambda: slot0.followers.waiting == 1, "the second copy at the follower")
    assert not late.done()
    slot0.followers.gate.set()
    await asyncio.wait_for(late, 5)
    assert shipper.done == second and slot0.followers.stored["b1"] == ["m0", "m1"]


@pytest.mark.asyncio
async def test_a_member_slower_than_the_lag_budget_leaves_the_set_and_the_send_is_acknowledged_without_it(
    slot0: Slot0,
) -> None:
    """--replica-lag-max-ms: broker 2 answers nothing for a while (slow, not failed); once broker 1 stored the
    send and broker 2 lagged past the budget, broker 2 is recorded out and the send is answered, long before a
    failed call (2 s) would have removed it. Without a budget the send waits for it. Caught up, it joins again."""
    waiting = slot0.owner(min_insync=2)  # no budget
    await eventually_async(lambda: slot0.recorded() == (0, 1, 2), "both followers in the set")
    slot0.followers.slow.add("b2")
    held = asyncio.ensure_future(waiting.copy(*batch(0)))
    done, _ = await asyncio.wait([held], timeout=1.0)
    assert not done and slot0.recorded() == (0, 1, 2)  # held back by broker 2 alone
    slot0.followers.slow_gate.set()
    await held
    await waiting.close()
    slot0.followers.slow_gate.clear()
    slot0.registry = CollectorRegistry()  # another owner's counters
    owner = slot0.owner(min_insync=2, lag_max_s=0.2)
    await eventually_async(lambda: slot0.recorded() == (0, 1, 2), "both followers in the set")
    began = asyncio.get_running_loop().time()
    await owner.copy(*batch(1))
    assert asyncio.get_running_loop().time() - began < 1.0
    assert slot0.recorded() == (0, 1)  # the lease said so before the answer went out
    assert slot0.followers.stored["b1"][-1] == "m1" and "m1" not in slot0.followers.stored["b2"]
    slot0.followers.slow_gate.set()
    await eventually_async(lambda: slot0.recorded() == (0, 1, 2), "broker 2 caught up and back in the set")


@pytest.mark.asyncio
async def test_the_lag_budget_never_takes_the_set_below_min_insync(slot0: Slot0) -> None:
    """At --min-insync-replicas 3 a slow member cannot leave: the send is refused (retriable), the set stays."""
    owner = slot0.owner(min_insync=3, lag_max_s=0.2)
    await eventually_async(lambda: slot0.recorded() == (0, 1, 2), "both followers in the set")
    slot0.followers.slow.add("b2")
    with pytest.raises(errors.NotEnoughReplicas, match="not enough in-sync replicas of slot 0: 2 of 3"):
        await owner.copy(*batch(0))
    assert slot0.recorded() == (0, 1, 2)
    assert slot0.counted("lmq_replication_refused_total", {"reason": "insync"}) == 1
    slot0.followers.slow_gate.set()


@pytest.mark.asyncio
async def test_a_send_waiting_while_a_new_follower_is_followed_is_acknowledged_once_that_follower_joined(
    slot0: Slot0,
) -> None:
    """A ring change follows a new replica while a send waits for its copies (``Owner.follow``): the new one
    was not numbered for that send's batch (it was taken for failed, the send refused, or raised ``KeyError``);
    once a probe took it into the set it counts as holding the batch (the probe began after it was stored)."""
    slot0.followers.slow.add("b1")  # broker 1's copies and probes hang: it is hopeful, never answering
    owner = copies.Owner(
        slot0.leaders[0],
        0,
        {1: "b1"},
        2,
        (slot0.followers.send, nothing, no_tails, slot0.stored_points),
        copies.Counters(slot0.registry),
        queue_messages=100,
        probe_interval_s=0.05,
    )
    slot0.owners.append(owner)
    send = asyncio.ensure_future(owner.copy(*batch(0)))
    await asyncio.sleep(0.1)
    assert not send.done()  # waiting: only the owner holds it, broker 1 may still join
    owner.follow({2: "b2"})
    await asyncio.wait_for(send, copies.ACK_TIMEOUT_S + 2)  # neither KeyError nor a refusal
    assert 2 in (slot0.recorded() or ())
    slot0.followers.slow_gate.set()
