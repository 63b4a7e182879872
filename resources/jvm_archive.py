"""A class-data archive for the Spark driver's JVM: its classes mapped at start, not loaded.

Every process that starts a Spark session (a Dagster run, a backfill, a test's child process)
loads and verifies the same tens of thousands of JVM classes (Spark's, Delta's, Kafka's) before
its first job. The JDK's application class-data sharing (AppCDS) stores them once, parsed and
verified, in an archive the JVM maps at start. `scripts/install.sh` makes it (`main`, into
`.jars/jvm-archive/`; delete that folder to have it made again): a session started with
`-XX:ArchiveClassesAtExit` runs a small workload through the paths an hour takes (Delta writes,
a MERGE with deletion vectors, Arrow to Python and back, reads with filters, aggregations) and
stops. `SparkResource` then starts the driver with `-XX:SharedArchiveFile` when the archive for
its JVM and class path exists.

The archive's name is a digest of what it depends on: the java binary, pyspark's version, and
the jars the session puts on the class path. Change any of them and the name changes: no
archive is found, the JVM starts as it did without one, and the next `scripts/install.sh`
makes the new one. A JVM that can't use a found archive (a different JDK build at the same
path) prints one warning and starts without it; nothing depends on the archive but the time.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import pyspark

DRIVER_OPTIONS = "spark.driver.extraJavaOptions"
# What decides which classes the JVM loads from where, besides the java binary and pyspark.
_CLASS_PATH_CONF = ("spark.jars", "spark.driver.extraClassPath")


def java_binary() -> Path | None:
    """The java that pyspark's launcher (spark-submit) runs: JAVA_HOME's, else PATH's."""
    home = os.environ.get("JAVA_HOME")
    found = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    return Path(found).resolve() if found and Path(found).exists() else None


def _entries(class_path: str) -> list[str]:
    """A class path conf's entries, each `dir/*` expanded to its jars (name and size)."""
    out = []
    for entry in filter(None, class_path.replace(os.pathsep, ",").split(",")):
        paths = sorted(Path(entry[:-1]).glob("*.jar")) if entry.endswith("*") else [Path(entry)]
        out += [f"{p}:{p.stat().st_size if p.exists() else -1}" for p in paths]
    return out


def archive_path(conf: Mapping[str, str], folder: Path) -> Path | None:
    """Where the archive of a session with Spark conf `conf` is (or goes); None without java."""
    java = java_binary()
    if java is None:
        return None
    stat = java.stat()
    parts = [f"{java}:{stat.st_size}:{stat.st_mtime_ns}", f"pyspark {pyspark.__version__}"]
    for name in _CLASS_PATH_CONF:
        parts += [name, *_entries(conf.get(name, ""))]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return folder / f"spark-driver-{digest}.jsa"


def with_archive(conf: dict[str, str], folder: Path) -> dict[str, str]:
    """`conf` with the driver started on its archive when it exists (other options kept)."""
    path = archive_path(conf, folder)
    if path is None or not path.is_file():
        return conf
    options = conf.get(DRIVER_OPTIONS, "")
    return {**conf, DRIVER_OPTIONS: f"{options} -XX:SharedArchiveFile={path}".strip()}


def _workload(spark, work: Path) -> None:
    """The code paths an hour's run takes, on a few rows (their classes get archived)."""
    from delta.tables import DeltaTable
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    def through_python(batches):
        yield from batches

    path = str(work / "table")
    rows = spark.range(2000).select(
        F.col("id"),
        (F.col("id") % 7).alias("k"),
        F.concat(F.lit("v"), F.col("id").cast("string")).alias("v"),
        F.struct(F.col("id").alias("a"), F.lit(1).alias("b")).alias("s"),
    )
    rows = rows.mapInArrow(through_python, rows.schema)
    (
        DeltaTable.createIfNotExists(spark)
        .location(path)
        .addColumns(rows.schema)
        .property("delta.enableDeletionVectors", "true")
        .execute()
    )
    rows.write.format("delta").mode("append").save(path)
    source = rows.where(F.col("id") % 3 == 0).withColumn("id", F.col("id") + 1000)
    newest = source.groupBy("id").agg(F.max_by(F.struct("k", "v", "s"), F.col("s")).alias("n"))
    source = newest.select("id", "n.*").persist()
    source.count()
    table = DeltaTable.forPath(spark, path)
    (
        table.alias("t")
        .merge(source.alias("s"), "t.id = s.id AND t.id BETWEEN 0 AND 4000")
        .whenMatchedUpdate(condition="s.s > t.s", set={"v": "s.v", "s": "s.s"})
        .whenNotMatchedInsertAll()
        .execute()
    )
    source.unpersist()
    read = spark.read.format("delta").load(path).where(F.col("id").between(10, 3000))
    ranked = read.withColumn("r", F.row_number().over(Window.partitionBy("k").orderBy("id")))
    ranked.join(read.select("id"), "id", "left_semi").groupBy("k").count().collect()
    table.history(5).collect()
    spark.sql(f"SHOW TBLPROPERTIES delta.`{path}`").collect()
    table.optimize().executeZOrderBy("id")


class ArchiveNotMadeError(RuntimeError):
    """No archive came out (no java found, or the JVM wrote none)."""


def make(folder: Path, conf: dict[str, str], *, force: bool = False) -> Path:
    """Makes the archive of sessions started with `conf` in `folder`, unless it is there.

    The JVM writes the archive when it exits: this stops the session and waits for its JVM,
    then moves the file into place, so a JVM starting meanwhile never maps half of one.
    """
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    target = archive_path(conf, folder)
    if target is None:
        raise ArchiveNotMadeError("no java on PATH or under JAVA_HOME")
    if target.is_file() and not force:
        return target
    folder.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    # A dynamic archive can't be made on top of another: any archive option of `conf` goes.
    options = [o for o in conf.get(DRIVER_OPTIONS, "").split() if "SharedArchiveFile" not in o]
    # Classes it can't archive (not linked yet, from signed jars) are skipped, each with a warning.
    options += [f"-XX:ArchiveClassesAtExit={partial}", "-Xlog:cds=error,cds+dynamic=error"]
    conf = {**conf, DRIVER_OPTIONS: " ".join(options)}
    builder = SparkSession.builder
    for name, value in conf.items():
        builder = builder.config(name, value)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the workload's Python workers
    started = time.monotonic()
    spark = builder.getOrCreate()
    worked = False
    try:
        with tempfile.TemporaryDirectory() as work:
            _workload(spark, Path(work))
        worked = True
    finally:
        spark.stop()
        gateway = SparkContext._gateway
        process = gateway.proc
        gateway.shutdown()
        process.stdin.close()  # the JVM exits on its standard input's end, writing the archive
        process.wait(timeout=600)
        if not worked:
            partial.unlink(missing_ok=True)  # an archive of a failed workload is never used
    if not partial.is_file():
        raise ArchiveNotMadeError(f"the JVM wrote no archive at {partial}")
    for old in folder.glob("spark-driver-*.jsa"):
        old.unlink()
    partial.rename(target)
    made = (
        f"{target.name} ({target.stat().st_size >> 20} MiB) in {time.monotonic() - started:.0f} s"
    )
    print(f"jvm_archive: made {made}")  # noqa: T201  (install's output)
    return target


def main(argv: list[str] | None = None) -> int:
    """scripts/install.sh's step: the archive of SparkResource's default session."""
    from resources.spark import SparkResource

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="make it again even if it exists")
    args = parser.parse_args(argv)
    resource = SparkResource()
    try:
        make(Path(resource.jvm_archive_dir), resource.spark_config(), force=args.force)
    except ArchiveNotMadeError as exc:
        sys.stderr.write(f"jvm_archive: {exc}\n")
        return 1
    return 0
