"""The run's last step: leave each parent's summary on the brokers, for ParentTopic status.

Each broker keeps, per parent, the newest run's record (``RecordReclaimRuns``), and the operator shows the
newest run its brokers report as ``status.lastReclaim``, adding up their shares. So every planned broker gets
a record for every parent it listed, its own share of the counts, zeros included: "the run looked and found
nothing" is news too, and it tells the operator how many brokers the run covered. A broker that could not be
planned gets none (the run never saw its parents), which the operator shows as fewer brokers for the run.

A failed record is logged, printed and counted, but stays out of the exit code: the reclaim is done by then,
a retried Job would scan every broker again only to write a status, and the next run records anyway.
Brokers are called in parallel so that one that hangs costs one timeout, not one per broker.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent import futures
from typing import Final

from lmq_broker import errors
from lmq_broker.admin.client import ReclaimRecording
from lmq_broker.admin.credentials import KeyPair
from lmq_broker.admin.tls import ClientTls
from lmq_reclaim import brokers, report

log = logging.getLogger("lmq_reclaim")

MAX_PARALLEL_BROKERS: Final = 16


def shares(out: report.Report, broker: str) -> dict[str, report.ParentSummary]:
    """``broker``'s share of the run, parent by parent."""
    return {parent: counts for (b, parent), counts in sorted(out.parents.items()) if b == broker}


def record(
    targets: Sequence[tuple[str, str]],
    out: report.Report,
    timeout_s: float,
    credentials: KeyPair | None = None,
    tls: ClientTls | None = None,
) -> None:
    """Record ``out`` on each (broker name, endpoint) of ``targets``; fills ``out.recorded_on`` and
    ``out.record_failures`` (with a message in ``out.error_messages`` per failure)."""
    work = [(name, endpoint, shares(out, name)) for name, endpoint in targets]
    work = [w for w in work if w[2]]  # a broker without parents has nothing to hold a record
    if not work:
        return

    def one(endpoint: str, parents: dict[str, report.ParentSummary]) -> ReclaimRecording:
        with brokers.ArrowAdmin(endpoint, timeout_s, credentials, tls) as admin:
            return admin.record_run(out, parents)

    with futures.ThreadPoolExecutor(min(MAX_PARALLEL_BROKERS, len(work)), "lmq-reclaim-record") as pool:
        calls = [(name, pool.submit(one, endpoint, parents)) for name, endpoint, parents in work]
        for name, call in calls:
            try:
                done = call.result()
            except errors.LmqError as exc:
                out.record_failures += 1
                out.error_messages.append(f"record {name}: {exc.message}")
                log.error("run summary not recorded on %s: %s", name, exc.message)
                continue
            out.recorded_on.append(name)
            if done.superseded:
                log.warning(
                    "%s keeps a later run's record for %s (this run started earlier)", name, ", ".join(done.superseded)
                )
            if done.unknown_parents:
                log.info("%s no longer holds %s: not recorded there", name, ", ".join(done.unknown_parents))
    log.info("run %s recorded on %d of %d broker(s)", out.run_id, len(out.recorded_on), len(work))
