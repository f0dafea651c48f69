"""The one client of a broker's admin service (lmq.admin.v1): ``lmq-admin``, the operator and the reclaim job
all call brokers through it, so a call is signed, bounded, mapped and its failure translated in one way.

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
        admin.cluster() / admin.set_cluster(members, ring_sizes)                # -> ClusterInfo (, changed)
        admin.get_lite_client("client-1")                                       # -> LiteClientInfo (its lite set)
        admin.group_lag("g", top_k=10)                                          # -> GroupLag (latency, top K)
        admin.reset_lite_offsets("g", ["session-1"], OffsetReset(OffsetPolicy.MAX))  # -> {lite: offset}
        admin.trigger_lite_dispatch("g", ["session-1"])                         # -> lites offered now
        admin.record_reclaim_runs([ReclaimRun("orders", "run-1", start, finish, reclaimed=5)])  # -> ReclaimRecording
        for columns in admin.scan_lite_topics_columns("orders", batch_size=10_000):
            ...  # dict: column name -> list, one entry per row (LITE_TOPIC_COLUMNS [+ optional ones])
        admin.compare_and_delete(columns, require_no_subscribers=True, dry_run=False)  # -> list[DeleteOutcome]

``AsyncAdminClient`` is the client, on grpc.aio: asyncio callers (the operator, on kopf's loop) await its
methods, and a hundred concurrent calls are a hundred calls in flight, not a queue in front of a thread pool.
``AdminClient`` is its blocking façade, for the CLI, scripts and the reclaim job's Spark executors: the
same methods, each run on one event loop thread that every blocking client of the process shares, and
``start_compare_and_delete``, which returns a future so the caller can prepare its next call meanwhile.

Model values (``lmq_broker.model``) go in and come out; ``Applied.value`` is what the broker stored, with
its defaults filled in; the other results are the plain values of ``admin.results``. Failures raise
``lmq_broker.errors`` classes (``convert.call_error``): the class the broker raised when it is ours
(``GroupNotFound``, ``Conflict``, ``InvalidArgument``...), ``Unauthorized`` for a rejected signature,
``BrokerUnavailable`` when the broker cannot be reached or does not answer within the timeout; every one
carries the status ``code``, the ``rpc`` and the ``endpoint`` in its fields.

Lite topics move in columns, never one object per row: a scan yields ``dict[str, list]`` batches that
``pyarrow.RecordBatch.from_pydict`` or Spark take as they are, and ``compare_and_delete`` takes the same
columns back (``COMPARE_COLUMNS`` are required, others ignored), split into requests of
``DELETE_ROWS_PER_CALL`` rows, and returns one ``DeleteOutcome`` per row in input order. With
``subscribers_seen=True`` the ``subscriber_count`` column (a scan ``with_subscribers``) is sent too: only
subscribers beyond those the scan saw then keep a row.

Unary calls use ``timeout_s``; a scan stream, each compare-and-delete request, a purging parent-topic delete
and ``broker_info(with_undrained=True)`` use ``long_timeout_s``. Every call is signed with the broker's
*admin* key pair (``access_key``/``secret_key``, or ``keys``) as the v2 clients sign theirs; the broker
refuses unsigned admin calls unless it runs with ``--admin-anonymous``. ``AdminClient.resolved`` finds the
pair as ``lmq-admin`` does (``admin.credentials.resolve``: the ``LMQ_ADMIN_ACCESS_KEY``/``_SECRET_KEY``
variables, else ``<data-dir>/admin-credentials.json``). ``channel_credentials`` makes the channel TLS; so does
``tls`` (``admin.tls.client_tls()``: ``--tls-ca`` or ``LMQ_TLS_CA``), with the name the certificate must carry.

A broker with peers sends the changes of parent topics, groups and quotas it gets on to every other member
(``admin.everywhere``; a member that did not take one fails the call, naming it). ``here_only=True`` marks the
calls to be applied on this broker only: for callers that call every broker themselves (the operator).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import threading
from collections.abc import AsyncGenerator, Callable, Coroutine, Generator, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Final, TypedDict, TypeVar, Unpack

import grpc
import grpc.aio

from lmq_broker import model
from lmq_broker.admin import convert, credentials, everywhere, restoring
from lmq_broker.admin.convert import COMPARE_COLUMNS, LITE_TOPIC_COLUMNS
from lmq_broker.admin.results import (
    AclEntry,
    AclPut,
    Applied,
    BrokerInfo,
    ClientInfo,
    ClusterInfo,
    DeleteOutcome,
    GroupInfo,
    GroupLag,
    LiteClientInfo,
    LiteTopicDescription,
    LiteTopicInfo,
    LiteTopicPage,
    ParentTopicDeletion,
    ParentTopicInfo,
    ReclaimRecording,
    UserDeletion,
    UserInfo,
    UserPut,
)
from lmq_broker.admin.tls import ClientTls
from lmq_broker.dispatch.offsets import OffsetPolicy, OffsetReset
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
    "GroupLag",
    "LiteClientInfo",
    "LiteTopicDescription",
    "LiteTopicInfo",
    "LiteTopicPage",
    "LoopThread",
    "OffsetPolicy",
    "OffsetReset",
    "ParentTopicDeletion",
    "ParentTopicInfo",
    "ReclaimRecording",
]

DELETE_ROWS_PER_CALL: Final = 5_000  # ~0.5 MB per request: well under gRPC's default 4 MiB receive limit
_CHANNEL_OPTIONS: Final = (("grpc.max_receive_message_length", 64 * 1024 * 1024),)

T = TypeVar("T")


class ClientOptions(TypedDict, total=False):
    long_timeout_s: float
    access_key: str
    secret_key: str
    keys: credentials.KeyPair | None
    channel_credentials: grpc.ChannelCredentials | None
    tls: ClientTls | None
    clock: Callable[[], datetime]
    here_only: bool


class ScanOptions(TypedDict, total=False):
    """``ScanLiteTopicsRequest``'s fields besides ``parent``, by the same names (unset: the broker's default)."""

    start_after: str  # exclusive; a lite name within a parent, ``parent$lite`` across parents
    end_before: str  # exclusive; "" for the end
    batch_size: int  # rows per batch (the broker's default: 10 000)
    with_subscribers: bool  # add the subscriber_count column
    with_fully_consumed: bool  # add the fully_consumed column
    idle_since_before_ms: int  # > 0: only topics whose last activity is before it (filtered by the broker)


class AsyncAdminClient:
    """The client of one broker, on grpc.aio; use it from the event loop it was created on."""

    def __init__(  # noqa: PLR0913 (the call's fields, each a keyword)
        self,
        endpoint: str,
        timeout_s: float = 5.0,
        *,
        long_timeout_s: float = 600.0,
        access_key: str = "",
        secret_key: str = "",
        keys: credentials.KeyPair | None = None,
        channel_credentials: grpc.ChannelCredentials | None = None,
        tls: ClientTls | None = None,
        clock: Callable[[], datetime] = auth.utc_now,
        here_only: bool = False,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.long_timeout_s = long_timeout_s
        if keys is not None:
            access_key, secret_key = keys.access_key, keys.secret_key
        self._keys = (access_key, secret_key) if access_key else None
        self._clock = clock
        self._marks: tuple[tuple[str, str], ...] = ((everywhere.HERE_ONLY, "1"),) if here_only else ()
        options: tuple[tuple[str, Any], ...] = _CHANNEL_OPTIONS
        if tls is not None:  # TLS to brokers (--tls-ca / LMQ_TLS_CA)
            channel_credentials, options = tls.credentials(), (*options, *tls.options())
        if channel_credentials is None:
            self._channel = grpc.aio.insecure_channel(endpoint, options=options)
        else:
            self._channel = grpc.aio.secure_channel(endpoint, channel_credentials, options=options)
        self._stub = admin_pb2_grpc.LmqAdminStub(self._channel)

    async def close(self) -> None:
        await self._channel.close(grace=None)

    async def __aenter__(self) -> AsyncAdminClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # --- plumbing ---------------------------------------------------------------------------------------
    def _metadata(self) -> tuple[tuple[str, str], ...]:
        if self._keys is None:
            return self._marks
        return (*auth.sign_metadata(*self._keys, self._clock()), *self._marks)

    async def _unary(self, rpc: str, request: Any, timeout_s: float | None = None) -> Any:
        method = getattr(self._stub, rpc)
        try:
            return await method(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata())
        except grpc.RpcError as exc:
            raise convert.call_error(exc, rpc, self.endpoint) from None

    # --- parent topics ----------------------------------------------------------------------------------
    async def put_parent_topic(self, topic: model.ParentTopic) -> Applied[model.ParentTopic]:
        request = pb.PutParentTopicRequest(topic=convert.parent_topic_to_pb(topic))
        reply = await self._unary("PutParentTopic", request)
        return Applied(convert.parent_topic_from_pb(reply.topic), reply.created)

    async def get_parent_topic(self, name: str) -> ParentTopicInfo:
        return convert.parent_info_from_pb(await self._unary("GetParentTopic", pb.GetParentTopicRequest(name=name)))

    async def delete_parent_topic(self, name: str, *, purge_lite_topics: bool = False) -> ParentTopicDeletion:
        request = pb.DeleteParentTopicRequest(name=name, purge_lite_topics=purge_lite_topics)
        reply = await self._unary("DeleteParentTopic", request, self.long_timeout_s if purge_lite_topics else None)
        return ParentTopicDeletion(reply.deleted, reply.lite_topics_deleted)

    async def list_parent_topics(self) -> list[ParentTopicInfo]:
        reply = await self._unary("ListParentTopics", pb.ListParentTopicsRequest())
        return [convert.parent_info_from_pb(t) for t in reply.topics]

    # --- lite groups ------------------------------------------------------------------------------------
    async def put_group(self, group: model.LiteGroup) -> Applied[model.LiteGroup]:
        reply = await self._unary("PutLiteGroup", pb.PutLiteGroupRequest(group=convert.lite_group_to_pb(group)))
        return Applied(convert.lite_group_from_pb(reply.group), reply.created)

    async def get_group(self, name: str) -> GroupInfo:
        return convert.group_info_from_pb(await self._unary("GetLiteGroup", pb.GetLiteGroupRequest(name=name)))

    async def delete_group(self, name: str) -> bool:
        return bool((await self._unary("DeleteLiteGroup", pb.DeleteLiteGroupRequest(name=name))).deleted)

    async def list_groups(self) -> list[GroupInfo]:
        reply = await self._unary("ListLiteGroups", pb.ListLiteGroupsRequest())
        return [convert.group_info_from_pb(g) for g in reply.groups]

    # --- quotas -----------------------------------------------------------------------------------------
    async def put_quota(self, quota: model.Quota) -> Applied[model.Quota]:
        reply = await self._unary("PutQuota", pb.PutQuotaRequest(quota=convert.quota_to_pb(quota)))
        return Applied(convert.quota_from_pb(reply.quota), reply.created)

    async def delete_quota(self, scope: str) -> bool:
        return bool((await self._unary("DeleteQuota", pb.DeleteQuotaRequest(scope=scope))).deleted)

    async def list_quotas(self) -> list[model.Quota]:
        reply = await self._unary("ListQuotas", pb.ListQuotasRequest())
        return [convert.quota_from_pb(q) for q in reply.quotas]

    # --- users and access control ----------------------------------------------------------------------
    async def put_user(self, name: str, secret: str = "", *, super_user: bool = False, enabled: bool = True) -> UserPut:
        """``secret`` empty: keep the user's own (a new user needs one)."""
        user = pb.User(name=name, secret=secret, super_user=super_user, disabled=not enabled)
        reply = await self._unary("PutUser", pb.PutUserRequest(user=user))
        return UserPut(reply.user.name, reply.user.super_user, not reply.user.disabled, reply.created)

    async def get_user(self, name: str) -> UserInfo:
        return _user_info(await self._unary("GetUser", pb.GetUserRequest(name=name)))

    async def delete_user(self, name: str) -> UserDeletion:
        reply = await self._unary("DeleteUser", pb.DeleteUserRequest(name=name))
        return UserDeletion(reply.deleted, reply.acl_entries_deleted)

    async def list_users(self) -> list[UserInfo]:
        return [_user_info(u) for u in (await self._unary("ListUsers", pb.ListUsersRequest())).users]

    async def put_acl(self, entries: Sequence[AclEntry]) -> AclPut:
        request = pb.PutAclRequest(entries=[_acl_to_pb(e) for e in entries])
        reply = await self._unary("PutAcl", request)
        return AclPut(reply.created, tuple(_acl_from_pb(e) for e in reply.entries))

    async def get_acl(self, user: str) -> list[AclEntry]:
        return [_acl_from_pb(e) for e in (await self._unary("GetAcl", pb.GetAclRequest(user=user))).entries]

    async def delete_acl(self, user: str, resource: str = "", decision: str = "") -> int:
        request = pb.DeleteAclRequest(user=user, resource=resource, decision=decision)
        return int((await self._unary("DeleteAcl", request)).deleted)

    async def list_acls(self) -> list[AclEntry]:
        return [_acl_from_pb(e) for e in (await self._unary("ListAcls", pb.ListAclsRequest())).entries]

    # --- lite topics and clients ------------------------------------------------------------------------
    async def describe_lite_topic(self, parent: str, lite: str) -> LiteTopicDescription:
        request = pb.DescribeLiteTopicRequest(parent=parent, lite=lite)
        return convert.description_from_pb(await self._unary("DescribeLiteTopic", request))

    async def list_lite_topics(self, parent: str = "", *, start_after: str = "", limit: int = 100) -> LiteTopicPage:
        """One page; across parents (``parent=""``) ``start_after`` is a ``parent$lite`` key."""
        request = pb.ListLiteTopicsRequest(parent=parent, start_after=start_after, limit=limit)
        return convert.page_from_pb(await self._unary("ListLiteTopics", request))

    async def list_clients(self, group: str | None = None) -> list[ClientInfo]:
        reply = await self._unary("ListClients", pb.ListClientsRequest(group=group or ""))
        return [convert.client_from_pb(c) for c in reply.clients]

    async def scan_lite_topics_columns(
        self, parent: str = "", **options: Unpack[ScanOptions]
    ) -> AsyncGenerator[dict[str, list[Any]], None]:
        """Lite-topic metadata in key order, a batch of up to ``batch_size`` rows at a time (``ScanOptions``).

        Each batch maps ``LITE_TOPIC_COLUMNS`` (plus ``subscriber_count`` / ``fully_consumed`` when asked)
        to equal-length lists. The stream is read lazily; close the iterator to stop early.
        """
        request = pb.ScanLiteTopicsRequest(parent=parent, **options)
        call = self._stub.ScanLiteTopics(request, timeout=self.long_timeout_s, metadata=self._metadata())
        subscribers, fully_consumed = request.with_subscribers, request.with_fully_consumed
        try:
            async for batch in call:
                yield convert.scan_batch_columns(
                    batch, with_subscribers=subscribers, with_fully_consumed=fully_consumed
                )
        except grpc.RpcError as exc:
            raise convert.call_error(exc, "ScanLiteTopics", self.endpoint) from None
        finally:
            call.cancel()

    async def backup_parts(self, chunk_bytes: int = 0) -> AsyncGenerator[pb.BackupResponse, None]:
        """The ``Backup`` stream as it comes (``restoring.receive`` writes it to a directory). No deadline: a large
        store takes as long as its bytes take to travel."""
        call = self._stub.Backup(pb.BackupRequest(chunk_bytes=chunk_bytes), timeout=None, metadata=self._metadata())
        try:
            async for part in call:
                yield part
        except grpc.RpcError as exc:
            raise convert.call_error(exc, "Backup", self.endpoint) from None
        finally:
            call.cancel()

    async def compare_and_delete(
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
            stop = min(start + DELETE_ROWS_PER_CALL, rows)
            request = convert.compare_request(
                columns,
                start,
                stop,
                require_no_subscribers=require_no_subscribers,
                dry_run=dry_run,
                subscribers_seen=subscribers_seen,
            )
            reply = await self._unary("CompareAndDeleteLiteTopics", request, self.long_timeout_s)
            outcomes.extend(convert.outcomes_from_pb(reply, stop - start, self.endpoint))
        return outcomes

    async def record_reclaim_runs(self, runs: Sequence[model.ReclaimRun]) -> ReclaimRecording:
        """Record each run as its parent's newest reclaim summary on this broker (one run per parent)."""
        request = pb.RecordReclaimRunsRequest(runs=[convert.reclaim_run_to_pb(r) for r in runs])
        return convert.recording_from_pb(await self._unary("RecordReclaimRuns", request))

    # --- the broker -------------------------------------------------------------------------------------
    async def broker_info(self, *, with_undrained: bool = True) -> BrokerInfo:
        """``with_undrained`` walks every lite topic of the broker (see the service); it uses ``long_timeout_s``."""
        request = pb.GetBrokerInfoRequest(skip_undrained=not with_undrained)
        reply = await self._unary("GetBrokerInfo", request, self.long_timeout_s if with_undrained else None)
        return convert.broker_info_from_pb(reply)

    # --- the cluster (docs/scale-out.md) -----------------------------------------------------------------
    async def cluster(self, *, with_undrained: bool = False) -> ClusterInfo:
        request = pb.GetClusterRequest(with_undrained=with_undrained)
        reply = await self._unary("GetCluster", request, self.long_timeout_s if with_undrained else None)
        return convert.cluster_info_from_pb(reply)

    async def set_cluster(
        self,
        members: Sequence[str],
        ring_sizes: Sequence[int],
        *,
        slot: int | None = None,
        force: bool = False,
        epoch: int = 0,
    ) -> tuple[ClusterInfo, bool]:
        """This broker's membership; returns it as now applied, and whether it changed. ``epoch`` 0: the
        broker's current one + 1 (a writer that tells several brokers gives them all the same number)."""
        request = pb.SetClusterRequest(members=members, ring_sizes=ring_sizes, slot=slot, force=force, epoch=epoch)
        reply = await self._unary("SetCluster", request, self.long_timeout_s)
        return convert.cluster_info_from_pb(reply.cluster), reply.changed

    # --- lite operations beyond mqadmin's ----------------------------------------------------------------
    async def get_lite_client(self, client_id: str) -> LiteClientInfo:
        request = pb.GetLiteClientRequest(client_id=client_id)
        return convert.lite_client_from_pb(await self._unary("GetLiteClient", request))

    async def group_lag(self, group: str, *, top_k: int = 0) -> GroupLag:
        """Walks the group's bind topic on the broker (off its serving loop): uses ``long_timeout_s``."""
        request = pb.GetGroupLagRequest(group=group, top_k=top_k)
        return convert.group_lag_from_pb(await self._unary("GetGroupLag", request, self.long_timeout_s))

    async def reset_lite_offsets(self, group: str, lites: Sequence[str], option: OffsetReset) -> dict[str, int]:
        """Move ``group``'s offset in ``lites`` of its bind topic; returns lite -> committed offset after it."""
        reply = await self._unary("ResetLiteOffsets", convert.offset_reset_to_pb(group, lites, option))
        return dict(reply.offsets)

    async def trigger_lite_dispatch(self, group: str, lites: Sequence[str] = ()) -> list[str]:
        """Offer ``lites`` (empty: all the group's clients subscribe to) to the group now; the lites offered."""
        request = pb.TriggerLiteDispatchRequest(group=group, lites=lites)
        return list((await self._unary("TriggerLiteDispatch", request)).offered)


class LoopThread:
    """An asyncio loop in a daemon thread; ``run`` executes a coroutine there and waits for its result."""

    def __init__(self, name: str = "lmq-admin-loop", timeout_s: float | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self._timeout_s = timeout_s
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result(self._timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30.0)
        self.loop.close()


_SHARED_LOCK: Final = threading.Lock()


@functools.cache
def _loop_of(pid: int) -> LoopThread:
    return LoopThread("lmq-admin-client")


def shared_loop() -> LoopThread:
    """The loop of this process's blocking clients (a forked child starts its own: the parent's thread is
    not there). It runs until the process exits; each client closes its own channel."""
    with _SHARED_LOCK:
        return _loop_of(os.getpid())


class AdminClient:
    """``AsyncAdminClient``'s blocking façade: the same methods, run on ``shared_loop()``. Thread-safe."""

    def __init__(self, endpoint: str, timeout_s: float = 5.0, **options: Unpack[ClientOptions]) -> None:
        self.endpoint = endpoint
        self._loop = shared_loop()

        async def connect() -> AsyncAdminClient:  # grpc.aio ties a channel to the loop it is made on
            return AsyncAdminClient(endpoint, timeout_s, **options)

        self.aio = self._loop.run(connect())

    @classmethod
    def resolved(
        cls, endpoint: str, timeout_s: float = 5.0, *, data_dir: Path | None = None, **options: Any
    ) -> AdminClient:
        """A client signing with the pair ``lmq-admin`` would find: ``LMQ_ADMIN_ACCESS_KEY``/``_SECRET_KEY``,
        else ``<data_dir>/admin-credentials.json`` (default ``LMQ_DATA_DIR``, else ``./data``); unsigned if none."""
        return cls(endpoint, timeout_s, keys=credentials.resolve(data_dir=data_dir), **options)

    def close(self) -> None:
        self._loop.run(self.aio.close())

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def put_parent_topic(self, topic: model.ParentTopic) -> Applied[model.ParentTopic]:
        return self._loop.run(self.aio.put_parent_topic(topic))

    def get_parent_topic(self, name: str) -> ParentTopicInfo:
        return self._loop.run(self.aio.get_parent_topic(name))

    def delete_parent_topic(self, name: str, *, purge_lite_topics: bool = False) -> ParentTopicDeletion:
        return self._loop.run(self.aio.delete_parent_topic(name, purge_lite_topics=purge_lite_topics))

    def list_parent_topics(self) -> list[ParentTopicInfo]:
        return self._loop.run(self.aio.list_parent_topics())

    def put_group(self, group: model.LiteGroup) -> Applied[model.LiteGroup]:
        return self._loop.run(self.aio.put_group(group))

    def get_group(self, name: str) -> GroupInfo:
        return self._loop.run(self.aio.get_group(name))

    def delete_group(self, name: str) -> bool:
        return self._loop.run(self.aio.delete_group(name))

    def list_groups(self) -> list[GroupInfo]:
        return self._loop.run(self.aio.list_groups())

    def put_quota(self, quota: model.Quota) -> Applied[model.Quota]:
        return self._loop.run(self.aio.put_quota(quota))

    def delete_quota(self, scope: str) -> bool:
        return self._loop.run(self.aio.delete_quota(scope))

    def list_quotas(self) -> list[model.Quota]:
        return self._loop.run(self.aio.list_quotas())

    def describe_lite_topic(self, parent: str, lite: str) -> LiteTopicDescription:
        return self._loop.run(self.aio.describe_lite_topic(parent, lite))

    def put_user(self, name: str, secret: str = "", *, super_user: bool = False, enabled: bool = True) -> UserPut:
        return self._loop.run(self.aio.put_user(name, secret, super_user=super_user, enabled=enabled))

    def get_user(self, name: str) -> UserInfo:
        return self._loop.run(self.aio.get_user(name))

    def delete_user(self, name: str) -> UserDeletion:
        return self._loop.run(self.aio.delete_user(name))

    def list_users(self) -> list[UserInfo]:
        return self._loop.run(self.aio.list_users())

    def put_acl(self, entries: Sequence[AclEntry]) -> AclPut:
        return self._loop.run(self.aio.put_acl(entries))

    def get_acl(self, user: str) -> list[AclEntry]:
        return self._loop.run(self.aio.get_acl(user))

    def delete_acl(self, user: str, resource: str = "", decision: str = "") -> int:
        return self._loop.run(self.aio.delete_acl(user, resource, decision))

    def list_acls(self) -> list[AclEntry]:
        return self._loop.run(self.aio.list_acls())

    def list_lite_topics(self, parent: str = "", *, start_after: str = "", limit: int = 100) -> LiteTopicPage:
        return self._loop.run(self.aio.list_lite_topics(parent, start_after=start_after, limit=limit))

    def list_clients(self, group: str | None = None) -> list[ClientInfo]:
        return self._loop.run(self.aio.list_clients(group))

    def scan_lite_topics_columns(
        self, parent: str = "", **options: Unpack[ScanOptions]
    ) -> Generator[dict[str, list[Any]], None, None]:
        batches = self.aio.scan_lite_topics_columns(parent, **options)

        async def step() -> dict[str, list[Any]] | None:
            return await anext(batches, None)

        async def stop() -> None:
            await batches.aclose()

        try:
            while (batch := self._loop.run(step())) is not None:
                yield batch
        finally:
            self._loop.run(stop())

    def compare_and_delete(
        self,
        columns: Mapping[str, Sequence[Any]],
        *,
        require_no_subscribers: bool = True,
        dry_run: bool = False,
        subscribers_seen: bool = False,
    ) -> list[DeleteOutcome]:
        return self.start_compare_and_delete(
            columns, require_no_subscribers=require_no_subscribers, dry_run=dry_run, subscribers_seen=subscribers_seen
        ).result()

    def start_compare_and_delete(
        self,
        columns: Mapping[str, Sequence[Any]],
        *,
        require_no_subscribers: bool = True,
        dry_run: bool = False,
        subscribers_seen: bool = False,
    ) -> concurrent.futures.Future[list[DeleteOutcome]]:
        """``compare_and_delete`` sent at once; ``result()`` waits for the outcomes (or raises its error)."""
        call = self.aio.compare_and_delete(
            columns, require_no_subscribers=require_no_subscribers, dry_run=dry_run, subscribers_seen=subscribers_seen
        )
        return self._loop.submit(call)

    def record_reclaim_runs(self, runs: Sequence[model.ReclaimRun]) -> ReclaimRecording:
        return self._loop.run(self.aio.record_reclaim_runs(runs))

    def broker_info(self, *, with_undrained: bool = True) -> BrokerInfo:
        return self._loop.run(self.aio.broker_info(with_undrained=with_undrained))

    def cluster(self, *, with_undrained: bool = False) -> ClusterInfo:
        return self._loop.run(self.aio.cluster(with_undrained=with_undrained))

    def set_cluster(
        self,
        members: Sequence[str],
        ring_sizes: Sequence[int],
        *,
        slot: int | None = None,
        force: bool = False,
        epoch: int = 0,
    ) -> tuple[ClusterInfo, bool]:
        return self._loop.run(self.aio.set_cluster(members, ring_sizes, slot=slot, force=force, epoch=epoch))

    def get_lite_client(self, client_id: str) -> LiteClientInfo:
        return self._loop.run(self.aio.get_lite_client(client_id))

    def group_lag(self, group: str, *, top_k: int = 0) -> GroupLag:
        return self._loop.run(self.aio.group_lag(group, top_k=top_k))

    def reset_lite_offsets(self, group: str, lites: Sequence[str], option: OffsetReset) -> dict[str, int]:
        return self._loop.run(self.aio.reset_lite_offsets(group, lites, option))

    def trigger_lite_dispatch(self, group: str, lites: Sequence[str] = ()) -> list[str]:
        return self._loop.run(self.aio.trigger_lite_dispatch(group, lites))

    def backup(
        self, target: Path, *, chunk_bytes: int = 0, progress: restoring.Progress | None = None
    ) -> restoring.Summary:
        """Take a snapshot of the broker's store into ``target`` (new or empty), ``manifest.json`` last."""
        parts = self.aio.backup_parts(chunk_bytes)

        async def step() -> pb.BackupResponse | None:
            return await anext(parts, None)

        async def stop() -> None:
            await parts.aclose()

        def stream() -> Iterator[pb.BackupResponse]:
            try:
                while (part := self._loop.run(step())) is not None:
                    yield part
            finally:
                self._loop.run(stop())

        return restoring.receive(stream(), target, progress)


def _user_info(reply: pb.GetUserResponse) -> UserInfo:
    return UserInfo(reply.user.name, reply.user.super_user, not reply.user.disabled, reply.acl_entries)


def _acl_to_pb(entry: AclEntry) -> pb.AclEntry:
    return pb.AclEntry(
        user=entry.user,
        resource=entry.resource,
        actions=list(entry.actions),
        decision=entry.decision,
        sources=list(entry.sources),
    )


def _acl_from_pb(entry: pb.AclEntry) -> AclEntry:
    return AclEntry(entry.user, entry.resource, tuple(entry.actions), entry.decision, tuple(entry.sources))
