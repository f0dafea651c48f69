"""Who is subscribed to what, owned by client id (``x-mq-client-id``), never by group.

Both directions are kept so that both questions are one dict lookup: "which lite topics does this
client hold" (quota, catch-up, cleanup) and "who listens on this LMQ" (dispatch on arrival). The reverse
side stores a bare client id for the common single-subscriber case and only grows a set for the second
subscriber: with a million subscribed lite topics that is the difference between ~100 MB and ~300 MB.

LMQs are identified by their store name (``%LMQ%$parent$lite``) as plain strings; the same string object
is shared by both directions. Time is passed in (milliseconds, any monotonic origin).

A big change (a COMPLETE_ADD of 100,000 names) is made in steps of ``SLICE`` names: ``add_steps``,
``replace_steps`` and ``remove_steps`` are generators that yield between steps, so the event loop serves
other calls in between (``drive`` runs one to its end at once). Quotas are checked, and the broker-wide
growth reserved, before the first change: a refused change changes nothing. While the steps run, the
topics the change is to subscribe count as subscribed (``subscriber_count``), so a compare-and-delete
that checks them in between keeps them. A change of at most ``SLICE`` names never yields.
"""

from __future__ import annotations

from collections.abc import Collection, Generator, Iterable, Iterator, KeysView
from dataclasses import dataclass, field
from itertools import islice
from typing import Final, TypeVar

from lmq_broker import errors, model

SLICE: Final = 500  # names per step of a big change: 1-2 ms of the loop
T = TypeVar("T")
Steps = Generator[None, None, T]


def drive(steps: Steps[T]) -> T:
    """Run a change's steps to the end without yielding; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def slices(items: Iterable[str]) -> Iterator[list[str]]:
    """``items`` in pieces of ``SLICE`` (a collection must not change while they are taken)."""
    it = iter(items)
    while part := list(islice(it, SLICE)):
        yield part


def unique(lmqs: Collection[str]) -> dict[str, None]:
    """``lmqs`` without repeats, in order (a dict, as ``lmq_names`` builds one in slices, is taken as is)."""
    return lmqs if isinstance(lmqs, dict) else dict.fromkeys(lmqs)


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
        self._reserved = 0  # broker-wide growth of changes under way, checked but not all made yet
        self._incoming: dict[str, Collection[str]] = {}  # client -> the LMQs a change under way subscribes
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
        return drive(self.add_steps(client_id, lmqs, quota, now_ms, patterns=patterns))

    def add_steps(
        self, client_id: str, lmqs: Collection[str], quota: int, now_ms: int, *, patterns: Collection[str] = ()
    ) -> Steps[list[str]]:
        """``add`` in steps (see the module's docstring)."""
        state = self.touch(client_id, now_ms)
        wanted = unique(lmqs)
        if len(wanted) > SLICE:  # a small change never yields: no one sees it under way
            self._incoming[client_id] = wanted
        try:
            growth = 0
            for part in slices(wanted):
                if len(wanted) > SLICE:
                    yield
                growth += sum(lmq not in state.lite_topics for lmq in part)
            new_patterns = [p for p in dict.fromkeys(patterns) if p not in state.patterns]
            growth += len(new_patterns)
            self._check_quota(state, len(state.lite_topics) + len(state.patterns) + growth, growth, quota)
            new = yield from self._link_all(state, wanted, growth)
            state.patterns.update(new_patterns)
            self._pairs += len(new_patterns)
            self.version += bool(new_patterns)
            return new
        finally:
            if self._incoming.get(client_id) is wanted:
                del self._incoming[client_id]

    def remove(self, client_id: str, lmqs: Iterable[str], now_ms: int, *, patterns: Iterable[str] = ()) -> list[str]:
        return drive(self.remove_steps(client_id, lmqs, now_ms, patterns=patterns))

    def remove_steps(
        self, client_id: str, lmqs: Iterable[str], now_ms: int, *, patterns: Iterable[str] = ()
    ) -> Steps[list[str]]:
        """``remove`` in steps (see the module's docstring)."""
        state = self.touch(client_id, now_ms)
        gone: list[str] = []
        for index, part in enumerate(slices(lmqs)):
            if index:
                yield
                if self._clients.get(client_id) is not state:
                    return gone  # dropped meanwhile, with every subscription it held
            held = state.lite_topics
            now_gone = [lmq for lmq in dict.fromkeys(part) if lmq in held]
            for lmq in now_gone:
                held.discard(lmq)
                self._unlink(lmq, client_id)
            gone += now_gone
            self._pairs -= len(now_gone)
            self.version += bool(now_gone)
        gone_patterns = [p for p in dict.fromkeys(patterns) if p in state.patterns]
        state.patterns.difference_update(gone_patterns)
        self._pairs -= len(gone_patterns)
        self.version += bool(gone_patterns)
        return gone

    def replace(
        self, client_id: str, lmqs: Collection[str], quota: int, now_ms: int, *, patterns: Collection[str] = ()
    ) -> tuple[list[str], list[str]]:
        """Make the client's sets exactly ``lmqs`` and ``patterns``; returns (added, removed) LMQs."""
        return drive(self.replace_steps(client_id, lmqs, quota, now_ms, patterns=patterns))

    def replace_steps(
        self, client_id: str, lmqs: Collection[str], quota: int, now_ms: int, *, patterns: Collection[str] = ()
    ) -> Steps[tuple[list[str], list[str]]]:
        """``replace`` in steps (see the module's docstring): the difference is found, the quota checked,
        then the topics no longer wanted removed and the new ones added."""
        state = self.touch(client_id, now_ms)
        wanted = unique(lmqs)
        big = len(wanted) > SLICE or len(state.lite_topics) > SLICE
        self._incoming[client_id] = wanted
        try:
            held = list(state.lite_topics)
            removed: list[str] = []
            for part in slices(held):
                if big:
                    yield
                removed += [lmq for lmq in part if lmq not in wanted]
            wanted_patterns = set(patterns)
            size = len(wanted) + len(wanted_patterns)
            self._check_quota(state, size, size - len(state.lite_topics) - len(state.patterns), quota)
            unwanted_patterns = state.patterns - wanted_patterns
            removed = yield from self.remove_steps(client_id, removed, now_ms, patterns=unwanted_patterns)
            if self._clients.get(client_id) is not state:
                return [], removed
            added = yield from self._link_all(state, wanted, len(wanted) - len(state.lite_topics))
            new_patterns = wanted_patterns - state.patterns
            self._pairs += len(new_patterns)
            state.patterns.update(wanted_patterns)
            self.version += bool(new_patterns)  # what ``remove`` took away counted there
            return added, removed
        finally:
            if self._incoming.get(client_id) is wanted:
                del self._incoming[client_id]

    def _link_all(self, state: ClientState, lmqs: Collection[str], growth: int) -> Steps[list[str]]:
        """Subscribe ``state``'s client to those of ``lmqs`` it does not hold, in steps; ``growth`` of them
        were reserved against the broker-wide limit (released as they are linked, the rest at the end)."""
        reserved = max(0, growth)
        self._reserved += reserved
        new: list[str] = []
        try:
            for index, part in enumerate(slices(lmqs)):
                if index or len(lmqs) > SLICE:
                    yield
                    if self._clients.get(state.client_id) is not state:
                        break  # dropped meanwhile: what it held so far went with it
                held = state.lite_topics
                now_new = [lmq for lmq in part if lmq not in held]
                for lmq in now_new:
                    held.add(lmq)
                    self._link(lmq, state.client_id)
                new += now_new
                self._pairs += len(now_new)
                taken = min(reserved, len(now_new))
                reserved -= taken
                self._reserved -= taken
                self.version += bool(now_new)
        finally:
            self._reserved -= reserved
        return new

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
        """Clients subscribed to ``lmq``, counting one whose change under way subscribes it (``*_steps``)."""
        holders = self._by_lmq.get(lmq)
        count = 0 if holders is None else 1 if isinstance(holders, str) else len(holders)
        for client_id, incoming in self._incoming.items():
            if lmq in incoming and client_id not in self.subscribers(lmq):
                count += 1
        return count

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
        if self.max_pairs != model.UNLIMITED and growth > 0 and self._pairs + self._reserved + growth > self.max_pairs:
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
