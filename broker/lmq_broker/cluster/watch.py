"""Each broker watches its peers: up or down, restarted or not, ahead of or behind this broker's epoch.

Once per ``PROBE_INTERVAL_S`` every other member is asked ``GetCluster`` (cheap: no undrained count). What it
learns acts at once:

* a peer that restarted (its ``incarnation`` changed: a kill -9 lost the subscriptions it held in memory), came
  back after not answering, or missed a client's subscription change (``fanout.behind``) is given every
  client's part again (``fanout.repush``), with no client action. Probes name their caller and its
  incarnation, so a restarted broker's first probes, sent as soon as it serves (``setup.Cluster.serve``),
  tell its peers at once (``heard_from``) rather than at their next probe;
* a peer whose epoch differs from this broker's is brought level (``epochs.recheck``: told this broker's
  membership, or asked for its newer one), so a ring change reaches every broker within an interval even
  without traffic.

Every change of a peer's state is one log line and one count (``lmq_peer_state_changes``); ``lmq_peer_up``
says which peers answer now. Refused forwards are not logged one by one: their clients get the error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Final

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from lmq_broker import errors
from lmq_broker.cluster.epochs import Epochs
from lmq_broker.cluster.fanout import Fanout
from lmq_broker.cluster.links import Links
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as admin_pb

log = logging.getLogger(__name__)

PROBE_INTERVAL_S: Final = 5.0  # a restarted peer says so itself at once (heard_from): this only bounds the rest
PROBE_TIMEOUT_S: Final = 1.0
UP: Final = "up"
DOWN: Final = "down"
RESTARTED: Final = "restarted"


@dataclass
class _Seen:
    up: bool
    incarnation: str


class Watch:
    def __init__(
        self, links: Links, epochs: Epochs, fanout: Fanout, registry: CollectorRegistry, *, incarnation: str
    ) -> None:
        self._links = links
        self._incarnation = incarnation
        self._epochs = epochs
        self._fanout = fanout
        self._seen: dict[str, _Seen] = {}  # by member endpoint
        self._task: asyncio.Task[None] | None = None
        self._repushing: dict[str, asyncio.Task[None]] = {}
        self._again: set[str] = set()  # members to give every intent again once their running repush ends
        self._closed = False
        self.up = Gauge("lmq_peer_up", "1 while the peer answers, 0 while it does not", ["peer"], registry=registry)
        self.changes = Counter(
            "lmq_peer_state_changes",
            "Peers seen going down, coming up, or restarted",
            ["peer", "state"],
            registry=registry,
        )
        self.repushed = Counter(
            "lmq_subscriptions_repushed",
            "Lite topics and patterns given again to a peer that restarted, came back or missed a change",
            registry=registry,
        )

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        self._closed = True
        tasks = [t for t in (self._task, *self._repushing.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            members = self._links.membership.members
            me = self._links.me
            await asyncio.gather(
                *(self._probe(slot, member) for slot, member in enumerate(members) if slot != me),
                return_exceptions=True,
            )
            for gone in [m for m in self._seen if m not in members]:
                del self._seen[gone]
                with contextlib.suppress(KeyError):
                    self.up.remove(gone)
            self._fanout.prune()
            await asyncio.sleep(PROBE_INTERVAL_S)

    async def _probe(self, slot: int, member: str) -> None:
        stub, headers = self._links.admin(member, "GetCluster", probe=True)
        seen = self._seen.get(member)
        try:
            mine = self._links.membership.members[self._links.me] if self._links.me >= 0 else ""
            request = admin_pb.GetClusterRequest(caller=mine, caller_incarnation=self._incarnation)
            reply = await stub.GetCluster(request, metadata=headers, timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if seen is None or seen.up:
                self._change(member, DOWN, f"{exc.code().name}: {exc.details()}")
                self._seen[member] = _Seen(False, seen.incarnation if seen else "")
            self._fanout.unreachable.add(slot)  # subscription changes keep its part rather than wait for it
            return
        self._observe(slot, member, reply.incarnation, f"epoch {reply.epoch}")
        if reply.epoch != self._links.membership.epoch:
            with contextlib.suppress(errors.LmqError):
                await self._epochs.recheck(slot)

    def heard_from(self, member: str, incarnation: str) -> None:
        """A peer's own probe reached this broker: it is up, and it restarted if its incarnation changed. A
        restarted broker's first probes (as soon as it serves) so bring it its subscriptions at once."""
        members = self._links.membership.members
        if incarnation and member in members and members.index(member) != self._links.me:
            self._observe(members.index(member), member, incarnation, "it asked")

    def _observe(self, slot: int, member: str, incarnation: str, detail: str) -> None:
        self._fanout.unreachable.discard(slot)
        seen = self._seen.get(member)
        if seen is None:
            self._seen[member] = _Seen(True, incarnation)
            self.up.labels(member).set(1)
        else:
            if not seen.up:
                self._change(member, UP, detail)
            elif seen.incarnation != incarnation:
                self._change(member, RESTARTED, detail)
            if not seen.up or seen.incarnation != incarnation:
                self._fanout.behind.add(slot)
            seen.up, seen.incarnation = True, incarnation
        if slot in self._fanout.behind:
            self._start_repush(slot, member)

    def ring_changed(self) -> None:
        """The ring's sizes changed (a scale-up, slots marked leaving), or a subscription change was split by the
        ring before it: every member, this broker included, is given every intent's part again by the new ring
        at once (after the repush running there, which may not know the change: this broker is never probed).
        A subscription made through this broker while it still had the older ring went to the topic's owner by
        that ring only, and that owner, told first, had already copied what it held to the topic's new owner
        (``setup.Cluster``): the new owner would store the topic's messages with nobody subscribed there until
        the client's next full sync (an MQTT session's: never). A member that fails is tried again at the next
        probe."""
        for slot, member in enumerate(self._links.membership.members):
            self._fanout.behind.add(slot)
            self._start_repush(slot, member, again=True)

    def _start_repush(self, slot: int, member: str, *, again: bool = False) -> None:
        if self._closed:
            return
        if member in self._repushing:
            if again:
                self._again.add(member)
            return
        task = asyncio.get_running_loop().create_task(self._repush(slot, member))
        self._repushing[member] = task
        task.add_done_callback(lambda _: self._repushed(slot, member))

    def _repushed(self, slot: int, member: str) -> None:
        self._repushing.pop(member, None)
        if member in self._again:
            self._again.discard(member)
            members = self._links.membership.members
            if member in members:
                self._start_repush(members.index(member), member)

    async def _repush(self, slot: int, member: str) -> None:
        pushed, failed = await self._fanout.repush(slot)
        self.repushed.inc(pushed)
        if failed:
            log.warning("%d lite subscriptions not yet given again to %s: tried again next probe", failed, member)
        else:
            log.info("%d lite subscriptions given again to %s", pushed, member)

    def _change(self, member: str, state: str, detail: str) -> None:
        self.changes.labels(member, state).inc()
        self.up.labels(member).set(0 if state == DOWN else 1)
        (log.warning if state == DOWN else log.info)("peer %s is %s (%s)", member, state, detail)
