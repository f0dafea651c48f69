"""Does the in-broker lite-topic expiry stall the serving loop? Loop lag and send latency while a pass runs over
100k lite topics (10% of them idle past the parent's expiration), against the same load without a pass.

In one process, as in the broker: an LmqStore (RocksDB + segments, async flush) filled through the store API
with an injected clock (one block of 1000 topics in ten two hours old, expiration 60 min), a dispatcher on the
event loop with the broker's GIL switch interval, a probe that sleeps 1 ms at a time and records how late it
wakes (the loop's lag) and how much CPU the loop's thread spent meanwhile (work that ran on the loop, which the
machine's other load does not inflate as it does the lag), and a sender that stores a message into one of 1000
fresh lite topics every 2 ms through the dispatcher (its latency is what a client would see). Each round copies
the generated store, runs the load alone (baseline), then the load during one pass with the broker's defaults
(batch 1000, 20 ms between steps; without the CPU-share pacing, which only lengthens the pauses), with no pause
at all (steps back to back, the worst case of the stepped pass) and with the defaults over topics of which none
expires (reads only). For reference it also times one unbounded read of the whole parent, the stall a full scan
on the loop would be.

    python bench/bench_lite_ttl.py             # 100k topics, 3 rounds (~2-3 min)
    python bench/bench_lite_ttl.py --quick     # 10k topics, 1 round
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from lmq_broker import config, model
from lmq_broker.admin import expiry
from lmq_broker.dispatch import testing as dispatch_testing
from lmq_broker.dispatch.dispatcher import Dispatcher
from lmq_broker.storage import store as store_mod
from lmq_broker.storage.api import Store

PARENT = "Agent"
EXPIRATION_MIN = 60
BLOCK = 1_000
OLD_EVERY = 10
T0_MS = 1_750_000_000_000
NOW_MS = T0_MS + 120 * 60_000
SWITCH_INTERVAL_S = 0.0005  # lmq_broker.__main__ sets the same
PROBE_S = 0.001
SEND_EVERY_S = 0.002
BASELINE_S = 2.0
WARMUP_S = 0.5
DEFAULTS = config.BrokerConfig()


def generate(data_dir: Path, topics: int) -> int:
    """Fill a store; returns how many topics are idle past the expiration."""
    clock = [T0_MS]
    store = store_mod.open_store(
        config.StoreConfig(data_dir=data_dir, flush_mode=config.FlushMode.ASYNC), lambda: clock[0]
    )
    expired = 0
    try:
        store.put_parent_topic(model.ParentTopic(PARENT, expiration_minutes=EXPIRATION_MIN))
        for b, start in enumerate(range(0, topics, BLOCK)):
            n = min(BLOCK, topics - start)
            old = b % OLD_EVERY == 0
            expired += n if old else 0
            clock[0] = T0_MS if old else NOW_MS - 5 * 60_000
            store.append(
                [
                    dispatch_testing.lite_message(f"s-{start + i:08d}", parent=PARENT, message_id=f"g{start + i}")
                    for i in range(n)
                ]
            )
        store.flush()
    finally:
        store.close()
    return expired


@dataclass
class Load:
    lags_ms: list[float]
    sends_ms: list[float]
    busy_ms: list[float]  # CPU time of the loop's thread during each probe window: work that ran on the loop

    def line(self) -> str:
        lags, sends, busy = sorted(self.lags_ms), sorted(self.sends_ms), sorted(self.busy_ms)
        return (
            f"loop lag max {lags[-1]:.2f} ms p99.9 {pct(lags, 0.999):.2f} ms p99 {pct(lags, 0.99):.2f} ms "
            f"({len(lags)} probes); loop CPU per probe window max {busy[-1]:.2f} ms p99 {pct(busy, 0.99):.2f} ms; "
            f"send latency max {sends[-1]:.2f} ms p99 {pct(sends, 0.99):.2f} ms p50 {pct(sends, 0.5):.2f} ms "
            f"({len(sends)} sends)"
        )


def pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


async def under_load(dispatcher: Dispatcher, work: Callable[[], Awaitable[object]]) -> tuple[Load, object]:
    """Run ``work`` while probing the loop and sending; the load's figures and what ``work`` returned."""
    load = Load([], [], [])
    done = False

    async def probe() -> None:
        while not done:
            started, cpu = time.perf_counter(), time.thread_time()
            await asyncio.sleep(PROBE_S)
            load.lags_ms.append((time.perf_counter() - started - PROBE_S) * 1000)
            load.busy_ms.append((time.thread_time() - cpu) * 1000)

    async def sender() -> None:
        i = 0
        while not done:
            message = dispatch_testing.lite_message(f"hot-{i % 1000:04d}", parent=PARENT, message_id=f"h{i}")
            started = time.perf_counter()
            await dispatcher.send([message])
            load.sends_ms.append((time.perf_counter() - started) * 1000)
            i += 1
            await asyncio.sleep(SEND_EVERY_S)

    tasks = [asyncio.create_task(probe()), asyncio.create_task(sender())]
    try:
        result = await work()
    finally:
        done = True
        await asyncio.gather(*tasks)
    return load, result


@dataclass(frozen=True)
class Variant:
    name: str
    pause_ms: int
    min_age_ms: int  # the defaults' 15 min lets the 2-hour-old topics expire; "never" lets none

    @property
    def expires(self) -> bool:
        return self.min_age_ms < NOW_MS - T0_MS


VARIANTS = (
    Variant("defaults", DEFAULTS.lite_ttl_step_pause_ms, DEFAULTS.lite_ttl_min_age_ms),
    Variant("no pause", 0, DEFAULTS.lite_ttl_min_age_ms),
    Variant("defaults, nothing expires", DEFAULTS.lite_ttl_step_pause_ms, 10**15),
)


async def one_round(source: Path, scratch: Path, topics: int, variant: Variant) -> dict[str, object]:
    data = scratch / "data"
    shutil.rmtree(data, ignore_errors=True)
    shutil.copytree(source, data)
    clock = [NOW_MS]
    store: Store = store_mod.open_store(
        config.StoreConfig(data_dir=data, flush_mode=config.FlushMode.ASYNC), lambda: clock[0]
    )
    dispatcher = Dispatcher(store, dispatch_testing.config_for(data), wall_clock=lambda: clock[0])
    await dispatcher.start()
    try:
        await under_load(dispatcher, lambda: asyncio.sleep(WARMUP_S))  # first sends, caches: not measured
        baseline, _ = await under_load(dispatcher, lambda: asyncio.sleep(BASELINE_S))
        settings = expiry.Settings(
            interval_ms=DEFAULTS.lite_ttl_interval_ms,
            batch=DEFAULTS.lite_ttl_batch,
            step_pause_ms=variant.pause_ms,
            min_age_ms=variant.min_age_ms,
            cpu_share=0.0,  # the step pause alone: the CPU-share pacing (default 0.0025) only lengthens a pass
        )
        during, report = await under_load(
            dispatcher, lambda: expiry.run_pass(store, dispatcher, settings, lambda: clock[0])
        )
        assert isinstance(report, expiry.Report)
        started = time.perf_counter()
        everything = store.scan_lite_topics(PARENT, limit=topics + 1000)  # on the loop, on purpose: the reference
        full_scan_ms = (time.perf_counter() - started) * 1000
        assert len(everything) >= topics - report.deleted  # plus the hot topics the sender created
    finally:
        await dispatcher.close()
        store.close()
    return {"baseline": baseline, "during": during, "report": report, "full_scan_ms": full_scan_ms}


@dataclass
class Worst:
    """The worst figure of each kind over the rounds."""

    lag: float = 0.0
    lag_p99: float = 0.0
    busy: float = 0.0
    send_p99: float = 0.0

    def add(self, load: Load) -> None:
        self.lag = max(self.lag, *load.lags_ms)
        self.lag_p99 = max(self.lag_p99, pct(sorted(load.lags_ms), 0.99))
        self.busy = max(self.busy, *load.busy_ms)
        self.send_p99 = max(self.send_p99, pct(sorted(load.sends_ms), 0.99))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10k topics, one round")
    ap.add_argument("--topics", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    topics, rounds = (10_000, 1) if args.quick else (args.topics, args.rounds)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    with tempfile.TemporaryDirectory(prefix="bench-lite-ttl-") as tmp:
        scratch = Path(tmp)
        started = time.perf_counter()
        expired = generate(scratch / "source", topics)
        took = time.perf_counter() - started
        print(f"generated {topics} lite topics ({expired} idle past the expiration) in {took:.1f} s")
        worst = {v.name: Worst() for v in VARIANTS}
        without = Worst()
        for r in range(rounds):
            for variant in VARIANTS:
                got = asyncio.run(one_round(scratch / "source", scratch, topics, variant))
                report = got["report"]
                assert isinstance(report, expiry.Report), report
                assert report.deleted == (expired if variant.expires else 0), report
                baseline, during = got["baseline"], got["during"]
                assert isinstance(baseline, Load) and isinstance(during, Load)
                worst[variant.name].add(during)
                without.add(baseline)
                print(
                    f"round {r + 1} {variant.name} (pause {variant.pause_ms} ms): pass {report.seconds:.2f} s, "
                    f"{report.scanned} read ({report.scanned / report.seconds:,.0f}/s), {report.deleted} deleted, "
                    f"longest step {report.longest_step_s * 1000:.1f} ms; full scan on the loop would stall "
                    f"{got['full_scan_ms']:.0f} ms"
                )
                print(f"  baseline: {baseline.line()}")
                print(f"  during:   {during.line()}")
        n = f"{topics // 1000}k"
        print(
            f"FIGURE lite-ttl same load without a pass: loop CPU per 1 ms window max {without.busy:.2f} ms, loop lag "
            f"p99 {without.lag_p99:.2f} ms max {without.lag:.2f} ms, send p99 {without.send_p99:.2f} ms (worst of "
            f"{rounds * len(VARIANTS)} baselines)"
        )
        for name, w in worst.items():
            print(
                f"FIGURE lite-ttl pass over {n} topics, {name}: loop CPU per 1 ms window max {w.busy:.2f} ms, loop lag "
                f"p99 {w.lag_p99:.2f} ms max {w.lag:.2f} ms, send p99 {w.send_p99:.2f} ms (worst of {rounds} round(s))"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
