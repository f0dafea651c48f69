"""Consumer lag per lite group on ``/metrics``: the same figure ``GetLiteGroup`` reports, counted on a worker
thread at most every refresh interval (dispatch/lag.py), read by a real broker's metrics endpoint."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Callable

import pytest
from waiting import eventually_async

from lmq_broker import app, model
from lmq_broker.admin import inspection
from lmq_broker.dispatch import lag
from lmq_broker.dispatch import testing as dispatch_testing
from lmq_broker.dispatch.api import ClientView, StaticLiveView
from lmq_broker.dispatch.registry import ClientState
from lmq_broker.storage import memory
from lmq_broker.storage.api import Store

pytestmark = pytest.mark.asyncio
P, OTHER = dispatch_testing.PARENT, "Q"


def _send(store: Store, parent: str, lite: str, count: int) -> None:
    store.append([dispatch_testing.lite_message(lite, parent=parent, message_id=f"{lite}-{i}") for i in range(count)])


def _state() -> tuple[Store, dict[str, frozenset[str]]]:
    """Two parents; groups G and H on P, I on Q. G committed on a, subscribes b; H committed on c only; I never
    consumed nor subscribed anything."""
    store = memory.MemoryStore()
    for parent in (P, OTHER):
        store.put_parent_topic(model.ParentTopic(parent))
    for name, parent in (("G", P), ("H", P), ("I", OTHER)):
        store.put_group(model.LiteGroup(name, parent))
    _send(store, P, "a", 5)
    _send(store, P, "b", 3)
    _send(store, P, "c", 4)
    _send(store, P, "empty", 0)
    _send(store, OTHER, "x", 7)
    store.commit_offset(model.QueueId.lmq(P, "a"), "G", 2)  # 3 left
    store.commit_offset(model.QueueId.lmq(P, "c"), "H", 4)  # consumed to the end
    subscribed = {"G": frozenset({model.QueueId.lmq(P, "b").topic})}  # b: no commit yet, all 3 count
    return store, subscribed


async def test_the_walk_counts_what_get_lite_group_reports() -> None:
    store, subscribed = _state()
    found = lag.walk(store, subscribed)
    assert found == {("G", P): 3 + 3, ("H", P): 0, ("I", OTHER): 0}
    # the admin view computes the same figures its own way (live subscriptions looked up on the loop)
    live = StaticLiveView(subs={model.QueueId.lmq(P, "b"): ["c1"]}, client_views=[ClientView("c1", "G", P, 0, 1, 0, 0)])
    groups = store.list_groups()
    by_admin = await inspection.group_lags(store, live, groups)
    assert by_admin == {group: count for (group, _), count in found.items()}


async def test_subscriptions_are_taken_per_group_from_the_registry() -> None:
    clients = [
        ClientState("c1", group="G", lite_topics={"%LMQ%$P$a", "%LMQ%$P$b"}),
        ClientState("c2", group="G", lite_topics={"%LMQ%$P$c"}),
        ClientState("c3", group="H"),
        ClientState("producer"),
    ]
    assert lag.subscriptions(clients) == {"G": frozenset({"%LMQ%$P$a", "%LMQ%$P$b", "%LMQ%$P$c"})}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_read_returns_the_last_walk_and_refreshes_only_when_stale() -> None:
    store, _ = _state()
    clock = Clock()
    walks: list[float] = []

    async def run(fn: Callable[[], lag.Lags | None]) -> lag.Lags | None:
        walks.append(clock.now)
        clock.now += 5.0  # the walk took 5 s: the next one waits 50 s (a tenth of the time walking)
        return await asyncio.to_thread(fn)

    board = lag.LagBoard(store, list, asyncio.get_running_loop(), run, clock=clock, refresh_min_s=30.0)
    assert board.read() == {}  # nothing walked yet: the read starts the first walk
    await eventually_async(lambda: bool(walks) and board.walk_seconds == 5.0, "the first walk")
    assert board.read()[("G", P)] == 3  # b is not subscribed (no clients): only a's 3
    _send(store, P, "a", 2)
    clock.now += 49.0
    assert board.read()[("G", P)] == 3 and len(walks) == 1  # still fresh: no walk, the old figure
    clock.now += 1.0
    assert board.read()[("G", P)] == 3  # stale: the old figure now, a walk in the background
    await eventually_async(lambda: len(walks) == 2 and board.read()[("G", P)] == 5, "the second walk")
    assert walks[1] - walks[0] == 55.0
    assert board.read() and len(walks) == 2


async def test_a_failed_walk_keeps_the_last_figures() -> None:
    store, _ = _state()
    clock = Clock()
    walked: list[lag.Lags | None] = []

    async def run(fn: Callable[[], lag.Lags | None]) -> lag.Lags | None:
        walked.append(await asyncio.to_thread(fn))
        return walked[-1]

    board = lag.LagBoard(store, list, asyncio.get_running_loop(), run, clock=clock)
    board.read()
    await eventually_async(board.read, "the first walk's figures")
    store.close()
    clock.now += 60.0
    before = board.read()  # stale: starts a walk, which fails on the closed store
    await eventually_async(lambda: len(walked) == 2, "the second walk")
    assert walked[1] is None and board.read() == before and before[("G", P)] == 3


async def test_a_real_broker_exports_consumer_lag_per_group_and_parent(broker: app.Broker) -> None:
    assert broker.store is not None and broker.dispatcher is not None
    broker.store.put_parent_topic(model.ParentTopic(P))
    broker.store.put_group(model.LiteGroup("workers", P))
    broker.dispatcher.metadata_changed()
    await broker.dispatcher.send([dispatch_testing.lite_message("t1", message_id=f"m{i}") for i in range(4)])
    broker.store.commit_offset(model.QueueId.lmq(P, "t1"), "workers", 1)

    def scrape() -> str:
        url = f"http://127.0.0.1:{broker.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())

    wanted = f'lmq_consumer_lag{{group="workers",parent="{P}"}} 3.0'
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    text = ""
    while wanted not in text:  # the first scrape starts the walk; a later one shows it
        assert loop.time() < deadline, text
        text = await asyncio.to_thread(scrape)
        await asyncio.sleep(0.05)  # between scrapes, run on a thread: this loop serves the endpoint
    [walk_line] = [x for x in text.splitlines() if x.startswith("lmq_consumer_lag_walk_seconds ")]
    assert 0.0 < float(walk_line.split()[1]) < 5.0
    group = broker.store.get_group("workers")
    assert group is not None
    assert await inspection.group_lags(broker.store, broker.dispatcher, [group]) == {"workers": 3}
