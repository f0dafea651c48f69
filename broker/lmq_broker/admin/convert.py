"""Plain values ↔ lmq.admin.v1 messages, and failed calls → errors: the admin plane's only mapping.

The service and the one client (``admin.client``, which the CLI, the operator and the reclaim job all use)
read the same functions, so a field added to the proto is mapped once, for every caller.

Decoding is exact except where proto3 cannot tell "unset" from zero: an unset message type means LITE,
an unset queue count means 1 and an unset subscription model means SHARED. Other zeros (quotas,
capacities) are given their defaults by ``validation`` on the server, which knows the broker's
configuration.

Lite-topic rows travel as columns (one repeated field per attribute): ``LITE_TOPIC_COLUMNS`` names them
for both ends, so a scanned batch can be handed back to CompareAndDelete as it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import grpc

from lmq_broker import errors, model
from lmq_broker.admin import codes
from lmq_broker.admin.results import (
    BrokerInfo,
    ClientInfo,
    ClusterInfo,
    DeleteOutcome,
    GroupInfo,
    GroupLag,
    LiteClientInfo,
    LiteTopicDescription,
    LiteTopicInfo,
    LiteTopicLag,
    LiteTopicPage,
    ParentTopicInfo,
    ReclaimRecording,
)
from lmq_broker.dispatch.api import ClientView
from lmq_broker.dispatch.offsets import OffsetPolicy, OffsetReset
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as pb

LITE_TOPIC_COLUMNS: Final = (
    "parent",
    "lite",
    "created_ms",
    "last_store_ms",
    "last_consume_ms",
    "min_offset",
    "max_offset",
)
SUBSCRIBERS_COLUMN: Final = "subscriber_count"
FULLY_CONSUMED_COLUMN: Final = "fully_consumed"
# What CompareAndDelete needs of each row, by the same names as a scan's columns.
COMPARE_COLUMNS: Final = ("parent", "lite", "max_offset", "last_store_ms", "last_consume_ms")

_MODELS: Final = {
    pb.SHARED: model.SubscriptionModel.SHARED,
    pb.EXCLUSIVE: model.SubscriptionModel.EXCLUSIVE,
}


def parent_topic_to_pb(topic: model.ParentTopic) -> pb.ParentTopic:
    return pb.ParentTopic(
        name=topic.name,
        message_type=int(topic.message_type),
        expiration_minutes=topic.expiration_minutes,
        max_lite_topics=topic.max_lite_topics,
        queue_count=topic.queue_count,
    )


def parent_topic_from_pb(message: pb.ParentTopic) -> model.ParentTopic:
    number = message.message_type or int(model.MessageType.LITE)
    try:
        message_type = model.MessageType(number)
    except ValueError:
        raise errors.InvalidArgument(
            f"topic.message_type: unknown message type {number}", field="topic.message_type"
        ) from None
    return model.ParentTopic(
        name=message.name,
        message_type=message_type,
        expiration_minutes=message.expiration_minutes,
        max_lite_topics=message.max_lite_topics,
        queue_count=message.queue_count or 1,
    )


def lite_group_to_pb(group: model.LiteGroup) -> pb.LiteGroup:
    return pb.LiteGroup(
        name=group.name,
        bind_topic=group.bind_topic,
        model=pb.EXCLUSIVE if group.model is model.SubscriptionModel.EXCLUSIVE else pb.SHARED,
        client_quota=group.client_quota,
        ready_capacity=group.ready_capacity,
        retry=pb.RetryPolicy(max_attempts=group.retry.max_attempts, backoff_ms=group.retry.backoff_ms),
        fifo=group.fifo,
        consume_enabled=group.consume_enabled,
        wildcard=group.wildcard,
        lite_patterns=group.lite_patterns,
    )


def lite_group_from_pb(message: pb.LiteGroup) -> model.LiteGroup:
    if message.model not in (pb.SUBSCRIPTION_MODEL_UNSPECIFIED, *_MODELS):
        raise errors.InvalidArgument(f"group.model: unknown subscription model {message.model}", field="group.model")
    return model.LiteGroup(
        name=message.name,
        bind_topic=message.bind_topic,
        model=_MODELS.get(message.model, model.SubscriptionModel.SHARED),
        client_quota=message.client_quota,
        ready_capacity=message.ready_capacity,
        retry=model.RetryPolicy(max_attempts=message.retry.max_attempts, backoff_ms=tuple(message.retry.backoff_ms)),
        fifo=message.fifo,
        consume_enabled=message.consume_enabled,
        wildcard=message.wildcard,
        lite_patterns=tuple(message.lite_patterns),
    )


def quota_to_pb(quota: model.Quota) -> pb.Quota:
    return pb.Quota(
        scope=quota.scope,
        max_lite_topics=quota.max_lite_topics,
        max_subscriptions_per_client=quota.max_subscriptions_per_client,
        max_send_rate=quota.max_send_rate,
    )


def quota_from_pb(message: pb.Quota) -> model.Quota:
    return model.Quota(
        scope=message.scope,
        max_lite_topics=message.max_lite_topics,
        max_subscriptions_per_client=message.max_subscriptions_per_client,
        max_send_rate=message.max_send_rate,
    )


def reclaim_run_to_pb(run: model.ReclaimRun) -> pb.ReclaimRun:
    return pb.ReclaimRun(**{name: getattr(run, name) for name in model.RECLAIM_RUN_FIELDS})


def reclaim_run_from_pb(message: pb.ReclaimRun) -> model.ReclaimRun:
    return model.ReclaimRun(**{name: getattr(message, name) for name in model.RECLAIM_RUN_FIELDS})


def parent_info_to_pb(
    topic: model.ParentTopic, lite_topic_count: int, last_reclaim: model.ReclaimRun | None
) -> pb.GetParentTopicResponse:
    reply = pb.GetParentTopicResponse(topic=parent_topic_to_pb(topic), lite_topic_count=lite_topic_count)
    if last_reclaim is not None:
        reply.last_reclaim.CopyFrom(reclaim_run_to_pb(last_reclaim))
    return reply


def last_reclaim_from_pb(message: pb.GetParentTopicResponse) -> model.ReclaimRun | None:
    return reclaim_run_from_pb(message.last_reclaim) if message.HasField("last_reclaim") else None


def lite_topic_to_pb(meta: model.LiteTopicMeta, subscriber_count: int = 0) -> pb.LiteTopicInfo:
    return pb.LiteTopicInfo(
        parent=meta.parent,
        lite=meta.lite,
        created_ms=meta.created_ms,
        last_store_ms=meta.last_store_ms,
        last_consume_ms=meta.last_consume_ms,
        min_offset=meta.min_offset,
        max_offset=meta.max_offset,
        subscriber_count=subscriber_count,
    )


def lite_topic_from_pb(message: pb.LiteTopicInfo) -> model.LiteTopicMeta:
    return model.LiteTopicMeta(
        parent=message.parent,
        lite=message.lite,
        created_ms=message.created_ms,
        last_store_ms=message.last_store_ms,
        last_consume_ms=message.last_consume_ms,
        min_offset=message.min_offset,
        max_offset=message.max_offset,
    )


def scan_batch_to_pb(metas: Sequence[model.LiteTopicMeta]) -> pb.ScanLiteTopicsResponse:
    batch = pb.ScanLiteTopicsResponse()
    batch.parent.extend([m.parent for m in metas])
    batch.lite.extend([m.lite for m in metas])
    batch.created_ms.extend([m.created_ms for m in metas])
    batch.last_store_ms.extend([m.last_store_ms for m in metas])
    batch.last_consume_ms.extend([m.last_consume_ms for m in metas])
    batch.min_offset.extend([m.min_offset for m in metas])
    batch.max_offset.extend([m.max_offset for m in metas])
    return batch


def scan_batch_columns(
    batch: pb.ScanLiteTopicsResponse, *, with_subscribers: bool, with_fully_consumed: bool
) -> dict[str, list[Any]]:
    columns: dict[str, list[Any]] = {name: list(getattr(batch, name)) for name in LITE_TOPIC_COLUMNS}
    if with_subscribers:
        columns[SUBSCRIBERS_COLUMN] = list(batch.subscriber_count)
    if with_fully_consumed:
        columns[FULLY_CONSUMED_COLUMN] = list(batch.fully_consumed)
    return columns


def compare_request(
    columns: Mapping[str, Sequence[Any]],
    start: int,
    stop: int,
    *,
    require_no_subscribers: bool,
    dry_run: bool,
    subscribers_seen: bool = False,
) -> pb.CompareAndDeleteRequest:
    """Rows ``start:stop`` of ``columns`` (keyed by ``COMPARE_COLUMNS``, and ``SUBSCRIBERS_COLUMN`` with
    ``subscribers_seen``; other columns are ignored)."""
    return pb.CompareAndDeleteRequest(
        parent=columns["parent"][start:stop],
        lite=columns["lite"][start:stop],
        expected_max_offset=columns["max_offset"][start:stop],
        expected_last_store_ms=columns["last_store_ms"][start:stop],
        expected_last_consume_ms=columns["last_consume_ms"][start:stop],
        require_no_subscribers=require_no_subscribers,
        dry_run=dry_run,
        expected_subscriber_count=columns[SUBSCRIBERS_COLUMN][start:stop] if subscribers_seen else (),
    )


def row_count(columns: Mapping[str, Sequence[Any]], names: Iterable[str]) -> int:
    """The common length of ``names`` in ``columns``; InvalidArgument when one is missing or they differ."""
    lengths: dict[str, int] = {}
    for name in names:
        if name not in columns:
            raise errors.InvalidArgument(f"column {name!r} is missing", field=name)
        lengths[name] = len(columns[name])
    if len(set(lengths.values())) > 1:
        raise errors.InvalidArgument(f"columns differ in length: {lengths}")
    return next(iter(lengths.values()), 0)


# ---- replies, as the client returns them ----------------------------------------------------------------


def parent_info_from_pb(message: pb.GetParentTopicResponse) -> ParentTopicInfo:
    return ParentTopicInfo(parent_topic_from_pb(message.topic), message.lite_topic_count, last_reclaim_from_pb(message))


def group_info_from_pb(message: pb.GetLiteGroupResponse) -> GroupInfo:
    return GroupInfo(lite_group_from_pb(message.group), message.subscription_count, message.client_count, message.lag)


def lite_info_from_pb(message: pb.LiteTopicInfo) -> LiteTopicInfo:
    return LiteTopicInfo(lite_topic_from_pb(message), message.subscriber_count)


def page_from_pb(message: pb.ListLiteTopicsResponse) -> LiteTopicPage:
    return LiteTopicPage(tuple(lite_info_from_pb(t) for t in message.topics), message.next_start_after)


def description_from_pb(message: pb.DescribeLiteTopicResponse) -> LiteTopicDescription:
    return LiteTopicDescription(
        lite_topic_from_pb(message.topic), dict(message.group_offsets), tuple(message.subscribed_clients)
    )


def client_view_to_pb(c: ClientView) -> pb.ClientInfo:
    return pb.ClientInfo(
        client_id=c.client_id,
        group=c.group,
        topic=c.topic,
        client_type=c.client_type,
        subscription_count=c.subscription_count,
        last_seen_ms=c.last_seen_ms,
        ready_events=c.ready_events,
    )


def client_from_pb(c: pb.ClientInfo) -> ClientInfo:
    return ClientInfo(
        c.client_id, c.group, c.topic, c.client_type, c.subscription_count, c.last_seen_ms, c.ready_events
    )


def broker_info_from_pb(message: pb.GetBrokerInfoResponse) -> BrokerInfo:
    return BrokerInfo(
        broker_name=message.broker_name,
        version=message.version,
        lite_topic_count=message.lite_topic_count,
        subscription_count=message.subscription_count,
        client_count=message.client_count,
        stored_bytes=message.stored_bytes,
        undrained_messages=message.undrained_messages,
        parent_topic_count=message.parent_topic_count,
        group_count=message.group_count,
    )


def cluster_info_from_pb(message: pb.GetClusterResponse) -> ClusterInfo:
    return ClusterInfo(
        tuple(message.members),
        tuple(message.ring_sizes),
        message.slot,
        message.leaving,
        message.undrained_messages,
        message.drained,
        message.source,
        message.admin_port,
        message.epoch,
        message.ring_fixed,
    )


def recording_from_pb(message: pb.RecordReclaimRunsResponse) -> ReclaimRecording:
    return ReclaimRecording(tuple(message.recorded), tuple(message.unknown_parents), tuple(message.superseded))


_OUTCOMES: Final[Mapping[int, DeleteOutcome]] = {int(o): o for o in DeleteOutcome}


def outcomes_from_pb(message: pb.CompareAndDeleteResponse, rows: int, endpoint: str) -> list[DeleteOutcome]:
    """One outcome per row sent, in order; a reply that does not give exactly that is an error for the call."""
    if len(message.outcome) != rows:
        raise errors.LmqError(f"{endpoint}: {len(message.outcome)} outcomes for {rows} rows", endpoint=endpoint)
    try:
        return [_OUTCOMES[o] for o in message.outcome]  # a dict: a reclaim run maps millions of them
    except KeyError as exc:  # a broker newer than this client
        raise errors.LmqError(f"{endpoint}: unknown delete outcome {exc}", endpoint=endpoint) from None


def lite_client_from_pb(message: pb.GetLiteClientResponse) -> LiteClientInfo:
    return LiteClientInfo(client_from_pb(message.client), tuple(message.lite_topics))


def group_lag_to_pb(lag: GroupLag) -> pb.GetGroupLagResponse:
    return pb.GetGroupLagResponse(
        group=lag.group,
        bind_topic=lag.bind_topic,
        lag=lag.lag,
        latency_ms=lag.latency_ms,
        lagging_topics=lag.lagging_topics,
        top=[
            pb.LiteTopicLag(
                lite=t.lite,
                lag=t.lag,
                committed_offset=t.committed_offset,
                max_offset=t.max_offset,
                latency_ms=t.latency_ms,
            )
            for t in lag.top
        ],
        unclaimed_messages=lag.unclaimed_messages,
        unclaimed_topics=lag.unclaimed_topics,
    )


def group_lag_from_pb(message: pb.GetGroupLagResponse) -> GroupLag:
    return GroupLag(
        message.group,
        message.bind_topic,
        message.lag,
        message.latency_ms,
        message.lagging_topics,
        tuple(LiteTopicLag(t.lite, t.lag, t.committed_offset, t.max_offset, t.latency_ms) for t in message.top),
        message.unclaimed_messages,
        message.unclaimed_topics,
    )


_POLICIES: Final[Mapping[pb.OffsetPolicy.ValueType, OffsetPolicy]] = {
    pb.OFFSET_MIN: OffsetPolicy.MIN,
    pb.OFFSET_MAX: OffsetPolicy.MAX,
    pb.OFFSET_VALUE: OffsetPolicy.OFFSET,
    pb.OFFSET_TAIL_N: OffsetPolicy.TAIL_N,
}
_POLICY_NUMBERS: Final = {v: k for k, v in _POLICIES.items()}


def offset_reset_to_pb(group: str, lites: Sequence[str], option: OffsetReset) -> pb.ResetLiteOffsetsRequest:
    if option.policy not in _POLICY_NUMBERS:
        raise errors.InvalidArgument(f"offset policy {option.policy.value} cannot be reset to", field="policy")
    return pb.ResetLiteOffsetsRequest(
        group=group, lites=lites, policy=_POLICY_NUMBERS[option.policy], value=option.value
    )


def offset_reset_from_pb(message: pb.ResetLiteOffsetsRequest) -> OffsetReset:
    policy = _POLICIES.get(message.policy)
    if policy is None:
        raise errors.InvalidArgument(f"policy: unknown or unset offset policy {message.policy}", field="policy")
    return OffsetReset(policy, message.value)


# ---- failed calls ---------------------------------------------------------------------------------------

_AWAY: Final = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def call_error(error: grpc.RpcError, rpc: str, endpoint: str) -> errors.LmqError:
    """What a failed call raises: the class the broker named in ``lmq-error`` (``codes.error_for``), fields
    ``code``, ``rpc`` and ``endpoint``. The message is the broker's own, except when the broker was away or
    late: then it names the call, the endpoint and the status (``GetBrokerInfo on host:8081: UNAVAILABLE: …``)."""
    call: Any = error  # what grpc and grpc.aio raise for a failed call is also the call (code, details, trailers)
    if not callable(getattr(call, "code", None)):  # failed before any call existed
        return errors.BrokerUnavailable(f"{rpc} on {endpoint}: {error}", rpc=rpc, endpoint=endpoint)
    code: grpc.StatusCode = call.code()
    class_name = next((v for k, v in call.trailing_metadata() or () if k == codes.ERROR_CLASS_KEY), "")
    details = call.details() or ""
    message = details or code.name
    if code in _AWAY:
        message = f"{rpc} on {endpoint}: {code.name}" + (f": {details}" if details else "")
    return codes.error_for(code, message, class_name if isinstance(class_name, str) else "", rpc=rpc, endpoint=endpoint)
