"""kopf registrations: which events reach the reconcile, and nothing else.

One reconcile serves create, update, resume and the resync timer, so a broker that appears later, a pod
restarted with an empty disk and a hand-made change on a broker are all repaired by the same code that
applies a new spec. A per-object lock serialises the timer with change handlers, and both read the live
body under it, so a resync can never re-apply a spec older than the one an update just applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf

from lmq_operator import admins, apply, desired, metrics, model, settings, status

_RESYNC_S = settings.resync_seconds(os.environ)
EVENT_SOURCE = "lmq-operator"  # reportingComponent and source.component of every Event we post


@dataclass
class Context:
    """What every handler shares, kept in kopf's memo."""

    conf: settings.Settings
    pool: apply.AdminPool
    fleet: apply.Fleet
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    def lock(self, uid: str) -> asyncio.Lock:
        return self.locks.setdefault(uid, asyncio.Lock())


def _now() -> datetime:
    return datetime.now(UTC)


def _ctx(memo: Any) -> Context:
    ctx: Context = memo.lmq
    return ctx


@kopf.on.startup()
async def configure(memo: Any, **kwargs: Any) -> None:
    options: kopf.OperatorSettings = kwargs["settings"]  # kopf's kwarg; ``settings`` here is our module
    options.persistence.finalizer = model.FINALIZER
    options.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="lmq.io")
    options.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="lmq.io")
    options.peering.standalone = True
    conf = settings.from_env(os.environ)
    # Events are our explicit outcomes (kopf.info/warn); kopf's log lines stay logs, so a resync timer over
    # 1,000 resources does not turn into a stream of "Timer succeeded" Events. They come from us, not from
    # "kopf": `kubectl describe` and `kubectl get events` show this component and the pod that wrote them.
    options.posting.level = logging.INFO
    options.posting.loggers = False
    options.posting.reporting_component = EVENT_SOURCE
    options.posting.reporting_instance = conf.identity
    options.posting.event_name_prefix = f"{EVENT_SOURCE}-"
    options.watching.server_timeout = 300
    if getattr(memo, "admin_factory", None) is not None:  # tests inject an in-memory broker admin
        factory: apply.AdminFactory = memo.admin_factory
    else:

        def factory(endpoint: str) -> admins.BrokerAdmin:
            return apply.GrpcAdmin(endpoint, conf.admin_timeout_s, conf.admin_keys)

    pool = apply.AdminPool(factory)
    memo.lmq = Context(conf, pool, apply.Fleet(conf, pool))


@kopf.on.cleanup()
async def close(memo: Any, **_: Any) -> None:
    ctx: Context | None = getattr(memo, "lmq", None)
    if ctx is not None:
        await ctx.fleet.close()


@kopf.on.probe(id="brokers")
async def brokers_probe(memo: Any, **_: Any) -> int:
    return len((await _ctx(memo).fleet.view()).targets)


# ---- claims: who owns which broker-side name ----------------------------------------------------------


def _claim(kind: model.Kind, *, name: str, namespace: str | None, spec: Any, meta: Any, uid: str) -> Any:
    key = desired.broker_key(kind, name, spec)
    if key is None:
        return None
    return {key: model.Claimant(namespace or "", name, uid, str(meta.get("creationTimestamp", "")))}


@kopf.index(model.GROUP, model.VERSION, "parenttopics")
def parenttopics_claims(name: str, namespace: str | None, spec: Any, meta: Any, uid: str, **_: Any) -> Any:
    return _claim(model.Kind.PARENT_TOPIC, name=name, namespace=namespace, spec=spec, meta=meta, uid=uid)


@kopf.index(model.GROUP, model.VERSION, "litegroups")
def litegroups_claims(name: str, namespace: str | None, spec: Any, meta: Any, uid: str, **_: Any) -> Any:
    return _claim(model.Kind.LITE_GROUP, name=name, namespace=namespace, spec=spec, meta=meta, uid=uid)


@kopf.index(model.GROUP, model.VERSION, "litequotas")
def litequotas_claims(name: str, namespace: str | None, spec: Any, meta: Any, uid: str, **_: Any) -> Any:
    return _claim(model.Kind.LITE_QUOTA, name=name, namespace=namespace, spec=spec, meta=meta, uid=uid)


# ---- reconcile ----------------------------------------------------------------------------------------


def _post(body: Any, events: tuple[apply.Event, ...]) -> None:
    for event in events:
        post = kopf.warn if event.type == "Warning" else kopf.info
        post(body, reason=event.reason, message=event.message)


async def _reconcile(kind: model.Kind, trigger: str, *, body: Any, patch: Any, memo: Any, claims: Any) -> None:
    ctx = _ctx(memo)
    async with ctx.lock(body["metadata"]["uid"]), _measured(kind, trigger) as run:
        previous = dict(body.get("status") or {})
        outcome = await apply.reconcile(
            ctx.pool, ctx.fleet, kind, trigger=trigger, body=body, claims=claims, now=_now()
        )
        for key, value in status.changes(previous, outcome.status).items():
            patch.status[key] = value
        _post(body, outcome.events)
        if outcome.brokers is not None:
            metrics.BROKERS.set(outcome.brokers)
        if outcome.repaired:
            metrics.DRIFT_REPAIRED.labels(kind.value).inc(outcome.repaired)
        run.failed = outcome.retry
    if outcome.retry and trigger != "timer":  # the timer retries by itself; change handlers retry sooner
        raise kopf.TemporaryError("not every broker is in sync yet", delay=ctx.conf.retry_delay_s)


@dataclass
class _Run:
    failed: bool = True  # until the reconcile says otherwise: an exception counts as a failure


@contextlib.asynccontextmanager
async def _measured(kind: model.Kind, trigger: str) -> AsyncIterator[_Run]:
    """Count one reconciliation, its duration and, unless it cleared ``failed``, its failure. An exception
    (a bug, an API error kopf retries) is a failed reconciliation too, not one that never happened."""
    started = time.monotonic()
    metrics.RECONCILIATIONS.labels(kind.value, trigger).inc()
    run = _Run()
    try:
        yield run
    finally:
        metrics.DURATION.labels(kind.value).observe(time.monotonic() - started)
        if run.failed:
            metrics.RECONCILIATIONS_FAILED.labels(kind.value, trigger).inc()


def _register(kind: model.Kind) -> None:
    plural = kind.plural
    index_name = f"{plural}_claims"

    @kopf.on.create(model.GROUP, model.VERSION, plural, id=f"{plural}-create")
    async def on_create(body: Any, patch: Any, memo: Any, **kw: Any) -> None:
        await _reconcile(kind, "create", body=body, patch=patch, memo=memo, claims=kw[index_name])

    @kopf.on.update(model.GROUP, model.VERSION, plural, id=f"{plural}-update")
    async def on_update(body: Any, patch: Any, memo: Any, **kw: Any) -> None:
        await _reconcile(kind, "update", body=body, patch=patch, memo=memo, claims=kw[index_name])

    @kopf.on.resume(model.GROUP, model.VERSION, plural, id=f"{plural}-resume")
    async def on_resume(body: Any, patch: Any, memo: Any, **kw: Any) -> None:
        await _reconcile(kind, "resume", body=body, patch=patch, memo=memo, claims=kw[index_name])

    @kopf.timer(
        model.GROUP,
        model.VERSION,
        plural,
        id=f"{plural}-resync",
        interval=_RESYNC_S,
        initial_delay=lambda **_: random.uniform(0.5, 1.0) * _RESYNC_S,  # spread 1000 timers over time
    )
    async def resync(body: Any, patch: Any, memo: Any, **kw: Any) -> None:
        await _reconcile(kind, "timer", body=body, patch=patch, memo=memo, claims=kw[index_name])

    @kopf.on.delete(model.GROUP, model.VERSION, plural, id=f"{plural}-delete")
    async def on_delete(body: Any, memo: Any, **kw: Any) -> None:
        await _delete(kind, body, memo, kw[index_name])


async def _delete(kind: model.Kind, body: Any, memo: Any, claims: Any) -> None:
    ctx = _ctx(memo)
    uid = body["metadata"]["uid"]
    async with ctx.lock(uid), _measured(kind, "delete") as run:
        outcome = await apply.remove(ctx.pool, ctx.fleet, kind, body, claims)
        _post(body, outcome.events)
        run.failed = outcome.retry
    if outcome.retry:
        raise kopf.TemporaryError("broker copies are not deleted yet", delay=ctx.conf.retry_delay_s)
    ctx.locks.pop(uid, None)


for _kind in model.Kind:
    _register(_kind)
