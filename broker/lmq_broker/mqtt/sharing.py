"""One session's shared subscriptions (``shares``): joining and leaving shares, the caps, the delivery loop
of each membership, and what a persistent session stores of them.

The connection keeps the packets (SUBACK codes, UNSUBACK codes, PUBLISH writing, PUBACKs): this module
answers with a code per filter and runs one loop per membership through ``Consume``, the connection's delivery
loop given the member, so shared deliveries share the connection's in-flight window and packet ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any, Final

from lmq_broker import errors, model
from lmq_broker.dispatch import metadata
from lmq_broker.dispatch.dispatcher import Dispatcher
from lmq_broker.mqtt import codec, matching, shares, stats, topics
from lmq_broker.mqtt.properties import Reason

log = logging.getLogger(__name__)

FAILURE_3_1_1: Final = codec.SUBACK_FAILURE

Consume = Callable[[shares.Member], Coroutine[Any, Any, None]]


class Sharing:
    def __init__(
        self,
        dispatcher: Dispatcher,
        members: shares.Members,
        stats_: stats.Stats,
        max_shares: int,
        consume: Consume,
        *,
        client_id: str = "",
        session_group: str = "",
        v5: bool = False,
    ) -> None:
        self.dispatcher = dispatcher
        self.members = members
        self.stats = stats_
        self.max_shares = max_shares
        self.consume = consume
        self.client_id = client_id  # these three: set by the connection once its CONNECT is read
        self.session_group = session_group
        self.v5 = v5
        self.held: dict[str, shares.Member] = {}  # share group -> this session's membership
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def _refused(self, text: str, why: str, code: int) -> int:
        self.stats.refusals.refused(self.client_id, "SUBSCRIBE", text, why, f"SUBACK {code:#04x}")
        return code

    def _member(self, text: str, options: int, snap: metadata.Metadata) -> shares.Member:
        share = shares.parse(text)
        parent, levels = topics.subscription_of(share.filter)
        snap.lite_parent(parent)
        consumer = shares.consumer_of(share.group, parent, self.session_group)
        return shares.Member(share, parent, levels, options, consumer)

    async def subscribe(self, text: str, options: int, snap: metadata.Metadata, *, alone: bool) -> int:
        """Join (or update) the share ``text`` names: the SUBACK code for it (the granted QoS, or a refusal).
        ``alone``: this broker is not in a cluster (shares are served by one broker only)."""
        invalid = Reason.TOPIC_FILTER_INVALID if self.v5 else FAILURE_3_1_1
        try:
            member = self._member(text, options, snap)
        except (shares.ShareError, topics.TopicError, errors.LmqError) as exc:
            return self._refused(text, str(exc), invalid)
        if not alone:
            code = Reason.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED if self.v5 else FAILURE_3_1_1
            return self._refused(text, "shared subscriptions are served by a broker outside a cluster", code)
        held = self.held.get(member.group)
        if held is not None:  # the same share again: new options (QoS, identifier), same membership
            self.held[member.group] = replace(held, options=options)
            return options & codec.OPTION_QOS
        quota = Reason.QUOTA_EXCEEDED if self.v5 else FAILURE_3_1_1
        if len(self.held) >= self.max_shares:
            self.stats.refused[stats.SHARES_PER_CLIENT] += 1
            return self._refused(text, f"{self.max_shares} shares held (--mqtt-max-shares-per-client)", quota)
        if not self.members.join(member.group, self.client_id):
            self.stats.refused[stats.SHARE_MEMBERS] += 1
            why = f"{self.members.max_members} members (--mqtt-max-share-members)"
            return self._refused(text, why, quota)
        try:
            if self.members.count(member.group) == 1:  # a share nobody here reads: it starts at the ends
                await self._start_at_end(member)
            await self._register(member)
        except errors.LmqError as exc:
            self.members.leave(member.group, self.client_id)
            log.warning("mqtt client %s: shared subscription %s refused: %s", self.client_id, text, exc.message)
            return Reason.UNSPECIFIED_ERROR if self.v5 else FAILURE_3_1_1
        return options & codec.OPTION_QOS

    async def _start_at_end(self, member: shares.Member) -> None:
        dispatcher = self.dispatcher

        async def scan(parent: str, start_after: str, end_before: str, limit: int) -> list[model.LiteTopicMeta]:
            return await dispatcher.run(dispatcher.store.scan_lite_topics, parent, start_after, end_before, limit)

        await matching.start_at_end(scan, dispatcher.reset_offsets, member.group, member.parent, [member.levels], [])

    async def _register(self, member: shares.Member) -> None:
        await self.dispatcher.subscribe_filters(member.consumer, member.group, member.parent, [member.levels])
        self.held[member.group] = member
        if member.group not in self._tasks:
            self._tasks[member.group] = asyncio.get_running_loop().create_task(self.consume(member))

    async def reregister(self, group: str) -> None:
        """The member's registration expired meanwhile (a stalled event loop): made again."""
        member = self.held.get(group)
        if member is not None:
            await self.dispatcher.subscribe_filters(member.consumer, member.group, member.parent, [member.levels])

    async def unsubscribe(self, text: str) -> int:
        """Leave the share ``text`` names: the 5.0 UNSUBACK code."""
        try:
            share = shares.parse(text)
        except shares.ShareError:
            return Reason.TOPIC_FILTER_INVALID
        member = self.held.pop(share.group, None)
        if member is None:
            return Reason.NO_SUBSCRIPTION_EXISTED
        await self._leave(member)
        return Reason.SUCCESS

    async def _leave(self, member: shares.Member) -> None:
        task = self._tasks.pop(member.group, None)
        if task is not None:
            await stop_task(task)
        with contextlib.suppress(errors.LmqError):
            await self.dispatcher.subscribe_filters(member.consumer, member.group, member.parent, [])
        self.dispatcher.client_gone(member.consumer)
        self.members.leave(member.group, self.client_id)

    async def restore(self, text: str, options: int, snap: metadata.Metadata) -> None:
        """A persistent session's stored share, joined again at its group's offsets (no start at the end)."""
        try:
            member = self._member(text, options, snap)
        except (shares.ShareError, topics.TopicError, errors.LmqError) as exc:
            log.info("mqtt client %s: stored shared subscription %s dropped: %s", self.client_id, text, exc)
            return
        if not self.members.join(member.group, self.client_id):
            self.stats.refused[stats.SHARE_MEMBERS] += 1
            log.info("mqtt client %s: stored shared subscription %s over --mqtt-max-share-members", self.client_id,
                     text)  # fmt: skip
            return
        await self._register(member)

    def saved(self) -> dict[str, int]:
        """What a persistent session stores of its shares: filter text -> options (identifier included)."""
        return {m.share.text: m.options for m in self.held.values()}

    async def filters_for(self, member: shares.Member, receipts: list[str]) -> dict[tuple[str, ...], int] | None:
        """The filter (-> options) the share's deliveries to ``member`` are written for; None when the session
        left the share since they were leased: they are given back to its group for another member then."""
        current = self.held.get(member.group)
        if current is not None:
            return {current.levels: current.options}
        for receipt in receipts:
            with contextlib.suppress(errors.LmqError):
                await self.dispatcher.change_invisible(member.group, receipt, 0)
        return None

    async def stop(self) -> None:
        """The connection ends: no more deliveries (its leases are given back by the connection)."""
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            await stop_task(task)

    async def end(self) -> None:
        """The connection ended: every membership left here (a persistent session keeps them stored)."""
        await self.stop()
        for member in list(self.held.values()):
            await self._leave(member)
        self.held.clear()


async def stop_task(task: asyncio.Task[None]) -> None:
    """Cancel a delivery loop and wait for its end, cancelling again while it runs (in Python 3.11 a
    ``wait_for`` that completes as the cancellation arrives swallows it); its own failure is its end."""
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=0.1)
    with contextlib.suppress(asyncio.CancelledError, Exception):
        task.result()
