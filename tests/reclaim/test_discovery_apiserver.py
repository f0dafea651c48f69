"""EndpointSlice discovery against a real kube-apiserver (the operator's testenv; no kubelet, so the
slices are written the way the EndpointSlice controller would write them for the headless Service)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmq_operator import testing as kube
from lmq_reclaim import discovery, options


@pytest.mark.slow
def test_endpointslices_of_the_headless_service_give_the_ready_brokers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ip = kube.host_ip()
    base = ip.rsplit(".", 1)[0]
    ready, starting, other = f"{base}.201", f"{base}.202", f"{base}.203"
    with kube.testenv(tmp_path / "kube") as api:
        api.ensure_namespace("mq")

        def endpoint_slice(name: str, service: str, addresses: dict[str, bool]) -> dict[str, object]:
            return {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
                "addressType": "IPv4",
                "ports": [{"name": "grpc", "port": 8081, "protocol": "TCP"}],
                "endpoints": [{"addresses": [a], "conditions": {"ready": r}} for a, r in addresses.items()],
            }

        path = "/apis/discovery.k8s.io/v1/namespaces/mq/endpointslices"
        api.post(path, endpoint_slice("lmq-broker-headless-a", "lmq-broker-headless", {ready: True, starting: False}))
        api.post(path, endpoint_slice("other-a", "other", {other: True}))
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
        opts = options.parse(
            ["--broker-service", "lmq-broker-headless", "--namespace", "mq", "--discovery", "endpointslices"]
        )
        assert discovery.discover(opts) == [f"{ready}:8081"]
