"""kopf registrations: which events reach the reconcile, and nothing else.

One reconcile serves create, update, resume and the resync, so a broker that appears later, a pod
restarted with an empty disk and a hand-made change on a broker are all repaired by the same code that
applies a new spec. The resync is one loop over every resource (``resyncing``), fed by an index that keeps
each resource as compact JSON, not a kopf timer per resource. A per-object lock serialises it with change
handlers, and the resync reads the resource from the index under that lock, so it can never re-apply a
spec older than the one an update just applied.

A LiteGroup applied together with its ParentTopic (one GitOps sync) is refused by the brokers until the
topic is on every broker. It does not wait out the retry delay: every reconcile that finds a ParentTopic
Ready wakes the LiteGroups the brokers refused for want of that topic (``_wake``, fed by an index of the
LiteGroups not Ready by the name of their parent topic, and ``Context.refused``). Their "waiting" status is
written under the group's lock, not by kopf after the handler, so it can never land after the wake-up's Ready.

Brokers do not wait for the resync. A watch loop (``_watch``) looks at the brokers every discovery interval:
when one lacks a resource the operator knows it applied (a new pod, a pod back with an empty disk) every
resource is reconciled at once, and when the set of leaving brokers with undrained messages changes, every
ParentTopic is reconciled at once (its ``BrokersDrained`` condition and the brokers it counts). Joining
brokers of a scale-up get every resource from the scaler's ``prepare`` (``_prepare``) before any broker is
told the ring that names them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import aiohttp
import kopf

from lmq_broker.admin.credentials import KeyPair
from lmq_operator import (
    admins,
    apply,
    desired,
    discovery,
    grpcadmin,
    kube,
    metrics,
    model,
    resyncing,
    scaler,
    scaling,
    settings,
    status,
)

log = logging.getLogger(__name__)

EVENT_SOURCE = "lmq-operator"  # reportingComponent and source.component of every Event we post
# Connections to the apiserver at most. kopf's own HTTP session has no bound: a burst of creates (a GitOps
# sync) opened one TLS connection per concurrent request, ~500 for 1,000 resources, each holding asyncio's
# 256 KiB TLS read buffer for as long as it stayed open: most of the operator's memory. Watches hold one each
# (one per resource kind, plus CRDs and namespaces); requests beyond the bound wait for a free connection.
API_CONNECTIONS = 24
_sessions: list[aiohttp.ClientSession] = []  # ours, closed on a new login and at exit


@dataclass
class Context:
    """What every handler shares, kept in kopf's memo."""

    conf: settings.Settings
    pool: admins.AdminPool
    fleet: discovery.Fleet
    statuses: kube.StatusWriter
    indices: dict[str, Any] = field(default_factory=dict)  # kopf's indices, by name
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    resync: asyncio.Task[None] | None = None
    watch: asyncio.Task[None] | None = None
    scaler: scaler.Scaler | None = None  # the broker StatefulSet's membership, when the operator manages it
    scaling: asyncio.Task[None] | None = None
    # At most conf.workers reconciles at once (their broker calls, status and Events); a burst of thousands of
    # resources waits here rather than holding thousands of admin calls open. Not kopf's worker_limit: kopf's
    # workers wait for every resource to be indexed before the first handler runs, so a bound on them would
    # deadlock a start with more resources than workers.
    slots: asyncio.Semaphore | None = None
    # kopf posts Events through a queue it binds to each handler's context; the resync loop runs outside any
    # handler, so it posts within a copy of the first handler's context (every resource was handled by
    # create or resume before its first resync).
    posting: contextvars.Context | None = None
    # Resources whose delete handler finished: kopf may run it again on a stale event (one that arrived before
    # its finalizer-removal patch took effect), which would repeat the broker calls and the "Deleted" Event.
    deleted: collections.OrderedDict[str, None] = field(default_factory=collections.OrderedDict)
    waking: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # LiteGroup uid -> its wake-up (_wake)
    # LiteGroups whose last reconcile the brokers refused for a missing parent: only these are woken, so a
    # group whose create handler has not run yet is left to it (else that handler would find the copies the
    # wake-up made and call them adopted).
    refused: set[str] = field(default_factory=set)
    # Resources whose create is being retried -> the brokers its attempts put them on so far (apply.reconcile's
    # ``placed``): a retry may read a body without the status the last attempt wrote. Dropped when the create
    # is done or the resource deleted.
    placing: dict[str, frozenset[str]] = field(default_factory=dict)
    # ... and the brokers its attempts sent it to without an answer (``apply.Outcome.unanswered``), likewise
    unanswered: dict[str, frozenset[str]] = field(default_factory=dict)
    secrets: kube.SecretReader = field(default_factory=kube.SecretReader)  # LmqUsers' Secrets, one get each

    def lock(self, uid: str) -> asyncio.Lock:
        return self.locks.setdefault(uid, asyncio.Lock())

    def claims(self, kind: model.Kind) -> Any:
        return self.indices[f"{kind.plural}_claims"]

    def body(self, kind: model.Kind, uid: str) -> dict[str, Any] | None:
        """The resource as the index last saw it (None: gone)."""
        for raw in self.indices[f"{kind.plural}_bodies"].get(uid, ()):
            return resyncing.expand(raw)
        return None

    def entries(self, *kinds: model.Kind) -> list[resyncing.Entry]:
        return [(kind, uid) for kind in kinds or model.Kind for uid in self.indices[f"{kind.plural}_bodies"]]


# Parent topics before the groups bound to them: a group's put is refused where its parent is missing.
APPLY_ORDER: Final = (model.Kind.PARENT_TOPIC, model.Kind.LITE_QUOTA, model.Kind.LITE_GROUP, model.Kind.LMQ_USER)


_DELETED_KEPT = 4096  # finished deletions remembered; a re-run comes within seconds of its first run


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
        factory: admins.AdminFactory = memo.admin_factory
    else:

        def factory(endpoint: str) -> admins.BrokerAdmin:
            return grpcadmin.GrpcAdmin(endpoint, conf.admin_timeout_s, conf.admin_keys, tls=conf.tls)

    pool = admins.AdminPool(factory)
    indices = {name: kwargs[name] for kind in model.Kind for name in (f"{kind.plural}_claims", f"{kind.plural}_bodies")}
    indices[WAITING] = kwargs[WAITING]
    member: scaler.Scaler | None = None
    if conf.manages_membership:
        keys = KeyPair(*conf.admin_keys) if conf.admin_keys else None
        member = scaler.Scaler(conf, kube.shared_kube_client, keys)
    fleet = discovery.Fleet(conf, pool, ring_pods=(lambda: member.ring_pods) if member else lambda: None)
    ctx = memo.lmq = Context(conf, pool, fleet, kube.StatusWriter(), indices, scaler=member)
    ctx.slots = asyncio.Semaphore(conf.workers) if conf.workers else None
    ctx.resync = asyncio.create_task(
        resyncing.run(ctx.entries, lambda kind, uid: _resync(ctx, kind, uid), interval_s=conf.resync_s)
    )
    ctx.watch = asyncio.create_task(_watch(ctx, max(conf.discovery_ttl_s, WATCH_MIN_S)))
    if member is not None:

        async def prepare(brokers: Sequence[model.Broker]) -> scaling.Unprepared | None:
            return await _prepare(ctx, brokers)

        member.prepare = prepare
        ctx.scaling = asyncio.create_task(scaler.run(member, conf.scaling_s))


@kopf.on.login()
async def login(**kwargs: Any) -> kopf.AiohttpSession | None:
    """kopf's own login (in-cluster service account, else the kubeconfig), into a session with a bounded pool."""
    try:
        info = kopf.login_via_client(**kwargs)
    except kopf.LoginError:
        return None  # nothing to log in with (tests that bring their own login)
    if info is None:
        return None
    auth = aiohttp.BasicAuth(info.username, info.password or "") if info.username else None
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=API_CONNECTIONS, ssl=info.as_ssl_context()),
        headers=info.as_http_headers(),
        auth=auth,
        proxy=info.proxy_url,
        trust_env=info.trust_env,
    )
    for stale in _sessions:  # a re-login (an expired token): the requests have moved to the new session
        await stale.close()
    _sessions[:] = [session]
    return kopf.AiohttpSession(
        aiohttp_session=session,
        server=info.server,
        default_namespace=info.default_namespace,
        expiration=info.expiration,
        priority=info.priority,
    )


@kopf.on.cleanup()
async def close(memo: Any, **_: Any) -> None:
    for session in _sessions:
        await session.close()
    _sessions.clear()
    ctx: Context | None = getattr(memo, "lmq", None)
    if ctx is not None:
        for task in (ctx.resync, ctx.watch, ctx.scaling, *ctx.waking.values()):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if ctx.scaler is not None:
            await ctx.scaler.close()
        await ctx.fleet.close()
        ctx.statuses.close()
        ctx.secrets.close()


@kopf.on.probe(id="brokers")
async def brokers_probe(memo: Any, **_: Any) -> int:
    return len((await _ctx(memo).fleet.view()).targets)


# ---- claims: who owns which broker-side name ----------------------------------------------------------


def _claim(kind: model.Kind, *, name: str, namespace: str | None, spec: Any, meta: Any, uid: str) -> Any:
    """An invalid spec keeps its claim (its naming fields say which name): its copies may be on the brokers from
    when it was valid, and a younger claimant must not take them over in the meantime."""
    key = desired.broker_key(kind, name, spec) or desired.named_key(kind, name, spec)
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


@kopf.index(model.GROUP, model.VERSION, "lmqusers")
def lmqusers_claims(name: str, namespace: str | None, spec: Any, meta: Any, uid: str, **_: Any) -> Any:
    return _claim(model.Kind.LMQ_USER, name=name, namespace=namespace, spec=spec, meta=meta, uid=uid)


async def _secret(ctx: Context, kind: model.Kind, body: Any) -> desired.Secret:
    """A user's secret from the Secret its spec names, read at every reconcile (None: not a user, or an invalid
    spec, which the reconcile reports: a name that is no Secret's is never sent to the apiserver)."""
    if kind is not model.Kind.LMQ_USER:
        return None
    spec = desired.parse(kind, body.get("spec") or {})
    if not isinstance(spec, model.LmqUserSpec):
        return None
    namespace = body["metadata"].get("namespace") or ctx.conf.namespace or "default"
    return await ctx.secrets.read(namespace, spec.secret_ref.name, spec.secret_ref.key)


WOKEN: Final = apply.WOKEN  # the trigger of a LiteGroup reconciled because its ParentTopic turned Ready
OUTSIDE_HANDLERS: Final = frozenset({"timer", WOKEN})  # triggers that run outside kopf's handlers
WAITING: Final = "litegroups_waiting"  # the index of LiteGroups that may be waiting for their ParentTopic


@kopf.index(model.GROUP, model.VERSION, "litegroups", id=WAITING)
def litegroups_waiting(body: Any, spec: Any, uid: str, **_: Any) -> Any:
    """parent topic -> uid of each LiteGroup not Ready yet or refused for a missing parent (others never are
    listed: this index stays as small as the number of groups waiting)."""
    parent = spec.get("parentTopic")
    ready = status.ready_of(body.get("status") or {})
    if not parent or ready not in (None, ("False", status.Reason.PARENT_TOPIC_NOT_FOUND.value)):
        return None
    return {parent: uid}


def _waits_for_parent(kind: model.Kind, outcome: apply.Outcome) -> bool:
    return kind is model.Kind.LITE_GROUP and status.ready_of(outcome.status) == (
        "False",
        status.Reason.PARENT_TOPIC_NOT_FOUND.value,
    )


def _wake(ctx: Context, kind: model.Kind, outcome: apply.Outcome) -> None:
    """Reconcile at once the LiteGroups waiting for the ParentTopic ``outcome`` shows Ready on every broker."""
    if kind is not model.Kind.PARENT_TOPIC or status.ready_of(outcome.status) != ("True", status.Reason.APPLIED.value):
        return
    for uid in ctx.indices[WAITING].get(outcome.status.get(status.KEY_FIELD[kind]), ()):
        if uid not in ctx.waking:
            task = asyncio.create_task(_resync(ctx, model.Kind.LITE_GROUP, uid, trigger=WOKEN))
            ctx.waking[uid] = task
            task.add_done_callback(functools.partial(_woken, ctx, uid))


def _woken(ctx: Context, uid: str, task: asyncio.Task[None]) -> None:
    ctx.waking.pop(uid, None)
    if not task.cancelled() and (exc := task.exception()) is not None:  # the resync retries it
        log.error("reconciling LiteGroup %s once its ParentTopic was Ready failed", uid, exc_info=exc)


# ---- reconcile ----------------------------------------------------------------------------------------


def _post(body: Any, events: tuple[apply.Event, ...]) -> None:
    for event in events:
        post = kopf.warn if event.type == "Warning" else kopf.info
        post(body, reason=event.reason, message=event.message)


async def _apply(
    ctx: Context, kind: model.Kind, trigger: str, body: Any, run: _Run
) -> tuple[apply.Outcome, dict[str, Any]]:
    """One reconcile of ``body`` (under its lock): the outcome and the status changes to write."""
    previous = dict(body.get("status") or {})
    async with ctx.slots or contextlib.nullcontext():
        secret = await _secret(ctx, kind, body)
        uid = body["metadata"]["uid"]
        placed = ctx.placing.get(uid, frozenset()) if trigger == "create" else frozenset()
        unanswered = ctx.unanswered.get(uid, frozenset()) if trigger == "create" else frozenset()
        outcome = await apply.reconcile(
            ctx.pool,
            ctx.fleet,
            kind,
            trigger=trigger,
            body=body,
            claims=ctx.claims(kind),
            now=_now(),
            secret=secret,
            placed=placed,
            unanswered=unanswered,
        )
    if trigger == "create":
        if _retried(outcome):
            rows = outcome.status.get("brokers") or ()
            ctx.placing[uid] = placed | {str(row.get("name")) for row in rows if row.get("synced")}
            ctx.unanswered[uid] = unanswered | outcome.unanswered
        else:
            ctx.placing.pop(uid, None)
            ctx.unanswered.pop(uid, None)
    if trigger in OUTSIDE_HANDLERS:  # post through the context a handler left (see Context)
        if ctx.posting is not None:
            ctx.posting.run(_post, body, outcome.events)
    else:
        ctx.posting = ctx.posting or contextvars.copy_context()
        _post(body, outcome.events)
    if outcome.brokers is not None:
        metrics.BROKERS.set(outcome.brokers)
    if outcome.repaired:
        metrics.DRIFT_REPAIRED.labels(kind.value).inc(outcome.repaired)
    run.failed = outcome.retry
    if kind is model.Kind.LITE_GROUP:
        uid = body["metadata"]["uid"]
        if _waits_for_parent(kind, outcome):
            ctx.refused.add(uid)
        else:
            ctx.refused.discard(uid)
    _wake(ctx, kind, outcome)
    return outcome, status.changes(previous, outcome.status)


async def _reconcile(kind: model.Kind, trigger: str, *, body: Any, patch: Any, memo: Any) -> None:
    ctx = _ctx(memo)
    async with ctx.lock(body["metadata"]["uid"]), _measured(kind, trigger) as run:
        outcome, changes = await _apply(ctx, kind, trigger, body, run)
        if changes and _waits_for_parent(kind, outcome):  # under the lock: see the module's docstring
            meta = body["metadata"]
            await ctx.statuses.patch(kind, meta["namespace"], meta["name"], changes)
        else:
            for key, value in changes.items():
                patch.status[key] = value
    if _retried(outcome):  # the resync retries too, but a change handler retries sooner
        raise kopf.TemporaryError("not every broker is in sync yet", delay=ctx.conf.retry_delay_s)


_STALLED: Final = frozenset(reason.value for reason in status.TERMINAL)


def _retried(outcome: apply.Outcome) -> bool:
    """Whether a change handler tries again soon: not when the resource is Stalled (a broker refused it: the same
    spec is refused again), which only a change of the resource or of a broker can fix; the resync still looks.
    Retrying it every LMQ_OPERATOR_RETRY_SECONDS called every broker and logged an error each time, forever (for
    every resource at once when the brokers refuse the operator's admin keys)."""
    ready = status.ready_of(outcome.status)
    return outcome.retry and not (ready is not None and ready[0] == "False" and ready[1] in _STALLED)


async def _resync(ctx: Context, kind: model.Kind, uid: str, trigger: str = "timer") -> None:
    """The periodic reconcile of one resource (or a woken LiteGroup's), as the index shows it once its lock
    is ours."""
    async with ctx.lock(uid):
        body = ctx.body(kind, uid)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return  # gone, or the delete handler's now
        if trigger == WOKEN and uid not in ctx.refused:
            return  # Ready since, or its create handler has not run yet (and will find the parent)
        async with _measured(kind, trigger) as run:
            _, changes = await _apply(ctx, kind, trigger, body, run)
            if changes:
                meta = body["metadata"]
                await ctx.statuses.patch(kind, meta["namespace"], meta["name"], changes)


# ---- brokers that need everything now, and the drain -------------------------------------------------

WATCH_MIN_S: Final = 1.0  # the watch loop's interval at least (it is the discovery interval)


async def _prepare(ctx: Context, brokers: Sequence[model.Broker]) -> scaling.Unprepared | None:
    """Every resource onto ``brokers`` (joining a scale-up), each under its lock and as the index shows it now
    (the apiserver's list when the index has not seen it yet), parent topics first; None once all are held."""
    pool = admins.AdminPool(ctx.pool.factory)  # its own connections: discovery prunes the shared pool's
    missing: list[apply.Missing] = []
    try:
        for kind in APPLY_ORDER:
            listed = await kube.listed(kind, ctx.conf.namespace)
            entries = [(kind, uid) for uid in sorted({*listed, *ctx.indices[f"{kind.plural}_bodies"]})]

            async def one(kind: model.Kind, uid: str, listed: dict[str, bytes] = listed) -> None:
                async with ctx.lock(uid):
                    body = ctx.body(kind, uid) or (resyncing.expand(listed[uid]) if uid in listed else None)
                    if body is None or body["metadata"].get("deletionTimestamp"):
                        return
                    try:
                        secret = await _secret(ctx, kind, body)
                        missing.extend(await apply.prepare(pool, brokers, kind, body, ctx.claims(kind), secret=secret))
                    except Exception as exc:  # a bug, not a broker's answer: still no reason to tell the ring
                        log.exception("applying %s %s to joining brokers failed", kind.value, uid)
                        missing.append(apply.Missing(f"{kind.value} {body['metadata'].get('name')}: {exc}", False))

            await resyncing.sweep(entries, one)
    finally:
        await pool.close()
    if not missing:
        return None
    text = "; ".join(m.text for m in missing[:3]) + (f" (and {len(missing) - 3} more)" if len(missing) > 3 else "")
    return scaling.Unprepared(text, any(m.refused for m in missing))


def _probe(ctx: Context) -> tuple[model.Kind, str] | None:
    """A resource every broker holds if none lost anything: the first applied ParentTopic (else any kind)."""
    for kind in APPLY_ORDER:
        for uid in ctx.indices[f"{kind.plural}_bodies"]:
            body = ctx.body(kind, uid)
            if body is None or status.ready_of(body.get("status") or {}) != ("True", status.Reason.APPLIED.value):
                continue
            key = (body.get("status") or {}).get(status.KEY_FIELD[kind])
            if key:
                return kind, str(key)
    return None


async def _lacking(ctx: Context, targets: Sequence[model.Broker]) -> list[str]:
    """Brokers that answer but do not hold the probe resource: new pods, or pods back with an empty disk."""
    probe = _probe(ctx)
    if probe is None or not targets:
        return []
    kind, key = probe
    seen = await apply.observe(ctx.pool, kind, key, targets)
    return [b.name for b, found in seen.items() if found is None]


async def _sweep_all(ctx: Context) -> None:
    for kind in APPLY_ORDER:
        await resyncing.sweep(ctx.entries(kind), lambda kind, uid: _resync(ctx, kind, uid))


def _drain_key(leaving: Sequence[model.Leaving]) -> tuple[str, ...]:
    """What makes BrokersDrained change (its status, reason and the brokers named), not the counts: those
    change with every message consumed, and rewriting every ParentTopic for each would flood the apiserver."""
    return tuple(sorted(f"{x.broker.name}/{x.undrained_messages is None}" for x in leaving))


async def _watch(ctx: Context, interval_s: float) -> None:
    last: tuple[str, ...] | None = None
    known: set[str] | None = None  # endpoints of the last view; None before the first (resume covers those)
    while True:
        await asyncio.sleep(interval_s)
        try:
            view = await ctx.fleet.view()
            endpoints = {b.endpoint for b in view.targets}
            new = sorted(b.name for b in view.targets if known is not None and b.endpoint not in known)
            known = endpoints if view.error is None else known
            lacking = await _lacking(ctx, view.targets)
            if new or lacking:  # a new one may hold everything already (joined a scale-up): its status may not
                why = f"new brokers {', '.join(new)}" if new else f"brokers {', '.join(lacking)} lack resources"
                log.info("%s: reconciling every resource now", why)
                await _sweep_all(ctx)
            key = _drain_key(view.leaving)
            if key != last and last is not None:  # the first view only sets the baseline (resume covers it)
                # a full reconcile of each ParentTopic: BrokersDrained and the brokers it counts change together
                log.info("leaving brokers changed (%s): reconciling every ParentTopic", ", ".join(key) or "none")
                drained = ctx.entries(model.Kind.PARENT_TOPIC)
                await resyncing.sweep(drained, lambda kind, uid: _resync(ctx, kind, uid))
            last = key
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("broker watch pass failed")


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

    @kopf.index(model.GROUP, model.VERSION, plural, id=f"{plural}_bodies")
    def bodies(body: Any, uid: str, **_: Any) -> Any:
        return {uid: resyncing.compact(body)}

    @kopf.on.create(model.GROUP, model.VERSION, plural, id=f"{plural}-create")
    async def on_create(body: Any, patch: Any, memo: Any, **_: Any) -> None:
        await _reconcile(kind, "create", body=body, patch=patch, memo=memo)

    @kopf.on.update(model.GROUP, model.VERSION, plural, id=f"{plural}-update")
    async def on_update(body: Any, patch: Any, memo: Any, **_: Any) -> None:
        await _reconcile(kind, "update", body=body, patch=patch, memo=memo)

    @kopf.on.resume(model.GROUP, model.VERSION, plural, id=f"{plural}-resume")
    async def on_resume(body: Any, patch: Any, memo: Any, **_: Any) -> None:
        await _reconcile(kind, "resume", body=body, patch=patch, memo=memo)

    @kopf.on.delete(model.GROUP, model.VERSION, plural, id=f"{plural}-delete")
    async def on_delete(body: Any, patch: Any, memo: Any, **_: Any) -> None:
        await _delete(kind, body, memo, patch)


async def _delete(kind: model.Kind, body: Any, memo: Any, patch: Any = None) -> None:
    ctx = _ctx(memo)
    uid = body["metadata"]["uid"]
    if uid in ctx.deleted:
        return  # done already: a uid names one object, never a recreated one
    async with ctx.lock(uid), _measured(kind, "delete") as run:
        outcome = await apply.remove(ctx.pool, ctx.fleet, kind, body, ctx.claims(kind), now=_now())
        _post(body, outcome.events)
        run.failed = outcome.retry
    if outcome.retry and outcome.status and patch is not None:  # why it stays Terminating (kopf writes it)
        for key, value in status.changes(dict(body.get("status") or {}), outcome.status).items():
            patch.status[key] = value
    if outcome.retry:
        raise kopf.TemporaryError("broker copies are not deleted yet", delay=ctx.conf.retry_delay_s)
    ctx.locks.pop(uid, None)
    ctx.refused.discard(uid)
    ctx.placing.pop(uid, None)
    ctx.unanswered.pop(uid, None)
    ctx.deleted[uid] = None
    if len(ctx.deleted) > _DELETED_KEPT:
        ctx.deleted.popitem(last=False)


for _kind in model.Kind:
    _register(_kind)
