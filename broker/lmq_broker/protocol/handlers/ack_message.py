"""AckMessage: settle each entry; the commit point moves over every acknowledged prefix and is persisted
before the answer, so a restarted consumer resumes exactly after its last ack."""

from __future__ import annotations

from collections.abc import Sequence

from lmq_broker import errors
from lmq_broker.protocol import convert, status
from lmq_broker.protocol.context import Caller
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb

MAX_ENTRIES = 1024


async def handle(edge: Edge, request: spb.AckMessageRequest, caller: Caller) -> spb.AckMessageResponse:
    group = convert.group_name(request.group)
    convert.topic_name(request.topic)
    if not request.entries or len(request.entries) > MAX_ENTRIES:
        raise errors.InvalidArgument(f"an ack carries 1..{MAX_ENTRIES} entries")
    results = []
    for entry in request.entries:
        try:
            await edge.dispatcher.ack(group, entry.receipt_handle, client_id=caller.client_id)
            entry_status = status.ok()
            edge.metrics.acks.inc()
        except errors.LmqError as exc:
            entry_status = status.status_of(exc)
        results.append(
            spb.AckMessageResultEntry(
                message_id=entry.message_id, receipt_handle=entry.receipt_handle, status=entry_status
            )
        )
    return spb.AckMessageResponse(status=overall(results), entries=results)


def overall(results: Sequence[spb.AckMessageResultEntry]) -> pb.Status:
    """The status of a whole ack: OK, the one entry's, or MULTIPLE_RESULTS."""
    codes = {r.status.code for r in results}
    if codes == {pb.OK}:
        return status.ok()
    if len(results) == 1:
        return results[0].status
    return pb.Status(code=pb.MULTIPLE_RESULTS, message="entries have different results")
