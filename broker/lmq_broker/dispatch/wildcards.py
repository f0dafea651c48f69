"""Clients of wildcard lite groups: a group with ``wildcard`` receives every lite topic of its bind topic.

RocketMQ 5.5.0's ``lite.sub.wildcard``: a client registers with COMPLETE_ADD (the set it sends is ignored;
the clients' ``subscribe_lite_all()``), holds no per-topic subscriptions and counts against no
subscription quota. Arrivals are matched by parent topic: one dict lookup per arrived LMQ while any
wildcard client is registered, nothing otherwise; no walk over all topics happens on the serving path
(a registering client's backlog is found by the dispatcher's paged catch-up, off the loop).
"""

from __future__ import annotations

from collections.abc import Mapping

from lmq_broker import model


class Wildcards:
    def __init__(self) -> None:
        self._by_parent: dict[str, dict[str, set[str]]] = {}  # parent -> group -> client ids
        self._of_client: dict[str, tuple[str, str]] = {}  # client id -> (parent, group)

    def __bool__(self) -> bool:
        return bool(self._of_client)

    def add(self, client_id: str, group: str, parent: str) -> bool:
        """Register; True when the client was not registered for this (parent, group) already."""
        if self._of_client.get(client_id) == (parent, group):
            return False
        self.remove(client_id)
        self._of_client[client_id] = (parent, group)
        self._by_parent.setdefault(parent, {}).setdefault(group, set()).add(client_id)
        return True

    def remove(self, client_id: str) -> tuple[str, str] | None:
        where = self._of_client.pop(client_id, None)
        if where is not None:
            parent, group = where
            groups = self._by_parent[parent]
            groups[group].discard(client_id)
            if not groups[group]:
                del groups[group]
            if not groups:
                del self._by_parent[parent]
        return where

    def registration(self, client_id: str) -> tuple[str, str] | None:
        """(parent, group) of a wildcard client, or None."""
        return self._of_client.get(client_id)

    def groups_of_lmq(self, lmq: str) -> Mapping[str, set[str]]:
        """Wildcard groups (and their clients) that receive the LMQ ``lmq``."""
        if not self._by_parent or not lmq.startswith(model.LMQ_PREFIX):
            return {}
        return self._by_parent.get(parent_of(lmq), {})

    def holds(self, client_id: str, lmq: str) -> bool:
        where = self._of_client.get(client_id)
        return where is not None and lmq.startswith(model.LMQ_PREFIX) and parent_of(lmq) == where[0]


def parent_of(lmq: str) -> str:
    """``%LMQ%$parent$lite`` -> ``parent`` (names never contain ``$``)."""
    return lmq.split(model.LMQ_SEPARATOR, 2)[1]
