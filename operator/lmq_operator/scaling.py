"""The broker StatefulSet's membership, decided as a value: what the operator does next to reach the wanted size.

Brokers never move data (docs/scale-out.md), so a pod count is not something to set and forget: adding pods
means telling every broker the grown ring, and removing pods means marking them leaving, waiting until they
have drained, removing them from the ring, and only then stopping them. The operator runs these steps one
pass at a time; each pass observes everything again and ``decide`` says what to do, so a restarted operator (or
a new leader) takes over halfway without any memory of its own besides its record, the membership it is
driving the brokers to (the ``target``).

``spec.replicas`` of the StatefulSet belongs to the operator: it is whatever the target's members need. The
wanted pod count comes from the ``lmq.io/replicas`` annotation (the chart's ``broker.replicas``); a
``spec.replicas`` that someone else changed is set back, because lowering it directly would stop brokers that
still hold undelivered messages. Everything here is pure: no kopf, no Kubernetes, no gRPC.

Two rules keep a membership change safe for clients. A broker learns a new member only once that member holds
every resource the operator manages (``prepare``): a producer routed there by the new ring must find its
ParentTopic. And the operator is the single writer of the membership's epoch: every broker told one target
membership gets the same epoch, one above the highest any broker had (``epoch_for``), and the same number
again while the operator retries that target.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from lmq_broker.cluster import membership as mb
from lmq_broker.cluster import ring
from lmq_operator import replicas

ANNOTATION_REPLICAS: Final = "lmq.io/replicas"  # the wanted pod count, on the StatefulSet (chart, GitOps, kubectl)
ANNOTATION_MEMBERSHIP: Final = "lmq.io/membership"  # the operator's target, on its membership ConfigMap
ANNOTATION_EPOCH: Final = "lmq.io/membership-epoch"  # the epoch given with the target, on the same ConfigMap
ANNOTATION_STATUS: Final = "lmq.io/scaling"  # the operator's progress, on the StatefulSet, for `kubectl describe`
ENV_PEERS: Final = "LMQ_PEERS"  # the ConfigMap's keys: what a starting broker pod takes as its flags
ENV_HISTORY: Final = "LMQ_RING_HISTORY"


class Phase(enum.StrEnum):
    STEADY = "Steady"  # the brokers form the wanted ring
    SCALING_UP = "ScalingUp"  # new pods are starting; the brokers are told once every one of them answers
    DRAINING = "Draining"  # leaving pods keep serving what they hold until every group has consumed it
    SCALED_DOWN = "ScaledDown"  # this pass removed the drained pods from the ring and lowers the replicas
    CONVERGING = "Converging"  # some brokers do not have the target yet: this pass tells them
    WAITING = "Waiting"  # a broker of the target does not answer: nothing changes until it does
    STALLED = "Stalled"  # a person has to act (the message says what)


def slot_endpoints(pod: str, processes: int) -> tuple[str, ...]:
    """The ring slots' advertised endpoints of one pod (``host:port``): the pod itself with one process, else its
    processes' own ports ``port + 1 + i`` (``lmq_broker.supervisor``)."""
    return ring.slot_endpoints(pod, processes)


def members_of(pods: Sequence[str], processes: int) -> tuple[str, ...]:
    """Slot endpoints of ``pods`` in slot order (``ordinal * processes + i``)."""
    out: list[str] = []
    for ordinal, pod in enumerate(pods):
        slots = slot_endpoints(pod, processes)
        assert all(ring.slot_number(ordinal, i, processes) == len(out) + i for i in range(processes))
        out += slots
    return tuple(out)


def pod_env(target: mb.Membership, pods: Sequence[str]) -> dict[str, str] | None:
    """The flags a broker pod starting now needs for ``target`` (``--peers`` one per pod, ``--ring-history``
    in slots); None while slots are leaving, which flags cannot say (the operator tells such pods itself)."""
    if target.leaving_slots:
        return None
    return {ENV_PEERS: mb.SEPARATOR.join(pods), ENV_HISTORY: mb.SEPARATOR.join(str(s) for s in target.sizes[:-1])}


@dataclass(frozen=True, slots=True)
class View:
    """One slot's answer to GetCluster."""

    membership: mb.Membership
    slot: int
    epoch: int = 0  # 0: a broker that does not number its memberships (older than epochs)
    ring_fixed: str = ""  # why the broker refuses a grown ring now (replication; "": it takes one)


@dataclass(frozen=True, slots=True)
class Observed:
    wanted: int | None  # pods, from the annotation (-1: not a number); None: keep the size the target has
    replicas: int  # spec.replicas now
    processes: int
    target: mb.Membership | None  # the operator's record; None before its first pass
    views: Mapping[int, View | None]  # slot -> its answer (None: did not answer); pods that run, beyond too
    undrained: Mapping[int, int | None]  # leaving slot -> undrained messages (None: could not be asked)
    pod: Callable[[int], str]  # ordinal -> the pod's advertised endpoint (what ``--peers`` lists)
    epoch: int | None = None  # the epoch recorded with ``target`` (None: none recorded yet)
    replication: int = 1  # copies of every ring slot (docs/replication.md, Changing the ring with R > 1)
    # Above 1: each slot's in-sync set as its Lease records it (None for a slot: none recorded; None: the Leases
    # could not be read). A ring change is over once no set names a replica the ring no longer gives the slot.
    in_sync: Mapping[int, tuple[int, ...] | None] | None = None
    # Above 1: the ring slot of the broker holding each slot's Lease (None for a slot: nobody, its Lease
    # released, expired or missing), read with ``in_sync``: a scale-down removes its slots only once every
    # slot that stays is held by a broker that stays.
    holders: Mapping[int, int | None] | None = None


@dataclass(frozen=True, slots=True)
class Unprepared:
    """Why joining brokers do not hold every resource yet: ``stalled`` when a broker refused one (a person has
    to act), else one could not be reached and the next pass tries again."""

    message: str
    stalled: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    phase: Phase
    message: str
    target: mb.Membership | None = None  # the record to write before anything else (None: unchanged)
    env: dict[str, str] | None = None  # the ConfigMap's data to write (None: unchanged)
    tell: tuple[int, ...] = ()  # slots to SetCluster with the target, in this order
    replicas: int | None = None  # spec.replicas to set once every SetCluster succeeded (None: unchanged)
    warning: str | None = None  # someone else changed spec.replicas: the Warning Event that says so
    event: str | None = None  # a step worth an Event (Normal), with the phase as its reason
    epoch: int | None = None  # the epoch every told broker gets with the target (recorded before telling)
    prepare: tuple[int, ...] = ()  # slots that must hold every resource before any broker is told


def _pods(target: mb.Membership, processes: int) -> int:
    return len(target.members) // processes


def _bootstrap(o: Observed) -> mb.Membership | Decision:
    """The target before the operator's first pass: what the running brokers agree on."""
    answers = {(v.membership.members, v.membership.sizes) for v in o.views.values() if v is not None}
    if not answers:
        return Decision(Phase.WAITING, "no broker answers GetCluster yet")
    if len(answers) > 1:
        seen = "; ".join(f"{list(m)} sizes {list(s)}" for m, s in sorted(answers))
        return Decision(
            Phase.STALLED,
            f"the brokers disagree on their membership ({seen}): make them agree with "
            "`lmq-admin cluster set --everywhere`, then the operator takes over",
        )
    members, sizes = answers.pop()
    found = mb.Membership(members, sizes)
    if len(members) % o.processes or members != members_of(
        [o.pod(i) for i in range(len(members) // o.processes)], o.processes
    ):
        expected = members_of([o.pod(i) for i in range(max(1, len(members) // o.processes))], o.processes)
        return Decision(
            Phase.STALLED,
            f"the brokers' members {list(members)} are not the pods' endpoints {list(expected)}: start them with "
            "--advertised-address and --peers of the pods (the chart does), or set them with `lmq-admin cluster set`",
        )
    return found


def tell_order(old: Sequence[str], target: mb.Membership, slots: Sequence[int]) -> tuple[int, ...]:
    """The safe order of ``lmq-admin cluster set --everywhere``: joining slots first, then leaving ones (they send
    on what reaches them by the old view), then the others, slots no longer members last."""

    def rank(slot: int) -> tuple[int, int]:
        if slot >= len(target.members):
            return 3, slot
        if target.members[slot] not in old:
            return 0, slot
        return (1 if target.leaving(slot) else 2), slot

    return tuple(sorted(slots, key=rank))


def epoch_for(target: mb.Membership, recorded: int | None, views: Mapping[int, View | None]) -> int:
    """The epoch to give every broker with ``target``: the one recorded with it while no broker holds a newer
    one or that number with other members; else the newest epoch any broker has, when every broker at that
    epoch already holds ``target`` (a pass told some before it stopped, or a person did with the same
    members); else one above it. So it only grows, and it stays the same while the same target is retried."""
    seen = [v for v in views.values() if v is not None]
    top = max((v.epoch for v in seen), default=0)

    def holds(epoch: int) -> bool:
        return all(v.membership == target for v in seen if v.epoch == epoch)

    if recorded is not None and recorded >= top and holds(recorded):
        return recorded
    if top > 0 and holds(top):
        return top
    return top + 1


def joining_slots(old: Sequence[str], target: mb.Membership) -> tuple[int, ...]:
    """Slots of ``target`` that are not members of ``old`` (the ring the brokers being told have): telling them
    the target sends clients there, so those brokers must hold every resource first."""
    return tuple(s for s, member in enumerate(target.members) if member not in old)


def _numbered(views: Mapping[int, View | None]) -> bool:
    """Whether the brokers number their memberships: one that reports 0 everywhere ignores epochs."""
    return any(v is not None and v.epoch > 0 for v in views.values())


def _differs(view: View | None, target: mb.Membership, slot: int, epoch: int | None = None) -> bool:
    want_slot = slot if slot < len(target.members) else -1
    if view is None or view.membership != target or view.slot != want_slot:
        return True
    return epoch is not None and view.epoch != epoch


def decide(o: Observed) -> Decision:  # noqa: PLR0911 (a return per scaling decision, in order)
    found = o.target if o.target is not None else _bootstrap(o)
    if isinstance(found, Decision):
        return found
    target, recorded = found, o.target is None
    pods = _pods(target, o.processes)
    # A pod the membership needs is never left stopped: raising spec.replicas back is always safe.
    base = Decision(Phase.STEADY, "", target if recorded else None)
    if o.replicas < pods:
        base = _with(base, base.phase, "", replicas=pods, warning=_restored(o.replicas, pods))

    # 1. Every member (and every removed pod still running) has the target, or is told it, in a safe order.
    members = len(target.members)
    silent = [s for s in range(members) if o.views.get(s) is None]
    if silent:
        names = ", ".join(target.members[s] for s in silent)
        return _with(base, Phase.WAITING, f"waiting for {names} to answer (pods starting, or down)")
    epoch = epoch_for(target, o.epoch, o.views)
    numbered = epoch if _numbered(o.views) else None
    stale = [s for s, v in o.views.items() if v is not None and _differs(v, target, s, numbered)]
    if stale:
        old = next((v for v in o.views.values() if v is not None and v.membership != target), o.views[stale[0]])
        assert old is not None
        order = tell_order(old.membership.members, target, stale)
        text = (
            f"telling {len(order)} brokers the membership of {pods} pods (ring sizes {list(target.sizes)}, "
            f"epoch {epoch})"
        )
        return _with(
            base, Phase.CONVERGING, text, tell=order, epoch=epoch, prepare=joining_slots(old.membership.members, target)
        )

    # 2. Every broker has the target. Pods beyond its members are stopped only now (a broker told to remove a
    # peer asks that peer whether it is drained), then the next step towards the wanted size.
    if o.replicas > pods:
        return _with(
            base,
            Phase.CONVERGING,
            f"stopping pods beyond the {pods} members",
            replicas=pods,
            warning=_restored(o.replicas, pods),
        )
    ring_pods = target.size // o.processes
    wanted = o.wanted if o.wanted is not None else ring_pods
    if wanted < 1:
        return _with(base, Phase.STALLED, f"{ANNOTATION_REPLICAS} must be a whole number of at least 1")
    replicated = _replicated(o, target, wanted) if o.replication > 1 else None
    if replicated is not None:
        return _with(base, *replicated)
    if target.leaving_slots:
        # a new wish while draining: a new epoch with that ring (all back, or fewer); a replicated ring first
        # finishes the scale-down it marked (its brokers take no other ring meanwhile)
        if wanted != ring_pods and o.replication <= 1:
            new = target.shrunk(min(wanted, pods) * o.processes)
            text = f"the wanted size changed to {wanted} pods while draining"
            return _step(base, o, target, new, phase=Phase.CONVERGING, text=text)
        counts = [o.undrained.get(s) for s in target.leaving_slots]
        if all(c == 0 for c in counts):
            new = target.shed()
            text = f"the leaving brokers are drained: removing them, then scaling down to {ring_pods} pods"
            step = _step(base, o, target, new, phase=Phase.SCALED_DOWN, text=text)
            return _with(
                step,
                step.phase,
                step.message,
                replicas=ring_pods,
                warning=None,
                env=pod_env(new, _pod_list(o, ring_pods)),
            )
        parts = []
        for slot, count in zip(target.leaving_slots, counts, strict=True):
            held = "cannot be asked" if count is None else f"{count} undrained messages" if count else "drained"
            parts.append(f"{target.members[slot]}: {held}")
        text = f"scaling down {pods} → {ring_pods} pods, waiting for the leaving brokers to drain ({'; '.join(parts)})"
        return _with(base, Phase.DRAINING, text)
    if wanted < pods:
        new = target.shrunk(wanted * o.processes)
        text = f"scaling down {pods} → {wanted} pods: the leaving brokers take no new topic and drain"
        return _step(base, o, target, new, phase=Phase.DRAINING, text=text)
    if wanted > pods:
        joining = [o.pod(i) for i in range(pods, wanted)]
        new = target.grown(*members_of(_pod_list(o, wanted), o.processes)[members:])
        text = f"scaling up {pods} → {wanted} pods: starting {', '.join(joining)}"
        env = pod_env(new, _pod_list(o, wanted))
        return Decision(Phase.SCALING_UP, text, new, env, (), wanted, None, text)
    env = pod_env(target, _pod_list(o, pods))
    return _with(base, Phase.STEADY, f"{pods} pods, ring sizes {list(target.sizes)}", env=env)


def _replicated(o: Observed, target: mb.Membership, wanted: int) -> tuple[Phase, str] | None:
    """At R > 1, what holds the ring where it is (None: nothing, the next step goes as at R = 1): a scale-down
    whose leaving slots cannot be removed yet, a change still moving replicas, a scale-down below R pods, a
    change while a broker cannot change its ring."""
    if target.leaving_slots:
        return _not_shed(o, target)
    moving = _replicas_moving(o, target)
    if moving is not None:
        return moving
    pods = target.size // o.processes
    if wanted < pods and wanted < o.replication:
        return Phase.STALLED, _too_few(o.replication, pods, wanted)
    fixed = [(s, v.ring_fixed) for s, v in sorted(o.views.items()) if v is not None and v.ring_fixed]
    if wanted != pods and fixed:
        return Phase.STALLED, _not_changeable(o.replication, pods, wanted, target, fixed)
    return None


def _not_shed(o: Observed, target: mb.Membership) -> tuple[Phase, str] | None:
    """At R > 1 with slots leaving (docs/replication.md, *Changing the ring with R > 1*, step 6): what the
    removal of the leaving slots waits for; None once nothing (their drain is checked as at R = 1). Each
    leaving slot is held by its own broker, which drains its topics to their owners in today's ring (they take
    them over where they end); each slot that stays has its new-ring replicas in its in-sync set (probed in by
    its holder) and is held by a broker that stays (a leaving one releases it to a member of the set). Removed
    before, a slot that stays could lose its last in-sync copy, or keep a lease nobody renews."""
    pods, ring_pods = len(target.members) // o.processes, target.size // o.processes
    if o.in_sync is None or o.holders is None:
        why = "their holders and in-sync sets decide when leaving slots may be removed"
        return Phase.WAITING, f"the slot Leases could not be read: {why}"
    waits: list[str] = []
    for slot in target.leaving_slots:
        holder = o.holders.get(slot)
        if holder != slot:
            held = "nobody" if holder is None else _member(target, holder)
            waits.append(f"leaving slot {slot}'s lease is held by {held}, not {_member(target, slot)}, which drains it")
    for slot in range(target.size):
        ring = replicas.replicas_of(slot, target.size, o.processes, o.replication)
        found, holder = o.in_sync.get(slot), o.holders.get(slot)
        if holder is None or target.leaving(holder):
            held = "nobody (released or expired)" if holder is None else f"{_member(target, holder)}, which is leaving"
            waits.append(f"slot {slot}'s lease is held by {held}")
        if found is None or not set(ring) <= set(found):
            waits.append(f"slot {slot}: in sync {list(found or ())}, needs its replicas {ring}")
    if not waits:
        return None
    shown = "; ".join(waits[:8]) + (f" and {len(waits) - 8} more" if len(waits) > 8 else "")
    return Phase.DRAINING, f"scaling down {pods} → {ring_pods} pods (every slot on {o.replication}), waiting: {shown}"


def _member(target: mb.Membership, slot: int) -> str:
    return target.members[slot] if 0 <= slot < len(target.members) else f"slot {slot}"


def _replicas_moving(o: Observed, target: mb.Membership) -> tuple[Phase, str] | None:
    """At R > 1, after a grown ring was told to every broker: each slot's replicas move to the new ring through
    its in-sync set (docs/replication.md, *Changing the ring with R > 1*): the new replicas are probed into it,
    then its holder writes it without the replicas the new ring does not give the slot. Until every slot's set
    names only its new-ring replicas nothing else changes (the next change would start from a half-moved
    ring); None once they do. A slot whose lease names no set yet (a new slot's first tick) is waited for."""
    if o.in_sync is None:
        return Phase.WAITING, "the slot Leases could not be read: their in-sync sets decide when a ring change is over"
    slots, processes = target.size, o.processes
    unset = [s for s in range(slots) if o.in_sync.get(s) is None]
    moving = {
        s: (found, ring)
        for s in range(slots)
        if (found := o.in_sync.get(s)) is not None
        and not set(found) <= set(ring := replicas.replicas_of(s, slots, processes, o.replication))
    }
    if moving:
        shown = "; ".join(f"slot {s}: in sync {list(f)}, replicas {r}" for s, (f, r) in sorted(moving.items())[:8])
        return Phase.SCALING_UP, f"moving slots' replicas to the ring of {slots // processes} pods ({shown})"
    if unset:
        return Phase.WAITING, f"waiting for the leases of slots {unset[:20]} to name their in-sync sets"
    return None


def _too_few(replication: int, pods: int, wanted: int) -> str:
    """Why the pod count stays: every slot is kept on ``replication`` pods, never two replicas on one pod."""
    return (
        f"{ANNOTATION_REPLICAS} asks for {wanted} pods, but every slot is kept on {replication} pods, each on "
        f"another pod: the ring stays at {pods} pods (docs/replication.md). Set it to {replication} or more"
    )


def _not_changeable(
    replication: int, pods: int, wanted: int, target: mb.Membership, fixed: Sequence[tuple[int, str]]
) -> str:
    """Why a ring change does not start at R > 1: a broker holds a lite topic whose last record names no slot,
    so it would file it by another ring after the change. Nothing is started, recorded, told or drained."""
    shown = "; ".join(f"{target.members[s] if s < len(target.members) else s}: {why}" for s, why in fixed[:4])
    way = "grow" if wanted > pods else "shrink"
    return (
        f"{ANNOTATION_REPLICAS} asks for {wanted} pods, but the brokers cannot {way} a ring replicated "
        f"{replication} times now ({shown}): the ring stays at {pods} pods (docs/replication.md, Changing the "
        "ring with R > 1)"
    )


def _restored(replicas: int, pods: int) -> str:
    return (
        f"spec.replicas was {replicas} but the brokers' membership has {pods} pods: set to {pods}. Change the pod "
        f"count with the {ANNOTATION_REPLICAS} annotation (chart value broker.replicas): the operator then starts "
        "new pods and tells every broker, or drains leaving pods before it stops them"
    )


def _pod_list(o: Observed, count: int) -> list[str]:
    return [o.pod(i) for i in range(count)]


def _step(base: Decision, o: Observed, old: mb.Membership, new: mb.Membership, *, phase: Phase, text: str) -> Decision:
    """Record ``new`` and tell every running broker, in the safe order."""
    slots = sorted(s for s, v in o.views.items() if v is not None)
    order = tell_order(old.members, new, slots)
    epoch = epoch_for(new, o.epoch if new == o.target else None, o.views)
    prepare = joining_slots(old.members, new)
    return _with(base, phase, text, target=new, tell=order, event=text, epoch=epoch, prepare=prepare)


def _with(base: Decision, phase: Phase, message: str, **changes: Any) -> Decision:
    return dataclasses.replace(base, phase=phase, message=message, **changes)
