"""Prometheus metrics of the operator (prefix ``lmq_operator_``), served by ``__main__`` on its own port."""

from __future__ import annotations

from typing import Final

import prometheus_client

RECONCILIATIONS: Final = prometheus_client.Counter(
    "lmq_operator_reconciliations",
    "Reconciliations of one resource, by kind and trigger (create, update, resume, timer, delete)",
    ["kind", "trigger"],
)
RECONCILIATIONS_FAILED: Final = prometheus_client.Counter(
    "lmq_operator_reconciliations_failed",
    "Reconciliations that left the resource not Ready for a reason worth retrying (brokers unavailable/rejecting)",
    ["kind", "trigger"],
)
DURATION: Final = prometheus_client.Histogram(
    "lmq_operator_reconcile_duration_seconds",
    "Time to reconcile one resource against every broker",
    ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
DRIFT_REPAIRED: Final = prometheus_client.Counter(
    "lmq_operator_drift_repaired",
    "Broker copies re-created or overwritten by a resync because they were missing or differed",
    ["kind"],
)
BROKERS: Final = prometheus_client.Gauge("lmq_operator_brokers", "Brokers the operator applies to")
LEADER: Final = prometheus_client.Gauge(
    "lmq_operator_leader",
    "1 while this replica reconciles: it holds the leader-election Lease, or runs without leader election",
)
REPLICATION_SLOTS: Final = prometheus_client.Gauge(
    "lmq_operator_replication_slots",
    "Ring slots of the brokers by replication state, from the slots' Leases (state: all, unheld: no live lease "
    "holder, under_replicated: a replica does not answer); only with broker replication",
    ["state"],
)
