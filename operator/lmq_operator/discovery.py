"""Finding the brokers: every pod of the brokers' headless Service (``slices``), or a static list, and which of
them leave the ring while still holding data (ordinal at or above the StatefulSet's replicas, or a volume claim
left behind). At most one discovery per ``discovery_ttl_s``; a failed one keeps serving the last good view.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import kubernetes

from lmq_operator import admins, kube, model, settings, slices
from lmq_operator.admins import AdminError

log = logging.getLogger(__name__)

# The broker StatefulSet's volumeClaimTemplates name (charts/lmq): pod <sts>-<N> keeps its data in claim data-<sts>-<N>.
CLAIM_TEMPLATE: Final = "data"


@dataclass(frozen=True, slots=True)
class FleetView:
    """The brokers to apply to, and the leaving ones (ordinal >= replicas) that still hold data."""

    targets: tuple[model.Broker, ...]
    leaving: tuple[model.Leaving, ...] = ()
    error: str | None = None  # discovery failed; targets are the last known good ones


class Fleet:
    """Discovers brokers, at most once per ``discovery_ttl_s``; concurrent callers share one refresh."""

    def __init__(
        self,
        conf: settings.Settings,
        pool: admins.AdminPool,
        clock: Callable[[], float] = time.monotonic,
        ring_pods: Callable[[], int | None] = lambda: None,
    ) -> None:
        self._conf = conf
        self._pool = pool
        self._clock = clock
        self._ring_pods = ring_pods  # pods of today's ring while the operator scales the brokers down
        self._lock = asyncio.Lock()
        self._view: FleetView | None = None
        self._at = 0.0
        self._kube: Any = None

    async def view(self) -> FleetView:
        async with self._lock:
            if self._view is None or self._clock() - self._at >= self._conf.discovery_ttl_s:
                self._view = await self._discover(self._view)
                self._at = self._clock()
                await self._pool.prune([*self._view.targets, *(x.broker for x in self._view.leaving)])
            return self._view

    async def _discover(self, last: FleetView | None) -> FleetView:
        try:
            replicas = await self._replicas()
            claims = await self._claims_or_none(replicas) if replicas is not None else {}
            if self._conf.brokers:
                known = [(model.Broker(ep, ep, i), True) for i, ep in enumerate(self._conf.brokers)]
            else:
                known = slices.brokers(await self._slices(), self._conf.admin_port, self._conf.processes)
        except Exception as exc:  # any API failure: keep serving the last good view
            log.warning("broker discovery failed: %s", exc)
            return FleetView(last.targets if last else (), last.leaving if last else (), error=str(exc))
        if replicas is None:
            return FleetView(tuple(b for b, ready in known if ready))
        targets, leaving = [], []
        asked: set[int] = set()
        ring = self._ring_pods()
        for broker, ready in known:
            if broker.ordinal is not None and ring is not None and ring <= broker.ordinal < replicas:
                # Leaving the ring but still running: it serves its consumers (so it gets every resource) and
                # drains; the scale-down waits for it.
                if ready:
                    targets.append(broker)
                    undrained = await self._undrained(broker)
                    if undrained != 0:
                        leaving.append(model.Leaving(broker, ring, undrained, claims.get(broker.ordinal), True))
                continue
            if broker.ordinal is None or broker.ordinal < replicas:
                if ready:
                    targets.append(broker)
                continue
            asked.add(broker.ordinal)
            claim = claims.get(broker.ordinal)
            undrained = await self._undrained(broker)
            if undrained or (undrained is None and claim is not None):
                leaving.append(model.Leaving(broker, replicas, undrained, claim))
        # In a cluster a leaving pod and its endpoint are gone at once; its claim, and the data, stay.
        for ordinal, claim in sorted(claims.items()):
            if ordinal not in asked:
                name = f"{self._conf.broker_statefulset}-{ordinal}"
                leaving.append(model.Leaving(model.Broker(name, "", ordinal), replicas, None, claim))
        return FleetView(tuple(targets), tuple(leaving))

    async def _undrained(self, broker: model.Broker) -> int | None:
        try:
            return await self._pool(broker).undrained_messages()
        except AdminError as exc:
            log.info("leaving broker %s did not answer: %s", broker.name, exc.message)
            return None

    def _client(self) -> Any:
        if self._kube is None:
            self._kube = kube.kube_client()
        return self._kube

    async def _replicas(self) -> int | None:
        name, ns = self._conf.broker_statefulset, self._conf.broker_namespace
        if name is None or ns is None:
            return None

        def read() -> Any:
            return kubernetes.client.AppsV1Api(self._client()).read_namespaced_stateful_set(name, ns)

        sts = await asyncio.to_thread(read)
        return int(sts.spec.replicas if sts.spec.replicas is not None else 1)

    async def _claims_or_none(self, replicas: int) -> dict[int, str]:
        """``_claims``, or none when they cannot be listed (e.g. an RBAC role without the rule): the brokers
        are still found and applied to; only the drain check of leaving brokers loses its claim evidence."""
        try:
            return await self._claims(replicas)
        except Exception as exc:
            log.warning("cannot list the broker volume claims (drain check without them): %s", exc)
            return {}

    async def _claims(self, replicas: int) -> dict[int, str]:
        """Ordinal -> name of the broker volume claims ``data-<statefulset>-<ordinal>`` at or above ``replicas``."""
        sts, ns = self._conf.broker_statefulset, self._conf.broker_namespace or "default"
        pattern = re.compile(rf"^{CLAIM_TEMPLATE}-{re.escape(str(sts))}-(\d+)$")

        def read() -> Any:
            return kubernetes.client.CoreV1Api(self._client()).list_namespaced_persistent_volume_claim(ns)

        found = {}
        for pvc in (await asyncio.to_thread(read)).items or []:
            match = pattern.match(pvc.metadata.name or "")
            if match and int(match.group(1)) >= replicas:
                found[int(match.group(1))] = str(pvc.metadata.name)
        return found

    async def _slices(self) -> list[Mapping[str, Any]]:
        namespace, service = self._conf.broker_namespace or "default", str(self._conf.broker_service)
        return await kube.endpoint_slices(self._client(), namespace, service)

    async def close(self) -> None:
        if self._kube is not None:
            with contextlib.suppress(Exception):
                self._kube.close()
        await self._pool.close()


_shared: list[Any] = []
