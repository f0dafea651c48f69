"""Which broker owns each lite topic: ``membership.resolve`` with the answers it needs, asked and remembered.

Most topics have one candidate slot in every epoch of the ring history and need no question. A topic whose
owner changed with a scale-up or down is asked about once: does an older owner hold it (and, when that one is
leaving, has it handed the topic to today's owner yet)? Before the answer "held nowhere" may place it on
today's owner, every candidate must have confirmed this broker's membership epoch (``cluster.epochs``), so no
broker with an older ring can create it elsewhere meanwhile. Answers are remembered per parent until the
membership changes (``forget``) or the memory is full (cleared wholesale).

The same resolution runs where a send arrives and where a peer's copy of it arrives: a peer's copy is stored
only if the receiver, by its own view, owns the topic (``forwarding``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

import grpc

from lmq_broker import errors, model
from lmq_broker.cluster import membership as mb
from lmq_broker.cluster.epochs import Epochs
from lmq_broker.cluster.links import CALL_TIMEOUT_S, Links
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as admin_pb

PLACEMENT_CACHE: Final = 262_144  # lite topic -> slot answers kept; cleared wholesale when full
LocalHolds = Callable[[int, str, str], Awaitable[bool]]  # (slot, parent, lite) -> this broker holds it as that slot


class Owners:
    def __init__(self, links: Links, epochs: Epochs, holds_locally: LocalHolds) -> None:
        self._links = links
        self._epochs = epochs
        self._holds_locally = holds_locally
        self._placement: dict[str, dict[str, int]] = {}  # parent -> lite topic -> slot
        self._placed = 0  # entries of _placement
        self.handed_over = False  # a topic was placed by a hand-over since the last membership (``place``)
        # With replication (lmq_broker.replication): the slot whose broker holds a slot's lease, where its
        # topics' sends go after a failover. None: every slot serves itself.
        self.serving: Callable[[int], int] | None = None

    def forget(self, parent: str = "", lites: Sequence[str] = ()) -> None:
        """Everything remembered (a new membership), or what is remembered of ``lites`` of ``parent``."""
        if not parent:
            self._placement = {}
            self._placed = 0
            self.handed_over = False
            return
        placed = self._placement.get(parent, {})
        for lite in lites:
            if placed.pop(lite, None) is not None:
                self._placed -= 1

    async def owners(self, parent: str, lites: Sequence[str]) -> list[int]:
        """The slot each lite topic of ``parent`` is written to (``cluster.membership.resolve``), or the slot
        serving it after a failover."""
        found = await self._owners(parent, lites)
        serving = self.serving
        return found if serving is None else [serving(slot) for slot in found]

    async def _owners(self, parent: str, lites: Sequence[str]) -> list[int]:
        known = (self._placement.get(parent) or {}).get
        out = [known(lite, -1) for lite in lites]  # per message of a batched send: the common case first
        if -1 not in out:
            return out
        membership = self._links.membership
        unknown: list[int] = []
        for i in [i for i, slot in enumerate(out) if slot == -1]:
            lite = lites[i]
            out[i] = self._placement.get(parent, {}).get(lite, -1)  # missing several times in one request
            if out[i] == -1:
                found = mb.candidates(membership, model.QueueId.lmq(parent, lite).topic)
                if len(found) == 1:
                    out[i] = found[0]
                    self._remember(parent, lite, found[0])
                else:
                    unknown.append(i)
        if unknown:
            resolved = await asyncio.gather(*(self._look_up(parent, lites[i]) for i in unknown))
            for i, slot in zip(unknown, resolved, strict=True):
                out[i] = slot
        return out

    def owner_today(self, parent: str, lite: str) -> int:
        return mb.owner(self._links.membership, model.QueueId.lmq(parent, lite).topic)

    def place(self, parent: str, lite: str, slot: int) -> None:
        """Remember ``lite`` as living on ``slot`` (a topic handed over to this broker)."""
        self.handed_over = True
        self._remember(parent, lite, slot)

    def _remember(self, parent: str, lite: str, slot: int) -> None:
        if self._placed >= PLACEMENT_CACHE:
            self._placement.clear()
            self._placed = 0
        placed = self._placement.get(parent)
        if placed is None:
            placed = self._placement[parent] = {}
        if lite not in placed:
            self._placed += 1
        placed[lite] = slot

    async def _look_up(self, parent: str, lite: str) -> int:
        membership = self._links.membership
        lmq = model.QueueId.lmq(parent, lite).topic
        found = mb.candidates(membership, lmq)
        await self._epochs.confirm(found)
        asked = list(found[1:])
        if any(membership.leaving(slot) for slot in asked):
            asked.append(found[0])
        answers = await asyncio.gather(*(self._holds(slot, parent, lite) for slot in asked))
        held = dict(zip(asked, answers, strict=True))
        slot = mb.resolve(membership, lmq, held.__getitem__)
        if self._links.membership is membership:  # not answered by a ring that has changed since
            self._remember(parent, lite, slot)
        return slot

    async def _holds(self, slot: int, parent: str, lite: str) -> bool:
        """Does ``slot`` hold the topic: asked of the broker serving it (after a failover, its lease holder,
        which has the slot's topics; its preferred owner may be down or back on an empty disk)."""
        serving = self.serving
        asked = slot if serving is None else serving(slot)
        if asked == self._links.me:
            return await self._holds_locally(slot, parent, lite)
        member = self._links.membership.members[asked]
        stub, metadata = self._links.admin(member, "DescribeLiteTopic")
        try:
            await stub.DescribeLiteTopic(
                admin_pb.DescribeLiteTopicRequest(parent=parent, lite=lite, slot=slot),
                metadata=metadata,
                timeout=CALL_TIMEOUT_S,
                wait_for_ready=True,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise errors.BrokerUnavailable(
                f"cannot tell whether broker {member} holds lite topic {lite!r}: {exc.code().name} {exc.details()}"
            ) from None
        return True
