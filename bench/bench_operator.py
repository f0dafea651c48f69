"""Operator benchmark on a real kube-apiserver + etcd with two real brokers and the operator as a process.

Prints:
  * apply -> Ready latency: a ParentTopic is POSTed, the time until its status says Ready=True with every
    broker in sync (observedGeneration current); p50/p99 over N resources (goal p99 <= 2 s), twice: created
    back to back (burst), and one every 100 ms (paced). Readiness is seen through a watch, so the figure is
    not rounded to a polling interval.
  * pair latency: a LiteGroup POSTed and its ParentTopic right after it (one GitOps sync applying both; the
    brokers refuse the group until its parent exists), one pair every 100 ms; the time from the LiteGroup's
    POST until it is Ready on every broker (goal p99 <= 1 s: the group does not wait out a retry delay).
  * the operator's CPU (share of one core) and peak RSS while the rest of the resources arrive back to back
    (a GitOps sync of a whole repository: the moment the operator once ran out of memory), then its CPU and
    RSS over a steady-state window after all of them are Ready (resync timers and drift checks running at
    the shipped interval). The window should cover one resync interval (60 s).

    python bench/bench_operator.py                     # 100 latency samples, 10,000 topics, 60 s window
    python bench/bench_operator.py --resources 1000    # the same at another scale
    python bench/bench_operator.py --quick             # 20 samples, 100 topics, 3 s window (smoke)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from lmq_broker import testing as broker_testing
from lmq_operator import testing

NAMESPACE = "bench"
P99_GOAL_S = 2.0
PAIR_P99_GOAL_S = 1.0


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class ReadyWatch:
    """Records, per object name, the first time a watch event shows it Ready on every broker."""

    def __init__(self, api: testing.KubeAPI, plural: str = "parenttopics") -> None:
        self.api = api
        self.plural = plural
        self.ready_at: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            path = testing.cr_path(self.plural, NAMESPACE) + "?watch=1&timeoutSeconds=30"
            req = urllib.request.Request(self.api.server + path, headers={"Authorization": f"Bearer {self.api.token}"})
            try:
                with urllib.request.urlopen(req, context=self.api._ssl, timeout=60) as resp:
                    for line in resp:
                        if self._stop.is_set():
                            return
                        event = json.loads(line)
                        if event.get("type") in ("ADDED", "MODIFIED"):  # not ERROR (an expired watch) or BOOKMARK
                            self._seen(event["object"])
            except OSError:
                time.sleep(0.1)

    def _seen(self, obj: dict[str, Any]) -> None:
        name, st = obj["metadata"]["name"], obj.get("status") or {}
        if name in self.ready_at or st.get("observedGeneration") != obj["metadata"]["generation"]:
            return
        for cond in st.get("conditions") or []:
            if cond["type"] == "Ready" and cond["status"] == "True" and st.get("brokersReady") == "2/2":
                self.ready_at[name] = time.monotonic()


def _topic(name: str) -> dict[str, Any]:
    return {"apiVersion": "lmq.io/v1alpha1", "kind": "ParentTopic", "metadata": {"name": name}, "spec": {}}


def _group(name: str, parent: str) -> dict[str, Any]:
    spec = {"groupName": name, "parentTopic": parent}
    return {"apiVersion": "lmq.io/v1alpha1", "kind": "LiteGroup", "metadata": {"name": name}, "spec": spec}


def _measure_pairs(api: testing.KubeAPI, groups: ReadyWatch, count: int) -> list[float]:
    """``count`` LiteGroups, each POSTed just before its ParentTopic, one pair every 100 ms: the seconds from
    each group's POST until it is Ready on every broker."""
    created: dict[str, float] = {}
    for i in range(count):
        topic, group = f"pair-{i:04d}", f"pair-g-{i:04d}"
        api.post(testing.cr_path("litegroups", NAMESPACE), _group(group, topic))
        created[group] = time.monotonic()
        api.post(testing.cr_path("parenttopics", NAMESPACE), _topic(topic))
        time.sleep(0.1)  # pacing the load generator, not waiting for a result
    testing.wait_for(lambda: all(g in groups.ready_at for g in created), 120, "paired LiteGroups Ready", 0.05)
    return [groups.ready_at[g] - t for g, t in created.items()]


def _measure(api: testing.KubeAPI, watch: ReadyWatch, names: list[str], interval_s: float) -> list[float]:
    created: dict[str, float] = {}
    for name in names:
        api.post(testing.cr_path("parenttopics", NAMESPACE), _topic(name))
        created[name] = time.monotonic()
        if interval_s:
            time.sleep(interval_s)  # pacing the load generator, not waiting for a result
    testing.wait_for(lambda: all(n in watch.ready_at for n in created), 120, "latency samples Ready", 0.05)
    return [watch.ready_at[n] - t for n, t in created.items()]


def _report(mode: str, latencies: list[float], goal_s: float = P99_GOAL_S) -> None:
    p50, p99 = _percentile(latencies, 0.50), _percentile(latencies, 0.99)
    verdict = "met" if p99 <= goal_s else "MISSED"
    print(f"ready_latency_{mode}_p50_s {p50:.3f}")
    print(f"ready_latency_{mode}_p99_s {p99:.3f} (goal <= {goal_s:.1f}: {verdict})")
    print(f"ready_latency_{mode}_max_s {max(latencies):.3f} over {len(latencies)} resources")


def _peak_rss_mib(pid: int) -> float:
    """The process's high-water mark of resident memory (VmHWM): what a memory limit is measured against."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def run(samples: int, total: int, window_s: float, workdir: Path) -> int:
    with testing.testenv(workdir / "testenv") as api:
        api.apply_crds()
        api.ensure_namespace(NAMESPACE)
        shared = broker_testing.SHARED_ADMIN_ENV  # one admin pair for both brokers, as the chart's Secret
        brokers = [
            broker_testing.start_broker(workdir / f"b{i}", extra_args=["--no-bootstrap"], env=shared) for i in range(2)
        ]
        op = None
        try:
            env = {
                "LMQ_OPERATOR_NAMESPACE": NAMESPACE,
                "LMQ_OPERATOR_BROKERS": ",".join(b.admin_endpoint for b in brokers),
                **brokers[0].admin_env("LMQ_OPERATOR"),
            }
            op = testing.start_operator(api, workdir / "operator.log", env)
            watch, groups = ReadyWatch(api), ReadyWatch(api, "litegroups")
            watch.start()
            groups.start()

            # warm-up: the operator's watches are established (a fresh CRD's watch cache answers 429 at first)
            api.post(testing.cr_path("parenttopics", NAMESPACE), _topic("warmup"))
            testing.wait_for(lambda: "warmup" in watch.ready_at, 60, "warm-up ParentTopic Ready", 0.05)

            # burst: N resources POSTed back to back (what `kubectl apply -f dir/` does)
            burst = _measure(api, watch, [f"burst-{i:04d}" for i in range(samples)], interval_s=0.0)
            _report("burst", burst)
            # paced: one resource every 100 ms (a steady stream of changes, e.g. a GitOps sync of many apps)
            paced = _measure(api, watch, [f"paced-{i:04d}" for i in range(samples)], interval_s=0.1)
            _report("paced", paced)
            pairs = _measure_pairs(api, groups, samples)
            _report("pair", pairs, PAIR_P99_GOAL_S)
            groups.stop()
            done = 1 + 3 * samples  # the pairs' ParentTopics count too

            proc = psutil.Process(op.proc.pid)
            started, cpu_started = time.monotonic(), _cpu_s(proc)
            for i in range(done, total):
                api.post(testing.cr_path("parenttopics", NAMESPACE), _topic(f"load-{i:05d}"))
            testing.wait_for(lambda: len(watch.ready_at) >= total, 1800, f"{total} ParentTopics Ready", 0.2)
            arrival_s = time.monotonic() - started
            print(f"ready_all_s {arrival_s:.1f} for {total - done} more ParentTopics")
            arrival_cpu = (_cpu_s(proc) - cpu_started) / arrival_s
            print(f"operator_arrival_cpu_core_share {arrival_cpu:.3f} while {total - done} ParentTopics arrived")
            watch.stop()

            cpu_before, t0 = _cpu_s(proc), time.monotonic()
            time.sleep(window_s)  # the measurement window itself, not a wait for a condition
            cpu = (_cpu_s(proc) - cpu_before) / (time.monotonic() - t0)
            rss_mib = proc.memory_info().rss / 2**20
            print(f"operator_cpu_core_share {cpu:.3f} at {total} ParentTopics over {window_s:.0f}s steady state")
            print(f"operator_rss_mib {rss_mib:.1f} at {total} ParentTopics")
            print(f"operator_rss_peak_mib {_peak_rss_mib(op.proc.pid):.1f} (high-water mark since start)")
        finally:
            if op is not None:
                op.stop()
            for b in brokers:
                b.stop()
                if b.process.stdout is not None:
                    b.process.stdout.close()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small run for the smoke test")
    parser.add_argument("--resources", type=int, default=10_000, help="ParentTopics in all (default 10,000)")
    parser.add_argument("--window", type=float, default=60.0, help="steady-state window in seconds (default 60)")
    args = parser.parse_args()
    samples, total, window = (20, 100, 3.0) if args.quick else (100, args.resources, args.window)
    if total < 1 + 3 * samples:
        parser.error(f"--resources must be at least {1 + 3 * samples} (the latency samples are part of it)")
    with tempfile.TemporaryDirectory(prefix="lmq-bench-operator-") as tmp:
        return run(samples, total, window, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
