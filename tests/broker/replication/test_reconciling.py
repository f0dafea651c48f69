"""A follower's reconciling is tried again on its own (``lmq_broker.replication.reconciling``): after a failure,
with a capped exponential backoff with jitter, and at once when the slot falls out of sync. The loop runs for
real on the event loop; the follower and its leases are stand-ins (the whole path, with broker processes and
the real apiserver: test_replication_failover.py,
test_a_follower_whose_reconcile_failed_is_in_sync_again_on_its_own_and_takes_over)."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from waiting import eventually_async

from lmq_broker import errors, model
from lmq_broker.config import StoreConfig
from lmq_broker.replication import reconciling, sources, wire
from lmq_broker.storage import store as lmq_store


def test_the_backoff_doubles_up_to_its_cap_and_draws_from_the_upper_half() -> None:
    highest = reconciling.Backoff(0.1, 1.0, lambda: 1.0)
    assert [round(highest.next(), 3) for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    lowest = reconciling.Backoff(0.1, 1.0, lambda: 0.0)
    assert [round(lowest.next(), 3) for _ in range(5)] == [0.05, 0.1, 0.2, 0.4, 0.5]
    assert reconciling.Backoff(0.1, 0.01, lambda: 1.0).next() == 0.1  # a cap below the first wait: the first


class _Leases:
    me, mine, holders = 1, [0], {0: "slot-0/x"}

    def __init__(self) -> None:
        self.epochs = {0: 1}

    def holds(self, slot: int) -> bool:
        return False


class _Follower:
    def __init__(self) -> None:
        self.reconciled: dict[int, int] = {}
        self.on_out_of_sync: Any = lambda slot: None

    def in_sync(self, slot: int, epoch: int) -> bool:
        return self.reconciled.get(slot) == epoch

    def out_of_sync(self, slot: int) -> None:
        self.reconciled.pop(slot, None)
        self.on_out_of_sync(slot)


@pytest.mark.asyncio
async def test_a_failed_reconcile_is_tried_again_and_falling_out_of_sync_wakes_the_loop_at_once() -> None:
    leases, follower, registry = _Leases(), _Follower(), CollectorRegistry()
    attempts: list[float] = []

    async def attempt(slot: int) -> bool:
        attempts.append(time.monotonic())
        if len(attempts) <= 3:
            raise errors.BrokerUnavailable("timed out")
        follower.reconciled[slot] = 1
        return True

    cap_s = 30.0  # a turn of the loop every 30 s at the latest: only the backoff and the wake-up come sooner
    loop: Any = reconciling.Reconciler(leases, follower, attempt, registry, cap_s)  # type: ignore[arg-type]
    stopping = asyncio.Event()
    task = asyncio.create_task(loop.run(stopping))

    def count(result: str) -> float:
        return registry.get_sample_value("lmq_replication_reconciles_total", {"result": result}) or 0

    try:
        await eventually_async(lambda: follower.in_sync(0, 1), "in sync after three failures", 5)
        assert count("failed") == 3 and count("ok") == 1
        waits = [b - a for a, b in itertools.pairwise(attempts)]
        assert 0.05 <= waits[0] < waits[2] < 1.0  # 0.05-0.1, 0.1-0.2, 0.2-0.4 s (and a little scheduling)
        fell = time.monotonic()
        follower.out_of_sync(0)  # a copy found it behind
        await eventually_async(lambda: follower.in_sync(0, 1), "in sync again", 5)
        assert attempts[-1] - fell < 1.0 and count("ok") == 2  # at once, not at the next 30 s turn
    finally:
        stopping.set()
        await asyncio.wait_for(task, 5)


def test_a_fetch_is_a_page_of_at_most_fetch_bytes_of_bodies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reconcile's Fetch answers 1,000 messages at most, and stops early past ``FETCH_BYTES`` of bodies (a
    message larger than that still comes, alone): each call a bounded amount of work within its deadline."""
    monkeypatch.setattr(sources, "FETCH_BYTES", 2_500)
    queue = model.QueueId.lmq("P", "a")
    store = lmq_store.LmqStore(StoreConfig(data_dir=tmp_path))
    try:
        sizes = [1_000, 1_000, 1_000, 4_000, 10]
        messages = [model.NewMessage(f"m{n}", "P", b"x" * size, (queue,)) for n, size in enumerate(sizes)]
        store.append(messages)
        pages, start = [], 0
        while start < len(sizes):
            copy = wire.decode(sources.fetch(store, 0, 1, queue.topic, start))
            pages.append([m.message_id for m in copy.messages])
            start += len(copy.messages)
    finally:
        store.close()
    assert pages == [["m0", "m1"], ["m2"], ["m3"], ["m4"]]
