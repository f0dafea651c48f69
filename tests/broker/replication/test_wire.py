"""A replica copy's two layouts (``replication.wire``): the binary one the copy path takes and its plain twin,
JSON (what a broker of an older version reads), carry the same copy."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from lmq_broker import errors, model
from lmq_broker.dispatch import testing as dispatch_testing
from lmq_broker.replication import wire


def messages() -> tuple[list[model.NewMessage], list[model.AppendResult]]:
    """Every field set, and every optional one absent; texts beyond ASCII (one a lone surrogate)."""
    full = model.NewMessage(
        message_id="ид-1",
        topic="P",
        body=b"\x00\xffbody",
        queues=(model.QueueId("P", 3), model.QueueId.lmq("P", "lite-é"), model.QueueId("%DLQ%g", 0)),
        lite_topic="lite-é",
        message_type=model.MessageType.FIFO,
        born_timestamp_ms=1_764_387_000_123,
        born_host="10.0.0.1",
        tag="tag-\U0001f600",
        keys=("k1", "", "k\ud800"),
        message_group="g",
        user_properties={"a": "1", "": "empty name", "ключ": "значение"},
        epoch=2**40,
        slot=7,
    )
    bare = model.NewMessage(message_id="", topic="T", body=b"", queues=(model.QueueId("T", 0),))
    lite = dispatch_testing.lite_message("x", b"y" * 1024, message_id="m-3", tag="")
    results = [
        model.AppendResult(full.message_id, full.queues, (7, 2**62, 0), 5),
        model.AppendResult(bare.message_id, bare.queues, (0,), 5),
        model.AppendResult(lite.message_id, lite.queues, (11, 12), 5),
    ]
    return [full, bare, lite], results


COMMITS = [
    wire.Commit(
        model.QueueId.lmq("P", "lite-é"), "group-ü", 12, (14, 15, 2**50), model.Handouts(20, ((13, 3), (16, 0)))
    ),
    wire.Commit(model.QueueId("T", 2), "", 0, ()),
]


@pytest.mark.parametrize("encode", [wire.encode, wire.encode_json], ids=["binary", "json"])
def test_both_layouts_read_back_as_they_were_written(encode: Callable[..., bytes]) -> None:
    listed, results = messages()
    data = encode(3, 9, listed, results, COMMITS)
    assert wire.is_binary(data) == (encode is wire.encode)
    copy = wire.decode(data)
    assert (copy.slot, copy.epoch, copy.messages, copy.commits) == (3, 9, listed, COMMITS)
    assert copy.offsets == [r.queue_offsets for r in results]
    assert [type(m.message_type) for m in copy.messages] == [model.MessageType] * 3
    empty = wire.decode(encode(0, 1, [], []))
    assert (empty.slot, empty.epoch, empty.messages, empty.offsets, empty.commits) == (0, 1, [], [], [])


def test_a_binary_copy_becomes_the_json_copy_for_an_older_follower() -> None:
    listed, results = messages()
    binary, plain = wire.encode(3, 9, listed, results, COMMITS), wire.encode_json(3, 9, listed, results, COMMITS)
    assert binary != plain
    assert wire.as_json(binary) == plain
    assert wire.as_json(plain) is plain


@pytest.mark.parametrize("encode", [wire.encode, wire.encode_json], ids=["binary", "json"])
def test_a_damaged_copy_is_refused(encode: Callable[..., bytes]) -> None:
    listed, results = messages()
    data = encode(3, 9, listed, results, COMMITS)
    for damaged in (data + b"x", data[:-1], data[: len(data) // 2], b"", b"\xff"):
        with pytest.raises(errors.InvalidArgument, match="unreadable replica copy"):
            wire.decode(damaged)


def test_a_binary_layout_of_another_version_is_refused() -> None:
    data = bytearray(wire.encode(3, 9, [], []))
    data[1] = wire.BINARY + 1
    with pytest.raises(errors.InvalidArgument, match="copy layout 3 is not known here"):
        wire.decode(bytes(data))
