"""The brokers of a cluster and where a lite topic lives, as plain values: the same answer on every broker.

A ``Membership`` is the ordered list of ring slots (slot -> the endpoint clients and peers call) and the
ring size of every epoch so far, oldest first. RocketMQ never moves data: a topic created while the ring had
n slots stays on the slot that owned it then, until it is reclaimed. So the owner of a topic is not simply
its slot in today's ring but the newest epoch's owner *that holds it*; only topics that hold nowhere follow
today's ring. Jump hashing keeps that search short: a scale-up from n to m slots moves a key only onto one
of the new slots, so most keys have one candidate and need no look-up at all.

Slots at or past today's ring size are leaving (a scale-down): they stay in routes, READ for producers, and
take no new topic; a topic a leaving slot holds keeps its messages there until that topic is drained (every
message consumed), so its order holds, and then moves to today's owner (``protocol.draining``). A leaving
slot that holds nothing undrained is removed (``shed``): only the tail of the ring leaves, so removing it
changes no other slot's number, and ring sizes of the history past the new end become the new end, which
jump hashing makes exact: a key that never landed on a removed slot in a bigger ring has the same slot in
the smaller one.

Every membership carries an ``epoch`` that only grows. One writer numbers each change (the operator, holding
its Lease, or ``lmq-admin cluster set --everywhere``) and every broker applies the same number; a broker never
goes back to a smaller epoch. A membership from flags has the epoch ``len(sizes)`` (brokers started with the
same flags agree). The epoch is what lets brokers that learn a change at different moments agree on where a
brand-new lite topic goes (``cluster.owners``: such a topic is created only once every slot it may have been
placed on confirms the epoch).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from lmq_broker import errors
from lmq_broker.cluster import ring

SEPARATOR: Final = ","


@dataclass(frozen=True, slots=True)
class Membership:
    members: tuple[str, ...]  # slot -> advertised endpoint "host:port"
    sizes: tuple[int, ...]  # ring size of every epoch, oldest first; the last is today's ring
    # Only grows (module docstring); 0: len(sizes). Not part of equality: two memberships are equal when their
    # rings are (the writer numbers them); code that cares about the number compares it.
    epoch: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if self.epoch <= 0:
            object.__setattr__(self, "epoch", len(self.sizes))
        if not self.members:
            raise errors.InvalidArgument("a cluster has at least one member")
        if len(set(self.members)) != len(self.members):
            raise errors.InvalidArgument(f"members must differ: {', '.join(self.members)}")
        if not self.sizes or any(not 1 <= size <= len(self.members) for size in self.sizes):
            raise errors.InvalidArgument(f"ring sizes {self.sizes} must lie within 1..{len(self.members)}")
        if max(self.sizes) != len(self.members):
            raise errors.InvalidArgument(f"{len(self.members)} members but no epoch had that many slots")

    @staticmethod
    def single(endpoint: str = "") -> Membership:
        return Membership((endpoint,), (1,))

    @staticmethod
    def parse(peers: str, history: str = "") -> Membership:
        """From ``--peers a:1,b:2,c:3`` and ``--ring-history 2`` (earlier ring sizes, oldest first)."""
        members = tuple(p.strip() for p in peers.split(SEPARATOR) if p.strip())
        for member in members:
            host, _, port = member.rpartition(":")
            if not host or not port.isdigit():
                raise errors.InvalidArgument(f"peer {member!r} is not host:port")
        try:
            earlier = tuple(int(s) for s in history.split(SEPARATOR) if s.strip())
        except ValueError:
            raise errors.InvalidArgument(f"ring history {history!r} is not a list of sizes") from None
        return Membership(members, (*earlier, len(members)))

    @property
    def size(self) -> int:
        """Slots of today's ring: the ones new topics are placed on."""
        return self.sizes[-1]

    def at(self, epoch: int) -> Membership:
        return Membership(self.members, self.sizes, epoch)

    def writable(self, slot: int) -> bool:
        return 0 <= slot < self.size

    def leaving(self, slot: int) -> bool:
        return self.size <= slot < len(self.members)

    @property
    def leaving_slots(self) -> range:
        return range(self.size, len(self.members))

    def slot_of(self, endpoint: str) -> int:
        try:
            return self.members.index(endpoint)
        except ValueError:
            raise errors.InvalidArgument(f"{endpoint} is not one of the peers {', '.join(self.members)}") from None

    def grown(self, *endpoints: str) -> Membership:
        """Scale-up: the new slots appended, a new epoch."""
        members = self.members + endpoints
        return Membership(members, (*self.sizes, len(members)), self.epoch + 1)

    def shrunk(self, size: int) -> Membership:
        """Scale-down, first step: slots ``size`` and beyond are leaving (a new epoch)."""
        if not 1 <= size <= len(self.members):
            raise errors.InvalidArgument(f"a ring of {len(self.members)} members cannot shrink to {size}")
        return Membership(self.members, (*self.sizes, size), self.epoch + 1) if size != self.size else self

    def shed(self) -> Membership:
        """Scale-down, last step: the leaving slots removed, the history capped at the ring that remains."""
        return of(self.members[: self.size], self.sizes, self.epoch + 1)

    def to_json(self) -> str:
        return json.dumps({"members": list(self.members), "sizes": list(self.sizes), "epoch": self.epoch})

    @staticmethod
    def from_json(text: str) -> Membership:
        try:
            value = json.loads(text)
            return Membership(
                tuple(str(m) for m in value["members"]),
                tuple(int(s) for s in value["sizes"]),
                int(value.get("epoch", 0)),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise errors.InvalidArgument(f"membership {text!r} is not readable: {exc}") from None


def admin_endpoint(member: str, admin_port: int) -> str:
    """Where a member serves lmq.admin.v1: on its own endpoint, or with ``--admin-port`` (every broker of a
    cluster runs with the same flags) on that port of its host."""
    return f"{member.rsplit(':', 1)[0]}:{admin_port}" if admin_port > 0 else member


def of(members: Sequence[str], sizes: Sequence[int], epoch: int = 0) -> Membership:
    """A membership whose history may name sizes bigger than its member list (slots since removed): those are
    capped at today's member count and repeats merged. Only valid once the removed slots hold nothing."""
    kept: list[int] = []
    for size in sizes:
        capped = min(size, len(members))
        if not kept or kept[-1] != capped:
            kept.append(capped)
    return Membership(tuple(members), tuple(kept), epoch)


def owner(membership: Membership, lmq: str) -> int:
    """Today's owner: where a topic that no broker holds yet is created."""
    return ring.slot_of(lmq, membership.size)


def candidates(membership: Membership, lmq: str) -> tuple[int, ...]:
    """The slots that may hold ``lmq``, newest epoch first, each once; a single one needs no look-up."""
    if len(membership.sizes) == 1:
        return (owner(membership, lmq),)
    key = ring.key_of(lmq)
    out: list[int] = []
    for size in reversed(membership.sizes):
        slot = 0 if size == 1 else ring.jump(key, size)
        if slot not in out:
            out.append(slot)
    return tuple(out)


def resolve(membership: Membership, lmq: str, holds: Callable[[int], bool]) -> int:
    """Where a send to ``lmq`` goes: the newest candidate that holds it, else today's owner. ``holds`` is asked
    only about candidates other than today's owner, newest first. A leaving holder keeps the topic until it
    has drained it (it then sends the topic's new messages on to today's owner itself); a topic that today's
    owner holds as well has been handed over already, and ``holds(today)`` is asked only in that case."""
    found = candidates(membership, lmq)
    today = found[0]
    for slot in found[1:]:
        if holds(slot):
            if membership.leaving(slot) and holds(today):
                return today
            return slot
    return today


def subscribers_at(membership: Membership, lmq: str, owner: int) -> tuple[int, ...]:
    """Where a subscription to ``lmq`` (written to ``owner``) must be known: the owner, and today's owner too
    while the owner is leaving, so the topic's consumers are in place there before it is handed over."""
    if not membership.leaving(owner):
        return (owner,)
    today = ring.slot_of(lmq, membership.size)
    return (owner, today) if today != owner else (owner,)
