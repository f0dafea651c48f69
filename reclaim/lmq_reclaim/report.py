"""The run's result as a value, and its rendering as the summary table printed at the end.

Counts per broker come from three places gathered by the job: the scan tasks' accumulator (rows read,
errors), the observation on the decide step (expired), and the delete outcomes. Counts per (broker,
parent), which each broker keeps as the parent's last run, come from the tasks' accumulator alone: a scan
task covers one parent, and a delete call counts its outcomes per parent as it returns. Keeping the value
apart from the table lets tests assert on numbers, not on text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from lmq_reclaim.columns import Outcome


def _count(summary: BrokerSummary | ParentSummary, outcome: str, count: int) -> None:
    if outcome in (Outcome.DELETED, Outcome.WOULD_DELETE):
        summary.reclaimed += count
    elif outcome == Outcome.KEPT_CHANGED:
        summary.kept_changed += count
    elif outcome == Outcome.KEPT_SUBSCRIBED:
        summary.kept_subscribed += count
    elif outcome == Outcome.NOT_FOUND:
        summary.not_found += count
    # ERROR rows are not counted here: ``errors`` counts failed calls (a scan range or a delete batch),
    # reported by the tasks themselves, so a scan failure (no rows at all) and a delete failure weigh alike.


@dataclass(slots=True)
class BrokerSummary:
    broker: str
    endpoint: str
    scanned: int = 0
    expired: int = 0
    reclaimed: int = 0  # DELETED, or WOULD_DELETE in a dry run
    kept_changed: int = 0
    kept_subscribed: int = 0
    not_found: int = 0
    errors: int = 0

    def add_outcome(self, outcome: str, count: int) -> None:
        _count(self, outcome, count)


@dataclass(slots=True)
class ParentSummary:
    """One broker's share of the run for one parent: what that broker records as the parent's last run."""

    scanned: int = 0
    expired: int = 0  # candidates: every one has exactly one outcome, ERROR included
    reclaimed: int = 0
    kept_changed: int = 0
    kept_subscribed: int = 0
    not_found: int = 0
    errors: int = 0  # failed scan or delete calls that concerned this parent

    def add_outcome(self, outcome: str, count: int) -> None:
        self.expired += count
        _count(self, outcome, count)


@dataclass(slots=True)
class Report:
    now_ms: int
    dry_run: bool
    brokers: dict[str, BrokerSummary] = field(default_factory=dict)
    timings_s: dict[str, float] = field(default_factory=dict)
    error_messages: list[str] = field(default_factory=list)
    audit_path: str = ""
    scan_tasks: int = 0
    run_id: str = ""
    finish_ms: int = 0
    # (broker, parent) -> counts, for every parent of every planned broker (zeros when nothing was scanned).
    parents: dict[tuple[str, str], ParentSummary] = field(default_factory=dict)
    recorded_on: list[str] = field(default_factory=list)  # brokers that now hold this run's records
    record_failures: int = 0  # brokers the records could not be sent to (logged; not in the exit code)

    @property
    def total(self) -> BrokerSummary:
        total = BrokerSummary("TOTAL", "")
        for b in self.brokers.values():
            for name in COUNTERS:
                setattr(total, name, getattr(total, name) + getattr(b, name))
        return total

    @property
    def exit_code(self) -> int:
        """0 when every broker was scanned and every delete call answered; 1 otherwise (a re-run is safe)."""
        return 1 if self.total.errors else 0


COUNTERS: Final = ("scanned", "expired", "reclaimed", "kept_changed", "kept_subscribed", "not_found", "errors")
_HEADERS: Final = ("broker", "endpoint", *COUNTERS)


def render_table(report: Report) -> str:
    rows = [[str(getattr(b, h)) for h in _HEADERS] for b in sorted(report.brokers.values(), key=lambda b: b.broker)]
    total = report.total
    rows.append([str(getattr(total, h)) for h in _HEADERS])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(_HEADERS)]

    def line(cells: list[str] | tuple[str, ...]) -> str:
        return "  ".join(
            cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    out = [line(_HEADERS), line(["-" * w for w in widths])]
    out.extend(line(r) for r in rows[:-1])
    out.append(line(["-" * w for w in widths]))
    out.append(line(rows[-1]))
    return "\n".join(out)


def render_timings(timings_s: Mapping[str, float]) -> str:
    return "  ".join(f"{name}={seconds:.2f}s" for name, seconds in timings_s.items())
