"""The state rows of the slots this broker holds, shipped to their followers; the followers' shadows of them;
and what a follower does with a shadow when it takes a slot over (``states`` has the rows' rules).

Kinds, and where their rows come from on the holder:

* ``sub``: per client id, its lite subscriptions to topics of the slot (the dispatcher's registry, as
  ``saved_subscriptions`` saves it; the client's patterns go with them). A takeover adds them to the new
  owner's registry, as a restart restores its own: the subscriber is served there without subscribing again.
* ``mqtt-sessions``, ``mqtt-qos2``, ``mqtt-wills``, ``mqtt-retained``: the rows of the broker's MQTT store
  (``mqtt.durable``; ``wills``: those waiting for their delay),
  with its own slot only: an MQTT session and a retained publish live on the broker the MQTT client was
  connected to (its access broker, docs/scale-out.md), not at their topics' owners. A takeover merges them
  into the new owner's MQTT store (``durable.merge``), so the client finds its session there and a will still
  waiting is published there when due. A follower of an older version keeps the kinds it does not know in its
  shadow and installs none of them; one of a newer version is sent none by an older holder.
* ``moved``: per lite topic taken over from a leaving slot, the take-over (``moved``): rows of the slot it left
  and of the slot it went to. Facts, never changed: a follower writes each into its own ``moved.Moved`` as soon
  as a batch or snapshot brings it (before it takes anything over), so every replica of either slot files the
  topic where it went, also after a later scale-up brings the slot it left back (docs/replication.md).

Asynchronous and coalesced, like commit points: every ``SHIP_INTERVAL_MS`` (at least ``PACE`` times what the
last look cost) the holder compares its rows with what it last shipped, only when the registry or the MQTT store
changed since, and sends what changed to every follower at once; not awaited by a v2 client's call
(a subscription missing after a failover delays delivery, it loses no message: messages and commit points
are copied before acknowledgement or right after, and the client's full sync every 30 s brings it back). An
MQTT client never subscribes again to a session it finds present, so a persistent session's change (its
CONNECT, SUBSCRIBE, UNSUBSCRIBE) is answered only once ``flushed``: a look begun after it has reached the
slot's in-sync followers (or ``FLUSH_TIMEOUT_S`` passed: logged and counted, the answer goes out anyway).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector as _Collector

from lmq_broker import errors
from lmq_broker.dispatch import saved_subscriptions
from lmq_broker.mqtt import durable
from lmq_broker.replication import events, moved, states
from lmq_broker.replication.leadership import Leadership

log = logging.getLogger(__name__)

SHIP_INTERVAL_MS: Final = 100  # how often a holder looks for changed rows (a look costs nothing when none changed)
PACE: Final = 10  # the wait after a look is at least this many times what it cost (a large registry: less often)
SLOTS_CACHED: Final = 262_144  # lite topics whose slot a holder remembers (~30 MiB when full)
SNAPSHOT_PAGE: Final = 5_000  # rows per StateFetch answer (a page of a snapshot the holder keeps meanwhile)
SNAPSHOTS_KEPT: Final = 8  # snapshots a holder keeps for their next pages (the oldest goes first)
SNAPSHOT_KEEP_S: Final = 60.0  # and for at most this long
FETCH_RESTARTS: Final = 3  # a snapshot the holder no longer had, started again at most this often per fetch
DURING_MAX: Final = 10_000  # batches a follower keeps while it fetches a snapshot (more: it fetches again)
FLUSH_TIMEOUT_S: Final = 2.0  # ``flushed`` waits at most this long (a copy call's timeout)
SUB: Final = "sub"
MQTT_KIND: Final = "mqtt-"  # + the table's name

Call = Callable[[int, bytes], Awaitable[bytes]]  # (the slot of a broker, data) -> its answer
# (the holder's slot, slot, snapshot name ("" first), rows received) -> the next page of its rows (``states`` full)
Snapshot = Callable[[int, int, str, int], Awaitable[bytes]]


@dataclass(frozen=True, slots=True)
class _Kept:
    """A snapshot a holder keeps for the next pages a follower asks for."""

    slot: int
    epoch: int
    stream: str
    seq: int
    rows: list[tuple[str, str, str | None]]
    made: float  # monotonic


Records = list[saved_subscriptions.ClientRecord]


class States:
    def __init__(  # noqa: PLR0917 (the registry's and the MQTT store's doors)
        self,
        leadership: Leadership,
        slot_of_topic: Callable[[str], int],
        export: Callable[[], Records],
        restore: Callable[[Records], None],
        registry_version: Callable[[], int],
        mqtt: Callable[[], durable.Durable | None],
        now_ms: Callable[[], int],
    ) -> None:
        self._leadership = leadership
        self._slot_of_topic = slot_of_topic
        self._export = export
        self._restore = restore
        self._registry_version = registry_version
        self._mqtt = mqtt
        self._now_ms = now_ms
        self._trackers: dict[int, states.Tracker] = {}  # slot held -> what its followers were sent
        self._seen: dict[int, tuple[int, int, int]] = {}  # slot held -> the versions its rows were last read at
        self._held: set[int] = set()
        self._slots: dict[str, int] = {}  # lite topic -> its slot, as ``_slot`` remembers it
        self.shadows: dict[int, states.Shadow] = {}  # slot followed -> its holder's rows
        self.stale: set[int] = set()  # slots followed whose shadow missed a batch (a snapshot is due)
        self._sub_rows: dict[int, tuple[int, states.Rows]] = {}  # slot -> (registry version, its rows then)
        self._mqtt_rows: tuple[int, states.Rows] | None = None  # (the MQTT store's changes, its rows then)
        self._sending: dict[tuple[int, int], asyncio.Task[bool]] = {}  # (slot, follower) -> its last batch (sent)
        self._flushes: list[asyncio.Future[bool]] = []  # ``flushed`` callers waiting for the next look
        self._wake = events.Signal()  # a ``flushed`` caller: look now
        self.unflushed = 0  # ``flushed`` calls that timed out
        self._retry: set[int] = set()  # slots held whose last batch did not reach every follower
        self.installed: set[int] = set()  # slots taken over whose shadow went into this broker's state
        self._kept: dict[str, _Kept] = {}  # the holder's snapshots being fetched, by name
        self._during: dict[int, list[states.Batch]] = {}  # slot whose snapshot is being fetched -> batches meanwhile
        self._overflowed: set[int] = set()  # slots whose batches meanwhile were too many
        self.on_stale: Callable[[int], None] = lambda slot: None
        self.refused: Callable[[str], None] = lambda reason: None  # counted with the copies a follower refused
        self.merged: Callable[[], None] = lambda: None  # MQTT rows merged at a takeover (its wills' timer looks)
        # the take-overs of leaving slots' topics (``moved``): written at a follower as they come, shipped by a holder
        self.moved: moved.Moved | None = None
        self.moved_in: Callable[[list[str]], None] = lambda topics: None  # topics whose take-over is new here

    # --- the holder ----------------------------------------------------------------------------------------
    async def run(self, stopping: asyncio.Event, followers: Callable[[int], list[int]], call: Call) -> None:
        while not stopping.is_set():
            flushes, self._flushes = self._flushes, []
            self._wake.clear()
            began = time.monotonic()
            reached = False
            try:
                reached = await self.tick(followers, call)
            except Exception as exc:  # a registry or MQTT store that failed to read: again next tick
                log.warning("state rows: %s", exc)
            if flushes:
                reached = reached and await self._reached()
                for waiter in flushes:
                    if reached and not waiter.done():
                        waiter.set_result(True)
                self._flushes[:0] = [w for w in flushes if not w.done()]  # not yet: the next look (their timeout)
            # the next look no sooner than this, ``flushed`` callers waiting or not (a look reads every row):
            # those who came meanwhile share it
            floor_s = max(PACE * (time.monotonic() - began), SHIP_INTERVAL_MS / 1000 / 10)
            await events.nap(floor_s, stopping)
            if not self._flushes:
                await events.nap(SHIP_INTERVAL_MS / 1000 - floor_s, stopping, self._wake)

    async def flushed(self, timeout_s: float = FLUSH_TIMEOUT_S, *, own: bool = True) -> bool:
        """Until the rows as they are now (the caller changed them before) reached the in-sync followers of
        every slot this broker holds: a look begun after this call shipped what changed and every call to an
        in-sync follower under way then succeeded. False after ``timeout_s``, or at once while this broker does
        not hold its own slot (its MQTT rows are shipped by no one then; not asked with ``own`` False: a
        take-over's row, of the slots held), counted in ``unflushed`` (with ``own``)."""
        if own and self._leadership.me not in self._leadership.held():  # its MQTT rows go to no follower meanwhile
            self.unflushed += 1
            return False
        waiter = asyncio.get_running_loop().create_future()
        self._flushes.append(waiter)
        self._wake.set()
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except TimeoutError:
            self.unflushed += own  # the MQTT sessions' count (a take-over that timed out is tried again)
            return False
        finally:
            if not waiter.done():
                waiter.cancel()
            with contextlib.suppress(ValueError):
                self._flushes.remove(waiter)

    async def _reached(self) -> bool:
        """Every batch under way to an in-sync follower of a slot held was stored there (or found it behind: it
        is out of sync then, and takes the slot over only after a snapshot of the rows newer than the batch)."""
        leadership = self._leadership
        calls = [
            task
            for (slot, follower), task in self._sending.items()
            if leadership.holds(slot) and follower in leadership.in_sync(slot)
        ]
        if not calls:
            return True
        done = await asyncio.gather(*calls, return_exceptions=True)
        return all(result is True for result in done)

    def forget_slots(self) -> None:
        """Another ring: the slots remembered per topic (and the rows made with them) are forgotten."""
        self._sub_rows.clear()
        self._slots.clear()
        self._seen.clear()

    async def tick(self, followers: Callable[[int], list[int]], call: Call) -> bool:
        """One look: what changed, shipped. False when a batch was left out for a follower in the slot's in-sync
        set (one still under way to it: the next look sends what it missed)."""
        leadership = self._leadership
        shipped = True
        held = set(leadership.held())
        if held != self._held:  # which slot a topic belongs to follows the slots held
            self._held = held
            self._sub_rows.clear()
            self._slots.clear()
            self._seen.clear()
        for slot in [s for s in self._trackers if s not in held]:
            del self._trackers[slot]
        self.installed &= held
        for slot in sorted(held):
            if slot != leadership.me and slot not in self.installed:
                await self.install(slot)
            epoch = leadership.epoch(slot)
            if epoch is None:
                continue
            batch = await self._changed(slot, epoch)
            if batch is None and slot in self._retry:  # a follower may have missed the last one: it finds out
                tracker = self._tracker(slot)
                tracker.seq += 1
                batch = states.Batch(slot, epoch, tracker.stream, tracker.seq, [])
            if batch is not None:
                self._retry.discard(slot)
                data = states.encode(batch)
                for follower in followers(slot):
                    if not self._ship(slot, follower, data, call) and follower in leadership.in_sync(slot):
                        shipped = False
        return shipped

    def _ship(self, slot: int, follower: int, data: bytes, call: Call) -> bool:
        """Send a batch to one follower, after the previous one (never two at once: they would cross). One
        still under way (a follower down: up to the call's timeout): this one is left out, so the follower
        finds a gap with the next one and fetches a snapshot. False when left out."""
        under_way = self._sending.get((slot, follower))
        if under_way is not None and not under_way.done():
            self._retry.add(slot)
            return False

        async def send() -> bool:
            try:
                await call(follower, data)  # b"behind": out of sync there, so it takes the slot over only once it
            except Exception:  # fetched a snapshot of the rows (this change in) / down or refusing: the next
                self._retry.add(slot)  # batch (one is sent for this) tells it what it missed
                return False
            return True

        self._sending[(slot, follower)] = asyncio.get_running_loop().create_task(send(), name="lmq-state-rows")
        return True

    async def close(self) -> None:
        tasks = list(self._sending.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _changed(self, slot: int, epoch: int) -> states.Batch | None:
        """The next batch of ``slot``: what changed since the last one; None when nothing did."""
        tracker = self._tracker(slot)
        versions = self._versions()
        if self._seen.get(slot) == versions:
            return None
        rows = await self.rows(slot)
        self._seen[slot] = versions
        changes = tracker.diff(rows)
        if not changes:
            return None
        tracker.seq += 1
        return states.Batch(slot, epoch, tracker.stream, tracker.seq, changes)

    async def snapshot(self, slot: int, epoch: int, page: str = "", start: int = 0) -> bytes:
        """A page of every row of a slot this broker holds, for a follower that reconciles: from ``start`` of the
        snapshot named ``page``, or the first of a new one (the rows now) when ``page`` is "" or gone."""
        now = time.monotonic()
        for name in [n for n, k in self._kept.items() if now - k.made > SNAPSHOT_KEEP_S]:
            del self._kept[name]
        kept = self._kept.get(page)
        if kept is None or kept.slot != slot or kept.epoch != epoch:
            tracker = self._tracker(slot)
            rows = await self.rows(slot)
            listed: list[tuple[str, str, str | None]] = [(kind, key, value) for (kind, key), value in rows.items()]
            page, start = uuid.uuid4().hex, 0
            kept = self._kept[page] = _Kept(slot, epoch, tracker.stream, tracker.seq, listed, now)
            while len(self._kept) > SNAPSHOTS_KEPT:
                del self._kept[next(iter(self._kept))]
        end = start + SNAPSHOT_PAGE
        chunk, more = kept.rows[start:end], end < len(kept.rows)
        return states.encode(states.Batch(slot, epoch, kept.stream, kept.seq, chunk, True, page, more))

    def _tracker(self, slot: int) -> states.Tracker:
        found = self._trackers.get(slot)
        if found is None:
            found = self._trackers[slot] = states.Tracker(uuid.uuid4().hex)
        return found

    def _versions(self) -> tuple[int, int, int]:
        mqtt = self._mqtt()
        taken = -1 if self.moved is None else self.moved.version
        return self._registry_version(), -1 if mqtt is None else mqtt.changes(), taken

    async def rows(self, slot: int) -> states.Rows:
        """Every row of ``slot`` now. Each kind is read again only when its source changed since; the registry is
        exported on the event loop (it is not shared with threads) and its rows made on a thread."""
        version = self._registry_version()
        cached = self._sub_rows.get(slot)
        if cached is None or cached[0] != version:
            records, of = self._export(), self._slot
            cached = self._sub_rows[slot] = (version, await asyncio.to_thread(_sub_rows, records, of, slot))
        rows = dict(cached[1])
        mqtt = self._mqtt()
        if mqtt is not None and slot == self._leadership.me:
            changes = mqtt.changes()
            if self._mqtt_rows is None or self._mqtt_rows[0] != changes:
                self._mqtt_rows = (changes, await asyncio.to_thread(_mqtt_rows, mqtt))
            rows.update(self._mqtt_rows[1])
        if self.moved is not None:
            rows.update({(moved.MOVED, topic): text for topic, text in self.moved.rows_of(slot).items()})
        return rows

    def _slot(self, topic: str) -> int:
        """``slot_of_topic``, remembered (a hash per topic; forgotten when the slots held change, or wholesale
        when full)."""
        found = self._slots.get(topic)
        if found is None:
            if len(self._slots) >= SLOTS_CACHED:
                self._slots.clear()
            found = self._slots[topic] = self._slot_of_topic(topic)
        return found

    # --- a follower ----------------------------------------------------------------------------------------
    def accept(self, data: bytes) -> bool:
        """A holder's batch: True once applied (or already in), False when it does not follow what this broker
        has (then a snapshot is due: not in sync meanwhile)."""
        batch = states.decode(data)
        slot, leadership = batch.slot, self._leadership
        if slot not in leadership.mine:
            raise errors.InvalidArgument(f"this broker is no replica of slot {slot}")
        if leadership.holds(slot):
            self.refused("owner")
            raise errors.Fenced(
                f"this broker holds the lease of slot {slot}: state rows of epoch {batch.epoch} refused"
            )
        if batch.epoch < leadership.epochs.get(slot, 0):
            self.refused("stale_epoch")
            raise errors.Fenced(f"slot {slot} is at a newer epoch: state rows of epoch {batch.epoch} refused")
        self._take_moved(batch.rows)
        during = self._during.get(slot)
        if during is not None:  # a snapshot is being fetched: applied over it once it is in
            if len(during) < DURING_MAX:
                during.append(batch)
                return True
            during.clear()  # too many: fetched again
            self._overflowed.add(slot)
            self.stale.add(slot)
            self.on_stale(slot)
            return False
        shadow = self.shadows.get(slot)
        if shadow is None or not shadow.apply(batch):
            if shadow is not None:  # without one (just started) a snapshot is due anyway
                self.refused("state_gap")
            self.stale.add(slot)
            self.on_stale(slot)
            return False
        return True

    async def fetch(self, slot: int, holder: int, snapshot: Snapshot) -> None:
        """The holder's rows of ``slot`` now, page by page: this broker's shadow of them from here on. Batches
        that arrive meanwhile are applied over it once it is in (those it already holds change nothing)."""
        during = self._during[slot] = []
        try:
            batch = await self._snapshot(slot, holder, snapshot)
            self._take_moved(batch.rows)
            rows: states.Rows = {}
            states.put(rows, batch.rows)
            shadow = self.shadows[slot] = states.Shadow(batch.stream, batch.seq, rows)
            if slot in self._overflowed:
                return  # too many batches meanwhile: stale, fetched again
            self.stale.discard(slot)
            for later in during:
                if not shadow.apply(later):
                    self.refused("state_gap")
                    self.stale.add(slot)
                    self.on_stale(slot)
                    return
        finally:
            del self._during[slot]
            self._overflowed.discard(slot)

    def _take_moved(self, rows: list[tuple[str, str, str | None]]) -> None:
        """Take-overs in a holder's rows, written down here at once (blocking: an fsync each, only when one is
        new; a scale-down's topics, once each), whatever becomes of the batch: they are facts."""
        found = [(key, value) for kind, key, value in rows if kind == moved.MOVED and value is not None]
        if found and self.moved is not None:
            new = self.moved.take(found)
            if new:
                self.moved_in(new)

    async def _snapshot(self, slot: int, holder: int, snapshot: Snapshot) -> states.Batch:
        """Every page of one snapshot of the holder's rows, as one batch."""
        page, rows, restarts = "", list[tuple[str, str, str | None]](), 0
        while True:
            batch = states.decode(await snapshot(holder, slot, page, len(rows)))
            if not batch.full or batch.slot != slot:
                raise errors.Conflict(f"slot {slot}: the holder answered no snapshot of its state rows")
            if batch.page != page:  # the first page, or the holder no longer had the snapshot: a new one
                if page:
                    restarts += 1
                    if restarts > FETCH_RESTARTS:
                        raise errors.Conflict(f"slot {slot}: the holder's snapshot of its state rows kept expiring")
                page, rows = batch.page, []
            rows.extend(batch.rows)
            if not batch.more:
                return states.Batch(slot, batch.epoch, batch.stream, batch.seq, rows, full=True)

    async def install(self, slot: int) -> None:
        """A slot this broker took over: its holder's subscriptions and MQTT rows become this broker's."""
        self.installed.add(slot)
        shadow = self.shadows.get(slot)
        if shadow is None:
            return
        records = [_record_of(client, text) for (kind, client), text in shadow.rows.items() if kind == SUB]
        self._restore(records)
        mqtt = self._mqtt()
        merged = 0  # rows
        if mqtt is not None:
            for table in durable.REPLICATED:
                rows = [_decode_row(text) for text in states.of_kind(shadow.rows, MQTT_KIND + table)]
                await asyncio.to_thread(mqtt.merge, table, rows, self._now_ms())
                merged += len(rows)
            self.merged()
        log.warning("slot %d taken over: %d clients' subscriptions and %d MQTT rows restored", slot, len(records),
                    merged)  # fmt: skip


class Collector(_Collector):
    """``lmq_replication_state_rows{slot, kind}``: the rows this broker shadows of each slot it follows;
    ``lmq_replication_state_flush_timeouts_total``: ``flushed`` calls that timed out."""

    def __init__(self, of: States) -> None:
        self._of = of

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        family = GaugeMetricFamily(
            "lmq_replication_state_rows",
            "State rows (sub, mqtt-sessions, mqtt-qos2, mqtt-wills, mqtt-retained, moved) this broker holds of each "
            "slot it follows",
            labels=["slot", "kind"],
        )
        for slot, shadow in sorted(self._of.shadows.items()):
            counts: dict[str, int] = {}
            for kind, _ in shadow.rows:
                counts[kind] = counts.get(kind, 0) + 1
            for kind, count in sorted(counts.items()):
                family.add_metric([str(slot), kind], count)
        yield family
        yield CounterMetricFamily(
            "lmq_replication_state_flush_timeouts",
            "MQTT session changes answered before their state rows reached the in-sync followers (timed out)",
            value=self._of.unflushed,
        )


def _record_text(r: saved_subscriptions.ClientRecord, lmqs: tuple[str, ...]) -> str:
    fields = {"type": r.client_type, "group": r.group, "bind": r.bind_topic, "lmqs": lmqs, "patterns": r.patterns}
    return json.dumps({**fields, "owner": r.owner}, separators=(",", ":"))


def _record_of(client_id: str, text: str) -> saved_subscriptions.ClientRecord:
    f = json.loads(text)
    owner = (str(f["owner"][0]), str(f["owner"][1]))
    lmqs, patterns = tuple(str(x) for x in f["lmqs"]), tuple(str(x) for x in f["patterns"])
    return saved_subscriptions.ClientRecord(client_id, int(f["type"]), str(f["group"]), str(f["bind"]), lmqs,
                                            patterns, owner)  # fmt: skip


def _sub_rows(records: Records, slot_of_topic: Callable[[str], int], slot: int) -> states.Rows:
    """Each client's subscriptions to topics of ``slot`` (and its patterns), as rows (on a thread)."""
    rows: states.Rows = {}
    for r in records:
        lmqs = tuple(t for t in r.lmqs if slot_of_topic(t) == slot)
        if lmqs or r.patterns:
            rows[(SUB, r.client_id)] = _record_text(r, lmqs)
    return rows


def _mqtt_rows(mqtt: durable.Durable) -> states.Rows:
    """Every row of the MQTT store's replicated tables (blocking)."""
    out: states.Rows = {}
    for table, (key_columns, _, _) in durable.REPLICATED.items():
        for row in mqtt.rows(table):
            key = json.dumps([_plain(row[c]) for c in key_columns], separators=(",", ":"))
            out[(MQTT_KIND + table, key)] = json.dumps({c: _plain(v) for c, v in row.items()}, separators=(",", ":"))
    return out


def _plain(value: object) -> object:
    """A column's value as JSON can hold it: bytes as ``{"b64": …}``."""
    if isinstance(value, bytes):
        return {"b64": base64.b64encode(value).decode()}
    return value


def _decode_row(text: str) -> dict[str, object]:
    row: dict[str, object] = json.loads(text)
    for column, value in row.items():
        if isinstance(value, dict):
            row[column] = base64.b64decode(value["b64"])
    return row
