"""MQTT 5 wills waiting for their delay: rows in the durable store (``durable.Will``), not objects in memory.

A connection that ends without DISCONNECT and with a will delay writes its will there; one timer waits for the
will due first (read from the store's index on the due time, nothing else is held), publishes it and deletes
its row. The client id connecting again takes the row out (the will is dropped, or published at once with a
clean start: the old session ends then). So a delayed will costs disk, not memory, and survives a restart:
a restarted broker publishes what fell due meanwhile at once. The delay is capped (``--mqtt-max-will-delay-s``,
``limits``), as is a will's size.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Final

from lmq_broker.dispatch.dispatcher import Dispatcher
from lmq_broker.mqtt import codec, durable, properties, stats, wire
from lmq_broker.mqtt.properties import Context

log = logging.getLogger(__name__)

RECHECK_S: Final = 60.0  # the wall clock may jump: the timer looks again at least this often
RETRY_S: Final = 5.0  # a will that could not be published waits this long before it is tried again

Publish = Callable[[str, str, codec.Will], Awaitable[bool]]  # (client id, host, will) -> published


class Wills:
    def __init__(self, store: durable.Durable, dispatcher: Dispatcher, publish: Publish, counts: stats.Stats) -> None:
        self._store = store
        self._dispatcher = dispatcher
        self._publish = publish
        self._stats = counts
        self._changed = asyncio.Event()
        self._timer: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._timer = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            await asyncio.wait([self._timer])  # its cancellation, not this wait's: that one goes on up
            self._timer = None

    async def delay(self, client_id: str, host: str, will: codec.Will, delay_s: int) -> None:
        """Keep ``will`` until ``delay_s`` from now; published at once when it cannot be kept."""
        props = None if will.properties is None else properties.encode(will.properties)
        due = self._dispatcher.wall_clock() + delay_s * 1000
        row = durable.Will(client_id, due, will.topic, will.payload, will.qos, will.retain, props, host)
        try:
            await self._dispatcher.run(self._store.put_will, row)
        except Exception:
            self._stats.errors[stats.WILL_WRITE] += 1
            log.exception("mqtt client %s: delayed will not stored; published now", client_id)
            await self._publish(client_id, host, will)
            return
        self._changed.set()

    def wake(self) -> None:
        """Rows were written behind the timer's back (a slot taken over, ``replication.stating``): look again."""
        self._changed.set()

    async def take(self, client_id: str) -> tuple[str, codec.Will] | None:
        """The client id's waiting will (and the host it came from), no longer waiting."""
        row = await self._dispatcher.run(self._store.take_will, client_id)
        return None if row is None else (row.host, _will_of(row))

    async def _run(self) -> None:
        while True:
            self._changed.clear()
            try:
                wait_s = await self._step()
            except Exception:  # the store failing (a full disk...): the will waits on, tried again
                self._stats.errors[stats.WILL_PUBLISH] += 1
                log.exception("mqtt: delayed wills not read or published; tried again in %.0f s", RETRY_S)
                wait_s = RETRY_S
            if wait_s > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), wait_s)

    async def _step(self) -> float:
        """Publish the will due first if it is due; how long to wait before the next step."""
        first = await self._dispatcher.run(self._store.next_will)
        if first is None:
            return RECHECK_S
        client_id, due = first
        wait_s = min(RECHECK_S, (due - self._dispatcher.wall_clock()) / 1000)
        if wait_s <= 0:
            await self._fire(client_id, due)
        return wait_s

    async def _fire(self, client_id: str, due_ms: int) -> None:
        row = await self._dispatcher.run(self._store.take_will, client_id, due_ms)
        if row is None:  # taken meanwhile
            return
        try:
            published = await self._publish(client_id, row.host, _will_of(row))
        except Exception:
            log.exception("mqtt client %s: will to %s not published", client_id, row.topic)
            published = False
        if not published:  # back in the store (its row was taken), tried again a little later
            self._stats.errors[stats.WILL_PUBLISH] += 1
            retry = durable.Will(client_id, self._dispatcher.wall_clock() + int(RETRY_S * 1000), row.topic,
                                 row.payload, row.qos, row.retain, row.properties, row.host)  # fmt: skip
            await self._dispatcher.run(self._store.put_will, retry)


def _will_of(row: durable.Will) -> codec.Will:
    props = None if row.properties is None else properties.decode(wire.Reader(row.properties), Context.WILL)
    return codec.Will(row.topic, row.payload, row.qos, row.retain, props)
