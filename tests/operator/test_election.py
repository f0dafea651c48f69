"""Leader election's rules, on the in-memory Lease store with a fake clock (the real apiserver, two real
operator processes and the RBAC: test_leadership.py)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from lmq_operator import leadership, settings

T0 = datetime(2026, 3, 4, 5, 6, 7, 890, tzinfo=UTC)


class Clock:
    """Monotonic and wall time that move only when a candidate sleeps (or the test says so)."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> datetime:
        return T0 + timedelta(seconds=self.now)

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


def elector(store: leadership.LeaseStore, clock: Clock, who: str) -> leadership.Elector:
    conf = leadership.LeaseConfig("lmq-operator", "mq", who, duration_s=15, renew_deadline_s=10, retry_s=2)
    return leadership.Elector(store, conf, monotonic=clock.monotonic, wall=clock.wall, sleep=clock.sleep)


def test_the_first_candidate_creates_the_lease_and_a_second_cannot_take_a_renewed_one() -> None:
    async def scenario() -> None:
        store, clock = leadership.MemoryLeases(), Clock()
        a, b = elector(store, clock, "a"), elector(store, clock, "b")
        assert await a.try_acquire() and a.leading
        assert store.lease is not None and leadership.holder(store.lease) == "a"
        spec = store.lease["spec"]
        assert spec["leaseDurationSeconds"] == 15 and spec["acquireTime"] == spec["renewTime"]
        assert spec["leaseTransitions"] == 0
        for _ in range(20):  # 40 s of a renewing leader: b never gets it
            clock.now += 2
            assert await a._renew()
            assert not await b.try_acquire() and not b.leading
        assert leadership.holder(store.lease) == "a"

    asyncio.run(scenario())


def test_a_lease_not_renewed_for_a_lease_duration_is_taken_over() -> None:
    async def scenario() -> None:
        store, clock = leadership.MemoryLeases(), Clock()
        a, b = elector(store, clock, "a"), elector(store, clock, "b")
        await a.try_acquire()
        assert not await b.try_acquire()  # b first sees the record now
        clock.now += 14.9
        assert not await b.try_acquire()  # not yet a whole lease duration since b saw it change
        clock.now += 0.2
        assert await b.try_acquire()
        assert store.lease is not None
        spec = store.lease["spec"]
        assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("b", 1)
        assert spec["acquireTime"] == leadership.micro_time(clock.wall())
        # the old leader, back, finds the Lease taken: it is no longer leading and does not write
        assert not await a._renew() and not a.leading
        assert leadership.holder(store.lease) == "b"

    asyncio.run(scenario())


def test_of_two_candidates_racing_for_a_free_lease_exactly_one_wins() -> None:
    async def scenario() -> None:
        store, clock = leadership.MemoryLeases(), Clock()
        a, b = elector(store, clock, "a"), elector(store, clock, "b")
        won = await asyncio.gather(a.try_acquire(), b.try_acquire())
        assert sorted(won) == [False, True]
        assert [a.leading, b.leading].count(True) == 1
        # and again when the Lease exists but is free (released): both read it, one write wins
        leader = a if a.leading else b
        await leader.release()
        assert store.lease is not None and leadership.holder(store.lease) == ""
        won = await asyncio.gather(a.try_acquire(), b.try_acquire())
        assert sorted(won) == [False, True]

    asyncio.run(scenario())


def test_a_released_lease_is_taken_at_once_and_counts_a_transition() -> None:
    async def scenario() -> None:
        store, clock = leadership.MemoryLeases(), Clock()
        a, b = elector(store, clock, "a"), elector(store, clock, "b")
        await a.try_acquire()
        assert not await b.try_acquire()
        await a.release()
        assert not a.leading
        assert store.lease is not None and store.lease["spec"]["leaseDurationSeconds"] == 1
        assert await b.try_acquire()  # no waiting for the 15 s to pass
        assert store.lease["spec"]["leaseTransitions"] == 1

    asyncio.run(scenario())


def test_a_leader_that_cannot_renew_gives_up_after_the_renew_deadline_before_the_lease_runs_out() -> None:
    async def scenario() -> None:
        store, clock = leadership.MemoryLeases(), Clock()
        a = elector(store, clock, "a")
        await a.try_acquire()
        assert store.lease is not None
        last_renewal = clock.now
        store.down = True  # partitioned from the apiserver
        await a.hold()
        assert not a.leading
        gave_up_after = clock.now - last_renewal
        assert 10 <= gave_up_after < 15  # the renew deadline, and before anyone may take the Lease over

    asyncio.run(scenario())


def test_a_leader_keeps_renewing_while_it_can() -> None:
    async def scenario() -> None:
        store, clock = leadership.MemoryLeases(), Clock()
        a = elector(store, clock, "a")
        await a.try_acquire()
        holding = asyncio.create_task(a.hold())
        for _ in range(50):  # 100 s of renewals, one hiccup of 6 s (within the deadline) in the middle
            store.down = 20 <= _ < 23
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        assert not holding.done() and a.leading
        assert store.lease is not None and leadership.holder(store.lease) == "a"
        holding.cancel()

    asyncio.run(scenario())


def test_acquire_waits_as_a_standby_until_the_holder_is_gone() -> None:
    async def scenario() -> None:
        store, clock = leadership.MemoryLeases(), Clock()
        a, b = elector(store, clock, "a"), elector(store, clock, "b")
        await a.try_acquire()
        started = clock.now
        await b.acquire()  # a never renews: b gets it once a lease duration passed on its clock
        assert b.leading and 15 <= clock.now - started <= 15 + 2

    asyncio.run(scenario())


def test_micro_time_always_has_six_fraction_digits() -> None:
    assert leadership.micro_time(datetime(2026, 1, 1, tzinfo=UTC)) == "2026-01-01T00:00:00.000000Z"
    assert leadership.micro_time(T0) == "2026-03-04T05:06:07.000890Z"


def test_lease_settings() -> None:
    base = {"LMQ_OPERATOR_BROKERS": "a:1"}
    assert settings.from_env(base).lease is None
    conf = settings.from_env(
        {**base, "LMQ_OPERATOR_LEASE_NAME": "op", "LMQ_OPERATOR_LEASE_NAMESPACE": "mq", "LMQ_OPERATOR_POD_NAME": "p-0"}
    )
    assert conf.lease == leadership.LeaseConfig("op", "mq", "p-0", 15.0, 10.0, 2.0)
    assert conf.identity == "p-0"
    with pytest.raises(settings.SettingsError, match="LMQ_OPERATOR_LEASE_NAMESPACE"):
        settings.from_env({**base, "LMQ_OPERATOR_LEASE_NAME": "op"})
    with pytest.raises(settings.SettingsError, match="retry < renew deadline < lease duration"):
        settings.from_env(
            {
                **base,
                "LMQ_OPERATOR_LEASE_NAME": "op",
                "LMQ_OPERATOR_LEASE_NAMESPACE": "mq",
                "LMQ_OPERATOR_LEASE_RENEW_DEADLINE_SECONDS": "20",
            }
        )
    # without a pod name two processes on one host still differ
    assert settings.from_env(base).identity != settings.from_env(base).identity
