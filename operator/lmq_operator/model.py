"""The operator's values: custom-resource specs as parsed, and broker-side configs as applied.

Specs are pydantic models because they arrive as untrusted dicts (the CRD schema validates on a real
apiserver, but a hand-edited object or an older CRD may still carry nonsense): parsing them again here turns
that into an ``Invalid`` condition instead of a crash. They are also where the CRDs come from: each field's
name (camelCased), type, bounds, default, description and ``schema`` markers are what
``lmq_operator.crd`` turns into the OpenAPI schema, so a knob is declared once, here, next to the one place
it is mapped onto the admin API's names (the specs' ``config`` methods). Configs are frozen dataclasses named
as the admin API names them, so that "in sync" is plain equality between what we want and what a broker
reports.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from lmq_broker import errors as broker_errors
from lmq_broker.access import policy as broker_policy
from lmq_broker.dispatch import wildcards
from lmq_broker.model import MAX_LITE_TOPIC_BYTES, MAX_RESOURCE_NAME_BYTES
from lmq_operator.schema import Bits, Immutable, Matches, NotZero

GROUP: Final = "lmq.io"
VERSION: Final = "v1alpha1"
ANNOTATION_MANAGED: Final = "lmq.io/managed"
ANNOTATION_PAUSED: Final = "lmq.io/pause-reconciliation"
FINALIZER: Final = "lmq.io/finalizer"

LITE_MESSAGE_TYPE: Final = 5  # apache.rocketmq.v2.MessageType.LITE
MAX_EXPIRATION_MINUTES: Final = 43_200  # 30 days
NO_LIMIT: Final = -1  # the admin API's "unlimited" / "never" for limits and expirations

_DURATION: Final = "0*([1-9][0-9]{0,8})(ms|s|m|h)"  # at least 1ms: the broker refuses a zero delay
_NOT_A_DURATION: Final = "is not a duration like 500ms, 10s, 5m or 2h (at least 1ms)"
DURATION_RE: Final = re.compile(f"^{_DURATION}$")
_UNIT_MS: Final = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000}
# RocketMQ's customized backoff for lite groups
DEFAULT_BACKOFF: Final = ("1s", "5s", "10s", "30s", "1m", "2m", "3m", "4m", "5m", "6m", "7m", "8m", "9m", "10m")
DEFAULT_BACKOFF_TAIL: Final = ("20m", "30m", "1h", "2h")


class Kind(enum.StrEnum):
    PARENT_TOPIC = "ParentTopic"
    LITE_GROUP = "LiteGroup"
    LITE_QUOTA = "LiteQuota"
    LMQ_USER = "LmqUser"

    @property
    def plural(self) -> str:
        return f"{self.value.lower()}s"


class Mode(enum.Enum):
    """What the annotations allow the operator to do with a resource."""

    MANAGED = "managed"
    UNMANAGED = "unmanaged"
    PAUSED = "paused"


def duration_ms(text: str) -> int:
    match = DURATION_RE.match(text)
    if match is None:
        raise ValueError(f"{text!r} {_NOT_A_DURATION}")
    return int(match.group(1)) * _UNIT_MS[match.group(2)]


# Names of broker-side objects (topics, groups, quota scopes), as the broker's admin service accepts them.
ResourceName = Annotated[
    str,
    Field(min_length=1, max_length=MAX_RESOURCE_NAME_BYTES),
    Matches("[%A-Za-z0-9_-]+", "may only contain letters, digits, %, _ and -"),
]
# Lite topic patterns (session-*, a/+/c, a/#); the brokers check the grammar (docs/protocol.md).
LitePattern = Annotated[
    str,
    Field(min_length=1, max_length=MAX_LITE_TOPIC_BYTES),
    Matches("[A-Za-z0-9_/+#*-]+", "may only contain letters, digits, _, -, / and the wildcards +, # and *"),
]
MAX_LITE_PATTERNS: Final = 1000  # the brokers' limit per group
_PATTERNS_NEED_WILDCARD: Final = "spec.litePatterns needs spec.wildcard: true"
Duration = Annotated[str, Field(max_length=16), Matches(_DURATION, _NOT_A_DURATION)]
Int32 = Annotated[int, Bits(32)]
Int64 = Annotated[int, Bits(64)]
_RESOURCE_NAME: Final = TypeAdapter(ResourceName)


class CamelModel(BaseModel):
    """A frozen model whose fields are spelled in camelCase in the custom resource: one name, two casings."""

    model_config = ConfigDict(frozen=True, extra="ignore", alias_generator=to_camel, populate_by_name=True)


def _name_or_default(own: str | None, metadata_name: str, noun: str, field: str) -> str:
    if own is not None:
        return own
    try:
        return _RESOURCE_NAME.validate_python(metadata_name)
    except ValidationError:
        raise ValueError(f"metadata.name {metadata_name!r} is not a valid broker {noun} name: set {field}") from None


class ParentTopicSpec(CamelModel):
    """A LITE parent topic on every broker pod: lite topics under it are created by producers on first send and
    reclaimed once idle for liteTopicExpirationMinutes."""

    topic_name: Annotated[ResourceName | None, Immutable("it cannot be added, changed or removed after creation")] = (
        Field(None, description="Broker-side topic name; defaults to metadata.name.")
    )
    message_type: Literal["LITE"] = Field(
        "LITE", description="Message type of the parent topic; only LITE is supported."
    )
    lite_topic_expiration_minutes: Annotated[
        Int32, NotZero(f"must be -1 (never) or between 1 and {MAX_EXPIRATION_MINUTES} (30 days)")
    ] = Field(
        NO_LIMIT,
        ge=NO_LIMIT,
        le=MAX_EXPIRATION_MINUTES,
        description="Minutes a lite topic may stay idle before the reclaim job deletes it; -1 never.",
    )
    max_lite_topics: Annotated[Int64, NotZero("must be -1 (unlimited) or at least 1")] = Field(
        NO_LIMIT,
        ge=NO_LIMIT,
        description="Maximum number of lite topics under this parent on each broker; -1 unlimited.",
    )
    deletion_policy: Literal["delete", "retain"] = Field(
        "delete",
        description="delete removes the topic and its lite topics from every broker when this resource is "
        "deleted; retain keeps them.",
    )

    def config(self, name: str) -> TopicConfig:
        """The topic every broker should hold for the resource ``name`` (its metadata.name)."""
        return TopicConfig(
            name=_name_or_default(self.topic_name, name, "topic", "spec.topicName"),
            expiration_minutes=self.lite_topic_expiration_minutes,
            max_lite_topics=self.max_lite_topics,
        )


class RetryPolicySpec(CamelModel):
    """How often and how late a message the group failed to consume is delivered again."""

    max_attempts: Int32 = Field(
        17, ge=1, le=1000, description="Delivery attempts before a message goes to the dead-letter queue."
    )
    backoff: tuple[Duration, ...] = Field(
        DEFAULT_BACKOFF + DEFAULT_BACKOFF_TAIL,
        min_length=1,  # the brokers store an empty backoff as their default one: it would differ at every resync
        max_length=64,
        description="Delay before each redelivery, as durations (ms, s, m, h); the last one repeats.",
    )


class LiteGroupSpec(CamelModel):
    """A lite consumer group on every broker pod, bound to one parent topic."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "!has(self.litePatterns) || size(self.litePatterns) == 0 || self.wildcard",
                 "message": _PATTERNS_NEED_WILDCARD},
            ]
        }
    )  # fmt: skip

    group_name: Annotated[ResourceName | None, Immutable("it cannot be added, changed or removed after creation")] = (
        Field(None, description="Broker-side consumer group name; defaults to metadata.name.")
    )
    parent_topic: Annotated[ResourceName, Immutable("a lite group stays bound to its parent topic")] = Field(
        description="Broker-side name of the bound parent topic (a ParentTopic's status.topicName)."
    )
    subscription_model: Literal["Shared", "Exclusive"] = Field(
        "Shared",
        description="Shared offers each lite topic to one client of the group at a time; Exclusive binds a lite "
        "topic to a single client.",
    )
    client_subscription_quota: Int32 = Field(
        2000,
        ge=1,
        le=1_000_000,
        description="Lite topics one client may subscribe to at once (RocketMQ lite.sub.client.quota).",
    )
    ready_set_capacity: Int32 = Field(
        100,
        ge=10,
        le=1_000_000,
        description="Capacity of each client's ready queue; overflow is caught up later instead of growing memory.",
    )
    retry_policy: RetryPolicySpec = Field(RetryPolicySpec.model_validate({}), description=RetryPolicySpec.__doc__)
    fifo: bool = Field(True, description="Deliver each lite topic's messages in order (one in flight per lite topic).")
    consume_enabled: bool = Field(True, description="false stops deliveries to the group without deleting it.")
    wildcard: bool = Field(
        False,
        description="Receive every lite topic of the parent topic (clients register with subscribeLiteAll; "
        "per-topic subscriptions are refused).",
    )
    lite_patterns: tuple[LitePattern, ...] = Field(
        (),
        max_length=MAX_LITE_PATTERNS,
        description="With wildcard: receive only the lite topics these patterns match (session-*, a/+/c, a/#); "
        "none: every lite topic. A change reaches clients with their next full sync (30 s).",
    )

    @model_validator(mode="after")
    def _patterns_need_wildcard(self) -> LiteGroupSpec:
        if self.lite_patterns and not self.wildcard:
            raise ValueError(_PATTERNS_NEED_WILDCARD)
        for index, pattern in enumerate(self.lite_patterns):  # the brokers' own grammar: what it refuses is Invalid
            try:
                wildcards.parse_pattern(pattern)
            except ValueError as exc:
                raise ValueError(f"spec.litePatterns[{index}] {pattern!r}: {exc}") from None
        return self

    def config(self, name: str) -> GroupConfig:
        """The group every broker should hold for the resource ``name`` (its metadata.name)."""
        return GroupConfig(
            name=_name_or_default(self.group_name, name, "group", "spec.groupName"),
            bind_topic=self.parent_topic,
            model=self.subscription_model,
            client_quota=self.client_subscription_quota,
            ready_capacity=self.ready_set_capacity,
            max_attempts=self.retry_policy.max_attempts,
            backoff_ms=tuple(duration_ms(d) for d in self.retry_policy.backoff),
            fifo=self.fifo,
            consume_enabled=self.consume_enabled,
            wildcard=self.wildcard,
            lite_patterns=self.lite_patterns,
        )


_SCOPE_IMMUTABLE: Final = (
    "the scope (spec.rocketmqNamespace / spec.parentTopic) is immutable: create another LiteQuota instead"
)


def _scope_cel(side: str) -> str:
    return (
        f"(has({side}.rocketmqNamespace) ? 'rocketmqNamespace ' + {side}.rocketmqNamespace"
        f" : has({side}.parentTopic) ? 'parentTopic ' + {side}.parentTopic : 'unset')"
    )


class LiteQuotaSpec(CamelModel):
    """Lite-topic limits for one RocketMQ namespace or one parent topic, on every broker pod; -1 is unlimited."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.rocketmqNamespace) != has(self.parentTopic)",
                    "message": "exactly one of spec.rocketmqNamespace and spec.parentTopic must be set",
                },
                {
                    "rule": "has(self.rocketmqNamespace) == has(oldSelf.rocketmqNamespace)"
                    " && (!has(self.rocketmqNamespace) || self.rocketmqNamespace == oldSelf.rocketmqNamespace)"
                    " && has(self.parentTopic) == has(oldSelf.parentTopic)"
                    " && (!has(self.parentTopic) || self.parentTopic == oldSelf.parentTopic)",
                    "message": _SCOPE_IMMUTABLE,
                    "messageExpression": f"'{_SCOPE_IMMUTABLE} (was ' + {_scope_cel('oldSelf')}"
                    f" + ', now ' + {_scope_cel('self')} + ')'",
                },
            ]
        }
    )

    rocketmq_namespace: ResourceName | None = Field(
        None, description="RocketMQ namespace (the clients' x-mq-namespace) the limits apply to."
    )
    parent_topic: ResourceName | None = Field(None, description="Broker-side parent topic name the limits apply to.")
    max_lite_topics: Int64 = Field(
        NO_LIMIT, ge=NO_LIMIT, description="Lite topics in scope on each broker; -1 unlimited."
    )
    max_subscriptions_per_client: Int32 = Field(
        NO_LIMIT, ge=NO_LIMIT, description="Lite-topic subscriptions one client may hold in scope; -1 unlimited."
    )
    max_send_rate: Int64 = Field(
        NO_LIMIT, ge=NO_LIMIT, description="Messages per second accepted in scope on each broker; -1 unlimited."
    )

    @model_validator(mode="after")
    def _one_scope(self) -> LiteQuotaSpec:
        if (self.rocketmq_namespace is None) == (self.parent_topic is None):
            raise ValueError("exactly one of spec.rocketmqNamespace and spec.parentTopic must be set")
        return self

    @property
    def scope(self) -> str:
        """The admin API's quota scope: ``namespace:<ns>`` or ``parent:<topic>``."""
        if self.rocketmq_namespace is not None:
            return f"namespace:{self.rocketmq_namespace}"
        return f"parent:{self.parent_topic}"

    def config(self, name: str) -> QuotaConfig:
        """The quota every broker should hold (a quota is named by its scope, not by ``name``)."""
        return QuotaConfig(
            scope=self.scope,
            max_lite_topics=self.max_lite_topics,
            max_subscriptions_per_client=self.max_subscriptions_per_client,
            max_send_rate=self.max_send_rate,
        )


# ---- users and their policies (the brokers' access control, docs/security.md) --------------------------------

# A user's name is its access key (MQv2-HMAC-SHA1) and its MQTT username, as the brokers accept it.
UserName = Annotated[
    str,
    Field(min_length=1, max_length=broker_policy.MAX_NAME_CHARS),
    Matches("[A-Za-z0-9._:@-]+", "may only contain letters, digits, '.', '_', ':', '@' and '-'"),
]
# What the brokers' policy parser reads (access.policy): checked here by the same parser, and at admission by
# this shape (a literal parent for Lite:, no blanks).
PolicyResource = Annotated[
    str,
    Field(min_length=1, max_length=broker_policy.MAX_RESOURCE_CHARS),
    Matches(
        "(?:[*]|(Topic|Group):[^\\s]+|Lite:[^/*?\\s]+/[^\\s]+)",
        "is not a resource: Topic:<name>, Group:<name>, Lite:<parent>/<name> (a name may be a prefix ending in * or"
        " a pattern with * and ?) or *",
    ),
]
SourceCidr = Annotated[
    str,
    Field(
        min_length=1,
        max_length=64,
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "isCIDR(self) || isIP(self)", "messageExpression": "self + ' is not an IP address or CIDR'"}
            ]
        },
    ),
]
Action = Literal["Pub", "Sub", "Create", "Update", "Delete", "Get", "List"]
MAX_POLICIES: Final = 32
MAX_POLICY_ITEMS: Final = 32  # resources or sources in one policy
# Characters of every policy's resources and sourceCidrs together. kopf keeps the spec it last handled in an
# annotation, and all of an object's annotations (with kubectl's last-applied copy) must fit in 256 KiB: a spec
# beyond it was Applied, then every patch of kopf's was refused, its deletion included (Terminating for good).
MAX_POLICY_CHARS: Final = 65_536
_POLICY_CHARS_CEL: Final = (
    "(has(self.policies) ? self.policies.map(p, p.resources.map(r, size(r)).sum()"
    " + (has(p.sourceCidrs) ? p.sourceCidrs.map(c, size(c)).sum() : 0)).sum() : 0)"
)
_POLICY_CHARS: Final = (
    f"spec.policies hold more than {MAX_POLICY_CHARS} characters of resources and sourceCidrs (the spec must fit"
    " in an annotation)"
)


class SecretRefSpec(CamelModel):
    """The Kubernetes Secret (in this resource's namespace) holding the user's secret key, which is also its MQTT
    password; the operator reads it on every reconcile, so a changed value reaches the brokers within a resync."""

    # What Kubernetes accepts as a Secret's name and as a key of its data: anything else names no Secret, and
    # would be read as another path (a name of "..") or refused by the apiserver (a handler failing forever).
    name: Annotated[
        str,
        Field(min_length=1, max_length=253),
        Matches(
            "[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*",
            "is not a Secret's name (a DNS subdomain: lower-case letters, digits, '-' and '.')",
        ),
    ] = Field(description="Name of the Secret.")
    key: Annotated[
        str,
        Field(min_length=1, max_length=253),
        Matches("[-._a-zA-Z0-9]*[-_a-zA-Z0-9][-._a-zA-Z0-9]*", "is not a key of a Secret's data"),
    ] = Field("secretKey", description="Key in the Secret's data whose value is the secret (8-256 characters).")


class PolicySpec(CamelModel):
    """Actions the user may (Allow) or may not (Deny) take on resources; deny wins, and anything no Allow names
    is refused."""

    resources: tuple[PolicyResource, ...] = Field(
        min_length=1,
        max_length=MAX_POLICY_ITEMS,
        description="Topic:<parent>, Group:<group>, Lite:<parent>/<lite topic> or *; a name is literal, a prefix"
        " ending in * (Lite:chat/tenant-a-*) or a pattern with * and ?.",
    )
    actions: tuple[Action, ...] = Field(
        min_length=1, max_length=7, description="Pub, Sub and the admin actions Create, Update, Delete, Get, List."
    )
    decision: Literal["Allow", "Deny"] = Field("Allow", description="Allow or Deny; a matching Deny always wins.")
    source_cidrs: tuple[SourceCidr, ...] = Field(
        (),
        max_length=MAX_POLICY_ITEMS,
        description="Client addresses the policy applies to (IP addresses or CIDRs); none: from anywhere.",
    )

    @model_validator(mode="after")
    def _broker_accepts(self) -> PolicySpec:
        for resource in self.resources:  # the brokers' own parser: what it refuses is Invalid here
            try:
                broker_policy.checked_entry(
                    broker_policy.Entry("u", resource, (broker_policy.Action.PUB,), sources=self.source_cidrs)
                )
            except broker_errors.LmqError as exc:
                raise ValueError(exc.message) from None
        return self


class LmqUserSpec(CamelModel):
    """A user of the brokers (an access/secret key pair for gRPC, a username/password for MQTT) and its policies,
    on every broker pod; the secret comes from a Secret, never from the spec."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                # no messageExpression: computing the sum twice exceeds the CRD's CEL cost budget
                {"rule": f"{_POLICY_CHARS_CEL} <= {MAX_POLICY_CHARS}", "message": _POLICY_CHARS}
            ]
        }
    )

    user_name: Annotated[UserName | None, Immutable("it cannot be added, changed or removed after creation")] = Field(
        None, description="Broker-side user name (the access key and MQTT username); defaults to metadata.name."
    )
    super_user: bool = Field(False, description="A super user may do everything; its policies are not consulted.")
    enabled: bool = Field(True, description="false refuses every call of the user without deleting it.")
    secret_ref: SecretRefSpec = Field(description=SecretRefSpec.__doc__)
    policies: tuple[PolicySpec, ...] = Field(
        (), max_length=MAX_POLICIES, description="What the user may do; none: nothing (unless superUser)."
    )
    deletion_policy: Literal["delete", "retain"] = Field(
        "delete",
        description="delete removes the user and its policies from every broker when this resource is deleted;"
        " retain keeps them.",
    )

    @model_validator(mode="after")
    def _one_entry_per_resource(self) -> LmqUserSpec:
        chars = sum(len(x) for p in self.policies for x in (*p.resources, *p.source_cidrs))
        if chars > MAX_POLICY_CHARS:
            raise ValueError(f"{_POLICY_CHARS}: {chars}")
        seen: set[tuple[str, str]] = set()
        for policy in self.policies:
            for resource in policy.resources:
                if (resource, policy.decision) in seen:
                    raise ValueError(f"{resource} is in two policies with decision {policy.decision}: name it once")
                seen.add((resource, policy.decision))
        return self

    def config(self, name: str) -> UserConfig:
        """The user every broker should hold, without its secret (``desired`` adds the Secret's value)."""
        entries = (
            AclEntryConfig(r, _sorted_actions(p.actions), p.decision, tuple(dict.fromkeys(p.source_cidrs)))
            for p in self.policies
            for r in p.resources
        )
        return UserConfig(
            name=self.user_name if self.user_name is not None else name,
            super_user=self.super_user,
            enabled=self.enabled,
            entries=tuple(sorted(entries, key=lambda e: e.key)),
        )


def _sorted_actions(actions: tuple[str, ...]) -> tuple[str, ...]:
    """As the brokers store them: once each, in their order."""
    order = [a.value for a in broker_policy.Action]
    return tuple(sorted(set(actions), key=order.index))


Spec = ParentTopicSpec | LiteGroupSpec | LiteQuotaSpec | LmqUserSpec
SPECS: Final[dict[Kind, type[ParentTopicSpec] | type[LiteGroupSpec] | type[LiteQuotaSpec] | type[LmqUserSpec]]] = {
    Kind.PARENT_TOPIC: ParentTopicSpec,
    Kind.LITE_GROUP: LiteGroupSpec,
    Kind.LITE_QUOTA: LiteQuotaSpec,
    Kind.LMQ_USER: LmqUserSpec,
}


# ---- broker-side configs: what one broker holds, compared field by field ------------------------------


@dataclass(frozen=True, slots=True)
class TopicConfig:
    name: str
    expiration_minutes: int
    max_lite_topics: int
    message_type: int = LITE_MESSAGE_TYPE

    @property
    def key(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True)
class GroupConfig:
    name: str
    bind_topic: str
    model: Literal["Shared", "Exclusive"]
    client_quota: int
    ready_capacity: int
    max_attempts: int
    backoff_ms: tuple[int, ...]
    fifo: bool
    consume_enabled: bool
    wildcard: bool
    lite_patterns: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True)
class QuotaConfig:
    scope: str  # "namespace:<ns>" or "parent:<topic>", as the admin service spells it
    max_lite_topics: int
    max_subscriptions_per_client: int
    max_send_rate: int

    @property
    def key(self) -> str:
        return self.scope


@dataclass(frozen=True, slots=True)
class AclEntryConfig:
    """One policy entry of a user, as the admin API names it (the user is the UserConfig's)."""

    resource: str
    actions: tuple[str, ...]
    decision: str  # "Allow" | "Deny"
    sources: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return (self.resource, self.decision)  # a broker keeps one entry per user, resource and decision


@dataclass(frozen=True, slots=True)
class UserConfig:
    """A user and its policy entries (sorted by key). Brokers never return a secret: ``secret_version`` says
    which Secret value a copy holds (the one the operator last applied everywhere, see ``apply``), and the
    secret itself takes no part in comparing."""

    name: str
    super_user: bool
    enabled: bool
    entries: tuple[AclEntryConfig, ...] = ()
    secret: str = field(default="", repr=False, compare=False)
    secret_version: str = ""  # "<secret>/<key>@<resourceVersion>" of the Secret the value came from

    @property
    def key(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True)
class Credential:
    """A user's secret as read from its Secret, and where from (its ``secret_version``)."""

    secret: str = field(repr=False)
    version: str


@dataclass(frozen=True, slots=True)
class SecretProblem:
    """The Secret a user names cannot be used: ``missing`` (not there, or without the key: it may still come)
    or not a usable secret."""

    message: str
    missing: bool = True


Config = TopicConfig | GroupConfig | QuotaConfig | UserConfig


@dataclass(frozen=True, slots=True)
class ReclaimRun:
    """What one broker recorded of the newest reclaim run for a parent topic: its own share of the counts."""

    run_id: str
    start_ms: int
    finish_ms: int
    scanned: int = 0
    expired: int = 0
    reclaimed: int = 0
    kept_changed: int = 0
    kept_subscribed: int = 0
    not_found: int = 0
    errors: int = 0
    dry_run: bool = False


@dataclass(frozen=True, slots=True)
class Observed:
    """One broker's copy of a config plus the live figures it reports beside it (and, for a parent topic,
    the last reclaim run it recorded; for a lite group, whether its parent topic is still there)."""

    config: Config
    figures: tuple[tuple[str, int], ...] = ()
    reclaim: ReclaimRun | None = None
    parent_missing: bool = False  # a lite group whose parent topic the broker does not hold (any more)


@dataclass(frozen=True, slots=True, order=True)
class Broker:
    """A broker pod the operator can reach. ``ordinal`` is the StatefulSet ordinal (list index when static)."""

    name: str  # the pod's name (the static endpoint without discovery)
    endpoint: str
    ordinal: int | None = None


@dataclass(frozen=True, slots=True)
class Claimant:
    """A resource that claims a broker-side name; the oldest claimant owns it."""

    namespace: str
    name: str
    uid: str
    created: str  # RFC 3339 creationTimestamp; sorts chronologically as text

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class Leaving:
    """A broker with an ordinal at or above the StatefulSet's replicas that may still hold data: it reported
    undrained messages, or it cannot be asked (no endpoint, no answer) while its PersistentVolumeClaim
    (``claim``) still exists. ``undrained_messages`` is None when it could not be asked."""

    broker: Broker
    replicas: int  # the StatefulSet's, or with ``draining`` the pods of the ring it is leaving
    undrained_messages: int | None
    claim: str | None = None
    draining: bool = False  # the operator scales down: the pod still runs and drains before it is stopped


class Failure(enum.StrEnum):
    UNAVAILABLE = "unavailable"  # could not reach the broker or it timed out: retry later
    REJECTED = "rejected"  # the broker answered no (invalid, conflict): retrying the same spec will not help
    MISSING_PARENT = "missing-parent"  # a lite group's parent topic is not on the broker (yet, or any more)


@dataclass(frozen=True, slots=True)
class BrokerSync:
    """What one reconcile achieved on one broker."""

    broker: Broker
    synced: bool
    change: str = "none"  # diff.Change value of the step that was executed
    failure: Failure | None = None
    message: str = ""
    figures: tuple[tuple[str, int], ...] = ()
    reclaim: ReclaimRun | None = None  # as observed before any write
