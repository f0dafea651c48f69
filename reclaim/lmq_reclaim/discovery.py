"""Finding the brokers: a static list, or the pods behind the StatefulSet's headless Service.

DNS is the default on Kubernetes because it needs no RBAC: a headless Service answers its A/AAAA query
with one address per pod. The EndpointSlices API is the alternative when the job should see exactly the
pods the Service selects (it needs ``list`` on ``discovery.k8s.io/endpointslices``). Both return admin
endpoints ``host:port``; naming them is the driver's business (it asks each broker for its name). A pod
running ``serve --processes N`` is N brokers, each with its own lite topics and admin port (the pod's admin
port + i), so each pod address stands for N endpoints: reaching process 0 only would leave the others'
topics unreclaimed.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from lmq_broker import errors
from lmq_reclaim.options import Options

Resolver = Callable[[str, int], Iterable[str]]
SliceLister = Callable[[str, str], Sequence[Mapping[str, Any]]]


def endpoint(host: str, port: int) -> str:
    try:
        is_v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        is_v6 = False
    return f"[{host}]:{port}" if is_v6 else f"{host}:{port}"


def service_host(service: str, namespace: str, cluster_domain: str) -> str:
    """The DNS name of a Service; a name with a dot is taken as already qualified."""
    if "." in service or not namespace:
        return service
    return f"{service}.{namespace}.svc.{cluster_domain}"


def resolve_addresses(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def per_process(address: str, port: int, processes: int) -> list[str]:
    """The admin endpoints of a pod's processes: process i at ``port`` + i."""
    return [endpoint(address, port + i) for i in range(processes)]


def from_dns(host: str, port: int, resolve: Resolver = resolve_addresses, processes: int = 1) -> list[str]:
    try:
        addresses = sorted(set(resolve(host, port)))
    except OSError as exc:
        raise errors.BrokerUnavailable(f"cannot resolve {host}: {exc}", host=host) from exc
    if not addresses:
        raise errors.BrokerUnavailable(f"{host} resolves to no address", host=host)
    return [e for a in addresses for e in per_process(a, port, processes)]


def from_slices(slices: Sequence[Mapping[str, Any]], port: int, processes: int = 1) -> list[str]:
    """Endpoints of the ready pods in EndpointSlice objects (as JSON-like dicts, camelCase keys).

    The slice's port whose number equals ``port`` wins; without one, ``port`` itself is used (a headless
    Service may leave ports empty).
    """
    found: set[str] = set()
    for s in slices:
        numbers = [p.get("port") for p in (s.get("ports") or []) if p.get("port")]
        use = port if (port in numbers or not numbers) else int(numbers[0])
        for ep in s.get("endpoints") or []:
            ready = (ep.get("conditions") or {}).get("ready")
            if ready is False:
                continue
            for address in ep.get("addresses") or []:
                found.update(per_process(address, use, processes))
    return sorted(found)


def list_slices_from_api(service: str, namespace: str) -> Sequence[Mapping[str, Any]]:
    # Imported here: the kubernetes client is heavy and only this path needs it.
    from kubernetes import client, config  # noqa: PLC0415

    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        # KUBECONFIG is read now, not at import: the client's module-level default is fixed when first imported.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))  # type: ignore[no-untyped-call]
    api = client.DiscoveryV1Api()
    reply = api.list_namespaced_endpoint_slice(namespace, label_selector=f"kubernetes.io/service-name={service}")
    items = client.ApiClient().sanitize_for_serialization(reply).get("items", [])  # type: ignore[no-untyped-call]
    return list(items)


def discover(opts: Options, resolve: Resolver = resolve_addresses, list_slices: SliceLister | None = None) -> list[str]:
    """Admin endpoints of every broker, sorted, without duplicates."""
    if opts.brokers:
        return sorted(set(opts.brokers))
    if opts.discovery == "endpointslices":
        lister = list_slices or list_slices_from_api
        found = from_slices(lister(opts.broker_service, opts.namespace), opts.broker_port, opts.broker_processes)
        if not found:
            raise errors.BrokerUnavailable(
                f"no ready endpoints for service {opts.namespace}/{opts.broker_service}",
                service=opts.broker_service,
            )
        return found
    host = service_host(opts.broker_service, opts.namespace, opts.cluster_domain)
    return from_dns(host, opts.broker_port, resolve, opts.broker_processes)
