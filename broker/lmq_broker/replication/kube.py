"""The Lease API of the Kubernetes apiserver, the one engine that decides who owns a slot.

Every write names the ``resourceVersion`` it read, so etcd refuses it when anyone wrote since: two brokers can
never both believe they took the same lease. Blocking stdlib HTTPS (callers run it in a thread): the broker
needs five calls of one resource kind, not a client library.

Connections are kept alive and reused (``keep_alive``): a TLS handshake per call cost each broker 10 to 30 ms of
CPU per second at R=2 (a LIST and a renewal every third of the lease), a third of a follower's CPU at a few
hundred sends a second (bench/RESULTS.md, issue 32). A request that finds a kept connection closed by the
apiserver (idle) is sent once more on a new one: a write sent twice that way is refused as a conflict (its
``resourceVersion`` is gone), never applied twice. A connection per call (``keep_alive=False``, the default of
a bare ``ApiServer``: tests and tools) is the plain twin the tests compare it with.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import threading
import urllib.parse
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


class ApiError(Exception):
    """The apiserver answered with an error status other than 404 and 409."""


# A kept connection the apiserver closed while idle: the request is sent again on a new one.
_STALE: Final = (
    *(http.client.RemoteDisconnected, http.client.CannotSendRequest, BrokenPipeError, ConnectionResetError),
    *(ssl.SSLEOFError, ssl.SSLZeroReturnError),
)
IDLE_CONNECTIONS: Final = 2  # kept per ApiServer (a broker's LIST and a lease write may overlap)


class ApiServer:
    def __init__(
        self, server: str, token: str, ca_file: Path | None, namespace: str, *, keep_alive: bool = False
    ) -> None:
        url = urllib.parse.urlsplit(server.rstrip("/"))
        self._https = url.scheme == "https"
        self._netloc = url.netloc
        self._base = f"{url.path}/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self._token = token
        self._ssl = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
        self._keep_alive = keep_alive
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()  # calls run on the default executor's threads
        self.opened = 0  # connections opened (tests: reused, or one per call)
        self._closed = False

    @classmethod
    def of(cls, server: str, token_file: Path | None, ca_file: Path | None, namespace: str) -> ApiServer:
        """From flags; empty ones are the pod's own (in-cluster) settings; connections kept alive (``close``)."""
        if not server:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "")
            server = f"https://{host}:{port}"
        token = (token_file or SERVICE_ACCOUNT / "token").read_text().strip()
        return cls(server, token, ca_file or SERVICE_ACCOUNT / "ca.crt", namespace, keep_alive=True)

    def _call(self, method: str, suffix: str, body: dict[str, Any] | None = None) -> dict[str, Any] | None:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self._token}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        status, payload = self._exchange(method, self._base + suffix, data, headers)
        if status == 404:
            return None
        if status == 409:
            raise Conflict(suffix)
        if status >= 300:
            raise ApiError(f"{method} {suffix}: HTTP {status} {payload[:300]!r}")
        result: dict[str, Any] = json.loads(payload)
        return result

    def _exchange(self, method: str, path: str, data: bytes | None, headers: dict[str, str]) -> tuple[int, bytes]:
        """(status, body) of one request, on a kept connection when one is idle."""
        while True:
            conn, kept = self._take()
            try:
                conn.request(method, path, body=data, headers=headers)
                response = conn.getresponse()
                payload = response.read()
            except _STALE:
                conn.close()
                if kept:
                    continue  # closed by the apiserver while idle: again, on a new connection
                raise
            except BaseException:
                conn.close()
                raise
            if response.will_close or not self._keep_alive:
                conn.close()
            else:
                self._give(conn)
            return response.status, payload

    def _take(self) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
            self.opened += 1
        if self._https:
            return http.client.HTTPSConnection(self._netloc, timeout=CALL_TIMEOUT_S, context=self._ssl), False
        return http.client.HTTPConnection(self._netloc, timeout=CALL_TIMEOUT_S), False

    def _give(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < IDLE_CONNECTIONS:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        """Close the kept connections (a call still running closes its own when it ends)."""
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, []
        for conn in idle:
            conn.close()

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
