"""Looking a resent QoS 2 publish's message up in a lite topic (``exactly.find``, what ``MqttFindMessage``
answers another broker with), on a real store: from an offset, at most a cap of messages a call, and where the
next call goes on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lmq_broker import model
from lmq_broker.dispatch import testing as dispatch_testing
from lmq_broker.mqtt import exactly
from lmq_broker.storage import store as lmq_store
from lmq_broker.storage.api import Store

PARENT = "F"
LITE = "f"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = lmq_store.open_store(dispatch_testing.config_for(tmp_path / "s").store)
    opened.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
    opened.append([message(f"M{i}") for i in range(10)])
    yield opened
    opened.close()


def message(message_id: str) -> model.NewMessage:
    return model.NewMessage(
        message_id=message_id,
        topic=PARENT,
        body=b"x",
        queues=(model.QueueId.lmq(PARENT, LITE),),
        lite_topic=LITE,
        message_type=model.MessageType.LITE,
        born_timestamp_ms=0,
        born_host="h",
    )


def test_a_message_at_or_after_the_offset_is_found_and_one_before_it_is_not(store: Store) -> None:
    assert exactly.find(store, PARENT, LITE, "M7", 7) == (True, None)
    assert exactly.find(store, PARENT, LITE, "M6", 7) == (False, None)  # read to the end: not there
    assert exactly.find(store, PARENT, LITE, "M1", 10) == (False, None)  # nothing after the end


def test_a_call_reads_at_most_its_limit_and_says_where_to_go_on(store: Store) -> None:
    assert exactly.find(store, PARENT, LITE, "M8", 0, limit=4) == (False, 4)
    assert exactly.find(store, PARENT, LITE, "M8", 4, limit=4) == (False, 8)
    assert exactly.find(store, PARENT, LITE, "M8", 8, limit=4) == (True, None)
    assert exactly.find(store, PARENT, LITE, "nope", 8, limit=4) == (False, None)
