"""The job's command line, parsed into one frozen value that the rest of the job reads.

Defaults are the CronJob's: local[2], 15 minutes minimum age (RocketMQ ``minLiteTTl``), a bounded delete
rate per broker. ``--now-ms`` pins the clock so a run can be replayed exactly. ``--run-id`` names the run in
the records it leaves on brokers; the chart passes the Job's name (``LMQ_RECLAIM_RUN_ID``).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from lmq_broker import errors
from lmq_broker.admin import validation
from lmq_broker.admin.tls import CA_ENV, SERVER_NAME_ENV, ClientTls, client_tls

DEFAULT_MASTER: Final = "local[2]"
DEFAULT_BROKER_PORT: Final = 8081
# C1 only: a run lasts a minute or two on a few cores, and C2's compiler threads cost more CPU than its faster
# code gives back in that time (measured: JIT threads 20 CPU-s -> 2.5 for a 1M-topic run, the job's phases
# no slower).
DEFAULT_JVM_OPTIONS: Final = "-XX:TieredStopAtLevel=1"


@dataclass(frozen=True, slots=True)
class Options:
    brokers: tuple[str, ...] = ()
    broker_service: str = ""
    namespace: str = ""
    broker_port: int = DEFAULT_BROKER_PORT
    broker_processes: int = 1  # serve --processes N per pod: process i's admin on broker_port + i
    cluster_domain: str = "cluster.local"
    discovery: str = "dns"  # dns | endpointslices
    master: str | None = None  # None: spark-submit's master when submitted, else DEFAULT_MASTER
    local_dir: Path | None = None
    driver_memory: str = "1g"
    spark_conf: tuple[tuple[str, str], ...] = ()
    jvm_options: str = DEFAULT_JVM_OPTIONS
    class_archive: Path | None = None
    min_age_minutes: int = 15
    only_fully_consumed: bool = False
    no_live_subscribers: bool = False
    dry_run: bool = False
    max_deletes_per_second: float = 2000.0
    delete_batch_size: int = 500
    scan_batch_size: int = 10_000
    rows_per_task: int = 250_000
    max_ranges_per_parent: int = 64
    pushdown: bool = True  # brokers return only rows idle long enough to possibly expire
    audit_path: str = ""
    audit_format: str = "parquet"  # parquet | jsonl
    now_ms: int | None = None
    run_id: str = ""  # empty: the run's start in epoch ms
    record: bool = True  # leave each parent's summary on its brokers (ParentTopic status.lastReclaim)
    timeout_s: float = 30.0
    scan_timeout_s: float = 3600.0
    delete_timeout_s: float = 300.0
    access_key: str = ""
    secret_key: str = field(default="", repr=False)
    tls: ClientTls | None = None  # --tls-ca: admin calls over TLS
    log_level: str = "INFO"


def _conf_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _deletes_per_second(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:  # a negative rate used to pass and mean "unlimited"
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (0: unlimited), got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmq-reclaim",
        description="Reclaim expired lite topics on every broker (PySpark). Scans lite-topic metadata through "
        "the admin service, applies each ParentTopic's expiration, and deletes with compare-and-delete.",
    )
    where = p.add_argument_group("brokers (one of --brokers or --broker-service)")
    where.add_argument("--brokers", default="", help="comma-separated admin endpoints host:port")
    where.add_argument("--broker-service", default="", help="headless Service of the broker StatefulSet")
    where.add_argument("--namespace", default="", help="namespace of --broker-service")
    where.add_argument("--broker-port", type=int, default=DEFAULT_BROKER_PORT, help="admin port (default 8081)")
    where.add_argument(
        "--broker-processes",
        type=int,
        default=1,
        help="processes per broker pod (serve --processes N): each pod address is reached at --broker-port + i "
        "for i < N (default 1)",
    )
    where.add_argument("--cluster-domain", default="cluster.local", help="DNS suffix (default cluster.local)")
    where.add_argument(
        "--discovery",
        choices=("dns", "endpointslices"),
        default="dns",
        help="resolve the Service through DNS A records (no RBAC needed) or the EndpointSlices API",
    )
    spark = p.add_argument_group("spark")
    spark.add_argument(
        "--master", default=None, help=f"Spark master (default: spark-submit's --master, else {DEFAULT_MASTER})"
    )
    spark.add_argument("--local-dir", type=Path, default=None, help="spark.local.dir (scratch space)")
    spark.add_argument("--driver-memory", default="1g", help="spark.driver.memory (default 1g)")
    spark.add_argument("--conf", action="append", type=_conf_pair, default=[], help="extra Spark KEY=VALUE")
    spark.add_argument(
        "--jvm-options",
        default=DEFAULT_JVM_OPTIONS,
        help=f"options of the driver and executor JVMs, as --jvm-options='...' (default {DEFAULT_JVM_OPTIONS!r}: "
        "no C2 JIT)",
    )
    spark.add_argument(
        "--class-archive",
        type=Path,
        default=Path(os.environ["LMQ_RECLAIM_CLASS_ARCHIVE"]) if os.environ.get("LMQ_RECLAIM_CLASS_ARCHIVE") else None,
        help="a JVM class-data-sharing archive of Spark's classes: loaded when the file exists (the JVM starts "
        "in about half the CPU), written when the run ends when it does not; env LMQ_RECLAIM_CLASS_ARCHIVE",
    )
    rules = p.add_argument_group("policy")
    rules.add_argument("--min-age-minutes", type=int, default=15, help="never reclaim a topic idle less (15)")
    rules.add_argument("--only-fully-consumed", action="store_true", help="keep topics with unconsumed messages")
    rules.add_argument("--no-live-subscribers", action="store_true", help="keep topics with a live subscriber")
    rules.add_argument("--now-ms", type=int, default=None, help="evaluate as of this epoch-millis time")
    act = p.add_argument_group("deleting")
    act.add_argument("--dry-run", action="store_true", help="decide and report, delete nothing")
    act.add_argument(
        "--max-deletes-per-second",
        type=_deletes_per_second,
        default=2000.0,
        help="per broker, token bucket; 0 = unlimited (must be >= 0)",
    )
    act.add_argument("--delete-batch-size", type=_positive_int, default=500, help="rows per delete call")
    act.add_argument("--scan-batch-size", type=_positive_int, default=10_000, help="rows per scan response")
    act.add_argument("--rows-per-task", type=_positive_int, default=250_000, help="target rows per scan task")
    act.add_argument(
        "--no-pushdown",
        dest="pushdown",
        action="store_false",
        help="scan every row, fresh ones too (the report then counts every topic; slower)",
    )
    act.add_argument("--max-ranges-per-parent", type=_positive_int, default=64, help="key ranges per parent cap")
    act.add_argument("--timeout-s", type=float, default=30.0, help="deadline of unary admin calls")
    act.add_argument("--scan-timeout-s", type=float, default=3600.0, help="deadline of one range's scan stream")
    act.add_argument("--delete-timeout-s", type=float, default=300.0, help="deadline of one delete call")
    where.add_argument(
        "--access-key",
        default=os.environ.get("LMQ_RECLAIM_ACCESS_KEY", ""),
        help="the brokers' admin access key, to sign admin calls; env LMQ_RECLAIM_ACCESS_KEY",
    )
    where.add_argument(
        "--secret-key",
        default=os.environ.get("LMQ_RECLAIM_SECRET_KEY", ""),
        help="secret of --access-key; prefer env LMQ_RECLAIM_SECRET_KEY (kept out of the process list)",
    )
    where.add_argument(
        "--tls-ca",
        default=None,
        help=f"speak TLS to brokers whose certificate this PEM CA signed; env {CA_ENV} (default plaintext)",
    )
    where.add_argument(
        "--tls-server-name",
        default=None,
        help=f"the name the brokers' certificate must carry (they are dialled by address); env {SERVER_NAME_ENV}",
    )
    out = p.add_argument_group("report")
    out.add_argument("--audit-path", default="", help="write the audit here ('{now}' becomes the run's time)")
    out.add_argument("--audit-format", choices=("parquet", "jsonl"), default="parquet")
    out.add_argument(
        "--run-id",
        default=os.environ.get("LMQ_RECLAIM_RUN_ID", ""),
        help="name of this run in the summaries recorded on brokers (default: its start in epoch ms); "
        "env LMQ_RECLAIM_RUN_ID",
    )
    out.add_argument(
        "--no-record",
        dest="record",
        action="store_false",
        help="do not record this run's per-parent summary on the brokers (it is what the operator shows as "
        "ParentTopic status.lastReclaim; a dry run records too, flagged, unless told not to)",
    )
    out.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return p


def parse(argv: Sequence[str] | None = None) -> Options:
    p = parser()
    ns = p.parse_args(argv)
    brokers = tuple(b.strip() for b in ns.brokers.split(",") if b.strip())
    if bool(brokers) == bool(ns.broker_service):
        p.error("give exactly one of --brokers or --broker-service")
    if ns.broker_service and not ns.namespace and "." not in ns.broker_service:
        p.error("--broker-service needs --namespace (or a fully qualified name)")
    if ns.broker_processes < 1:
        p.error("--broker-processes must be >= 1")
    if brokers and ns.broker_processes != 1:
        p.error("--broker-processes applies to --broker-service; --brokers lists every process's endpoint")
    if ns.min_age_minutes < 0:
        p.error("--min-age-minutes must be >= 0")
    if len(ns.run_id.encode()) > validation.RUN_ID_MAX_BYTES or not ns.run_id.isprintable():
        p.error(f"--run-id must be at most {validation.RUN_ID_MAX_BYTES} bytes of printable text")
    try:
        tls = client_tls(ns.tls_ca, ns.tls_server_name)
    except errors.InvalidArgument as exc:
        p.error(exc.message)
    return Options(
        brokers=brokers,
        broker_service=ns.broker_service,
        namespace=ns.namespace,
        broker_port=ns.broker_port,
        broker_processes=ns.broker_processes,
        cluster_domain=ns.cluster_domain,
        discovery=ns.discovery,
        master=ns.master,
        local_dir=ns.local_dir,
        driver_memory=ns.driver_memory,
        spark_conf=tuple(ns.conf),
        jvm_options=ns.jvm_options,
        class_archive=ns.class_archive,
        min_age_minutes=ns.min_age_minutes,
        only_fully_consumed=ns.only_fully_consumed,
        no_live_subscribers=ns.no_live_subscribers,
        dry_run=ns.dry_run,
        max_deletes_per_second=ns.max_deletes_per_second,
        delete_batch_size=ns.delete_batch_size,
        scan_batch_size=ns.scan_batch_size,
        rows_per_task=ns.rows_per_task,
        max_ranges_per_parent=ns.max_ranges_per_parent,
        pushdown=ns.pushdown,
        audit_path=ns.audit_path,
        audit_format=ns.audit_format,
        now_ms=ns.now_ms,
        run_id=ns.run_id,
        record=ns.record,
        timeout_s=ns.timeout_s,
        scan_timeout_s=ns.scan_timeout_s,
        delete_timeout_s=ns.delete_timeout_s,
        access_key=ns.access_key,
        secret_key=ns.secret_key,
        tls=tls,
        log_level=ns.log_level,
    )
