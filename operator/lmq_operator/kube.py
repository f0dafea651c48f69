"""The operator's Kubernetes API calls outside kopf's own: clients, the resources as the apiserver lists
them, the brokers' EndpointSlices, the leader-election Lease and the resync loop's status writes.

Blocking client calls run in a thread (``asyncio.to_thread``); lists are read as JSON (``_preload_content=False``),
never deserialized into the client's model objects.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections.abc import Mapping
from typing import Any

import kubernetes

from lmq_operator import leadership, model, resyncing

log = logging.getLogger(__name__)

_shared: list[Any] = []


def shared_kube_client() -> Any:
    """One Kubernetes API client for the membership loop, made on first use."""
    if not _shared:
        _shared.append(kube_client())
    return _shared[0]


def kube_client() -> Any:
    """A Kubernetes API client: the pod's service account in a cluster, else the kubeconfig (tests, laptops)."""
    try:
        kubernetes.config.load_incluster_config()  # type: ignore[no-untyped-call]
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()  # type: ignore[no-untyped-call]
    return kubernetes.client.ApiClient()


async def endpoint_slices(client: Any, namespace: str, service: str) -> list[Mapping[str, Any]]:
    """The EndpointSlices of ``service`` (the brokers' headless Service), as JSON."""

    def read() -> dict[str, Any]:
        api = kubernetes.client.DiscoveryV1Api(client)
        selector = f"kubernetes.io/service-name={service}"
        resp: Any = api.list_namespaced_endpoint_slice(namespace, label_selector=selector, _preload_content=False)
        found: dict[str, Any] = json.loads(resp.data)
        return found

    listing = await asyncio.to_thread(read)
    return list(listing.get("items") or [])


async def listed(kind: model.Kind, namespace: str | None, client: Any = None, page: int = 500) -> dict[str, bytes]:
    """uid -> compact copy of every resource of ``kind`` the apiserver has (in ``namespace``, else all), a page
    at a time: what a joining broker must hold even when kopf's index is still filling (an operator that just
    started in the middle of a scale-up)."""

    def read() -> dict[str, bytes]:
        api = kubernetes.client.CustomObjectsApi(client or shared_kube_client())
        found: dict[str, bytes] = {}
        token: str | None = None
        while True:
            args: dict[str, Any] = {"limit": page, "_preload_content": False}
            if token:
                args["_continue"] = token
            resp: Any
            if namespace:
                resp = api.list_namespaced_custom_object(model.GROUP, model.VERSION, namespace, kind.plural, **args)
            else:
                resp = api.list_cluster_custom_object(model.GROUP, model.VERSION, kind.plural, **args)
            listing = json.loads(resp.data)
            for item in listing.get("items") or []:
                found[item["metadata"]["uid"]] = resyncing.compact(item)
            token = (listing.get("metadata") or {}).get("continue")
            if not token:
                return found

    return await asyncio.to_thread(read)


# ---- a user's Secret ------------------------------------------------------------------------------------


class SecretReader:
    """A user's secret from the Secret its spec names (``get`` on one Secret: the operator never lists or watches
    Secrets, so its role cannot enumerate them; a changed value is read on the next reconcile, at the latest the
    resync). A Secret that is not there, lacks the key or may not be read is a value, not an exception."""

    def __init__(self, client: Any = None) -> None:
        self._client = client

    async def read(self, namespace: str, name: str, key: str) -> model.Credential | model.SecretProblem:
        def call() -> model.Credential | model.SecretProblem:
            if self._client is None:
                self._client = kube_client()
            api = kubernetes.client.CoreV1Api(self._client)
            try:
                resp: Any = api.read_namespaced_secret(name, namespace, _preload_content=False)
            except kubernetes.client.ApiException as exc:
                if exc.status in (403, 404):
                    why = (
                        "does not exist" if exc.status == 404 else "may not be read by the operator (RBAC: get secrets)"
                    )
                    return model.SecretProblem(f"Secret {namespace}/{name} {why}")
                raise
            return credential(json.loads(resp.data), name, key)

        return await asyncio.to_thread(call)

    def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()


def credential(secret: Mapping[str, Any], name: str, key: str) -> model.Credential | model.SecretProblem:
    """The value under ``key`` of a Secret as the API returns it (base64 in ``data``)."""
    encoded = (secret.get("data") or {}).get(key)
    if encoded is None:
        return model.SecretProblem(f"Secret {name} has no key {key!r}")
    try:
        value = base64.b64decode(encoded).decode()
    except (ValueError, UnicodeDecodeError):
        return model.SecretProblem(f"Secret {name} key {key!r} is not UTF-8 text", missing=False)
    version = (secret.get("metadata") or {}).get("resourceVersion", "")
    return model.Credential(value.strip("\n"), f"{name}/{key}@{version}")


# ---- the leader-election Lease --------------------------------------------------------------------------


class KubeLeases:
    """``leadership.LeaseStore`` over the API: one named Lease, read and written as JSON. Each call is bounded
    by ``timeout_s`` so that a hung apiserver counts as a failed renewal, not a stuck one."""

    def __init__(self, name: str, namespace: str, timeout_s: float, client: Any = None) -> None:
        self._name, self._namespace, self._timeout_s = name, namespace, timeout_s
        self._client = client

    def _api(self) -> Any:
        if self._client is None:
            self._client = kube_client()
        return kubernetes.client.CoordinationV1Api(self._client)

    async def _call(self, verb: str, *args: Any) -> dict[str, Any] | None:
        def call() -> dict[str, Any] | None:
            method = getattr(self._api(), f"{verb}_namespaced_lease")
            try:
                resp = method(*args, _preload_content=False, _request_timeout=self._timeout_s)
            except kubernetes.client.ApiException as exc:
                if exc.status == 404 and verb == "read":
                    return None
                if exc.status == 409:
                    raise leadership.Conflict(str(exc.reason)) from None
                raise
            found: dict[str, Any] = json.loads(resp.data)
            return found

        return await asyncio.to_thread(call)

    async def get(self) -> dict[str, Any] | None:
        return await self._call("read", self._name, self._namespace)

    async def create(self, lease: dict[str, Any]) -> dict[str, Any]:
        made = await self._call("create", self._namespace, lease)
        assert made is not None
        return made

    async def replace(self, lease: dict[str, Any]) -> dict[str, Any]:
        written = await self._call("replace", self._name, self._namespace, lease)
        assert written is not None
        return written

    def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()


# ---- status writes of the resync loop ------------------------------------------------------------------


class StatusWriter:
    """Merge-patches the status subresource of one resource, as kopf does for its handlers (the resync loop
    runs outside them). A resource deleted meanwhile is no error; other failures are logged and left to the
    next pass, which computes the same changes again."""

    def __init__(self, client: Any = None) -> None:
        self._client = client

    async def patch(self, kind: model.Kind, namespace: str, name: str, changes: Mapping[str, Any]) -> None:
        def call() -> None:
            if self._client is None:
                self._client = kube_client()
            api = kubernetes.client.CustomObjectsApi(self._client)
            api.patch_namespaced_custom_object_status(
                model.GROUP,
                model.VERSION,
                namespace,
                kind.plural,
                name,
                {"status": dict(changes)},
                field_manager="lmq-operator",
                _content_type="application/merge-patch+json",
            )

        try:
            await asyncio.to_thread(call)
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                log.warning(
                    "status of %s %s/%s not written: %s %s", kind.value, namespace, name, exc.status, exc.reason
                )

    def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
