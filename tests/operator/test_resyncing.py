"""The resync loop's schedule and the compact copy it reads, with a fake clock (the loop repairing drift on a
real apiserver and real brokers: test_operator.py)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import kopf

from lmq_operator import model, resyncing

PT, LG = model.Kind.PARENT_TOPIC, model.Kind.LITE_GROUP
RAW: dict[str, Any] = {
    "apiVersion": "lmq.io/v1alpha1",
    "kind": "LiteGroup",
    "metadata": {
        "name": "workers",
        "namespace": "apps",
        "uid": "u-1",
        "generation": 3,
        "creationTimestamp": "2026-01-01T00:00:00Z",
        "resourceVersion": "812",
        "finalizers": ["lmq.io/finalizer"],
        "annotations": {
            "lmq.io/pause-reconciliation": "true",
            "lmq.io/last-handled-configuration": '{"spec": {}}',
            "kubectl.kubernetes.io/last-applied-configuration": "{...}",
        },
        "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}],
    },
    "spec": {"parentTopic": "events", "retryPolicy": {"maxAttempts": 4, "backoff": ["1s"]}},
    "status": {"observedGeneration": 2, "conditions": [{"type": "Ready", "status": "True"}], "brokers": []},
}


def test_the_compact_copy_keeps_what_a_reconcile_reads_and_drops_the_rest() -> None:
    for body in (RAW, kopf.Body(cast(Any, RAW))):  # kopf hands its Body (mapping views), tests and tools plain dicts
        copy = resyncing.expand(resyncing.compact(body))
        assert copy["spec"] == RAW["spec"] and copy["status"] == RAW["status"]
        assert (copy["apiVersion"], copy["kind"]) == ("lmq.io/v1alpha1", "LiteGroup")
        assert copy["metadata"] == {
            "name": "workers",
            "namespace": "apps",
            "uid": "u-1",
            "generation": 3,
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "annotations": {"lmq.io/pause-reconciliation": "true"},  # ours only: it obeys those
        }
    assert len(resyncing.compact(RAW)) < 400


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        for _ in range(5):  # whatever was started before the sleep runs first, at the time it was started
            await asyncio.sleep(0)
        self.now += seconds


def test_a_pass_spreads_every_resource_over_the_interval_and_repeats() -> None:
    async def scenario() -> None:
        clock = Clock()
        entries = [(PT, "a"), (PT, "b"), (LG, "c"), (LG, "d")]
        seen: list[tuple[float, str]] = []

        async def resync(kind: model.Kind, uid: str) -> None:
            seen.append((clock.now, uid))

        task = asyncio.create_task(
            resyncing.run(lambda: entries, resync, interval_s=60.0, clock=clock, sleep=clock.sleep)
        )
        while len(seen) < 8:
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        # the first pass an interval after the start (resume has just reconciled everything), each 15 s apart
        assert seen[:8] == [
            (60.0, "a"),
            (75.0, "b"),
            (90.0, "c"),
            (105.0, "d"),
            (120.0, "a"),
            (135.0, "b"),
            (150.0, "c"),
            (165.0, "d"),
        ]

    asyncio.run(scenario())


def test_at_most_concurrency_resyncs_run_and_a_failing_one_does_not_stop_the_loop() -> None:
    async def scenario() -> None:
        clock = Clock()
        entries = [(PT, str(i)) for i in range(10)]
        running, peak, done = 0, 0, []
        release = asyncio.Event()

        async def resync(kind: model.Kind, uid: str) -> None:
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            try:
                if uid == "3":
                    raise RuntimeError("broken broker seam")
                await release.wait()
                done.append(uid)
            finally:
                running -= 1

        task = asyncio.create_task(
            resyncing.run(lambda: entries, resync, interval_s=10.0, concurrency=3, clock=clock, sleep=clock.sleep)
        )
        for _ in range(50):
            await asyncio.sleep(0)
        assert peak == 3 and running == 3  # the rest wait for a slot, even past their turn
        release.set()
        while len(done) < 9:
            await asyncio.sleep(0)
        assert sorted(done) == sorted(str(i) for i in range(10) if i != 3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())


def test_resources_that_appear_join_the_next_pass() -> None:
    async def scenario() -> None:
        clock = Clock()
        entries: list[resyncing.Entry] = [(PT, "a")]
        seen: list[str] = []

        async def resync(kind: model.Kind, uid: str) -> None:
            seen.append(uid)
            entries.append((PT, "b"))

        task = asyncio.create_task(
            resyncing.run(lambda: list(entries), resync, interval_s=5.0, clock=clock, sleep=clock.sleep)
        )
        while len(seen) < 3:
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert seen[:3] == ["a", "a", "b"]

    asyncio.run(scenario())


def test_a_sweep_visits_every_entry_once_now_with_bounded_concurrency_and_survives_failures() -> None:
    entries = [(PT, f"u{i}") for i in range(50)]
    seen: list[str] = []
    running = peak = 0

    async def visit(kind: model.Kind, uid: str) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0)  # let the other workers start theirs
        running -= 1
        seen.append(uid)
        if uid == "u7":
            raise RuntimeError("one resource's trouble")

    asyncio.run(resyncing.sweep(entries, visit, concurrency=4))
    assert sorted(seen) == sorted(uid for _, uid in entries) and len(seen) == 50
    assert peak == 4
