"""The SendMessage reply is filled column-wise from a template: it must equal the reply built entry by entry."""

from __future__ import annotations

import pytest

from lmq_broker import model
from lmq_broker.protocol import status
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.handlers import send_message

LMQ = model.QueueId.lmq("P", "t")


@pytest.mark.parametrize("count", [1, 3, 15, 16, 1000])
def test_reply_equals_the_entry_by_entry_reply(count: int) -> None:
    offsets = [0, 1, 2**40, 127, 128][:count] + list(range(5, count))[: max(0, count - 5)]
    results = [
        model.AppendResult(f"ID\u00e9{i}", (model.QueueId("P", 0), LMQ), (7, offset), 1)
        for i, offset in enumerate(offsets)
    ]
    expected = spb.SendMessageResponse(status=status.ok())
    for result in results:
        expected.entries.add(status=status.ok(), message_id=result.message_id, offset=result.queue_offsets[-1])
    reply = send_message.reply(results)
    assert reply == expected
    assert reply.SerializeToString() == expected.SerializeToString()
    assert all(entry.status.code == status.ok().code for entry in reply.entries)
