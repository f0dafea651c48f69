"""The CRDs as generated from the operator's models: committed copies equal the generated ones, every field is
described, the CRD's defaults are the models' defaults, the status the operator writes fits the status models,
and the names the CRD admits are the names the broker accepts. In process, no apiserver: tests/operator/
test_crds.py sends the same CRDs to a real one.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import pydantic
import pytest
import yaml

from lmq_broker import model as broker_model
from lmq_operator import crd, desired, model, schema, status

REPO = Path(__file__).resolve().parents[2]
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
BY_KIND = {r.kind: r for r in crd.RESOURCES}


def openapi(resource: crd.Resource) -> dict[str, Any]:
    (version,) = crd.manifest(resource)["spec"]["versions"]
    root: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return root


def properties(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every property below ``node``, depth first, with its dotted path, and array entries that are objects
    (``[]``; `kubectl explain` describes those)."""
    for name, child in node.get("properties", {}).items():
        yield f"{path}.{name}", child
        yield from properties(child, f"{path}.{name}")
    if node.get("items", {}).get("type") == "object":
        yield f"{path}[]", node["items"]
        yield from properties(node["items"], f"{path}[]")


@pytest.mark.parametrize("folder", ["crds", "charts/lmq/crds"])
def test_committed_crds_are_the_generated_ones(folder: str) -> None:
    committed = {p.name: yaml.safe_load(p.read_text()) for p in (REPO / folder).glob("*.yaml")}
    generated = {f"{model.GROUP}_{r.kind.plural}.yaml": crd.manifest(r) for r in crd.RESOURCES}
    assert committed.keys() == generated.keys()
    for name, manifest in generated.items():
        assert committed[name] == manifest, f"{folder}/{name} drifted from the models: run `make crds`"


@pytest.mark.parametrize("resource", crd.RESOURCES, ids=lambda r: r.kind.value)
def test_every_field_has_a_description(resource: crd.Resource) -> None:
    root = openapi(resource)
    assert root["description"]
    spec, status_ = root["properties"]["spec"], root["properties"]["status"]
    fields = [("spec", spec), ("status", status_), *properties(spec, "spec"), *properties(status_, "status")]
    assert len(fields) > 10
    undescribed = [path for path, node in fields if not node.get("description", "").strip()]
    assert undescribed == []


@pytest.mark.parametrize("resource", crd.RESOURCES, ids=lambda r: r.kind.value)
def test_every_spec_field_of_the_model_is_in_the_crd_under_its_camel_case_name(resource: crd.Resource) -> None:
    spec = openapi(resource)["properties"]["spec"]
    assert list(spec["properties"]) == [pydantic.alias_generators.to_camel(n) for n in resource.spec.model_fields]


def _apply_defaults(node: dict[str, Any], value: dict[str, Any]) -> dict[str, Any]:
    """What the apiserver's structural defaulting does to ``value``: missing defaulted fields get their default,
    then objects are defaulted inside."""
    out = copy.deepcopy(value)
    for name, child in node.get("properties", {}).items():
        if name not in out and "default" in child:
            out[name] = copy.deepcopy(child["default"])
        if child["type"] == "object" and isinstance(out.get(name), dict):
            out[name] = _apply_defaults(child, out[name])
    return out


@pytest.mark.parametrize(
    ("kind", "minimal"),
    [
        (model.Kind.PARENT_TOPIC, {}),
        (model.Kind.LITE_GROUP, {"parentTopic": "orders"}),
        (model.Kind.LITE_GROUP, {"parentTopic": "orders", "retryPolicy": {"maxAttempts": 3}}),
        (model.Kind.LITE_QUOTA, {"rocketmqNamespace": "prod"}),
    ],
)
def test_the_crds_defaults_are_the_models_defaults(kind: model.Kind, minimal: dict[str, Any]) -> None:
    defaulted = _apply_defaults(openapi(BY_KIND[kind])["properties"]["spec"], minimal)
    parsed = model.SPECS[kind].model_validate(minimal)
    assert defaulted == parsed.model_dump(mode="json", by_alias=True, exclude_none=True)


def _statuses(kind: model.Kind) -> Iterator[dict[str, Any]]:
    """Every shape of status status.py writes for ``kind``."""
    b0, b1 = model.Broker("b0", "10.0.0.1:8081", 0), model.Broker("b1", "10.0.0.2:8081", 1)
    figures = tuple((name, 3) for name in status.FIGURES[kind])
    run = model.ReclaimRun("lmq-reclaim-1", 1_767_225_600_000, 1_767_225_690_123, 5, 4, 2, 1, 0, 1, 0, True)
    syncs = [
        model.BrokerSync(b0, True, "missing", figures=figures, reclaim=run),
        model.BrokerSync(b1, False, "", model.Failure.UNAVAILABLE, "UNAVAILABLE: down"),
    ]
    applied = status.applied(kind, "key", generation=2, syncs=syncs, previous={}, now=NOW)
    yield applied
    yield status.with_condition(
        copy.deepcopy(applied), status.drained([model.Leaving(b1, 1, None, "data-b1")], {}, NOW)
    )
    yield status.applied(kind, "key", generation=2, syncs=[], previous={}, now=NOW)
    for reason in status.Reason:
        yield status.blocked(reason, "why", generation=3, previous=applied, now=NOW, key=(kind, "key"))


@pytest.mark.parametrize("resource", crd.RESOURCES, ids=lambda r: r.kind.value)
def test_the_status_the_operator_writes_fits_the_status_model(resource: crd.Resource) -> None:
    shapes = list(_statuses(resource.kind))
    for written in shapes:
        resource.status.model_validate(written)
    with pytest.raises(pydantic.ValidationError):  # guard: a field the CRD does not declare is refused
        resource.status.model_validate({**shapes[0], "undeclared": 1})
    if resource.kind is model.Kind.PARENT_TOPIC:
        assert "lastReclaim" in shapes[0]


@pytest.mark.parametrize("resource", crd.RESOURCES, ids=lambda r: r.kind.value)
def test_the_crd_names_every_condition_type_the_operator_writes(resource: crd.Resource) -> None:
    """`kubectl explain ...status.conditions.type` lists what a reader may meet (Reconciling and Stalled too)."""
    written = {c["type"] for shape in _statuses(resource.kind) for c in shape["conditions"]}
    assert written >= {status.READY, status.RECONCILING, status.STALLED}, written
    conditions = openapi(resource)["properties"]["status"]["properties"]["conditions"]
    described = conditions["items"]["properties"]["type"]["description"]
    for type_ in written | {status.DRAINED}:
        assert type_ in described, (type_, described)


NAME_SAMPLES = [
    "a",
    "orders",
    "%RETRY%group_1-x",
    "a" * 127,
    "a" * 128,
    "",
    "orders.eu",
    "a$b",
    "a b",
    "caf\u00e9",
    "UPPER_lower-09",
]


@pytest.mark.parametrize("name", NAME_SAMPLES)
def test_a_name_passes_the_crd_rules_exactly_when_the_broker_accepts_it(name: str) -> None:
    accepted = broker_model.is_valid_resource_name(name)
    for kind, field in [
        (model.Kind.PARENT_TOPIC, "topicName"),
        (model.Kind.LITE_GROUP, "groupName"),
        (model.Kind.LITE_QUOTA, "rocketmqNamespace"),
    ]:
        spec = {"parentTopic": "t"} if kind is model.Kind.LITE_GROUP else {}
        parsed = desired.parse(kind, {**spec, field: name})
        assert isinstance(parsed, desired.InvalidSpec) != accepted, (kind, name)
    # metadata.name stands in for an unset topic name
    stand_in = desired.config(model.Kind.PARENT_TOPIC, name, {})
    assert isinstance(stand_in, desired.InvalidSpec) != accepted


def test_the_crd_checks_names_with_the_models_rule_and_the_brokers_length() -> None:
    topic_name = openapi(BY_KIND[model.Kind.PARENT_TOPIC])["properties"]["spec"]["properties"]["topicName"]
    assert topic_name["maxLength"] == broker_model.MAX_RESOURCE_NAME_BYTES
    (rule,) = topic_name["x-kubernetes-validations"]
    assert rule["rule"] == "self.matches('^[%A-Za-z0-9_-]+$')"
    (root_rule,) = openapi(BY_KIND[model.Kind.PARENT_TOPIC])["x-kubernetes-validations"]
    assert f"size(self.metadata.name) <= {broker_model.MAX_RESOURCE_NAME_BYTES}" in root_rule["rule"]


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"parentTopic": "t", "retryPolicy": {"backoff": ["0s"]}}, "at least 1ms"),
        ({"parentTopic": "t", "retryPolicy": {"backoff": ["0000000000000001s"]}}, "at most 16"),
        ({"parentTopic": "t", "readySetCapacity": 9}, "readySetCapacity"),
        ({"parentTopic": "t", "wildcard": True, "litePatterns": ["a b"]}, "may only contain letters"),
        ({"parentTopic": "t", "litePatterns": ["s-*"]}, "spec.litePatterns needs spec.wildcard: true"),
        # the brokers store no delay as their default ones: the copy would differ from the spec at every resync
        ({"parentTopic": "t", "retryPolicy": {"backoff": []}}, "retryPolicy.backoff: Tuple should have at least 1"),
        # the patterns' grammar is the brokers' (beyond the CRD's rules): Invalid, not refused by every broker
        ({"parentTopic": "t", "wildcard": True, "litePatterns": ["a", "a/#/c"]}, "litePatterns[1] 'a/#/c': '#' must"),
    ],
)
def test_values_the_broker_refuses_are_invalid_specs(spec: dict[str, Any], needle: str) -> None:
    parsed = desired.parse(model.Kind.LITE_GROUP, spec)
    assert isinstance(parsed, desired.InvalidSpec) and needle in parsed.message


def test_integers_must_fit_the_admin_apis_width() -> None:
    quota = {"parentTopic": "t", "maxSubscriptionsPerClient": 2**31}
    parsed = desired.parse(model.Kind.LITE_QUOTA, quota)
    assert isinstance(parsed, desired.InvalidSpec) and "int32" in parsed.message
    assert not isinstance(
        desired.parse(model.Kind.LITE_QUOTA, {**quota, "maxSubscriptionsPerClient": 2**31 - 1}), desired.InvalidSpec
    )
    field = openapi(BY_KIND[model.Kind.LITE_QUOTA])["properties"]["spec"]["properties"]["maxSubscriptionsPerClient"]
    assert (field["format"], field["maximum"]) == ("int32", 2**31 - 1)


# ---- the builder refuses what it cannot say ----------------------------------------------------------------


class _Undescribed(model.CamelModel):
    """A model with a field nobody described."""

    knob: int = 1


class _Unsupported(model.CamelModel):
    """A model with a type the CRD cannot express."""

    knob: dict[str, int] = pydantic.Field(default_factory=dict, description="A map.")


class _UnknownConstraint(model.CamelModel):
    """A model with a constraint the builder would silently drop."""

    knob: Annotated[int, pydantic.Field(multiple_of=5)] = pydantic.Field(5, description="Fives.")


@pytest.mark.parametrize(
    ("cls", "needle"),
    [
        (_Undescribed, "spec.knob: every field needs a description"),
        (_Unsupported, "spec.knob: no CRD schema"),
        (_UnknownConstraint, "spec.knob: not expressed in the CRD"),
    ],
)
def test_the_builder_refuses_what_the_crd_cannot_say(cls: type[model.CamelModel], needle: str) -> None:
    with pytest.raises(schema.SchemaError, match=needle):
        schema.object_schema(cls, "spec", "a test model")
