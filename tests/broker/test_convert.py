"""MessageReader builds NewMessage through slot descriptors (a fast path): it must equal the dataclass value."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmq_broker import errors, model
from lmq_broker.dispatch import catalog
from lmq_broker.dispatch.testing import config_for
from lmq_broker.protocol import convert
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb

NOW_MS = 1_700_000_000_123


def reader(tmp_path: Path, **overrides: object) -> convert.MessageReader:
    config = config_for(tmp_path, **overrides)
    parents = {
        "LITE_P": model.ParentTopic("LITE_P", model.MessageType.LITE),
        "NORMAL_P": model.ParentTopic("NORMAL_P", model.MessageType.NORMAL, queue_count=1),
    }
    return convert.MessageReader(catalog.Snapshot(config, parents), config, NOW_MS, 0)


def test_a_lite_message_reads_as_the_dataclass_would_build_it(tmp_path: Path) -> None:
    msg = pb.Message(
        topic=pb.Resource(name="LITE_P"),
        body=b"payload",
        user_properties={"k": "v"},
        system_properties=pb.SystemProperties(
            message_id="ID1",
            message_type=pb.LITE,
            lite_topic="chat-1",
            tag="TagA",
            keys=["a", "b"],
            born_host="10.0.0.1",
            born_timestamp=convert.timestamp_of(1_690_000_000_005),
        ),
    )
    read = reader(tmp_path).read(msg)
    expected = model.NewMessage(
        message_id="ID1",
        topic="LITE_P",
        body=b"payload",
        queues=(model.QueueId.lmq("LITE_P", "chat-1"),),
        lite_topic="chat-1",
        message_type=model.MessageType.LITE,
        born_timestamp_ms=1_690_000_000_005,
        born_host="10.0.0.1",
        tag="TagA",
        keys=("a", "b"),
        message_group=None,
        user_properties={"k": "v"},
    )
    assert read == expected
    assert hash(read.queues) == hash(expected.queues)


def test_a_bare_normal_message_takes_defaults_and_now(tmp_path: Path) -> None:
    msg = pb.Message(
        topic=pb.Resource(name="NORMAL_P"), body=b"x", system_properties=pb.SystemProperties(message_id="ID2")
    )
    read = reader(tmp_path).read(msg)
    assert read == model.NewMessage(
        message_id="ID2",
        topic="NORMAL_P",
        body=b"x",
        queues=(model.QueueId("NORMAL_P", 0),),
        message_type=model.MessageType.NORMAL,
        born_timestamp_ms=NOW_MS,
    )


def test_the_parent_queue_is_indexed_when_configured(tmp_path: Path) -> None:
    msg = pb.Message(
        topic=pb.Resource(name="LITE_P"),
        body=b"x",
        system_properties=pb.SystemProperties(message_id="ID3", lite_topic="t"),
    )
    read = reader(tmp_path, index_parent_queue=True).read(msg)
    assert read.queues == (model.QueueId("LITE_P", 0), model.QueueId.lmq("LITE_P", "t"))


def test_the_body_limit_is_the_configured_one(tmp_path: Path) -> None:
    msg = pb.Message(
        topic=pb.Resource(name="LITE_P"),
        body=b"x" * 11,
        system_properties=pb.SystemProperties(message_id="ID4", lite_topic="t"),
    )
    with pytest.raises(errors.BodyTooLarge):
        reader(tmp_path, max_body_bytes=10).read(msg)
