"""``forwarding._alone``: a request's answer cut out of the reply to the batch it was forwarded in is the same
message, byte for byte, whether its entries are copied out (the plain way, kept for replies that are not OK) or
filled into a template (an OK reply's, as ``_merge`` fills one), for any ids, offsets and slice."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lmq_broker import model
from lmq_broker.cluster import forwarding
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.handlers import send_message

RESULTS = st.lists(
    st.tuples(st.text(max_size=40), st.integers(0, 2**62)).map(
        lambda r: model.AppendResult(r[0], (model.QueueId.lmq("P", "t"),), (r[1],), 0)
    ),
    min_size=1,
    max_size=12,
)


def copied(reply: spb.SendMessageResponse, start: int, end: int) -> spb.SendMessageResponse:
    return spb.SendMessageResponse(status=reply.status, entries=reply.entries[start:end])


@settings(max_examples=200, deadline=None)
@given(RESULTS, st.data())
def test_an_ok_batch_reply_cut_by_template_is_the_copied_cut(
    results: list[model.AppendResult], data: st.DataObject
) -> None:
    # the owner's reply as the access process gets it: encoded, sent over the hop, parsed
    reply = spb.SendMessageResponse.FromString(send_message.reply(results).SerializeToString())
    start = data.draw(st.integers(0, len(results) - 1))
    end = data.draw(st.integers(start + 1, len(results)))
    cut = forwarding._alone((reply, start, end))
    assert cut == copied(reply, start, end)
    assert cut.SerializeToString() == copied(reply, start, end).SerializeToString()


def test_a_reply_that_is_not_ok_is_cut_by_copying() -> None:
    refused = pb.Status(code=pb.INTERNAL_ERROR, message="not the owner")
    reply = spb.SendMessageResponse(status=refused, entries=[spb.SendResultEntry(status=refused)] * 3)
    assert forwarding._alone((reply, 1, 2)) == copied(reply, 1, 2)
