"""The Lease API of the Kubernetes apiserver, the one engine that decides who owns a slot.

Every write names the ``resourceVersion`` it read, so etcd refuses it when anyone wrote since: two brokers can
never both believe they took the same lease. Blocking stdlib HTTPS (callers run it in a thread): the broker
needs five calls of one resource kind, not a client library.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

SERVICE_ACCOUNT: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
CALL_TIMEOUT_S: Final = 2.0
IN_SYNC: Final = "lmq.io/in-sync"  # annotation: the slot's in-sync replicas, ring slots comma-separated


class Conflict(Exception):
    """Someone wrote the lease since it was read (HTTP 409), or created it first."""


@dataclass(frozen=True, slots=True)
class Lease:
    name: str
    holder: str
    transitions: int  # the slot's replication epoch
    resource_version: str
    duration_s: int
    in_sync: tuple[int, ...] | None = None  # the in-sync replicas recorded by the holder; None: never recorded


def _in_sync_of(value: object) -> tuple[int, ...] | None:
    if not isinstance(value, str):
        return None
    return tuple(sorted(int(part) for part in value.split(",") if part.strip().isdigit()))


def _meta(name: str, in_sync: tuple[int, ...] | None, version: str = "") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if version:
        meta["resourceVersion"] = version
    if in_sync is not None:
        meta["annotations"] = {IN_SYNC: ",".join(map(str, sorted(in_sync)))}
    return meta


def _lease_of(body: dict[str, Any]) -> Lease:
    spec = body.get("spec") or {}
    return Lease(
        name=body["metadata"]["name"],
        holder=spec.get("holderIdentity") or "",
        transitions=int(spec.get("leaseTransitions") or 0),
        resource_version=body["metadata"]["resourceVersion"],
        duration_s=int(spec.get("leaseDurationSeconds") or 0),
        in_sync=_in_sync_of((body["metadata"].get("annotations") or {}).get(IN_SYNC)),
    )


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class ApiServer:
    def __init__(self, server: str, token: str, ca_file: Path | None, namespace: str) -> None:
        self._base = f"{server.rstrip('/')}/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self._token = token
        self._ssl = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)

    @classmethod
    def of(cls, server: str, token_file: Path | None, ca_file: Path | None, namespace: str) -> ApiServer:
        """From flags; empty ones are the pod's own (in-cluster) settings."""
        if not server:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "")
            server = f"https://{host}:{port}"
        token = (token_file or SERVICE_ACCOUNT / "token").read_text().strip()
        return cls(server, token, ca_file or SERVICE_ACCOUNT / "ca.crt", namespace)

    def _call(self, method: str, suffix: str, body: dict[str, Any] | None = None) -> dict[str, Any] | None:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self._token}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self._base + suffix, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=CALL_TIMEOUT_S, context=self._ssl) as resp:
                result: dict[str, Any] = json.loads(resp.read())
                return result
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            if exc.code == 409:
                raise Conflict(suffix) from None
            raise

    def get(self, name: str) -> Lease | None:
        body = self._call("GET", f"/{name}")
        return None if body is None else _lease_of(body)

    def list_named(self, prefix: str) -> list[Lease]:
        """The namespace's leases whose names start with ``prefix``: one call for every slot, filtered here (a
        label selector would miss leases written before it was set)."""
        body = self._call("GET", "")
        items = [] if body is None else body.get("items") or []
        return [_lease_of(item) for item in items if str(item["metadata"]["name"]).startswith(prefix)]

    def create(self, name: str, holder: str, duration_s: int, in_sync: tuple[int, ...] | None = None) -> Lease:
        spec = {"holderIdentity": holder, "leaseDurationSeconds": duration_s, "leaseTransitions": 0}
        spec |= {"acquireTime": _now(), "renewTime": _now()}
        body = self._call("POST", "", {"metadata": _meta(name, in_sync), "spec": spec})
        assert body is not None
        return _lease_of(body)

    def write(
        self, lease: Lease, holder: str, transitions: int, duration_s: int, in_sync: tuple[int, ...] | None = None
    ) -> Lease:
        """Renew (same holder and transitions) or take (a new holder, transitions + 1) ``lease`` as read, with
        the in-sync replicas ``in_sync`` (a PUT replaces the whole object: the annotation is written each time)."""
        spec: dict[str, Any] = {
            "holderIdentity": holder,
            "leaseDurationSeconds": duration_s,
            "leaseTransitions": transitions,
            "renewTime": _now(),
        }
        if holder != lease.holder:
            spec["acquireTime"] = _now()
        meta = _meta(lease.name, in_sync, lease.resource_version)
        body = self._call("PUT", f"/{lease.name}", {"metadata": meta, "spec": spec})
        assert body is not None
        return _lease_of(body)
