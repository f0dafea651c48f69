"""A leaving broker's hand-over decision (cluster.draining.Handoff) with replication: once the take-over of a
drained topic was asked for, nothing more of it is stored at the leaving broker, even when that ask failed and
the topic reads as undrained afterwards. The new owner may have taken it over where it ended here (its answer
lost on the way back); a message stored here after that would sit at an offset where the new owner stores
another (docs/replication.md, *Changing the ring with R > 1*). The whole path on three brokers:
tests/broker/replication/test_replication.py. And the walk by which a leaving broker finds its consumed topics
to hand over without a send (at every --replicas; tests/broker/cluster/test_peers.py has the whole path)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from lmq_broker import errors, model
from lmq_broker.cluster import draining
from lmq_broker.cluster.draining import Handoff
from lmq_broker.dispatch import testing as dispatch_testing
from lmq_broker.storage import store as lmq_store

pytestmark = pytest.mark.unit
LMQ = model.QueueId.lmq("P", "t").topic


def test_a_topic_whose_take_over_was_asked_for_is_never_stored_here_again_even_once_undrained() -> None:
    state = {"drained": True, "answers": ["lost", "ok"]}
    asked: list[str] = []

    async def drained(parent: str, lite: str) -> bool:
        return bool(state["drained"])

    async def move(parent: str, lite: str) -> None:
        return None

    async def taken_over(lmq: str, leaving: int, slot: int) -> None:
        asked.append(lmq)
        answers = state["answers"]
        assert isinstance(answers, list)
        if answers.pop(0) == "lost":  # done at the new owner, its answer lost (a deadline, a dropped connection)
            raise errors.BrokerUnavailable("Adopt: DEADLINE_EXCEEDED")

    async def run() -> None:
        handoff = Handoff(drained, move)
        handoff.taken_over, handoff.slots, handoff.leaves = taken_over, lambda lmq: (2, 1), lambda lmq: True
        with pytest.raises(errors.BrokerUnavailable):
            await handoff.keep("P", "t")
        state["drained"] = False  # a new group bound to P, or a commit point reset: undrained here now
        assert not await handoff.keep("P", "t"), "stored at the leaving broker after its take-over was asked for"
        assert handoff.moved(LMQ)
        assert asked == [LMQ, LMQ]

    asyncio.run(run())


def test_an_undrained_topic_never_asked_for_is_still_stored_here() -> None:
    async def drained(parent: str, lite: str) -> bool:
        return False

    async def move(parent: str, lite: str) -> None:
        raise AssertionError("an undrained topic is not moved")

    async def run() -> None:
        handoff = Handoff(drained, move)
        assert await handoff.keep("P", "t")
        handoff.release("P", "t")
        assert not handoff.moved(LMQ)

    asyncio.run(run())


def test_the_hand_over_walk_goes_round_the_store_past_what_was_handed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leaving broker's passes over its consumed topics (``draining.hand_over_idle``): each pass takes the next
    topics not handed over yet after where the last one stopped, skipping handed-over ones, and starts from the
    first again once it reached the end (a real store)."""
    monkeypatch.setattr(draining, "HAND_OVER_BATCH", 2)
    monkeypatch.setattr(draining, "SCAN_PAGE", 2)
    store = lmq_store.open_store(dispatch_testing.config_for(tmp_path).store)
    try:
        store.put_parent_topic(model.ParentTopic("P", model.MessageType.LITE))
        names = [f"t{i}" for i in range(7)]
        for name in names:
            store.append([dispatch_testing.lite_message(name, message_id=name)])
        moved = {model.QueueId.lmq("P", "t1").topic}
        passes: list[list[str]] = []
        cursor = ""
        for _ in range(5):
            found, cursor = draining.not_handed_over(store, moved.__contains__, None, cursor)
            passes.append([lite for _, lite in found])
            moved.update(model.QueueId.lmq("P", lite).topic for _, lite in found if lite != "t5")
        assert passes == [["t0", "t2"], ["t3", "t4"], ["t5", "t6"], [], ["t5"]]  # t5 stays undrained
        assert cursor == ""
        mine = lambda topic: topic.endswith("t5")  # noqa: E731
        assert draining.not_handed_over(store, lambda topic: False, mine) == ([("P", "t5")], "")
    finally:
        store.close()
