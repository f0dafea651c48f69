"""Checks on what the admin plane is asked to store, with messages that name the offending field.

Each check returns the value to store: zeros that proto3 cannot tell from "unset" become the broker's
defaults here (client quota, ready-set capacity, retry policy), so a Put always reports what was stored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Final

from lmq_broker import errors, model
from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch import wildcards

EXPIRATION_MINUTES_MIN: Final = -1  # never expire
EXPIRATION_MINUTES_MAX: Final = 43_200  # 30 days: RocketMQ's upper bound
READY_CAPACITY_MIN: Final = 10
QUEUE_COUNT_MIN: Final = 1
QUEUE_COUNT_MAX: Final = 64
MAX_GROUP_PATTERNS: Final = 1000
MAX_LITES_PER_CALL: Final = 10_000  # lite topics one ResetLiteOffsets or TriggerLiteDispatch names
# Parent topics of lite topics, and plain topics for PushConsumer/SimpleConsumer (and rocketmq-a2a requests).
PARENT_MESSAGE_TYPES: Final = (model.MessageType.LITE, model.MessageType.NORMAL)
SCOPE_BROKER: Final = "broker"
SCOPE_KINDS: Final = ("parent", "namespace")
_NAME_RULE: Final = f"1..{model.MAX_RESOURCE_NAME_BYTES} bytes of [%A-Za-z0-9_-]"
_LITE_RULE: Final = f"1..{model.MAX_LITE_TOPIC_BYTES} bytes of [A-Za-z0-9_-]"


def _invalid(field: str, problem: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(f"{field}: {problem}", field=field)


def name(field: str, value: str) -> str:
    if not model.is_valid_resource_name(value):
        raise errors.InvalidName(f"{field}: {value!r} is not a valid name ({_NAME_RULE})", field=field)
    return value


def lite_topic(field: str, value: str) -> str:
    if not model.is_valid_lite_topic(value):
        raise errors.InvalidLiteTopic(f"{field}: {value!r} is not a valid lite topic ({_LITE_RULE})", field=field)
    return value


def lite_topics(field: str, values: Sequence[str]) -> list[str]:
    """The lite topics one call names: at most ``MAX_LITES_PER_CALL``, each valid."""
    if len(values) > MAX_LITES_PER_CALL:
        raise _invalid(field, f"at most {MAX_LITES_PER_CALL} lite topics per call, got {len(values)}")
    return [lite_topic(field, value) for value in values]


def _at_least(field: str, value: int, minimum: int) -> int:
    if value < minimum:
        raise _invalid(field, f"must be >= {minimum}, got {value}")
    return value


def parent_topic(topic: model.ParentTopic) -> model.ParentTopic:
    name("topic.name", topic.name)
    if topic.message_type not in PARENT_MESSAGE_TYPES:
        supported = " or ".join(f"{t.name} ({int(t)})" for t in PARENT_MESSAGE_TYPES)
        raise _invalid("topic.message_type", f"{topic.message_type.name} is not supported; use {supported}")
    if not QUEUE_COUNT_MIN <= topic.queue_count <= QUEUE_COUNT_MAX:
        raise _invalid("topic.queue_count", f"must be in {QUEUE_COUNT_MIN}..{QUEUE_COUNT_MAX}, got {topic.queue_count}")
    if topic.message_type is model.MessageType.LITE:
        # A lite topic is one queue of its own; the parent's queues are never read.
        if topic.queue_count != 1:
            raise _invalid("topic.queue_count", f"must be 1 for a LITE topic, got {topic.queue_count}")
    else:
        # Refused rather than silently ignored: a NORMAL topic has no lite topics to expire or count.
        defaults = model.ParentTopic(topic.name)
        for field in ("expiration_minutes", "max_lite_topics"):
            value, default = getattr(topic, field), getattr(defaults, field)
            if value != default:
                raise _invalid(
                    f"topic.{field}", f"applies to LITE topics only; must be {default} for a NORMAL topic, got {value}"
                )
    if not EXPIRATION_MINUTES_MIN <= topic.expiration_minutes <= EXPIRATION_MINUTES_MAX:
        raise _invalid(
            "topic.expiration_minutes",
            f"must be in {EXPIRATION_MINUTES_MIN}..{EXPIRATION_MINUTES_MAX}, got {topic.expiration_minutes}",
        )
    _at_least("topic.max_lite_topics", topic.max_lite_topics, -1)
    return topic


def lite_group(group: model.LiteGroup, config: BrokerConfig) -> model.LiteGroup:
    name("group.name", group.name)
    name("group.bind_topic", group.bind_topic)
    defaults = model.RetryPolicy()
    retry = dataclasses.replace(
        group.retry,
        max_attempts=group.retry.max_attempts or defaults.max_attempts,
        backoff_ms=group.retry.backoff_ms or defaults.backoff_ms,
    )
    group = dataclasses.replace(
        group,
        client_quota=group.client_quota or config.default_client_quota,
        ready_capacity=group.ready_capacity or config.default_ready_capacity,
        retry=retry,
    )
    _at_least("group.client_quota", group.client_quota, 1)
    _at_least("group.ready_capacity", group.ready_capacity, READY_CAPACITY_MIN)
    _at_least("group.retry.max_attempts", group.retry.max_attempts, 1)
    for index, delay in enumerate(group.retry.backoff_ms):
        _at_least(f"group.retry.backoff_ms[{index}]", delay, 1)
    if group.lite_patterns and not group.wildcard:
        raise _invalid("group.lite_patterns", "only a wildcard group takes lite topics by group-level patterns")
    if len(group.lite_patterns) > MAX_GROUP_PATTERNS:
        raise _invalid("group.lite_patterns", f"at most {MAX_GROUP_PATTERNS} patterns")
    for index, pattern in enumerate(group.lite_patterns):
        try:
            if len(pattern) > model.MAX_LITE_TOPIC_BYTES:
                raise ValueError(f"at most {model.MAX_LITE_TOPIC_BYTES} characters")
            wildcards.parse_pattern(pattern)
        except ValueError as exc:
            raise _invalid(f"group.lite_patterns[{index}]", f"{pattern[:160]!r}: {exc}") from None
    return group


def scope(value: str) -> str:
    if value == SCOPE_BROKER:
        return value
    kind, sep, target = value.partition(":")
    if not sep or kind not in SCOPE_KINDS:
        raise _invalid("quota.scope", f"{value!r} must be 'broker', 'parent:<topic>' or 'namespace:<namespace>'")
    name("quota.scope", target)
    return value


def quota(value: model.Quota) -> model.Quota:
    scope(value.scope)
    _at_least("quota.max_lite_topics", value.max_lite_topics, -1)
    _at_least("quota.max_subscriptions_per_client", value.max_subscriptions_per_client, -1)
    _at_least("quota.max_send_rate", value.max_send_rate, -1)
    return value


RUN_ID_MAX_BYTES: Final = 253  # a Kubernetes object name (the reclaim Job's) always fits


def reclaim_run(field: str, run: model.ReclaimRun) -> model.ReclaimRun:
    name(f"{field}.parent", run.parent)
    if not run.run_id or len(run.run_id.encode()) > RUN_ID_MAX_BYTES or not run.run_id.isprintable():
        raise _invalid(f"{field}.run_id", f"must be 1..{RUN_ID_MAX_BYTES} bytes of printable text, got {run.run_id!r}")
    _at_least(f"{field}.start_ms", run.start_ms, 0)
    _at_least(f"{field}.finish_ms", run.finish_ms, run.start_ms)
    for count in model.RECLAIM_COUNTS:
        _at_least(f"{field}.{count}", getattr(run, count), 0)
    return run


def limit(field: str, value: int, *, default: int, maximum: int) -> int:
    """A page or batch size: 0 means ``default``; more than ``maximum`` is refused, not clamped."""
    if value == 0:
        return default
    if not 1 <= value <= maximum:
        raise _invalid(field, f"must be in 1..{maximum} (0 for {default}), got {value}")
    return value
