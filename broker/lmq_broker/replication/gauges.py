"""Replication's gauges, read from the live state at each scrape (nothing is counted twice).

Each broker speaks for the slots it is a replica of: ``lmq_replication_in_sync{slot}`` is 1 while it holds the
slot's lease or is reconciled with its holder's epoch, so ``sum by (slot)`` over the release is the slot's
in-sync replicas seen from the replicas themselves (a broker down reports nothing: the sum drops). The owner
adds what only it knows: its epoch and, per follower, the messages it stored that the follower has not
confirmed yet (``lmq_replication_lag_messages``). At ``--replicas 1`` the families are declared, empty.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Final

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector as _Collector

from lmq_broker.replication import following, owning
from lmq_broker.replication.leadership import Leadership

NAMES: Final = (
    "lmq_replication_replicas",
    "lmq_replication_in_sync",
    "lmq_replication_owner",
    "lmq_replication_epoch",
    "lmq_replication_lag_messages",
)


class Collector(_Collector):
    def __init__(
        self,
        replicas: int,
        leadership: Leadership | None = None,
        follower: Callable[[], following.Follower | None] = lambda: None,
        slots: Callable[[], owning.Slots | None] = lambda: None,
    ) -> None:
        self._replicas = replicas
        self._leadership = leadership
        self._follower = follower
        self._slots = slots

    def collect(self) -> Iterator[GaugeMetricFamily]:
        replicas = GaugeMetricFamily("lmq_replication_replicas", "Copies of every ring slot (--replicas)")
        replicas.add_metric([], self._replicas)
        in_sync = GaugeMetricFamily(
            "lmq_replication_in_sync",
            "1 while this broker holds the slot's lease or is in sync with its holder (a replica of the slot)",
            labels=["slot"],
        )
        owner = GaugeMetricFamily(
            "lmq_replication_owner",
            "1 while this broker holds the slot's lease and acknowledges under it",
            labels=["slot"],
        )
        epoch = GaugeMetricFamily(
            "lmq_replication_epoch", "The slot's epoch (leaseTransitions) as last seen", labels=["slot"]
        )
        lag = GaugeMetricFamily(
            "lmq_replication_lag_messages",
            "Messages the owner stored that the follower (its endpoint) has not confirmed yet",
            labels=["slot", "follower"],
        )
        leadership, follower, slots = self._leadership, self._follower(), self._slots()
        if leadership is not None:
            for slot in leadership.mine:
                label = [str(slot)]
                now = leadership.epoch(slot)
                seen = leadership.epochs.get(slot)
                synced = follower is not None and seen is not None and follower.in_sync(slot, seen)
                in_sync.add_metric(label, 1 if now is not None or synced else 0)
                owner.add_metric(label, 1 if now is not None else 0)
                if seen is not None:
                    epoch.add_metric(label, seen)
        if slots is not None:
            for slot, endpoint, pending in slots.lag():
                lag.add_metric([str(slot), endpoint], pending)
        yield from (replicas, in_sync, owner, epoch, lag)
