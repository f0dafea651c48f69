"""The control-plane metadata (parent topics, groups, quotas) the dispatcher reads, and the limits derived from it.

Parent topics, groups and quotas are few and change rarely (the operator writes them through the admin
service, which then calls ``LiveView.metadata_changed``), while every send and receive needs them. So the
dispatcher keeps one immutable ``Metadata`` copy, read from the store in one go, and swaps it when told that
metadata changed. Every limit is resolved here, in one place, from that copy and the broker config. (The admin
side's ``admin.catalog`` is what writes these records.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from lmq_broker import errors, model
from lmq_broker.access import policy
from lmq_broker.config import BrokerConfig
from lmq_broker.storage.api import Store

DLQ_PREFIX: Final = "%DLQ%"  # dead letters of group G go to the normal topic %DLQ%G (queue 0), read-only
NORMAL_GROUP_RETRY = model.RetryPolicy()
# The group of an MQTT session (docs/mqtt.md): implicit, like a normal topic's group, so that a client id costs
# no metadata write and no snapshot reload; bound to whichever parent it is used with (its offsets are per LMQ).
# MQTT never gives up on a QoS 1 message: a client that disconnects without PUBACK gets it again, so the
# attempts cap (then the DLQ) is far above what a live client reaches.
MQTT_GROUP_PREFIX: Final = policy.SESSION_GROUP_PREFIX  # which access control's rules never grant
MQTT_GROUP_RETRY = model.RetryPolicy(max_attempts=10_000, backoff_ms=(0,))


def _tightest(*limits: int) -> int:
    real = [x for x in limits if x >= 0]
    return min(real) if real else model.UNLIMITED


@dataclass(frozen=True, slots=True)
class Metadata:
    config: BrokerConfig
    parents: dict[str, model.ParentTopic] = field(default_factory=dict)
    groups: dict[str, model.LiteGroup] = field(default_factory=dict)
    quotas: dict[str, model.Quota] = field(default_factory=dict)
    # Whether any lite-topic count limit exists at all: when none does (the usual case) a send needs no
    # look at its lite topics. Derived once per copy.
    limits_lite_topics: bool = field(init=False)

    def __post_init__(self) -> None:
        limited = (
            self.config.max_lite_topics_per_broker >= 0
            or any(p.max_lite_topics >= 0 for p in self.parents.values())
            or any(q.max_lite_topics >= 0 for q in self.quotas.values())
        )
        object.__setattr__(self, "limits_lite_topics", limited)

    @staticmethod
    def load(store: Store, config: BrokerConfig) -> Metadata:
        """Blocking: run in an executor."""
        return Metadata(
            config,
            {t.name: t for t in store.list_parent_topics()},
            {g.name: g for g in store.list_groups()},
            {q.scope: q for q in store.list_quotas()},
        )

    # --- lookups that raise the domain error the edge maps to a status code -----------------------------
    def topic(self, name: str) -> model.ParentTopic:
        topic = self.parents.get(name)
        if topic is None:
            if name.startswith(DLQ_PREFIX) and len(name) > len(DLQ_PREFIX):
                return model.ParentTopic(name, model.MessageType.NORMAL, queue_count=1)
            raise errors.TopicNotFound(f"topic {name} does not exist", topic=name)
        return topic

    def lite_parent(self, name: str) -> model.ParentTopic:
        topic = self.topic(name)
        if topic.message_type != model.MessageType.LITE:
            raise errors.Conflict(f"topic {name} is not a LITE parent topic", kind="topic", topic=name)
        return topic

    def lite_group(self, name: str, parent: str) -> model.LiteGroup:
        """The lite group ``name``, which must be bound to ``parent``."""
        self.lite_parent(parent)
        group = self.groups.get(name)
        if group is None:
            if name.startswith(MQTT_GROUP_PREFIX):
                return model.LiteGroup(name, parent, retry=MQTT_GROUP_RETRY)
            raise errors.GroupNotFound(f"consumer group {name} does not exist", group=name)
        if group.bind_topic != parent:
            raise errors.Conflict(
                f"group {name} is bound to {group.bind_topic or 'no topic'}, not {parent}", kind="group", group=name
            )
        return group

    def consuming_lite_group(self, name: str, parent: str) -> model.LiteGroup:
        """As ``lite_group``, for subscribing and receiving, which a group with consumption off refuses."""
        group = self.lite_group(name, parent)
        if not group.consume_enabled:
            raise errors.Conflict(f"consumption of group {name} is disabled", kind="permission", group=name)
        return group

    def normal_group(self, name: str, topic: str) -> model.LiteGroup:
        """Groups consuming NORMAL topics need no declaration (RocketMQ auto-creates them); a lite group
        may not consume in normal mode."""
        self.topic(topic)
        group = self.groups.get(name)
        if group is None:
            return model.LiteGroup(name=name, bind_topic="", fifo=False, retry=NORMAL_GROUP_RETRY)
        bound = self.parents.get(group.bind_topic)
        if bound is not None and bound.message_type == model.MessageType.LITE:
            raise errors.Conflict(f"group {name} is a lite group of {group.bind_topic}", kind="group", group=name)
        return group

    # --- limits ---------------------------------------------------------------------------------------
    def _quota(self, scope: str) -> model.Quota | None:
        return self.quotas.get(scope)

    def _scopes(self, parent: str, namespace: str) -> list[model.Quota]:
        scopes = [f"parent:{parent}", "broker"]
        if namespace:
            scopes.append(f"namespace:{namespace}")
        return [q for q in (self._quota(s) for s in scopes) if q is not None]

    def client_quota(self, group: model.LiteGroup, parent: str, namespace: str = "") -> int:
        """Lite subscriptions one client may hold (UNLIMITED = -1)."""
        return _tightest(
            group.client_quota,
            *(q.max_subscriptions_per_client for q in self._scopes(parent, namespace)),
        )

    def advertised_client_quota(self, group: model.LiteGroup, parent: str, namespace: str = "") -> int:
        """What the settings frame tells the client: clients treat 0 or -1 as 'nothing allowed', so an
        unlimited quota is sent as the broker-wide subscription limit."""
        quota = self.client_quota(group, parent, namespace)
        return quota if quota != model.UNLIMITED else self.config.max_subscriptions_per_broker

    def lite_topic_limits(self, parent: model.ParentTopic) -> tuple[int, int]:
        """(max lite topics under ``parent``, max lite topics on the broker); UNLIMITED = -1."""
        parent_quota = self._quota(f"parent:{parent.name}")
        broker_quota = self._quota("broker")
        unset = model.UNLIMITED
        return (
            _tightest(parent.max_lite_topics, parent_quota.max_lite_topics if parent_quota else unset),
            _tightest(self.config.max_lite_topics_per_broker, broker_quota.max_lite_topics if broker_quota else unset),
        )

    def send_rates(self, parent: str) -> list[tuple[str, int]]:
        """(scope, messages per second) limits that apply to sends into ``parent``."""
        return [(q.scope, q.max_send_rate) for q in self._scopes(parent, "") if q.max_send_rate >= 0]

    def ready_capacity(self, group: str) -> int:
        found = self.groups.get(group)
        if found is not None and found.ready_capacity > 0:
            return found.ready_capacity
        return self.config.default_ready_capacity
