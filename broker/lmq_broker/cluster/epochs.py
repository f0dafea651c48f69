"""Membership epochs between brokers: which peers have confirmed this broker's epoch, and bringing a peer that
is behind up to it.

Brokers learn a ring change at different moments (the operator tells them one by one; a person runs
``lmq-admin cluster set`` on each). A lite topic whose owner differs between two epochs could then be created
twice: on its old owner by a broker that still has the old ring, on its new owner by one that has the new ring.
So a broker creates such a topic only after every slot it may have been placed on (its candidates,
``membership.candidates``) has *confirmed* the current epoch: that slot reports the epoch (or a newer one) in
``GetCluster``, and a broker reports an epoch only once every send it began under an older one has finished
(``setup.Cluster.change``). A confirmed slot never creates the topic by an older ring again, and whatever it
created before is visible to the ``DescribeLiteTopic`` asked next (``owners``). A peer found behind is sent
this broker's membership (``SetCluster`` with the epoch: the one writer's number, passed on, never a new one);
a peer found ahead is asked for its membership, which this broker adopts (``adopt``) before placing anything.
Only a membership its writer gave (``SetCluster``, source "admin") is passed on or adopted: one a broker took
from its flags (a new pod started with the grown ring) waits for the writer, which may first have work to do
(the operator applies every resource to a new broker before any broker is told the new ring).

Confirmations are kept per epoch and asked at most once at a time per peer. A peer that cannot be reached
leaves the topics it may hold unplaceable (the send fails with a retriable error naming it), exactly as a
topic whose older owner is down cannot be looked up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

import grpc

from lmq_broker import errors
from lmq_broker.cluster import membership as mb
from lmq_broker.cluster.links import CALL_TIMEOUT_S, Links
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as admin_pb

log = logging.getLogger(__name__)

Adopt = Callable[[mb.Membership], Awaitable[None]]  # a newer membership a peer has: apply it here


class Epochs:
    def __init__(self, links: Links, adopt: Adopt) -> None:
        self._links = links
        self._adopt = adopt
        self._epoch = -1
        self._confirmed: set[int] = set()  # slots that confirmed ``_epoch``
        self._asking: dict[int, asyncio.Future[None]] = {}

    def _current(self) -> int:
        epoch = self._links.membership.epoch
        if epoch != self._epoch:
            self._epoch = epoch
            self._confirmed = {self._links.me}
            self._asking = {}
        return epoch

    async def confirm(self, slots: Iterable[int]) -> None:
        """Return once every slot of ``slots`` has confirmed this broker's epoch; BrokerUnavailable when one
        cannot be reached or refuses it, or when a peer turned out to be ahead (this broker then adopts its
        membership: the caller tries again, by the new ring)."""
        epoch = self._current()
        waiting = []
        for slot in set(slots) - self._confirmed:
            asking = self._asking.get(slot)
            if asking is None:
                asking = self._asking[slot] = asyncio.ensure_future(self._ask(slot, epoch))
                asking.add_done_callback(self._asked)
            waiting.append(asking)
        if waiting:
            await asyncio.gather(*(asyncio.shield(w) for w in waiting))

    async def recheck(self, slot: int) -> None:
        """Ask ``slot`` again (it refused what this broker placed on it: one of the two has an older ring)."""
        if slot != self._links.me:
            self._current()
            self._confirmed.discard(slot)
            await self.confirm((slot,))

    def _asked(self, done: asyncio.Future[None]) -> None:
        for slot, asking in list(self._asking.items()):
            if asking is done:
                del self._asking[slot]
        if not done.cancelled():
            done.exception()  # retrieved here: every caller waiting got it already

    async def _ask(self, slot: int, epoch: int) -> None:
        membership = self._links.membership
        member = membership.members[slot]
        stub, headers = self._links.admin(member, "GetCluster")
        try:
            reply = await stub.GetCluster(
                admin_pb.GetClusterRequest(), metadata=headers, timeout=CALL_TIMEOUT_S, wait_for_ready=True
            )
            if reply.epoch < epoch and not self._links.told:
                raise errors.BrokerUnavailable(
                    f"broker {member} has membership epoch {reply.epoch}, this broker {epoch} from its flags: lite "
                    "topics it may hold are placed once the change is told to it (the operator, or lmq-admin "
                    "cluster set --everywhere); try again"
                )
            if reply.epoch < epoch:
                stub, headers = self._links.admin(member, "SetCluster")
                request = admin_pb.SetClusterRequest(
                    members=membership.members, ring_sizes=membership.sizes, epoch=epoch
                )
                set_reply = await stub.SetCluster(
                    request, metadata=headers, timeout=CALL_TIMEOUT_S, wait_for_ready=True
                )
                reply = set_reply.cluster
                log.info("broker %s was behind: told it epoch %d", member, epoch)
        except grpc.aio.AioRpcError as exc:
            raise errors.BrokerUnavailable(
                f"broker {member} has not confirmed the cluster's epoch {epoch} ({exc.code().name}: "
                f"{exc.details()}); lite topics it may hold cannot be placed until it does, try again"
            ) from None
        if reply.epoch > epoch and reply.source != "admin":
            raise errors.BrokerUnavailable(
                f"broker {member} has membership epoch {reply.epoch} from its flags, this broker {epoch}: lite topics "
                "it may hold are placed once the change is told to every broker; try again"
            )
        if reply.epoch > epoch:
            ahead = mb.of(tuple(reply.members), tuple(reply.ring_sizes), reply.epoch)
            log.info(
                "broker %s has a newer membership (epoch %d, this broker %d): adopting it", member, reply.epoch, epoch
            )
            await self._adopt(ahead)
            raise errors.BrokerUnavailable(
                f"the cluster changed to epoch {reply.epoch} while this send was placed; try again"
            )
        if reply.epoch < epoch:
            raise errors.BrokerUnavailable(f"broker {member} did not take the cluster's epoch {epoch}; try again")
        if (tuple(reply.members), tuple(reply.ring_sizes)) != (membership.members, membership.sizes):
            raise errors.BrokerUnavailable(
                f"broker {member} has another ring at epoch {reply.epoch} ({', '.join(reply.members)}): the "
                "membership's writer must tell every broker the same one; try again"
            )
        if self._epoch == epoch:
            self._confirmed.add(slot)
