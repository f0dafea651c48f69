"""In-flight messages per (queue, group): leases, acks, redelivery and the commit point.

For every (queue, group) with messages out, ``QueueLeases`` remembers the committed offset (next offset
not yet acknowledged in order), the hand-out mark (one past the highest offset ever leased or settled), one
``Lease`` per message out, and the offsets settled above the commit point (acknowledged, or gone from the
store) as runs: a lost segment of millions of offsets is one run, never one object per offset, and the
commit point jumps over it in one step once the leases before it are settled.

Consumption of a lite topic, and of a normal queue by a FIFO group, is *ordered*: walking from the commit
point, delivery stops at the first message that is leased and still invisible, so no message is handed out
while an earlier one of the same queue is out (a nacked or expired one comes back first). Other groups read
normal topics unordered: leased messages are skipped and the window of in-flight messages is capped instead.
An MQTT session's group (``metadata.MQTT_GROUP_PREFIX``) reads its lite topics *pipelined*: in order, but
past messages still out (MQTT lets a topic's QoS 1 messages be in flight together, up to the client's
Receive Maximum, which the session bounds itself; they are written in order, and what was not acknowledged
when the connection ends is handed out again first).

Acks move the commit point over every acknowledged prefix; the dispatcher persists it together with the
offsets settled above it (``acked_above``, runs), so that after a restart ``seed`` settles those again and
only what was not acknowledged is delivered again. Leases themselves are not persisted, but what they imply
for delivery attempts is (``handouts``): the *delivered* mark (one past the highest offset ever leased) and
the attempts counted of the offsets whose count is not 1 (``counts``, kept up to date as leases come and go,
so that the persisted value costs nothing while every message goes out once). After a restart an offset below
the mark comes back with its count + 1: 2, unless ``counts`` says otherwise. A suspend counts no attempt: its
offset's count goes back by one until it is handed out again.

Auto-renew leases (push consumers: the client never extends a lease itself) carry a renewal deadline:
while their holder still holds the queue (registered, in the group, subscribed to the lite topic), ``due``
extends them a slice at a time, shortly before they expire, up to that deadline, keeping their receipt
handle. A lease whose holder is gone or unsubscribed, or that reached its deadline, expires as any other.

Receipt handles are opaque strings minted here and echoed back by clients:
``r2 <incarnation> <queue topic> <queue id> <offset> <lease id> <tag>`` (space is never valid in a queue
name). The tag is an HMAC-SHA256 (128 bits, hex) of the rest and of the consumer group, keyed by a secret
drawn per broker process: a handle cannot be forged from the sequential offsets and lease ids, nor used
with another group than the one it was handed to (either is INVALID_RECEIPT_HANDLE). The incarnation is
random per broker process too, so handles from before a restart are recognisably stale (leases do not
survive a restart; the message is delivered again from the committed offset). A genuine handle is good for
as long as its lease is the message's current one and has not expired (``current``): a consumer whose
invisible time ran out cannot settle, nack or dead-letter the message, and so never the delivery that came
after its own (INVALID_RECEIPT_HANDLE; docs/protocol.md, *Receipt handles*).
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import hmac
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple

from lmq_broker import errors, model
from lmq_broker.dispatch import metadata
from lmq_broker.storage import keys, ranges

RECEIPT_VERSION: Final = "r2"
RECEIPT_SECRET_BYTES: Final = 32
RECEIPT_TAG_BYTES: Final = 16
NORMAL_WINDOW: Final = 1024  # in-flight messages per (normal queue, group)
# Keys whose state ``drop`` forgot because replication stored another broker's commit point: remembered (with the
# lease id their handles came before) so that such a handle is refused rather than settle nothing (``ack``)
DROPPED_KEPT: Final = 100_000


@dataclass(frozen=True, slots=True)
class Receipt:
    incarnation: str
    topic: str
    queue: int
    offset: int
    lease_id: int

    def encode(self) -> str:
        return f"{RECEIPT_VERSION} {self.incarnation} {self.topic} {self.queue} {self.offset} {self.lease_id}"

    @staticmethod
    def decode(handle: str) -> Receipt:
        parts = handle.split(" ")
        if len(parts) != 6 or parts[0] != RECEIPT_VERSION:
            raise errors.InvalidReceiptHandle("malformed receipt handle")
        try:
            queue, offset, lease_id = int(parts[3]), int(parts[4]), int(parts[5])
        except ValueError:
            raise errors.InvalidReceiptHandle("malformed receipt handle") from None
        if not parts[1] or not parts[2] or queue < 0 or offset < 0 or lease_id < 0:
            raise errors.InvalidReceiptHandle("malformed receipt handle")
        return Receipt(parts[1], parts[2], queue, offset, lease_id)


@dataclass(slots=True)
class Lease:
    attempt: int  # delivery attempt of the latest hand-out, 1-based
    visible_at_ms: int
    lease_id: int
    holder: str = ""
    keep_attempt: bool = False  # set by a suspend: the next hand-out repeats the attempt number
    renew_until_ms: int = 0  # an auto-renew lease is extended while its holder holds the queue, up to this; 0: never
    message_id: str = ""  # of the message handed out: after an index rebuild, is its offset still that message?
    suspended_ms: int = 0  # suspended so far, over all hand-outs of the message by this process (see ``change``)


@dataclass(frozen=True, slots=True)
class Pick:
    offset: int
    attempt: int
    redelivery: bool
    suspended_ms: int = 0  # carried over from the lease before (a suspend cap, ``LeaseTable.change``)


@dataclass(slots=True)
class QueueLeases:
    """Offsets in [committed, handed) are each in one of three states: *leased* (an entry in ``entries``),
    *settled* (acknowledged, or gone from the store: in the runs ``_starts``/``_ends``, never one object per
    offset), or *pending* (neither: to be handed out again, e.g. out before a restart). Offsets from
    ``handed`` on were never handed out."""

    committed: int
    ordered: bool
    window: int  # max leases out at once (unordered queues)
    pipelined: bool = False  # ordered, but an earlier message out does not hold back the next (MQTT sessions)
    handed: int = -1
    entries: dict[int, Lease] = field(default_factory=dict)  # leases not acknowledged
    _starts: list[int] = field(default_factory=list)  # settled runs [start, end) above the commit point
    _ends: list[int] = field(default_factory=list)
    # After ``clip``/``drop_leases``: handles issued before lease id ``lost_before_lease`` for offsets at or
    # above ``lost_from`` or in ``lost_offsets`` name messages a rebuilt index lost; the offsets may hold
    # other messages now.
    lost_from: int = -1
    lost_offsets: set[int] = field(default_factory=set)
    lost_before_lease: int = 0
    delivered: int = -1  # one past the highest offset leased (``handed`` also counts offsets settled unseen)
    # Attempts counted so far of unsettled offsets below ``delivered`` whose count is not 1 (0: its only
    # hand-out was suspended): what ``handouts`` persists. Empty while every message goes out once.
    counts: dict[int, int] = field(default_factory=dict)
    # The lease table's next lease id when this state was opened: a handle with a lower lease id was issued by
    # an earlier state of the key (``predates``).
    first_lease: int = 0
    gone: bool = False  # its lite topic was deleted (``LeaseTable.drop_topic``): nothing of it is written again

    def __post_init__(self) -> None:
        self.handed = max(self.handed, self.committed)
        self.delivered = max(self.delivered, self.committed)

    def seed(self, acked: Sequence[int], handouts: model.Handouts = model.NO_HANDOUTS, end: int = -1) -> None:
        """After a restart: the offsets above the commit point that were acknowledged (or settled) before it,
        and what was handed out above it (``end``: the queue's end, when known; nothing at or above it was
        delivered). The acknowledged stay settled; the others below the hand-out mark were out and are handed
        out again at once, with their attempt counted on. O(runs + counts)."""
        for start, stop in ranges.OffsetRanges.of(acked).runs:
            self._settle(max(start, self.committed), stop)
        self._advance()
        mark = handouts.mark if end < 0 else min(handouts.mark, end)
        if mark > self.committed:
            self.delivered = max(self.delivered, mark)
            self.handed = max(self.handed, mark)
            for offset, count in handouts.counts:
                if self.committed <= offset < mark and count != 1 and not self.settled(offset):
                    self.counts[offset] = count

    def handouts(self) -> model.Handouts:
        """What to persist of the hand-outs (see ``model.Handouts``). O(1) while ``counts`` is empty; beyond
        ``keys.HANDOUTS_MAX_COUNTS`` counts only the lowest offsets' are kept: the others read as delivered
        once after a restart (attempt 2 next, however many attempts they had, or a suspended first one)."""
        committed, delivered = self.committed, self.delivered
        if delivered <= committed:
            return model.NO_HANDOUTS
        counts = self.counts
        if not counts:
            return model.Handouts(delivered)
        kept = sorted(item for item in counts.items() if committed <= item[0] < delivered)
        return model.Handouts(delivered, tuple(kept[: keys.HANDOUTS_MAX_COUNTS]))

    def count(self, offset: int, counted: int) -> None:
        """Offset ``offset`` has ``counted`` attempts counted now (a hand-out, a suspend, a nack)."""
        if counted == 1:
            if self.counts:
                self.counts.pop(offset, None)
        else:
            self.counts[offset] = counted

    def acked_above(self) -> ranges.OffsetRanges:
        """The settled offsets above the commit point, as runs (what ``seed`` takes back). O(runs)."""
        if not self._starts:
            return ranges.EMPTY
        return ranges.OffsetRanges(zip(self._starts, self._ends, strict=True))

    def settled(self, offset: int) -> bool:
        """Is ``offset`` (at or above the commit point) acknowledged or gone?"""
        i = bisect.bisect_right(self._starts, offset) - 1
        return i >= 0 and offset < self._ends[i]

    def settle_gone(self, lo: int, hi: int) -> bool:
        """Offsets [lo, hi) are gone from the store (damaged or lost records): settle them as if acknowledged,
        without handing them out, in O(log runs + leases). Offsets between ``handed`` and ``lo`` were not
        handed out yet and are still there: they stay pending. True when the commit point moved."""
        lo = max(lo, self.committed)
        if lo >= hi:
            return False
        if self.entries:
            for offset in [o for o in self.entries if lo <= o < hi]:
                del self.entries[offset]
        if self.counts:
            for offset in [o for o in self.counts if lo <= o < hi]:
                del self.counts[offset]
        self._settle(lo, hi)
        return self._advance()

    def _settle(self, lo: int, hi: int) -> None:
        """Add [lo, hi) to the settled runs, merging it with the runs it overlaps or touches."""
        if lo >= hi:
            return
        starts, ends = self._starts, self._ends
        i = bisect.bisect_left(ends, lo)  # first run ending at or after lo: touches or follows [lo, hi)
        j = bisect.bisect_right(starts, hi)  # runs before j start at or before hi
        if i < j:
            lo = min(lo, starts[i])
            hi = max(hi, ends[j - 1])
        starts[i:j] = [lo]
        ends[i:j] = [hi]
        self.handed = max(self.handed, hi)

    def picks(self, now_ms: int, limit: int) -> list[Pick]:
        """What to hand out next, up to ``limit``: redeliveries and pending offsets first (in offset order),
        then new offsets. Walks leases and pending offsets only, jumping over settled runs.

        New offsets may lie beyond the end of the queue; the caller leases only what the store returns.
        """
        out: list[Pick] = []
        if limit <= 0:
            return out
        entries, starts, ends = self.entries, self._starts, self._ends
        runs = len(starts)
        i = 0
        at, handed = self.committed, self.handed
        pending = 0
        while at < handed:
            if i < runs and starts[i] <= at:
                at = ends[i]
                i += 1
                continue
            stop = starts[i] if i < runs else handed
            while at < stop:
                lease = entries.get(at)
                if lease is None:  # pending: not out now (delivered before a restart when below ``delivered``)
                    counted = self.counts.get(at, 1) if at < self.delivered else 0
                    out.append(Pick(at, counted + 1, counted > 0))
                    pending += 1
                elif lease.visible_at_ms > now_ms:
                    if self.ordered and not self.pipelined:
                        return out
                else:
                    attempt = lease.attempt if lease.keep_attempt else lease.attempt + 1
                    out.append(Pick(at, attempt, lease.attempt > 0, lease.suspended_ms))
                at += 1
                if len(out) >= limit:
                    return out
        room = limit - len(out)
        if not self.ordered:  # the window counts leases actually out, not the span they lie in
            room = min(room, self.window - len(entries) - pending)
        out.extend(Pick(offset, 1, False) for offset in range(handed, handed + max(room, 0)))
        return out

    def lease(
        self,
        pick: Pick,
        now_ms: int,
        invisible_ms: int,
        lease_id: int,
        holder: str,
        *,
        renew_until_ms: int = 0,
        message_id: str = "",
    ) -> Lease:
        lease = Lease(pick.attempt, now_ms + invisible_ms, lease_id, holder, renew_until_ms=renew_until_ms,
                      message_id=message_id, suspended_ms=pick.suspended_ms)  # fmt: skip
        offset = pick.offset
        self.entries[offset] = lease
        if offset >= self.delivered:
            self.delivered = offset + 1
            if offset >= self.handed:
                self.handed = offset + 1
        if pick.attempt != 1 or self.counts:
            self.count(offset, pick.attempt)
        return lease

    def skip_to(self, offset: int) -> None:
        """The store no longer has offsets below ``offset`` (retention): forget them."""
        if offset <= self.committed:
            return
        for o in [o for o in self.entries if o < offset]:
            del self.entries[o]
        for o in [o for o in self.counts if o < offset]:
            del self.counts[o]
        starts, ends = self._starts, self._ends
        i = bisect.bisect_right(ends, offset)  # runs ending at or before offset are wholly below it
        del starts[:i], ends[:i]
        if starts and starts[0] < offset:
            starts[0] = offset
        self.committed = offset
        self.handed = max(self.handed, offset)
        self.delivered = max(self.delivered, offset)
        self._advance()

    def clip(self, end: int, next_lease_id: int) -> None:
        """The queue now ends at ``end`` (a rebuilt index lowered it): offsets from ``end`` on hold no message
        this state knows of; new messages will take them. Forget their leases and settlement, and refuse the
        handles of those leases (``lost``) from now on."""
        if end >= self.handed:
            return
        self.lost_from = end if self.lost_from < 0 else min(self.lost_from, end)
        self.lost_before_lease = next_lease_id
        for o in [o for o in self.entries if o >= end]:
            del self.entries[o]
        for o in [o for o in self.counts if o >= end]:
            del self.counts[o]
        starts, ends = self._starts, self._ends
        i = bisect.bisect_left(starts, end)  # runs from i start at or after end
        del starts[i:], ends[i:]
        if ends and ends[-1] > end:
            ends[-1] = end
        self.committed = min(self.committed, end)
        self.handed = max(end, self.committed)
        self.delivered = min(self.delivered, self.handed)

    def ack(self, offset: int) -> bool:
        """Settle a leased offset; True when the commit point moved."""
        if self.entries.pop(offset, None) is None:
            return False
        if self.counts:
            self.counts.pop(offset, None)
        self._settle(offset, offset + 1)
        return self._advance()

    def _advance(self) -> bool:
        """Move the commit point over the settled run at its head (one jump, however long the run)."""
        starts = self._starts
        if not starts or starts[0] > self.committed:
            return False
        self.committed = max(self.committed, self._ends[0])
        del starts[0], self._ends[0]
        return True

    def has_ready(self, now_ms: int, max_offset: int) -> bool:
        """Would ``picks`` hand something out now (given the queue ends at ``max_offset``)?"""
        for pick in self._open_offsets():
            lease = self.entries.get(pick)
            if lease is None or lease.visible_at_ms <= now_ms:
                return True  # pending, or expired
            if self.ordered and not self.pipelined:
                return False
        if not self.ordered and len(self.entries) >= self.window:
            return False
        return max_offset > self.handed

    def blocked(self, now_ms: int) -> bool:
        """Ordered queue with its head out and still invisible: a new arrival cannot be handed out yet."""
        if not self.ordered or self.pipelined:
            return False
        for offset in self._open_offsets():
            lease = self.entries.get(offset)
            return lease is not None and lease.visible_at_ms > now_ms
        return False

    def _open_offsets(self) -> Iterator[int]:
        """Offsets in [committed, handed) that are not settled, ascending (leased or pending)."""
        starts, ends = self._starts, self._ends
        at = self.committed
        for i in range(len(starts) + 1):
            stop = starts[i] if i < len(starts) else self.handed
            yield from range(at, stop)
            if i < len(starts):
                at = ends[i]

    def drop_leases(self, offsets: Sequence[int], next_lease_id: int) -> None:
        """The leases at ``offsets`` name messages the store no longer holds there (a rebuilt index): they
        become pending (the offset is handed out again, whatever it holds now) and their handles are refused."""
        for offset in offsets:
            if self.entries.pop(offset, None) is not None:
                self.lost_offsets.add(offset)
                self.counts[offset] = 0  # whatever it holds now was never delivered
        self.lost_before_lease = next_lease_id

    def rollback(self, committed: int, acked: Sequence[int]) -> None:
        """Settlement back to what was persisted (``committed`` at or below ours, ``acked`` above it): the
        acks the store refused (each answered with that error) are forgotten, their offsets pending again."""
        self.committed = min(self.committed, committed)
        self._starts.clear()
        self._ends.clear()
        for start, end in ranges.OffsetRanges.of(acked).runs:
            self._settle(max(start, self.committed), end)
        for offset in [o for o in self.entries if self.settled(o)]:
            del self.entries[offset]
        for offset in [o for o in self.counts if self.settled(o) or o < self.committed]:
            del self.counts[offset]
        self._advance()

    def lost(self, receipt: Receipt) -> bool:
        """Does ``receipt`` name a message that a rebuilt index lost (see ``clip``, ``drop_leases``)?"""
        if receipt.lease_id >= self.lost_before_lease:
            return False
        return 0 <= self.lost_from <= receipt.offset or receipt.offset in self.lost_offsets

    def predates(self, receipt: Receipt) -> bool:
        """Was ``receipt`` issued before this state was opened? Then its message was settled (a state is
        dropped once idle), its offsets were reset (OffsetOption), or its lite topic was deleted (a reclaim, an
        expiry) and re-created since: the offset may name another message now, which the handle must not settle."""
        return receipt.lease_id < self.first_lease

    @property
    def idle(self) -> bool:
        return self.committed >= self.handed


class LeaseKey(NamedTuple):
    """What lease state is kept per: one queue and one consumer group. A named tuple, as ``QueueId`` is: it keys
    the dicts and the expiry heap that every receive and ack looks up, and a tuple hashes and compares in C."""

    topic: str  # the queue's topic: an LMQ name for a lite topic
    queue: int
    group: str

    @property
    def queue_id(self) -> model.QueueId:
        return model.QueueId(self.topic, self.queue)


@dataclass(frozen=True, slots=True)
class Renewal:
    """How ``LeaseTable.due`` renews auto-renew leases: ``ahead_ms`` before one expires, if ``holds(holder,
    key)``, it is extended to ``slice_ms`` from now (never past its renewal deadline)."""

    slice_ms: int
    ahead_ms: int
    holds: Callable[[str, LeaseKey], bool]


class LeaseTable:
    def __init__(self, incarnation: str, window: int = NORMAL_WINDOW, secret: bytes | None = None) -> None:
        self.incarnation = incarnation
        self._secret = secret if secret is not None else secrets.token_bytes(RECEIPT_SECRET_BYTES)
        self.window = window
        self._states: dict[LeaseKey, QueueLeases] = {}
        self._expiries: list[tuple[int, int, LeaseKey]] = []
        self._seq = 0
        self._next_lease_id = 1
        self._dropped: dict[LeaseKey, int] = {}  # key -> the lease id its dropped state's handles came before

    def get(self, key: LeaseKey) -> QueueLeases | None:
        return self._states.get(key)

    def open(self, key: LeaseKey, committed: int, ordered: bool) -> QueueLeases:
        state = self._states.get(key)
        if state is None:
            pipelined = ordered and key.group.startswith(metadata.MQTT_GROUP_PREFIX)
            state = self._states[key] = QueueLeases(
                committed, ordered, self.window, pipelined, first_lease=self._next_lease_id
            )
        return state

    def release_if_idle(self, key: LeaseKey) -> None:
        state = self._states.get(key)
        if state is not None and state.idle:
            del self._states[key]

    def forget(self, key: LeaseKey) -> None:
        self._states.pop(key, None)

    def states(self) -> list[tuple[LeaseKey, QueueLeases]]:
        return list(self._states.items())

    @property
    def next_lease_id(self) -> int:
        return self._next_lease_id

    def drop_topic(self, topic: str) -> None:
        for key in [k for k in self._states if k.topic == topic]:
            self._states.pop(key).gone = True

    def drop(self, key: LeaseKey) -> None:
        """Forget ``key``'s state for good, as ``drop_topic`` does (whoever still holds it writes nothing of it):
        another broker's commit point of the key replaced it. A handle it issued is refused from then on (``ack``),
        unless its message is settled by then."""
        state = self._states.pop(key, None)
        if state is not None:
            state.gone = True
            if len(self._dropped) >= DROPPED_KEPT:
                self._dropped.clear()
            self._dropped[key] = self._next_lease_id

    def in_flight(self) -> int:
        return sum(len(s.entries) for s in self._states.values())

    def new_lease_id(self) -> int:
        lease_id = self._next_lease_id
        self._next_lease_id += 1
        return lease_id

    def receipt(self, key: LeaseKey, offset: int, lease_id: int) -> str:
        return self.seal(Receipt(self.incarnation, key.topic, key.queue, offset, lease_id), key.group)

    def seal(self, receipt: Receipt, group: str) -> str:
        """The handle of ``receipt`` for ``group``: its fields and their tag."""
        body = receipt.encode()
        return f"{body} {self._tag(body, group)}"

    def _tag(self, body: str, group: str) -> str:
        mac = hmac.digest(self._secret, f"{group}\n{body}".encode(), hashlib.sha256)
        return mac[:RECEIPT_TAG_BYTES].hex()

    def resolve(self, handle: str, group: str) -> tuple[Receipt, LeaseKey]:
        body, _, tag = handle.rpartition(" ")
        if not body or not hmac.compare_digest(tag.encode(), self._tag(body, group).encode()):
            if body.startswith(f"{RECEIPT_VERSION} ") and body.split(" ", 2)[1:2] != [self.incarnation]:
                raise errors.InvalidReceiptHandle("receipt handle from an earlier broker incarnation")
            raise errors.InvalidReceiptHandle(f"receipt handle was not handed out to group {group} by this broker")
        receipt = Receipt.decode(body)
        if receipt.incarnation != self.incarnation:
            raise errors.InvalidReceiptHandle("receipt handle from an earlier broker incarnation")
        return receipt, LeaseKey(receipt.topic, receipt.queue, group)

    def ack(self, key: LeaseKey, receipt: Receipt, now_ms: int, *, checked: bool = False) -> bool:
        """Acknowledge; True when the ack is news to persist (the commit point or the acknowledged set above it
        moved). Only the current lease of a message out settles it, and only before it expires (``current``):
        the handle of an earlier delivery (the message was delivered again, or its invisible time changed, since)
        or of a lease whose invisible time ran out is INVALID_RECEIPT_HANDLE, as RocketMQ's proxy answers an
        expired handle, and the message stays out to its current holder, or is delivered again. Acking a message
        settled already is accepted (nothing to do, whichever of its handles), and so is a handle issued before
        the key's state was opened, which settles nothing (its lite topic may have been deleted and re-created
        since, its offset naming another message: ``predates``). ``checked``: the caller found the handle current
        before it stored the message's dead letter, which settles it whatever happened to the lease meanwhile."""
        state = self._states.get(key)
        if receipt.lease_id < self._dropped.get(key, 0) and (
            state is None or not (receipt.offset < state.committed or state.settled(receipt.offset))
        ):
            # Issued by a state ``drop`` forgot (this broker held the queue's slot, lost it, and the holder's commit
            # point came since): nothing here says whether its message was acked there. Settling nothing and
            # answering OK would deliver it again after an OK; refused, it may come again (at-least-once).
            raise errors.InvalidReceiptHandle(
                "receipt handle from before this queue's slot moved to another broker: not settled here"
            )
        if state is None or receipt.offset < state.committed or state.predates(receipt):
            return False
        if receipt.offset >= state.handed:
            raise errors.InvalidReceiptHandle("receipt handle names a message that was never delivered")
        if state.lost(receipt):
            raise errors.InvalidReceiptHandle("receipt handle names a message lost when the store rebuilt its index")
        if receipt.offset not in state.entries:
            if state.settled(receipt.offset):
                return False  # settled already (acked, or gone)
            # pending again: its ack was refused by the store and forgotten after an index rebuild
            raise errors.InvalidReceiptHandle("receipt handle names a message that is no longer leased")
        if not checked:
            current(state, receipt, now_ms)
        state.ack(receipt.offset)
        return True

    def change(
        self,
        key: LeaseKey,
        receipt: Receipt,
        now_ms: int,
        invisible_ms: int,
        suspend: bool,
        *,
        max_suspend_ms: int = -1,
    ) -> tuple[Receipt, Lease]:
        """Re-lease a message for ``invisible_ms`` (a nack when short). Only the current lease may do it.

        A suspend counts no attempt, so a message suspended again and again would never reach the DLQ: its
        suspended time adds up, and once the total passes ``max_suspend_ms`` (-1: no cap) the lease ends at
        once and ``over_suspend_cap`` marks its next hand-out as a dead letter."""
        state = self._states.get(key)
        if state is None:
            raise errors.InvalidReceiptHandle("receipt handle is no longer the current lease of the message")
        lease = current(state, receipt, now_ms)
        lease.lease_id = self.new_lease_id()
        lease.visible_at_ms = now_ms + invisible_ms
        if suspend:
            lease.suspended_ms += invisible_ms
            if over_suspend_cap(lease.suspended_ms, max_suspend_ms):
                lease.visible_at_ms = now_ms
        lease.keep_attempt = suspend
        state.count(receipt.offset, lease.attempt - 1 if suspend else lease.attempt)
        lease.renew_until_ms = 0  # the client chose the invisible time: no longer renewed for it
        self.watch(key, lease.visible_at_ms)
        return Receipt(self.incarnation, key.topic, key.queue, receipt.offset, lease.lease_id), lease

    # --- expiry -----------------------------------------------------------------------------------------
    def watch(self, key: LeaseKey, visible_at_ms: int) -> None:
        """Report ``key`` from ``due`` once ``visible_at_ms`` has passed (one entry per lease batch)."""
        self._seq += 1
        heapq.heappush(self._expiries, (visible_at_ms, self._seq, key))

    def due(self, now_ms: int, renewal: Renewal | None = None) -> list[LeaseKey]:
        """Keys whose leases have expired with something still unacknowledged, each once. With ``renewal``,
        auto-renew leases about to expire whose holder still holds the queue are extended first (see ``Renewal``)."""
        keys: dict[LeaseKey, None] = {}
        seen: set[LeaseKey] = set()
        while self._expiries and self._expiries[0][0] <= now_ms:
            _, _, key = heapq.heappop(self._expiries)
            if key in seen:
                continue
            seen.add(key)
            state = self._states.get(key)
            if state is None:
                continue
            if renewal is not None:
                self._renew(key, state, now_ms, renewal)
            if _has_expired(state, now_ms):
                keys[key] = None
        return list(keys)

    def _renew(self, key: LeaseKey, state: QueueLeases, now_ms: int, renewal: Renewal) -> None:
        again: set[int] = set()  # one watch per time, not per lease: a receive leases up to a batch at once
        for lease in state.entries.values():
            if lease.renew_until_ms <= lease.visible_at_ms:
                continue  # not renewable, or renewed up to its deadline already: it expires when it is due
            if lease.visible_at_ms - renewal.ahead_ms > now_ms:
                continue  # another lease of the key brought us here early; its own watch comes later
            if not renewal.holds(lease.holder, key):
                again.add(lease.visible_at_ms)  # the holder no longer holds the queue: it expires on time
                continue
            lease.visible_at_ms = max(lease.visible_at_ms, min(now_ms + renewal.slice_ms, lease.renew_until_ms))
            again.add(self.watch_at(lease, renewal.ahead_ms))
        for at in again:
            self.watch(key, at)

    @staticmethod
    def watch_at(lease: Lease, ahead_ms: int) -> int:
        """When to look at a lease again: ahead of its expiry while it can still be renewed, else at it."""
        return watch_time(lease.visible_at_ms, lease.renew_until_ms, ahead_ms)

    def next_expiry_ms(self) -> int | None:
        return self._expiries[0][0] if self._expiries else None


def current(state: QueueLeases, receipt: Receipt, now_ms: int) -> Lease:
    """The lease ``receipt`` names, if it is the message's current lease and has not expired: only such a handle
    acknowledges, changes the invisible time of, or dead-letters a message (``errors.InvalidReceiptHandle``
    otherwise). A handle is superseded when the message was handed out again (to any consumer of the group) or its
    invisible time was changed: settling it would settle the newer delivery, which its holder still works on. An
    expired lease's message is due to be delivered again (RocketMQ's proxy refuses a handle past its invisible
    time likewise, redelivered or not); an auto-renew lease does not expire while it is renewed."""
    lease = state.entries.get(receipt.offset)
    if lease is None or lease.lease_id != receipt.lease_id:
        raise errors.InvalidReceiptHandle(
            "receipt handle is no longer the current lease of the message: it was delivered again, or its "
            "invisible time changed, since this handle was issued"
        )
    if lease.visible_at_ms <= now_ms:
        raise errors.InvalidReceiptHandle(
            "receipt handle is expired: the message's invisible time ran out, and it is delivered again"
        )
    return lease


def watch_time(visible_at_ms: int, renew_until_ms: int, ahead_ms: int) -> int:
    """When to look at a lease visible again at ``visible_at_ms`` (``LeaseTable.watch_at``)."""
    return visible_at_ms - ahead_ms if renew_until_ms > visible_at_ms else visible_at_ms


def over_suspend_cap(suspended_ms: int, max_suspend_ms: int) -> bool:
    return 0 <= max_suspend_ms < suspended_ms


def _has_expired(state: QueueLeases, now_ms: int) -> bool:
    return any(lease.visible_at_ms <= now_ms for lease in state.entries.values())
