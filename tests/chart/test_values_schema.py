"""values.yaml is the manual and values.schema.json its guard: they describe the same keys, every key is
documented, unknown keys and wrong types are refused by Helm itself (the SDK binds Helm's Go code), and
the schema closes every object it describes (additionalProperties: false).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

Manifest = dict[str, Any]
Render = Callable[..., list[Manifest]]

# Objects the schema deliberately leaves open: Kubernetes types passed through to a pod spec, where the
# API server (and kubernetes-validate in test_render.py) checks them.
PASS_THROUGH = {
    "valueFrom", "nodeAffinity", "podAffinity", "podAntiAffinity", "labelSelector", "podSelector", "namespaceSelector",
    "extraVolumes[]", "extraContainers[]",
}  # fmt: skip
# Schema definitions of Kubernetes types: values.yaml sets some of their optional keys, not all of them.
KUBERNETES_TYPES = {"#/definitions/affinity", "#/definitions/resources"}


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def nested(path: str, value: Any) -> dict[str, Any]:
    tree: Any = value
    for key in reversed(path.split(".")):
        tree = {key: tree}
    result: dict[str, Any] = tree
    return result


@pytest.fixture(scope="module")
def schema(chart_dir: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((chart_dir / "values.schema.json").read_text())
    return loaded


def resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        ref: str = node["$ref"]
        assert ref.startswith("#/definitions/"), ref
        node = schema["definitions"][ref.removeprefix("#/definitions/")]
    return node


def object_nodes(schema: dict[str, Any], node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every object-typed schema node reachable from node, with a readable path."""
    node = resolve(schema, node)
    if node.get("type") == "object":
        yield path, node
    for key, child in node.get("properties", {}).items():
        yield from object_nodes(schema, child, f"{path}.{key}")
    if isinstance(node.get("additionalProperties"), dict):
        yield from object_nodes(schema, node["additionalProperties"], f"{path}.*")
    if isinstance(node.get("items"), dict):
        yield from object_nodes(schema, node["items"], f"{path}[]")
    for alternative in node.get("anyOf", []):
        yield from object_nodes(schema, alternative, path)


def test_the_schema_closes_every_object(schema: dict[str, Any]) -> None:
    open_objects = []
    for path, node in object_nodes(schema, schema, "$"):
        key = path.rsplit(".", 1)[-1]
        if key in PASS_THROUGH:
            continue
        extra = node.get("additionalProperties")
        if "properties" in node:
            if extra is not False:
                open_objects.append(path)
        elif not isinstance(extra, dict):  # a map of user keys must still type its values
            open_objects.append(path)
    assert open_objects == []


def test_the_schema_describes_exactly_the_keys_of_values_yaml(schema: dict[str, Any], chart: helm.Chart) -> None:
    def compare(values: dict[str, Any], node: dict[str, Any], path: str) -> Iterator[str]:
        optional_keys = node.get("$ref") in KUBERNETES_TYPES
        node = resolve(schema, node)
        properties = node.get("properties")
        if properties is None:  # a map of user keys (labels, requests...): its keys are free
            return
        for key in values.keys() - properties.keys():
            yield f"{path}{key}: in values.yaml, not in the schema"
        for key in properties.keys() - values.keys() if not optional_keys else ():
            yield f"{path}{key}: in the schema, not in values.yaml"
        for key in values.keys() & properties.keys():
            if isinstance(values[key], dict):
                yield from compare(values[key], properties[key], f"{path}{key}.")

    assert sorted(compare(chart.values, schema, "")) == []


def test_every_key_of_values_yaml_is_documented(chart_dir: Path, schema: dict[str, Any]) -> None:
    """Each chart key has a comment right above it (not the keys inside Kubernetes types or user maps)."""
    text = (chart_dir / "values.yaml").read_text()
    lines = text.splitlines()
    undocumented = []
    checked = []

    def walk(node: yaml.Node, schema_node: dict[str, Any], path: str) -> None:
        properties = resolve(schema, schema_node).get("properties")
        if not isinstance(node, yaml.MappingNode) or properties is None:
            return
        if schema_node.get("$ref") in KUBERNETES_TYPES:  # documented by Kubernetes
            return
        for key_node, value_node in node.value:
            key = f"{path}{key_node.value}"
            checked.append(key)
            above = lines[key_node.start_mark.line - 1].strip() if key_node.start_mark.line else ""
            if not above.startswith("#") or above == "#":
                undocumented.append(key)
            walk(value_node, properties.get(key_node.value, {}), key + ".")

    root = yaml.compose(text)
    assert root is not None
    walk(root, schema, "")
    assert len(checked) > 100
    assert "broker.persistence.retentionPolicy.whenScaled" in checked
    assert undocumented == []


def test_defaults_and_a_full_override_are_valid(chart: helm.Chart) -> None:
    chart.validate_schema(chart.values)
    chart.validate_schema(
        deep_merge(
            chart.values,
            {
                "broker": {
                    "image": {"digest": "sha256:" + "0" * 64},
                    "replicas": 7,
                    "podDisruptionBudget": {"maxUnavailable": "25%"},
                    "extraVolumeMounts": [{"name": "x", "mountPath": "/x", "readOnly": True}],
                },
                "operator": {"image": {"repository": "ops/operator"}},
                "tls": {"enabled": True, "certManager": {"enabled": True, "issuerRef": {"name": "ca"}}},
                "networkPolicy": {"adminFrom": [{"ipBlock": {"cidr": "10.1.0.0/16"}}]},
                "podSecurity": {"runAsUser": None},
                "reclaim": {"enabled": True, "timeZone": "America/Argentina/Buenos_Aires"},
                "backup": {"enabled": True, "existingClaim": "lmq-backups", "keep": 30},
            },
        )
    )


def object_paths(values: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Every key of values.yaml whose value is a map with fixed keys (where a typo must be refused)."""
    if prefix == "" or values:
        yield prefix
    for key, value in values.items():
        if isinstance(value, dict) and value and key not in ("requests", "limits"):
            yield from object_paths(value, f"{prefix}{key}.")


def test_an_unknown_key_is_refused_at_every_level(chart: helm.Chart) -> None:
    accepted = []
    paths = list(object_paths(chart.values))
    assert len(paths) > 20  # the walk really reached the nested sections
    for path in paths:
        values = nested(f"{path}replicaz", 1) if path else {"replicaz": 1}
        try:
            chart.validate_schema(deep_merge(chart.values, values))
        except helm.HelmValuesError as error:
            assert "replicaz" in str(error)
        else:
            accepted.append(path or "<top>")
    assert accepted == []


WRONG = [
    ("broker.replicas", "3"),
    ("broker.replicas", 0),
    ("broker.replicas", 2.5),
    ("broker.persistence.enabled", "yes"),
    ("broker.persistence.size", "ten gigs"),
    ("broker.persistence.accessModes", ["ReadWriteSometimes"]),
    ("broker.persistence.accessModes", []),
    ("broker.persistence.retentionPolicy.whenScaled", "Keep"),
    ("broker.service.type", "ExternalName"),
    ("broker.podDisruptionBudget.maxUnavailable", "one"),
    ("broker.resources", {"requests": {"memory": "lots"}}),
    ("broker.resources", {"limitz": {"memory": "1Gi"}}),
    ("broker.extraArgs", "--flush-mode async"),
    ("broker.extraArgs", [1]),
    ("broker.extraEnv", [{"value": "no name"}]),
    ("broker.extraEnv", [{"name": "A", "valu": "typo"}]),
    ("broker.tolerations", [{"operator": "Maybe"}]),
    ("broker.topologySpreadConstraints", [{"maxSkew": 1, "topologyKey": "zone"}]),
    ("broker.affinity", {"nodeAffinityy": {}}),
    ("broker.livenessProbe.periodSeconds", 0),
    ("broker.readinessProbe.path", "/other"),
    ("broker.terminationGracePeriodSeconds", -1),
    ("operator.enabled", 1),
    ("operator.watchNamespace", "Not_A_Namespace"),
    ("operator.serviceAccount.name", "Has Spaces"),
    ("operator.podAnnotations", {"a": 1}),
    ("commonLabels", {"team": True}),
    ("image.pullPolicy", "Sometimes"),
    ("broker.image.digest", "latest"),
    ("operator.image.digest", "sha256:short"),
    ("broker.podAntiAffinityPreset", "sometimes"),
    ("broker.topologySpread.maxSkew", 0),
    ("broker.topologySpread.whenUnsatisfiable", "Maybe"),
    ("broker.extraVolumes", [{"emptyDir": {}}]),
    ("broker.extraVolumeMounts", [{"name": "x"}]),
    ("broker.extraVolumeMounts", [{"name": "x", "mountPath": "relative"}]),
    ("operator.extraContainers", [{"name": "sidecar"}]),
    ("reclaim.extraVolumeMounts", [{"name": "x", "mountPath": "/x", "readonly": True}]),
    ("networkPolicy.enabled", "yes"),
    ("networkPolicy.extraIngress", [{"ports": [{"port": 70000}]}]),
    ("networkPolicy.adminFrom", [{"podSelectorr": {}}]),
    ("networkPolicy.clientFrom", [{"ipBlock": {"except": ["10.0.0.0/8"]}}]),
    ("tls.enabled", "true"),
    ("tls.caKey", "a/b"),
    ("tls.serverName", "Not A Name"),
    ("tls.certManager.duration", "90 days"),
    ("tls.certManager.extraDnsNames", ["not a name"]),
    ("crds.templated", "yes"),
    ("test.enabled", 1),
    ("image.tag", "has space"),
    ("imagePullSecrets", ["regcred"]),
    ("podSecurity.runAsUser", 0),
    ("podSecurity.fsGroup", "10001"),
    ("nameOverride", "UPPER"),
    ("clusterDomain", ""),
    ("reclaim.concurrencyPolicy", "Parallel"),
    ("reclaim.schedule", ""),
    ("reclaim.timeZone", "not a zone"),
    ("reclaim.startingDeadlineSeconds", 5),
    ("reclaim.scratchSizeLimit", 10),
    ("reclaim.sparkMaster", ""),
    ("reclaim.driverMemory", "1 GB"),
    ("backup.keep", 0),
    ("backup.schedule", ""),
]


@pytest.mark.parametrize(("path", "value"), WRONG, ids=[f"{p}={v!r}" for p, v in WRONG])
def test_a_wrong_value_is_refused(chart: helm.Chart, path: str, value: Any) -> None:
    with pytest.raises(helm.HelmValuesError) as refused:
        chart.validate_schema(deep_merge(chart.values, nested(path, value)))
    # Helm names the offending value, or for an unknown key its parent object and the key.
    parent, _, key = path.rpartition(".")
    message = str(refused.value)
    assert f"'/{path.replace('.', '/')}" in message or (
        f"'/{parent.replace('.', '/')}'" in message and f"'{key}'" in message
    ), message


def test_install_refuses_bad_values_before_rendering_anything(render: Render) -> None:
    # The same check runs on the install path (values are merged with the defaults first).
    with pytest.raises(helm.HelmValuesError, match="replicaz"):
        render({"broker": {"replicaz": 3}})
    with pytest.raises(helm.HelmValuesError, match="/broker/replicas"):
        render({"broker": {"replicas": "3"}})
