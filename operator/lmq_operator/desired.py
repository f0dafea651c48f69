"""From a custom resource to the config every broker should hold.

Pure: nothing here knows kopf or a broker. A spec that does not parse becomes an ``InvalidSpec`` value (the
handler reports it as ``Ready=False, Invalid``); it never raises into kopf, which would retry it forever.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import pydantic

from lmq_broker.access.policy import MAX_SECRET_CHARS, MIN_SECRET_CHARS
from lmq_operator import model, status


@dataclass(frozen=True, slots=True)
class InvalidSpec:
    message: str


def mode(annotations: Mapping[str, str]) -> model.Mode:
    """Unmanaged wins over paused: an unmanaged resource has nothing left to pause."""
    if annotations.get(model.ANNOTATION_MANAGED, "").strip().lower() == "false":
        return model.Mode.UNMANAGED
    if annotations.get(model.ANNOTATION_PAUSED, "").strip().lower() == "true":
        return model.Mode.PAUSED
    return model.Mode.MANAGED


def parse(kind: model.Kind, spec: Mapping[str, Any]) -> model.Spec | InvalidSpec:
    try:
        return model.SPECS[kind].model_validate(dict(spec))
    except pydantic.ValidationError as exc:
        return InvalidSpec(_readable(exc))


def _readable(exc: pydantic.ValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"])
        msg = str(error["msg"]).removeprefix("Value error, ")
        parts.append(f"spec.{where}: {msg}" if where else msg)
    return "; ".join(parts)


def config(kind: model.Kind, name: str, spec: Mapping[str, Any]) -> model.Config | InvalidSpec:
    """The config a broker should hold for the resource ``name`` (its metadata.name)."""
    parsed = parse(kind, spec)
    if isinstance(parsed, InvalidSpec):
        return parsed
    try:
        return parsed.config(name)
    except ValueError as exc:  # metadata.name stands in for an unset broker-side name and is not one
        return InvalidSpec(str(exc))


def broker_key(kind: model.Kind, name: str, spec: Mapping[str, Any]) -> str | None:
    """The broker-side name a resource claims, or None when its spec is invalid (it claims nothing)."""
    wanted = config(kind, name, spec)
    return None if isinstance(wanted, InvalidSpec) else wanted.key


# The spec fields that name the broker-side object, by kind (immutable, each checked at admission on its own),
# and what a name must be.
_NAMING: Final = {
    model.Kind.PARENT_TOPIC: "topicName",
    model.Kind.LITE_GROUP: "groupName",
    model.Kind.LMQ_USER: "userName",
}
_SCOPES: Final = (("rocketmqNamespace", "namespace"), ("parentTopic", "parent"))
_RESOURCE_NAME: Final = pydantic.TypeAdapter(model.ResourceName)
_USER_NAME: Final = pydantic.TypeAdapter(model.UserName)


def _valid(names: pydantic.TypeAdapter[str], value: Any) -> bool:
    try:
        names.validate_python(value)
    except pydantic.ValidationError:
        return False
    return True


def named_key(kind: model.Kind, name: str, spec: Mapping[str, Any]) -> str | None:
    """The broker-side name of a resource from its naming fields alone, also when the rest of its spec does not
    parse (None: they name none either). A spec that was valid when it was applied may not be now (edited into
    what only the operator refuses, or read by a newer operator): its broker copies must still go with it."""
    if kind is model.Kind.LITE_QUOTA:
        scopes = [(prefix, spec[field]) for field, prefix in _SCOPES if spec.get(field) is not None]
        if len(scopes) != 1 or not _valid(_RESOURCE_NAME, scopes[0][1]):
            return None
        return f"{scopes[0][0]}:{scopes[0][1]}"
    own = spec.get(_NAMING[kind])
    value = name if own is None else own
    return str(value) if _valid(_USER_NAME if kind is model.Kind.LMQ_USER else _RESOURCE_NAME, value) else None


def owner(claimants: Iterable[model.Claimant]) -> model.Claimant | None:
    """The oldest claimant owns a broker-side name; ties (same second) break on namespace/name, then uid."""
    return min(claimants, key=lambda c: (c.created, c.namespace, c.name, c.uid), default=None)


def conflicting_owner(uid: str, claimants: Iterable[model.Claimant]) -> model.Claimant | None:
    """The resource that owns the name instead of ``uid``; None when ``uid`` owns it or nobody else claims it."""
    first = owner(claimants)
    return None if first is None or first.uid == uid else first


@dataclass(frozen=True, slots=True)
class Blocked:
    """The operator must not touch brokers for this resource; ``key`` is the broker-side name when known."""

    reason: status.Reason
    message: str
    key: str | None = None


Secret = model.Credential | model.SecretProblem | None  # None: not read (deleting needs no secret)


def gate(
    kind: model.Kind,
    meta: Mapping[str, Any],
    spec: Mapping[str, Any],
    claims: Mapping[str, Iterable[model.Claimant]],
    secret: Secret = None,
) -> model.Config | Blocked:
    """What to apply, or why nothing may be applied: annotations first, then validity, then ownership, then (a
    user) its Secret."""
    current = mode(meta.get("annotations") or {})
    key = broker_key(kind, str(meta["name"]), spec)  # still shown in status: the name is immutable
    if current is model.Mode.UNMANAGED:
        text = f"{model.ANNOTATION_MANAGED}=false: brokers are neither changed nor cleaned up"
        return Blocked(status.Reason.UNMANAGED, text, key)
    if current is model.Mode.PAUSED:
        text = f"{model.ANNOTATION_PAUSED}=true: changes are not applied until the annotation is removed"
        return Blocked(status.Reason.RECONCILIATION_PAUSED, text, key)
    wanted = config(kind, str(meta["name"]), spec)
    if isinstance(wanted, InvalidSpec):
        return Blocked(status.Reason.INVALID, wanted.message)
    owner_ = conflicting_owner(str(meta["uid"]), claims.get(wanted.key, ()))
    if owner_ is not None:
        text = f"{kind.value} {owner_.ref} already manages {status.KEY_FIELD[kind]} {wanted.key!r}"
        return Blocked(status.Reason.RESOURCE_CONFLICT, text, wanted.key)
    if isinstance(wanted, model.UserConfig):
        return with_secret(wanted, secret)
    return wanted


def with_secret(wanted: model.UserConfig, secret: Secret) -> model.UserConfig | Blocked:
    """The user with its Secret's value, or why it cannot have one."""
    if isinstance(secret, model.SecretProblem):
        reason = status.Reason.SECRET_NOT_FOUND if secret.missing else status.Reason.SECRET_INVALID
        return Blocked(reason, secret.message, wanted.key)
    if secret is None:
        return wanted
    if not MIN_SECRET_CHARS <= len(secret.secret) <= MAX_SECRET_CHARS:
        text = (
            f"the secret in {secret.version.partition('@')[0]} must be {MIN_SECRET_CHARS}-{MAX_SECRET_CHARS} characters"
        )
        return Blocked(status.Reason.SECRET_INVALID, text, wanted.key)
    return dataclasses.replace(wanted, secret=secret.secret, secret_version=secret.version)
