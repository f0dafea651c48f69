"""The operator's values: custom-resource specs as parsed, and broker-side configs as applied.

Specs are pydantic models because they arrive as untrusted dicts (the CRD schema validates on a real
apiserver, but a hand-edited object or an older CRD may still carry nonsense): parsing them again here turns
that into an ``Invalid`` condition instead of a crash. Configs are frozen dataclasses so that "in sync" is
plain equality between what we want and what a broker reports.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Final, Literal, NewType

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

GROUP: Final = "lmq.io"
VERSION: Final = "v1alpha1"
ANNOTATION_MANAGED: Final = "lmq.io/managed"
ANNOTATION_PAUSED: Final = "lmq.io/pause-reconciliation"
FINALIZER: Final = "lmq.io/finalizer"

LITE_MESSAGE_TYPE: Final = 5  # apache.rocketmq.v2.MessageType.LITE
MAX_EXPIRATION_MINUTES: Final = 43_200  # 30 days
UNLIMITED: Final = -1

NAME_RE: Final = re.compile(r"^[%A-Za-z0-9_-]{1,127}$")
NAMESPACE_RE: Final = re.compile(r"^[%A-Za-z0-9_.-]{1,127}$")
DURATION_RE: Final = re.compile(r"^([0-9]{1,9})(ms|s|m|h)$")
_UNIT_MS: Final = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000}
# RocketMQ's customized backoff for lite groups
DEFAULT_BACKOFF: Final = ("1s", "5s", "10s", "30s", "1m", "2m", "3m", "4m", "5m", "6m", "7m", "8m", "9m", "10m")
DEFAULT_BACKOFF_TAIL: Final = ("20m", "30m", "1h", "2h")

BrokerName = NewType("BrokerName", str)


class Kind(enum.StrEnum):
    PARENT_TOPIC = "ParentTopic"
    LITE_GROUP = "LiteGroup"
    LITE_QUOTA = "LiteQuota"

    @property
    def plural(self) -> str:
        return {"ParentTopic": "parenttopics", "LiteGroup": "litegroups", "LiteQuota": "litequotas"}[self.value]


class Mode(enum.Enum):
    """What the annotations allow the operator to do with a resource."""

    MANAGED = "managed"
    UNMANAGED = "unmanaged"
    PAUSED = "paused"


def duration_ms(text: str) -> int:
    match = DURATION_RE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a duration like 500ms, 10s, 5m or 2h")
    return int(match.group(1)) * _UNIT_MS[match.group(2)]


def _check_name(value: str | None, field: str) -> str | None:
    if value is not None and not NAME_RE.match(value):
        raise ValueError(f"{field} {value!r} may only contain letters, digits, %, _ and - (1-127 chars)")
    return value


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)


class ParentTopicSpec(_Spec):
    topic_name: str | None = Field(None, alias="topicName")
    message_type: Literal["LITE"] = Field("LITE", alias="messageType")
    lite_topic_expiration_minutes: int = Field(UNLIMITED, alias="liteTopicExpirationMinutes")
    max_lite_topics: int = Field(UNLIMITED, alias="maxLiteTopics")
    deletion_policy: Literal["delete", "retain"] = Field("delete", alias="deletionPolicy")

    @field_validator("topic_name")
    @classmethod
    def _topic_name(cls, value: str | None) -> str | None:
        return _check_name(value, "spec.topicName")

    @field_validator("lite_topic_expiration_minutes")
    @classmethod
    def _expiration(cls, value: int) -> int:
        if value != UNLIMITED and not 1 <= value <= MAX_EXPIRATION_MINUTES:
            raise ValueError(f"must be -1 (never) or between 1 and {MAX_EXPIRATION_MINUTES}, got {value}")
        return value

    @field_validator("max_lite_topics")
    @classmethod
    def _max_lite_topics(cls, value: int) -> int:
        if value != UNLIMITED and value < 1:
            raise ValueError(f"must be -1 (unlimited) or at least 1, got {value}")
        return value


class RetryPolicySpec(_Spec):
    max_attempts: int = Field(17, alias="maxAttempts", ge=1, le=1000)
    backoff: tuple[str, ...] = Field(DEFAULT_BACKOFF + DEFAULT_BACKOFF_TAIL, max_length=64)

    @field_validator("backoff")
    @classmethod
    def _backoff(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for entry in value:
            duration_ms(entry)
        return value


class LiteGroupSpec(_Spec):
    group_name: str | None = Field(None, alias="groupName")
    parent_topic: str = Field(alias="parentTopic")
    subscription_model: Literal["Shared", "Exclusive"] = Field("Shared", alias="subscriptionModel")
    client_subscription_quota: int = Field(2000, alias="clientSubscriptionQuota", ge=1, le=1_000_000)
    ready_set_capacity: int = Field(100, alias="readySetCapacity", ge=10, le=1_000_000)
    retry_policy: RetryPolicySpec = Field(RetryPolicySpec.model_validate({}), alias="retryPolicy")
    fifo: bool = True
    consume_enabled: bool = Field(True, alias="consumeEnabled")
    wildcard: bool = False

    @field_validator("group_name")
    @classmethod
    def _group_name(cls, value: str | None) -> str | None:
        return _check_name(value, "spec.groupName")

    @field_validator("parent_topic")
    @classmethod
    def _parent_topic(cls, value: str) -> str:
        _check_name(value, "spec.parentTopic")
        return value


class LiteQuotaSpec(_Spec):
    namespace: str | None = Field(None, alias="rocketmqNamespace")
    parent_topic: str | None = Field(None, alias="parentTopic")
    max_lite_topics: int = Field(UNLIMITED, alias="maxLiteTopics", ge=UNLIMITED)
    max_subscriptions_per_client: int = Field(UNLIMITED, alias="maxSubscriptionsPerClient", ge=UNLIMITED)
    max_send_rate: int = Field(UNLIMITED, alias="maxSendRate", ge=UNLIMITED)

    @field_validator("parent_topic")
    @classmethod
    def _parent_topic(cls, value: str | None) -> str | None:
        return _check_name(value, "spec.parentTopic")

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str | None) -> str | None:
        if value is not None and not NAMESPACE_RE.match(value):
            raise ValueError(f"spec.rocketmqNamespace {value!r} may only contain letters, digits, %, ., _ and -")
        return value

    @model_validator(mode="after")
    def _one_scope(self) -> LiteQuotaSpec:
        if (self.namespace is None) == (self.parent_topic is None):
            raise ValueError("exactly one of spec.rocketmqNamespace and spec.parentTopic must be set")
        return self


Spec = ParentTopicSpec | LiteGroupSpec | LiteQuotaSpec


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


Config = TopicConfig | GroupConfig | QuotaConfig


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
    the last reclaim run it recorded)."""

    config: Config
    figures: tuple[tuple[str, int], ...] = ()
    reclaim: ReclaimRun | None = None


@dataclass(frozen=True, slots=True, order=True)
class Broker:
    """A broker pod the operator can reach. ``ordinal`` is the StatefulSet ordinal (list index when static)."""

    name: BrokerName
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
    replicas: int
    undrained_messages: int | None
    claim: str | None = None


class Failure(enum.StrEnum):
    UNAVAILABLE = "unavailable"  # could not reach the broker or it timed out: retry later
    REJECTED = "rejected"  # the broker answered no (invalid, conflict): retrying the same spec will not help


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
