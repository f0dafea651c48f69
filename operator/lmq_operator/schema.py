"""Kubernetes structural schemas from pydantic models, and the markers that carry what pydantic cannot say.

A model field declares its CRD field: the name (camelCased), the type, pydantic's bounds, the default and
the description. What only the apiserver can check at admission is said with the markers here, which also
check the same thing when the operator parses a spec, so one declaration serves both: ``Matches`` (a regex
and its message), ``NotZero``, ``Bits`` (the admin API's integer width) and ``Immutable`` (a transition
rule). Anything else goes through ``json_schema_extra``. A field without a description, or a type or
constraint this module cannot express, fails the build instead of being left out of the CRD.
"""

from __future__ import annotations

import re
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, GetCoreSchemaHandler
from pydantic.fields import FieldInfo
from pydantic_core import core_schema

Schema = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Matches:
    """The whole string must match ``regex`` (a regex both Python and CEL/RE2 read alike). The CRD gets it as a
    CEL rule whose message is ``<field> <value> <complaint>``."""

    regex: str
    complaint: str

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        pattern = re.compile(f"^(?:{self.regex})$")

        def check(value: str) -> str:
            if not pattern.match(value):
                raise ValueError(f"{value!r} {self.complaint}")
            return value

        return core_schema.no_info_after_validator_function(check, handler(source))


@dataclass(frozen=True, slots=True)
class Bits:
    """The admin API's width of an integer field: a value it cannot carry is refused (CRD: format, maximum)."""

    width: Literal[32, 64]

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        low, high = -(2 ** (self.width - 1)), 2 ** (self.width - 1) - 1

        def check(value: int) -> int:
            if not low <= value <= high:
                raise ValueError(f"{value} does not fit the admin API's int{self.width}")
            return value

        return core_schema.no_info_after_validator_function(check, handler(source))


@dataclass(frozen=True, slots=True)
class NotZero:
    """0 is refused (where -1 means unlimited and 0 would mean nothing at all); CEL rule ``self != 0``."""

    complaint: str

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        def check(value: int) -> int:
            if value == 0:
                raise ValueError(self.complaint)
            return value

        return core_schema.no_info_after_validator_function(check, handler(source))


@dataclass(frozen=True, slots=True)
class Immutable:
    """Fixed once the resource exists: the apiserver refuses a change (a transition rule; ``why`` ends its
    message) and the field's description says so."""

    why: str


_INT_FORMATS: Final = {32: "int32", 64: "int64"}
_KEY_ORDER: Final = (
    "type",
    "format",
    "description",
    "required",
    "enum",
    "default",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "items",
    "properties",
    "x-kubernetes-validations",
)


class SchemaError(TypeError):
    """A model declares something the CRD cannot say (or forgets a description)."""


def one_line(doc: str | None) -> str:
    """A docstring or description as the single line a schema description is."""
    return " ".join((doc or "").split())


def quoted(value: str) -> str:
    """``value`` as a CEL string literal."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def unwrap(tp: Any) -> tuple[Any, list[Any], bool]:
    """(bare type, the metadata of every Annotated layer, whether None is allowed)."""
    found: list[Any] = []
    optional = False
    while True:
        origin = get_origin(tp)
        if origin is Annotated:
            tp, *extra = get_args(tp)
            found.extend(extra)
        elif origin in (Union, types.UnionType):
            rest = [a for a in get_args(tp) if a is not type(None)]
            if len(rest) != 1:
                raise SchemaError(f"{tp}: a union other than `X | None` has no structural schema")
            tp, optional = rest[0], True
        else:
            return tp, _flat(found), optional


def _flat(metadata: list[Any]) -> list[Any]:
    """Metadata with nested FieldInfos opened up (their constraints, description and schema extras)."""
    out: list[Any] = []
    for item in metadata:
        if isinstance(item, FieldInfo):
            out.extend(_flat(list(item.metadata)))
            if item.description:
                out.append(_Description(item.description))
            if isinstance(item.json_schema_extra, Mapping):
                out.append(_Extra(dict(item.json_schema_extra)))
        else:
            out.append(item)
    return out


@dataclass(frozen=True)
class _Description:
    text: str


@dataclass(frozen=True)
class _Extra:
    keys: dict[str, Any]


def take(metadata: list[Any], kind: type[Any]) -> list[Any]:
    """Remove and return the metadata of one kind: what is left at the end was not understood."""
    taken = [m for m in metadata if isinstance(m, kind)]
    metadata[:] = [m for m in metadata if not isinstance(m, kind)]
    return taken


def _typed(tp: Any, metadata: list[Any], label: str) -> Schema:  # noqa: PLR0912 (a branch per JSON-schema keyword)
    """The schema of one value of type ``tp``; ``label`` names it in messages (e.g. spec.topicName)."""
    node: Schema = {}
    rules: list[dict[str, str]] = []
    for extra in take(metadata, _Extra):
        extra_rules = extra.keys.pop("x-kubernetes-validations", [])
        node.update(extra.keys)
        rules.extend(extra_rules)
    for description in take(metadata, _Description):
        node.setdefault("description", description.text)
    if get_origin(tp) is Literal:
        values = list(get_args(tp))
        if not all(isinstance(v, str) for v in values):
            raise SchemaError(f"{label}: only string literals are supported")
        node.update(type="string", enum=values)
    elif tp is bool:
        node["type"] = "boolean"
    elif tp is int:
        node["type"] = "integer"
        low = max((m.ge for m in take(metadata, annotated_types.Ge)), default=None)
        high = min((m.le for m in take(metadata, annotated_types.Le)), default=None)
        for bits in take(metadata, Bits):
            node["format"] = _INT_FORMATS[bits.width]
            if bits.width == 32:  # JSON integers are int64 already; narrower ones need their bound said
                high = min(high, 2**31 - 1) if high is not None else 2**31 - 1
        if low is not None:
            node["minimum"] = low
        if high is not None:
            node["maximum"] = high
        for not_zero in take(metadata, NotZero):
            rules.append({"rule": "self != 0", "message": f"{label} {not_zero.complaint}"})
    elif tp is str:
        node["type"] = "string"
        for min_len in take(metadata, annotated_types.MinLen):
            node["minLength"] = min_len.min_length
        for max_len in take(metadata, annotated_types.MaxLen):
            node["maxLength"] = max_len.max_length
        for matches in take(metadata, Matches):
            rules.append(
                {
                    "rule": f"self.matches({quoted(f'^{matches.regex}$')})",
                    "messageExpression": f"{quoted(label + ' ')} + self + {quoted(' ' + matches.complaint)}",
                }
            )
    elif get_origin(tp) is tuple:
        item, ellipsis = get_args(tp)
        if ellipsis is not Ellipsis:
            raise SchemaError(f"{label}: only tuple[X, ...] is supported")
        node["type"] = "array"
        for min_len in take(metadata, annotated_types.MinLen):
            node["minItems"] = min_len.min_length
        for max_len in take(metadata, annotated_types.MaxLen):
            node["maxItems"] = max_len.max_length
        item_type, item_metadata, _ = unwrap(item)
        node["items"] = _typed(item_type, item_metadata, f"{label} entry")
    elif isinstance(tp, type) and issubclass(tp, BaseModel):
        node = {**object_schema(tp, label, node.get("description") or one_line(tp.__doc__)), **node}
    else:
        raise SchemaError(f"{label}: no CRD schema for {tp!r}")
    if metadata:
        raise SchemaError(f"{label}: not expressed in the CRD: {metadata}")
    if rules:
        node["x-kubernetes-validations"] = [*node.get("x-kubernetes-validations", []), *rules]
    return node


def object_schema(cls: type[BaseModel], label: str, description: str) -> Schema:
    """The schema of the model ``cls`` at ``label`` (``spec``, ``spec.retryPolicy``, …)."""
    properties: Schema = {}
    required: list[str] = []
    transitions: list[dict[str, str]] = []  # rules on this object about its optional immutable fields
    for name, info in cls.model_fields.items():
        alias = info.alias or name
        where = f"{label}.{alias}"
        tp, metadata, optional = unwrap(info.annotation)
        metadata = [*_flat(list(info.metadata)), *metadata]
        immutable = take(metadata, Immutable)
        if isinstance(info.json_schema_extra, Mapping):
            metadata.append(_Extra(dict(info.json_schema_extra)))
        if not (info.description or (isinstance(tp, type) and issubclass(tp, BaseModel) and tp.__doc__)):
            raise SchemaError(f"{where}: every field needs a description (kubectl explain shows it)")
        node = _typed(tp, metadata, where)
        if info.description:
            node["description"] = one_line(info.description)
        if immutable:
            node["description"] += " Immutable."
        if info.is_required():
            required.append(alias)
        else:
            default = _default(info.get_default(call_default_factory=True))
            if default is not None:
                node["default"] = default
        for fixed in immutable:
            if optional:
                transitions.append(_immutable_optional(alias, where, fixed.why))
            else:
                if node["type"] != "string":
                    raise SchemaError(f"{where}: immutability messages are written for strings")
                node["x-kubernetes-validations"] = [
                    _immutable(where, fixed.why),
                    *node.get("x-kubernetes-validations", []),
                ]
        properties[alias] = ordered(node)
    schema: Schema = {"type": "object"}
    if description:
        schema["description"] = one_line(description)
    if required:
        schema["required"] = required
    schema["properties"] = properties
    extra = cls.model_config.get("json_schema_extra")
    declared = extra.get("x-kubernetes-validations") if isinstance(extra, Mapping) else None
    rules = [*transitions, *(declared if isinstance(declared, list) else [])]
    if rules:
        schema["x-kubernetes-validations"] = rules
    return ordered(schema)


def _default(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, BaseModel):  # a nested model at its own defaults: the apiserver fills them in
        if value != type(value).model_validate({}):
            raise SchemaError(f"{type(value).__name__}: a nested default must be the model's own defaults")
        return {}
    if isinstance(value, tuple):
        return list(value)
    return value


def _immutable(where: str, why: str) -> dict[str, str]:
    message = f"{where} is immutable: {why}"
    return {
        "rule": "self == oldSelf",
        "message": message,
        "messageExpression": f"{quoted(message + ' (was ')} + oldSelf + ', now ' + self + ')'",
    }


def _immutable_optional(alias: str, where: str, why: str) -> dict[str, str]:
    message = f"{where} is immutable: {why}"
    was = f"(has(oldSelf.{alias}) ? oldSelf.{alias} : 'unset')"
    now = f"(has(self.{alias}) ? self.{alias} : 'unset')"
    return {
        "rule": f"has(self.{alias}) == has(oldSelf.{alias}) && (!has(self.{alias}) || self.{alias} == oldSelf.{alias})",
        "message": message,
        "messageExpression": f"{quoted(message + ' (was ')} + {was} + ', now ' + {now} + ')'",
    }


def ordered(node: Schema) -> Schema:
    """``node`` with its keys in one fixed order, so that the generated YAML reads the same every time."""
    unknown = node.keys() - set(_KEY_ORDER)
    if unknown:
        raise SchemaError(f"schema keys without a place in the output: {sorted(unknown)}")
    return {key: node[key] for key in _KEY_ORDER if key in node}
