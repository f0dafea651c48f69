"""Lite subscriptions made under ``--acl`` end when their user may no longer read them.

A SyncLiteSubscription is checked when it is made; a later policy change (``lmq-admin acl put/delete``, a user
disabled or deleted) would otherwise leave what it allowed flowing to the client's receives. So this broker
remembers, per client id, which user (and from which address) last changed its lite subscriptions and which
names it holds (one ``Held`` per client: the dispatcher keeps one group and parent per client too), and after
every change of the rules (``AccessControl.watch``) checks them again: a group the user may no longer read
ends all of them (COMPLETE_REMOVE), a lite topic or pattern it may no longer read ends alone (PARTIAL_REMOVE),
applied as the client's own call would be (in a cluster at every broker that holds a part). A message leased
already may still be settled; no new one is handed out. A refused sync (the official clients send their whole
set again every 30 s) is checked the same way at once. The user and address are saved with the client's
subscriptions (``dispatch.saved_subscriptions``), so the subscriptions a restart restores are checked against
the rules as they are then before the broker serves (``check_restored``), and at every later change.

Clients no longer registered at the dispatcher are forgotten at each pass; at most ``CLIENTS_KEPT`` are kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Final

from lmq_broker import errors, model
from lmq_broker.access import policy
from lmq_broker.access.control import AccessControl
from lmq_broker.protocol.context import Caller
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.handlers import sync_lite_subscription

log = logging.getLogger(__name__)

CLIENTS_KEPT: Final = 1_000_000


@dataclass(slots=True)
class Held:
    user: str
    peer: str
    caller: Caller
    group: str
    parent: str
    names: set[str] = field(default_factory=set)
    whole: bool = False  # a wildcard group's registration: its patterns stand or fall together (COMPLETE_REMOVE)


class Revoker:
    def __init__(self, edge: Edge, access: AccessControl) -> None:
        self._edge = edge
        self._access = access
        self._held: dict[str, Held] = {}
        self._watching = False
        self._pass: asyncio.Task[None] | None = None
        self._again = False
        self._soon: set[str] = set()  # client ids to check at the next pass (a refused sync)

    def made(
        self,
        caller: Caller,
        user: str,
        peer: str,
        request: spb.SyncLiteSubscriptionRequest,
        names: list[str],
        *,
        whole: bool = False,
    ) -> None:
        """A sync of ``caller`` by ``user`` (before its checks: a refused one may name what the client holds);
        ``whole``: a wildcard group's COMPLETE_ADD, ``names`` its patterns, ended all at once when one is refused."""
        self._watch()
        client_id, group, parent = caller.client_id, request.group.name, request.topic.name
        self._edge.dispatcher.own_subscriptions(client_id, user, peer)
        held = self._held.get(client_id)
        if held is None or (held.group, held.parent) != (group, parent):
            if held is None and len(self._held) >= CLIENTS_KEPT:
                self._forget_gone()
            held = self._held[client_id] = Held(user, peer, caller, group, parent)
        held.user, held.peer, held.caller = user, peer, caller
        held.whole = whole or (held.whole and request.action != pb.COMPLETE_ADD)
        action = request.action
        if action == pb.PARTIAL_ADD:
            held.names.update(names)
        elif action == pb.PARTIAL_REMOVE:
            held.names.difference_update(names)
        elif action == pb.COMPLETE_ADD:
            held.names = set(names)
        elif action == pb.COMPLETE_REMOVE:
            held.names = set()

    def _watch(self) -> None:
        if not self._watching:
            loop = asyncio.get_running_loop()
            self._access.watch(lambda: loop.call_soon_threadsafe(self.changed))
            self._watching = True

    async def check_restored(self) -> None:
        """Check the subscriptions restored from the data dir whose user is known (saved under ``--acl``)
        against the rules as they are now; later changes check them too. Before the broker serves."""
        if not self._access.enabled:
            return
        dispatcher = self._edge.dispatcher
        for state in list(dispatcher.client_states()):
            owner = dispatcher.subscription_owner(state.client_id)
            if not state.restored or owner is None or not state.group or state.client_id in self._held:
                continue
            names = {model.QueueId(lmq).lite_parts()[1] for lmq in state.lite_topics} | state.patterns
            caller = Caller(client_id=state.client_id)
            self._held[state.client_id] = Held(*owner, caller, state.group, state.bind_topic, names)
        self._watch()
        self.changed()
        if self._pass is not None:
            await self._pass

    def refused(self, client_id: str) -> None:
        """The client's sync was refused: what it holds is checked at once."""
        self._soon.add(client_id)
        self.changed(only_soon=True)

    def changed(self, *, only_soon: bool = False) -> None:
        """The rules changed (or, ``only_soon``, a client's sync was refused): one pass, or one more after the
        running one."""
        if not only_soon:
            self._soon.clear()
            self._soon.add("")  # "" stands for every client
        if self._pass is not None and not self._pass.done():
            self._again = True
            return
        self._pass = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            self._again = False
            wanted, self._soon = self._soon, set()
            everyone = "" in wanted
            self._forget_gone()
            for client_id in list(self._held) if everyone else wanted:
                held = self._held.get(client_id)
                if held is not None:
                    try:
                        await self._check(client_id, held)
                    except Exception:
                        log.exception("client %s: lite subscriptions not checked again", client_id)
            if not self._again:
                return

    def _forget_gone(self) -> None:
        dispatcher = self._edge.dispatcher
        for client_id in [c for c in self._held if dispatcher.client_state(c) is None]:
            del self._held[client_id]
        while len(self._held) >= CLIENTS_KEPT:
            del self._held[next(iter(self._held))]

    async def _check(self, client_id: str, held: Held) -> None:
        access, user, peer = self._access, held.user, held.peer
        sub, parent = policy.Action.SUB, held.parent
        names = sorted(n for n in held.names if not access.allows(user, sub, policy.lite(parent, n), peer))
        if not access.allows(user, sub, policy.group(held.group), peer) or (held.whole and names):
            ended, action = sorted(held.names) or ["(all)"], pb.COMPLETE_REMOVE
            self._held.pop(client_id, None)
            names = []
        else:
            if not names:
                return
            ended, action = names, pb.PARTIAL_REMOVE
            held.names.difference_update(names)
        log.info("client %s, user %s: lite subscriptions of %s in group %s no longer allowed ended (access control "
                 "changed): %s", client_id, user, held.parent, held.group, ", ".join(ended[:20]))  # fmt: skip
        request = spb.SyncLiteSubscriptionRequest(
            action=action, topic=pb.Resource(name=held.parent), group=pb.Resource(name=held.group), lite_topic_set=names
        )
        plain = Caller(client_id=client_id, namespace=held.caller.namespace)  # names as they are: no splitting
        with contextlib.suppress(errors.NotFound):  # the group or parent deleted meanwhile: nothing to end
            cluster = self._edge.cluster
            if cluster is not None:
                await cluster.sync_lite(request, plain, lambda: ())
            else:
                await sync_lite_subscription.handle(self._edge, request, plain)
