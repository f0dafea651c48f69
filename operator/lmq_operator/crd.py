"""The CustomResourceDefinitions, built from the operator's models instead of written by hand.

A hand-written schema drifts from the model the operator parses with: a knob added in one and not the other,
a bound that differs, a field without a description. Here the spec models of ``model`` and the status models
below are the single declaration (``schema`` turns them into structural schemas); this module adds what
belongs to the resource rather than to a field: names, printer columns, and the rule that metadata.name must
be a broker-side name when it stands in for one. ``scripts/gen_crds.py`` writes the result to crds/, the
chart and docs/operator.md, and checks them for drift.

The status models describe what ``status.py`` writes; they are not used to write it, and the tests check
that every status it produces fits them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

import annotated_types
from pydantic import ConfigDict, Field

from lmq_operator import model, schema
from lmq_operator.model import CamelModel, Int32, Int64
from lmq_operator.schema import Schema

DateTime = Annotated[str, Field(json_schema_extra={"format": "date-time"})]

# ---- status: what status.py writes --------------------------------------------------------------------------


class _Status(CamelModel):
    model_config = ConfigDict(extra="forbid")


class Condition(_Status):
    """A standard Kubernetes condition: Ready on every resource, the kstatus pair Reconciling and Stalled while
    not Ready, BrokersDrained on ParentTopics."""

    type: str = Field(
        description="Ready; Reconciling (not Ready, retried until it is) or Stalled (not Ready until someone changes"
        " the spec or a broker), each present only while True; or BrokersDrained on a ParentTopic."
    )
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown (reconciliation paused).")
    reason: str | None = Field(None, description="One CamelCase word saying why, e.g. Applied or BrokerUnavailable.")
    message: str | None = Field(None, description="What happened, naming the brokers it is about.")
    observed_generation: Int64 | None = Field(None, description="The metadata.generation this condition is about.")
    last_transition_time: DateTime | None = Field(None, description="When status last changed.")


class _Broker(_Status):
    name: str = Field(description="The broker pod (or, without discovery, the configured endpoint).")
    endpoint: str | None = Field(None, description="host:port of the broker's admin service.")
    synced: bool = Field(description="Whether this broker holds the current spec.")
    message: str | None = Field(None, description="Why it is not in sync: the admin call's error.")


class ParentTopicBroker(_Broker):
    """One broker's copy of the topic."""

    lite_topic_count: Int64 | None = Field(None, description="Lite topics under this parent on this broker.")


class LiteGroupBroker(_Broker):
    """One broker's copy of the group."""

    subscription_count: Int64 | None = Field(None, description="Lite-topic subscriptions of the group on this broker.")
    client_count: Int64 | None = Field(None, description="Clients of the group connected to this broker.")
    lag: Int64 | None = Field(None, description="Messages the group has not consumed yet on this broker.")


class LiteQuotaBroker(_Broker):
    """One broker's copy of the quota."""


class LastReclaim(_Status):
    """The newest reclaim run the brokers recorded for this topic, counts summed over the brokers that recorded
    it. Never goes back to an older run."""

    run_id: str = Field(description="The run's name (the reclaim Job's name under the chart).")
    start_time: DateTime = Field(description="When the run started.")
    finish_time: DateTime = Field(description="When the last broker's share of the run finished.")
    dry_run: bool | None = Field(None, description="A dry run; reclaimed counts what it would have deleted.")
    brokers: Int32 = Field(description="Brokers that recorded this run.")
    scanned: Int64 | None = Field(
        None, description="Lite topics the scan returned (with the idle pushdown, only possibly expired ones)."
    )
    expired: Int64 | None = Field(None, description="Lite topics the expiration rules selected.")
    reclaimed: Int64 | None = Field(None, description="Lite topics deleted.")
    kept_by_race: Int64 | None = Field(
        None,
        description="Expired lite topics kept because a message, a consume or a subscriber arrived after the scan.",
    )
    not_found: Int64 | None = Field(
        None, description="Expired lite topics already deleted by someone else when the run got to them."
    )
    errors: Int64 | None = Field(
        None, description="Failed scan or delete calls for this topic; the run is safe to repeat."
    )


_CONDITIONS: Final = Field(
    None,
    max_length=16,
    description="The Ready condition (and BrokersDrained on a ParentTopic).",
    json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
)
_BROKERS_READY: Final = "Brokers holding the current spec / brokers found, as <in sync>/<brokers>."


class _ResourceStatus(_Status):
    observed_generation: Int64 | None = Field(None, description="The metadata.generation the operator last acted on.")
    brokers_ready: str | None = Field(None, description=_BROKERS_READY)
    conditions: tuple[Condition, ...] | None = _CONDITIONS


class ParentTopicStatus(_ResourceStatus):
    """What the operator last applied to the brokers, and what they report."""

    topic_name: str | None = Field(None, description="The broker-side name this resource manages.")
    lite_topic_count: Int64 | None = Field(None, description="Lite topics under this parent, summed over brokers.")
    last_reclaim: LastReclaim | None = Field(None, description=LastReclaim.__doc__)
    brokers: tuple[ParentTopicBroker, ...] | None = Field(None, max_length=1024, description="Per-broker sync state.")


class LiteGroupStatus(_ResourceStatus):
    """What the operator last applied to the brokers, and what they report."""

    group_name: str | None = Field(None, description="The broker-side name this resource manages.")
    subscription_count: Int64 | None = Field(
        None, description="Lite-topic subscriptions of the group, summed over brokers."
    )
    client_count: Int64 | None = Field(None, description="Clients of the group, summed over brokers.")
    lag: Int64 | None = Field(None, description="Messages not yet consumed by the group, summed over brokers.")
    brokers: tuple[LiteGroupBroker, ...] | None = Field(None, max_length=1024, description="Per-broker sync state.")


class LiteQuotaStatus(_ResourceStatus):
    """What the operator last applied to the brokers."""

    scope: str | None = Field(
        None, description='The broker-side scope this resource manages ("namespace:<ns>" or "parent:<topic>").'
    )
    brokers: tuple[LiteQuotaBroker, ...] | None = Field(None, max_length=1024, description="Per-broker sync state.")


class LmqUserBroker(_Broker):
    """One broker's copy of the user and its policies."""


class LmqUserStatus(_ResourceStatus):
    """What the operator last applied to the brokers (never the secret itself)."""

    user_name: str | None = Field(None, description="The broker-side user name this resource manages.")
    secret_version: str | None = Field(
        None,
        description="The Secret value every broker holds, as <secret>/<key>@<resourceVersion>; a Secret changed"
        " since is applied to every broker by the next reconcile.",
    )
    brokers: tuple[LmqUserBroker, ...] | None = Field(None, max_length=1024, description="Per-broker sync state.")


# ---- the resources ------------------------------------------------------------------------------------------


def _column(name: str, type_: str, path: str, description: str = "", priority: int = 0) -> dict[str, Any]:
    column: dict[str, Any] = {"name": name, "type": type_}
    if priority:
        column["priority"] = priority
    if description:
        column["description"] = description
    column["jsonPath"] = path
    return column


_READY_COLUMNS: Final = (
    _column("Brokers", "string", ".status.brokersReady", "Brokers in sync / brokers"),
    _column("Ready", "string", '.status.conditions[?(@.type=="Ready")].status'),
    _column("Reason", "string", '.status.conditions[?(@.type=="Ready")].reason'),
)
_AGE: Final = _column("Age", "date", ".metadata.creationTimestamp")


@dataclass(frozen=True)
class Resource:
    """One custom resource: its kind, its models and how `kubectl get` shows it."""

    kind: model.Kind
    short_name: str
    spec: type[CamelModel]
    status: type[CamelModel]
    columns: tuple[dict[str, Any], ...]
    name_field: str | None = None  # the spec field naming the broker-side object; metadata.name when unset
    noun: str = ""  # what that name names, for messages

    @property
    def name(self) -> str:
        return f"{self.kind.plural}.{model.GROUP}"


RESOURCES: Final = (
    Resource(
        model.Kind.PARENT_TOPIC,
        "pt",
        model.ParentTopicSpec,
        ParentTopicStatus,
        (
            _column("Topic", "string", ".status.topicName"),
            _column("Type", "string", ".spec.messageType"),
            _column(
                "Expiration",
                "integer",
                ".spec.liteTopicExpirationMinutes",
                "Minutes an idle lite topic lives (-1 never)",
            ),
            _column("Lite-Topics", "integer", ".status.liteTopicCount"),
            *_READY_COLUMNS,
            _column(
                "Reclaimed",
                "integer",
                ".status.lastReclaim.reclaimed",
                "Lite topics the last reclaim run deleted (would have, in a dry run), over its brokers",
                priority=1,
            ),
            _column(
                "Last-Reclaim",
                "date",
                ".status.lastReclaim.finishTime",
                "When the last reclaim run finished",
                priority=1,
            ),
            _AGE,
        ),
        name_field="topicName",
        noun="topic",
    ),
    Resource(
        model.Kind.LITE_GROUP,
        "lg",
        model.LiteGroupSpec,
        LiteGroupStatus,
        (
            _column("Group", "string", ".status.groupName"),
            _column("Parent", "string", ".spec.parentTopic"),
            _column("Model", "string", ".spec.subscriptionModel"),
            _column("Subscriptions", "integer", ".status.subscriptionCount"),
            _column("Lag", "integer", ".status.lag"),
            *_READY_COLUMNS,
            _AGE,
        ),
        name_field="groupName",
        noun="group",
    ),
    Resource(
        model.Kind.LITE_QUOTA,
        "lq",
        model.LiteQuotaSpec,
        LiteQuotaStatus,
        (
            _column("Scope", "string", ".status.scope"),
            _column("Max-Lite-Topics", "integer", ".spec.maxLiteTopics"),
            _column("Subs-Per-Client", "integer", ".spec.maxSubscriptionsPerClient"),
            _column("Send-Rate", "integer", ".spec.maxSendRate"),
            *_READY_COLUMNS,
            _AGE,
        ),
    ),
    Resource(
        model.Kind.LMQ_USER,
        "lu",
        model.LmqUserSpec,
        LmqUserStatus,
        (
            _column("User", "string", ".status.userName"),
            _column("Super", "boolean", ".spec.superUser"),
            _column("Enabled", "boolean", ".spec.enabled"),
            _column("Secret", "string", ".spec.secretRef.name"),
            *_READY_COLUMNS,
            _AGE,
        ),
        name_field="userName",
        noun="user",
    ),
)


_API_VERSION: Final = f"The versioned schema of this object: {model.GROUP}/{model.VERSION}."
_KIND: Final = "The REST resource this object represents."
_SPEC: Final = "What every broker pod should hold; the operator applies it and never writes it."


def manifest(resource: Resource) -> dict[str, Any]:
    """The CustomResourceDefinition of ``resource``, as a plain dict ready to be dumped."""
    root: Schema = {
        "type": "object",
        "description": schema.one_line(resource.spec.__doc__),
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": _API_VERSION},
            "kind": {"type": "string", "description": _KIND},
            # The apiserver describes metadata itself; the bound lets CEL rules read metadata.name cheaply.
            "metadata": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 253}}},
            "spec": schema.object_schema(resource.spec, "spec", _SPEC),
            "status": schema.object_schema(resource.status, "status", schema.one_line(resource.status.__doc__)),
        },
    }
    if resource.name_field is not None:
        root["x-kubernetes-validations"] = [_name_default_rule(resource)]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": resource.name, "labels": {"app.kubernetes.io/part-of": "lmq"}},
        "spec": {
            "group": model.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": resource.kind.value,
                "listKind": f"{resource.kind.value}List",
                "plural": resource.kind.plural,
                "singular": resource.kind.value.lower(),
                "shortNames": [resource.short_name],
                "categories": ["lmq"],
            },
            "versions": [
                {
                    "name": model.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": list(resource.columns),
                    "schema": {"openAPIV3Schema": schema.ordered(root)},
                }
            ],
        },
    }


@dataclass(frozen=True)
class FieldRow:
    """One field of a spec, for the reference table of docs/operator.md."""

    path: str
    type: str
    default: str
    limits: str
    description: str


def field_rows(resource: Resource) -> Iterator[FieldRow]:
    """The spec's fields, depth first, as the generated schema has them."""
    spec = manifest(resource)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    yield from _rows(spec, "", set(spec.get("required", ())))


def _name_default_rule(resource: Resource) -> dict[str, str]:
    """metadata.name stands in for an unset spec.<name_field>: then it must be a name the broker accepts."""
    field = resource.name_field
    info = next(i for n, i in resource.spec.model_fields.items() if (i.alias or n) == field)
    _, metadata, _ = schema.unwrap(info.annotation)
    (matches,) = schema.take(metadata, schema.Matches)
    (max_len,) = schema.take(metadata, annotated_types.MaxLen)
    limit = max_len.max_length
    complaint = (
        f" is not a valid broker {resource.noun} name: it {matches.complaint} and be at most {limit} characters"
        f" long; set spec.{field}"
    )
    return {
        "rule": f"has(self.spec.{field}) || (size(self.metadata.name) <= {limit}"
        f" && self.metadata.name.matches({schema.quoted(f'^{matches.regex}$')}))",
        "messageExpression": f"'metadata.name ' + self.metadata.name + {schema.quoted(complaint)}",
    }


def _rows(node: Schema, prefix: str, required: set[str]) -> Iterator[FieldRow]:
    for name, child in node.get("properties", {}).items():
        path = f"{prefix}{name}"
        kind = child["type"]
        if kind == "array":
            kind = f"[]{child['items']['type']}"
        if "enum" in child:
            kind = " | ".join(child["enum"])
        default = "required" if name in required else _shown(child.get("default"))
        yield FieldRow(path, kind, default, _limits(child), child["description"])
        if child["type"] == "object":
            yield from _rows(child, f"{path}.", set(child.get("required", ())))
        elif child["type"] == "array" and child["items"]["type"] == "object":
            yield from _rows(child["items"], f"{path}[].", set(child["items"].get("required", ())))


def _shown(default: Any) -> str:
    if default is None:
        return ""
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, list):
        return "[" + ", ".join(map(str, default)) + "]"
    if default == {}:
        return "{}"
    return str(default)


def _limits(node: Schema) -> str:
    """The bounds of a field in words: range, length, characters, entries."""
    parts = []
    if "minimum" in node or "maximum" in node:
        parts.append(f"{node.get('minimum', '')}..{node.get('maximum', '')}")
    if any(r["rule"] == "self != 0" for r in node.get("x-kubernetes-validations", ())):
        parts.append("not 0")
    if "maxLength" in node:
        parts.append(f"{node.get('minLength', 0)}..{node['maxLength']} chars")
    for rule in node.get("x-kubernetes-validations", ()):
        if rule["rule"].startswith("self.matches("):
            parts.append("`" + rule["rule"].removeprefix("self.matches('^").removesuffix("$')") + "`")
    if "maxItems" in node:
        parts.append(
            f"{node.get('minItems', 0)}..{node['maxItems']} entries"
            if "minItems" in node
            else f"at most {node['maxItems']} entries"
        )
        each = _limits(node["items"])
        if each:
            parts.append(f"each {each}")
    return ", ".join(parts)
