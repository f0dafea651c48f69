"""The lmq.admin.v1 servicer: decode, call catalog/inspection/reclaiming, encode; errors leave as status codes.

Served by the broker's own grpc.aio server (same port as the v2 service) through ``register``. Handlers
run on the broker's event loop; every store access goes to a worker thread and every change of parent
topics, groups or quotas is announced with ``live.metadata_changed()`` so the dispatcher drops its cached
copies. Changes of parent topics, groups and quotas are then sent on to the cluster's other members
(``everywhere``; per-broker operations are not). Errors are mapped in one place (``codes``), by the ``_edge``
wrapper below.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final, TypeAlias, TypeVar

import grpc
from typing_extensions import override

from lmq_broker import errors, model
from lmq_broker.access import policy
from lmq_broker.access.control import AccessControl
from lmq_broker.admin import (
    backups,
    catalog,
    codes,
    convert,
    everywhere,
    inspection,
    membership,
    permissions,
    reclaiming,
    users,
    validation,
)
from lmq_broker.cluster import relocating, trust
from lmq_broker.cluster.links import ADMIN, now_ms
from lmq_broker.cluster.setup import Cluster
from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch import metadata, wildcards
from lmq_broker.dispatch.api import LiveView
from lmq_broker.mqtt import exactly, matching, shares, topics
from lmq_broker.mqtt.server import MqttServer
from lmq_broker.protocol import auth, guard
from lmq_broker.protocol.admission import Admission
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as pb
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2_grpc
from lmq_broker.protocol.native import NativeServer
from lmq_broker.storage.api import Store

log = logging.getLogger(__name__)

MAX_READY_WAIT_MS: Final = 60_000  # an AwaitLiteReady waits at most this long

if TYPE_CHECKING:  # generic only in grpc's type stubs
    Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]
S = TypeVar("S", bound="AdminServicer")
Req = TypeVar("Req")
Resp = TypeVar("Resp")


def register(  # noqa: PLR0913 (its parts, each once)
    server: grpc.aio.Server | NativeServer,
    store: Store,
    live: LiveView,
    config: BrokerConfig,
    admission: Admission | None = None,
    *,
    admin_keys: tuple[str, str] | None,
    clock: Callable[[], datetime] = auth.utc_now,
    cluster: Cluster | None = None,
    mqtt: Callable[[], MqttServer | None] = lambda: None,
    access: AccessControl | None = None,
) -> None:
    """Add the LmqAdmin service to the broker's server (before it starts), answering only calls signed with
    ``admin_keys``; None serves anyone (``--admin-anonymous``, and harnesses that test the service itself).
    Its calls count against ``admission`` (the v2 service's, in a broker); ``cluster`` is the broker's place
    among its peers (GetCluster/SetCluster answer Unsupported without it); ``mqtt`` its MQTT listener, once it
    runs (``MqttRetained`` answers none without it); ``access`` the broker's access control, which user and
    acl changes reload, and which (``--acl``) opens the calls of ``permissions`` to users its policies allow."""
    service = pb.DESCRIPTOR.services_by_name["LmqAdmin"]
    servicer = AdminServicer(store, live, config, cluster, mqtt, access=access)
    handler = guard.strict_generic_handler(service, servicer, admission, waits=frozenset({"AwaitLiteReady"}))
    if admin_keys is not None:
        users = permissions.UserCalls(access, store) if access is not None and access.enabled else None
        handler = auth.AdminGuard(
            handler, *admin_keys, max_skew_s=config.auth_max_skew_ms / 1000, clock=clock, users=users
        )
    server.add_generic_rpc_handlers((handler,))


def _mqtt_filters(parent: str, texts: Iterable[str]) -> list[wildcards.Filter]:
    """MQTT topic filters after their parent level (``a/+/c``) -> filters; InvalidArgument when not one."""
    out = []
    for text in texts:
        try:
            out.append(topics.subscription_of(f"{parent}/{text}").filter)
        except topics.TopicError as exc:
            raise errors.InvalidArgument(str(exc), kind="filter") from None
    return out


async def _abort(context: Context, exc: BaseException) -> None:
    if isinstance(exc, errors.LmqError):
        await context.abort(codes.status_for(exc), exc.message, trailing_metadata=codes.trailers(exc))
    log.exception("admin call failed unexpectedly", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


def _edge(method: Callable[[S, Req, Context], Awaitable[Resp]]) -> Callable[[S, Req, Context], Awaitable[Resp]]:
    @functools.wraps(method)
    async def wrapper(self: S, request: Req, context: Context) -> Resp:
        try:
            return await method(self, request, context)
        except Exception as exc:  # the edge: every failure becomes a status
            await _abort(context, exc)
            raise AssertionError("unreachable: abort raises") from exc

    return wrapper


class AdminServicer(admin_pb2_grpc.LmqAdminServicer):
    def __init__(
        self,
        store: Store,
        live: LiveView,
        config: BrokerConfig,
        cluster: Cluster | None = None,
        mqtt: Callable[[], MqttServer | None] = lambda: None,
        *,
        access: AccessControl | None = None,
    ) -> None:
        self._store = store
        self._users = users.Users(store, access or AccessControl(config.acl))
        self._mqtt = mqtt
        self._live = live
        self._config = config
        self._cluster = cluster
        self._catalog = catalog.Catalog(store, config)
        self._everywhere = everywhere.Everywhere(cluster)
        self._backups = backups.Backups(store, config.store.data_dir)

    def _changed(self, changed: bool) -> None:
        if changed:
            self._live.metadata_changed()

    # --- parent topics ----------------------------------------------------------------------------------
    @override
    @_edge
    async def PutParentTopic(self, request: pb.PutParentTopicRequest, context: Context) -> pb.PutParentTopicResponse:
        topic = convert.parent_topic_from_pb(request.topic)
        put = await asyncio.to_thread(self._catalog.put_parent_topic, topic)
        self._changed(put.changed)
        await self._everywhere.send_on(context, "PutParentTopic", request)
        return pb.PutParentTopicResponse(topic=convert.parent_topic_to_pb(put.value), created=put.created)

    @override
    @_edge
    async def GetParentTopic(self, request: pb.GetParentTopicRequest, context: Context) -> pb.GetParentTopicResponse:
        info = await asyncio.to_thread(self._catalog.get_parent_topic, request.name)
        return convert.parent_info_to_pb(info.topic, info.lite_topic_count, info.last_reclaim)

    @override
    @_edge
    async def DeleteParentTopic(
        self, request: pb.DeleteParentTopicRequest, context: Context
    ) -> pb.DeleteParentTopicResponse:
        if not request.purge_lite_topics:  # refused by any member: deleted by none
            await self._everywhere.check_empty(context, validation.name("name", request.name))
        deletion = await asyncio.to_thread(
            functools.partial(self._catalog.delete_parent_topic, request.name, purge=request.purge_lite_topics)
        )
        self._changed(deletion.deleted)
        purged = await reclaiming.purge(self._store, self._live, request.name) if deletion.purge_needed else 0
        await self._everywhere.send_on(context, "DeleteParentTopic", request)
        return pb.DeleteParentTopicResponse(deleted=deletion.deleted, lite_topics_deleted=purged)

    @override
    @_edge
    async def ListParentTopics(
        self, request: pb.ListParentTopicsRequest, context: Context
    ) -> pb.ListParentTopicsResponse:
        topics = await asyncio.to_thread(self._catalog.list_parent_topics)
        return pb.ListParentTopicsResponse(
            topics=[convert.parent_info_to_pb(i.topic, i.lite_topic_count, i.last_reclaim) for i in topics]
        )

    # --- lite groups ------------------------------------------------------------------------------------
    @override
    @_edge
    async def PutLiteGroup(self, request: pb.PutLiteGroupRequest, context: Context) -> pb.PutLiteGroupResponse:
        group = convert.lite_group_from_pb(request.group)
        put = await asyncio.to_thread(self._catalog.put_group, group)
        self._changed(put.changed)
        await self._everywhere.send_on(context, "PutLiteGroup", request)
        return pb.PutLiteGroupResponse(group=convert.lite_group_to_pb(put.value), created=put.created)

    @override
    @_edge
    async def GetLiteGroup(self, request: pb.GetLiteGroupRequest, context: Context) -> pb.GetLiteGroupResponse:
        group = await asyncio.to_thread(self._catalog.get_group, request.name)
        (view,) = await inspection.group_views(self._store, self._live, [group])
        return view

    @override
    @_edge
    async def DeleteLiteGroup(self, request: pb.DeleteLiteGroupRequest, context: Context) -> pb.DeleteLiteGroupResponse:
        deleted = await asyncio.to_thread(self._catalog.delete_group, request.name)
        self._changed(deleted)
        await self._everywhere.send_on(context, "DeleteLiteGroup", request)
        return pb.DeleteLiteGroupResponse(deleted=deleted)

    @override
    @_edge
    async def ListLiteGroups(self, request: pb.ListLiteGroupsRequest, context: Context) -> pb.ListLiteGroupsResponse:
        groups = await asyncio.to_thread(self._catalog.list_groups)
        return pb.ListLiteGroupsResponse(groups=await inspection.group_views(self._store, self._live, groups))

    # --- quotas -----------------------------------------------------------------------------------------
    @override
    @_edge
    async def PutQuota(self, request: pb.PutQuotaRequest, context: Context) -> pb.PutQuotaResponse:
        put = await asyncio.to_thread(self._catalog.put_quota, convert.quota_from_pb(request.quota))
        self._changed(put.changed)
        await self._everywhere.send_on(context, "PutQuota", request)
        return pb.PutQuotaResponse(quota=convert.quota_to_pb(put.value), created=put.created)

    @override
    @_edge
    async def DeleteQuota(self, request: pb.DeleteQuotaRequest, context: Context) -> pb.DeleteQuotaResponse:
        deleted = await asyncio.to_thread(self._catalog.delete_quota, request.scope)
        self._changed(deleted)
        await self._everywhere.send_on(context, "DeleteQuota", request)
        return pb.DeleteQuotaResponse(deleted=deleted)

    @override
    @_edge
    async def ListQuotas(self, request: pb.ListQuotasRequest, context: Context) -> pb.ListQuotasResponse:
        quotas = await asyncio.to_thread(self._catalog.list_quotas)
        return pb.ListQuotasResponse(quotas=[convert.quota_to_pb(q) for q in quotas])

    # --- lite topics and clients ------------------------------------------------------------------------
    @override
    @_edge
    async def DescribeLiteTopic(
        self, request: pb.DescribeLiteTopicRequest, context: Context
    ) -> pb.DescribeLiteTopicResponse:
        of = self._cluster.slot_of_topic if self._cluster is not None else None
        slot = request.slot if request.HasField("slot") else None
        held = None if of is None or slot is None else lambda topic: of(topic) == slot
        return await inspection.describe(self._store, self._live, request.parent, request.lite, held)

    @override
    @_edge
    async def ListLiteTopics(self, request: pb.ListLiteTopicsRequest, context: Context) -> pb.ListLiteTopicsResponse:
        return await inspection.list_page(self._store, self._live, request.parent, request.start_after, request.limit)

    @override
    @_edge
    async def ListClients(self, request: pb.ListClientsRequest, context: Context) -> pb.ListClientsResponse:
        clients = self._live.clients(request.group or None)
        return pb.ListClientsResponse(clients=[convert.client_view_to_pb(c) for c in clients])

    @override
    async def ScanLiteTopics(  # an async generator, which grpc.aio accepts for server streams
        self, request: pb.ScanLiteTopicsRequest, context: Context
    ) -> AsyncIterator[pb.ScanLiteTopicsResponse]:
        try:
            async for batch in reclaiming.scan(self._store, self._live, request):
                yield batch
        except Exception as exc:  # the edge
            await _abort(context, exc)

    @override
    async def Backup(  # an async generator (a server stream)
        self, request: pb.BackupRequest, context: Context
    ) -> AsyncIterator[pb.BackupResponse]:
        try:
            async for part in self._backups.stream(request, context):
                yield part
        except Exception as exc:  # the edge
            await _abort(context, exc)

    @override
    @_edge
    async def CompareAndDeleteLiteTopics(
        self, request: pb.CompareAndDeleteRequest, context: Context
    ) -> pb.CompareAndDeleteResponse:
        outcomes = await reclaiming.compare_and_delete(
            self._store,
            self._live,
            reclaiming.rows_of(request),
            require_no_subscribers=request.require_no_subscribers,
            dry_run=request.dry_run,
        )
        return pb.CompareAndDeleteResponse(outcome=[pb.DeleteOutcome.ValueType(o) for o in outcomes])

    @override
    @_edge
    async def RecordReclaimRuns(
        self, request: pb.RecordReclaimRunsRequest, context: Context
    ) -> pb.RecordReclaimRunsResponse:
        runs = [convert.reclaim_run_from_pb(r) for r in request.runs]
        done = await asyncio.to_thread(self._catalog.record_reclaim_runs, runs)
        # Not a metadata change: the dispatcher never reads these records, so its caches stay valid.
        return pb.RecordReclaimRunsResponse(
            recorded=done.recorded, unknown_parents=done.unknown_parents, superseded=done.superseded
        )

    # --- lite operations beyond mqadmin's ----------------------------------------------------------------
    @override
    @_edge
    async def GetLiteClient(self, request: pb.GetLiteClientRequest, context: Context) -> pb.GetLiteClientResponse:
        found = [c for c in self._live.clients() if c.client_id == request.client_id]
        lites = self._live.lite_topics_of(request.client_id)
        if not found or lites is None:
            raise errors.NotFound(f"client {request.client_id!r} is not connected", client_id=request.client_id)
        return pb.GetLiteClientResponse(client=convert.client_view_to_pb(found[0]), lite_topics=lites)

    @override
    @_edge
    async def GetGroupLag(self, request: pb.GetGroupLagRequest, context: Context) -> pb.GetGroupLagResponse:
        group = await asyncio.to_thread(self._catalog.get_group, request.group)
        now_ms = int(auth.utc_now().timestamp() * 1000)
        lag = await inspection.group_lag(self._store, self._live, group, request.top_k, now_ms)
        return convert.group_lag_to_pb(lag)

    @override
    @_edge
    async def ResetLiteOffsets(
        self, request: pb.ResetLiteOffsetsRequest, context: Context
    ) -> pb.ResetLiteOffsetsResponse:
        option = convert.offset_reset_from_pb(request)
        group = await asyncio.to_thread(self._catalog.get_group, request.group)
        lites = validation.lite_topics("lites", request.lites)
        await self._live.reset_offsets(group.name, group.bind_topic, lites, option)

        def read() -> dict[str, int]:
            queue = functools.partial(model.QueueId.lmq, group.bind_topic)
            found = {lite: self._store.get_offset(queue(lite), group.name) for lite in lites}
            return {lite: offset for lite, offset in found.items() if offset is not None}

        return pb.ResetLiteOffsetsResponse(offsets=await asyncio.to_thread(read))

    @override
    @_edge
    async def TriggerLiteDispatch(
        self, request: pb.TriggerLiteDispatchRequest, context: Context
    ) -> pb.TriggerLiteDispatchResponse:
        group = await asyncio.to_thread(self._catalog.get_group, request.group)
        lites = validation.lite_topics("lites", request.lites)
        offered = await self._live.trigger_dispatch(group.name, group.bind_topic, lites)
        return pb.TriggerLiteDispatchResponse(offered=offered)

    # --- MQTT sessions of other brokers (docs/mqtt.md, "In a cluster") ----------------------------------
    @override
    @_edge
    async def MqttStartAtEnd(self, request: pb.MqttStartAtEndRequest, context: Context) -> pb.MqttStartAtEndResponse:
        parent = validation.name("parent", request.parent)
        group = validation.name("group", request.group)
        if not group.startswith(metadata.MQTT_GROUP_PREFIX):
            raise errors.InvalidArgument(f"group {group!r} is no MQTT session's", kind="group")
        new, older = _mqtt_filters(parent, request.filters), _mqtt_filters(parent, request.older)
        if shares.is_group(group) and shares.read_by(self._live.clients(group), parent):
            return pb.MqttStartAtEndResponse(lite_topics=0)  # a share some member reads: it goes on from there

        async def scan(parent: str, start_after: str, end_before: str, limit: int) -> list[model.LiteTopicMeta]:
            return await asyncio.to_thread(self._store.scan_lite_topics, parent, start_after, end_before, limit)

        default = self._config.mqtt_default_parent
        reset = matching.later(self._live.reset_offsets)
        moved = await matching.start_at_end(scan, reset, group, parent, new, older, default=default)
        return pb.MqttStartAtEndResponse(lite_topics=moved)

    @override
    @_edge
    async def MqttRetained(self, request: pb.MqttRetainedRequest, context: Context) -> pb.MqttRetainedResponse:
        parent = validation.name("parent", request.parent)
        (levels,) = _mqtt_filters(parent, [request.filter])
        server = self._mqtt()
        if server is None:  # no MQTT listener here: nothing was retained through this broker
            return pb.MqttRetainedResponse()
        limit = min(request.limit, matching.RETAINED_LIMIT) if request.limit > 0 else matching.RETAINED_LIMIT
        found, truncated = await server.retained(parent, levels, limit)
        return pb.MqttRetainedResponse(
            retained=[
                pb.MqttRetainedMessage(
                    lite=r.lite, payload=r.payload, qos=r.qos, stored_ms=r.stored_ms, properties=r.properties
                )
                for r in found
            ],
            truncated=truncated,
        )

    @override
    @_edge
    async def MqttFindMessage(self, request: pb.MqttFindMessageRequest, context: Context) -> pb.MqttFindMessageResponse:
        """Another broker asks whether a QoS 2 publish resent after its restart is stored here (``mqtt.exactly``);
        a peer's call only. At most ``exactly.FIND_LIMIT`` messages are read (beyond: where to go on). Without a
        message id: the lite topic's end, recorded before such a publish is stored here."""
        self._from_peer(context, "MqttFindMessage")
        parent = validation.name("parent", request.parent)
        lite = validation.lite_topic("lite", request.lite)
        if not request.message_id:  # where a publish about to be stored goes (at or after)
            return pb.MqttFindMessageResponse(end=await asyncio.to_thread(exactly.end_of, self._store, parent, lite))
        limit = min(request.limit, exactly.FIND_LIMIT) if request.limit > 0 else exactly.FIND_LIMIT
        find = functools.partial(exactly.find, self._store, parent, lite, request.message_id, request.from_offset)
        found, next_offset = await asyncio.to_thread(find, limit)
        complete = found or next_offset is None
        return pb.MqttFindMessageResponse(found=found, complete=complete, next_offset=next_offset or 0)

    @override
    @_edge
    async def AwaitLiteReady(self, request: pb.AwaitLiteReadyRequest, context: Context) -> pb.AwaitLiteReadyResponse:
        """Another broker waits for a client it serves (``cluster.readiness``): leases nothing, so a wait cut off
        loses nothing. A peer's call only (its header, besides the admin pair)."""
        self._from_peer(context, "AwaitLiteReady")
        if not request.client_id:
            raise errors.InvalidArgument("client_id is required", kind="client_id")
        parent = validation.name("parent", request.parent)
        group = validation.name("group", request.group)
        timeout_ms = min(max(request.timeout_ms, 0), MAX_READY_WAIT_MS)
        ready = await self._live.await_ready(request.client_id, group, parent, timeout_ms)
        return pb.AwaitLiteReadyResponse(ready=ready)

    @override
    @_edge
    async def StoreRelocated(self, request: pb.StoreRelocatedRequest, context: Context) -> pb.StoreRelocatedResponse:
        """A leaving broker's messages of NORMAL topics and dead letters (``cluster.relocating``), appended here
        and answered once stored. A peer's call only (its header, besides the admin pair)."""
        self._from_peer(context, "StoreRelocated")
        cluster = self._cluster_or_refuse()
        return pb.StoreRelocatedResponse(stored=await cluster.store_relocated(request.messages, request.source))

    @override
    @_edge
    async def CommittedGroups(self, request: pb.CommittedGroupsRequest, context: Context) -> pb.CommittedGroupsResponse:
        """The groups with a commit point in each of the topics asked (``cluster.relocating``): a leaving broker
        copies what they have not consumed too. A peer's call only."""
        self._from_peer(context, "CommittedGroups")
        found = await asyncio.to_thread(relocating.committed_groups, self._store, request.topics)
        return pb.CommittedGroupsResponse(
            topics=[pb.TopicGroups(topic=topic, groups=sorted(groups)) for topic, groups in sorted(found.items())]
        )

    def _from_peer(self, context: Context, method: str) -> None:
        peers = self._cluster.peers if self._cluster is not None else None
        if peers is None:
            raise errors.Unsupported("this broker is not part of a cluster: no other broker waits here")
        peer, _ = trust.verify(peers.links.secret, ADMIN + method, context.invocation_metadata(), now_ms())
        if peer is None:
            raise errors.Forbidden(f"{method} is a call between the brokers of a cluster (no valid peer header)")

    # --- the broker -------------------------------------------------------------------------------------
    @override
    @_edge
    async def GetBrokerInfo(self, request: pb.GetBrokerInfoRequest, context: Context) -> pb.GetBrokerInfoResponse:
        cluster = self._cluster
        drains = membership.drains(cluster) if cluster is not None else None
        leaving = cluster is not None and membership.handed_over(cluster) is not None
        consumers = cluster.relocator.groups() if cluster is not None and leaving else None
        return await inspection.broker_info(
            self._store,
            self._live,
            self._config,
            skip_undrained=request.skip_undrained,
            drains=drains,
            relocated=consumers,
        )

    # --- the cluster ------------------------------------------------------------------------------------
    def _cluster_or_refuse(self) -> Cluster:
        if self._cluster is None:
            raise errors.Unsupported("this admin service runs without a broker: it has no cluster")
        return self._cluster

    @override
    @_edge
    async def GetCluster(self, request: pb.GetClusterRequest, context: Context) -> pb.GetClusterResponse:
        cluster = self._cluster_or_refuse()
        if request.caller:
            cluster.heard_from(request.caller, request.caller_incarnation)
        return await membership.view(cluster, self._store, with_undrained=request.with_undrained)

    @override
    @_edge
    async def SetCluster(self, request: pb.SetClusterRequest, context: Context) -> pb.SetClusterResponse:
        return await membership.change(self._cluster_or_refuse(), self._store, request)

    # --- users and access control (docs/security.md, "Access control") ---------------------------------
    @override
    @_edge
    async def PutUser(self, request: pb.PutUserRequest, context: Context) -> pb.PutUserResponse:
        user, created = await asyncio.to_thread(self._users.put_user, users.user_from_pb(request.user))
        await self._everywhere.send_on(context, "PutUser", request)
        return pb.PutUserResponse(user=users.user_to_pb(user), created=created)

    @override
    @_edge
    async def GetUser(self, request: pb.GetUserRequest, context: Context) -> pb.GetUserResponse:
        user, entries = await asyncio.to_thread(self._users.get_user, request.name)
        return pb.GetUserResponse(user=users.user_to_pb(user), acl_entries=entries)

    @override
    @_edge
    async def DeleteUser(self, request: pb.DeleteUserRequest, context: Context) -> pb.DeleteUserResponse:
        deleted, entries = await asyncio.to_thread(self._users.delete_user, request.name)
        await self._everywhere.send_on(context, "DeleteUser", request)
        return pb.DeleteUserResponse(deleted=deleted, acl_entries_deleted=entries)

    @override
    @_edge
    async def ListUsers(self, request: pb.ListUsersRequest, context: Context) -> pb.ListUsersResponse:
        found = await asyncio.to_thread(self._users.list_users)
        return pb.ListUsersResponse(
            users=[pb.GetUserResponse(user=users.user_to_pb(u), acl_entries=n) for u, n in found]
        )

    @override
    @_edge
    async def PutAcl(self, request: pb.PutAclRequest, context: Context) -> pb.PutAclResponse:
        entries = [users.entry_from_pb(e) for e in request.entries]
        stored, created = await asyncio.to_thread(self._users.put_entries, entries)
        await self._everywhere.send_on(context, "PutAcl", request)
        return pb.PutAclResponse(entries=[users.entry_to_pb(e) for e in stored], created=created)

    @override
    @_edge
    async def GetAcl(self, request: pb.GetAclRequest, context: Context) -> pb.GetAclResponse:
        found = await asyncio.to_thread(self._users.get_entries, request.user)
        return pb.GetAclResponse(entries=[users.entry_to_pb(e) for e in found])

    @override
    @_edge
    async def DeleteAcl(self, request: pb.DeleteAclRequest, context: Context) -> pb.DeleteAclResponse:
        decision = policy.decision_of(request.decision) if request.decision else None
        deleted = await asyncio.to_thread(self._users.delete_entries, request.user, request.resource, decision)
        await self._everywhere.send_on(context, "DeleteAcl", request)
        return pb.DeleteAclResponse(deleted=deleted)

    @override
    @_edge
    async def ListAcls(self, request: pb.ListAclsRequest, context: Context) -> pb.ListAclsResponse:
        found = await asyncio.to_thread(self._users.list_entries)
        return pb.ListAclsResponse(entries=[users.entry_to_pb(e) for e in found])
