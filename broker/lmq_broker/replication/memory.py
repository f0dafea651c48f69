"""An in-memory twin of the Lease API (``leadership.LeaseApi``) for tests: the apiserver's one rule for
Leases, a write names the resourceVersion it read, else ``kube.Conflict``; ``down`` makes every call fail."""

from __future__ import annotations

import itertools

from lmq_broker.replication import kube


class Leases:
    def __init__(self) -> None:
        self.items: dict[str, kube.Lease] = {}
        self._versions = itertools.count(1)
        self.down = False
        self.lists = 0  # reads: one LIST per tick, whatever the number of slots
        self.writes = 0

    def _check(self) -> None:
        if self.down:
            raise OSError("apiserver unreachable")

    def list_named(self, prefix: str) -> list[kube.Lease]:
        self._check()
        self.lists += 1
        return [lease for name, lease in self.items.items() if name.startswith(prefix)]

    def create(self, name: str, holder: str, duration_s: int, in_sync: tuple[int, ...] | None = None) -> kube.Lease:
        self._check()
        if name in self.items:
            raise kube.Conflict(name)
        lease = kube.Lease(name, holder, 0, str(next(self._versions)), duration_s, in_sync)
        self.items[name] = lease
        return lease

    def write(
        self, lease: kube.Lease, holder: str, transitions: int, duration_s: int, in_sync: tuple[int, ...] | None = None
    ) -> kube.Lease:
        self._check()
        if self.items[lease.name].resource_version != lease.resource_version:
            raise kube.Conflict(lease.name)
        self.writes += 1
        written = kube.Lease(lease.name, holder, transitions, str(next(self._versions)), duration_s, in_sync)
        self.items[lease.name] = written
        return written
