"""Leader election on a ``coordination.k8s.io/v1`` Lease, so that two operator replicas never both reconcile.

kopf's own peering pauses operators of equal priority instead of electing one of them, and needs its own
cluster-wide CRD; platform teams expect the Lease that every Go controller takes. The rules are the ones
client-go's leader election follows:

* a candidate takes the Lease when nobody holds it, or when the record has not changed for a whole
  ``leaseDurationSeconds`` *as this process observed it* (its own monotonic clock: clocks of two nodes are
  never compared, only whether the holder kept renewing);
* every write carries the ``resourceVersion`` it read, so of two candidates at most one wins (the other gets
  a conflict and reads again);
* the leader renews every ``retry_s``; when it has not managed to for ``renew_deadline_s`` (shorter than the
  lease duration) it gives up leadership and stops reconciling *before* anyone else may take the Lease;
* a leader that stops cleanly clears the holder, so the next one takes over at once instead of after a lease
  duration.

Nothing here talks to Kubernetes: ``LeaseStore`` is the seam (``kube.KubeLeases`` over the API, a dict in
tests), and time comes in as functions.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Protocol

log = logging.getLogger(__name__)

DEFAULT_LEASE_DURATION_S: Final = 15.0
DEFAULT_RENEW_DEADLINE_S: Final = 10.0
DEFAULT_RETRY_S: Final = 2.0


@dataclass(frozen=True, slots=True)
class LeaseConfig:
    name: str
    namespace: str
    identity: str  # this process: the pod name, so `kubectl get lease` shows which pod leads
    duration_s: float = DEFAULT_LEASE_DURATION_S
    renew_deadline_s: float = DEFAULT_RENEW_DEADLINE_S
    retry_s: float = DEFAULT_RETRY_S


class Conflict(Exception):
    """Someone else wrote the Lease since we read it (HTTP 409), or created it first."""


class LeaseStore(Protocol):
    """The Lease object as JSON dicts; ``get`` returns None when there is none."""

    async def get(self) -> dict[str, Any] | None: ...
    async def create(self, lease: dict[str, Any]) -> dict[str, Any]: ...
    async def replace(self, lease: dict[str, Any]) -> dict[str, Any]: ...


def micro_time(now: datetime) -> str:
    """A Kubernetes MicroTime: RFC 3339 with exactly six fractional digits, in UTC."""
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def holder(lease: Mapping[str, Any] | None) -> str:
    return str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")


def _version(lease: Mapping[str, Any]) -> str:
    return str((lease.get("metadata") or {}).get("resourceVersion", ""))


def claimed(lease: Mapping[str, Any] | None, conf: LeaseConfig, now: datetime) -> dict[str, Any]:
    """The Lease with us as its holder: a renewal when we already hold it, else a takeover (a transition)."""
    old = dict(lease or {})
    spec = dict(old.get("spec") or {})
    ours = spec.get("holderIdentity") == conf.identity
    stamp = micro_time(now)
    spec.update(
        holderIdentity=conf.identity,
        leaseDurationSeconds=max(1, round(conf.duration_s)),
        renewTime=stamp,
    )
    if not ours:
        spec["acquireTime"] = stamp
        spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (1 if lease is not None else 0)
    meta = dict(old.get("metadata") or {})
    meta.update(name=conf.name, namespace=conf.namespace)
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}


def released(lease: Mapping[str, Any], now: datetime) -> dict[str, Any]:
    """The Lease given up: no holder, so a waiting candidate may take it on its next try."""
    spec = {k: v for k, v in (lease.get("spec") or {}).items() if k != "holderIdentity"}
    spec.update(leaseDurationSeconds=1, renewTime=micro_time(now))
    return {**lease, "spec": spec}


class Elector:
    """Acquires, holds and releases one Lease for ``conf.identity``."""

    def __init__(
        self,
        store: LeaseStore,
        conf: LeaseConfig,
        *,
        monotonic: Callable[[], float],
        wall: Callable[[], datetime],
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._store = store
        self._conf = conf
        self._monotonic = monotonic
        self._wall = wall
        self._sleep = sleep
        self._seen: tuple[str, str] | None = None  # (resourceVersion, holder) last read
        self._seen_at = 0.0  # when that record was first seen, on our clock
        self._lease: dict[str, Any] | None = None  # the record as we last wrote it while leading
        self.leading = False

    def _observe(self, lease: Mapping[str, Any] | None) -> None:
        key = (_version(lease), holder(lease)) if lease is not None else None
        if key != self._seen:
            self._seen, self._seen_at = key, self._monotonic()

    def _takeable(self, lease: Mapping[str, Any] | None) -> bool:
        if lease is None:
            return True
        current = holder(lease)
        if not current or current == self._conf.identity:
            return True
        return self._monotonic() - self._seen_at >= self._conf.duration_s

    async def try_acquire(self) -> bool:
        """One attempt: True when we hold the Lease afterwards. API errors count as "not now"."""
        try:
            lease = await self._store.get()
            self._observe(lease)
            if not self._takeable(lease):
                return False
            mine = claimed(lease, self._conf, self._wall())
            self._lease = await (self._store.replace(mine) if lease is not None else self._store.create(mine))
        except Conflict:
            return False
        except Exception as exc:  # an unreachable or refusing apiserver: try again later
            log.warning("leader election: cannot read or write lease %s/%s: %s", *self._where(), exc)
            return False
        self._observe(self._lease)
        if not self.leading:
            log.info("leader election: %s now holds lease %s/%s", self._conf.identity, *self._where())
        self.leading = True
        return True

    async def acquire(self) -> None:
        """Wait until we hold the Lease."""
        announced = ""
        while not await self.try_acquire():
            other = self._seen[1] if self._seen is not None else ""
            if other and other != announced:
                log.info("leader election: %s leads; %s waits as a standby", other, self._conf.identity)
                announced = other
            await self._sleep(self._conf.retry_s)

    async def hold(self) -> None:
        """Renew until a renewal has failed for ``renew_deadline_s``; then return: leadership is lost, and the
        caller must stop reconciling at once (another replica may take the Lease a little later)."""
        renewed = self._monotonic()
        while True:
            await self._sleep(self._conf.retry_s)
            if await self._renew():
                renewed = self._monotonic()
            elif self._monotonic() - renewed >= self._conf.renew_deadline_s or not self.leading:
                self.leading = False
                log.error(
                    "leader election: %s lost lease %s/%s (not renewed for %.0f s)",
                    self._conf.identity,
                    *self._where(),
                    self._monotonic() - renewed,
                )
                return

    async def _renew(self) -> bool:
        try:
            current = self._lease if self._lease is not None else await self._store.get()
            for _ in range(2):  # our last write, then (on a conflict) what is stored now
                if holder(current) != self._conf.identity:
                    self.leading = False  # taken over: our lease ran out while we could not renew it
                    return False
                try:
                    self._lease = await self._store.replace(claimed(current, self._conf, self._wall()))
                    return True
                except Conflict:
                    self._lease = None
                    current = await self._store.get()
            return False
        except Exception as exc:
            log.warning("leader election: renewing lease %s/%s failed: %s", *self._where(), exc)
            return False

    async def release(self) -> None:
        """Give the Lease up (clean shutdown) so a standby takes over without waiting for it to expire."""
        if not self.leading:
            return
        self.leading = False
        try:
            current = await self._store.get()
            if current is not None and holder(current) == self._conf.identity:
                await self._store.replace(released(current, self._wall()))
                log.info("leader election: %s released lease %s/%s", self._conf.identity, *self._where())
        except Exception as exc:  # it expires by itself after a lease duration
            log.warning("leader election: releasing lease %s/%s failed: %s", *self._where(), exc)

    def _where(self) -> tuple[str, str]:
        return self._conf.namespace, self._conf.name


class MemoryLeases:
    """``LeaseStore``'s in-memory twin, with the apiserver's optimistic concurrency: a write whose
    ``resourceVersion`` is not the stored one, or a create of an existing Lease, is a ``Conflict``. Each call
    yields to the loop once, so concurrent candidates interleave as over a network. ``down`` fails every call."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.down = False
        self._version = 0

    async def _enter(self) -> None:
        await asyncio.sleep(0)
        if self.down:
            raise ConnectionError("apiserver unreachable")

    def _stored(self, lease: dict[str, Any]) -> dict[str, Any]:
        self._version += 1
        meta = {**lease.get("metadata", {}), "resourceVersion": str(self._version)}
        self.lease = {**lease, "metadata": meta}
        return dict(self.lease)

    async def get(self) -> dict[str, Any] | None:
        await self._enter()
        return None if self.lease is None else dict(self.lease)

    async def create(self, lease: dict[str, Any]) -> dict[str, Any]:
        await self._enter()
        if self.lease is not None:
            raise Conflict("already exists")
        return self._stored(lease)

    async def replace(self, lease: dict[str, Any]) -> dict[str, Any]:
        await self._enter()
        if self.lease is None or _version(lease) != _version(self.lease):
            raise Conflict("the object has been modified")
        return self._stored(lease)
