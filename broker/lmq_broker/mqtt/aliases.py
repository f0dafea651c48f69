"""Outbound topic aliases (MQTT 5.0 section 3.3.2.3.4): a subscriber that declares a Topic Alias Maximum gets
each topic it receives often as a two-byte alias instead of its name.

Per connection (aliases do not outlive it, MQTT-3.3.2-7): the first PUBLISH of a topic carries the name and a
new alias, later ones an empty name and the alias. When every alias the client allows is taken, the least
recently used one is given to the new topic (sent with its name, which rebinds it, section 3.3.2.3.4). At most
``MAX`` aliases whatever the client allows, so a connection holds at most ``MAX`` topic names here.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final

MAX: Final = 64  # aliases per connection, whatever the client's Topic Alias Maximum


class Outbound:
    """The aliases this broker gave one connection's topics, least recently used first."""

    __slots__ = ("_by_topic", "_limit")

    def __init__(self, client_maximum: int) -> None:
        self._limit = min(MAX, client_maximum)  # 0: the client takes none (MQTT-3.3.2-9)
        self._by_topic: OrderedDict[str, int] = OrderedDict()

    def choose(self, topic: str) -> tuple[int | None, bool]:
        """The alias for ``topic``'s next PUBLISH and whether the name must travel with it (a new binding);
        (None, True) when the client takes no aliases. Nothing changes until ``sent``."""
        if not self._limit:
            return None, True
        alias = self._by_topic.get(topic)
        if alias is not None:
            return alias, False
        if len(self._by_topic) < self._limit:
            return len(self._by_topic) + 1, True
        return next(iter(self._by_topic.values())), True  # the least recently used one, rebound

    def sent(self, topic: str, alias: int | None, bound: bool) -> None:
        """The PUBLISH chosen by ``choose`` went out: ``alias`` names ``topic`` from now on (None: no alias)."""
        if alias is None:
            return
        if bound and len(self._by_topic) >= self._limit:
            self._by_topic.popitem(last=False)
        self._by_topic[topic] = alias
        self._by_topic.move_to_end(topic)
