"""Per-arrival dispatch cost of lite topic patterns, as the number of registered patterns grows.

Definition printed with the result: a dispatcher (in-memory store, manual clock) holds N patterns, N in
(1, 100, 10,000), registered by RocketMQ clients through ``add_lite`` (1,000 per client, one group): half
prefix patterns ``p<i>-*``, half level filters ``d<i>/+/cmd``. We time ``Deliverer.arrived`` (the code an
append's arrival signal runs) for single arrivals whose lite topic matches exactly one pattern (offered to
its client; the same 64 topics round-robin, so after the first round each offer finds the topic queued) and
for arrivals that match none, in CPU µs per arrival (robust to a shared machine's noise). The figure is
cost(10,000) / cost(1): 1 means the cost does not grow with the patterns registered. For contrast the
same arrivals are matched by a linear scan over every pattern (``wildcards.matches`` per pattern).

    python bench/bench_lite_patterns.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from lmq_broker import model
from lmq_broker.dispatch import testing, wildcards
from lmq_broker.dispatch.dispatcher import Dispatcher
from lmq_broker.storage.memory import ManualClock, MemoryStore

SIZES = (1, 100, 10_000)
PER_CLIENT = 1000
TARGET_RATIO = 2.0
T = TypeVar("T")


def figure(name: str, value: float, unit: str, *, target: float, extra: str = "") -> None:
    verdict = "PASS" if value <= target else "ABOVE TARGET"
    print(f"FIGURE {name}: {value:,.2f} {unit} (target <= {target:,.2f} {unit}) {verdict}{extra}", flush=True)


def pattern(i: int) -> str:
    return f"p{i:05d}-*" if i % 2 == 0 else f"d{i:05d}/+/cmd"


def matching_name(i: int) -> str:
    return f"p{i:05d}-x" if i % 2 == 0 else f"d{i:05d}_7_cmd"


async def dispatcher_with(n: int, root: Path) -> Dispatcher:
    config = testing.config_for(root, max_subscriptions_per_broker=max(n, 1) * 2)
    store = MemoryStore(config.store)
    store.put_parent_topic(model.ParentTopic(testing.PARENT))
    store.put_group(model.LiteGroup(testing.GROUP, testing.PARENT, client_quota=PER_CLIENT, ready_capacity=1000))
    d = Dispatcher(store, config, clock=ManualClock(1_000_000))
    await d.start()
    for start in range(0, n, PER_CLIENT):
        batch = [pattern(i) for i in range(start, min(n, start + PER_CLIENT))]
        await d.add_lite(f"client-{start // PER_CLIENT}", testing.GROUP, testing.PARENT, batch)
    while d.runtime.tasks:  # the registrations' catch-up passes (an empty store: nothing to find)
        await asyncio.sleep(0.001)
    return d


def cpu_us_per_call(call: Callable[[T], object], args: list[T], rounds: int) -> float:
    """Median over ``rounds`` of the process CPU time per call, in µs."""
    per_round = []
    for _ in range(rounds):
        t = time.process_time()
        for a in args:
            call(a)
        per_round.append((time.process_time() - t) / len(args) * 1e6)
    return statistics.median(per_round)


async def measure(n: int, root: Path, arrivals: int, rounds: int) -> tuple[float, float, float]:
    d = await dispatcher_with(n, root)
    wanted = [min(n - 1, (k * 7919) % n) for k in range(64)]
    hits = [{model.QueueId.lmq(testing.PARENT, matching_name(i)).topic: None} for i in wanted]
    misses = [{model.QueueId.lmq(testing.PARENT, f"zz-{k}_none").topic: None} for k in range(64)]
    for arrival in hits:
        d.deliverer.arrived(arrival)
    assert d.ready.total() == len(set(wanted)), "each matching arrival is offered to its pattern's client"
    hit_us = cpu_us_per_call(d.deliverer.arrived, [hits[k % 64] for k in range(arrivals)], rounds)
    miss_us = cpu_us_per_call(d.deliverer.arrived, [misses[k % 64] for k in range(arrivals)], rounds)
    filters = [wildcards.parse_pattern(pattern(i)) for i in range(n)]
    names = [matching_name(i).split(wildcards.LEVEL_SEPARATOR) for i in wanted]

    def linear(levels: list[str]) -> None:
        for f in filters:
            wildcards.matches(f, levels)

    linear_us = cpu_us_per_call(linear, [names[k % 64] for k in range(64)], 1)
    await d.close()
    return hit_us, miss_us, linear_us


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer arrivals and rounds (a smoke run)")
    args = parser.parse_args()
    arrivals, rounds = (2_000, 3) if args.quick else (20_000, 7)
    print(__doc__.split("\n\n")[1], flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in SIZES:
            hit, miss, linear = await measure(n, Path(tmp) / str(n), arrivals, rounds)
            results[n] = (hit, miss)
            print(
                f"N={n:>6,} patterns: matching arrival {hit:7.2f} µs, non-matching arrival {miss:7.2f} µs "
                f"(a linear scan of every pattern: {linear:9.2f} µs)",
                flush=True,
            )
    (hit_1, miss_1), (hit_n, miss_n) = results[1], results[10_000]
    extra = f" (matching arrivals; {hit_n:.2f} vs {hit_1:.2f} µs)"
    figure(
        "per-arrival dispatch cost, 10,000 patterns ÷ 1 pattern", hit_n / hit_1, "x", target=TARGET_RATIO, extra=extra
    )
    figure("per-arrival cost of a non-matching arrival, 10,000 patterns ÷ 1 pattern", miss_n / miss_1, "x",
           target=TARGET_RATIO)  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
