"""The intents an access broker keeps of its clients' subscriptions (cluster.fanout): changes that run at the
same time and end in any order, as a client's periodic full sync crossing a subscribe that waits for a down
broker. The whole path with real brokers and the official clients: tests/e2e/test_cluster_faults.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lmq_broker.cluster.fanout import Fanout
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb

pytestmark = pytest.mark.unit
KEY = ("client-1", "group", "P")


def fanout() -> Any:
    links = SimpleNamespace(config=SimpleNamespace(max_subscriptions_per_broker=100), size=2)
    return Fanout(links, owners=None, subscribers=lambda *_: [], known=lambda _: True)  # type: ignore[arg-type]


def held(f: Any) -> tuple[set[str], set[str]]:
    intent = f._intents.get(KEY)
    return (set(intent.lites), set(intent.patterns)) if intent else (set(), set())


def test_a_full_sync_that_began_before_a_subscribe_ended_keeps_what_the_subscribe_added() -> None:
    f = fanout()
    f._remember(*KEY, pb.COMPLETE_ADD, ["a"], 1, 2)
    # the subscribe of "x" begins (3), the client's full sync begins (4) without "x", the subscribe ends (5),
    # then the full sync (6)
    f._remember(*KEY, pb.PARTIAL_ADD, ["x"], 3, 5)
    f._remember(*KEY, pb.COMPLETE_ADD, ["a", "s-*"], 4, 6)
    assert held(f) == ({"a", "x"}, {"s-*"})
    f._remember(*KEY, pb.COMPLETE_ADD, ["a"], 7, 8)  # begun after the subscribe ended: the client's whole set
    assert held(f) == ({"a"}, set())
    assert f.intents == 1


def test_a_removal_takes_away_only_what_was_added_before_it_began() -> None:
    f = fanout()
    f._remember(*KEY, pb.PARTIAL_ADD, ["x"], 2, 5)
    f._remember(*KEY, pb.PARTIAL_REMOVE, ["x"], 4, 6)  # begun before the add ended: the add wins
    assert held(f) == ({"x"}, set())
    f._remember(*KEY, pb.PARTIAL_REMOVE, ["x"], 7, 8)
    assert held(f) == (set(), set()) and f.intents == 0
    f._remember(*KEY, pb.PARTIAL_ADD, ["y"], 9, 11)
    f._remember(*KEY, pb.COMPLETE_REMOVE, [], 10, 12)
    assert held(f) == ({"y"}, set())
