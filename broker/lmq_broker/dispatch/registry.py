"""Who is subscribed to what, owned by client id (``x-mq-client-id``), never by group.

Both directions are kept so that both questions are one dict lookup: "which lite topics does this
client hold" (quota, catch-up, cleanup) and "who listens on this LMQ" (dispatch on arrival). The reverse
side stores a bare client id for the common single-subscriber case and only grows a set for the second
subscriber: with a million subscribed lite topics that is the difference between ~100 MB and ~300 MB.

LMQs are identified by their store name (``%LMQ%$parent$lite``) as plain strings; the same string object
is shared by both directions. Time is passed in (milliseconds, any monotonic origin).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, KeysView
from dataclasses import dataclass, field

from lmq_broker import errors, model


@dataclass(slots=True)
class ClientState:
    client_id: str
    client_type: int = 0
    group: str = ""
    bind_topic: str = ""
    lite_topics: set[str] = field(default_factory=set)
    patterns: set[str] = field(default_factory=set)  # lite topic patterns, as the client named them (``wildcards``)
    topics: frozenset[str] = frozenset()  # normal topics from the client's telemetry settings
    last_seen_ms: int = 0
    streams: int = 0  # open telemetry streams; the client is gone when the last one closes
    language: str = ""
    version: str = ""
    # Restored from the data dir at start and not heard from since: it may be gone for good, so a live member
    # of its group is offered a topic first (``delivery``); any call of the client clears it.
    restored: bool = False


class Registry:
    def __init__(self, max_pairs: int = model.UNLIMITED) -> None:
        self._clients: dict[str, ClientState] = {}
        self._by_lmq: dict[str, str | set[str]] = {}
        self._pairs = 0
        self.max_pairs = max_pairs
        # Bumped by every change of what a client subscribes (not by a heartbeat): the periodic save of the
        # subscriptions (``saved_subscriptions``) writes only when it moved.
        self.version = 0

    # --- clients ----------------------------------------------------------------------------------------
    def get(self, client_id: str) -> ClientState | None:
        return self._clients.get(client_id)

    def touch(
        self,
        client_id: str,
        now_ms: int,
        *,
        client_type: int | None = None,
        group: str | None = None,
        bind_topic: str | None = None,
        topics: Iterable[str] | None = None,
    ) -> ClientState:
        """Create or refresh a client; a client keeps the group it first named (RocketMQ clients never switch)."""
        state = self._clients.get(client_id)
        if state is None:
            state = self._clients[client_id] = ClientState(client_id)
        if group:
            if state.group and state.group != group:
                raise errors.Conflict(
                    f"client {client_id} already belongs to group {state.group}",
                    kind="group",
                    group=group,
                )
            state.group = group
        if bind_topic:
            if state.bind_topic and state.bind_topic != bind_topic and (state.lite_topics or state.patterns):
                raise errors.Conflict(
                    f"client {client_id} already subscribes lite topics of {state.bind_topic}",
                    kind="topic",
                    topic=bind_topic,
                )
            state.bind_topic = bind_topic
        if client_type:
            state.client_type = client_type
        if topics is not None:
            state.topics = frozenset(topics)
        state.last_seen_ms = max(state.last_seen_ms, now_ms)
        state.restored = False
        return state

    def drop(self, client_id: str) -> ClientState | None:
        """Forget a client and every subscription it holds."""
        state = self._clients.pop(client_id, None)
        if state is not None:
            for lmq in state.lite_topics:
                self._unlink(lmq, client_id)
            self._pairs -= len(state.lite_topics) + len(state.patterns)
            self.version += 1
        return state

    def idle_since(self, cutoff_ms: int) -> list[str]:
        """Clients not seen since ``cutoff_ms`` (a walk over clients, never over lite topics)."""
        return [cid for cid, st in self._clients.items() if st.last_seen_ms < cutoff_ms]

    def clients(self) -> Iterator[ClientState]:
        return iter(self._clients.values())

    def client_count(self) -> int:
        return len(self._clients)

    # --- subscriptions ----------------------------------------------------------------------------------
    def add(
        self, client_id: str, lmqs: Collection[str], quota: int, now_ms: int, *, patterns: Collection[str] = ()
    ) -> list[str]:
        """Subscribe; all or nothing. A pattern counts as one subscription. Returns the LMQs that were not
        subscribed before."""
        state = self.touch(client_id, now_ms)
        new = [lmq for lmq in dict.fromkeys(lmqs) if lmq not in state.lite_topics]
        new_patterns = [p for p in dict.fromkeys(patterns) if p not in state.patterns]
        growth = len(new) + len(new_patterns)
        self._check_quota(state, len(state.lite_topics) + len(state.patterns) + growth, growth, quota)
        for lmq in new:
            state.lite_topics.add(lmq)
            self._link(lmq, client_id)
        state.patterns.update(new_patterns)
        self._pairs += growth
        self.version += bool(growth)
        return new

    def remove(self, client_id: str, lmqs: Iterable[str], now_ms: int, *, patterns: Iterable[str] = ()) -> list[str]:
        state = self.touch(client_id, now_ms)
        gone = [lmq for lmq in dict.fromkeys(lmqs) if lmq in state.lite_topics]
        for lmq in gone:
            state.lite_topics.discard(lmq)
            self._unlink(lmq, client_id)
        gone_patterns = [p for p in dict.fromkeys(patterns) if p in state.patterns]
        state.patterns.difference_update(gone_patterns)
        self._pairs -= len(gone) + len(gone_patterns)
        self.version += bool(gone or gone_patterns)
        return gone

    def replace(
        self, client_id: str, lmqs: Collection[str], quota: int, now_ms: int, *, patterns: Collection[str] = ()
    ) -> tuple[list[str], list[str]]:
        """Make the client's sets exactly ``lmqs`` and ``patterns``; returns (added, removed) LMQs."""
        state = self.touch(client_id, now_ms)
        wanted, wanted_patterns = dict.fromkeys(lmqs), set(patterns)
        added = [lmq for lmq in wanted if lmq not in state.lite_topics]
        removed = [lmq for lmq in state.lite_topics if lmq not in wanted]
        size = len(wanted) + len(wanted_patterns)
        self._check_quota(state, size, size - len(state.lite_topics) - len(state.patterns), quota)
        self.remove(client_id, removed, now_ms, patterns=state.patterns - wanted_patterns)
        for lmq in added:
            state.lite_topics.add(lmq)
            self._link(lmq, client_id)
        new_patterns = wanted_patterns - state.patterns
        self._pairs += len(added) + len(new_patterns)
        state.patterns.update(wanted_patterns)
        self.version += bool(added or new_patterns)  # what ``remove`` took away counted there
        return added, removed

    def forget_lmq(self, lmq: str) -> list[str]:
        """Drop every subscription to a deleted lite topic; returns the clients that held it."""
        holders = self.subscribers(lmq)
        for cid in holders:
            state = self._clients.get(cid)
            if state is not None and lmq in state.lite_topics:
                state.lite_topics.discard(lmq)
                self._pairs -= 1
        self._by_lmq.pop(lmq, None)
        self.version += bool(holders)
        return list(holders)

    def subscribers(self, lmq: str) -> tuple[str, ...]:
        holders = self._by_lmq.get(lmq)
        if holders is None:
            return ()
        if isinstance(holders, str):
            return (holders,)
        return tuple(holders)

    def subscribed(self) -> KeysView[str]:
        """The LMQs with at least one subscriber: a live view, for set operations done in C."""
        return self._by_lmq.keys()

    def subscriber_count(self, lmq: str) -> int:
        holders = self._by_lmq.get(lmq)
        if holders is None:
            return 0
        return 1 if isinstance(holders, str) else len(holders)

    def pair_count(self) -> int:
        return self._pairs

    # --- internals --------------------------------------------------------------------------------------
    def _check_quota(self, state: ClientState, size_after: int, growth: int, quota: int) -> None:
        if quota != model.UNLIMITED and size_after > quota:
            raise errors.SubscriptionQuotaExceeded(
                f"client {state.client_id} would hold {size_after} lite subscriptions, quota is {quota}",
                client_id=state.client_id,
                quota=quota,
            )
        if self.max_pairs != model.UNLIMITED and growth > 0 and self._pairs + growth > self.max_pairs:
            raise errors.SubscriptionQuotaExceeded(
                f"broker holds {self._pairs} lite subscriptions, limit is {self.max_pairs}",
                limit=self.max_pairs,
            )

    def _link(self, lmq: str, client_id: str) -> None:
        holders = self._by_lmq.get(lmq)
        if holders is None:
            self._by_lmq[lmq] = client_id
        elif isinstance(holders, str):
            if holders != client_id:
                self._by_lmq[lmq] = {holders, client_id}
        else:
            holders.add(client_id)

    def _unlink(self, lmq: str, client_id: str) -> None:
        holders = self._by_lmq.get(lmq)
        if holders is None:
            return
        if isinstance(holders, str):
            if holders == client_id:
                del self._by_lmq[lmq]
            return
        holders.discard(client_id)
        if len(holders) == 1:
            self._by_lmq[lmq] = next(iter(holders))
        elif not holders:
            del self._by_lmq[lmq]
