"""Parents created after a filter was made: the sessions whose filters reach into them are told.

A first-level wildcard filter (``#``, ``+/x``) reaches into every named parent, and ``chat/#`` into ``chat``
once it exists, as does ``chat/x`` (its topic is kept there from then on); what a session holds in a named
parent is made when the filter is (``held``), and so are a share's parts (``sharing``). So when a LITE parent
topic appears (admin ``PutParentTopic`` here, or sent on from another member of a cluster; the operator's; all
of them announced by ``Dispatcher.metadata_changed``) the sessions that hold such filters or shares must reach
into it too. Only they are told: an index of the sessions holding a first-level wildcard filter, and per first
level those naming it with more levels after it, so a new parent costs the sessions it concerns, not a scan of
every connection. The dispatcher's watcher only takes note; one task here reloads the metadata
and tells them, a bounded number at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import Final, Protocol

from lmq_broker.dispatch.dispatcher import Dispatcher
from lmq_broker.mqtt import topics

log = logging.getLogger(__name__)

TELL_AT_ONCE: Final = 64  # sessions following a new parent concurrently


class Follower(Protocol):
    async def follow_parents(self) -> None:
        """Reach into the parents created since the filters were made."""
        ...


class Followers:
    """The index of sessions whose filters reach into parents created later, and the task that tells them."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self._dispatcher = dispatcher
        self._wild: set[Follower] = set()  # hold a first-level wildcard filter: every new parent concerns them
        self._named: dict[str, set[Follower]] = {}  # parent name -> those holding ``<it>/...`` in the default one
        self._firsts: dict[Follower, frozenset[str]] = {}  # what each is indexed under in ``_named``
        self._known: frozenset[str] = frozenset()
        self._changed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self.told = 0  # sessions told of new parents (tests, ``stats``)

    def index(self, who: Follower, wild: bool, firsts: Iterable[str]) -> None:
        """What ``who`` now holds (``held.reaches``); nothing: it leaves the index."""
        if wild:
            self._wild.add(who)
        else:
            self._wild.discard(who)
        now = frozenset(firsts)
        before = self._firsts.pop(who, frozenset())
        for first in before - now:
            members = self._named.get(first)
            if members is not None:
                members.discard(who)
                if not members:
                    del self._named[first]
        for first in now - before:
            self._named.setdefault(first, set()).add(who)
        if now:
            self._firsts[who] = now

    def size(self) -> int:
        return len(self._wild) + len(self._firsts)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._known = topics.space_of(await self._dispatcher.metadata()).parents
        self._dispatcher.watch_metadata(self._note)
        self._task = self._loop.create_task(self._run())

    def _note(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._changed.set)

    async def _run(self) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
            try:
                parents = topics.space_of(await self._dispatcher.metadata()).parents
            except Exception:  # the next change reloads again
                log.exception("mqtt: metadata not reloaded: new parents not followed")
                continue
            new, self._known = parents - self._known, parents
            if new:
                await self._tell(new)

    async def _tell(self, new: frozenset[str]) -> None:
        who = set(self._wild)
        for parent in new:
            who |= self._named.get(parent, set())
        members = list(who)
        for i in range(0, len(members), TELL_AT_ONCE):
            chunk = members[i : i + TELL_AT_ONCE]
            results = await asyncio.gather(*(m.follow_parents() for m in chunk), return_exceptions=True)
            for result in results:
                if isinstance(result, Exception):
                    log.warning("mqtt: a session did not follow new parents %s: %s", sorted(new), result)
            self.told += len(chunk)

    async def stop(self) -> None:
        self._dispatcher.unwatch_metadata(self._note)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
