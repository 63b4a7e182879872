"""The Spark session: `local[*]` by default, any master URL by config, Delta and Kafka jars local.

The jars come from `.jars/spark/`, which `mvn package` fills from pom.xml; nothing is
downloaded when the session starts. One session is shared by everything in a process. With the
S3A jars comes Delta's log store for s3a paths that is safe with several writers
(`.jars/log-store/`, jvm/log-store, compiled by scripts/install.sh). The settings of the
session itself (`SparkResource.session_conf`) are also what the EMR Pipes job sets on the
session a cluster gives it (emr/pipes_job.py).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import dagster as dg
import pyspark
from dagster_pyspark import LazyPySparkResource
from pydantic import Field, PrivateAttr
from pyspark.sql import SparkSession

from resources import jvm_archive

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JARS_DIR = REPO_ROOT / ".jars" / "spark"
DEFAULT_S3_JARS_DIR = REPO_ROOT / ".jars" / "s3"
DEFAULT_LOG_STORE_DIR = REPO_ROOT / ".jars" / "log-store"
DEFAULT_JVM_ARCHIVE_DIR = REPO_ROOT / ".jars" / "jvm-archive"
# Delta reads its log store class for a scheme from the SparkConf the session starts with
# (DelegatingLogStore: SparkEnv's conf), so it can't be set on a running session.
LOG_STORE_CONF = "spark.delta.logStore.s3a.impl"
CONDITIONAL_PUT_LOG_STORE = "io.cdclake.delta.ConditionalPutLogStore"
# The driver JVM's compilers (`SparkResource.driver_jit`): "c1" stops HotSpot's tiered JIT at
# its first compiler. Options of the user's that choose the JIT themselves are left alone.
C1_ONLY = "-XX:TieredStopAtLevel=1"
_OWN_JIT = ("TieredStopAtLevel", "TieredCompilation")
DRIVER_JITS = ("tiered", "c1")
DriverJit = Literal["tiered", "c1"]


# How the mirrors' Parquet files store timestamps: as microseconds (TIMESTAMP_MICROS), the
# proleptic Gregorian calendar as written, not Spark's default INT96 (nanoseconds in 64 bits,
# which delta-rs, polars and pyarrow read wrong outside 1677-09-21 .. 2262-04-11). Every value
# Debezium can send (years 0001-9999) reads back as the source has it, in every reader.
PARQUET_TIMESTAMPS = {
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
    "spark.sql.parquet.datetimeRebaseModeInWrite": "CORRECTED",
    "spark.sql.parquet.int96RebaseModeInWrite": "CORRECTED",
}
DELTA_EXTENSION = "io.delta.sql.DeltaSparkSessionExtension"
# What the project's results rest on, whatever a cluster's defaults: Delta's catalog, UTC hours
# and timestamps, timestamps in Parquet that every reader reads right, and secrets (in Kafka
# options and S3 settings) kept out of Spark's logged configuration.
REQUIRED_SESSION_CONF = {
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    "spark.sql.session.timeZone": "UTC",
    "spark.redaction.regex": "(?i)secret|password|token|access[.]?key|jaas",
    **PARQUET_TIMESTAMPS,
}


@contextmanager
def session_settings(spark: SparkSession, settings: Mapping[str, str]) -> Iterator[None]:
    """Sets `settings` on the session for the block, then puts back what was there (unset when
    nothing was set). A run's tables each have a session of their own (`cdc_assets.fleet`)."""
    previous = {name: spark.conf.get(name, None) for name in settings}
    try:
        for name, value in settings.items():
            spark.conf.set(name, value)
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                spark.conf.unset(name)
            else:
                spark.conf.set(name, value)


def compiled_classes(spark: SparkSession) -> int:
    """The classes Spark's code generation has compiled in this JVM so far (its cache misses):
    what `codegen_cache_entries` saves, counted by benchmarks/small_hours and its test."""
    # PySpark has no API for Spark's code generation metrics (a JVM metrics source): they are
    # read through pyspark's gateway to the JVM, which it keeps private.
    jvm = spark.sparkContext._jvm  # noqa: SLF001
    metrics = jvm.org.apache.spark.metrics.source.CodegenMetrics
    return int(metrics.METRIC_COMPILATION_TIME().getCount())


class SparkJarsMissingError(RuntimeError):
    pass


def spark_jars(jars_dir: Path) -> list[str]:
    """The jar files Spark needs, failing with the fix when they were never resolved."""
    jars = sorted(str(path) for path in jars_dir.glob("*.jar"))
    names = " ".join(jars)
    missing = [name for name in ("delta-spark_", "spark-sql-kafka-") if name not in names]
    if missing:
        raise SparkJarsMissingError(
            f"Spark jars {missing} are missing from {jars_dir}. Resolve them with "
            f"`mvn -q package` in {REPO_ROOT} (scripts/install.sh does this)."
        )
    return jars


def s3_class_path(jars_dir: Path) -> str | None:
    """The class path entry of the S3A jars (hadoop-aws, AWS SDK), if they were resolved.

    They go on the JVMs' class path rather than into spark.jars, which would copy the ~650 MB
    SDK bundle into every executor's work directory each time a session starts. hadoop-aws must
    be the Hadoop version pyspark ships, or S3A fails at run time with missing methods.
    """
    aws = sorted(jars_dir.glob("hadoop-aws-*.jar"))
    if not aws:
        return None
    shipped = sorted((Path(pyspark.__file__).parent / "jars").glob("hadoop-client-api-*.jar"))
    version = aws[0].name.removeprefix("hadoop-aws-").removesuffix(".jar")
    if shipped and not shipped[0].name.endswith(f"-{version}.jar"):
        raise SparkJarsMissingError(
            f"{aws[0].name} in {jars_dir} does not match pyspark's {shipped[0].name}: set "
            f"hadoop.version in pom.xml to pyspark's Hadoop and run scripts/install.sh."
        )
    return f"{jars_dir}/*"


def log_store_jar(jars_dir: Path) -> str | None:
    """The conditional-put log store's jar (jvm/log-store), if scripts/install.sh built it."""
    jars = sorted(jars_dir.glob("conditional-put-log-store-*.jar"))
    return str(jars[-1]) if jars else None


# SparkResource.interpreted_max_bytes' default (run_hour's too): where interpreting a small hour
# stops paying (docs/benchmark.md, "Small hours run interpreted").
INTERPRETED_MAX_BYTES = 1024 * 1024


class SparkResource(dg.ConfigurableResource):
    """Builds the SparkSession through dagster-pyspark, with Delta and the Kafka source set up."""

    master: str = Field(default="local[*]", description="Any Spark master URL.")
    app_name: str = "cdc-lake"
    jars_dir: str = Field(default=str(DEFAULT_JARS_DIR), description="Folder of jars for Spark.")
    s3_jars_dir: str = Field(
        default=str(DEFAULT_S3_JARS_DIR),
        description=(
            "Folder of the S3A jars (hadoop-aws and the AWS SDK), put on the driver's and "
            "executors' class path; ignored when missing (a cluster may bring its own)."
        ),
    )
    log_store_dir: str = Field(
        default=str(DEFAULT_LOG_STORE_DIR),
        description=(
            "Folder of the conditional-put log store's jar: with the S3A jars, it is Delta's "
            f"log store for s3a paths ({LOG_STORE_CONF}), safe with several writers of a table."
        ),
    )
    driver_memory: str = "2g"
    shuffle_partitions: int = Field(
        default=8, description="Default shuffle width; small, since an hour is small."
    )
    ui_enabled: bool = False
    retained_queries: int = Field(
        default=100,
        ge=1,
        description=(
            "SQL queries, jobs and stages whose plans and metrics the session keeps in the "
            "driver's heap for its UI and status API (Spark keeps 1,000 of each, even with the "
            "UI off). Raise it to see more history in a session's UI."
        ),
    )
    # 2 MB less a Java array's 16-byte header, as Spark sizes its own pages: G1 stores an array
    # of a whole 2 MB in one more region than it needs (docs/benchmark.md has the figures).
    memory_page_size: str = Field(
        default="2097136b",
        description=(
            "spark.buffer.pageSize: the memory an aggregation, sort or join takes at a time, a "
            "whole page for its first row. Spark sizes it from the heap, far more than a small "
            "hour needs; larger inputs take more pages."
        ),
    )
    delta_snapshot_partitions: int = Field(
        default=4,
        description=(
            "Partitions for replaying a Delta log (Delta's default is 50, which makes every "
            "snapshot of a small table slow); raise it for tables with very long logs."
        ),
    )
    codegen_cache_entries: int = Field(
        default=1000,
        ge=0,
        description=(
            "Generated classes Spark keeps compiled (spark.sql.codegen.cache.maxEntries; 0: "
            "none), so each hour of a process does not compile a table's classes again. Spark "
            "reads it once per JVM: it counts only when this resource starts the session. The "
            "classes take Metaspace, outside driver_memory."
        ),
    )
    parallel_tables: int = Field(
        default=2,
        ge=1,
        description=(
            "Tables a run works on at once, each in a thread with a Spark session of its own "
            "(FAIR scheduling between them); about the cores the driver and executors have."
        ),
    )
    local_read_max_records: int = Field(
        default=20_000,
        ge=0,
        description=(
            "An hour whose slice holds at most this many records is read and decoded in the "
            "driver, without a Spark job for the read; larger ones by Spark's Kafka source."
        ),
    )
    interpreted_max_bytes: int = Field(
        default=INTERPRETED_MAX_BYTES,
        ge=0,
        description=(
            "An hour read in the driver (local_read_max_records) into a mirror, error table "
            "and history each smaller than this many bytes of data files runs Spark's "
            "expressions interpreted, without generating and compiling code for them: on a "
            "few thousand rows that code costs more than it saves (a warm small table-hour "
            "11-13% less, with history 20%), on many rows interpreting is ~10 microseconds a "
            "row slower. Lakes on local disk or S3 (others count as large). 0: always generate "
            "code."
        ),
    )
    driver_jit: DriverJit = Field(
        default="tiered",
        description=(
            "The driver JVM's JIT compilers. 'tiered': the JVM's default, C1 then C2. 'c1': "
            f"the client compiler only ({C1_ONLY}): a run of one or two table-hours is faster "
            "(a cold table-hour by ~5 s, a quarter) on a third to a half less CPU, but longer "
            "runs are slower (50 tables' hour, two at a time: 18% longer), as C1's code is. "
            "For deployments whose runs are single table-hours (env CDC_SPARK_DRIVER_JIT where "
            "the resources come from the environment). Ignored where the driver's "
            "Java options choose the JIT themselves. docs/benchmark.md has the figures."
        ),
    )
    extra_conf: dict[str, str] = Field(default_factory=dict, description="Any other Spark conf.")
    jvm_archive_dir: str | None = Field(
        default=str(DEFAULT_JVM_ARCHIVE_DIR),
        description=(
            "Folder of the driver JVM's class-data archive (scripts/install.sh makes it; "
            "resources/jvm_archive.py): the driver starts on it when the archive of its java "
            "and class path is there, else as without one. None: never."
        ),
    )
    python_executable: str | None = Field(
        default=None,
        description=(
            "Python of Spark's Python workers (the masking UDF runs there). Default: "
            "PYSPARK_PYTHON; without it, this interpreter on a local master."
        ),
    )

    _pyspark: LazyPySparkResource | None = PrivateAttr(default=None)

    def session_conf(self) -> dict[str, str]:
        """The settings of the session itself, wherever it runs: REQUIRED_SESSION_CONF and the
        sizes for small hours. The EMR Pipes job sets them on its cluster's session too
        (emr/pipes_job.py); where the session runs and with what is `spark_config`'s."""
        return {
            "spark.sql.shuffle.partitions": str(self.shuffle_partitions),
            "spark.ui.showConsoleProgress": "false",
            "spark.sql.ui.retainedExecutions": str(self.retained_queries),
            "spark.ui.retainedJobs": str(self.retained_queries),
            "spark.ui.retainedStages": str(self.retained_queries),
            "spark.buffer.pageSize": self.memory_page_size,
            "spark.databricks.delta.snapshotPartitions": str(self.delta_snapshot_partitions),
            "spark.sql.codegen.cache.maxEntries": str(self.codegen_cache_entries),
            **REQUIRED_SESSION_CONF,
        }

    def spark_config(self) -> dict[str, Any]:
        conf = {
            "spark.master": self.master,
            "spark.app.name": self.app_name,
            "spark.jars": ",".join(spark_jars(Path(self.jars_dir))),
            "spark.driver.memory": self.driver_memory,
            "spark.sql.extensions": DELTA_EXTENSION,
            "spark.ui.enabled": str(self.ui_enabled).lower(),
            # A run's tables share the executors fairly (cdc_assets/fleet.py).
            "spark.scheduler.mode": "FAIR",
            **self.session_conf(),
        }
        class_path = s3_class_path(Path(self.s3_jars_dir))
        if class_path:
            conf["spark.driver.extraClassPath"] = class_path
            conf["spark.executor.extraClassPath"] = class_path
            # Only the driver commits, but the class extends Delta's S3 log store, so it must be
            # loaded beside Delta (spark.jars), not from the class path. It is used for s3a paths
            # only; LakeResource.connect refuses an S3 lake without it (or single_writer).
            store = log_store_jar(Path(self.log_store_dir))
            if store:
                conf["spark.jars"] += "," + store
                conf[LOG_STORE_CONF] = CONDITIONAL_PUT_LOG_STORE
        conf.update(self.extra_conf)
        conf = self._with_jit(conf)
        archives = None if self.jvm_archive_dir is None else Path(self.jvm_archive_dir)
        return jvm_archive.with_archive(conf, archives)

    def _with_jit(self, conf: dict[str, str]) -> dict[str, str]:
        """`conf` with the driver's JIT as `driver_jit` says, unless the driver's options
        already choose one."""
        if self.driver_jit == "tiered" or any(
            flag in conf.get(name, "") for name in jvm_archive.USER_OPTIONS for flag in _OWN_JIT
        ):
            return conf
        name = jvm_archive.DRIVER_OPTIONS
        return {**conf, name: f"{conf.get(name, '')} {C1_ONLY}".strip()}

    @property
    def session(self) -> SparkSession:
        if self._pyspark is None:
            # PySpark takes its workers' Python from PYSPARK_PYTHON when the context starts (the
            # spark.pyspark.python conf only counts under spark-submit); 'python3' from PATH may
            # lack pandas and pyarrow.
            if self.python_executable:
                os.environ["PYSPARK_PYTHON"] = self.python_executable
            elif self.master.startswith("local"):
                os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
            self._pyspark = LazyPySparkResource(spark_config=self.spark_config())
            # py4j's DEBUG trace prints every call into the JVM with its arguments, the Kafka
            # login among them: it never goes below INFO here.
            py4j = logging.getLogger("py4j")
            py4j.setLevel(max(py4j.getEffectiveLevel(), logging.INFO))
        return self._pyspark.spark_session
