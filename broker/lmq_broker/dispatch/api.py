"""What the admin service may see of the dispatcher's live (in-memory) state.

The dispatcher implements ``LiveView``; the admin service depends only on this Protocol, and its tests
use ``StaticLiveView``, the in-memory twin below.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from lmq_broker import model
from lmq_broker.dispatch import offsets, reclaims
from lmq_broker.storage.api import Store


@dataclass(frozen=True, slots=True)
class ClientView:
    client_id: str
    group: str
    topic: str
    client_type: int  # apache.rocketmq.v2.ClientType number
    subscription_count: int
    last_seen_ms: int
    ready_events: int


class LiveView(Protocol):
    def subscribers(self, lmq: model.QueueId) -> list[str]:
        """Client ids subscribed to an LMQ (any group)."""
        ...

    def subscriber_count(self, lmq: model.QueueId) -> int: ...

    def clients(self, group: str | None = None) -> list[ClientView]: ...

    def subscription_count(self) -> int:
        """Active (client, lite topic) pairs on this broker."""
        ...

    def client_count(self) -> int: ...

    def forget_lite_topic(self, lmq: model.QueueId) -> None:
        """Drop subscriptions, ready events and leases of a deleted lite topic (clients are not notified,
        as in RocketMQ; a client that re-sends re-creates it)."""
        ...

    def metadata_changed(self) -> None:
        """Parent topics, groups or quotas changed in the store: drop cached copies."""
        ...

    def begin_reclaim(self, lmqs: Sequence[model.QueueId], allowed_subscribers: Sequence[int] | None) -> reclaims.Mark:
        """In one loop step: keep the rows with more subscribers than allowed (None: no check) and mark the
        others as being deleted, until ``end_reclaim``; see ``reclaims``."""
        ...

    def end_reclaim(self, mark: reclaims.Mark, deleted: Sequence[model.QueueId]) -> None:
        """The delete is over: forget ``deleted`` (as ``forget_lite_topic``) and clear ``mark``."""
        ...

    def lite_topics_of(self, client_id: str) -> list[str] | None:
        """The lite names ``client_id`` subscribes to, sorted; None when no such client is registered."""
        ...

    async def reset_offsets(
        self,
        group: str,
        parent: str,
        lites: Sequence[str],
        option: offsets.OffsetReset,
        ends: Sequence[int] | None = None,
        *,
        copy_later: bool = False,
    ) -> None:
        """Move ``group``'s start in lite topics of ``parent`` (as a subscription's OffsetOption does); ``ends``:
        ``MAX`` means these ends, read before (``offsets.reset``). Refused when the followers could not store it
        in time (``errors.NotEnoughReplicas``, ``errors.Fenced``), unless ``copy_later`` (an MQTT start at the
        end: answered, copied again in the background; ``Settlement.reset_offsets``)."""
        ...

    async def trigger_dispatch(self, group: str, parent: str, lites: Sequence[str]) -> list[str]:
        """Offer ``lites`` of ``parent`` that have work for ``group`` to its subscribers now (empty: every lite
        topic a client of the group subscribes to); the lite names offered."""
        ...

    async def await_ready(self, client_id: str, group: str, parent: str, poll_ms: int, *, capped: bool = True) -> bool:
        """Until ``client_id`` has lite topics ready here (True) or ``poll_ms`` passed (False), leasing nothing
        (another broker then receives for it without waiting); ``errors.TooManyRequests`` beyond the caps."""
        ...


@dataclass
class StaticLiveView:
    """In-memory twin of LiveView for tests of the layers above dispatch."""

    subs: dict[model.QueueId, list[str]] = field(default_factory=dict)
    client_views: list[ClientView] = field(default_factory=list)
    forgotten: list[model.QueueId] = field(default_factory=list)
    metadata_changes: int = 0
    store: Store | None = None  # where reset_offsets writes (the harness's store)
    lite_sets: dict[str, list[str]] = field(default_factory=dict)  # client -> lite names
    triggered: list[tuple[str, str, tuple[str, ...]]] = field(default_factory=list)

    def subscribers(self, lmq: model.QueueId) -> list[str]:
        return list(self.subs.get(lmq, []))

    def subscriber_count(self, lmq: model.QueueId) -> int:
        return len(self.subs.get(lmq, []))

    def clients(self, group: str | None = None) -> list[ClientView]:
        return [c for c in self.client_views if group is None or c.group == group]

    def subscription_count(self) -> int:
        return sum(len(v) for v in self.subs.values())

    def client_count(self) -> int:
        return len(self.client_views)

    def forget_lite_topic(self, lmq: model.QueueId) -> None:
        self.forgotten.append(lmq)
        self.subs.pop(lmq, None)

    def metadata_changed(self) -> None:
        self.metadata_changes += 1

    def begin_reclaim(self, lmqs: Sequence[model.QueueId], allowed_subscribers: Sequence[int] | None) -> reclaims.Mark:
        counts = [self.subscriber_count(lmq) for lmq in lmqs]
        return reclaims.check_and_mark([lmq.topic for lmq in lmqs], counts, allowed_subscribers)

    def end_reclaim(self, mark: reclaims.Mark, deleted: Sequence[model.QueueId]) -> None:
        for lmq in deleted:
            self.forget_lite_topic(lmq)
        mark.done.set()

    def lite_topics_of(self, client_id: str) -> list[str] | None:
        found = client_id in self.lite_sets or any(c.client_id == client_id for c in self.client_views)
        return sorted(self.lite_sets.get(client_id, [])) if found else None

    async def reset_offsets(
        self,
        group: str,
        parent: str,
        lites: Sequence[str],
        option: offsets.OffsetReset,
        ends: Sequence[int] | None = None,
        *,
        copy_later: bool = False,
    ) -> None:
        assert self.store is not None, "StaticLiveView.store is needed for reset_offsets"
        offsets.reset(self.store, [model.QueueId.lmq(parent, lite).topic for lite in lites], group, option, ends)

    async def trigger_dispatch(self, group: str, parent: str, lites: Sequence[str]) -> list[str]:
        """Records the call; offers the given lites that someone subscribes to (no ready sets here)."""
        self.triggered.append((group, parent, tuple(lites)))
        return [lite for lite in lites if self.subs.get(model.QueueId.lmq(parent, lite))]

    async def await_ready(self, client_id: str, group: str, parent: str, poll_ms: int, *, capped: bool = True) -> bool:
        """No ready sets here: never ready (answered at once)."""
        return False
