"""The brokers' headless Service as its EndpointSlices show it: which pods there are, at which address and ports.

One reading for both readers: broker discovery (``discovery.Fleet``, the brokers every resource goes to) and
the membership loop (``scaler``, which asks each ring slot for its view). Pure: the slices come in as plain
mappings (the API's JSON), no Kubernetes client here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from lmq_broker.cluster import ring
from lmq_operator import model

# A StatefulSet pod's name ends in its ordinal: <statefulset>-<N>.
ORDINAL: Final = re.compile(r"-(\d+)$")


def ordinal(pod: str | None) -> int | None:
    match = ORDINAL.search(pod or "")
    return int(match.group(1)) if match else None


@dataclass(frozen=True, slots=True)
class Pod:
    """One pod endpoint of the Service."""

    name: str  # the pod's name (targetRef), else its hostname, else its address
    ip: str
    grpc_port: int  # the port its processes share (routes' port with one process)
    admin_port: int | None  # the slice's "admin" port: a separate admin listener (one process per pod only)
    ready: bool

    @property
    def ordinal(self) -> int | None:
        return ordinal(self.name)

    def admin_endpoints(self, processes: int) -> tuple[str, ...]:
        """Each process's admin endpoint: the pod's admin listener with one process, else the processes' own
        ports (``ring.process_port``)."""
        if processes == 1:
            return (f"{self.ip}:{self.admin_port or self.grpc_port}",)
        return ring.slot_endpoints(f"{self.ip}:{self.grpc_port}", processes)


def pods(slices: Iterable[Mapping[str, Any]], default_port: int) -> list[Pod]:
    """Every pod endpoint with an address (ready or not), deduplicated by name, in the order first seen.
    Ports: the one named "grpc", else "admin", else the slice's first, else ``default_port``; "admin" when named."""
    found: dict[str, Pod] = {}
    for s in slices:
        ports = s.get("ports") or []
        named = {p.get("name"): p.get("port") for p in ports}
        admin = named.get("admin")
        grpc = int(named.get("grpc") or admin or (ports[0].get("port") if ports else None) or default_port)
        for ep in s.get("endpoints") or []:
            addresses = ep.get("addresses") or []
            if not addresses:
                continue
            name = (ep.get("targetRef") or {}).get("name") or ep.get("hostname") or addresses[0]
            ready = (ep.get("conditions") or {}).get("ready") is not False
            found[name] = Pod(name, addresses[0], grpc, int(admin) if admin else None, ready)
    return list(found.values())


def brokers(
    slices: Iterable[Mapping[str, Any]], default_port: int, processes: int = 1
) -> list[tuple[model.Broker, bool]]:
    """(broker, ready) for every pod of the Service. With several processes per pod, each process is a broker
    of its own (``<pod>-p<i>``) on its own port."""
    found = []
    for pod in pods(slices, default_port):
        endpoints = pod.admin_endpoints(processes)
        if processes == 1:
            found.append((model.Broker(pod.name, endpoints[0], pod.ordinal), pod.ready))
            continue
        found.extend((model.Broker(f"{pod.name}-p{i}", e, pod.ordinal), pod.ready) for i, e in enumerate(endpoints))
    return sorted(found)
