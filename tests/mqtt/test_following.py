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
    assert held.reaches(subs, "mqtt-default") == (True, frozenset({"orders", "chat", "plain"}))
    later = topics.Space("mqtt-default", frozenset({"chat", "orders"}))
    made = held.expand(subs, later, named_first=True)
    assert sorted(made) == [("orders", ("#",)), ("orders", ("+", "x"))]
    assert subs["orders"] == {("#",): 1 | held.EXPANDED, ("+", "x"): 1}  # its own filter's, not the wildcard's
    assert following.TELL_AT_ONCE > 0


def test_an_exact_filter_made_before_its_parent_is_held_in_both_and_ends_in_both() -> None:
    """``chat/x`` made while no ``chat`` existed: once it does, held there too (the default parent's stays for
    what it keeps); a session saved meanwhile is restored into both; UNSUBSCRIBE ends both."""
    before = topics.Space("mqtt-default", frozenset())
    subs: held.Subs = {}
    held.add(subs, before.subscriptions_of("chat/x"), 1)
    assert subs == {"mqtt-default": {("chat", "x"): 1}}
    saved = held.texts(subs, "mqtt-default")
    assert saved == {"chat/x": 1 | held.IN_DEFAULT}
    after = topics.Space("mqtt-default", frozenset({"chat"}))
    assert held.expand(subs, after, named_first=True) == [("chat", ("x",))]
    assert subs == {"mqtt-default": {("chat", "x"): 1}, "chat": {("x",): 1}}
    assert held.texts(subs, "mqtt-default") == saved  # one filter, still marked
    restored: held.Subs = {}
    held.add_saved(restored, after, "chat/x", saved["chat/x"])
    assert restored == subs
    assert held.holds(restored, after.subscriptions_of("chat/x"), "mqtt-default")
    ended = held.remove(restored, after, after.subscriptions_of("chat/x"))
    assert ended == {"chat": [("x",)], "mqtt-default": [("chat", "x")]}
    assert not any(restored.values())
    fresh: held.Subs = {}  # made after the parent existed: the named parent's only, saved unmarked
    held.add(fresh, after.subscriptions_of("chat/x"), 1, "mqtt-default")
    assert held.texts(fresh, "mqtt-default") == {"chat/x": 1}
