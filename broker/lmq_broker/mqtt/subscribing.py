"""A session's subscriptions: an MQTT session is the implicit lite group ``%MQTT%<client id>``
(``metadata.MQTT_GROUP_PREFIX``) and, per parent topic it subscribes in, one dispatcher client registered with
its topic filters (``Dispatcher.subscribe_filters``), whose delivery loop ``delivering`` runs.

A new subscription starts at the end of every matching lite topic (MQTT delivers what is published after it,
plus the retained message); a persistent session resumes at its group's offsets. In a cluster the session is
subscribed at every other broker too, its new filters starting at their ends there as well, and a SUBSCRIBE
also gets the other brokers' retained messages (per topic the newest).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Final

from lmq_broker import errors, model
from lmq_broker.dispatch import metadata, wildcards
from lmq_broker.mqtt import codec, held, identifiers, matching, shares, stats, topics
from lmq_broker.mqtt.delivering import Deliveries
from lmq_broker.mqtt.link import Closed, Link, reason_of, stop
from lmq_broker.mqtt.owners import Owners
from lmq_broker.mqtt.properties import Reason
from lmq_broker.mqtt.sharing import Sharing

log = logging.getLogger(__name__)

MAX_FILTERS: Final = 1000  # topic filters one session may hold
_TICK_S: Final = 0.0005  # the SUBACK waits for the wall clock's next millisecond in steps of this
_TICK_TRIES: Final = 10
_FILTERS_PER_STEP: Final = 256  # an UNSUBSCRIBE's filters handled in one step of the event loop


class Subscriptions:
    def __init__(self, link: Link, deliveries: Deliveries) -> None:
        self.link = link
        self.deliveries = deliveries
        self.consumers: dict[str, asyncio.Task[None]] = {}  # parent -> its delivery loop
        self.retained_tasks: set[asyncio.Task[None]] = set()
        self.sharing = Sharing(link, deliveries)  # its shared subscriptions ($share/...)
        self._made_at: dict[str, tuple[str, ...]] = {}  # parent -> the cluster's members its filters were made at
        self._changing = asyncio.Lock()  # a SUBSCRIBE, UNSUBSCRIBE or new parents: one at a time
        self._parents: frozenset[str] | None = None  # the named parents the filters were last made or followed for
        self._ended = False

    async def restore(self, saved: dict[str, int]) -> None:
        async with self._changing:
            await self._restore(saved)

    async def _restore(self, saved: dict[str, int]) -> None:
        link = self.link
        snap = await link.dispatcher.metadata()
        space = topics.space_of(snap)
        for text, options in saved.items():
            if shares.is_shared(text):
                await self.sharing.restore(text, options, snap)
                self._index()
                continue
            with contextlib.suppress(topics.TopicError):
                held.add_saved(link.subs, space, text, options)
        self._parents = space.parents
        cluster = link.cluster
        for parent in list(link.subs):
            await self.register(parent)
            if cluster is not None:  # resumed at the group's offsets there too
                await self._make_everywhere(cluster, parent)

    async def follow(self, cluster: Owners, parent: str) -> None:
        """The filters in ``parent`` made at every broker again if the cluster changed since they were."""
        if self._made_at.get(parent) != cluster.members:
            await self._make_everywhere(cluster, parent)

    async def _make_everywhere(self, cluster: Owners, parent: str) -> None:
        """The session's filters in ``parent`` made at every broker (again), resuming at the group's offsets."""
        link = self.link
        self._made_at[parent] = cluster.members
        filters = self._wired(parent, list(link.subs.get(parent, ())))
        try:
            await cluster.subscribe(link.consumer_id(parent), link.group, parent, filters, None)
        except errors.LmqError as exc:
            log.warning("mqtt client %s: subscriptions in %s not made at every broker: %s", link.client_id, parent,
                        exc.message)  # fmt: skip

    def _wired(self, parent: str, filters: list[wildcards.Filter]) -> list[wildcards.Filter]:
        """What the other brokers are given for ``filters`` (all the session holds in ``parent``): in the default
        parent ``HASHED`` too, as here (``topics.registered``): a hashed name carries no levels to match."""
        return topics.registered(self.link.config.mqtt_default_parent, parent, filters)

    def _readable(self, wanted: list[topics.Subscription]) -> list[topics.Subscription]:
        """Of the parents a filter reaches into, those the session's user may read (``--acl``; all without it):
        a filter is refused (``errors.Forbidden``) only when it may read none of them."""
        link = self.link
        readable: list[topics.Subscription] = []
        refused: errors.Forbidden | None = None
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

    async def follow_parents(self) -> None:
        """Parents created since the filters were made (``following``): the filters that can match them reach
        into them, from their beginning (whatever they hold came after they existed), here and at every broker."""
        async with self._changing:
            if not self._ended:
                await self._follow(await self.link.dispatcher.metadata())

    async def _follow(self, snap: metadata.Metadata) -> None:
        link = self.link
        touched: set[str] = set()
        space = topics.space_of(snap)
        self._parents = space.parents
        for parent, levels in held.expand(link.subs, space, named_first=True):
            try:
                link.host.authorize_subscribe(link.user, link.address, parent, levels)
                touched.add(parent)
            except errors.Forbidden:  # as a SUBSCRIBE would: only the parents the user may read
                del link.subs[parent][levels]
                if not link.subs[parent]:
                    del link.subs[parent]
        cluster = link.cluster
        for parent in sorted(touched | {p for p in link.subs if p not in self.consumers}):
            await self.register(parent)
            if cluster is not None:  # resumed at the group's offsets there: a new parent's topics from the start
                await self._make_everywhere(cluster, parent)
        await self.sharing.follow_parents(snap)
        self._index()

    async def subscribe(self, packet: codec.Subscribe) -> None:
        async with self._changing:
            now = await self.link.dispatcher.metadata()
            if self._parents is not None and topics.space_of(now).parents != self._parents:
                await self._follow(now)  # parents came that the session was not told of yet: held there first
            snap = await self._subscribe(packet)
            self._index()  # its shares too (its other filters: when their parent is registered)
            if snap is not await self.link.dispatcher.metadata():  # a parent may have come meanwhile
                await self._follow(await self.link.dispatcher.metadata())

    async def _subscribe(self, packet: codec.Subscribe) -> metadata.Metadata:
        self.link.hold()  # a new subscription's deliveries go out after its SUBACK (MQTT-3.8.4)
        try:
            return await self._subscribe_held(packet)
        finally:
            self.link.unhold()

    async def _subscribe_held(self, packet: codec.Subscribe) -> metadata.Metadata:
        link = self.link
        codes: list[int] = []
        fresh: dict[str, list[wildcards.Filter]] = {}
        granted: dict[int, list[tuple[str, wildcards.Filter]]] = {}  # index in codes -> what it granted
        no_retained: set[int] = set()  # 5.0 retain handling: granted, but no retained messages now
        failure, shared = codec.SUBACK_FAILURE, False
        ids = packet.properties.subscription_ids if packet.properties is not None else ()
        sub_id = ids[0] if ids else 0  # one at most (the codec refuses more)
        snap = await link.dispatcher.metadata()
        space = topics.space_of(snap)
        if self._parents is None:
            self._parents = space.parents
        count = held.count(link.subs, space.default)  # once (it reads every filter held), then kept
        limit = MAX_FILTERS + link.config.mqtt_max_shares_per_client  # all a session may hold, shares included
        for text, options in packet.filters[:limit]:
            # granted as asked (QoS 0, 1 or 2; 3 is a malformed SUBSCRIBE), with the SUBSCRIBE's identifier
            # (``identifiers``; none: none), a shared subscription too
            stored = identifiers.with_id(options, sub_id)
            if shares.is_shared(text):
                if options & codec.OPTION_NO_LOCAL and link.v5:
                    raise Closed("no local on a shared subscription", code=Reason.PROTOCOL_ERROR)  # MQTT-3.8.3-4
                codes.append(await self.sharing.subscribe(text, stored, snap))
                shared = True
                continue
            try:
                wanted = self._readable(space.subscriptions_of(text))
                snap.lite_parent(wanted[0].parent)
            except (topics.TopicError, errors.LmqError) as exc:
                code = Reason.NOT_AUTHORIZED if isinstance(exc, errors.Forbidden) else Reason.TOPIC_FILTER_INVALID
                codes.append(code if link.v5 else failure)
                link.host.stats.refusals.refused(
                    link.client_id, "SUBSCRIBE", text, str(exc), f"SUBACK {codes[-1]:#04x}"
                )
                continue
            existed = held.holds(link.subs, wanted, space.default)
            if not existed and count >= MAX_FILTERS:
                link.host.stats.refused[stats.FILTERS_PER_CLIENT] += 1
                codes.append(Reason.QUOTA_EXCEEDED if link.v5 else failure)
                continue
            count += not existed
            made = held.add(link.subs, wanted, stored, space.default)
            for parent, levels, _ in (m for m in made if not m.existed):
                fresh.setdefault(parent, []).append(levels)
            handling = options >> codec.OPTION_RETAIN_HANDLING_SHIFT
            if handling == 2 or (handling == 1 and existed):
                no_retained.add(len(codes))
            granted[len(codes)] = [(m.parent, m.filter) for m in made]
            codes.append(stored & codec.OPTION_QOS)
        codes += self._past_limit(len(packet.filters) - limit)
        for parent, new in fresh.items():
            refused = await self._start(parent, new)
            if refused is not None:
                for i, pairs in list(granted.items()):
                    if pairs[0][0] == parent and pairs[0][1] in new:  # its own subscription failed
                        codes[i] = reason_of(refused) if link.v5 else failure
                        del granted[i]
                    else:  # a named parent a wildcard reaches into: the rest holds
                        granted[i] = [(p, f) for p, f in pairs if p != parent or f not in new]
        if (granted or shared) and link.persistent:
            await self.save()
        as_of = await self._tick(link.dispatcher.wall_clock)  # retained later than the SUBACK came live instead
        link.writer.write(codec.encode_suback(packet.packet_id, codes, link.ack_props()))
        sends = [(p, f, codes[i]) for i, pairs in granted.items() if i not in no_retained for p, f in pairs]
        if sends:  # after the SUBACK (MQTT-3.3.1-6, 3.8.4-3); off the reader, which reads the PUBACKs they wait for
            link.hold()
            task = asyncio.get_running_loop().create_task(self._send_all_retained(sends, as_of))
            self.retained_tasks.add(task)
            task.add_done_callback(self.retained_tasks.discard)
        return snap

    def _past_limit(self, over: int) -> list[int]:
        """The codes of a SUBSCRIBE's ``over`` filters past all a session may hold: refused unread (each would
        cost the loop ~10 µs: 200,000 held every client for 2 s), and counted."""
        if over <= 0:
            return []
        link = self.link
        link.host.stats.refused[stats.FILTERS_PER_CLIENT] += over
        return [Reason.QUOTA_EXCEEDED if link.v5 else codec.SUBACK_FAILURE] * over

    @staticmethod
    async def _tick(wall_clock: Callable[[], int]) -> int:
        """The millisecond the subscriptions are in place by, returned once the clock has passed it (at most a
        few ms): a publish the client makes after reading the SUBACK is stamped later, so its retained message
        is told from those of before (``Deliveries.send_retained``), even within one millisecond."""
        as_of = wall_clock()
        for _ in range(_TICK_TRIES):
            if wall_clock() > as_of:
                break
            await asyncio.sleep(_TICK_S)
        return as_of

    async def _start(self, parent: str, new: list[wildcards.Filter]) -> errors.LmqError | None:
        """The ``new`` filters in ``parent`` take effect (here, and at the other brokers); else the refusal
        (they are dropped again)."""
        link = self.link
        older = [f for f in link.subs[parent] if f not in new]
        try:
            await self._start_at_end(parent, new, older)
            await self.register(parent)
            cluster = link.cluster
            if cluster is not None:  # at the other brokers too, from their ends as well
                consumer = link.consumer_id(parent)
                if self._made_at.get(parent) != cluster.members:  # set first: the loop must not make ``new``
                    self._made_at[parent] = cluster.members
                    if older:  # made while this broker was alone, or before a broker joined
                        await cluster.subscribe(consumer, link.group, parent, self._wired(parent, older), None)
                await cluster.subscribe(consumer, link.group, parent, new, older)
                if not older and parent == link.config.mqtt_default_parent:  # started at their ends just now
                    await cluster.subscribe(consumer, link.group, parent, [topics.HASHED], None)
        except errors.LmqError as exc:  # e.g. the store rebuilds its index: these filters fail, the rest holds
            log.warning("mqtt client %s: subscriptions in %s refused: %s", link.client_id, parent, exc.message)
            cluster = link.cluster
            if cluster is not None:  # brokers that took them before one refused
                await cluster.unsubscribe(link.consumer_id(parent), link.group, parent, new)
            for f in new:
                link.subs[parent].pop(f, None)
            await self.register(parent)
            return exc
        return None

    async def _send_all_retained(self, wanted: list[tuple[str, wildcards.Filter, int]], as_of: int) -> None:
        deliveries = self.deliveries
        try:
            elsewhere = await deliveries.retained_elsewhere(wanted)
            link = self.link
            holding = await link.dispatcher.run(link.host.durable.holding_retained, {p for p, _, _ in wanted})
            for (parent, levels, qos), theirs in zip(wanted, elsewhere, strict=True):
                if parent in holding or theirs:  # else none here nor elsewhere: 100 filters, not 100 queries
                    await deliveries.send_retained(parent, levels, qos, theirs, as_of)
        except (ConnectionError, errors.LmqError) as exc:
            log.info("mqtt client %s: retained messages not sent: %s", self.link.client_id, exc)
        finally:
            self.link.unhold()

    async def unsubscribe(self, packet: codec.Unsubscribe) -> None:
        async with self._changing:
            await self._unsubscribe(packet)
            self._index()

    async def _unsubscribe(self, packet: codec.Unsubscribe) -> None:
        link = self.link
        changed: dict[str, list[wildcards.Filter]] = {}  # parent -> the filters ended there
        codes, shared = [], False
        space = topics.space_of(await link.dispatcher.metadata())
        for at, text in enumerate(packet.filters, 1):
            if not at % _FILTERS_PER_STEP:
                await asyncio.sleep(0)  # other clients' turn: 200,000 filters held the loop for 1.6 s
            if shares.is_shared(text):
                codes.append(await self.sharing.unsubscribe(text))
                shared = True
                continue
            try:
                wanted = space.subscriptions_of(text)
            except topics.TopicError:
                codes.append(Reason.TOPIC_FILTER_INVALID)
                continue
            existed = held.holds(link.subs, wanted, space.default)
            for parent, ended in held.remove(link.subs, space, wanted).items():
                changed.setdefault(parent, []).extend(ended)
            codes.append(Reason.SUCCESS if existed else Reason.NO_SUBSCRIPTION_EXISTED)
        cluster = link.cluster
        for parent, ended in changed.items():
            await self.register(parent)
            if cluster is not None:
                last = parent == link.config.mqtt_default_parent and not link.subs.get(parent)
                gone = [*ended, topics.HASHED] if last else ended  # the last filter there: hashed topics end too
                await cluster.unsubscribe(link.consumer_id(parent), link.group, parent, gone)
        if (changed or shared) and link.persistent:
            await self.save()
        if link.v5:
            link.writer.write(codec.encode_unsuback(packet.packet_id, codes))
        else:
            link.writer.write(codec.encode_packet_id(codec.UNSUBACK, packet.packet_id))

    async def save(self, *, replicated: bool = True) -> None:
        """The session's row written; ``replicated``: and on the replicas before the CONNACK, SUBACK or UNSUBACK
        this precedes (False: the caller waits once for many, ``Host.rows_saved``)."""
        link = self.link
        filters = held.texts(link.subs, link.config.mqtt_default_parent)
        filters |= self.sharing.saved()
        await link.dispatcher.run(link.host.durable.save_session, link.client_id, filters, link.expiry_s)
        link.stored = True
        if replicated:
            await link.host.rows_saved(link.client_id, "its session")

    async def _start_at_end(self, parent: str, new: list[wildcards.Filter], older: list[wildcards.Filter]) -> None:
        """The group's start in each existing lite topic here that only the ``new`` filters match: its end."""
        dispatcher = self.link.dispatcher

        async def scan(parent: str, start_after: str, end_before: str, limit: int) -> list[model.LiteTopicMeta]:
            return await dispatcher.run(dispatcher.store.scan_lite_topics, parent, start_after, end_before, limit)

        reset = matching.later(dispatcher.reset_offsets)
        await matching.start_at_end(scan, reset, self.link.group, parent, new, older,
                                    default=self.link.config.mqtt_default_parent,
                                    indexed=lambda f: dispatcher.lite_topics_matching(parent, f))  # fmt: skip

    async def register(self, parent: str) -> None:
        """Give the dispatcher this session's filters in ``parent``; start or stop the parent's delivery loop."""
        link = self.link
        filters = topics.registered(link.config.mqtt_default_parent, parent, link.subs.get(parent, {}))
        consumer = link.consumer_id(parent)
        await link.dispatcher.subscribe_filters(consumer, link.group, parent, filters)
        task = self.consumers.get(parent)
        if filters and task is None:
            self.consumers[parent] = asyncio.get_running_loop().create_task(self.deliveries.consume(parent, self))
        elif not filters and task is not None:
            await stop(task)
            del self.consumers[parent]
            link.dispatcher.client_gone(consumer)
            link.subs.pop(parent, None)
        if parent == link.config.mqtt_default_parent:
            self._index()

    def _index(self) -> None:
        """Which parents created later the filters and shares would reach into (``following``)."""
        if self._ended:
            return
        link = self.link
        wild, firsts = held.reaches(link.subs, link.config.mqtt_default_parent)
        shared_wild, shared_firsts = self.sharing.reaches()
        link.host.followers.index(self, wild or shared_wild, firsts | shared_firsts)

    async def stop_all(self) -> None:
        """At the end: the delivery loops and the retained messages being sent stop."""
        async with self._changing:  # a parent being followed meanwhile registers nothing after this
            self._ended = True
            self.link.host.followers.index(self, False, ())
        for task in [*self.consumers.values(), *self.retained_tasks]:
            await stop(task)
        await self.sharing.stop()
