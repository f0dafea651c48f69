"""The owner's end of a slot's copies: it ships each stored batch to its followers (``shipping``, in order) and
acknowledges once enough of them stored it, keeping the slot's in-sync set in its lease (``insync``); the
follower's end: ``following``.

With --min-insync-replicas M > 1 a send is acknowledged once it is stored here and on every member of the
in-sync set (members that failed are removed from the set first, the lease written), and the set counting
this broker has at least M members. With M = 1 the batch is queued for each follower and the send answered at
once: no future, no waiting (asynchronous replication).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterable, Sequence
from typing import Final

from prometheus_client import CollectorRegistry, Counter

from lmq_broker import errors, model
from lmq_broker.replication import insync, shipping, wire
from lmq_broker.replication.leadership import Leadership

log = logging.getLogger(__name__)

Send = shipping.Send
Read = shipping.Read
Tails = shipping.Tails
Points = shipping.Points
ACK_TIMEOUT_S: Final = 3.0  # a send waits this long at most for its copies (then refused, retriable)
LMQ_PREFIX: Final = model.LMQ_PREFIX
_STORED, _PENDING, _FAILED = "stored", "pending", "failed"  # a follower's state for a send's batches (``_state``)
as_new = shipping.as_new


class Counters:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.refused = Counter(
            "lmq_replication_refused",
            "Sends, settlements and hand-outs refused (fenced, fenced_receive: lease not held; insync: too few "
            "replicas stored it)",
            ["reason"],
            registry=registry,
        )
        self.copies_refused = Counter(
            "lmq_replication_copies_refused",
            "Copies a follower refused (stale_epoch, owner: it holds the slot, out_of_sync, state_gap: rows missed, "
            "not_peer: no valid peer header; crowded: a copy socket connection closed at once, 64 others still to "
            "say their hello)",
            ["reason"],
            registry=registry,
        )
        self.dropped = Counter(
            "lmq_replication_copies_dropped",
            "Messages not queued for a follower whose queue was full (--replica-queue-messages): it leaves the "
            "in-sync set and catches up",
            registry=registry,
        )
        self.commits_stored = Counter(
            "lmq_replication_commits_stored",
            "Commit points this broker stored from its slots' owners (handouts: yes when with delivery attempts)",
            ["handouts"],
            registry=registry,
        )

    def ack_refused(self, error: BaseException) -> None:
        """An ack refused because the commit copy it waited for failed (``dispatch.settlement`` tells): counted
        once per ack, where the client is refused, never for a commit copy nobody waited on (a hand-out write
        whose copy the fence outlasted refused no client)."""
        if isinstance(error, errors.Fenced):
            self.refused.labels("fenced").inc()
        elif isinstance(error, errors.NotEnoughReplicas):
            self.refused.labels("insync").inc()


class Owner:
    """The copies of one slot this broker holds the lease of."""

    def __init__(  # noqa: PLR0913, PLR0917 (the owner's slot, its followers, its rules and its doors)
        self,
        leadership: Leadership,
        slot: int,
        followers: dict[int, str],
        min_insync: int,
        doors: tuple[Send, Read, Tails, Points],
        counters: Counters,
        *,
        queue_messages: int = shipping.QUEUE_MESSAGES,
        probe_interval_s: float = 1.0,
        lag_max_s: float = 0.0,
    ) -> None:
        self._leadership = leadership
        self._lag_max_s = lag_max_s  # --replica-lag-max-ms: a member holding a send back longer leaves (0: never)
        self._slot = slot
        self._min_insync = min_insync
        self._need = min_insync - 1  # followers that must store a commit point before its ack is answered
        self._counters = counters
        send, read, tails, points = doors
        self.keeper = keeper = insync.Keeper(leadership, slot, min_insync)
        self._lock = asyncio.Lock()  # commit copies, one send at a time (a flush's, a probe's)
        shipper_doors = shipping.Doors(
            send,
            read,
            tails,
            lambda: leadership.epoch(slot),
            keeper.changed,
            keeper.wants_probe,
            counters.dropped.inc,
            points,
            self._lock,
        )
        self._shipping = (shipper_doors, queue_messages, probe_interval_s)
        self._followers: dict[int, str] = {}  # ring slot → endpoint
        self.follow(followers)
        self._send = send
        self._commits: dict[tuple[model.QueueId, str], wire.Commit] = {}  # the newest per key, not sent yet
        self._awaited: list[asyncio.Future[None]] = []  # the acks waiting for the commits in ``_commits``
        self._flushing: asyncio.Task[None] | None = None
        # (epoch, in-sync set) a release sends what is still queued under, the lease no longer held (``drain``)
        self._releasing: tuple[int, tuple[int, ...]] | None = None

    def follow(self, followers: dict[int, str]) -> None:
        """Copy to ``followers`` too (a ring change: ``replicas.sets_of``). A new follower is outside the in-sync
        set: it gets every batch from now on and is probed; a send waits for it only once it joined the set (as
        for a follower back from a restart). None is removed here (that is step 4 of a ring change)."""
        doors, cap, probe_interval_s = self._shipping
        for f, endpoint in followers.items():
            if f not in self.keeper.shippers:
                self.keeper.shippers[f] = shipping.Shipper(f, endpoint, self._slot, doors, cap, probe_interval_s)
                self._followers[f] = endpoint

    @property
    def followers(self) -> dict[int, str]:
        return dict(self._followers)

    async def unfollow(self, gone: Iterable[int]) -> None:
        """Copy to ``gone`` no more: replicas the ring no longer names (step 4 of a ring change). Only those out
        of the in-sync set and not joining it: the holder wrote the set without them first, so no send or ack
        waits for them; a member is kept (asked again at the next tick)."""
        keeper = self.keeper
        keep = {*keeper.recorded(), *keeper.joining}
        closing = []
        for f in [f for f in gone if f not in keep]:
            self._followers.pop(f, None)
            shipper = keeper.shippers.pop(f, None)
            if shipper is not None:
                closing.append(shipper.close())
        await asyncio.gather(*closing)

    def lag(self) -> list[tuple[str, int]]:
        """(follower endpoint, messages it has not confirmed) per follower."""
        return [(s.endpoint, s.pending) for s in self.keeper.shippers.values()]

    def admit(self) -> None:
        if self._leadership.epoch(self._slot) is None:
            self._counters.refused.labels("fenced").inc()
            raise errors.Fenced(
                f"this broker does not hold the lease of slot {self._slot} now: nothing acknowledged, try again"
            )

    def hands_out(self) -> bool:
        if self._leadership.epoch(self._slot) is not None:
            return True
        self._counters.refused.labels("fenced_receive").inc()
        return False

    async def copy(self, messages: Sequence[model.NewMessage], results: list[model.AppendResult]) -> None:
        epoch = self._leadership.epoch(self._slot)
        if epoch is None:
            self.admit()
            return
        shippers = self.keeper.shippers
        seqs = {f: s.put(epoch, messages, results) for f, s in shippers.items()}
        if self._min_insync > 1:
            await self._acknowledged(seqs)
        if self._leadership.epoch(self._slot) != epoch:
            self.admit()

    async def _acknowledged(self, seqs: dict[int, int]) -> None:
        """Return once every member of the in-sync set (and every follower joining it) answered for these
        batches, those that failed removed from the set in the lease, and at least M members hold them."""
        keeper, me, need = self.keeper, self._leadership.me, self._min_insync
        deadline = time.monotonic() + ACK_TIMEOUT_S
        lag_at = deadline - ACK_TIMEOUT_S + self._lag_max_s if self._lag_max_s > 0 else math.inf
        while True:
            awaited = keeper.awaited()
            members = [f for f in keeper.recorded() if f != me]
            stored = 1 + sum(1 for f in members if self._state(f, seqs) is _STORED)
            failed = [f for f in awaited if self._state(f, seqs) is _FAILED]
            if failed:
                if not await keeper.shrink(failed):  # below M (they stay), or the lease could not be written
                    self._refuse(f"{stored} of {need} stored it (in sync: {[me, *members]}; failed: {failed})")
                continue
            pending = [f for f in awaited if self._state(f, seqs) is not _STORED]
            if not pending and stored >= need:
                return
            now = time.monotonic()
            if stored >= need and now >= lag_at:  # M hold it, the others over the lag budget: they leave the set
                lag_at = math.inf  # once per send (a lease that could not be written: the deadline decides)
                await keeper.shrink(pending)
                continue
            if now >= deadline or (not pending and not self._may_grow(seqs)):
                waiting = f"; no answer yet from {pending}" if pending else ""
                self._refuse(f"{stored} of {need} stored it (in sync: {[me, *members]}{waiting})")
            if now >= lag_at:  # over the budget with fewer than M: any answer may make M
                await keeper.wait(deadline - now)
            else:
                await keeper.wait(min(deadline, lag_at) - now, (pending[0], seqs[pending[0]]) if pending else None)

    def _state(self, f: int, seqs: dict[int, int]) -> str:
        """Where follower ``f`` is with the batches numbered ``seqs``. A follower this slot no longer copies to
        (``unfollow``: the set was narrowed meanwhile, or a lease write from an older set named it again) stores
        nothing: failed. One not numbered for them was followed after they were stored (``follow``, a ring
        change): a probe that reached it since began after they were stored, so it holds them once one did and
        nothing failed there since (``Shipper.complete``); without one it failed (the set keeps no member that
        cannot have them)."""
        shipper = self.keeper.shippers.get(f)
        if shipper is None:
            return _FAILED
        n = seqs.get(f)
        if n is None:
            return _STORED if shipper.complete() else _FAILED
        if shipper.lost(n):
            return _FAILED
        return _STORED if shipper.stored(n) else _PENDING

    def _may_grow(self, seqs: dict[int, int]) -> bool:
        """A follower outside the set may still join in time: one is joining, or has not answered for these
        batches yet, or answered lately (a probe follows). A follower that is down is none of these: refused
        at once rather than after the timeout."""
        keeper, members = self.keeper, set(self.keeper.recorded())
        outside = [s for f, s in keeper.shippers.items() if f not in members]
        return bool(keeper.joining) or any(s.hopeful() or self._state(s.follower, seqs) is _PENDING for s in outside)

    def _refuse(self, why: str) -> None:
        self._counters.refused.labels("insync").inc()
        raise errors.NotEnoughReplicas(f"not enough in-sync replicas of slot {self._slot}: {why}; try again")

    def note_commit(self, commit: wire.Commit) -> asyncio.Future[None] | None:
        """A commit point persisted here: sent to the followers soon, coalesced per key, one flush at a time
        (so a key's commits never arrive out of order). The future is done once, as for a send, every member of
        the in-sync set stored it (those that failed recorded out first) and at least M did, or failed
        (``errors.NotEnoughReplicas``, ``errors.Fenced``): the ack waits for it, so a follower that takes over
        never delivers again what was acked. None when no follower is needed (asynchronous: after a failover a
        consumer may get again what it acked just before)."""
        self._commits[(commit.queue, commit.group)] = commit
        future: asyncio.Future[None] | None = None
        if self._need:
            future = asyncio.get_running_loop().create_future()
            future.add_done_callback(_observed)
            self._awaited.append(future)
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush(), name=f"lmq-commits-{self._slot}")
        return future

    async def _flush(self) -> None:
        awaited: list[asyncio.Future[None]] = []
        try:
            while self._commits:
                epoch = self._epoch()
                batch, self._commits = list(self._commits.values()), {}
                awaited, self._awaited = self._awaited, []
                if epoch is None:  # fenced: the new owner's commits count
                    _settle(awaited, self._fenced())
                    return
                data = wire.encode(self._slot, epoch, [], [], batch)
                followers = dict(self._followers)  # as now: ``follow`` may add one meanwhile
                awaited_by = self._awaited_by()  # members and those joining: their copies are waited for
                seqs = {f: s.seq for f, s in self.keeper.shippers.items() if f in awaited_by}
                await self._shipped(seqs)
                async with self._lock:
                    answers = await asyncio.gather(
                        *(self._send(e, data) for e in followers.values()), return_exceptions=True
                    )
                answered = {f: self._unless_lost(f, a, seqs) for f, a in zip(followers, answers, strict=True)}
                if awaited:
                    _settle(awaited, await self._commits_held(epoch, answered))
                self._missed(answered)  # after: a member that failed was recorded out by now, or stays
        finally:
            _settle(awaited, errors.BrokerUnavailable("the broker is stopping: try again"))
            self._flushing = None

    async def _shipped(self, seqs: dict[int, int]) -> None:
        """Until every member (and follower joining) answered for the batches numbered before these commits (or
        the timeout): a commit copy that overtook its messages would be clamped to the follower's end
        (``following``). One outside the set answers a clamped commit with its ends: it is probed again."""
        keeper, deadline = self.keeper, time.monotonic() + ACK_TIMEOUT_S
        while (
            behind := [(f, n) for f, n in seqs.items() if f in keeper.shippers and keeper.shippers[f].done < n]
        ) and (left := deadline - time.monotonic()) > 0:
            await keeper.wait(left, behind[0])

    def _unless_lost(
        self, f: int, answer: dict[str, int] | BaseException, seqs: dict[int, int]
    ) -> dict[str, int] | BaseException:
        """A follower that did not store the messages before a commit holds no more than its end of them."""
        if answer:  # ends: a commit point past them was clamped there
            return errors.BrokerUnavailable(f"follower {f} lacks messages the commit points count: {answer}")
        shipper, n = self.keeper.shippers.get(f), seqs.get(f, 0)
        if isinstance(answer, BaseException) or n == 0 or shipper is None or shipper.holds(n):
            return answer
        return errors.BrokerUnavailable(f"follower {f} did not store the messages the commit points count")

    def _missed(self, answers: dict[int, dict[str, int] | BaseException]) -> None:
        """A follower outside the set that did not store a commit copy must not join it (nor stay joining)
        without a new probe: it would take the slot over with a commit point lower than one acknowledged
        meanwhile. (A member that failed stays only when the set would go below M: the ack was refused.)"""
        members = set(self.keeper.recorded())
        for f, answer in answers.items():
            shipper = self.keeper.shippers.get(f)
            if isinstance(answer, BaseException) and shipper is not None and f not in members:
                shipper.missed()
                self.keeper.changed(shipper)

    async def _commits_held(
        self, epoch: int, answers: dict[int, dict[str, int] | BaseException]
    ) -> errors.LmqError | None:
        """None when the acks of a flush may be answered: every member of the in-sync set stored its commit
        points (any member may take the slot over: one without them would deliver the acked messages again),
        those that failed removed from the set first (as a send's), at least M members counted, and the lease
        still held; else why not."""
        me, ok = self._leadership.me, answers
        failed = [f for f in self.keeper.recorded() if f != me and (f not in ok or isinstance(ok[f], BaseException))]
        kept = bool(failed) and not await self.keeper.shrink(failed)  # below M (they stay), or lease not written
        failed_to = f"; failed: {failed}" if kept else ""
        members = [f for f in self.keeper.recorded() if f != me]
        stored = sum(1 for f in members if f in ok and not isinstance(ok[f], BaseException))
        if self._epoch() != epoch:
            return self._fenced()
        if failed_to or stored < self._need:
            return errors.NotEnoughReplicas(
                f"not enough in-sync replicas of slot {self._slot} stored the ack: {stored + 1} of "
                f"{self._need + 1} (in sync: {[me, *members]}{failed_to}); try again"
            )
        return None

    def _epoch(self) -> int | None:
        """The epoch commit copies go under: the lease's while held; while a release drains (``drain``), the
        released one (the fence is closed: no ack waits, the copies go to the taker)."""
        epoch = self._leadership.epoch(self._slot)
        if epoch is None and self._releasing is not None:
            return self._releasing[0]
        return epoch

    def _awaited_by(self) -> list[int]:
        """The followers a commit flush waits for (their batches before its commits): ``Keeper.awaited``; while a
        release drains, the members of the set the lease was released with."""
        if self._releasing is None or self._leadership.holds(self._slot):
            return self.keeper.awaited()
        return [f for f in self._releasing[1] if f != self._leadership.me]

    async def drain(self, epoch: int, members: Iterable[int], timeout_s: float) -> bool:
        """Before a release writes the lease (``Leadership.release``; the fence is closed by then, and the set
        ``members`` is the lease's): send what is still queued for them under ``epoch``, every batch numbered so
        far, then the commit points noted so far (at --min-insync-replicas 1 nobody waited for them: a taker
        without them would lose acknowledged sends, or deliver acked messages again). Until each member answered,
        or ``timeout_s``; True when every member holds them all. The shippers go on under their batches' epoch
        by themselves; the commit flush takes ``epoch`` meanwhile (``_epoch``)."""
        deadline = time.monotonic() + timeout_s
        keeper, me, named = self.keeper, self._leadership.me, tuple(members)
        seqs = {f: keeper.shippers[f].seq for f in named if f != me and f in keeper.shippers}
        self._releasing = (epoch, named)
        try:
            while (
                behind := [(f, n) for f, n in seqs.items() if f in keeper.shippers and keeper.shippers[f].done < n]
            ) and (left := deadline - time.monotonic()) > 0:
                await keeper.wait(left, behind[0])  # the batches first: a commit point never overtakes its messages
            while (flushing := self._flushing) is not None and (left := deadline - time.monotonic()) > 0:
                await asyncio.wait([flushing], timeout=left)
        finally:
            self._releasing = None
        copied = self._flushing is None and not self._commits
        return copied and all(f in keeper.shippers and keeper.shippers[f].holds(n) for f, n in seqs.items())

    def _fenced(self) -> errors.LmqError:
        """A commit copy's refusal: counted by the ack it refuses (``Counters.ack_refused``), if one waits."""
        return errors.Fenced(f"this broker does not hold the lease of slot {self._slot} now: try again")

    async def close(self) -> None:
        if self._flushing is not None:
            self._flushing.cancel()
        _settle(self._awaited, errors.BrokerUnavailable("the broker is stopping: try again"))
        await asyncio.gather(*(s.close() for s in self.keeper.shippers.values()))
        await self.keeper.close()


def _observed(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


def _settle(futures: list[asyncio.Future[None]], error: BaseException | None) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None) if error is None else future.set_exception(error)


def first_offsets(copy: wire.Copy) -> dict[model.QueueId, int]:
    """Each lite topic queue of the copy and the owner's first offset in it."""
    out: dict[model.QueueId, int] = {}
    for message, offsets in zip(copy.messages, copy.offsets, strict=True):
        for queue, offset in zip(message.queues, offsets, strict=True):
            if queue.topic.startswith(LMQ_PREFIX) and queue not in out:
                out[queue] = offset
    return out
