"""The read side of the broker, as its callers see it: one object, four parts behind it.

The protocol handlers, the admin service (through ``api.LiveView``) and the app call ``Dispatcher``; each call
is served by one of four parts, and only what spans several of them (start and stop, the timer's ``tick``,
``resync``, forgetting a deleted lite topic) is written here:

- ``ingest``: the one door for writes (sends and dead letters): the appender, the recent-message cache, and
  the coalesced arrival signal that wakes readers.
- ``subscriptions``: clients and their lite subscriptions, catch-up passes, compare-and-delete marks.
- ``delivery``: ready queues, long polls, reading and leasing; what arrivals, acks and expiries offer lands here.
- ``settlement``: acks, dead letters and offset resets, and the offset writes that persist them.

They share the data structures (``registry``, ``readyset``, ``leases``, ``wildcards``) and a ``runtime`` (store,
thread pool, clock, timer, metadata), never each other's state: imports go subscriptions -> delivery ->
settlement -> leases, and delivery -> ingest; ingest and settlement tell delivery what happened through the
Protocols they define (``ingest.Readers``, ``settlement.Deliveries``), which ``delivery.Deliverer`` implements.
The dispatcher runs on one asyncio loop; blocking store calls go to the runtime's thread pool.
"""

from __future__ import annotations

import concurrent.futures
import random
import secrets
from collections.abc import Callable, Sequence
from typing import Final

from lmq_broker import model
from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch import (
    api,
    appender,
    delivery,
    ingest,
    leases,
    offsets,
    readyset,
    reclaims,
    registry,
    runtime,
    settlement,
    subscriptions,
    wildcards,
)
from lmq_broker.storage.api import Store

HOUSEKEEPING_INTERVAL_MS: Final = 10_000  # failed commits retried and silent clients expired this often

Delivery = delivery.Delivery
OffsetPolicy = offsets.OffsetPolicy
OffsetReset = offsets.OffsetReset


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
        self.settlement = settlement.Settlement(rt, self.leases, self.ingest.dead_letter, self._index_replaced)
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
        self._next_housekeeping = 0

        # Calls served by one part alone are that part's methods (no façade frame on the hot paths).
        self.run = rt.run
        self.metadata = rt.metadata
        self.metadata_changed = rt.metadata_changed
        self.next_round_robin = rt.next_round_robin
        self.send = self.ingest.send
        self.client_seen = self.subscriptions.client_seen
        self.stream_opened = self.subscriptions.stream_opened
        self.stream_closed = self.subscriptions.stream_closed
        self.client_gone = self.subscriptions.client_gone
        self.export_subscriptions = self.subscriptions.export
        self.restore_subscriptions = self.subscriptions.restore
        self.add_lite = self.subscriptions.add_lite
        self.remove_lite = self.subscriptions.remove_lite
        self.replace_lite = self.subscriptions.replace_lite
        self.remove_all_lite = self.subscriptions.remove_all_lite
        self.subscribe_filters = self.subscriptions.subscribe_filters
        self.begin_reclaim = self.subscriptions.begin_reclaim
        self.receive_lite = self.deliverer.receive_lite
        self.receive_normal = self.deliverer.receive_normal
        self.await_ready = self.deliverer.await_ready
        self.change_invisible = self.deliverer.change_invisible
        self.ack = self.settlement.ack
        self.dead_letter = self.settlement.dead_letter

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
        self, group: str, parent: str, lites: Sequence[str], option: OffsetReset, ends: Sequence[int] | None = None
    ) -> None:
        """Move ``group``'s start in lite topics of ``parent`` (as a subscription's OffsetOption does); ``ends``:
        ``MAX`` means these ends, read before (``offsets.reset``)."""
        lmqs = [subscriptions.lmq_name(parent, lite) for lite in lites]
        await self.settlement.reset_offsets(lmqs, group, option, ends)

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

    def end_reclaim(self, mark: reclaims.Mark, deleted: Sequence[model.QueueId]) -> None:
        for lmq in deleted:
            self.forget_lite_topic(lmq)
        self.subscriptions.marks.end(mark)

    def reclaims_in_flight(self) -> int:
        """Lite topics marked by a compare-and-delete right now."""
        return len(self.subscriptions.marks)

    # --- introspection for metrics --------------------------------------------------------------------------
    def ready_events(self) -> int:
        return self.ready.total()

    def in_flight(self) -> int:
        return self.leases.in_flight()

    def append_stats(self) -> appender.AppendStats:
        return self.ingest.stats


def _check_live_view(d: Dispatcher) -> api.LiveView:
    return d  # mypy proves Dispatcher satisfies the LiveView seam
