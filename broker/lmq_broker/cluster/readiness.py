"""Waiting on the other brokers for a client this broker serves, without leasing there.

A LiteSimpleConsumer's receive (``gathering``) and an MQTT session (``mqtt_link``) take messages from every
broker of a cluster through the one they are connected to. A long-polled ReceiveMessage at another broker that
is cut off after it leased would hide what it leased for its invisible duration, so receiving there is only
ever done without waiting. The wait itself is an ``AwaitLiteReady`` admin call there (a peer's call: signed
with the admin pair and the peer header), which leases nothing: it answers ``ready`` as soon as the client has
lite topics ready at that broker, else not ready at its timeout, and one cut off loses nothing.

``Readiness`` keeps one such wait parked at each other broker for one client: a wait that ends not ready is
parked again (while someone waits), one that said ready is not, until ``take`` handed that broker to the
caller, which receives there without waiting. A broker whose wait failed (down, refusing, stopping) or ended
early, or where receiving failed, is not asked again within ``RETRY_S`` of the previous ask (a broker that said
ready but where the receive found nothing, ``EMPTY_RETRY_S``): a waiting client costs at most one call per
other broker per ``RETRY_S`` when things fail, and one per other broker per wait timeout while all is quiet.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Final

import grpc

from lmq_broker.cluster.links import CALL_TIMEOUT_S
from lmq_broker.cluster.peers import Peers
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as admin_pb

log = logging.getLogger(__name__)

MAX_WAIT_S: Final = 30.0  # one parked wait lasts at most this long, then it is parked again
SPREAD: Final = 0.2  # long waits last 80-100 % of what was asked: waits parked together renew apart
MIN_WAIT_S: Final = 0.05  # less time than this left: no wait is parked
RETRY_S: Final = 1.0  # a broker is asked again no sooner than this after an ask that did not say ready
EMPTY_RETRY_S: Final = 0.1  # ... and after this when a receive there found nothing though it said ready
METHOD: Final = "AwaitLiteReady"


class Readiness:
    """One client's waits at the other brokers. ``calls`` counts the waits parked (for tests and benchmarks)."""

    def __init__(
        self,
        peers: Callable[[], Peers | None],
        client_id: str,
        group: str,
        parent: str,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._peers = peers
        self._request = admin_pb.AwaitLiteReadyRequest(client_id=client_id, group=group, parent=parent)
        self._clock = clock
        self._parked: dict[str, asyncio.Task[None]] = {}
        self._ready: dict[str, None] = {}  # said ready, not taken yet (in the order they said it)
        self._asked_at: dict[str, float] = {}
        self._changed = asyncio.Event()
        self.calls = 0

    def take(self) -> list[str]:
        """The brokers that said ready since the last ``take``; the caller receives there without waiting and
        tells how that went (``received``, ``failed``), and their waits are parked again by ``wait``."""
        ready = list(self._ready)
        self._ready.clear()
        return ready

    def received(self, member: str, count: int) -> None:
        """``count`` messages came from ``member`` after it said ready: its next wait is parked at once (none:
        after ``EMPTY_RETRY_S``, as a ready answer that a receive keeps finding empty must not spin)."""
        if count:
            self._asked_at.pop(member, None)
        else:
            self._asked_at[member] = self._clock() - RETRY_S + EMPTY_RETRY_S

    def failed(self, member: str) -> None:
        """Receiving at ``member`` failed (down, overloaded): it is asked again after ``RETRY_S``."""
        self._asked_at[member] = self._clock()

    async def wait(self, members: Sequence[str], timeout_s: float, *, park_s: float | None = None) -> bool:
        """Until one of ``members`` said ready (True), or ``timeout_s`` passed (False). A wait parked at a broker
        lasts ``park_s`` (at most ``MAX_WAIT_S``; None: the time left of this call) and stays parked across calls
        (``close`` ends them); brokers no longer among ``members`` are forgotten."""
        for gone in [m for m in self._parked if m not in members]:
            self._parked.pop(gone).cancel()
        deadline = self._clock() + timeout_s
        while not self._ready:
            now = self._clock()
            if now >= deadline:
                return False
            wake = deadline
            for member in members:
                if member in self._parked or member in self._ready:
                    continue
                next_ask = self._asked_at.get(member, -RETRY_S) + RETRY_S
                if next_ask > now:
                    wake = min(wake, next_ask)
                elif deadline - now >= MIN_WAIT_S:
                    self._park(member, min(MAX_WAIT_S, park_s * _spread() if park_s else deadline - now))
            self._changed.clear()
            try:
                async with asyncio.timeout(max(0.0, wake - now)):
                    await self._changed.wait()
            except TimeoutError:
                pass
        return True

    def _park(self, member: str, timeout_s: float) -> None:
        self._asked_at[member] = self._clock()
        self.calls += 1
        task = asyncio.get_running_loop().create_task(self._one(member, timeout_s))
        self._parked[member] = task
        task.add_done_callback(lambda done: self._ended(member, done))

    async def _one(self, member: str, timeout_s: float) -> None:
        peers = self._peers()
        if peers is None:
            return
        request = admin_pb.AwaitLiteReadyRequest()
        request.CopyFrom(self._request)
        request.timeout_ms = int(timeout_s * 1000)
        stub, metadata = peers.admin(member, METHOD)
        try:
            reply = await stub.AwaitLiteReady(
                request, metadata=metadata, timeout=timeout_s + CALL_TIMEOUT_S, wait_for_ready=True
            )
        except grpc.aio.AioRpcError as exc:  # asked again after RETRY_S; its messages wait meanwhile
            log.debug("waiting for %s at %s failed: %s", request.client_id, member, exc.code().name)
            return
        if reply.ready:
            self._ready[member] = None

    def _ended(self, member: str, done: asyncio.Task[None]) -> None:
        if self._parked.get(member) is done:
            del self._parked[member]
        if not done.cancelled() and done.exception() is not None:
            log.warning("waiting for %s at %s failed", self._request.client_id, member, exc_info=done.exception())
        self._changed.set()

    def close(self) -> None:
        """End every parked wait (nothing was leased by them: nothing is lost)."""
        for task in self._parked.values():
            task.cancel()
        self._parked.clear()
        self._ready.clear()


def _spread() -> float:
    return 1.0 - SPREAD * random.random()
