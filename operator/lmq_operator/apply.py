"""Applying one resource to the brokers: observe every broker's copy, let ``diff`` plan, put or delete, and turn
the outcome into the status and the Events a handler writes.

Failures are values (``diff.Unreachable``, ``model.BrokerSync`` with a ``Failure``), so that one bad broker
never aborts the work on the others. The broker calls go through ``admins.AdminPool`` (``grpcadmin`` in
production); the brokers come from ``discovery.Fleet``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from lmq_operator import desired, diff, discovery, model, status
from lmq_operator.admins import AdminError, AdminPool


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
    pool: AdminPool,
    wanted: model.Config,
    kind: model.Kind,
    brokers: Iterable[model.Broker],
    previous: Mapping[str, Any] | None = None,
) -> tuple[diff.Plan, list[model.BrokerSync]]:
    """``previous``: the resource's status, which says which Secret value its users' copies hold."""
    observed = await observe(pool, kind, wanted.key, brokers)
    if isinstance(wanted, model.UserConfig):
        observed = diff.with_secret_version(observed, str((previous or {}).get(SECRET_VERSION) or ""))
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
    *,
    secret: desired.Secret = None,
) -> list[Missing]:
    """Apply one resource to ``brokers`` only, with the reconcile's own observe, diff and put: joining brokers
    get everything before any broker is told the ring that makes them members. Status is the reconcile's to
    write; a resource the operator leaves alone (paused, unmanaged, invalid, in conflict) is skipped."""
    wanted = desired.gate(kind, body["metadata"], body.get("spec") or {}, claims, secret)
    if isinstance(wanted, desired.Blocked):
        return []
    _, syncs = await sync(pool, wanted, kind, brokers, body.get("status"))
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
    # brokers this attempt sent a write to and heard nothing back from (timed out, connection lost): the write
    # may have been applied there all the same
    unanswered: frozenset[str] = frozenset()


async def reconcile(  # noqa: PLR0913 (the inputs of one reconcile, each named at its one call)
    pool: AdminPool,
    fleet: discovery.Fleet,
    kind: model.Kind,
    *,
    trigger: str,
    body: Mapping[str, Any],
    claims: Mapping[str, Iterable[model.Claimant]],
    now: datetime,
    secret: desired.Secret = None,
    placed: frozenset[str] = frozenset(),
    unanswered: frozenset[str] = frozenset(),
) -> Outcome:
    """``secret``: a user's, read from its Secret by the caller (the one module here that reads Kubernetes).
    ``placed``: the brokers an earlier attempt of this same create put the object on, as the caller remembers
    them (the status that attempt wrote may not be in ``body`` yet); ``unanswered``: those an earlier attempt
    sent it to without an answer (``Outcome.unanswered``)."""
    meta = body["metadata"]
    previous: Mapping[str, Any] = dict(body.get("status") or {})
    generation = int(meta.get("generation") or 0)
    wanted = desired.gate(kind, meta, body.get("spec") or {}, claims, secret)
    if isinstance(wanted, desired.Blocked):
        key = (kind, wanted.key) if wanted.key is not None else None
        new = status.blocked(wanted.reason, wanted.message, generation=generation, previous=previous, now=now, key=key)
        # A Secret that is not there yet (applied after its user) is looked for again soon, not at the resync.
        return Outcome(new, _transition_events(previous, new), retry=wanted.reason in status.RETRYING)
    view = await fleet.view()
    _, syncs = await sync(pool, wanted, kind, view.targets, previous)
    new = status.applied(kind, wanted.key, generation=generation, syncs=syncs, previous=previous, now=now)
    if kind is model.Kind.PARENT_TOPIC:
        status.with_condition(new, status.drained(view.leaving, previous, now))
    news = _write_events(trigger, syncs, previous, placed, unanswered)
    retry = not syncs or any(not s.synced for s in syncs)
    if isinstance(wanted, model.UserConfig):
        # Only a value every broker took is "applied": until then each attempt puts it everywhere again.
        version = previous.get(SECRET_VERSION) if retry else wanted.secret_version
        if version:
            new[SECRET_VERSION] = version
    repaired = sum(len(names) for reason, names in news.items() if reason == "DriftRepaired")
    writes = tuple(
        Event("Normal", r, f"{kind.value} {wanted.key!r} {_VERB[r]} on {', '.join(n)}") for r, n in news.items()
    )
    sent = (diff.Change.MISSING.value, diff.Change.DIFFERS.value)  # a put was made (``execute``)
    lost = frozenset(s.broker.name for s in syncs if s.failure is model.Failure.UNAVAILABLE and s.change in sent)
    events = writes + _transition_events(previous, new)
    return Outcome(new, events, retry, repaired, len(view.targets), unanswered=lost)


SECRET_VERSION: Final = "secretVersion"  # status: the Secret value every broker's copy of a user holds
WOKEN: Final = "parent"  # the trigger of a LiteGroup reconciled at once because its ParentTopic turned Ready
_VERB: Final = {"Created": "created", "Adopted": "adopted", "Updated": "applied", "DriftRepaired": "repaired"}
_CHANGE_TEXT: Final = {"missing": "was missing", "differs": "differed, overwritten", "none": "already identical"}


def _write_events(
    trigger: str,
    syncs: Sequence[model.BrokerSync],
    previous: Mapping[str, Any],
    placed: frozenset[str] = frozenset(),
    unanswered: frozenset[str] = frozenset(),
) -> dict[str, list[str]]:
    """Event reason -> "broker (what it held)" entries. A create that finds the object already on a broker,
    equal or not, adopts it there. A broker the previous status lists as synced got its copy from an earlier
    attempt of this same create (a retry, a restart): finding it there again is no news. A LiteGroup woken by
    its ParentTopic turning Ready continues a create or an update the brokers refused: a copy it writes where
    none was is created, one it overwrites updated, not a repaired drift. ``placed`` adds the brokers an earlier
    attempt put it on whose status the body does not show yet (a retry can run before that status write's
    watch event arrives). A broker in ``unanswered`` got a write of an earlier attempt whose answer was lost (a
    timeout on a loaded broker): found identical there, it is that write, no news; found missing, it is created
    now; found different, adopted as on any broker. A resync that writes a copy where none was, for a resource
    whose status lists no broker in sync (it lost a conflict until now, waited for its Secret, no broker ever
    answered), creates it: there was no copy of its own to repair."""
    ours = {row.get("name") for row in previous.get("brokers") or () if row.get("synced")} | placed
    found: dict[str, list[str]] = {}
    for s in sorted(syncs, key=lambda s: s.broker):
        if not s.synced:
            continue
        if trigger == "create" and s.broker.name not in ours:
            if s.change == diff.Change.NONE.value and s.broker.name in unanswered:
                continue
            reason = "Created" if s.change == diff.Change.MISSING.value else "Adopted"
        elif trigger == WOKEN and s.change != diff.Change.NONE.value:
            reason = "Created" if s.change == diff.Change.MISSING.value else "Updated"
        elif s.change == diff.Change.NONE.value:
            continue
        elif trigger != "update" and not ours and s.change == diff.Change.MISSING.value:
            reason = "Created"  # nothing to repair: no status showed a copy (it lost a conflict, lacked its Secret)
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
    fleet: discovery.Fleet,
    kind: model.Kind,
    body: Mapping[str, Any],
    claims: Mapping[str, Iterable[model.Claimant]],
    *,
    now: datetime,
) -> Outcome:
    """Delete the broker copies unless the resource says to keep them; ``retry`` keeps the finalizer, and then
    the status says why (``Ready=False, DeleteFailed``: a Terminating resource must not go on showing Ready)."""
    meta, spec = body["metadata"], body.get("spec") or {}
    wanted = desired.gate(kind, meta, spec, claims)
    if isinstance(wanted, desired.Blocked) and wanted.reason is not status.Reason.INVALID:
        what = wanted.key or desired.broker_key(kind, str(meta["name"]), spec)
        return Outcome({}, (Event("Normal", "Retained", f"{kind.value} {what!r} left on brokers: {wanted.message}"),))
    if isinstance(wanted, desired.Blocked):
        # Invalid now, but it may have been applied while it was valid: its copies go, unless the name is another
        # resource's (an invalid spec claims nothing, so the owner may be another resource).
        key = desired.named_key(kind, str(meta["name"]), spec)
        if key is None or desired.conflicting_owner(str(meta["uid"]), claims.get(key, ())) is not None:
            return Outcome({})  # it names nothing of its own on the brokers
    else:
        key = wanted.key
    if kind in (model.Kind.PARENT_TOPIC, model.Kind.LMQ_USER) and spec.get("deletionPolicy") == "retain":
        text = f"{kind.value} {key!r} left on brokers (deletionPolicy: retain)"
        return Outcome({}, (Event("Normal", "Retained", text),))
    # Releasing the finalizer is only safe once every broker said the copy is gone: with no broker to ask
    # (discovery failed, or found none, e.g. all pods restarting) the copies would be orphaned for good.
    view = await fleet.view()
    what = f"{kind.value} {key!r}"

    def kept(text: str) -> Outcome:
        new = status.blocked(
            status.Reason.DELETE_FAILED,
            text + _KEEP,
            generation=int(meta.get("generation") or 0),
            previous=dict(body.get("status") or {}),
            now=now,
            key=(kind, key),
        )
        events = (Event("Warning", "DeleteFailed", text + _KEEP),)
        return Outcome(new, events, retry=True, brokers=len(view.targets))

    if view.error is not None:
        return kept(f"{what} not deleted: broker discovery failed: {view.error}")
    if not view.targets:
        return kept(f"{what} not deleted: no broker pod is discovered")
    failed = [(b, e) for b, e in await delete(pool, kind, key, view.targets, True) if e]
    if failed:
        return kept(f"{what} not deleted on " + "; ".join(f"{b.name}: {e}" for b, e in failed))
    text = f"{what} deleted on {len(view.targets)} brokers"
    return Outcome({}, (Event("Normal", "Deleted", text),), brokers=len(view.targets))
