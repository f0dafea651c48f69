"""Tag filters (issue 16 item 3): the expression parser, and filtering at read time on both stores: a message
the receiver's filter does not take is settled for the group (its commit point passes it, in order), never
delivered."""

from __future__ import annotations

import pytest

from lmq_broker import errors, model
from lmq_broker.dispatch import filters
from lmq_broker.dispatch.testing import GROUP, Lite
from lmq_broker.protocol import convert, status
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb

X = filters.parse_tags("x")
asyncio_test = pytest.mark.asyncio


# --- the parser -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("expression", ["*", "", "   ", "x || *", " * "])
def test_star_or_blank_takes_every_message_tagged_or_not(expression: str) -> None:
    tags = filters.parse_tags(expression)
    assert tags.takes_all
    assert tags.matches("x") and tags.matches(None)


@pytest.mark.parametrize(
    ("expression", "expected"),
    [("x", {"x"}), ("x||y", {"x", "y"}), (" x || y ", {"x", "y"}), ("x || || y ||", {"x", "y"}), ("x || x", {"x"})],
)
def test_tags_joined_by_double_bars(expression: str, expected: set[str]) -> None:
    assert filters.parse_tags(expression).tags == frozenset(expected)


def test_a_tag_list_takes_its_tags_only_and_never_an_untagged_message() -> None:
    tags = filters.parse_tags("a || b")
    assert tags.matches("a") and tags.matches("b")
    assert not tags.matches("c") and not tags.matches(None) and not tags.matches("a || b")


@pytest.mark.parametrize("expression", ["a | b", "a|||b", "a" * (filters.MAX_EXPRESSION_CHARS + 1)])
def test_malformed_expressions_are_illegal_filter_expressions(expression: str) -> None:
    with pytest.raises(errors.InvalidArgument) as raised:
        filters.parse_tags(expression)
    assert status.status_of(raised.value).code == pb.ILLEGAL_FILTER_EXPRESSION


def test_sql92_is_refused_as_unsupported_with_a_clear_message() -> None:
    with pytest.raises(errors.Unsupported) as raised:
        convert.tag_filter(pb.FilterExpression(type=pb.SQL, expression="a > 1"))
    answer = status.status_of(raised.value)
    assert answer.code == pb.UNSUPPORTED and "SQL92" in answer.message


def test_unspecified_and_tag_types_are_tag_expressions() -> None:
    assert convert.tag_filter(pb.FilterExpression(type=pb.FILTER_TYPE_UNSPECIFIED, expression="*")).takes_all
    assert convert.tag_filter(pb.FilterExpression(type=pb.TAG, expression="a||b")).tags == frozenset({"a", "b"})


# --- filtering at read time: lite topics ----------------------------------------------------------------------


@asyncio_test
async def test_only_matching_messages_are_delivered_and_the_others_are_committed_in_order(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, "P", ["t1"])
    for body, tag in [(b"a", "x"), (b"b", "y"), (b"c", "x"), (b"d", None)]:
        await lite.send("t1", body, tag=tag)
    got = await lite.receive("c1", tags=X)
    assert [d.message.body for d in got] == [b"a", b"c"]
    assert lite.committed("t1") in (None, 0)  # "a" is leased: nothing passes it yet
    await lite.dispatcher.ack(GROUP, got[0].receipt_handle)
    assert lite.committed("t1") == 2  # "b" counted as consumed for the group
    await lite.dispatcher.ack(GROUP, got[1].receipt_handle)
    assert lite.committed("t1") == 4  # and "d" after "c": lag is zero
    assert await lite.receive("c1", tags=X) == []


@asyncio_test
async def test_a_topic_with_only_filtered_messages_is_committed_without_a_delivery(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, "P", ["t1"])
    for _ in range(3):
        await lite.send("t1", tag="y")
    assert await lite.receive("c1", tags=X) == []
    assert lite.committed("t1") == 3
    await lite.send("t1", b"wanted", tag="x")
    (got,) = await lite.receive("c1", tags=X)
    assert got.message.body == b"wanted" and got.attempt == 1


@asyncio_test
async def test_a_match_behind_more_filtered_messages_than_a_batch_is_reached_in_one_receive(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, "P", ["t1"])
    for _ in range(7):
        await lite.send("t1", tag="y")
    await lite.send("t1", b"wanted", tag="x")
    (got,) = await lite.receive("c1", batch=2, tags=X)
    assert got.message.body == b"wanted"
    await lite.dispatcher.ack(GROUP, got.receipt_handle)
    assert lite.committed("t1") == 8


@asyncio_test
async def test_a_redelivery_the_filter_no_longer_takes_is_settled(lite: Lite) -> None:
    await lite.dispatcher.add_lite("c1", GROUP, "P", ["t1"])
    await lite.send("t1", tag="y")
    (first,) = await lite.receive("c1", invisible_ms=1_000)  # no filter: taken
    lite.clock.advance(1_000)
    lite.dispatcher.tick()
    assert await lite.receive("c1", tags=X) == []  # its redelivery is not taken by "x": passed
    assert lite.committed("t1") == 1
    assert first.attempt == 1


# --- filtering at read time: normal topics --------------------------------------------------------------------
@asyncio_test
async def test_a_normal_topic_delivers_matching_tags_only_and_commits_the_rest(lite: Lite) -> None:
    lite.store.put_parent_topic(model.ParentTopic("N", model.MessageType.NORMAL, queue_count=1))
    lite.dispatcher.metadata_changed()
    queue = model.QueueId("N", 0)
    tags = ["y", "y", "x", None, "z", "y", "y", "y", "z"]
    await lite.dispatcher.send(
        [model.NewMessage(f"n{i}", "N", f"{i}".encode(), (queue,), tag=tag) for i, tag in enumerate(tags)]
    )
    either = filters.parse_tags("x || z")
    got = []
    for _ in range(4):  # no wait: a receive that passed filtered messages reads on by itself
        got += await lite.dispatcher.receive_normal(
            "r1", "readers", "N", batch=1, invisible_ms=10_000, poll_ms=0, tags=either
        )
    assert [d.message.body for d in got] == [b"2", b"4", b"8"]
    for d in got:
        await lite.dispatcher.ack("readers", d.receipt_handle)
    assert lite.store.get_offset(queue, "readers") == len(tags)
