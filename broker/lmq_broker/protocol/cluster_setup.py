"""This broker's place in a cluster: the membership of its flags (``--peers``, ``--ordinal``/``--advertised-address``,
``--ring-history``) or the one the admin service last set, and the ``Peers`` that act on it.

A membership set over the admin service is stored (synced) in the store's meta with the flags it replaced, so
a restart with the same flags keeps it; a restart with different flags means someone changed the deployment
since, and the flags win. A change applies in one step of the event loop (``Peers.apply``): the next call
already sees the new routes, assignments and placements.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Final

from lmq_broker import errors, model
from lmq_broker.cluster import membership as mb
from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch.dispatcher import Dispatcher
from lmq_broker.protocol import draining
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.metrics import Metrics
from lmq_broker.protocol.peers import Peers, Subscription, membership_of
from lmq_broker.storage.api import Store

log = logging.getLogger(__name__)

FLAGS: Final = "flags"
ADMIN: Final = "admin"


@dataclass(frozen=True, slots=True)
class Place:
    membership: mb.Membership
    slot: int  # this broker's slot; -1: no member (removed, still running)
    source: str  # FLAGS or ADMIN

    @property
    def alone(self) -> bool:
        return len(self.membership.members) == 1 and self.slot == 0


def flags_of(config: BrokerConfig) -> str:
    return json.dumps([config.peers, config.ring_history, config.ordinal, config.advertised_address])


def from_flags(config: BrokerConfig) -> Place:
    found = membership_of(config)
    if found is None:
        return Place(mb.Membership.single(config.advertised_address), 0, FLAGS)
    return Place(found[0], found[1], FLAGS)


def encode(place: Place, config: BrokerConfig) -> str:
    return json.dumps({"membership": place.membership.to_json(), "slot": place.slot, "flags": flags_of(config)})


def decode(text: str, config: BrokerConfig) -> Place | None:
    """The stored place, or None when it was set over other flags than this broker now has."""
    try:
        value = json.loads(text)
        if value["flags"] != flags_of(config):
            return None
        return Place(mb.Membership.from_json(value["membership"]), int(value["slot"]), ADMIN)
    except (ValueError, KeyError, TypeError) as exc:
        raise errors.InvalidArgument(f"the stored cluster membership is not readable: {exc}") from None


class Cluster:
    def __init__(
        self,
        config: BrokerConfig,
        store: Store,
        dispatcher: Dispatcher,
        edge: Edge,
        *,
        admin_keys: tuple[str, str] | None,
        metrics: Metrics,
    ) -> None:
        self.config = config
        self._store = store
        self._dispatcher = dispatcher
        self._edge = edge
        self._admin_keys = admin_keys
        self._metrics = metrics
        self.place = from_flags(config)
        self._peers: Peers | None = None
        self._changing = asyncio.Lock()
        self._handing: asyncio.Task[None] | None = None
        self._copying: set[asyncio.Task[None]] = set()  # subscriptions copied to brokers that joined

    @property
    def peers(self) -> Peers | None:
        """The peers this broker acts with; None while it runs alone."""
        return self._edge.peers

    @property
    def membership(self) -> mb.Membership:
        return self.place.membership

    @property
    def slot(self) -> int:
        return self.place.slot

    async def start(self) -> None:
        """The stored membership when it was set over the flags this broker has now, else the flags'."""
        text = await asyncio.to_thread(self._store.get_membership)
        stored = decode(text, self.config) if text is not None else None
        if text is not None and stored is None:
            log.warning("the flags changed since the cluster membership was last set over the admin service: flags win")
        self._apply(stored or self.place)

    async def change(self, place: Place) -> bool:
        """Store ``place`` (synced), then apply it. False when it is the current one."""
        async with self._changing:
            if (place.membership, place.slot) == (self.membership, self.slot):
                return False
            await asyncio.to_thread(self._store.put_membership, encode(place, self.config))
            self._apply(place)
            return True

    def _apply(self, place: Place) -> None:
        was_leaving = self.slot >= 0 and self.membership.leaving(self.slot) and self._peers is not None
        before = frozenset(self.membership.members) if self.slot >= 0 and self._peers is not None else None
        self.place = place
        membership, me = place.membership, place.slot
        if place.alone:
            self._edge.peers = None
        elif self._peers is None:
            self._peers = Peers(
                membership,
                me,
                self.config,
                holds_locally=self._holds_locally,
                drained_locally=self._drained_locally,
                subscribers=self._subscribers,
                admin_keys=self._admin_keys,
                registry=self._metrics.registry,
            )
            self._edge.peers = self._peers
        else:
            self._peers.apply(membership, me)
            self._edge.peers = self._peers
        if me >= 0 and membership.leaving(me) and not was_leaving and self._handing is None:
            self._handing = asyncio.get_running_loop().create_task(self._subscribe_at_owners())
        joined = [slot for slot, member in enumerate(membership.members) if before is not None and member not in before]
        if joined and me >= 0 and self._peers is not None:
            task = asyncio.get_running_loop().create_task(self._subscribe_at_owners(joined))
            self._copying.add(task)
            task.add_done_callback(self._copying.discard)
        where = f"slot {me}" if me >= 0 else "no member"
        log.info(
            "cluster (%s): %s of %d (ring of %d, epoch %d, %d leaving): %s",
            place.source,
            where,
            len(membership.members),
            membership.size,
            membership.epoch,
            len(membership.leaving_slots),
            ", ".join(membership.members),
        )

    async def _holds_locally(self, parent: str, lite: str) -> bool:
        return await self._dispatcher.run(self._store.lite_topic, parent, lite) is not None

    async def _drained_locally(self, parent: str, lite: str) -> bool:
        return await self._dispatcher.run(draining.drained, self._store, parent, lite)

    async def _subscribe_at_owners(self, joined: list[int] | None = None) -> None:
        """Subscriptions this broker has to topics it does not hold (topics not created yet) are made at their
        owners in today's ring, where those topics will be created: all of them when this broker just became a
        leaving one (its own topics take theirs along when they move), those owned by ``joined`` when brokers
        just joined, which also get every client's patterns (a pattern is on every broker). Failures only
        delay: the clients sync every subscription periodically (Python and Java every 30 s)."""
        try:
            wanted: dict[tuple[str, str, str], tuple[list[str], list[str]]] = {}
            for state in list(self._dispatcher.registry.clients()):
                for lmq in list(state.lite_topics):
                    parent, lite = model.QueueId(lmq).lite_parts()
                    wanted.setdefault((state.client_id, state.group, parent), ([], []))[0].append(lite)
                if joined and state.patterns and state.group and state.bind_topic:
                    key = (state.client_id, state.group, state.bind_topic)
                    wanted.setdefault(key, ([], []))[1].extend(state.patterns)

            def not_held() -> list[Subscription]:
                out = []
                for (client_id, group, parent), (lites, patterns) in wanted.items():
                    missing = [lite for lite in lites if self._store.lite_topic(parent, lite) is None]
                    if missing or patterns:
                        out.append((client_id, group, parent, missing, patterns))
                return out

            found = await self._dispatcher.run(not_held)
            peers = self._peers
            if found and peers is not None:
                failed = await peers.subscribe_at_owners(found, joined)
                if failed:
                    log.warning("%d subscriptions not copied to new owners: the clients' next sync makes them", failed)
        except Exception:
            log.exception("copying subscriptions to the new owners failed: clients' next sync makes them")
        finally:
            if joined is None:
                self._handing = None

    def _subscribers(self, parent: str, lite: str) -> list[tuple[str, str]]:
        out = []
        for client_id in self._dispatcher.subscribers(model.QueueId.lmq(parent, lite)):
            state = self._dispatcher.registry.get(client_id)
            if state is not None and state.group:
                out.append((client_id, state.group))
        return out

    async def close(self) -> None:
        if self._handing is not None or self._copying:
            await asyncio.gather(*filter(None, (self._handing, *self._copying)), return_exceptions=True)
        if self._peers is not None:
            await self._peers.close()
            self._peers = None
        self._edge.peers = None
