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


def test_a_full_sync_that_began_before_a_subscribe_keeps_what_the_subscribe_added() -> None:
    f = fanout()
    f._remember(*KEY, pb.COMPLETE_ADD, ["a"], 1)
    # full sync #3 was built from the client's set before subscribe #2 of "x" ended; #2 ends first
    f._remember(*KEY, pb.PARTIAL_ADD, ["x"], 2)
    f._remember(*KEY, pb.COMPLETE_ADD, ["a", "s-*"], 1 + 0)  # a complete set begun before #2 (number 1)
    assert held(f) == ({"a", "x"}, {"s-*"})
    f._remember(*KEY, pb.COMPLETE_ADD, ["a"], 4)  # a complete set begun after: it is the client's whole set
    assert held(f) == ({"a"}, set())
    assert f.intents == 1


def test_a_removal_takes_away_only_what_was_added_before_it_began() -> None:
    f = fanout()
    f._remember(*KEY, pb.PARTIAL_ADD, ["x"], 5)
    f._remember(*KEY, pb.PARTIAL_REMOVE, ["x"], 4)  # begun before the add, ended after it: the add wins
    assert held(f) == ({"x"}, set())
    f._remember(*KEY, pb.PARTIAL_REMOVE, ["x"], 6)
    assert held(f) == (set(), set()) and f.intents == 0
    f._remember(*KEY, pb.PARTIAL_ADD, ["y"], 8)
    f._remember(*KEY, pb.COMPLETE_REMOVE, [], 7)
    assert held(f) == ({"y"}, set())
