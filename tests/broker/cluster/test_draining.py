"""A leaving broker's hand-over decision (cluster.draining.Handoff) with replication: once the take-over of a
drained topic was asked for, nothing more of it is stored at the leaving broker, even when that ask failed and
the topic reads as undrained afterwards. The new owner may have taken it over where it ended here (its answer
lost on the way back); a message stored here after that would sit at an offset where the new owner stores
another (docs/replication.md, *Changing the ring with R > 1*). The whole path on three brokers:
tests/broker/replication/test_replication.py."""

from __future__ import annotations

import asyncio

import pytest

from lmq_broker import errors, model
from lmq_broker.cluster.draining import Handoff

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
