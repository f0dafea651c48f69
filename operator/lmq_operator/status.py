"""Status as GitOps tools read it: ``observedGeneration`` plus a ``Ready`` condition with one CamelCase reason.

Every reason the operator can give is in ``Reason``; this is the one place an outcome becomes a condition.
Beside ``Ready``, the two "abnormal-true" conditions of kstatus (what Flux and ``kubectl wait`` read) say
which way a not-Ready resource is going: ``Reconciling`` while the operator keeps retrying something that
may still succeed by itself (a broker down, a parent topic not there yet), ``Stalled`` when retrying the
same spec cannot help and a person has to act (invalid spec, a name another resource owns, a broker's
refusal). Each is present only while True, with the Ready condition's reason, and removed otherwise.
``lastTransitionTime`` only moves when a condition's status flips, so a resync that changes nothing writes
nothing (kopf skips empty patches) and watchers are not woken for no news.

A ParentTopic's ``lastReclaim`` is the newest reclaim run its brokers recorded, their shares added up. It
only moves forward: a broker that is unreachable, or lost its records with its disk, must not take the
status back to an older run or to a smaller share of the same one (and back again on the next resync).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final

from lmq_operator import model

READY: Final = "Ready"
RECONCILING: Final = "Reconciling"
STALLED: Final = "Stalled"
DRAINED: Final = "BrokersDrained"


class Reason(enum.StrEnum):
    APPLIED = "Applied"
    BROKER_UNAVAILABLE = "BrokerUnavailable"
    BROKER_REJECTED = "BrokerRejected"
    NO_BROKERS = "NoBrokers"
    RESOURCE_CONFLICT = "ResourceConflict"
    INVALID = "Invalid"
    RECONCILIATION_PAUSED = "ReconciliationPaused"
    UNMANAGED = "Unmanaged"
    DRAINED = "Drained"
    UNDRAINED_BROKER_LEAVING = "UndrainedBrokerLeaving"
    LEAVING_BROKER_UNREACHABLE = "LeavingBrokerUnreachable"
    PARENT_TOPIC_NOT_FOUND = "ParentTopicNotFound"
    SECRET_NOT_FOUND = "SecretNotFound"  # a user's Secret, or its key, is not there (yet)
    SECRET_INVALID = "SecretInvalid"  # a user's Secret holds no usable secret (8-256 characters of UTF-8)
    DELETE_FAILED = "DeleteFailed"  # Terminating: a broker copy is not known to be deleted yet (retried)


# Not Ready, and why it may still change without anyone touching the resource (Reconciling) or not (Stalled).
RETRYING: Final = frozenset(
    {
        Reason.BROKER_UNAVAILABLE,
        Reason.NO_BROKERS,
        Reason.PARENT_TOPIC_NOT_FOUND,
        Reason.SECRET_NOT_FOUND,
        Reason.DELETE_FAILED,
    }
)
TERMINAL: Final = frozenset({Reason.INVALID, Reason.RESOURCE_CONFLICT, Reason.BROKER_REJECTED, Reason.SECRET_INVALID})


KEY_FIELD: Final = {
    model.Kind.PARENT_TOPIC: "topicName",
    model.Kind.LITE_GROUP: "groupName",
    model.Kind.LITE_QUOTA: "scope",
    model.Kind.LMQ_USER: "userName",
}

# Live figures a broker reports, as status field names; summed over brokers.
FIGURES: Final[Mapping[model.Kind, tuple[str, ...]]] = {
    model.Kind.PARENT_TOPIC: ("liteTopicCount",),
    model.Kind.LITE_GROUP: ("subscriptionCount", "clientCount", "lag"),
    model.Kind.LITE_QUOTA: (),
    model.Kind.LMQ_USER: (),
}


def timestamp(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def timestamp_ms(epoch_ms: int) -> str:
    """RFC 3339 with milliseconds, fixed width: such strings sort as their instants do."""
    seconds, millis = divmod(epoch_ms, 1000)
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{millis:03d}Z"


# status.lastReclaim count -> the ReclaimRun fields it adds up (kept by a race: changed or subscribed since the scan)
RECLAIM_COUNTS: Final[tuple[tuple[str, tuple[str, ...]], ...]] = (
    ("scanned", ("scanned",)),
    ("expired", ("expired",)),
    ("reclaimed", ("reclaimed",)),
    ("keptByRace", ("kept_changed", "kept_subscribed")),
    ("notFound", ("not_found",)),
    ("errors", ("errors",)),
)


def last_reclaim(runs: Sequence[model.ReclaimRun], previous: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``status.lastReclaim``: the newest run among ``runs`` (one record per broker that answered), counts
    summed over the brokers that recorded that run; ``previous`` when it shows a newer run, or more brokers
    of the same one; None when there is nothing to show."""
    kept = dict(previous) if previous else None
    if not runs:
        return kept
    newest = max(runs, key=lambda r: (r.start_ms, r.run_id))
    # One run = one id AND one start: a retried Job keeps its name (the run id) and starts again later, and a
    # broker the retry could not reach still holds the first attempt's share, which must not be added in.
    same = [r for r in runs if (r.run_id, r.start_ms) == (newest.run_id, newest.start_ms)]
    out: dict[str, Any] = {
        "runId": newest.run_id,
        "startTime": timestamp_ms(newest.start_ms),
        "finishTime": timestamp_ms(max(r.finish_ms for r in same)),
        "dryRun": any(r.dry_run for r in same),  # one run is dry on every broker; any() is deterministic
        "brokers": len(same),
    }
    for name, fields in RECLAIM_COUNTS:
        out[name] = sum(getattr(r, f) for r in same for f in fields)
    if kept is not None:
        shown = (str(kept.get("startTime", "")), str(kept.get("runId", "")))
        found = (out["startTime"], out["runId"])
        if shown > found or (shown == found and int(kept.get("brokers") or 0) > out["brokers"]):
            return kept
    return out


def condition(
    type_: str,
    status: bool | None,
    reason: Reason,
    message: str,
    *,
    generation: int | None,
    now: datetime,
    previous: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    text = "Unknown" if status is None else str(status)
    old = next((c for c in previous if c.get("type") == type_), None)
    moved = old is None or old.get("status") != text or "lastTransitionTime" not in old
    cond: dict[str, Any] = {
        "type": type_,
        "status": text,
        "reason": reason.value,
        "message": message,
        "lastTransitionTime": timestamp(now) if moved else old["lastTransitionTime"],  # type: ignore[index]
    }
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def _merge(previous: Sequence[Mapping[str, Any]], *new: dict[str, Any]) -> list[dict[str, Any]]:
    replaced = {c["type"] for c in new}
    kept = [dict(c) for c in previous if c.get("type") not in replaced]
    return [*new, *kept]


def _with_ready(
    previous: Sequence[Mapping[str, Any]], ready: dict[str, Any], *, generation: int | None, now: datetime
) -> list[dict[str, Any]]:
    """``previous`` with ``ready`` and the Reconciling/Stalled condition that goes with it (the other one,
    or both, removed)."""
    reason = Reason(ready["reason"])
    extra = []
    if ready["status"] == "False" and reason in RETRYING | TERMINAL:
        type_ = RECONCILING if reason in RETRYING else STALLED
        extra.append(
            condition(type_, True, reason, ready["message"], generation=generation, now=now, previous=previous)
        )
    gone = {RECONCILING, STALLED} - {c["type"] for c in extra}
    return _merge([c for c in previous if c.get("type") not in gone], ready, *extra)


def _brokers(kind: model.Kind, syncs: Sequence[model.BrokerSync]) -> list[dict[str, Any]]:
    rows = []
    for s in sorted(syncs, key=lambda s: s.broker):
        row: dict[str, Any] = {"name": s.broker.name, "endpoint": s.broker.endpoint, "synced": s.synced}
        if s.message:
            row["message"] = s.message
        if s.synced:  # a copy just created reports no figures yet: it has none (else the next resync writes 0s)
            row.update(dict.fromkeys(FIGURES[kind], 0))
        row.update(dict(s.figures))
        rows.append(row)
    return rows


_FAILURE_ORDER: Final = (model.Failure.REJECTED, model.Failure.MISSING_PARENT, model.Failure.UNAVAILABLE)
_FAILURE_REASON: Final = {
    model.Failure.REJECTED: Reason.BROKER_REJECTED,
    model.Failure.MISSING_PARENT: Reason.PARENT_TOPIC_NOT_FOUND,
    model.Failure.UNAVAILABLE: Reason.BROKER_UNAVAILABLE,
}


def applied(
    kind: model.Kind,
    key: str,
    *,
    generation: int,
    syncs: Sequence[model.BrokerSync],
    previous: Mapping[str, Any],
    now: datetime,
) -> dict[str, Any]:
    """Status after a reconcile reached (or tried to reach) every broker."""
    conditions = previous.get("conditions") or []
    ok = [s for s in syncs if s.synced]
    failed = [s for s in syncs if not s.synced]
    if not syncs:
        ready = condition(
            READY,
            False,
            Reason.NO_BROKERS,
            "no broker pod is discovered",
            generation=generation,
            now=now,
            previous=conditions,
        )
    elif failed:
        # The reason of the worst failure: a refusal needs a person; a missing parent topic may still come.
        worst = min(failed, key=lambda s: _FAILURE_ORDER.index(s.failure or model.Failure.UNAVAILABLE))
        reason = _FAILURE_REASON[worst.failure or model.Failure.UNAVAILABLE]
        shown = [s for s in failed if s.failure is worst.failure]
        detail = "; ".join(f"{s.broker.name}: {s.message}" for s in shown)
        message = f"{len(ok)}/{len(syncs)} brokers in sync; {detail}"
        ready = condition(READY, False, reason, message, generation=generation, now=now, previous=conditions)
    else:
        message = f"applied to {len(syncs)}/{len(syncs)} brokers"
        ready = condition(READY, True, Reason.APPLIED, message, generation=generation, now=now, previous=conditions)
    out: dict[str, Any] = {
        "observedGeneration": generation,
        KEY_FIELD[kind]: key,
        "brokersReady": f"{len(ok)}/{len(syncs)}",
        "brokers": _brokers(kind, syncs),
        "conditions": _with_ready(conditions, ready, generation=generation, now=now),
    }
    for figure in FIGURES[kind]:
        out[figure] = sum(dict(s.figures).get(figure, 0) for s in ok)
    if kind is model.Kind.PARENT_TOPIC:
        reclaim = last_reclaim([s.reclaim for s in syncs if s.reclaim is not None], previous.get("lastReclaim"))
        if reclaim is not None:
            out["lastReclaim"] = reclaim
    return out


def blocked(
    reason: Reason,
    message: str,
    *,
    generation: int,
    previous: Mapping[str, Any],
    now: datetime,
    key: tuple[model.Kind, str] | None = None,
) -> dict[str, Any]:
    """Status when the operator deliberately does not touch brokers (invalid, conflict, paused, unmanaged), or
    when a deletion could not finish (``DeleteFailed``): no per-broker fields; ``lastReclaim`` is kept.

    A paused resource keeps its old ``observedGeneration``: its current generation is not applied, and a
    GitOps tool must not believe otherwise.
    """
    conditions = previous.get("conditions") or []
    state = {
        Reason.UNMANAGED: True,
        Reason.RECONCILIATION_PAUSED: None,
    }.get(reason, False)
    observed = None if reason is Reason.RECONCILIATION_PAUSED else generation
    ready = condition(READY, state, reason, message, generation=observed, now=now, previous=conditions)
    out: dict[str, Any] = {"conditions": _with_ready(conditions, ready, generation=observed, now=now)}
    if observed is not None:
        out["observedGeneration"] = observed
    elif "observedGeneration" in previous:
        out["observedGeneration"] = previous["observedGeneration"]
    if key is not None:
        out[KEY_FIELD[key[0]]] = key[1]
    if previous.get("lastReclaim"):  # a record of what happened, still true; it only ever moves forward
        out["lastReclaim"] = dict(previous["lastReclaim"])
    return out


def drained(leaving: Sequence[model.Leaving], previous: Mapping[str, Any], now: datetime) -> dict[str, Any]:
    """The scale-down condition; shown on ParentTopics because that is where the undrained data lives.

    A leaving broker that cannot be asked is not drained as far as anyone knows while its claim holds its
    disk: in a cluster its pod (and endpoint) is gone at once on scale-down, the data is not."""
    conditions = previous.get("conditions") or []
    if not leaving:
        text = "no leaving broker holds undrained messages or an unchecked volume claim"
        return condition(DRAINED, True, Reason.DRAINED, text, generation=None, now=now, previous=conditions)
    parts = []
    for x in sorted(leaving, key=lambda x: x.broker):
        where = f"{x.broker.name} (ordinal {x.broker.ordinal} >= replicas {x.replicas})"
        if x.draining:
            where = f"{x.broker.name} (ordinal {x.broker.ordinal}, leaving: scaling down to {x.replicas} pods)"
        if x.undrained_messages is not None:
            parts.append(f"{where} still holds {x.undrained_messages} undrained messages")
        else:
            parts.append(f"{where} cannot be asked whether it is drained, and its claim {x.claim} still exists")
    known = any(x.undrained_messages is not None for x in leaving)
    reason = Reason.UNDRAINED_BROKER_LEAVING if known else Reason.LEAVING_BROKER_UNREACHABLE
    return condition(DRAINED, False, reason, "; ".join(parts), generation=None, now=now, previous=conditions)


def with_condition(status: dict[str, Any], cond: dict[str, Any]) -> dict[str, Any]:
    status["conditions"] = _merge(status.get("conditions") or [], cond)
    return status


def ready_of(status: Mapping[str, Any]) -> tuple[str, str] | None:
    """(status, reason) of the Ready condition, for deciding whether an Event is news."""
    for cond in status.get("conditions") or []:
        if cond.get("type") == READY:
            return str(cond.get("status")), str(cond.get("reason"))
    return None


def changes(previous: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """Only the top-level status fields that differ: the merge patch to send (empty: send nothing).

    ``new`` is the whole status: a field it no longer has is removed (None in a JSON merge patch), so a
    resource that goes from Applied to paused or conflicting does not keep showing the brokers it had."""
    gone = {k: None for k in previous if k not in new}
    return gone | {k: v for k, v in new.items() if previous.get(k) != v}
