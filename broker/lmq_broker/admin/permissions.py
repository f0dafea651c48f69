"""Which admin calls a user may make under ``--acl``: the admin actions of its policies, per resource.

The admin pair, and users marked super, may call everything. Any other user (signed with its own key pair,
``auth.AdminGuard``) may call the methods of ``OPEN`` when its policies allow that method's action on the
resource the request names: parent topics as ``Topic:<name>`` (Get and List also admit a user with rights on
some lite topic of it), lite groups as ``Group:<name>``, lite topics as ``Lite:<parent>/<name>``. A Put needs
``Create`` when the resource does not exist yet and ``Update`` when it does. A List answers only the entries the
user may List (ListLiteTopics also needs List on the parent, as ``Topic:<parent>`` or some lite topic of
it). Everything else (users and policies, quotas, cluster membership, backups, reclaiming, the MQTT
and cluster-internal calls) stays with the admin pair and super users.

A refusal is gRPC PERMISSION_DENIED naming the user, action and resource, counted in
``lmq_acl_refused_total{user,action}`` and logged at INFO (``AccessControl.note``), never with a secret.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import grpc

from lmq_broker import errors
from lmq_broker.access import policy
from lmq_broker.access.control import AccessControl
from lmq_broker.admin import codes
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as pb
from lmq_broker.storage.api import Store

if TYPE_CHECKING:
    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]
    Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]

A = policy.Action
Need = tuple[policy.Action, policy.Target]
SERVICE_PREFIX: Final = "/lmq.admin.v1.LmqAdmin/"

# method -> what it needs of the request; Put methods: (resource kind, name) looked up for Create or Update
OPEN: Final[dict[str, Callable[[Any], Need]]] = {
    "GetParentTopic": lambda r: (A.GET, policy.under(r.name)),
    "DeleteParentTopic": lambda r: (A.DELETE, policy.topic(r.name)),
    "GetLiteGroup": lambda r: (A.GET, policy.group(r.name)),
    "DeleteLiteGroup": lambda r: (A.DELETE, policy.group(r.name)),
    "DescribeLiteTopic": lambda r: (A.GET, policy.lite(r.parent, r.lite)),
    "ListLiteTopics": lambda r: (A.LIST, policy.under(r.parent)),
    "GetGroupLag": lambda r: (A.GET, policy.group(r.group)),
}
PUTS: Final[dict[str, Callable[[Any], policy.Target]]] = {
    "PutParentTopic": lambda r: policy.topic(r.topic.name),
    "PutLiteGroup": lambda r: policy.group(r.group.name),
}
LISTS: Final = frozenset({"ListParentTopics", "ListLiteGroups", "ListLiteTopics"})


def _verb(method: str) -> policy.Action:
    """The action a refusal of an admin-only method is counted as."""
    for prefix, action in (("Get", A.GET), ("Describe", A.GET), ("List", A.LIST), ("Delete", A.DELETE)):
        if method.startswith(prefix):
            return action
    return A.UPDATE


class UserCalls:
    """``auth.UserCalls`` for the admin service: a user's admin call, checked per method and request."""

    def __init__(self, access: AccessControl, store: Store) -> None:
        self._access = access
        self._store = store

    def secret_of(self, name: str) -> str | None:
        return self._access.secret_of(name) if self._access.enabled else None

    def handler(self, method_path: str, user: str, handler: Handler) -> Handler:
        method = method_path.removeprefix(SERVICE_PREFIX)
        if self._access.is_super(user):
            return handler
        if handler.unary_unary is None or method not in OPEN.keys() | PUTS.keys() | LISTS:
            return self._denying(handler, user, method)
        inner: Any = handler.unary_unary  # an async behaviour on the aio server (the stubs type it sync)

        async def checked(request: Any, context: Context) -> Any:
            try:
                await self._permit(method, user, context.peer(), request)
            except errors.Forbidden as refused:
                self._access.note(f"admin {method}", refused.message)
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED, refused.message, trailing_metadata=codes.trailers(refused)
                )
            response = await inner(request, context)
            if method in LISTS:
                self._keep_listable(user, context.peer(), response)
            return response

        return grpc.unary_unary_rpc_method_handler(
            checked, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )

    async def _permit(self, method: str, user: str, peer: str, request: Any) -> None:
        access = self._access
        if method in LISTS and method not in OPEN:
            return  # answered with what the user may List
        if method in PUTS:
            target = PUTS[method](request)
            exists = await asyncio.to_thread(self._exists, target)
            access.check(user, A.UPDATE if exists else A.CREATE, target, peer)
            return
        action, target = OPEN[method](request)
        access.check(user, action, target, peer)

    def _exists(self, target: policy.Target) -> bool:
        if target.kind is policy.Kind.TOPIC:
            return self._store.get_parent_topic(target.name) is not None
        return self._store.get_group(target.name) is not None

    def _keep_listable(self, user: str, peer: str, response: Any) -> None:
        allows = self._access.allows
        if isinstance(response, pb.ListParentTopicsResponse):
            kept = [t for t in response.topics if allows(user, A.LIST, policy.under(t.topic.name), peer)]
            del response.topics[:]
            response.topics.extend(kept)
        elif isinstance(response, pb.ListLiteGroupsResponse):
            groups = [g for g in response.groups if allows(user, A.LIST, policy.group(g.group.name), peer)]
            del response.groups[:]
            response.groups.extend(groups)
        elif isinstance(response, pb.ListLiteTopicsResponse):
            lites = [t for t in response.topics if allows(user, A.LIST, policy.lite(t.parent, t.lite), peer)]
            del response.topics[:]
            response.topics.extend(lites)

    def _denying(self, handler: Handler, user: str, method: str) -> Handler:
        """An admin-only method: PERMISSION_DENIED, counted as the action its name says."""
        name = self._access.count_refusal(user, _verb(method))
        message = (
            f"user {name} may not call {method}: user and acl management, quotas and cluster-wide calls take the "
            "admin key pair or a super user (access control; see docs/security.md)"
        )
        self._access.note(f"admin {method}", message)

        trailers = codes.trailers(errors.Forbidden(message))

        async def deny(request: Any, context: Context) -> Any:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, message, trailing_metadata=trailers)

        async def deny_stream(request: Any, context: Context) -> AsyncIterator[Any]:
            # A generator, as a stream's handler must be: the native edge iterates it (a coroutine there ended
            # the call UNKNOWN, with a stack trace, instead of PERMISSION_DENIED).
            await deny(request, context)
            yield  # pragma: no cover (abort raises)

        serializer = handler.response_serializer
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(deny_stream, response_serializer=serializer)
        return grpc.unary_unary_rpc_method_handler(deny, response_serializer=serializer)
