"""Metadata changed through any member reaches every member: parent topics, lite groups and quotas.

Without the operator (``--peers``, ``serve --processes N``) ``lmq-admin`` reaches one broker, while producers
reach all of them and each one needs the parent topic to answer a route (issue 25: 40 sends of 40 failed with
"failed to fetch topic route"). So a change of the catalog is applied here first and then sent on to every
other member's admin service, to all at once, each call bounded by ``COPY_TIMEOUT_S`` and by the caller's own
deadline, and marked ``x-lmq-here-only``: the receiver applies it and never sends it on (one hop, no loop). The
marker needs no check of its own: a call reaches the servicer only once ``auth.AdminGuard`` accepted its admin
signature (with ``--admin-anonymous`` anyone may change anything anyway). The operator sends it too: it calls
every broker itself.

Sent on (one value per name on every broker): PutParentTopic, DeleteParentTopic (a purge purges each member's
own lite topics), PutLiteGroup, DeleteLiteGroup, PutQuota, DeleteQuota. Applied here only (they act on what
this broker holds or did): CompareAndDeleteLiteTopics, ResetLiteOffsets, TriggerLiteDispatch,
RecordReclaimRuns, and SetCluster (``lmq-admin cluster set --everywhere`` orders those calls itself).

Nothing is rolled back: when a member did not take the change the call fails, UNAVAILABLE when the member did
not answer and FAILED_PRECONDITION when it refused, naming the members that have it and those that do not.
Puts and deletes are idempotent, so the same call repeated once they answer completes it. A delete of a parent
without purge first asks every member whether it still holds lite topics of it, and deletes nowhere unless all
answered and none does: a parent gone from some members only would strand the sends reaching them.

A broker that was down does not fetch what changed meanwhile: without versions or tombstones a broker cannot
tell a topic created while it was away from one deleted while it was away (a union of catalogs brings deleted
topics back, a copy of a peer's deletes parents that still hold messages), so the failed call says to repeat it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeAlias

import grpc
from google.protobuf import message as pb_message

from lmq_broker import errors
from lmq_broker.admin import codes
from lmq_broker.cluster import membership as mb
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as pb
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2_grpc as admin_grpc

if TYPE_CHECKING:  # generic only in grpc's type stubs
    Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]

HERE_ONLY: Final = "x-lmq-here-only"  # on an admin call: apply it on this broker, send it on to no one
COPY_TIMEOUT_S: Final = 2.0  # as the brokers' other calls to each other (RocketMQ's proxy gives its 2 s)
PURGE_COPY_TIMEOUT_S: Final = 600.0  # a purge walks every lite topic of the parent a member holds
DEADLINE_MARGIN_S: Final = 0.2  # the caller gets our answer naming the members before its own deadline
Headers: TypeAlias = tuple[tuple[str, str], ...]


class PeerAdmins(Protocol):
    def admin(self, endpoint: str) -> tuple[admin_grpc.LmqAdminAsyncStub, Headers]: ...


class Members(Protocol):
    """What of the broker's cluster (``Cluster``) this needs: the members, its own slot, its peers."""

    @property
    def membership(self) -> mb.Membership: ...

    @property
    def slot(self) -> int: ...

    @property
    def peers(self) -> PeerAdmins | None: ...


@dataclass(frozen=True, slots=True)
class Missed:
    """A member that did not take a copy: the status its call ended with."""

    member: str
    code: grpc.StatusCode
    detail: str

    @property
    def transient(self) -> bool:
        return codes.transient(codes.error_for(self.code, self.detail))

    def __str__(self) -> str:
        hint = (
            " (every broker of a cluster needs the same admin key pair)"
            if self.code is grpc.StatusCode.UNAUTHENTICATED
            else ""
        )
        return f"{self.member} ({self.code.name}: {self.detail}){hint}"


def here_only(metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
    return any(key == HERE_ONLY for key, _ in metadata or ())


class Everywhere:
    """Sends the catalog changes this broker applied on to the other members (none while it runs alone)."""

    def __init__(self, members: Members | None) -> None:
        self._members = members

    def _targets(self, context: Context) -> tuple[PeerAdmins, list[str], str] | None:
        """The peers, the members to send to and this broker's name in messages; None: send to no one."""
        members = self._members
        if members is None or here_only(context.invocation_metadata()):
            return None
        peers = members.peers
        if peers is None:
            return None
        slot, listed = members.slot, members.membership.members
        others = [member for i, member in enumerate(listed) if i != slot]
        me = f"{listed[slot]} (this broker)" if 0 <= slot < len(listed) else "this broker (no member)"
        return (peers, others, me) if others else None

    async def send_on(self, context: Context, rpc: str, request: pb_message.Message) -> None:
        """``request`` of ``rpc``, just applied here, applied by every other member too; raises naming the ones
        that did not take it (``BrokerUnavailable`` when all of those failed to answer, else ``Conflict``)."""
        found = self._targets(context)
        if found is None:
            return
        peers, others, me = found
        purge = isinstance(request, pb.DeleteParentTopicRequest) and request.purge_lite_topics
        timeout = _bounded(PURGE_COPY_TIMEOUT_S if purge else COPY_TIMEOUT_S, context)
        replies = await asyncio.gather(*(_call(peers, member, rpc, request, timeout) for member in others))
        missed = [reply for reply in replies if isinstance(reply, Missed)]
        if not missed:
            return
        reached = [me, *(m for m, reply in zip(others, replies, strict=True) if not isinstance(reply, Missed))]
        text = f"{rpc} is applied on {', '.join(reached)} but not on {'; '.join(map(str, missed))}. "
        text += "Where it is applied it stays (nothing is rolled back). "
        names = [m.member for m in missed]
        if all(m.transient for m in missed):
            text += "Repeat the call once they answer: it is safe to repeat (puts and deletes are idempotent)"
            error: errors.LmqError = errors.BrokerUnavailable(text, rpc=rpc, missed=names)
        else:
            text += (
                "Repeat the call once their refusal is resolved: it is safe to repeat (puts and deletes are idempotent)"
            )
            error = errors.Conflict(text, rpc=rpc, missed=names)
        raise error

    async def check_empty(self, context: Context, name: str) -> None:
        """Before a parent is deleted without purge: every other member answers that it holds no lite topic of
        it. Raises ``Conflict`` naming those that do, ``BrokerUnavailable`` naming those that did not answer;
        either way nothing was deleted anywhere."""
        found = self._targets(context)
        if found is None:
            return
        peers, others, _ = found
        timeout = _bounded(COPY_TIMEOUT_S, context)
        request = pb.GetParentTopicRequest(name=name)
        replies = await asyncio.gather(*(_call(peers, member, "GetParentTopic", request, timeout) for member in others))
        holding = [
            f"{member} ({reply.lite_topic_count})"
            for member, reply in zip(others, replies, strict=True)
            if isinstance(reply, pb.GetParentTopicResponse) and reply.lite_topic_count > 0
        ]
        if holding:
            raise errors.Conflict(
                f"parent topic {name!r} still has lite topics on {', '.join(holding)}; delete them or set "
                "purge_lite_topics. Nothing was deleted",
                topic=name,
            )
        silent = [r for r in replies if isinstance(r, Missed) and r.code is not grpc.StatusCode.NOT_FOUND]
        if silent:
            raise errors.BrokerUnavailable(
                f"cannot ask {'; '.join(map(str, silent))} whether parent topic {name!r} still has lite topics, so "
                "nothing was deleted: repeat the call once they answer, or set purge_lite_topics",
                topic=name,
                missed=[m.member for m in silent],
            )


def _bounded(timeout_s: float, context: Context) -> float:
    remaining: float | None = context.time_remaining()  # None without a deadline (the stubs do not say)
    if remaining is None:
        return timeout_s
    return max(min(timeout_s, remaining - DEADLINE_MARGIN_S), 0.0)


async def _call(peers: PeerAdmins, member: str, rpc: str, request: pb_message.Message, timeout_s: float) -> Any:
    """The member's reply, or how it failed (``Missed``)."""
    stub, headers = peers.admin(member)
    try:
        return await getattr(stub, rpc)(request, metadata=(*headers, (HERE_ONLY, "1")), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        return Missed(member, exc.code(), exc.details() or "")
