"""Typed client of one broker's admin service (lmq.admin.v1), for the operator, the reclaim job and the CLI.

    with AdminClient("broker-0.lmq:8081", timeout_s=5.0) as admin:
        admin.put_parent_topic(ParentTopic("orders", expiration_minutes=60))   # -> Applied(value, created)
        admin.get_parent_topic("orders")                                        # -> ParentTopicInfo (+ last_reclaim)
        admin.delete_parent_topic("orders", purge_lite_topics=True)             # -> ParentTopicDeletion
        admin.list_parent_topics()                                              # -> list[ParentTopicInfo]
        admin.put_group(LiteGroup("g", bind_topic="orders"))                    # -> Applied[LiteGroup]
        admin.get_group("g") / admin.list_groups()                              # -> GroupInfo (counts, lag)
        admin.delete_group("g")                                                 # -> bool (False: was absent)
        admin.put_quota(Quota("parent:orders", max_lite_topics=10_000))         # -> Applied[Quota]
        admin.delete_quota("parent:orders") / admin.list_quotas()
        admin.describe_lite_topic("orders", "session-1")                        # -> LiteTopicDescription
        admin.list_lite_topics("orders", start_after="", limit=100)             # -> LiteTopicPage
        admin.list_clients(group=None)                                          # -> list[ClientInfo]
        admin.broker_info(with_undrained=True)                                  # -> BrokerInfo
        admin.cluster(with_undrained=False) / admin.set_cluster(members, sizes)  # -> ClusterInfo
        admin.record_reclaim_runs([ReclaimRun("orders", "run-1", start, finish, reclaimed=5)])  # -> ReclaimRecording
        for columns in admin.scan_lite_topics_columns("orders", batch_size=10_000):
            ...  # dict: column name -> list, one entry per row (LITE_TOPIC_COLUMNS [+ optional ones])
        admin.compare_and_delete(columns, require_no_subscribers=True, dry_run=False)  # -> list[DeleteOutcome]

Model values (``lmq_broker.model``) go in and come out; ``Applied.value`` is what the broker stored, with
its defaults filled in. Failures raise ``lmq_broker.errors`` classes, mapped from status codes in one
table (``admin.codes``): the class the broker raised when it is ours (``GroupNotFound``, ``Conflict``,
``InvalidArgument``...), ``Unauthorized`` for a rejected signature, ``BrokerUnavailable`` when the broker
cannot be reached or does not answer within the timeout.

Lite topics move in columns, never one object per row: a scan yields ``dict[str, list]`` batches that
``pyarrow.RecordBatch.from_pydict`` or Spark take as they are, and ``compare_and_delete`` takes the same
columns back (``COMPARE_COLUMNS`` are required, others ignored), split into requests of
``DELETE_ROWS_PER_CALL`` rows, and returns one ``DeleteOutcome`` per row in input order. With
``subscribers_seen=True`` the ``subscriber_count`` column (a scan ``with_subscribers``) is sent too: only
subscribers beyond those the scan saw then keep a row.

Unary calls use ``timeout_s``; a scan stream and each compare-and-delete request use ``long_timeout_s``.
Every call is signed with the broker's *admin* key pair (``access_key``/``secret_key``, or ``keys``) as the
v2 clients sign theirs; the broker refuses unsigned admin calls unless it runs with ``--admin-anonymous``.
``AdminClient.resolved`` finds the pair as ``lmq-admin`` does (``admin.credentials.resolve``: the
``LMQ_ADMIN_ACCESS_KEY``/``LMQ_ADMIN_SECRET_KEY`` variables, else ``<data-dir>/admin-credentials.json``).
``AsyncAdminClient`` offers the same methods as coroutines (each call runs the blocking client in a worker
thread), for asyncio callers such as kopf.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Generic, TypeVar, cast

import grpc

from lmq_broker import errors, model
from lmq_broker.admin import codes, convert, credentials
from lmq_broker.admin.convert import COMPARE_COLUMNS, LITE_TOPIC_COLUMNS
from lmq_broker.protocol import auth
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as pb
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2_grpc

__all__ = [
    "COMPARE_COLUMNS",
    "LITE_TOPIC_COLUMNS",
    "AdminClient",
    "Applied",
    "AsyncAdminClient",
    "BrokerInfo",
    "ClientInfo",
    "DeleteOutcome",
    "GroupInfo",
    "LiteTopicDescription",
    "LiteTopicInfo",
    "LiteTopicPage",
    "ParentTopicDeletion",
    "ParentTopicInfo",
    "ReclaimRecording",
]

DELETE_ROWS_PER_CALL: Final = 5_000  # ~0.5 MB per request: well under gRPC's default 4 MiB receive limit
_CHANNEL_OPTIONS: Final = (("grpc.max_receive_message_length", 64 * 1024 * 1024),)

T = TypeVar("T")


class DeleteOutcome(enum.IntEnum):
    """What compare-and-delete did with one row; same numbers as ``lmq.admin.v1.DeleteOutcome``."""

    DELETED = pb.DELETED
    KEPT_CHANGED = pb.KEPT_CHANGED  # received a message or a consume after the scan
    KEPT_SUBSCRIBED = pb.KEPT_SUBSCRIBED  # require_no_subscribers, and a subscriber beyond those expected
    NOT_FOUND = pb.NOT_FOUND  # already gone (an idempotent re-run)
    WOULD_DELETE = pb.WOULD_DELETE  # dry run


@dataclass(frozen=True, slots=True)
class Applied(Generic[T]):
    value: T  # as stored by the broker, defaults filled in
    created: bool


@dataclass(frozen=True, slots=True)
class ParentTopicInfo:
    topic: model.ParentTopic
    lite_topic_count: int
    last_reclaim: model.ReclaimRun | None = None  # the newest reclaim run recorded on this broker, if any


@dataclass(frozen=True, slots=True)
class ParentTopicDeletion:
    deleted: bool  # False: there was no such parent topic
    lite_topics_deleted: int


@dataclass(frozen=True, slots=True)
class ReclaimRecording:
    """Where each run of ``record_reclaim_runs`` went, by parent name."""

    recorded: tuple[str, ...]
    unknown_parents: tuple[str, ...]  # the broker holds no such parent topic
    superseded: tuple[str, ...]  # the broker keeps the record of a run that started later


@dataclass(frozen=True, slots=True)
class GroupInfo:
    group: model.LiteGroup
    subscription_count: int
    client_count: int
    lag: int  # messages the group has still to consume, summed over its lite topics


@dataclass(frozen=True, slots=True)
class LiteTopicInfo:
    meta: model.LiteTopicMeta
    subscriber_count: int


@dataclass(frozen=True, slots=True)
class LiteTopicDescription:
    meta: model.LiteTopicMeta
    group_offsets: Mapping[str, int]  # group -> committed offset (next to consume)
    subscribed_clients: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LiteTopicPage:
    topics: tuple[LiteTopicInfo, ...]
    next_start_after: str  # "" on the last page


@dataclass(frozen=True, slots=True)
class ClientInfo:
    client_id: str
    group: str
    topic: str
    client_type: int  # apache.rocketmq.v2.ClientType number
    subscription_count: int
    last_seen_ms: int
    ready_events: int


@dataclass(frozen=True, slots=True)
class BrokerInfo:
    broker_name: str
    version: str
    lite_topic_count: int
    subscription_count: int
    client_count: int
    stored_bytes: int
    undrained_messages: int  # -1 when not computed (with_undrained=False)
    parent_topic_count: int
    group_count: int


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    members: tuple[str, ...]  # ring slots' endpoints, in slot order
    ring_sizes: tuple[int, ...]  # oldest first; the last is today's ring (members past it are leaving)
    slot: int  # this broker's; -1: no member
    leaving: bool
    undrained_messages: int  # -1 when not computed
    drained: bool
    source: str  # "flags" or "admin"


def _cluster_info(message: pb.GetClusterResponse) -> ClusterInfo:
    return ClusterInfo(
        tuple(message.members),
        tuple(message.ring_sizes),
        message.slot,
        message.leaving,
        message.undrained_messages,
        message.drained,
        message.source,
    )


def _group_info(message: pb.GetLiteGroupResponse) -> GroupInfo:
    return GroupInfo(
        convert.lite_group_from_pb(message.group), message.subscription_count, message.client_count, message.lag
    )


def _parent_info(message: pb.GetParentTopicResponse) -> ParentTopicInfo:
    return ParentTopicInfo(
        convert.parent_topic_from_pb(message.topic), message.lite_topic_count, convert.last_reclaim_from_pb(message)
    )


def _lite_info(message: pb.LiteTopicInfo) -> LiteTopicInfo:
    return LiteTopicInfo(convert.lite_topic_from_pb(message), message.subscriber_count)


class AdminClient:
    """Blocking client of one broker; thread-safe (one gRPC channel shared by all calls)."""

    def __init__(
        self,
        endpoint: str,
        timeout_s: float = 5.0,
        *,
        long_timeout_s: float = 600.0,
        access_key: str = "",
        secret_key: str = "",
        keys: credentials.KeyPair | None = None,
        channel_credentials: grpc.ChannelCredentials | None = None,
        clock: Callable[[], datetime] = auth.utc_now,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.long_timeout_s = long_timeout_s
        if keys is not None:
            access_key, secret_key = keys.access_key, keys.secret_key
        self._keys = (access_key, secret_key) if access_key else None
        self._clock = clock
        if channel_credentials is None:
            self._channel = grpc.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
        else:
            self._channel = grpc.secure_channel(endpoint, channel_credentials, options=_CHANNEL_OPTIONS)
        self._stub = admin_pb2_grpc.LmqAdminStub(self._channel)

    @classmethod
    def resolved(
        cls, endpoint: str, timeout_s: float = 5.0, *, data_dir: Path | None = None, **options: Any
    ) -> AdminClient:
        """A client signing with the pair ``lmq-admin`` would find: ``LMQ_ADMIN_ACCESS_KEY``/``_SECRET_KEY``,
        else ``<data_dir>/admin-credentials.json`` (default ``LMQ_DATA_DIR``, else ``./data``); unsigned if none."""
        return cls(endpoint, timeout_s, keys=credentials.resolve(data_dir=data_dir), **options)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- plumbing ---------------------------------------------------------------------------------------
    def _metadata(self) -> tuple[tuple[str, str], ...]:
        if self._keys is None:
            return ()
        return auth.sign_metadata(*self._keys, self._clock())

    def _error(self, error: grpc.RpcError, rpc: str) -> errors.LmqError:
        if not callable(getattr(error, "code", None)):  # failed before any call existed
            return errors.BrokerUnavailable(f"{rpc} on {self.endpoint}: {error}", rpc=rpc, endpoint=self.endpoint)
        exc = cast("grpc.Call", error)  # what grpc raises for a failed call is both
        class_name = ""
        for key, value in exc.trailing_metadata() or ():
            if key == codes.ERROR_CLASS_KEY and isinstance(value, str):
                class_name = value
        message = exc.details() or exc.code().name
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            message = f"{rpc} on {self.endpoint}: {message}"
        return codes.error_for(exc.code(), message, class_name, rpc=rpc, endpoint=self.endpoint)

    def _unary(self, rpc: str, request: Any, timeout_s: float | None = None) -> Any:
        method = getattr(self._stub, rpc)
        try:
            return method(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata())
        except grpc.RpcError as exc:
            raise self._error(exc, rpc) from None

    # --- parent topics ----------------------------------------------------------------------------------
    def put_parent_topic(self, topic: model.ParentTopic) -> Applied[model.ParentTopic]:
        reply = self._unary("PutParentTopic", pb.PutParentTopicRequest(topic=convert.parent_topic_to_pb(topic)))
        return Applied(convert.parent_topic_from_pb(reply.topic), reply.created)

    def get_parent_topic(self, name: str) -> ParentTopicInfo:
        return _parent_info(self._unary("GetParentTopic", pb.GetParentTopicRequest(name=name)))

    def delete_parent_topic(self, name: str, *, purge_lite_topics: bool = False) -> ParentTopicDeletion:
        request = pb.DeleteParentTopicRequest(name=name, purge_lite_topics=purge_lite_topics)
        reply = self._unary("DeleteParentTopic", request, self.long_timeout_s if purge_lite_topics else None)
        return ParentTopicDeletion(reply.deleted, reply.lite_topics_deleted)

    def list_parent_topics(self) -> list[ParentTopicInfo]:
        reply = self._unary("ListParentTopics", pb.ListParentTopicsRequest())
        return [_parent_info(t) for t in reply.topics]

    # --- lite groups ------------------------------------------------------------------------------------
    def put_group(self, group: model.LiteGroup) -> Applied[model.LiteGroup]:
        reply = self._unary("PutLiteGroup", pb.PutLiteGroupRequest(group=convert.lite_group_to_pb(group)))
        return Applied(convert.lite_group_from_pb(reply.group), reply.created)

    def get_group(self, name: str) -> GroupInfo:
        return _group_info(self._unary("GetLiteGroup", pb.GetLiteGroupRequest(name=name)))

    def delete_group(self, name: str) -> bool:
        return bool(self._unary("DeleteLiteGroup", pb.DeleteLiteGroupRequest(name=name)).deleted)

    def list_groups(self) -> list[GroupInfo]:
        return [_group_info(g) for g in self._unary("ListLiteGroups", pb.ListLiteGroupsRequest()).groups]

    # --- quotas -----------------------------------------------------------------------------------------
    def put_quota(self, quota: model.Quota) -> Applied[model.Quota]:
        reply = self._unary("PutQuota", pb.PutQuotaRequest(quota=convert.quota_to_pb(quota)))
        return Applied(convert.quota_from_pb(reply.quota), reply.created)

    def delete_quota(self, scope: str) -> bool:
        return bool(self._unary("DeleteQuota", pb.DeleteQuotaRequest(scope=scope)).deleted)

    def list_quotas(self) -> list[model.Quota]:
        return [convert.quota_from_pb(q) for q in self._unary("ListQuotas", pb.ListQuotasRequest()).quotas]

    # --- lite topics and clients ------------------------------------------------------------------------
    def describe_lite_topic(self, parent: str, lite: str) -> LiteTopicDescription:
        reply = self._unary("DescribeLiteTopic", pb.DescribeLiteTopicRequest(parent=parent, lite=lite))
        return LiteTopicDescription(
            convert.lite_topic_from_pb(reply.topic), dict(reply.group_offsets), tuple(reply.subscribed_clients)
        )

    def list_lite_topics(self, parent: str = "", *, start_after: str = "", limit: int = 100) -> LiteTopicPage:
        """One page; across parents (``parent=""``) ``start_after`` is a ``parent$lite`` key."""
        request = pb.ListLiteTopicsRequest(parent=parent, start_after=start_after, limit=limit)
        reply = self._unary("ListLiteTopics", request)
        return LiteTopicPage(tuple(_lite_info(t) for t in reply.topics), reply.next_start_after)

    def list_clients(self, group: str | None = None) -> list[ClientInfo]:
        reply = self._unary("ListClients", pb.ListClientsRequest(group=group or ""))
        return [
            ClientInfo(
                c.client_id, c.group, c.topic, c.client_type, c.subscription_count, c.last_seen_ms, c.ready_events
            )
            for c in reply.clients
        ]

    def scan_lite_topics_columns(
        self,
        parent: str = "",
        *,
        start_after: str = "",
        end_before: str = "",
        batch_size: int = 10_000,
        with_subscribers: bool = False,
        with_fully_consumed: bool = False,
        idle_since_before_ms: int = 0,
    ) -> Generator[dict[str, list[Any]], None, None]:
        """Lite-topic metadata in key order, a batch of up to ``batch_size`` rows at a time.

        Keys are exclusive bounds: lite names within ``parent``, ``parent$lite`` across parents (``parent=""``).
        Each batch maps ``LITE_TOPIC_COLUMNS`` (plus ``subscriber_count`` / ``fully_consumed`` when asked)
        to equal-length lists. The stream is read lazily; close the iterator to stop early.
        ``idle_since_before_ms`` > 0: only topics whose last activity is before it (filtered by the broker).
        """
        request = pb.ScanLiteTopicsRequest(
            parent=parent,
            start_after=start_after,
            end_before=end_before,
            batch_size=batch_size,
            with_subscribers=with_subscribers,
            with_fully_consumed=with_fully_consumed,
            idle_since_before_ms=idle_since_before_ms,
        )
        stream = self._stub.ScanLiteTopics(request, timeout=self.long_timeout_s, metadata=self._metadata())
        try:
            for batch in stream:
                yield convert.scan_batch_columns(
                    batch, with_subscribers=with_subscribers, with_fully_consumed=with_fully_consumed
                )
        except grpc.RpcError as exc:
            raise self._error(exc, "ScanLiteTopics") from None
        finally:
            stream.cancel()  # type: ignore[no-untyped-call]  # untyped in grpc-stubs

    def compare_and_delete(
        self,
        columns: Mapping[str, Sequence[Any]],
        *,
        require_no_subscribers: bool = True,
        dry_run: bool = False,
        subscribers_seen: bool = False,
    ) -> list[DeleteOutcome]:
        """Delete each row's lite topic if unchanged since it was scanned; one outcome per row, in order."""
        names = (*COMPARE_COLUMNS, convert.SUBSCRIBERS_COLUMN) if subscribers_seen else COMPARE_COLUMNS
        rows = convert.row_count(columns, names)
        outcomes: list[DeleteOutcome] = []
        for start in range(0, rows, DELETE_ROWS_PER_CALL):
            request = convert.compare_request(
                columns,
                start,
                min(start + DELETE_ROWS_PER_CALL, rows),
                require_no_subscribers=require_no_subscribers,
                dry_run=dry_run,
                subscribers_seen=subscribers_seen,
            )
            reply = self._unary("CompareAndDeleteLiteTopics", request, self.long_timeout_s)
            outcomes.extend(DeleteOutcome(o) for o in reply.outcome)
        return outcomes

    def record_reclaim_runs(self, runs: Sequence[model.ReclaimRun]) -> ReclaimRecording:
        """Record each run as its parent's newest reclaim summary on this broker (one run per parent)."""
        request = pb.RecordReclaimRunsRequest(runs=[convert.reclaim_run_to_pb(r) for r in runs])
        reply = self._unary("RecordReclaimRuns", request)
        return ReclaimRecording(tuple(reply.recorded), tuple(reply.unknown_parents), tuple(reply.superseded))

    # --- the broker -------------------------------------------------------------------------------------
    def broker_info(self, *, with_undrained: bool = True) -> BrokerInfo:
        """``with_undrained`` walks every lite topic of the broker (see the service); it uses ``long_timeout_s``."""
        request = pb.GetBrokerInfoRequest(skip_undrained=not with_undrained)
        reply = self._unary("GetBrokerInfo", request, self.long_timeout_s if with_undrained else None)
        return BrokerInfo(
            broker_name=reply.broker_name,
            version=reply.version,
            lite_topic_count=reply.lite_topic_count,
            subscription_count=reply.subscription_count,
            client_count=reply.client_count,
            stored_bytes=reply.stored_bytes,
            undrained_messages=reply.undrained_messages,
            parent_topic_count=reply.parent_topic_count,
            group_count=reply.group_count,
        )

    # --- the cluster (docs/scale-out.md) -----------------------------------------------------------------
    def cluster(self, *, with_undrained: bool = False) -> ClusterInfo:
        request = pb.GetClusterRequest(with_undrained=with_undrained)
        return _cluster_info(self._unary("GetCluster", request, self.long_timeout_s if with_undrained else None))

    def set_cluster(
        self, members: Sequence[str], ring_sizes: Sequence[int], *, slot: int | None = None, force: bool = False
    ) -> tuple[ClusterInfo, bool]:
        """This broker's membership; returns it as now applied, and whether it changed."""
        request = pb.SetClusterRequest(members=members, ring_sizes=ring_sizes, slot=slot, force=force)
        reply = self._unary("SetCluster", request, self.long_timeout_s)
        return _cluster_info(reply.cluster), reply.changed


class AsyncAdminClient:
    """``AdminClient`` for asyncio callers: the same methods as coroutines, run in worker threads."""

    def __init__(self, endpoint: str, timeout_s: float = 5.0, **options: Any) -> None:
        self.sync = AdminClient(endpoint, timeout_s, **options)

    async def close(self) -> None:
        self.sync.close()

    async def __aenter__(self) -> AsyncAdminClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def put_parent_topic(self, topic: model.ParentTopic) -> Applied[model.ParentTopic]:
        return await asyncio.to_thread(self.sync.put_parent_topic, topic)

    async def get_parent_topic(self, name: str) -> ParentTopicInfo:
        return await asyncio.to_thread(self.sync.get_parent_topic, name)

    async def delete_parent_topic(self, name: str, *, purge_lite_topics: bool = False) -> ParentTopicDeletion:
        return await asyncio.to_thread(self.sync.delete_parent_topic, name, purge_lite_topics=purge_lite_topics)

    async def list_parent_topics(self) -> list[ParentTopicInfo]:
        return await asyncio.to_thread(self.sync.list_parent_topics)

    async def put_group(self, group: model.LiteGroup) -> Applied[model.LiteGroup]:
        return await asyncio.to_thread(self.sync.put_group, group)

    async def get_group(self, name: str) -> GroupInfo:
        return await asyncio.to_thread(self.sync.get_group, name)

    async def delete_group(self, name: str) -> bool:
        return await asyncio.to_thread(self.sync.delete_group, name)

    async def list_groups(self) -> list[GroupInfo]:
        return await asyncio.to_thread(self.sync.list_groups)

    async def put_quota(self, quota: model.Quota) -> Applied[model.Quota]:
        return await asyncio.to_thread(self.sync.put_quota, quota)

    async def delete_quota(self, scope: str) -> bool:
        return await asyncio.to_thread(self.sync.delete_quota, scope)

    async def list_quotas(self) -> list[model.Quota]:
        return await asyncio.to_thread(self.sync.list_quotas)

    async def describe_lite_topic(self, parent: str, lite: str) -> LiteTopicDescription:
        return await asyncio.to_thread(self.sync.describe_lite_topic, parent, lite)

    async def list_lite_topics(self, parent: str = "", *, start_after: str = "", limit: int = 100) -> LiteTopicPage:
        return await asyncio.to_thread(self.sync.list_lite_topics, parent, start_after=start_after, limit=limit)

    async def list_clients(self, group: str | None = None) -> list[ClientInfo]:
        return await asyncio.to_thread(self.sync.list_clients, group)

    async def scan_lite_topics_columns(self, parent: str = "", **options: Any) -> AsyncIterator[dict[str, list[Any]]]:
        batches = self.sync.scan_lite_topics_columns(parent, **options)
        try:
            while (batch := await asyncio.to_thread(next, batches, None)) is not None:
                yield batch
        finally:
            batches.close()

    async def compare_and_delete(
        self,
        columns: Mapping[str, Sequence[Any]],
        *,
        require_no_subscribers: bool = True,
        dry_run: bool = False,
        subscribers_seen: bool = False,
    ) -> list[DeleteOutcome]:
        return await asyncio.to_thread(
            self.sync.compare_and_delete,
            columns,
            require_no_subscribers=require_no_subscribers,
            dry_run=dry_run,
            subscribers_seen=subscribers_seen,
        )

    async def record_reclaim_runs(self, runs: Sequence[model.ReclaimRun]) -> ReclaimRecording:
        return await asyncio.to_thread(self.sync.record_reclaim_runs, runs)

    async def broker_info(self, *, with_undrained: bool = True) -> BrokerInfo:
        return await asyncio.to_thread(self.sync.broker_info, with_undrained=with_undrained)
