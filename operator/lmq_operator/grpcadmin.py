"""``admins.BrokerAdmin`` over a broker's admin service (gRPC): the operator's configs to the broker's models and
back, and its errors as ``AdminError`` values, so a handler never has to catch gRPC errors. Calls go through the
broker's own ``AsyncAdminClient`` on kopf's loop: a hundred resources created at once are a hundred concurrent
calls, not a queue in front of a small thread pool.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Final, Literal

from lmq_broker import errors
from lmq_broker import model as broker_model
from lmq_broker.admin import codes
from lmq_broker.admin.client import AsyncAdminClient
from lmq_broker.admin.credentials import KeyPair
from lmq_broker.admin.results import AclEntry
from lmq_broker.admin.tls import ClientTls
from lmq_operator import model
from lmq_operator.admins import AdminError

_MODELS: Final[dict[broker_model.SubscriptionModel, Literal["Shared", "Exclusive"]]] = {
    broker_model.SubscriptionModel.SHARED: "Shared",
    broker_model.SubscriptionModel.EXCLUSIVE: "Exclusive",
}


def _to_broker(
    c: model.TopicConfig | model.GroupConfig | model.QuotaConfig,
) -> broker_model.ParentTopic | broker_model.LiteGroup | broker_model.Quota:
    if isinstance(c, model.TopicConfig):
        message_type = broker_model.MessageType(c.message_type)
        return broker_model.ParentTopic(c.name, message_type, c.expiration_minutes, c.max_lite_topics)
    if isinstance(c, model.GroupConfig):
        retry = broker_model.RetryPolicy(c.max_attempts, c.backoff_ms)
        return broker_model.LiteGroup(
            c.name,
            c.bind_topic,
            broker_model.SubscriptionModel(c.model),
            c.client_quota,
            c.ready_capacity,
            retry,
            c.fifo,
            c.consume_enabled,
            c.wildcard,
            c.lite_patterns,
        )
    return broker_model.Quota(c.scope, c.max_lite_topics, c.max_subscriptions_per_client, c.max_send_rate)


def _topic_config(t: broker_model.ParentTopic) -> model.TopicConfig:
    return model.TopicConfig(t.name, t.expiration_minutes, t.max_lite_topics, int(t.message_type))


def _group_config(g: broker_model.LiteGroup) -> model.GroupConfig:
    return model.GroupConfig(
        name=g.name,
        bind_topic=g.bind_topic,
        model=_MODELS[g.model],
        client_quota=g.client_quota,
        ready_capacity=g.ready_capacity,
        max_attempts=g.retry.max_attempts,
        backoff_ms=g.retry.backoff_ms,
        fifo=g.fifo,
        consume_enabled=g.consume_enabled,
        wildcard=g.wildcard,
        lite_patterns=g.lite_patterns,
    )


def _quota_config(q: broker_model.Quota) -> model.QuotaConfig:
    return model.QuotaConfig(q.scope, q.max_lite_topics, q.max_subscriptions_per_client, q.max_send_rate)


def _reclaim(run: broker_model.ReclaimRun | None) -> model.ReclaimRun | None:
    # The broker's record has the operator's fields, and the parent, which the caller knows.
    return None if run is None else model.ReclaimRun(**{f.name: getattr(run, f.name) for f in fields(model.ReclaimRun)})


def _failed(exc: errors.LmqError) -> AdminError:
    """A failed call as the operator's value: UNAVAILABLE when a retry may help (``codes.transient``)."""
    failure = model.Failure.UNAVAILABLE if codes.transient(exc) else model.Failure.REJECTED
    return AdminError(failure, f"{exc.fields.get('code', type(exc).__name__)}: {exc.message}")


class GrpcAdmin:
    """``BrokerAdmin`` over the broker's admin service, through ``AsyncAdminClient`` on the caller's loop.
    Every call, a purging parent-topic delete and the undrained count included, gets ``timeout_s``."""

    def __init__(
        self, endpoint: str, timeout_s: float, keys: tuple[str, str] | None = None, tls: ClientTls | None = None
    ) -> None:
        self.endpoint = endpoint
        pair = KeyPair(*keys) if keys else None  # brokers guard admin calls with their admin pair
        # here_only: the operator calls every broker itself and tracks each one's sync; a broker's own copies to
        # its peers would make one broker's put fail for another's absence.
        self._client = AsyncAdminClient(
            endpoint, timeout_s, long_timeout_s=timeout_s, keys=pair, tls=tls, here_only=True
        )

    async def get(self, kind: model.Kind, key: str) -> model.Observed | None:
        try:
            if kind is model.Kind.LMQ_USER:
                return model.Observed(await self._user(key))
            if kind is model.Kind.PARENT_TOPIC:
                t = await self._client.get_parent_topic(key)
                count = (("liteTopicCount", t.lite_topic_count),)
                return model.Observed(_topic_config(t.topic), count, _reclaim(t.last_reclaim))
            if kind is model.Kind.LITE_GROUP:
                g = await self._client.get_group(key)
                figures = (("subscriptionCount", g.subscription_count), ("clientCount", g.client_count), ("lag", g.lag))
                orphan = not await self._has_topic(g.group.bind_topic)  # a broker keeps a group its parent left
                return model.Observed(_group_config(g.group), figures, parent_missing=orphan)
            found = next((q for q in await self._client.list_quotas() if q.scope == key), None)
            return None if found is None else model.Observed(_quota_config(found))
        except errors.NotFound:
            return None
        except errors.LmqError as exc:
            raise _failed(exc) from None

    async def put(self, config: model.Config) -> bool:
        if isinstance(config, model.UserConfig):
            try:
                return await self._put_user(config)
            except errors.LmqError as exc:
                raise _failed(exc) from None
        wanted = _to_broker(config)
        try:
            if isinstance(wanted, broker_model.ParentTopic):
                return (await self._client.put_parent_topic(wanted)).created
            if isinstance(wanted, broker_model.LiteGroup):
                return (await self._client.put_group(wanted)).created
            return (await self._client.put_quota(wanted)).created
        except errors.TopicNotFound as exc:  # only a group's put names another object: its parent topic
            raise AdminError(model.Failure.MISSING_PARENT, f"NOT_FOUND: {exc.message}") from None
        except errors.LmqError as exc:
            raise _failed(exc) from None

    async def _user(self, name: str) -> model.UserConfig:
        user = await self._client.get_user(name)
        entries = (
            model.AclEntryConfig(e.resource, e.actions, e.decision, e.sources) for e in await self._client.get_acl(name)
        )
        return model.UserConfig(user.name, user.super_user, user.enabled, tuple(sorted(entries, key=lambda e: e.key)))

    async def _put_user(self, c: model.UserConfig) -> bool:
        """The user, then its entries exactly: every moment in between is at most as permissive as before or
        after (extra allows go first, extra denies last)."""
        put = await self._client.put_user(c.name, c.secret, super_user=c.super_user, enabled=c.enabled)
        wanted = {e.key for e in c.entries}
        extra = [e for e in await self._client.get_acl(c.name) if (e.resource, e.decision) not in wanted]
        for e in extra:
            if e.decision != "Deny":
                await self._client.delete_acl(c.name, e.resource, e.decision)
        if c.entries:
            await self._client.put_acl(
                [AclEntry(c.name, e.resource, e.actions, e.decision, e.sources) for e in c.entries]
            )
        for e in extra:
            if e.decision == "Deny":
                await self._client.delete_acl(c.name, e.resource, e.decision)
        return put.created

    async def _has_topic(self, name: str) -> bool:
        try:
            await self._client.get_parent_topic(name)
        except errors.NotFound:
            return False
        return True

    async def delete(self, kind: model.Kind, key: str, purge: bool) -> bool:
        try:
            if kind is model.Kind.PARENT_TOPIC:
                return (await self._client.delete_parent_topic(key, purge_lite_topics=purge)).deleted
            if kind is model.Kind.LITE_GROUP:
                return await self._client.delete_group(key)
            if kind is model.Kind.LMQ_USER:
                return (await self._client.delete_user(key)).deleted  # its policy entries go with it
            return await self._client.delete_quota(key)
        except errors.NotFound:
            return False  # already gone: deleting is idempotent
        except errors.LmqError as exc:
            raise _failed(exc) from None

    async def undrained_messages(self) -> int:
        try:
            return (await self._client.broker_info(with_undrained=True)).undrained_messages
        except errors.LmqError as exc:
            raise _failed(exc) from None

    async def close(self) -> None:
        await self._client.close()
