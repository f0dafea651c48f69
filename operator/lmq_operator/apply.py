"""The operator's only I/O: admin calls to brokers and the Kubernetes reads that find them.

Everything here turns failures into values (``diff.Unreachable``, ``model.BrokerSync`` with a ``Failure``)
so that one bad broker never aborts the work on the others, and a handler never has to catch gRPC errors.
Admin calls go through the broker's own ``AsyncAdminClient`` on kopf's loop: a hundred resources created at
once are a hundred concurrent calls, not a queue in front of a small thread pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, Final, Literal

import kubernetes

from lmq_broker import errors
from lmq_broker import model as broker_model
from lmq_broker.admin import codes
from lmq_broker.admin.client import AsyncAdminClient
from lmq_broker.admin.credentials import KeyPair
from lmq_broker.admin.tls import ClientTls
from lmq_broker.cluster import ring
from lmq_operator import desired, diff, leadership, model, resyncing, settings, status
from lmq_operator.admins import AdminError, BrokerAdmin

log = logging.getLogger(__name__)

_ORDINAL = re.compile(r"-(\d+)$")
# The broker StatefulSet's volumeClaimTemplates name (charts/lmq): pod <sts>-<N> keeps its data in claim data-<sts>-<N>.
CLAIM_TEMPLATE: Final = "data"
_MODELS: Final[dict[broker_model.SubscriptionModel, Literal["Shared", "Exclusive"]]] = {
    broker_model.SubscriptionModel.SHARED: "Shared",
    broker_model.SubscriptionModel.EXCLUSIVE: "Exclusive",
}


# ---- brokers' admin service -----------------------------------------------------------------------------


def _to_broker(c: model.Config) -> broker_model.ParentTopic | broker_model.LiteGroup | broker_model.Quota:
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


AdminFactory = Callable[[str], BrokerAdmin]


@dataclass
class AdminPool:
    """One admin connection per broker endpoint, closed when the broker leaves the fleet."""

    factory: AdminFactory
    _open: dict[str, BrokerAdmin] = field(default_factory=dict)

    def __call__(self, broker: model.Broker) -> BrokerAdmin:
        admin = self._open.get(broker.endpoint)
        if admin is None:
            admin = self._open[broker.endpoint] = self.factory(broker.endpoint)
        return admin

    async def prune(self, keep: Iterable[model.Broker]) -> None:
        endpoints = {b.endpoint for b in keep}
        for endpoint in [e for e in self._open if e not in endpoints]:
            await self._open.pop(endpoint).close()

    async def close(self) -> None:
        await self.prune(())


# ---- reconcile I/O ------------------------------------------------------------------------------------


async def observe(
    pool: AdminPool, kind: model.Kind, key: str, brokers: Iterable[model.Broker]
) -> dict[model.Broker, diff.Observation]:
    async def one(broker: model.Broker) -> diff.Observation:
        try:
            return await pool(broker).get(kind, key)
        except AdminError as exc:
            return diff.Unreachable(exc.message)

    targets = list(brokers)
    seen = await asyncio.gather(*(one(b) for b in targets))
    return dict(zip(targets, seen, strict=True))


async def execute(
    pool: AdminPool, plan: diff.Plan, observed: Mapping[model.Broker, diff.Observation]
) -> list[model.BrokerSync]:
    async def one(step: diff.Step) -> model.BrokerSync:
        seen = observed.get(step.broker)
        figures = seen.figures if isinstance(seen, model.Observed) else ()
        reclaim = seen.reclaim if isinstance(seen, model.Observed) else None
        if isinstance(seen, model.Observed) and seen.parent_missing and isinstance(step.config, model.GroupConfig):
            text = f"parent topic {step.config.bind_topic!r} not found"  # a write would be refused for the same
            return model.BrokerSync(step.broker, False, step.change.value, model.Failure.MISSING_PARENT, text)
        if step.change is diff.Change.NONE:
            return model.BrokerSync(step.broker, True, step.change.value, figures=figures, reclaim=reclaim)
        try:
            await pool(step.broker).put(step.config)
        except AdminError as exc:
            # The put failed, but the record was read all the same: it still counts for status.lastReclaim.
            return model.BrokerSync(step.broker, False, step.change.value, exc.failure, exc.message, reclaim=reclaim)
        return model.BrokerSync(step.broker, True, step.change.value, figures=figures, reclaim=reclaim)

    done = list(await asyncio.gather(*(one(s) for s in plan.steps)))
    for broker, message in plan.unreachable:
        done.append(model.BrokerSync(broker, False, "", model.Failure.UNAVAILABLE, message))
    return done


async def sync(
    pool: AdminPool, wanted: model.Config, kind: model.Kind, brokers: Iterable[model.Broker]
) -> tuple[diff.Plan, list[model.BrokerSync]]:
    observed = await observe(pool, kind, wanted.key, brokers)
    planned = diff.plan(wanted, observed)
    return planned, await execute(pool, planned, observed)


async def delete(
    pool: AdminPool, kind: model.Kind, key: str, brokers: Iterable[model.Broker], purge: bool
) -> list[tuple[model.Broker, str | None]]:
    """Delete ``key`` from every broker; returns each broker's error text (None: deleted or absent)."""

    async def one(broker: model.Broker, name: str) -> tuple[model.Broker, str | None]:
        try:
            await pool(broker).delete(kind, name, purge)
        except AdminError as exc:
            return broker, exc.message
        return broker, None

    return list(await asyncio.gather(*(one(b, k) for b, k in diff.plan_delete(list(brokers), key))))


# ---- a joining broker, before the ring names it ---------------------------------------------------------

# A failure a resource already reports on every broker is the resource's, not a joining broker's: it does not
# hold a scale-up (a person fixes the resource; the ring need not wait for that).
_REPORTED: Final = {
    model.Failure.REJECTED: status.Reason.BROKER_REJECTED,
    model.Failure.MISSING_PARENT: status.Reason.PARENT_TOPIC_NOT_FOUND,
}


@dataclass(frozen=True, slots=True)
class Missing:
    """A resource a joining broker does not hold after ``prepare``."""

    text: str
    refused: bool  # the broker answered no (retrying the same spec will not help), else it was not reached


async def prepare(
    pool: AdminPool,
    brokers: Sequence[model.Broker],
    kind: model.Kind,
    body: Mapping[str, Any],
    claims: Mapping[str, Iterable[model.Claimant]],
) -> list[Missing]:
    """Apply one resource to ``brokers`` only, with the reconcile's own observe, diff and put: joining brokers
    get everything before any broker is told the ring that makes them members. Status is the reconcile's to
    write; a resource the operator leaves alone (paused, unmanaged, invalid, in conflict) is skipped."""
    wanted = desired.gate(kind, body["metadata"], body.get("spec") or {}, claims)
    if isinstance(wanted, desired.Blocked):
        return []
    _, syncs = await sync(pool, wanted, kind, brokers)
    ready = status.ready_of(body.get("status") or {})
    missing = []
    for s in syncs:
        if s.synced:
            continue
        reported = _REPORTED.get(s.failure) if s.failure is not None else None
        if reported is not None and ready is not None and ready[1] == reported.value:
            continue
        text = f"{kind.value} {wanted.key!r} on {s.broker.name}: {s.message}"
        missing.append(Missing(text, s.failure is model.Failure.REJECTED))
    return missing


async def listed(kind: model.Kind, namespace: str | None, client: Any = None, page: int = 500) -> dict[str, bytes]:
    """uid -> compact copy of every resource of ``kind`` the apiserver has (in ``namespace``, else all), a page
    at a time: what a joining broker must hold even when kopf's index is still filling (an operator that just
    started in the middle of a scale-up)."""

    def read() -> dict[str, bytes]:
        api = kubernetes.client.CustomObjectsApi(client or shared_kube_client())
        found: dict[str, bytes] = {}
        token: str | None = None
        while True:
            args: dict[str, Any] = {"limit": page, "_preload_content": False}
            if token:
                args["_continue"] = token
            resp: Any
            if namespace:
                resp = api.list_namespaced_custom_object(model.GROUP, model.VERSION, namespace, kind.plural, **args)
            else:
                resp = api.list_cluster_custom_object(model.GROUP, model.VERSION, kind.plural, **args)
            listing = json.loads(resp.data)
            for item in listing.get("items") or []:
                found[item["metadata"]["uid"]] = resyncing.compact(item)
            token = (listing.get("metadata") or {}).get("continue")
            if not token:
                return found

    return await asyncio.to_thread(read)


# ---- one resource, end to end -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Event:
    type: str  # "Normal" | "Warning"
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a reconcile decided: the new status, Events to post, and whether a retry can fix what is left."""

    status: dict[str, Any]
    events: tuple[Event, ...] = ()
    retry: bool = False
    repaired: int = 0  # broker copies a resync re-created or overwrote
    brokers: int | None = None


async def reconcile(
    pool: AdminPool,
    fleet: Fleet,
    kind: model.Kind,
    *,
    trigger: str,
    body: Mapping[str, Any],
    claims: Mapping[str, Iterable[model.Claimant]],
    now: datetime,
) -> Outcome:
    meta = body["metadata"]
    previous: Mapping[str, Any] = dict(body.get("status") or {})
    generation = int(meta.get("generation") or 0)
    wanted = desired.gate(kind, meta, body.get("spec") or {}, claims)
    if isinstance(wanted, desired.Blocked):
        key = (kind, wanted.key) if wanted.key is not None else None
        new = status.blocked(wanted.reason, wanted.message, generation=generation, previous=previous, now=now, key=key)
        return Outcome(new, _transition_events(previous, new))
    view = await fleet.view()
    _, syncs = await sync(pool, wanted, kind, view.targets)
    new = status.applied(kind, wanted.key, generation=generation, syncs=syncs, previous=previous, now=now)
    if kind is model.Kind.PARENT_TOPIC:
        status.with_condition(new, status.drained(view.leaving, previous, now))
    news = _write_events(trigger, syncs, previous)
    retry = not syncs or any(not s.synced for s in syncs)
    repaired = sum(len(names) for reason, names in news.items() if reason == "DriftRepaired")
    writes = tuple(
        Event("Normal", r, f"{kind.value} {wanted.key!r} {_VERB[r]} on {', '.join(n)}") for r, n in news.items()
    )
    return Outcome(new, writes + _transition_events(previous, new), retry, repaired, len(view.targets))


WOKEN: Final = "parent"  # the trigger of a LiteGroup reconciled at once because its ParentTopic turned Ready
_VERB: Final = {"Created": "created", "Adopted": "adopted", "Updated": "applied", "DriftRepaired": "repaired"}
_CHANGE_TEXT: Final = {"missing": "was missing", "differs": "differed, overwritten", "none": "already identical"}


def _write_events(trigger: str, syncs: Sequence[model.BrokerSync], previous: Mapping[str, Any]) -> dict[str, list[str]]:
    """Event reason -> "broker (what it held)" entries. A create that finds the object already on a broker,
    equal or not, adopts it there. A broker the previous status lists as synced got its copy from an earlier
    attempt of this same create (a retry, a restart): finding it there again is no news. A LiteGroup woken by
    its ParentTopic turning Ready continues a create or an update the brokers refused: a copy it writes where
    none was is created, one it overwrites updated, not a repaired drift."""
    ours = {row.get("name") for row in previous.get("brokers") or () if row.get("synced")}
    found: dict[str, list[str]] = {}
    for s in sorted(syncs, key=lambda s: s.broker):
        if not s.synced:
            continue
        if trigger == "create" and s.broker.name not in ours:
            reason = "Created" if s.change == diff.Change.MISSING.value else "Adopted"
        elif trigger == WOKEN and s.change != diff.Change.NONE.value:
            reason = "Created" if s.change == diff.Change.MISSING.value else "Updated"
        elif s.change == diff.Change.NONE.value:
            continue
        else:
            reason = "Updated" if trigger == "update" else "DriftRepaired"
        found.setdefault(reason, []).append(f"{s.broker.name} ({_CHANGE_TEXT[s.change]})")
    return found


def _transition_events(previous: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[Event, ...]:
    before, after = status.ready_of(previous), status.ready_of(new)
    if after is None or after == before:
        return ()
    cond = next(c for c in new["conditions"] if c["type"] == status.READY)
    return (Event("Warning" if after[0] == "False" else "Normal", after[1], str(cond["message"])),)


# Why a resource stays Terminating, and the way out for brokers that are gone for good.
_KEEP: Final = (
    f"; {model.FINALIZER} stays and deletion is retried until every broker is reached"
    f' (annotate {model.ANNOTATION_MANAGED}: "false" to leave the broker copies instead)'
)


async def remove(
    pool: AdminPool,
    fleet: Fleet,
    kind: model.Kind,
    body: Mapping[str, Any],
    claims: Mapping[str, Iterable[model.Claimant]],
) -> Outcome:
    """Delete the broker copies unless the resource says to keep them; ``retry`` keeps the finalizer."""
    meta, spec = body["metadata"], body.get("spec") or {}
    wanted = desired.gate(kind, meta, spec, claims)
    if isinstance(wanted, desired.Blocked):
        if wanted.reason is status.Reason.INVALID:
            return Outcome({})  # it never reached a broker
        what = wanted.key or desired.broker_key(kind, str(meta["name"]), spec)
        return Outcome({}, (Event("Normal", "Retained", f"{kind.value} {what!r} left on brokers: {wanted.message}"),))
    if isinstance(wanted, model.TopicConfig) and spec.get("deletionPolicy") == "retain":
        text = f"{kind.value} {wanted.key!r} left on brokers (deletionPolicy: retain)"
        return Outcome({}, (Event("Normal", "Retained", text),))
    # Releasing the finalizer is only safe once every broker said the copy is gone: with no broker to ask
    # (discovery failed, or found none, e.g. all pods restarting) the copies would be orphaned for good.
    view = await fleet.view()
    what = f"{kind.value} {wanted.key!r}"
    if view.error is not None:
        text = f"{what} not deleted: broker discovery failed: {view.error}"
        return Outcome({}, (Event("Warning", "DeleteFailed", text + _KEEP),), retry=True, brokers=len(view.targets))
    if not view.targets:
        text = f"{what} not deleted: no broker pod is discovered"
        return Outcome({}, (Event("Warning", "DeleteFailed", text + _KEEP),), retry=True, brokers=0)
    failed = [(b, e) for b, e in await delete(pool, kind, wanted.key, view.targets, True) if e]
    if failed:
        detail = "; ".join(f"{b.name}: {e}" for b, e in failed)
        text = f"{what} not deleted on {detail}"
        return Outcome({}, (Event("Warning", "DeleteFailed", text + _KEEP),), retry=True, brokers=len(view.targets))
    text = f"{what} deleted on {len(view.targets)} brokers"
    return Outcome({}, (Event("Normal", "Deleted", text),), brokers=len(view.targets))


# ---- finding brokers ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FleetView:
    """The brokers to apply to, and the leaving ones (ordinal >= replicas) that still hold data."""

    targets: tuple[model.Broker, ...]
    leaving: tuple[model.Leaving, ...] = ()
    error: str | None = None  # discovery failed; targets are the last known good ones


def _ordinal(pod: str | None) -> int | None:
    match = _ORDINAL.search(pod or "")
    return int(match.group(1)) if match else None


def brokers_from_slices(
    slices: Iterable[Mapping[str, Any]], default_port: int, processes: int = 1
) -> list[tuple[model.Broker, bool]]:
    """(broker, ready) for every endpoint of the Service's EndpointSlices, deduplicated by pod. With several
    processes per pod, each process is a broker of its own (``<pod>-p<i>``) on its own port ``grpc + 1 + i``."""
    found: dict[str, tuple[model.Broker, bool]] = {}
    for s in slices:
        ports = s.get("ports") or []
        named = {p.get("name"): p.get("port") for p in ports}
        port = named.get("admin") or named.get("grpc")  # "admin": brokers serving admin on its own port
        if port is None and ports:
            port = ports[0].get("port")
        port = port or default_port
        grpc = named.get("grpc") or port
        for ep in s.get("endpoints") or []:
            addresses = ep.get("addresses") or []
            if not addresses:
                continue
            pod = (ep.get("targetRef") or {}).get("name") or ep.get("hostname") or addresses[0]
            ready = (ep.get("conditions") or {}).get("ready") is not False
            if processes == 1:
                found[pod] = (model.Broker(pod, f"{addresses[0]}:{port}", _ordinal(pod)), ready)
                continue
            for i in range(processes):
                name = f"{pod}-p{i}"
                found[name] = (model.Broker(name, f"{addresses[0]}:{ring.process_port(grpc, i)}", _ordinal(pod)), ready)
    return sorted(found.values())


class Fleet:
    """Discovers brokers, at most once per ``discovery_ttl_s``; concurrent callers share one refresh."""

    def __init__(
        self,
        conf: settings.Settings,
        pool: AdminPool,
        clock: Callable[[], float] = time.monotonic,
        ring_pods: Callable[[], int | None] = lambda: None,
    ) -> None:
        self._conf = conf
        self._pool = pool
        self._clock = clock
        self._ring_pods = ring_pods  # pods of today's ring while the operator scales the brokers down
        self._lock = asyncio.Lock()
        self._view: FleetView | None = None
        self._at = 0.0
        self._kube: Any = None

    async def view(self) -> FleetView:
        async with self._lock:
            if self._view is None or self._clock() - self._at >= self._conf.discovery_ttl_s:
                self._view = await self._discover(self._view)
                self._at = self._clock()
                await self._pool.prune([*self._view.targets, *(x.broker for x in self._view.leaving)])
            return self._view

    async def _discover(self, last: FleetView | None) -> FleetView:
        try:
            replicas = await self._replicas()
            claims = await self._claims_or_none(replicas) if replicas is not None else {}
            if self._conf.brokers:
                known = [(model.Broker(ep, ep, i), True) for i, ep in enumerate(self._conf.brokers)]
            else:
                known = brokers_from_slices(await self._slices(), self._conf.admin_port, self._conf.processes)
        except Exception as exc:  # any API failure: keep serving the last good view
            log.warning("broker discovery failed: %s", exc)
            return FleetView(last.targets if last else (), last.leaving if last else (), error=str(exc))
        if replicas is None:
            return FleetView(tuple(b for b, ready in known if ready))
        targets, leaving = [], []
        asked: set[int] = set()
        ring = self._ring_pods()
        for broker, ready in known:
            if broker.ordinal is not None and ring is not None and ring <= broker.ordinal < replicas:
                # Leaving the ring but still running: it serves its consumers (so it gets every resource) and
                # drains; the scale-down waits for it.
                if ready:
                    targets.append(broker)
                    undrained = await self._undrained(broker)
                    if undrained != 0:
                        leaving.append(model.Leaving(broker, ring, undrained, claims.get(broker.ordinal), True))
                continue
            if broker.ordinal is None or broker.ordinal < replicas:
                if ready:
                    targets.append(broker)
                continue
            asked.add(broker.ordinal)
            claim = claims.get(broker.ordinal)
            undrained = await self._undrained(broker)
            if undrained or (undrained is None and claim is not None):
                leaving.append(model.Leaving(broker, replicas, undrained, claim))
        # In a cluster a leaving pod and its endpoint are gone at once; its claim, and the data, stay.
        for ordinal, claim in sorted(claims.items()):
            if ordinal not in asked:
                name = f"{self._conf.broker_statefulset}-{ordinal}"
                leaving.append(model.Leaving(model.Broker(name, "", ordinal), replicas, None, claim))
        return FleetView(tuple(targets), tuple(leaving))

    async def _undrained(self, broker: model.Broker) -> int | None:
        try:
            return await self._pool(broker).undrained_messages()
        except AdminError as exc:
            log.info("leaving broker %s did not answer: %s", broker.name, exc.message)
            return None

    def _client(self) -> Any:
        if self._kube is None:
            self._kube = kube_client()
        return self._kube

    async def _replicas(self) -> int | None:
        name, ns = self._conf.broker_statefulset, self._conf.broker_namespace
        if name is None or ns is None:
            return None

        def read() -> Any:
            return kubernetes.client.AppsV1Api(self._client()).read_namespaced_stateful_set(name, ns)

        sts = await asyncio.to_thread(read)
        return int(sts.spec.replicas if sts.spec.replicas is not None else 1)

    async def _claims_or_none(self, replicas: int) -> dict[int, str]:
        """``_claims``, or none when they cannot be listed (e.g. an RBAC role without the rule): the brokers
        are still found and applied to; only the drain check of leaving brokers loses its claim evidence."""
        try:
            return await self._claims(replicas)
        except Exception as exc:
            log.warning("cannot list the broker volume claims (drain check without them): %s", exc)
            return {}

    async def _claims(self, replicas: int) -> dict[int, str]:
        """Ordinal -> name of the broker volume claims ``data-<statefulset>-<ordinal>`` at or above ``replicas``."""
        sts, ns = self._conf.broker_statefulset, self._conf.broker_namespace or "default"
        pattern = re.compile(rf"^{CLAIM_TEMPLATE}-{re.escape(str(sts))}-(\d+)$")

        def read() -> Any:
            return kubernetes.client.CoreV1Api(self._client()).list_namespaced_persistent_volume_claim(ns)

        found = {}
        for pvc in (await asyncio.to_thread(read)).items or []:
            match = pattern.match(pvc.metadata.name or "")
            if match and int(match.group(1)) >= replicas:
                found[int(match.group(1))] = str(pvc.metadata.name)
        return found

    async def _slices(self) -> list[Mapping[str, Any]]:
        svc, ns = self._conf.broker_service, self._conf.broker_namespace or "default"

        def read() -> Any:
            api = kubernetes.client.DiscoveryV1Api(self._client())
            found = api.list_namespaced_endpoint_slice(ns, label_selector=f"kubernetes.io/service-name={svc}")
            return self._client().sanitize_for_serialization(found)

        listing = await asyncio.to_thread(read)
        return list(listing.get("items") or [])

    async def close(self) -> None:
        if self._kube is not None:
            with contextlib.suppress(Exception):
                self._kube.close()
        await self._pool.close()


_shared: list[Any] = []


def shared_kube_client() -> Any:
    """One Kubernetes API client for the membership loop, made on first use."""
    if not _shared:
        _shared.append(kube_client())
    return _shared[0]


def kube_client() -> Any:
    """A Kubernetes API client: the pod's service account in a cluster, else the kubeconfig (tests, laptops)."""
    try:
        kubernetes.config.load_incluster_config()  # type: ignore[no-untyped-call]
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()  # type: ignore[no-untyped-call]
    return kubernetes.client.ApiClient()


# ---- the leader-election Lease --------------------------------------------------------------------------


class KubeLeases:
    """``leadership.LeaseStore`` over the API: one named Lease, read and written as JSON. Each call is bounded
    by ``timeout_s`` so that a hung apiserver counts as a failed renewal, not a stuck one."""

    def __init__(self, name: str, namespace: str, timeout_s: float, client: Any = None) -> None:
        self._name, self._namespace, self._timeout_s = name, namespace, timeout_s
        self._client = client

    def _api(self) -> Any:
        if self._client is None:
            self._client = kube_client()
        return kubernetes.client.CoordinationV1Api(self._client)

    async def _call(self, verb: str, *args: Any) -> dict[str, Any] | None:
        def call() -> dict[str, Any] | None:
            method = getattr(self._api(), f"{verb}_namespaced_lease")
            try:
                resp = method(*args, _preload_content=False, _request_timeout=self._timeout_s)
            except kubernetes.client.ApiException as exc:
                if exc.status == 404 and verb == "read":
                    return None
                if exc.status == 409:
                    raise leadership.Conflict(str(exc.reason)) from None
                raise
            found: dict[str, Any] = json.loads(resp.data)
            return found

        return await asyncio.to_thread(call)

    async def get(self) -> dict[str, Any] | None:
        return await self._call("read", self._name, self._namespace)

    async def create(self, lease: dict[str, Any]) -> dict[str, Any]:
        made = await self._call("create", self._namespace, lease)
        assert made is not None
        return made

    async def replace(self, lease: dict[str, Any]) -> dict[str, Any]:
        written = await self._call("replace", self._name, self._namespace, lease)
        assert written is not None
        return written

    def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()


# ---- status writes of the resync loop ------------------------------------------------------------------


class StatusWriter:
    """Merge-patches the status subresource of one resource, as kopf does for its handlers (the resync loop
    runs outside them). A resource deleted meanwhile is no error; other failures are logged and left to the
    next pass, which computes the same changes again."""

    def __init__(self, client: Any = None) -> None:
        self._client = client

    async def patch(self, kind: model.Kind, namespace: str, name: str, changes: Mapping[str, Any]) -> None:
        def call() -> None:
            if self._client is None:
                self._client = kube_client()
            api = kubernetes.client.CustomObjectsApi(self._client)
            api.patch_namespaced_custom_object_status(
                model.GROUP,
                model.VERSION,
                namespace,
                kind.plural,
                name,
                {"status": dict(changes)},
                field_manager="lmq-operator",
                _content_type="application/merge-patch+json",
            )

        try:
            await asyncio.to_thread(call)
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                log.warning(
                    "status of %s %s/%s not written: %s %s", kind.value, namespace, name, exc.status, exc.reason
                )

    def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
