"""Sends forwarded by the native edge (``--native-forward on``): a client's SendMessage owned by a sibling
process of this pod is written to the sibling's local hop socket by the edge's tokio threads, and the sibling's
answer is the call's reply; this process's Python never sees the call (``native/edge/src/forward.rs``).

The edge does it only with the table this module gives it, and only while placement is plain, so that the ring
hash of a topic's LMQ name is its owner (what the edge computes, ``ring.slot_of``):

* one ring size (no older ring in the history in force) and no leaving slot (no hand-over under way);
* ``--replicas 1`` (no slot served by another after a failover) and no topic remembered as handed over;
* no client authentication (neither ``--acl`` nor ``--access-key``: the edge checks no signature);
* this broker is a member; the owner a sibling (this pod's host) whose local hop socket is there.

The table is pushed again at every membership change (``setup.Cluster._apply``) and every ``REFRESH_S`` (the
hello it carries is signed with a time, ``cluster.trust``; a sibling's socket may appear), and withdrawn as soon
as a condition fails: the edge then hands every call to Python, as with ``off``.

The sibling serves such a frame as a client's call (a connection whose hello is ``local_hop.HELLO_CLIENTS``):
admission, the reserved properties, its own view of ownership (a topic it does not own is forwarded on, as a
client's send would be), the same statuses. A request the edge cannot route alone (several owners, a message
that is not lite, this broker's own topic, bytes its scanner does not follow, a peer's copy) is Python's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Final, Protocol

from lmq_broker import errors
from lmq_broker.cluster import local_hop, trust
from lmq_broker.cluster import membership as mb
from lmq_broker.cluster.links import CALL_TIMEOUT_S
from lmq_broker.config import BrokerConfig, LocalHop, NativeForward
from lmq_broker.protocol import status
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb

log = logging.getLogger(__name__)

REFRESH_S: Final = 15.0  # well within trust.MAX_SKEW_MS: a connection opened later still greets with a valid hello


class Edge(Protocol):
    """What this needs of the native edge (``protocol.native.NativeServer``)."""

    def forward_to(self, size: int, me: int, timeout_s: float, routes: list[tuple[int, str, bytes, bytes]]) -> None: ...
    def forward_off(self) -> None: ...


def wanted(config: BrokerConfig) -> bool:
    """Whether the flags allow native forwarding at all (the rest is decided per membership)."""
    return (
        config.native_forward is NativeForward.ON
        and config.local_hop is LocalHop.SOCKET
        and config.local_hop_dir is not None
        and not config.acl
        and not config.access_key
        and config.replicas == 1
    )


def failed_reply(member: str) -> bytes:
    """What a call gets when ``member`` does not answer its forwarded frame (as ``forwarding`` answers)."""
    why = errors.BrokerUnavailable(
        f"broker {member} owning these lite topics did not answer over the local hop; nothing was stored, try again"
    )
    return spb.SendMessageResponse(status=status.status_of(why)).SerializeToString()


class NativeForwarding:
    """Keeps the edge's table in step with this broker's membership (``plain`` tells whether it may have one)."""

    def __init__(
        self, edge: Edge, config: BrokerConfig, secret: bytes, plain: Callable[[], tuple[mb.Membership, int] | None]
    ):
        self._edge = edge
        self._config = config
        self._secret = secret
        self._plain = plain
        self._task: asyncio.Task[None] | None = None
        self.on = False  # a table is with the edge

    def start(self) -> None:
        self.push()
        self._task = asyncio.get_running_loop().create_task(self._refresh(), name="lmq-native-forward")

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                self.push()
            except Exception:  # never leave a stale table behind
                log.exception("the native edge's forwarding table could not be refreshed: withdrawn")
                self._withdraw()

    def push(self) -> None:
        """The table for the membership now, or none when placement is not plain."""
        found = self._plain()
        directory = self._config.local_hop_dir
        if found is None or directory is None:
            self._withdraw()
            return
        membership, me = found
        now_ms = time.time_ns() // 1_000_000
        _, hello = trust.header(self._secret, local_hop.HELLO_CLIENTS, membership.epoch, now_ms)
        host = membership.members[me].rpartition(":")[0]
        routes = []
        for slot, member in enumerate(membership.members):
            # A sibling: this pod's host (a socket is named by its port alone, which another pod's member shares);
            # its socket not there yet, the edge's connect fails and Python serves until it is.
            if slot == me or not member or member.rpartition(":")[0] != host:
                continue
            path = local_hop.socket_path(directory, member)
            if path is not None:
                routes.append((slot, str(path), hello.encode(), failed_reply(member)))
        self._edge.forward_to(membership.size, me, CALL_TIMEOUT_S, routes)
        self.on = True

    def _withdraw(self) -> None:
        if self.on:
            self._edge.forward_off()
            self.on = False

    async def close(self) -> None:
        self._withdraw()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


def plain(membership: mb.Membership, me: int, handed_over: bool) -> bool:
    """Whether each topic's owner is its ring hash in today's ring (see the module's docstring)."""
    return me >= 0 and len(membership.sizes) == 1 and not membership.leaving_slots and not handed_over
