"""SyncLiteSubscription: PARTIAL_ADD / PARTIAL_REMOVE / COMPLETE_ADD / COMPLETE_REMOVE of lite topics.

rocketmq-python-client 5.1.2 sends ``subscribe_lite("session-1")`` as one entry per character (it extends
the repeated field with the string). Left alone, the subscription would only take effect with the
client's next COMPLETE_ADD, up to 30 s later. For exactly that client (x-mq-language PYTHON and
x-mq-client-version 5.1.2), a PARTIAL_ADD whose entries are all single characters is read as one name:
their concatenation, in order. Any other client, action or entry shape is taken literally.
"""

from __future__ import annotations

from lmq_broker import errors
from lmq_broker.protocol import convert, status
from lmq_broker.protocol.context import Caller
from lmq_broker.protocol.edge import Edge
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb


def lite_topics(request: spb.SyncLiteSubscriptionRequest, caller: Caller) -> list[str]:
    names = list(request.lite_topic_set)
    if (
        request.action == pb.PARTIAL_ADD
        and caller.splits_lite_topics
        and len(names) > 1
        and all(len(name) == 1 for name in names)
    ):
        return ["".join(names)]
    return names


async def handle(
    edge: Edge, request: spb.SyncLiteSubscriptionRequest, caller: Caller
) -> spb.SyncLiteSubscriptionResponse:
    client_id = caller.require_client_id()
    action = request.action
    if action not in (pb.PARTIAL_ADD, pb.PARTIAL_REMOVE, pb.COMPLETE_ADD, pb.COMPLETE_REMOVE):
        raise errors.InvalidArgument(f"unknown lite subscription action {action}")
    parent = convert.topic_name(request.topic)
    group = convert.group_name(request.group)
    names = lite_topics(request, caller)
    dispatcher = edge.dispatcher
    if action in (pb.PARTIAL_ADD, pb.COMPLETE_ADD):
        for name in names:
            convert.lite_topic_or_pattern(name, edge.config.max_lite_topic_size)
    if action == pb.PARTIAL_ADD:
        offset = convert.offset_reset(request.offset_option) if request.HasField("offset_option") else None
        await dispatcher.add_lite(client_id, group, parent, names, namespace=caller.namespace, offset=offset)
    elif action == pb.PARTIAL_REMOVE:
        await dispatcher.remove_lite(client_id, group, parent, names)
    elif action == pb.COMPLETE_ADD:
        await dispatcher.replace_lite(client_id, group, parent, names, namespace=caller.namespace)
    else:
        await dispatcher.remove_all_lite(client_id, group, parent)
    return spb.SyncLiteSubscriptionResponse(status=status.ok())
