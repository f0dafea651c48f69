"""The brokers' replication as the operator reports it: each ring slot's Lease (holder, epoch, renewal) and
whether every replica of the slot answers, summed up as a condition on the broker StatefulSet.

Leadership is the brokers' business (docs/replication.md): the operator never writes a slot Lease, it reads
them. Which replicas are *in sync* only a slot's owner knows exactly (``lmq_replication_in_sync`` on the
brokers); what the operator can see is a replica that does not answer at all (its pod down, or starting),
which is what keeps a slot from having every copy: such a slot is under-replicated here. Pure: the Leases come
in as the API's JSON, no Kubernetes client here.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Final

ANNOTATION: Final = "lmq.io/replication"  # the report, on the broker StatefulSet, for `kubectl describe`


class Reason(enum.StrEnum):
    REPLICATED = "Replicated"  # every slot's lease is held and every replica of it answers
    UNDER_REPLICATED = "UnderReplicated"  # some slot has a replica that does not answer
    LEASE_UNHELD = "LeaseUnheld"  # some slot's lease is missing, released or expired: nobody takes its sends


@dataclass(frozen=True, slots=True)
class Slot:
    slot: int
    holder: str  # the Lease's holderIdentity ("slot-<s>/<id>": the broker of ring slot s), "" when none
    epoch: int  # leaseTransitions: the slot's replication epoch
    renewed: str  # the Lease's renewTime as written ("" when none)
    held: bool  # a holder whose lease has not expired
    missing: tuple[int, ...]  # replicas (ring slots) of this slot that do not answer


@dataclass(frozen=True, slots=True)
class Report:
    replicas: int
    slots: tuple[Slot, ...]

    @property
    def unheld(self) -> list[int]:
        return [s.slot for s in self.slots if not s.held]

    @property
    def under_replicated(self) -> list[int]:
        return [s.slot for s in self.slots if s.missing]

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
            "slots": [{**asdict(s), "missing": list(s.missing)} for s in self.slots],
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":"))


def _listed(slots: list[int]) -> str:
    shown = ", ".join(str(s) for s in slots[:20])
    return shown + (f" and {len(slots) - 20} more" if len(slots) > 20 else "")


def replicas_of(slot: int, slots: int, processes: int, replicas: int) -> list[int]:
    """The ring slots that hold ``slot``: itself and the same process on the next ``replicas - 1`` pods (the
    brokers' rule, ``lmq_broker.replication.setup.followers_of``)."""
    return [(slot + k * processes) % slots for k in range(replicas)]


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
    by_name = {str(lease["metadata"]["name"]): lease.get("spec") or {} for lease in leases}
    found = []
    for slot in range(slots):
        spec = by_name.get(f"{prefix}-slot-{slot}", {})
        holder = str(spec.get("holderIdentity") or "")
        missing = tuple(r for r in replicas_of(slot, slots, processes, replicas) if r not in answering)
        found.append(
            Slot(
                slot=slot,
                holder=holder,
                epoch=int(spec.get("leaseTransitions") or 0),
                renewed=str(spec.get("renewTime") or ""),
                held=bool(holder) and not _expired(spec, now),
                missing=missing,
            )
        )
    return Report(replicas, tuple(found))
