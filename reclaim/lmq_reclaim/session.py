"""Building the SparkSession the job runs in: quiet, no UI, scratch space where the pod mounts it.

The log4j2 configuration is written next to the scratch space at start-up rather than shipped as a
package file, so a wheel needs no data files and an operator can still override it with ``--conf``.
Under ``spark-submit`` the JVM already runs when we get here: the builder then only adds settings and the
log level is lowered through the SparkContext.

Most of a short run's JVM time is start-up: loading ~24k classes out of ~250 jars (each lookup walks the jar
list) and compiling them. ``--class-archive`` keeps those classes in one JDK class-data-sharing archive,
mapped at start instead of loaded: a run without the file writes it as its JVM exits (``stop`` waits for
that and only then moves it into place, so a killed run never leaves half an archive); later runs map it.
An archive of another JDK or classpath is refused by the JVM, which then just starts without it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Final, cast

from pyspark import SparkContext
from pyspark.sql import SparkSession

from lmq_reclaim.options import DEFAULT_MASTER, Options

log = logging.getLogger("lmq_reclaim")

APP_NAME: Final = "lmq-reclaim"
ARCHIVE_WRITE_TIMEOUT_S: Final = 120.0  # writing the archive at JVM exit takes ~10 s on 2 cores
_WRITING_ARCHIVE: Final = "spark.lmq.reclaim.writingClassArchive"  # where this run's JVM dumps its classes
_PENDING_SUFFIX: Final = ".writing"
ARROW_BATCH_ROWS: Final = 10_000
ARROW_NO_BYTE_BOUND: Final = 2**31 - 1
_LOG4J2: Final = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
"""


def local_dir(opts: Options) -> Path:
    path = opts.local_dir or Path(tempfile.gettempdir()) / "lmq-reclaim-spark"
    path.mkdir(parents=True, exist_ok=True)
    return path


def build(opts: Options) -> SparkSession:
    scratch = local_dir(opts)
    log4j = scratch / "log4j2-lmq-reclaim.properties"
    log4j.write_text(_LOG4J2)
    # Executors must run our interpreter (it has lmq_reclaim and the stubs); a loopback driver address
    # keeps local mode off the network and silences Spark's hostname warning.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    master = effective_master(opts)
    if master is not None and master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    java_opts = " ".join((f"-Dlog4j2.configurationFile=file:{log4j}", opts.jvm_options)).strip()
    driver_opts = java_opts
    writing = ""
    if opts.class_archive is not None:
        if opts.class_archive.exists():
            driver_opts += f" -XX:SharedArchiveFile={opts.class_archive}"
        else:
            writing = str(_pending(opts.class_archive))
            # cds=error: the dump warns about every class it skips (signed jars, old class files).
            driver_opts += f" -XX:ArchiveClassesAtExit={writing} -Xlog:cds=error"
    builder = SparkSession.builder
    if master is not None:
        builder = builder.master(master)
    builder = (
        builder.appName(APP_NAME)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.local.dir", str(scratch))
        .config("spark.driver.memory", opts.driver_memory)
        .config("spark.driver.extraJavaOptions", driver_opts)
        .config(_WRITING_ARCHIVE, writing)
        .config("spark.executor.extraJavaOptions", java_opts)
        .config("spark.sql.shuffle.partitions", "8")
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", str(ARROW_BATCH_ROWS))
        # Batches are bounded by rows alone: with a byte bound, Spark sums the Arrow buffer sizes of every column
        # after every row it appends (Int.MaxValue is its "no bound" value, which skips that).
        .config("spark.sql.execution.arrow.maxBytesPerBatch", str(ARROW_NO_BYTE_BOUND))
        .config("spark.sql.session.timeZone", "UTC")
    )
    for key, value in opts.spark_conf:
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    log.info("spark master %s", spark.sparkContext.master)
    return spark


def effective_master(opts: Options) -> str | None:
    """The job's ``--master`` when given; else, under spark-submit (its launcher hands the driver a running
    JVM), none of ours, so that spark-submit's ``--master`` holds; else ``DEFAULT_MASTER``."""
    if opts.master is not None:
        return opts.master
    return None if os.environ.get("PYSPARK_GATEWAY_PORT") else DEFAULT_MASTER


def stop(spark: SparkSession) -> None:
    """Stop Spark. When this run writes the class archive, also end the JVM that we launched (it writes the
    archive as it exits), wait for it, and move the finished archive into place."""
    writing = spark.sparkContext.getConf().get(_WRITING_ARCHIVE, "") or ""
    spark.stop()
    gateway = SparkContext._gateway  # the JVM pyspark launched (no .proc under spark-submit)
    proc = cast("subprocess.Popen[bytes] | None", getattr(gateway, "proc", None))
    if not writing or gateway is None or proc is None or proc.stdin is None:
        return
    gateway.shutdown()
    proc.stdin.close()  # the gateway JVM exits when its stdin closes
    try:
        code = proc.wait(ARCHIVE_WRITE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.warning("the JVM did not exit within %.0fs; class archive not written", ARCHIVE_WRITE_TIMEOUT_S)
        return
    finally:
        SparkContext._gateway = None  # a later session must launch a new JVM
        SparkContext._jvm = None
    pending = Path(writing)
    if code == 0 and pending.exists():
        pending.replace(_final(pending))
        log.info("class archive written to %s", _final(pending))


def _pending(archive: Path) -> Path:
    return archive.with_name(archive.name + _PENDING_SUFFIX)


def _final(pending: Path) -> Path:
    return pending.with_name(pending.name.removesuffix(_PENDING_SUFFIX))
