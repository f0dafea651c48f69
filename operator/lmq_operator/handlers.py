"""kopf registrations: which events reach the reconcile, and nothing else.

One reconcile serves create, update, resume and the resync timer, so a broker that appears later, a pod
restarted with an empty disk and a hand-made change on a broker are all repaired by the same code that
applies a new spec. A per-object lock serialises the timer with change handlers, and both read the live
body under it, so a resync can never re-apply a spec older than the one an update just applied.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf

from lmq_operator import apply, desired, metrics, model, settings, status

_RESYNC_S = settings.resync_seconds(os.environ)


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
    # Events are our explicit outcomes (kopf.info/warn); kopf's log lines stay logs, so a resync timer over
    # 1,000 resources does not turn into a stream of "Timer succeeded" Events.
    options.posting.level = logging.INFO
    options.posting.loggers = False
    options.watching.server_timeout = 300
    conf = settings.from_env(os.environ)
    if getattr(memo, "admin_factory", None) is not None:  # tests inject an in-memory broker admin
        factory: apply.AdminFactory = memo.admin_factory
    else:

        def factory(endpoint: str) -> apply.BrokerAdmin:
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

_WRITE_EVENT = {
    ("create", "missing"): "Created",
    ("create", "differs"): "Adopted",
    ("update", "missing"): "Updated",
    ("update", "differs"): "Updated",
}


def _write_event(trigger: str, change: str) -> str:
    return _WRITE_EVENT.get((trigger, change), "DriftRepaired")


async def _reconcile(kind: model.Kind, trigger: str, *, body: Any, patch: Any, memo: Any, claims: Any) -> None:
    ctx = _ctx(memo)
    meta = body["metadata"]
    async with ctx.lock(meta["uid"]):
        started = time.monotonic()
        metrics.RECONCILIATIONS.labels(kind.value, trigger).inc()
        previous: Mapping[str, Any] = dict(body.get("status") or {})
        generation = int(meta.get("generation") or 0)
        new, retry = await _outcome(
            ctx, kind, trigger, body=body, previous=previous, generation=generation, claims=claims
        )
        delta = status.changes(previous, new)
        for key, value in delta.items():
            patch.status[key] = value
        before, after = status.ready_of(previous), status.ready_of(new)
        if after is not None and after != before:
            cond = next(c for c in new["conditions"] if c["type"] == status.READY)
            post = kopf.info if after[0] != "False" else kopf.warn
            post(body, reason=after[1], message=cond["message"])
        metrics.DURATION.labels(kind.value).observe(time.monotonic() - started)
    if retry:
        metrics.RECONCILIATIONS_FAILED.labels(kind.value, trigger).inc()
        if trigger != "timer":  # the timer retries by itself; change handlers retry sooner than a resync
            raise kopf.TemporaryError("not every broker is in sync yet", delay=ctx.conf.retry_delay_s)


async def _outcome(
    ctx: Context,
    kind: model.Kind,
    trigger: str,
    *,
    body: Any,
    previous: Mapping[str, Any],
    generation: int,
    claims: Any,
) -> tuple[dict[str, Any], bool]:
    """The new status, and whether the work is incomplete in a way a retry can fix."""
    meta, now = body["metadata"], _now()
    mode = desired.mode(meta.get("annotations") or {})
    wanted = desired.config(kind, meta["name"], body.get("spec") or {})
    if mode is model.Mode.UNMANAGED:
        message = f"{model.ANNOTATION_MANAGED}=false: brokers are neither changed nor cleaned up"
        return status.blocked(
            status.Reason.UNMANAGED, message, generation=generation, previous=previous, now=now
        ), False
    if mode is model.Mode.PAUSED:
        message = f"{model.ANNOTATION_PAUSED}=true: changes are not applied until the annotation is removed"
        return status.blocked(
            status.Reason.RECONCILIATION_PAUSED, message, generation=generation, previous=previous, now=now
        ), False
    if isinstance(wanted, desired.InvalidSpec):
        return status.blocked(
            status.Reason.INVALID, wanted.message, generation=generation, previous=previous, now=now
        ), False
    owner = desired.conflicting_owner(meta["uid"], claims.get(wanted.key, ()))
    if owner is not None:
        message = f"{kind.value} {owner.ref} already manages {status.KEY_FIELD[kind]} {wanted.key!r}"
        blocked = status.blocked(
            status.Reason.RESOURCE_CONFLICT, message, generation=generation, previous=previous, now=now
        )
        blocked[status.KEY_FIELD[kind]] = wanted.key
        return blocked, False
    view = await ctx.fleet.view()
    metrics.BROKERS.set(len(view.targets))
    _, syncs = await apply.sync(ctx.pool, wanted, kind, view.targets)
    new = status.applied(kind, wanted.key, generation=generation, syncs=syncs, previous=previous, now=now)
    if kind is model.Kind.PARENT_TOPIC:
        status.with_condition(new, status.drained(view.leaving, previous, now))
    writes = [s for s in syncs if s.synced and s.change != "none"]
    if writes:
        reason = _write_event(trigger, writes[0].change)
        if reason == "DriftRepaired":
            metrics.DRIFT_REPAIRED.labels(kind.value).inc(len(writes))
        names = ", ".join(f"{s.broker.name} ({s.change})" for s in writes)
        kopf.info(body, reason=reason, message=f"{kind.value} {wanted.key!r} applied on {names}")
    retry = not syncs or any(not s.synced and s.failure is model.Failure.UNAVAILABLE for s in syncs)
    return new, retry


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
    meta = body["metadata"]
    metrics.RECONCILIATIONS.labels(kind.value, "delete").inc()
    mode = desired.mode(meta.get("annotations") or {})
    wanted = desired.config(kind, meta["name"], body.get("spec") or {})
    if isinstance(wanted, desired.InvalidSpec):
        ctx.locks.pop(meta["uid"], None)
        return  # it never reached a broker
    keep = None
    if mode is not model.Mode.MANAGED:
        keep = f"left on brokers ({mode.value})"
    elif desired.conflicting_owner(meta["uid"], claims.get(wanted.key, ())) is not None:
        keep = "left on brokers: it belongs to another resource"
    elif isinstance(wanted, model.TopicConfig) and (body.get("spec") or {}).get("deletionPolicy") == "retain":
        keep = "left on brokers (deletionPolicy: retain)"
    if keep is not None:
        kopf.info(body, reason="Retained", message=f"{kind.value} {wanted.key!r} {keep}")
        ctx.locks.pop(meta["uid"], None)
        return
    async with ctx.lock(meta["uid"]):
        view = await ctx.fleet.view()
        if view.error is not None:
            raise kopf.TemporaryError(f"broker discovery failed: {view.error}", delay=ctx.conf.retry_delay_s)
        failed = [(b, e) for b, e in await apply.delete(ctx.pool, kind, wanted.key, view.targets, True) if e]
    if failed:
        metrics.RECONCILIATIONS_FAILED.labels(kind.value, "delete").inc()
        detail = "; ".join(f"{b.name}: {e}" for b, e in failed)
        kopf.warn(body, reason="DeleteFailed", message=f"{kind.value} {wanted.key!r} not deleted on {detail}")
        raise kopf.TemporaryError(f"delete failed on {detail}", delay=ctx.conf.retry_delay_s)
    kopf.info(body, reason="Deleted", message=f"{kind.value} {wanted.key!r} deleted on {len(view.targets)} brokers")
    ctx.locks.pop(meta["uid"], None)


for _kind in model.Kind:
    _register(_kind)
