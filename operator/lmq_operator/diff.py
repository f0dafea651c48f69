"""What to do on each broker to make it hold the desired config: a plan, computed without I/O.

The plan is per broker so that one unreachable broker never stops the others from being brought in sync,
and so that its failure is reported on its own line of ``status.brokers``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lmq_operator import model


class Change(enum.Enum):
    NONE = "none"  # already in sync
    MISSING = "missing"  # the broker does not hold it: create (or re-create after an empty disk)
    DIFFERS = "differs"  # the broker holds another version: overwrite


@dataclass(frozen=True, slots=True)
class Unreachable:
    """Observing a broker failed; carries the error text for status."""

    message: str


@dataclass(frozen=True, slots=True)
class Step:
    broker: model.Broker
    change: Change
    config: model.Config


@dataclass(frozen=True, slots=True)
class Plan:
    steps: tuple[Step, ...]
    unreachable: tuple[tuple[model.Broker, str], ...]

    @property
    def writes(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if s.change is not Change.NONE)


Observation = model.Observed | None | Unreachable


def plan(wanted: model.Config, observed: Mapping[model.Broker, Observation]) -> Plan:
    steps: list[Step] = []
    unreachable: list[tuple[model.Broker, str]] = []
    for broker in sorted(observed):
        seen = observed[broker]
        if isinstance(seen, Unreachable):
            unreachable.append((broker, seen.message))
        elif seen is None:
            steps.append(Step(broker, Change.MISSING, wanted))
        elif seen.config != wanted:
            steps.append(Step(broker, Change.DIFFERS, wanted))
        else:
            steps.append(Step(broker, Change.NONE, wanted))
    return Plan(tuple(steps), tuple(unreachable))


def with_secret_version(observed: Mapping[model.Broker, Observation], version: str) -> dict[model.Broker, Observation]:
    """Users as brokers hold them, with the Secret value they were last given everywhere (``version``): brokers
    never return a secret, so a changed Secret differs from every copy, and an unchanged one from none."""
    out: dict[model.Broker, Observation] = {}
    for broker, seen in observed.items():
        out[broker] = seen
        if isinstance(seen, model.Observed) and isinstance(seen.config, model.UserConfig):
            out[broker] = dataclasses.replace(seen, config=dataclasses.replace(seen.config, secret_version=version))
    return out


def plan_delete(brokers: Sequence[model.Broker], key: str) -> tuple[tuple[model.Broker, str], ...]:
    """Deleting is blind and idempotent: every broker is asked, whether or not it holds ``key``."""
    return tuple((b, key) for b in sorted(brokers))
