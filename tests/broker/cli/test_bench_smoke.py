"""Every broker/e2e benchmark runs with --quick (or its own small settings), exits 0 and prints its figure
lines (figures are not asserted: they are measurements, read by people, not pass/fail tests)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from benchruns import run_bench

BENCH = Path(__file__).resolve().parents[3] / "bench"
EXPECTED = {
    "bench_acl.py": ["FIGURE send throughput ACL on ÷ off:", "FIGURE receive throughput ACL on ÷ off:"],
    "bench_backup.py": [
        "FIGURE snapshot under the write lock:",
        "FIGURE backup over gRPC:",
        "FIGURE restore (hash and copy):",
    ],
    "bench_broker_batch.py": ["FIGURE batched send rate:"],
    "bench_broker_consume.py": ["FIGURE one-lite-topic drain rate:", "FIGURE drain calls/s ÷ echo calls/s:"],
    "bench_broker_send.py": [
        "FIGURE send rate broker(sync flush)/echo:",
        "FIGURE send rate broker(async flush)/echo:",
        "FIGURE send CPU per message broker(sync flush)/echo:",
        "FIGURE receive+ack CPU per message broker(sync flush)/echo:",
    ],
    "bench_edge_floor.py": [
        "FIGURE edge floor, bare grpcio echo CPU per message, 256 in flight:",
        "FIGURE sync grpcio echo (thread pool) CPU per message, 256 in flight:",
        "FIGURE lmq server CPU per message, 256 in flight:",
        "FIGURE lmq ÷ bare echo, 256 in flight:",
    ],
    "bench_producer_fleet.py": [
        "FIGURE producer fleet N=1: broker CPU per message:",
        "FIGURE producer fleet CPU per message N=2 (socket) ÷ N=1:",
    ],
    "bench_broker_idle.py": [
        "FIGURE receive p99",
        "FIGURE broker idle CPU",
        "FIGURE restart to ready with 5,000 stored",
        "FIGURE receive p99 with 5,000 stored / without:",
    ],
    "bench_cluster.py": [
        "FIGURE idle CPU per broker of a 3-broker cluster",
        "FIGURE restarted owner holds its subscriptions again after its readiness, median:",
    ],
    "bench_lite_ttl.py": [
        "FIGURE lite-ttl pass over 10k topics, defaults:",
        "FIGURE lite-ttl same load without a pass:",
    ],
    "bench_e2e_latency.py": ["FIGURE send->consume latency p50:", "FIGURE send->consume latency p99:"],
    "bench_footprint.py": [
        "FIGURE cold start, launch -> first acknowledged send:",
        "FIGURE RSS growth per lite topic:",
        "FIGURE kill -9 -> restart -> first acknowledged send:",
    ],
    "bench_lite_patterns.py": ["FIGURE per-arrival dispatch cost, 10,000 patterns ÷ 1 pattern:"],
    "bench_mqtt.py": [
        "FIGURE MQTT publish->subscribe latency p50:",
        "FIGURE MQTT publish->subscribe rate QoS 1:",
        "FIGURE MQTT 5 publish->subscribe latency p50:",
        "FIGURE MQTT 5 publish->subscribe rate QoS 1:",
        "FIGURE gRPC send->push latency p99:",
        "FIGURE MQTT p99 / gRPC p99:",
    ],
    "bench_parked_polls.py": [
        "FIGURE polls spread (50 per client id, 250 per connection): bytes per accepted poll:",
        "FIGURE polls flood (1 client id, 1 connection): poll sent / refused:",
        "FIGURE telemetry idle (reading, 1 per client id): bytes per accepted stream:",
        "FIGURE telemetry never reading (1 per client id, 10 connections): RSS before / parked / peak:",
    ],
    "bench_mqtt_memory.py": [
        "FIGURE bytes per idle MQTT connection after CONNECT:",
        "FIGURE RSS under the CONNECT flood",
        "FIGURE RSS under the PUBLISH flood",
        "FIGURE RSS under the retained flood",
        "FIGURE RSS under the will flood",
    ],
    "bench_mqtt_share_cluster.py": ["FIGURE share, a member on each of 2 brokers:", "FIGURE share ÷ plain:"],
    "bench_send_path.py": ["FIGURE send path CPU per message (handler):"],
    "bench_send_twins.py": ["FIGURE read_all_plain / read_all (fast):", "FIGURE prepare_plain / prepare (fast):"],
    "bench_subscribe_stall.py": [
        "FIGURE probe send latency max during a 20,000-topic COMPLETE_ADD:",
        "FIGURE COMPLETE_ADD of 20,000 lite topics, call duration:",
        "FIGURE MQTT 100-filter SUBSCRIBE, plain walk (--no-lite-level-index), first",
        "FIGURE MQTT 100-filter SUBSCRIBE, level index, second (other filters): broker CPU",
        "FIGURE level index memory:",
    ],
    "bench_scale_out.py": ["FIGURE scale-out N=1 direct:", "FIGURE batched send into 10,000 lite topics, processes"],
    "bench_soak_rss.py": ["FIGURE RSS slope after warm-up:", "FIGURE RSS slope over the last half:"],
    "bench_replication.py": ["FIGURE p50 R=2 ÷ R=1:", "FIGURE p99 R=2 ÷ R=1:", "FIGURE CPU/msg R=3 ÷ R=1:"],
    "bench_disk_faults.py": [
        "FIGURE disk_fault_resume_seconds[index-sync]",
        "FIGURE disk_fault_resume_seconds[fsync-async]",
    ],
}
ARGS = {  # the default is --quick
    "bench_soak_rss.py": ["--minutes", "0.2", "--warmup-minutes", "0.05"],
    "bench_disk_faults.py": ["--rounds", "1"],
    "bench_broker_idle.py": ["--quick", "--stored", "5000"],
}
TIMEOUT_S = {"bench_edge_floor.py": 600}  # its first run on a machine builds ghz (go install, a few minutes)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_bench_runs_quick_and_prints_its_figures(script: str) -> None:
    result = run_bench(
        [sys.executable, str(BENCH / script), *ARGS.get(script, ["--quick"])], TIMEOUT_S.get(script, 240)
    )
    assert result.returncode == 0, result.stderr[-8000:]
    for prefix in EXPECTED[script]:
        assert any(line.startswith(prefix) for line in result.stdout.splitlines()), result.stdout
