"""Send-side limits, checked before an append: lite topics per parent / per broker, and send rates.

Counting lite topics is a stored counter (O(1)); asking which topics of a request are new costs one index
read per distinct topic, so it is only done when the request could cross a limit. Two requests racing
over the last free slots may both pass: a limit can be overshot by what concurrent requests create.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from operator import attrgetter

from lmq_broker import errors, model
from lmq_broker.dispatch import metadata
from lmq_broker.storage.api import Store

_topic_of = attrgetter("topic")


def check_send_rates(
    snap: metadata.Metadata, buckets: dict[str, TokenBucket], messages: Sequence[model.NewMessage], now_ms: int
) -> None:
    if not snap.quotas:
        return  # the common case: no quota configured, nothing to count
    for parent, count in Counter(map(_topic_of, messages)).items():
        for scope, rate in snap.send_rates(parent):
            bucket = buckets.get(scope)
            if bucket is None or bucket.rate != rate:
                bucket = buckets[scope] = TokenBucket(rate, now_ms)
            if not bucket.take(count, now_ms):
                raise errors.TooManyRequests(f"send rate of {scope} is limited to {rate}/s", scope=scope)


def lite_topic_check(
    store: Store, snap: metadata.Metadata, messages: Sequence[model.NewMessage]
) -> Callable[[], None] | None:
    """The blocking check to run before appending ``messages`` (None when no limit applies)."""
    if not snap.limits_lite_topics:
        return None  # the common case, decided once per metadata snapshot
    parents = {m.topic for m in messages if m.lite_topic is not None}
    if not parents:
        return None
    limits = {parent: snap.lite_topic_limits(snap.topic(parent)) for parent in parents}
    broker_limit = min((b for _, b in limits.values() if b >= 0), default=model.UNLIMITED)
    if broker_limit < 0 and all(p < 0 for p, _ in limits.values()):
        return None  # the common case, decided without looking at each message's lite topic
    lites_by_parent: dict[str, set[str]] = {}
    for message in messages:
        if message.lite_topic is not None:
            lites_by_parent.setdefault(message.topic, set()).add(message.lite_topic)

    def check() -> None:
        candidates = sum(len(lites) for lites in lites_by_parent.values())
        broker_count = store.lite_topic_count(None) if broker_limit >= 0 else 0
        broker_may_cross = broker_limit >= 0 and broker_count + candidates > broker_limit
        broker_new = 0
        for parent, lites in lites_by_parent.items():
            per_parent = limits[parent][0]
            count = store.lite_topic_count(parent) if per_parent >= 0 else 0
            parent_may_cross = per_parent >= 0 and count + len(lites) > per_parent
            if not (parent_may_cross or broker_may_cross):
                continue
            new = sum(1 for lite in lites if store.lite_topic(parent, lite) is None)
            if parent_may_cross and count + new > per_parent:
                raise errors.LiteTopicQuotaExceeded(
                    f"parent topic {parent} holds {count} lite topics, limit is {per_parent}",
                    topic=parent,
                    limit=per_parent,
                )
            broker_new += new
        if broker_may_cross and broker_count + broker_new > broker_limit:
            raise errors.LiteTopicQuotaExceeded(
                f"broker holds {broker_count} lite topics, limit is {broker_limit}", limit=broker_limit
            )

    return check


class TokenBucket:
    """Messages-per-second limiter; time comes from the caller (ms)."""

    def __init__(self, rate: int, now_ms: int) -> None:
        self.rate = rate
        self.tokens = float(rate)
        self.at_ms = now_ms

    def take(self, n: int, now_ms: int) -> bool:
        elapsed = max(0, now_ms - self.at_ms)
        self.tokens = min(float(self.rate), self.tokens + elapsed * self.rate / 1000.0)
        self.at_ms = now_ms
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False
