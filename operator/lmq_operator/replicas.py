"""The brokers' replication as the operator reports it: each ring slot's Lease (holder, epoch, renewal) and
whether every replica of the slot answers, summed up as a condition on the broker StatefulSet.

Leadership is the brokers' business (docs/replication.md): the operator never writes a slot Lease, it reads
them. A slot is under-replicated here when a replica does not answer at all (its pod down, or starting) or is
not in the slot's *in-sync set* as its holder recorded it in the Lease (``lmq.io/in-sync``: only those may take
the slot over, Kafka's ISR). That set is also what a scale-up at R > 1 waits for (``scaling``: no set may
name a replica the grown ring does not give its slot; docs/replication.md, *Changing the ring with R > 1*).
Pure: the Leases come in as the API's JSON, no Kubernetes client here.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Final

ANNOTATION: Final = "lmq.io/replication"  # the report, on the broker StatefulSet, for `kubectl describe`
IN_SYNC: Final = "lmq.io/in-sync"  # on a slot Lease: its in-sync replicas (ring slots, comma-separated), the holder's
# The holder a released lease names (``lmq_broker.replication.leadership.RELEASED``): its releaser, fenced before it
# wrote it, so nobody takes the slot's sends until a member of its set takes the lease at its next tick.
RELEASED: Final = "released/"


class Reason(enum.StrEnum):
    REPLICATED = "Replicated"  # every slot's lease is held and every replica of it answers
    UNDER_REPLICATED = "UnderReplicated"  # some slot has a replica that does not answer
    LEASE_UNHELD = "LeaseUnheld"  # some slot's lease is missing, released or expired: nobody takes its sends


@dataclass(frozen=True, slots=True)
class Slot:
    slot: int
    holder: str  # the Lease's holderIdentity ("slot-<s>/<id>": the broker of ring slot s; "released/…"), "" when none
    epoch: int  # leaseTransitions: the slot's replication epoch
    renewed: str  # the Lease's renewTime as written ("" when none)
    held: bool  # a holder whose lease has not expired (a released lease is not held: its releaser is fenced)
    missing: tuple[int, ...]  # replicas (ring slots) of this slot that do not answer
    in_sync: tuple[int, ...] | None = None  # the in-sync set recorded in the Lease; None: none recorded
    out_of_sync: tuple[int, ...] = ()  # replicas not in that set (() when none is recorded)


@dataclass(frozen=True, slots=True)
class Report:
    replicas: int
    slots: tuple[Slot, ...]

    @property
    def unheld(self) -> list[int]:
        return [s.slot for s in self.slots if not s.held]

    @property
    def under_replicated(self) -> list[int]:
        return [s.slot for s in self.slots if s.missing or s.out_of_sync]

    @property
    def reason(self) -> Reason:
        if self.unheld:
            return Reason.LEASE_UNHELD
        return Reason.UNDER_REPLICATED if self.under_replicated else Reason.REPLICATED

    @property
    def message(self) -> str:
        parts = []
        if self.unheld:
            parts.append(f"slots without a lease holder: {_listed(self.unheld)}")
        if self.under_replicated:
            parts.append(f"slots under-replicated: {_listed(self.under_replicated)}")
        if not parts:
            return f"{len(self.slots)} slots, each held and on {self.replicas} answering replicas"
        return "; ".join(parts)

    def condition(self) -> dict[str, str]:
        """A Kubernetes condition (type Replicated): True only when nothing is missing."""
        ok = self.reason is Reason.REPLICATED
        return {"type": "Replicated", "status": "True" if ok else "False", "reason": self.reason.value}

    def annotation(self) -> str:
        """The JSON written to the StatefulSet's lmq.io/replication (no timestamps of its own: it changes only
        when something in it does)."""
        body = {
            **self.condition(),
            "message": self.message,
            "replicas": self.replicas,
            "underReplicated": len(self.under_replicated),
            "unheld": len(self.unheld),
            "slots": [_slot_json(s) for s in self.slots],
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":"))


def _slot_json(slot: Slot) -> dict[str, Any]:
    body = asdict(slot)
    del body["in_sync"], body["out_of_sync"]
    in_sync = None if slot.in_sync is None else list(slot.in_sync)
    return {**body, "missing": list(slot.missing), "inSync": in_sync, "outOfSync": list(slot.out_of_sync)}


def in_sync_of(lease: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The in-sync set a slot Lease records (the brokers' ``lmq_broker.replication.kube``); None when it has
    none or it cannot be read (a Lease written by hand)."""
    text = ((lease.get("metadata") or {}).get("annotations") or {}).get(IN_SYNC)
    if text is None:
        return None
    try:
        return tuple(sorted(int(part) for part in str(text).split(",") if part.strip()))
    except ValueError:
        return None


def _listed(slots: list[int]) -> str:
    shown = ", ".join(str(s) for s in slots[:20])
    return shown + (f" and {len(slots) - 20} more" if len(slots) > 20 else "")


def replicas_of(slot: int, slots: int, processes: int, replicas: int) -> list[int]:
    """The ring slots that hold ``slot``: itself and the same process on the next ``replicas - 1`` pods (the
    brokers' rule, ``lmq_broker.replication.setup.followers_of``)."""
    return [(slot + k * processes) % slots for k in range(replicas)]


def holder_of(lease: Mapping[str, Any], now: datetime) -> int | None:
    """The ring slot of the broker holding a slot Lease (its identity ``slot-<s>/…``); None when nobody holds it
    (missing, released, expired) or another name does (a person's forced takeover)."""
    spec = lease.get("spec") or {}
    holder = str(spec.get("holderIdentity") or "")
    head = holder.partition("/")[0]
    number = head.removeprefix("slot-")
    if not held(holder, spec, now) or not head.startswith("slot-") or not number.isdigit():
        return None
    return int(number)


def removed(
    leases: Iterable[Mapping[str, Any]], prefix: str, slots: int, running: Collection[int], now: datetime
) -> list[tuple[str, str]]:
    """(name, resourceVersion) of the slot Leases a finished scale-down leaves behind: ``<prefix>-slot-<s>`` of a
    slot ``s`` the ring of ``slots`` slots no longer has, whose broker is not ``running`` (no endpoint published:
    its pod is gone) and which nobody holds (released, expired, or no holder). Never a live slot's: every slot
    below ``slots`` stays, also one whose pod is away."""
    out: list[tuple[str, str]] = []
    for lease in leases:
        meta = lease.get("metadata") or {}
        name = str(meta.get("name") or "")
        number = name.removeprefix(f"{prefix}-slot-")
        if not name.startswith(f"{prefix}-slot-") or not number.isdigit():
            continue
        slot, spec = int(number), lease.get("spec") or {}
        if slot >= slots and slot not in running and not held(str(spec.get("holderIdentity") or ""), spec, now):
            out.append((name, str(meta.get("resourceVersion") or "")))
    return out


def held(holder: str, spec: Mapping[str, Any], now: datetime) -> bool:
    """Whether a slot Lease has a holder that takes the slot's sends: named, not released, not expired."""
    return bool(holder) and not holder.startswith(RELEASED) and not _expired(spec, now)


def _expired(spec: Mapping[str, Any], now: datetime) -> bool:
    renewed = spec.get("renewTime") or spec.get("acquireTime")
    if not renewed:
        return True
    when = datetime.fromisoformat(str(renewed).replace("Z", "+00:00"))
    return (now - when).total_seconds() > float(spec.get("leaseDurationSeconds") or 0)


def report(  # noqa: PLR0917 (what was observed)
    leases: Iterable[Mapping[str, Any]],
    prefix: str,
    slots: int,
    processes: int,
    replicas: int,
    answering: Collection[int],
    now: datetime,
) -> Report:
    """Each slot's state from the release's Leases (``<prefix>-slot-<s>``, the API's JSON) and the ring slots
    that answered the operator this pass."""
    by_name = {str(lease["metadata"]["name"]): lease for lease in leases}
    found = []
    for slot in range(slots):
        lease = by_name.get(f"{prefix}-slot-{slot}", {})
        spec = lease.get("spec") or {}
        holder = str(spec.get("holderIdentity") or "")
        ring = replicas_of(slot, slots, processes, replicas)
        missing = tuple(r for r in ring if r not in answering)
        in_sync = in_sync_of(lease)
        found.append(
            Slot(
                slot=slot,
                holder=holder,
                epoch=int(spec.get("leaseTransitions") or 0),
                renewed=str(spec.get("renewTime") or ""),
                held=held(holder, spec, now),
                missing=missing,
                in_sync=in_sync,
                out_of_sync=() if in_sync is None else tuple(r for r in ring if r not in in_sync),
            )
        )
    return Report(replicas, tuple(found))
