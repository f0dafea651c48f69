"""A leaving broker (scale-down) hands each lite topic it holds over to today's owner once that topic is drained.

Moving a topic while some group still has messages of it to consume here would let its newer messages (on
the new owner) be delivered before its older ones (here): per-topic order would break. So a leaving broker
keeps storing a topic's messages for as long as any group has one of them unconsumed, and the first send
that finds the topic drained (every bound group has committed up to its end) sends it, and every later
message of the topic, to today's owner. Under steady load a topic whose consumers keep up is drained
between two messages often, so topics move one by one and the broker ends with nothing undrained.

The decision and this broker's own stores of a topic exclude each other: while a store of the topic runs
here the topic is not drained; while the decision runs, sends of that topic wait for it. Handed-over topics
are remembered in memory: after a restart the first send checks again (the topic is still drained, nothing
was stored here meanwhile) and moves it again. Consumers of a handed-over topic must be subscribed at today's
owner before its first message is stored there: subscriptions made while the holder is leaving go to both
(``cluster.membership.subscribers_at``), and the ones this broker had from before are copied over as the
topic moves (``move``); a topic whose subscriptions cannot be copied does not move, and the send fails
(retried by the client). With replication a topic whose take-over was asked for (``taken_over``) is never
stored here again, even when the ask failed and the topic reads as undrained later (a new group, a reset commit
point): the new owner may have taken it over where it ended here, its answer lost; each later send asks again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Final

from lmq_broker import errors, model
from lmq_broker.storage.api import Store

log = logging.getLogger(__name__)

Drained = Callable[[str, str], Awaitable[bool]]  # (parent, lite) -> no unconsumed message here for any group
Move = Callable[[str, str], Awaitable[None]]  # (parent, lite): copy its subscriptions to today's owner
MOVED_MEMORY: Final = 1_000_000  # handed-over topics remembered; past it, the oldest are checked again
HAND_OVER_EVERY_S: Final = 1.0  # a leaving broker looks for consumed topics not handed over yet
HAND_OVER_BATCH: Final = 1_000  # such topics handed over per look
SCAN_PAGE: Final = 1_000


def drained(store: Store, parent: str, lite: str) -> bool:
    """Blocking. Every group bound to ``parent`` has consumed (committed) what this store holds of the topic;
    a non-empty topic whose parent has no group is never drained (nobody will ever consume it)."""
    meta = store.lite_topic(parent, lite)
    if meta is None or meta.max_offset <= meta.min_offset:
        return True
    groups = [g.name for g in store.list_groups() if g.bind_topic == parent]
    if not groups:
        return False
    queue = model.QueueId.lmq(parent, lite)
    for group in groups:
        committed = store.get_offset(queue, group)
        if committed is None or committed < meta.max_offset:
            return False
    return True


def not_handed_over(
    store: Store, moved: Callable[[str], bool], mine: Callable[[str], bool] | None = None, start_after: str = ""
) -> tuple[list[tuple[str, str]], str]:
    """Blocking. (parent, lite) of up to ``HAND_OVER_BATCH`` non-empty lite topics of this store after the key
    ``start_after`` not handed over yet (``moved``); with ``mine``, only the topics it accepts (LMQ name;
    replication: those of the leaving slot). And the key to start after next time ("": from the first again),
    so that passes go round the store instead of walking its handed-over head every time."""
    out: list[tuple[str, str]] = []
    after = start_after
    while len(out) < HAND_OVER_BATCH:
        page = store.scan_lite_topics(None, start_after=after, limit=SCAN_PAGE)
        for meta in page:
            topic = model.QueueId.lmq(meta.parent, meta.lite).topic
            after = f"{meta.parent}{model.LMQ_SEPARATOR}{meta.lite}"
            if meta.max_offset > meta.min_offset and not moved(topic) and (mine is None or mine(topic)):
                out.append((meta.parent, meta.lite))
                if len(out) == HAND_OVER_BATCH:
                    return out, after
        if len(page) < SCAN_PAGE:
            return out, ""
    return out, after


async def hand_over_idle(
    handoff: Handoff,
    store: Store,
    leaving: Callable[[], int],
    stopping: asyncio.Event,
    mine: Callable[[int], Callable[[str], bool] | None] = lambda slot: None,
) -> None:
    """Until ``stopping`` is set: every ``HAND_OVER_EVERY_S`` while this broker is leaving (``leaving``: its slot,
    else -1), its consumed lite topics not handed over yet are handed over without waiting for their next message
    (``Handoff.keep``'s decision: their consumers' subscriptions copied to today's owner), so a topic nobody sends
    to any more neither holds the scale-down up nor, once this broker is removed, takes its next message at
    today's owner where its consumers were never subscribed. A failure is tried again at the next pass."""
    cursor = ""
    while not stopping.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), HAND_OVER_EVERY_S)
        me = leaving()
        if me < 0 or stopping.is_set():
            continue
        try:
            found, cursor = await asyncio.to_thread(not_handed_over, store, handoff.moved, mine(me), cursor)
            for parent, lite in found:
                if await handoff.keep(parent, lite):  # not drained: it stays here for now
                    handoff.release(parent, lite)
        except errors.LmqError as exc:
            log.info("handing consumed topics of leaving slot %d over: %s (next pass tries again)", me, exc.message)
        except Exception:  # the loop must outlive any one pass: its topics would wait for a send otherwise
            log.exception("handing consumed topics of leaving slot %d over failed (next pass tries again)", me)


class Handoff:
    def __init__(self, is_drained: Drained, move: Move) -> None:
        self._drained = is_drained
        self._move = move
        self._moved: dict[str, None] = {}  # LMQ names handed over, oldest first
        self._storing: dict[str, int] = {}  # LMQ name -> stores of it running here
        self._deciding: dict[str, asyncio.Future[None]] = {}
        # With replication: (LMQ name, this leaving slot, today's owner) -> that owner's holder took the topic over
        # where it ends here (``replication.setup.Replication.hand_over``), before it counts as moved
        self.taken_over: Callable[[str, int, int], Awaitable[None]] | None = None
        self.slots: Callable[[str], tuple[int, int]] = lambda lmq: (-1, -1)  # LMQ name -> (this slot, today's)
        # With replication: whether a topic (LMQ name) is of this leaving slot by its records; one of a slot that
        # stays, which this broker holds until it releases it, is stored here and never handed over
        self.leaves: Callable[[str], bool] | None = None
        # LMQ names whose take-over was asked for (``taken_over``) and not confirmed: the new owner may have taken
        # the topic over where it ends here (its answer lost), so nothing more of it is stored here; each later
        # send asks again (found done there) instead of deciding afresh
        self._handing: set[str] = set()

    def moved(self, lmq: str) -> bool:
        return lmq in self._moved

    async def keep(self, parent: str, lite: str) -> bool:
        """True: store the message here (the caller must ``release`` the topic once stored or failed); False:
        the topic is handed over, its messages go to today's owner."""
        lmq = model.QueueId.lmq(parent, lite).topic
        while True:
            if lmq in self._moved:
                return False
            if self._storing.get(lmq):
                self._storing[lmq] += 1
                return True
            running = self._deciding.get(lmq)
            if running is None:
                break
            await asyncio.shield(running)
        decided: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._deciding[lmq] = decided
        try:
            if lmq in self._handing or (
                (self.leaves is None or self.leaves(lmq)) and await self._drained(parent, lite)
            ):
                await self._move(parent, lite)
                if self.taken_over is not None:
                    self._handing.add(lmq)
                    await self.taken_over(lmq, *self.slots(lmq))
                    self._handing.discard(lmq)
                if len(self._moved) >= MOVED_MEMORY:
                    del self._moved[next(iter(self._moved))]
                self._moved[lmq] = None
                return False
            self._storing[lmq] = 1
            return True
        finally:
            del self._deciding[lmq]
            decided.set_result(None)

    def release(self, parent: str, lite: str) -> None:
        lmq = model.QueueId.lmq(parent, lite).topic
        left = self._storing[lmq] - 1
        if left:
            self._storing[lmq] = left
        else:
            del self._storing[lmq]
