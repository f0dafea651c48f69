"""Building the SparkSession the job runs in: quiet, no UI, scratch space where the pod mounts it.

The log4j2 configuration is written next to the scratch space at start-up rather than shipped as a
package file, so a wheel needs no data files and an operator can still override it with ``--conf``.
Under ``spark-submit`` the JVM already runs when we get here: the builder then only adds settings and the
log level is lowered through the SparkContext.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Final

from pyspark.sql import SparkSession

from lmq_reclaim.options import Options

APP_NAME: Final = "lmq-reclaim"
ARROW_BATCH_ROWS: Final = 10_000
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
    if opts.master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    java_opts = f"-Dlog4j2.configurationFile=file:{log4j}"
    builder = (
        SparkSession.builder.master(opts.master)
        .appName(APP_NAME)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.local.dir", str(scratch))
        .config("spark.driver.memory", opts.driver_memory)
        .config("spark.driver.extraJavaOptions", java_opts)
        .config("spark.executor.extraJavaOptions", java_opts)
        .config("spark.sql.shuffle.partitions", "8")
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", str(ARROW_BATCH_ROWS))
        .config("spark.sql.session.timeZone", "UTC")
    )
    for key, value in opts.spark_conf:
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
