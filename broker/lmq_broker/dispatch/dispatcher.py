"""The read side of the broker, as its callers see it: one object, five parts behind it.

The protocol handlers, the admin service (through ``api.LiveView``) and the app call ``Dispatcher``; each call
is served by one of five parts, and only what spans several of them (start and stop, the timer's ``tick``,
``resync``, forgetting a deleted lite topic) is written here:

- ``ingest``: the one door for writes (sends and dead letters): the appender, the recent-message cache, and
  the coalesced arrival signal that wakes readers.
- ``subscriptions``: clients and their lite subscriptions, catch-up passes, compare-and-delete marks.
- ``delivery``: ready queues, long polls, reading and leasing; what arrivals, acks and expiries offer lands here.
- ``settlement``: acks, dead letters and offset resets, and the offset writes that persist them.
- ``dead_letters``: the copies of given-up messages in ``%DLQ%<group>``, appended through ingest's door.

They share the data structures (``registry``, ``readyset``, ``leases``, ``wildcards``) and a ``runtime`` (store,
thread pool, clock, timer, metadata), never each other's state: imports go subscriptions -> delivery ->
settlement -> leases, and delivery -> ingest; ingest and settlement tell delivery what happened through the
Protocols they define (``ingest.Readers``, ``settlement.Deliveries``), which ``delivery.Deliverer`` implements.
The dispatcher runs on one asyncio loop; blocking store calls go to the runtime's thread pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import secrets
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from typing import Any, Final, ParamSpec, TypeVar

from lmq_broker import model
from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch import (
    api,
    appender,
    dead_letters,
    delivery,
    filters,
    ingest,
    leases,
    metadata,
    offsets,
    readyset,
    reclaims,
    registry,
    runtime,
    saved_subscriptions,
    settlement,
    subscriptions,
    wildcards,
)
from lmq_broker.storage.api import Store

HOUSEKEEPING_INTERVAL_MS: Final = 10_000  # failed commits retried and silent clients expired this often

Delivery = delivery.Delivery
OffsetPolicy = offsets.OffsetPolicy
OffsetReset = offsets.OffsetReset
P = ParamSpec("P")
T = TypeVar("T")
Call = Coroutine[Any, Any, T]  # what an async part method returns: the façade hands it on, adding no frame


class Dispatcher:
    def __init__(
        self,
        store: Store,
        config: BrokerConfig,
        *,
        clock: Callable[[], int] = runtime.monotonic_ms,
        wall_clock: Callable[[], int] = runtime.epoch_ms,
        executor: concurrent.futures.Executor | None = None,
        incarnation: str | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.clock = clock
        self.wall_clock = wall_clock
        rt = self.runtime = runtime.Runtime(
            store, config, clock=clock, wall_clock=wall_clock, executor=executor, rng=rng
        )
        rt.on_timer = self.tick
        self.registry = registry.Registry(config.max_subscriptions_per_broker)
        self.wildcards = wildcards.Wildcards()
        self.ready = readyset.ReadySet()
        self.leases = leases.LeaseTable(incarnation or secrets.token_hex(6))
        self.ingest = ingest.Ingest(rt)
        self.recent = self.ingest.recent
        self.dead_letters = dead_letters.DeadLetters(self.ingest.append)
        self.settlement = settlement.Settlement(rt, self.leases, self.dead_letters.store, self._index_replaced)
        self.deliverer = delivery.Deliverer(
            rt,
            table=self.leases,
            ready=self.ready,
            subscribers=self.registry,
            wild=self.wildcards,
            writes=self.ingest,
            settling=self.settlement,
        )
        self.ingest.readers = self.settlement.deliveries = self.deliverer
        self.subscriptions = subscriptions.Subscriptions(
            rt,
            subscribers=self.registry,
            wild=self.wildcards,
            ready=self.ready,
            deliverer=self.deliverer,
            settling=self.settlement,
        )
        self.settlement.reclaim_of = self.subscriptions.marks.of
        self._next_housekeeping = 0

    # --- calls served by one part: thin delegations (an async one returns the part's coroutine) --------------
    def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Call[T]:
        """Run a blocking store call on the dispatcher's thread pool."""
        return self.runtime.run(fn, *args, **kwargs)

    def metadata(self) -> Call[metadata.Metadata]:
        """The current metadata, never older than a change announced (``metadata_changed``) before the call."""
        return self.runtime.metadata()

    def metadata_changed(self) -> None:
        """Metadata was written: the next ``metadata()`` reloads it."""
        self.runtime.metadata_changed()

    def watch_metadata(self, watcher: Callable[[], None]) -> None:
        """Call ``watcher`` (on the caller's thread, at once: it must only take note) each time metadata changes,
        e.g. a parent topic was created (the MQTT listener's first-level wildcard filters reach into it)."""
        self.runtime.metadata_watchers.append(watcher)

    def unwatch_metadata(self, watcher: Callable[[], None]) -> None:
        if watcher in self.runtime.metadata_watchers:
            self.runtime.metadata_watchers.remove(watcher)

    def next_round_robin(self) -> int:
        """A counter for spreading choices (queues, brokers) round-robin."""
        return self.runtime.next_round_robin()

    def send(self, messages: Sequence[model.NewMessage]) -> Call[list[model.AppendResult]]:
        """A producer's messages: send quotas enforced, then appended in one store call."""
        return self.ingest.send(messages)

    def client_seen(
        self,
        client_id: str,
        *,
        client_type: int | None = None,
        group: str | None = None,
        bind_topic: str | None = None,
        topics: Iterable[str] | None = None,
        language: str = "",
        version: str = "",
    ) -> registry.ClientState:
        """A client called (heartbeat, settings, a receive): register or refresh it."""
        return self.subscriptions.client_seen(
            client_id,
            client_type=client_type,
            group=group,
            bind_topic=bind_topic,
            topics=topics,
            language=language,
            version=version,
        )

    def stream_opened(self, client_id: str) -> asyncio.Queue[str]:
        """A telemetry stream opened; returns the client's notices (lite topics taken from it) to relay."""
        return self.subscriptions.stream_opened(client_id)

    def stream_closed(self, client_id: str) -> None:
        """A telemetry stream closed (the client is forgotten with its last stream, unless draining)."""
        self.subscriptions.stream_closed(client_id)

    def client_gone(self, client_id: str) -> None:
        """Termination, telemetry close or expiry: forget the client; its pending events go to its peers."""
        self.subscriptions.client_gone(client_id)

    def export_subscriptions(self) -> list[saved_subscriptions.ClientRecord]:
        """The clients and their subscriptions, to save at a graceful shutdown."""
        return self.subscriptions.export()

    def own_subscriptions(self, client_id: str, user: str, peer: str) -> None:
        """Who changes ``client_id``'s lite subscriptions (``--acl``), saved with them."""
        self.subscriptions.own(client_id, user, peer)

    def subscription_owner(self, client_id: str) -> tuple[str, str] | None:
        """The (user, address) saved with ``client_id``'s lite subscriptions; None: not known."""
        return self.subscriptions.owners.get(client_id)

    def subscriber(self, client_id: str) -> str:
        """The user that made the lite subscriptions ``client_id`` holds here (``--acl``); "": none known, or the
        client is not registered (gone, expired: its id is anyone's again)."""
        owner = self.subscriptions.owners.get(client_id)
        if owner is None or self.registry.get(client_id) is None:
            return ""
        return owner[0]

    def restore_subscriptions(self, records: list[saved_subscriptions.ClientRecord]) -> None:
        """Re-register clients saved at the last graceful shutdown."""
        self.subscriptions.restore(records)

    def add_lite(
        self,
        client_id: str,
        group: str,
        parent: str,
        lites: Sequence[str],
        *,
        namespace: str = "",
        offset: OffsetReset | None = None,
    ) -> Call[list[str]]:
        """Subscribe to lite topics and patterns (``wildcards.is_pattern``); returns the LMQs added."""
        return self.subscriptions.add_lite(client_id, group, parent, lites, namespace=namespace, offset=offset)

    def remove_lite(self, client_id: str, group: str, parent: str, lites: Sequence[str]) -> Call[list[str]]:
        """Unsubscribe from lite topics and patterns; returns the LMQs removed."""
        return self.subscriptions.remove_lite(client_id, group, parent, lites)

    def replace_lite(
        self, client_id: str, group: str, parent: str, lites: Sequence[str], *, namespace: str = ""
    ) -> Call[tuple[list[str], list[str]]]:
        """Make ``lites`` the client's whole set under ``parent`` (a full sync); returns (added, removed)."""
        return self.subscriptions.replace_lite(client_id, group, parent, lites, namespace=namespace)

    def remove_all_lite(self, client_id: str, group: str, parent: str) -> Call[None]:
        """Unsubscribe the client from every lite topic of ``parent``."""
        return self.subscriptions.remove_all_lite(client_id, group, parent)

    def subscribe_filters(
        self, client_id: str, group: str, parent: str, filters: Sequence[wildcards.Filter]
    ) -> Call[None]:
        """Take the lite topics of ``parent`` that ``filters`` match, now and as they appear (MQTT)."""
        return self.subscriptions.subscribe_filters(client_id, group, parent, filters)

    def begin_reclaim(self, lmqs: Sequence[model.QueueId], allowed_subscribers: Sequence[int] | None) -> reclaims.Mark:
        """A compare-and-delete begins: mark ``lmqs`` so that no subscription slips in before the delete, and
        no offset write overlaps it (``Mark.writes_done``)."""
        mark = self.subscriptions.begin_reclaim(lmqs, allowed_subscribers)
        mark.writes = self.settlement.writes_under_way(mark.topics)
        return mark

    def receive_lite(
        self,
        client_id: str,
        group: str,
        parent: str,
        *,
        batch: int,
        invisible_ms: int,
        poll_ms: int,
        auto_renew: bool = False,
        tags: filters.TagFilter = filters.ALL,
    ) -> Call[list[Delivery]]:
        """Long-poll this client's ready lite topics (``delivery.Deliverer.receive_lite``)."""
        return self.deliverer.receive_lite(
            client_id,
            group,
            parent,
            batch=batch,
            invisible_ms=invisible_ms,
            poll_ms=poll_ms,
            auto_renew=auto_renew,
            tags=tags,
        )

    def receive_normal(
        self,
        client_id: str,
        group: str,
        topic: str,
        *,
        batch: int,
        invisible_ms: int,
        poll_ms: int,
        auto_renew: bool = False,
        tags: filters.TagFilter = filters.ALL,
    ) -> Call[list[Delivery]]:
        """Long-poll a normal topic's queue for ``group``."""
        return self.deliverer.receive_normal(
            client_id,
            group,
            topic,
            batch=batch,
            invisible_ms=invisible_ms,
            poll_ms=poll_ms,
            auto_renew=auto_renew,
            tags=tags,
        )

    def await_ready(self, client_id: str, group: str, parent: str, poll_ms: int, *, capped: bool = True) -> Call[bool]:
        """Wait, leasing nothing, until the client has lite topics ready (True) or ``poll_ms`` passed (False)."""
        return self.deliverer.await_ready(client_id, group, parent, poll_ms, capped=capped)

    def change_invisible(
        self, group: str, receipt_handle: str, invisible_ms: int, *, suspend: bool = False
    ) -> Call[str]:
        """Move a leased message's redelivery time; returns the new receipt handle."""
        return self.deliverer.change_invisible(group, receipt_handle, invisible_ms, suspend=suspend)

    def give_back(self, group: str, receipt_handles: Iterable[str]) -> None:
        """Leases a receive returned that never reached their client (its call ended first): visible again now."""
        self.deliverer.give_back(group, receipt_handles)

    def ack(self, group: str, receipt_handle: str, *, client_id: str = "") -> Call[None]:
        """A message was consumed: settle its lease and, in time, the group's offset."""
        return self.settlement.ack(group, receipt_handle, client_id=client_id)

    def dead_letter(self, group: str, receipt_handle: str) -> Call[None]:
        """The client gave up on a message (ForwardMessageToDeadLetterQueue): store it in ``%DLQ%<group>``."""
        return self.settlement.dead_letter(group, receipt_handle)

    # --- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.runtime.start()
        assert self.runtime.loop is not None
        self.ingest.start(self.runtime.loop)
        self._next_housekeeping = self.clock() + HOUSEKEEPING_INTERVAL_MS
        self.runtime.arm(self._next_housekeeping)

    @property
    def draining(self) -> bool:
        return self.runtime.draining

    def begin_drain(self) -> None:
        """Shutdown begins: end every long poll now (empty), and keep clients whose streams close."""
        self.runtime.draining = True
        self.deliverer.wake_all()

    async def close(self) -> None:
        if not self.runtime.closed:
            await self.settlement.write_handouts()  # a graceful stop understates no attempt
        await self.runtime.stop_tasks()
        self.deliverer.wake_all()
        await self.ingest.close()
        await self.runtime.close_executor()

    # --- what is due: the timer calls this ------------------------------------------------------------------
    def tick(self) -> None:
        """Do everything that is due: redeliveries, catch-up passes, housekeeping. Re-arms the timer."""
        now = self.clock()
        self.deliverer.expire(now)
        for client_id in self.ready.due_catchups(now):
            self.subscriptions.start_catchup(client_id)
        if now >= self._next_housekeeping:
            self._next_housekeeping = now + HOUSEKEEPING_INTERVAL_MS
            if self.settlement.dirty:
                self.runtime.spawn(self.settlement.retry_commits())
            self.subscriptions.expire_idle(now)
        candidates = [
            t for t in (self.leases.next_expiry_ms(), self.ready.next_catchup_ms(), self._next_housekeeping) if t
        ]
        if candidates:
            self.runtime.arm(min(candidates))

    def resync(self) -> None:
        """After the store was unable to serve reads for a while (an index rebuild): look again for pending
        work of every client, wake every receiver of a normal topic, and persist the commits that failed."""
        if self.settlement.dirty and self.runtime.loop is not None:
            self.runtime.spawn(self.settlement.retry_commits())
        for st in self.registry.clients():
            self.subscriptions.start_catchup(st.client_id)
            for topic in st.topics:
                self.deliverer.wake_topic(topic)

    def _index_replaced(self) -> None:
        """Settlement saw the store's index replaced: messages cached from before may be wrong."""
        self.recent.clear()
        self.resync()

    # --- LiveView (the admin service) -----------------------------------------------------------------------
    def subscribers(self, lmq: model.QueueId) -> list[str]:
        return list(self.registry.subscribers(lmq.topic))

    def subscriber_count(self, lmq: model.QueueId) -> int:
        return self.registry.subscriber_count(lmq.topic)

    def clients(self, group: str | None = None) -> list[api.ClientView]:
        return self.subscriptions.views(group)

    def subscription_count(self) -> int:
        return self.registry.pair_count()

    def client_count(self) -> int:
        return self.registry.client_count()

    async def reset_offsets(
        self,
        group: str,
        parent: str,
        lites: Sequence[str],
        option: OffsetReset,
        ends: Sequence[int] | None = None,
        *,
        copy_later: bool = False,
    ) -> None:
        """Move ``group``'s start in lite topics of ``parent`` (as a subscription's OffsetOption does); ``ends``:
        ``MAX`` means these ends, read before (``offsets.reset``); ``copy_later``: ``Settlement.reset_offsets``."""
        lmqs = [subscriptions.lmq_name(parent, lite) for lite in lites]
        await self.settlement.reset_offsets(lmqs, group, option, ends, copy_later=copy_later)

    async def lite_topics_matching(
        self, parent: str, filters: Sequence[wildcards.Filter]
    ) -> list[model.LiteTopicMeta] | None:
        """The lite topics of ``parent`` that ``filters`` match, found with its level index; None when the
        filters have a literal prefix (a range scan finds them cheaply) or the index is off."""
        names = await self.subscriptions.indexed_names(parent, filters)
        if names is None:
            return None
        store = self.store

        def read(chunk: list[str]) -> list[model.LiteTopicMeta]:
            return [m for m in (store.lite_topic(parent, lite) for lite in chunk) if m is not None]

        found: list[model.LiteTopicMeta] = []
        for i in range(0, len(names), subscriptions.CATCHUP_CHUNK):
            found += await self.runtime.run(read, names[i : i + subscriptions.CATCHUP_CHUNK])
        return found

    def lite_topics_of(self, client_id: str) -> list[str] | None:
        state = self.registry.get(client_id)
        return None if state is None else sorted(model.QueueId(lmq).lite_parts()[1] for lmq in state.lite_topics)

    async def trigger_dispatch(self, group: str, parent: str, lites: Sequence[str]) -> list[str]:
        offered = await self.subscriptions.trigger(group, [subscriptions.lmq_name(parent, lite) for lite in lites])
        return [model.QueueId(lmq).lite_parts()[1] for lmq in offered]

    def forget_lite_topic(self, lmq: model.QueueId) -> None:
        self.wildcards.index_forget(lmq.topic)
        self.subscriptions.forget(lmq.topic)
        self.settlement.forget_topic(lmq.topic)
        self.recent.forget(lmq)
        if self.ingest.replicas is not None:
            self.ingest.replicas.forget(lmq.topic)

    def end_reclaim(self, mark: reclaims.Mark, deleted: Sequence[model.QueueId]) -> None:
        for lmq in deleted:
            self.forget_lite_topic(lmq)
        self.subscriptions.marks.end(mark)

    def reclaims_in_flight(self) -> int:
        """Lite topics marked by a compare-and-delete right now."""
        return len(self.subscriptions.marks)

    # --- introspection for metrics --------------------------------------------------------------------------
    def client_state(self, client_id: str) -> registry.ClientState | None:
        """What the registry holds of a client, or None if it is not registered here."""
        return self.registry.get(client_id)

    def client_states(self) -> Iterator[registry.ClientState]:
        """Every registered client (a live view: copy it to keep it across an await)."""
        return self.registry.clients()

    def wildcard_registration(self, client_id: str) -> tuple[str, str] | None:
        """(parent, group) of a client's topic filters (``subscribe_filters``), or None if it has none."""
        return self.wildcards.registration(client_id)

    @property
    def ready_waits(self) -> delivery.ReadyWaits:
        """The waits for clients' ready lite topics parked now (``await_ready``)."""
        return self.deliverer.ready_waits

    def ready_events(self) -> int:
        return self.ready.total()

    def in_flight(self) -> int:
        return self.leases.in_flight()

    def append_stats(self) -> appender.AppendStats:
        return self.ingest.stats


def _check_live_view(d: Dispatcher) -> api.LiveView:
    return d  # mypy proves Dispatcher satisfies the LiveView seam
