"""Fixtures for the chart and image suites: the chart rendered offline, the way `helm install` would.

helm-python-sdk binds Helm's own Go SDK (bundled as a shared library in the wheel), so rendering, schema
validation and lint run the real Helm code without a helm binary, a cluster or the network.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "charts" / "lmq"
RELEASE = "demo"
NAMESPACE = "mq"
# A current Kubernetes minor: the schemas of kubernetes-validate and helm lint's checks are pinned to it.
KUBE_VERSION = "1.34"

Manifest = dict[str, Any]
Render = Callable[..., list[Manifest]]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def kube_version() -> str:
    return KUBE_VERSION


@pytest.fixture(scope="session")
def release() -> str:
    return RELEASE


@pytest.fixture(scope="session")
def namespace() -> str:
    return NAMESPACE


@pytest.fixture(scope="session")
def chart_dir() -> Path:
    return CHART_DIR


@pytest.fixture(scope="session")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


def documents(text: str) -> list[Manifest]:
    return [doc for doc in yaml.load_all(text, Loader=yaml.CSafeLoader) if doc]


@pytest.fixture(scope="session")
def render(chart: helm.Chart) -> Render:
    """render(values=None, *, name=RELEASE, namespace=NAMESPACE) -> every rendered object, in file order.

    NOTES.txt is not an object and is left out; `render_notes` returns it.
    """

    def _render(
        values: dict[str, Any] | None = None, *, name: str = RELEASE, namespace: str = NAMESPACE
    ) -> list[Manifest]:
        rendered = chart.render(values or {}, name=name, namespace=namespace, is_install=True)
        objects: list[Manifest] = []
        for path in sorted(rendered):
            if not path.endswith(".txt"):
                objects.extend(documents(rendered[path]))
        return objects

    return _render


@pytest.fixture(scope="session")
def render_text(chart: helm.Chart) -> Callable[..., dict[str, str]]:
    """render_text(values=None): template path -> rendered text, unparsed (for cheap comparisons)."""

    def _render(values: dict[str, Any] | None = None) -> dict[str, str]:
        return chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)

    return _render


@pytest.fixture(scope="session")
def render_notes(chart: helm.Chart) -> Callable[..., str]:
    def _notes(values: dict[str, Any] | None = None) -> str:
        rendered = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
        return rendered["lmq/templates/NOTES.txt"]

    return _notes


def find(objects: list[Manifest], kind: str, name: str | None = None) -> list[Manifest]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


@pytest.fixture(scope="session")
def one() -> Callable[..., Manifest]:
    """one(objects, kind, name=None): the single object of that kind (and name); fails otherwise."""

    def _one(objects: list[Manifest], kind: str, name: str | None = None) -> Manifest:
        found = find(objects, kind, name)
        assert len(found) == 1, f"expected one {kind} {name or ''}, got {[o['metadata']['name'] for o in found]}"
        return found[0]

    return _one


@pytest.fixture(scope="session")
def crds(repo_root: Path) -> dict[str, Manifest]:
    """The CRDs of crds/ (the single source), by kind."""
    by_kind: dict[str, Manifest] = {}
    for path in sorted((repo_root / "crds").glob("*.yaml")):
        for doc in documents(path.read_text()):
            by_kind[doc["spec"]["names"]["kind"]] = doc
    assert by_kind, "no CRDs in crds/"
    return by_kind


# The Prometheus Operator's kinds the chart renders, with the fields of their CRDs the chart uses: strict, so a
# misspelt or misplaced field fails (kubernetes-validate has no schema for them).
_STRICT = {"additionalProperties": False}
_META = {
    "type": "object",
    "required": ["name", "namespace", "labels"],
    "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": {"type": "object"}},
    **_STRICT,
}
_SELECTOR = {
    "type": "object",
    "required": ["matchLabels"],
    "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}},
    **_STRICT,
}
_NAMESPACES = {
    "type": "object",
    "properties": {"matchNames": {"type": "array", "items": {"type": "string"}}},
    **_STRICT,
}
_ENDPOINT = {
    "type": "object",
    "required": ["port", "path", "interval"],
    "properties": {
        "port": {"type": "string"},
        "path": {"type": "string"},
        "interval": {
            "type": "string",
            "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
        },
    },
    **_STRICT,
}


def _monitor(endpoints_key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"type": "string"},
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["selector", endpoints_key],
                "properties": {
                    "namespaceSelector": _NAMESPACES,
                    "selector": _SELECTOR,
                    endpoints_key: {"type": "array", "minItems": 1, "items": _ENDPOINT},
                },
                **_STRICT,
            },
        },
        **_STRICT,
    }


_RULE = {
    "type": "object",
    "required": ["alert", "expr", "labels", "annotations"],
    "properties": {
        "alert": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
        "expr": {"type": "string"},
        "for": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    **_STRICT,
}
MONITORING_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": _monitor("endpoints"),
    "PodMonitor": _monitor("podMetricsEndpoints"),
    "PrometheusRule": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "PrometheusRule"},
            "metadata": _META,
            "spec": {
                "type": "object",
                "properties": {
                    "groups": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["name", "rules"],
                            "properties": {"name": {"type": "string"}, "rules": {"type": "array", "items": _RULE}},
                            **_STRICT,
                        },
                    }
                },
                **_STRICT,
            },
        },
        **_STRICT,
    },
}


@pytest.fixture(scope="session")
def monitoring_schemas() -> dict[str, dict[str, Any]]:
    return MONITORING_SCHEMAS
