"""One session's shared subscriptions (``shares``): joining and leaving shares, the caps, the delivery loop of
each membership, and what a persistent session stores of them.

``subscribing`` keeps the packets (a SUBACK or UNSUBACK code per filter comes from here); each membership has
one part per parent its filter reaches, each running ``Deliveries.consume`` for its share's group with its own
dispatcher client (``Membership``; in a cluster a client at every broker too, ``Owners.subscribe``), so shared
deliveries share the connection's in-flight window and packet ids, and a membership's unacknowledged
deliveries go back to its share when the connection ends (``Deliveries.give_back``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace

from lmq_broker import errors, model
from lmq_broker.dispatch import metadata, wildcards
from lmq_broker.mqtt import codec, held, matching, shares, stats, topics
from lmq_broker.mqtt.delivering import Deliveries
from lmq_broker.mqtt.link import Link, stop
from lmq_broker.mqtt.owners import Owners
from lmq_broker.mqtt.properties import Reason

log = logging.getLogger(__name__)


class Membership:
    """One membership's part in one parent as its delivery loop sees it (``delivering.Share``): the share's
    current filter there, and its registration made again if it expired."""

    def __init__(self, sharing: Sharing, member: shares.Member) -> None:
        self.sharing = sharing
        self.consumer = member.consumer
        self.group = member.group

    async def register(self, parent: str) -> None:
        await self.sharing.reregister(self.group, self.consumer)

    async def follow(self, cluster: Owners, parent: str) -> None:
        await self.sharing.follow(cluster, self.group, self.consumer)

    async def filters(self, receipts: list[str]) -> dict[wildcards.Filter, int] | None:
        return await self.sharing.filters_for(self.group, self.consumer, receipts)


class Sharing:
    def __init__(self, link: Link, deliveries: Deliveries) -> None:
        self.link = link
        self.deliveries = deliveries
        # share group -> this session's membership: one part per parent its filter reaches (``topics.Space``)
        self.held: dict[str, tuple[shares.Member, ...]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}  # a part's consumer -> its delivery loop
        self._made_at: dict[str, tuple[str, ...]] = {}  # a part's consumer -> the cluster's members it was made at

    def _refused(self, text: str, why: str, code: int) -> int:
        self.link.host.stats.refusals.refused(self.link.client_id, "SUBSCRIBE", text, why, f"SUBACK {code:#04x}")
        return code

    def _members(self, text: str, options: int, snap: metadata.Metadata) -> tuple[shares.Member, ...]:
        """The parts of the share ``text`` names, one per parent its filter reaches, as an ordinary filter's
        (``topics.Space.subscriptions_of``: a first level naming no parent is the default parent's, a first-level
        wildcard reaches every parent) that the session's user may read."""
        share = shares.parse(text)
        space = topics.space_of(snap)
        wanted = space.subscriptions_of(share.filter)
        if options & held.IN_DEFAULT:  # stored while (also) in the default parent: held there again (``held``)
            wanted += held.twin(wanted, space.default)
        wanted = self._readable(wanted)
        snap.lite_parent(wanted[0].parent)
        options &= ~held.IN_DEFAULT
        return tuple(self._member(share, p, levels, options) for p, levels in wanted)

    def _member(self, share: shares.Share, parent: str, levels: wildcards.Filter, options: int) -> shares.Member:
        return shares.Member(share, parent, levels, options, shares.consumer_of(share.group, parent, self.link.group))

    def _readable(self, wanted: list[topics.Subscription]) -> list[topics.Subscription]:
        """Those of ``wanted`` the user may read (``--acl``); ``errors.Forbidden`` when none."""
        link = self.link
        readable, refused = [], None
        for each in wanted:
            try:
                link.host.authorize_subscribe(link.user, link.address, each.parent, each.filter)
            except errors.Forbidden as exc:
                refused = exc
                continue
            readable.append(each)
        if not readable and refused is not None:
            raise refused
        return readable

    async def subscribe(self, text: str, options: int, snap: metadata.Metadata) -> int:
        """Join (or update) the share ``text`` names: the SUBACK code for it (the granted QoS, or a refusal)."""
        link = self.link
        failure = codec.SUBACK_FAILURE
        try:
            members = self._members(text, options, snap)
        except (shares.ShareError, topics.TopicError, errors.LmqError) as exc:
            refused = Reason.NOT_AUTHORIZED if isinstance(exc, errors.Forbidden) else Reason.TOPIC_FILTER_INVALID
            return self._refused(text, str(exc), refused if link.v5 else failure)
        group = members[0].group
        parts = self.held.get(group)
        if parts is not None:  # the same share again: new options (QoS, identifier), same membership
            self.held[group] = tuple(replace(m, options=options) for m in parts)
            return options & codec.OPTION_QOS
        refusal = self._over_cap(group)
        if refusal is not None:
            return self._refused(text, refusal, Reason.QUOTA_EXCEEDED if link.v5 else failure)
        try:
            await self._join(members, start={m.parent for m in members if self._unread(group, m.parent)})
        except errors.LmqError as exc:
            log.warning("mqtt client %s: shared subscription %s refused: %s", link.client_id, text, exc.message)
            return Reason.UNSPECIFIED_ERROR if link.v5 else failure
        return options & codec.OPTION_QOS

    async def _join(self, members: tuple[shares.Member, ...], *, start: set[str]) -> None:
        """Every part registered (those of the parents in ``start``, which no member reads, begin at the ends
        of their topics); on a refusal, every part left again."""
        group = members[0].group
        self.held[group] = members  # before the loops start: their deliveries are written under it
        try:
            for member in members:
                fresh = member.parent in start
                if fresh:
                    await self._start_at_end(member)
                await self._register(member, [] if fresh else None)
        except errors.LmqError:
            await self._leave(group)
            raise

    def _unread(self, group: str, parent: str) -> bool:
        """No member reads the share in ``parent`` but the one joining: none on this broker, nor (in a cluster)
        on another, whose subscription there is made here too (a wildcard filter everywhere, an exact one at its
        owner)."""
        if self.link.host.share_members.count(group) != 1:
            return False
        return not shares.read_by(self.link.dispatcher.clients(group), parent)

    def _over_cap(self, group: str) -> str | None:
        """Why joining share ``group`` is refused (a cap, counted); None: joined."""
        link = self.link
        cap = link.config.mqtt_max_shares_per_client
        if len(self.held) >= cap:
            link.host.stats.refused[stats.SHARES_PER_CLIENT] += 1
            return f"{cap} shared subscriptions held (--mqtt-max-shares-per-client)"
        members = link.host.share_members
        if not members.join(group, link.client_id):
            link.host.stats.refused[stats.SHARE_MEMBERS] += 1
            return f"the share has {members.max_members} members (--mqtt-max-share-members)"
        return None

    async def _start_at_end(self, member: shares.Member) -> None:
        dispatcher = self.link.dispatcher

        async def scan(parent: str, start_after: str, end_before: str, limit: int) -> list[model.LiteTopicMeta]:
            return await dispatcher.run(dispatcher.store.scan_lite_topics, parent, start_after, end_before, limit)

        reset = matching.later(dispatcher.reset_offsets)
        await matching.start_at_end(scan, reset, member.group, member.parent, [member.levels], [],
                                    default=self.link.config.mqtt_default_parent)  # fmt: skip

    def _filters(self, member: shares.Member) -> list[wildcards.Filter]:
        """What the dispatcher is given for a part (the default parent's: with its hashed names)."""
        return topics.registered(self.link.config.mqtt_default_parent, member.parent, [member.levels])

    async def _register(self, member: shares.Member, older: list[wildcards.Filter] | None) -> None:
        """The part made here and (in a cluster) at every other broker; ``older`` as ``Owners.subscribe`` takes
        it: [] starts the share at the ends there (it has no member), None resumes at its offsets."""
        cluster = self.link.cluster
        if cluster is not None:
            self._made_at[member.consumer] = cluster.members
            await cluster.subscribe(member.consumer, member.group, member.parent, self._filters(member), older)
        await self.link.dispatcher.subscribe_filters(member.consumer, member.group, member.parent,
                                                     self._filters(member))  # fmt: skip
        if member.consumer not in self._tasks:
            loop = Membership(self, member)
            task = asyncio.get_running_loop().create_task(self.deliveries.consume(member.parent, loop, loop))
            self._tasks[member.consumer] = task

    def _part(self, group: str, consumer: str) -> shares.Member | None:
        return next((m for m in self.held.get(group, ()) if m.consumer == consumer), None)

    async def follow(self, cluster: Owners, group: str, consumer: str) -> None:
        """The part made at every broker again if the cluster changed since it was (a broker joined, or this
        one was alone), resuming at the share's offsets there."""
        member = self._part(group, consumer)
        if member is None or self._made_at.get(consumer) == cluster.members:
            return
        self._made_at[consumer] = cluster.members
        try:
            await cluster.subscribe(consumer, group, member.parent, self._filters(member), None)
        except errors.LmqError as exc:
            log.warning("mqtt client %s: shared subscription %s not made at every broker: %s", self.link.client_id,
                        member.share.text, exc.message)  # fmt: skip

    async def reregister(self, group: str, consumer: str) -> None:
        """The part's registration expired meanwhile (a stalled event loop): made again."""
        member = self._part(group, consumer)
        if member is not None:
            await self.link.dispatcher.subscribe_filters(consumer, group, member.parent, self._filters(member))

    async def filters_for(self, group: str, consumer: str, receipts: list[str]) -> dict[wildcards.Filter, int] | None:
        """The filter (-> options) the part's deliveries are written for; None when the session left the share
        since they were leased: they go back to its group at once, for another member."""
        member = self._part(group, consumer)
        if member is not None:
            return {member.levels: member.options}
        for receipt in receipts:
            with contextlib.suppress(errors.LmqError):
                await self.link.dispatcher.change_invisible(group, receipt, 0)
        return None

    async def unsubscribe(self, text: str) -> int:
        """Leave the share ``text`` names: the 5.0 UNSUBACK code."""
        try:
            share = shares.parse(text)
        except shares.ShareError:
            return Reason.TOPIC_FILTER_INVALID
        if share.group not in self.held:
            return Reason.NO_SUBSCRIPTION_EXISTED
        await self._leave(share.group)
        return Reason.SUCCESS

    async def _leave(self, group: str) -> None:
        """Every part of share ``group`` ended here and (in a cluster) at the other brokers."""
        for member in self.held.pop(group, ()):
            await self._leave_part(member)
        self.link.host.share_members.leave(group, self.link.client_id)

    async def _leave_part(self, member: shares.Member) -> None:
        task = self._tasks.pop(member.consumer, None)
        if task is not None:
            await stop(task)
        dispatcher = self.link.dispatcher
        with contextlib.suppress(errors.LmqError):
            await dispatcher.subscribe_filters(member.consumer, member.group, member.parent, [])
        dispatcher.client_gone(member.consumer)
        cluster = self.link.cluster
        self._made_at.pop(member.consumer, None)
        if cluster is not None:  # a member no more at the other brokers either (best effort)
            await cluster.unsubscribe(member.consumer, member.group, member.parent, [])

    async def restore(self, text: str, options: int, snap: metadata.Metadata) -> None:
        """A persistent session's stored share, joined again at its group's offsets (no start at the end)."""
        link = self.link
        try:
            members = self._members(text, options, snap)
        except (shares.ShareError, topics.TopicError, errors.LmqError) as exc:
            log.info("mqtt client %s: stored shared subscription %s dropped: %s", link.client_id, text, exc)
            return
        if not link.host.share_members.join(members[0].group, link.client_id):
            link.host.stats.refused[stats.SHARE_MEMBERS] += 1
            log.info("mqtt client %s: stored shared subscription %s over --mqtt-max-share-members", link.client_id,
                     text)  # fmt: skip
            return
        try:
            await self._join(members, start=set())
        except errors.LmqError as exc:
            log.info("mqtt client %s: stored shared subscription %s not joined: %s", link.client_id, text, exc.message)

    def saved(self) -> dict[str, int]:
        """What a persistent session stores of its shares: filter text -> options (identifier included; a filter
        without wildcards with a part in the default parent marked ``held.IN_DEFAULT``, as a session's)."""
        default = self.link.config.mqtt_default_parent
        out = {}
        for parts in self.held.values():
            mark = any(m.parent == default and len(m.levels) > 1 for m in parts) and not _wild(parts[0].share)
            out[parts[0].share.text] = parts[0].options | (held.IN_DEFAULT if mark else 0)
        return out

    def reaches(self) -> tuple[bool, frozenset[str]]:
        """Which parents created later the shares would reach into (``held.reaches``, ``following``)."""
        default = self.link.config.mqtt_default_parent
        return held.reach_of(m.levels for parts in self.held.values() for m in parts if m.parent == default)

    async def follow_parents(self, snap: metadata.Metadata) -> None:
        """Parents created since the shares were joined: a part in each one a share's filter now reaches (the
        user may read), reading the share's topics there from their beginning, here and at every broker; the
        parts held before stay (a filter without wildcards keeps its default parent's part, ``held``)."""
        space = topics.space_of(snap)
        link = self.link
        for group, parts in list(self.held.items()):
            have = {m.parent for m in parts}
            with contextlib.suppress(topics.TopicError):
                for parent, levels in space.subscriptions_of(parts[0].share.filter):
                    if parent in have:
                        continue
                    try:
                        link.host.authorize_subscribe(link.user, link.address, parent, levels)
                    except errors.Forbidden:
                        continue
                    await self._add_part(group, self._member(parts[0].share, parent, levels, parts[0].options))

    async def _add_part(self, group: str, member: shares.Member) -> None:
        self.held[group] = (*self.held[group], member)
        try:
            await self._register(member, None)  # the share's offsets there: none yet, from the beginning
        except errors.LmqError as exc:
            log.warning("mqtt client %s: shared subscription %s not made in %s: %s", self.link.client_id,
                        member.share.text, member.parent, exc.message)  # fmt: skip
            self.held[group] = tuple(m for m in self.held[group] if m is not member)
            await self._leave_part(member)

    async def stop(self) -> None:
        """The connection ends: no more deliveries (its leases are given back by ``Deliveries.give_back``)."""
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            await stop(task)

    async def end(self) -> None:
        """The connection ended: every membership left here (a persistent session keeps them stored)."""
        await self.stop()
        for group in list(self.held):
            await self._leave(group)


def _wild(share: shares.Share) -> bool:
    return any(level in ("+", "#") for level in share.filter.split("/"))
