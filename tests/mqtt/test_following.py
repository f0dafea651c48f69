"""The index of sessions told of new parents (``mqtt.following``): a new parent reaches the sessions holding a
first-level wildcard filter and those naming it at the first level, and no other (cost: the sessions concerned,
not every connection)."""

from __future__ import annotations

import asyncio
from typing import cast

from lmq_broker.dispatch.dispatcher import Dispatcher
from lmq_broker.mqtt import following, held, topics
from lmq_broker.mqtt.following import Followers


class Session:
    def __init__(self) -> None:
        self.told = 0

    async def follow_parents(self) -> None:
        self.told += 1


def test_a_new_parent_is_told_to_the_sessions_it_concerns_only() -> None:
    followers = Followers(cast(Dispatcher, None))  # ``_tell`` needs no dispatcher
    wild, named, other, gone = Session(), Session(), Session(), Session()
    followers.index(wild, True, ())
    followers.index(named, False, ("chat",))
    followers.index(other, False, ("orders",))
    followers.index(gone, True, ("chat",))
    followers.index(gone, False, ())  # its filters ended: out of the index
    assert followers.size() == 3
    asyncio.run(followers._tell(frozenset({"chat"})))
    assert (wild.told, named.told, other.told, gone.told) == (1, 1, 0, 0)
    asyncio.run(followers._tell(frozenset({"metrics"})))
    assert (wild.told, named.told, other.told, gone.told) == (2, 1, 0, 0)
    assert followers.told == 3


def test_what_a_sessions_filters_reach_is_read_from_the_default_parent() -> None:
    space = topics.Space("mqtt-default", frozenset({"chat"}))
    subs: held.Subs = {}
    for text in ("#", "orders/+/x", "plain/topic", "chat/#"):
        held.add(subs, space.subscriptions_of(text), 1)
    assert held.reaches(subs, "mqtt-default") == (True, frozenset({"orders", "chat"}))
    later = topics.Space("mqtt-default", frozenset({"chat", "orders"}))
    made = held.expand(subs, later, named_first=True)
    assert sorted(made) == [("orders", ("#",)), ("orders", ("+", "x"))]
    assert subs["orders"] == {("#",): 1 | held.EXPANDED, ("+", "x"): 1}  # its own filter's, not the wildcard's
    assert following.TELL_AT_ONCE > 0
