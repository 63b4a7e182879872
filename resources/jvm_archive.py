"""A class-data archive for the Spark driver's JVM: its classes mapped at start, not loaded.

Every process that starts a Spark session loads and verifies the same tens of thousands of JVM
classes before its first job; the JDK's application class-data sharing (AppCDS) keeps them,
parsed and verified, in an archive the JVM maps at start. `scripts/install.sh` makes it (`main`,
into `.jars/jvm-archive/`; delete that folder to have it made again), and `SparkResource` starts
the driver on it when the archive of its java and class path exists (`jvm_archive_dir: None`
turns it off). Without a usable archive the JVM starts as it would without one: nothing depends
on the archive but the time.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pyspark

# Spark's launcher puts these before spark.driver.extraJavaOptions on the driver's command line:
# the archive goes here, so a host's extraJavaOptions (spark-defaults.conf) and a user's stay.
DRIVER_OPTIONS = "spark.driver.defaultJavaOptions"
USER_OPTIONS = (DRIVER_OPTIONS, "spark.driver.extraJavaOptions")
# Options that choose their own class sharing: the driver then gets no archive from here.
_OWN_SHARING = re.compile(r"SharedArchiveFile|ArchiveClassesAtExit|-Xshare:off")
# What decides which classes the JVM loads from where, besides the java binary and pyspark's.
_CLASS_PATH_CONF = ("spark.jars", "spark.driver.extraClassPath")
_CLASS_PATH_ENV = (
    "SPARK_HOME",
    "SPARK_CONF_DIR",
    "SPARK_CLASSPATH",
    "SPARK_DIST_CLASSPATH",
    "HADOOP_CONF_DIR",
    "YARN_CONF_DIR",
)
_HEAP = re.compile(r"(\d+)([kmgt]?)b?", re.IGNORECASE)
# Options that turn compressed object pointers off (ZGC has none); "-XX:-UseZGC" is not one.
_NO_COMPRESSED_OOPS = re.compile(r"-XX:\+UseZGC|-XX:-UseCompressedOops")


def java_binary() -> Path | None:
    """The java that pyspark's launcher (spark-submit, bin/spark-class) runs: JAVA_HOME's if
    set, else PATH's (devtools.processes.java, for the local servers, falls back to PATH)."""
    home = os.environ.get("JAVA_HOME")
    found = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    return Path(found).resolve() if found and Path(found).exists() else None


def _entries(class_path: str) -> list[str]:
    """A class path's jars, `dir/*` expanded, each with its size and time: the JVM refuses an
    archive whose jars differ in either from the ones it was made with."""
    out = []
    for entry in filter(None, class_path.replace(os.pathsep, ",").split(",")):
        paths = sorted(Path(entry[:-1]).glob("*.jar")) if entry.endswith("*") else [Path(entry)]
        for path in paths:
            stat = path.stat() if path.exists() else None
            out.append(f"{path}:{stat.st_size}:{stat.st_mtime_ns}" if stat else f"{path}:-")
    return out


def _compressed_oops(conf: Mapping[str, str]) -> bool:
    """Whether the driver JVM uses compressed object pointers (a heap under 32 GiB, no ZGC):
    the JDK keeps a base archive for each case, and a dynamic archive belongs to one."""
    if any(_NO_COMPRESSED_OOPS.search(conf.get(name, "")) for name in USER_OPTIONS):
        return False
    heap = _HEAP.fullmatch(conf.get("spark.driver.memory", "1g").strip())
    if heap is None:
        return True
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    return int(heap.group(1)) * scale[heap.group(2).lower() or "m"] < 32 << 30  # default: MiB


def archive_path(conf: Mapping[str, str], folder: Path) -> Path | None:
    """Where the archive of a session with Spark conf `conf` is (or goes); None without java.

    The name is a digest of what the JVM checks before it uses an archive: the java binary,
    pyspark's jars, the jars the session puts on the class path (each with its size and time),
    the environment variables that add to the class path, and whether the heap gets compressed
    pointers. Change any of them and no archive is found until `scripts/install.sh` makes one.
    """
    java = java_binary()
    if java is None:
        return None
    stat = java.stat()
    spark_home = Path(os.environ.get("SPARK_HOME") or Path(pyspark.__file__).parent)
    parts = [
        f"{java}:{stat.st_size}:{stat.st_mtime_ns}",
        f"pyspark {pyspark.__version__}",
        *_entries(f"{spark_home / 'jars'}/*"),
        *(f"{name}={os.environ.get(name, '')}" for name in _CLASS_PATH_ENV),
        f"compressed oops: {_compressed_oops(conf)}",
    ]
    for name in _CLASS_PATH_CONF:
        parts += [name, *_entries(conf.get(name, ""))]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return folder / f"spark-driver-{digest}.jsa"


def with_archive(conf: dict[str, str], folder: Path | None) -> dict[str, str]:
    """`conf` with the driver started on its archive when it exists: unless `folder` is None
    (off) or the conf's own JVM options choose their class sharing. Other options are kept."""
    if folder is None or any(_OWN_SHARING.search(conf.get(n, "")) for n in USER_OPTIONS):
        return conf
    path = archive_path(conf, folder)
    if path is None or not path.is_file():
        return conf
    option = f"-XX:SharedArchiveFile={shlex.quote(str(path))}"  # Spark splits on whitespace
    return {**conf, DRIVER_OPTIONS: f"{conf.get(DRIVER_OPTIONS, '')} {option}".strip()}


def _workload(spark, work: Path) -> None:
    """The code paths an hour's run takes, on a few rows (their classes get archived): Delta
    writes, a MERGE with deletion vectors, Arrow to Python and back, reads with filters,
    aggregations, the Kafka source's relation."""
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
    # The Kafka source's relation (no broker is asked: nothing is read).
    kafka = spark.read.format("kafka").option("kafka.bootstrap.servers", "127.0.0.1:9")
    kafka.option("subscribe", "none").load()


class ArchiveNotMadeError(RuntimeError):
    """No archive came out (no java found, a session already running, or the JVM wrote none)."""


def make(folder: Path, conf: dict[str, str]) -> Path:
    """Makes the archive of sessions started with `conf` in `folder`, unless it is there.

    The JVM writes the archive when it exits: this stops the session and waits for its JVM,
    then moves the file into place, so a JVM starting meanwhile never maps half of one. Two
    installs at once take turns (a lock in `folder`); the second finds the first's archive.
    Archives of other javas and class paths in `folder` are removed (each is about 200 MB).
    """
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    target = archive_path(conf, folder)
    if target is None:
        raise ArchiveNotMadeError("no java on PATH or under JAVA_HOME")
    # Only a JVM started with the archive's option writes it. pyspark starts one JVM per
    # process and keeps it after sessions stop; only its private gateway says whether it did.
    if SparkContext._gateway is not None:  # noqa: SLF001
        raise ArchiveNotMadeError("a Spark session already runs in this process")
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        partial = target.with_suffix(f".{os.getpid()}.partial")
        # Classes it can't archive (not linked yet, from signed jars) are skipped, each with a
        # warning: those are kept out of install's output.
        options = [
            *shlex.split(conf.get(DRIVER_OPTIONS, "")),
            f"-XX:ArchiveClassesAtExit={partial}",
            "-Xlog:cds=error,cds+dynamic=error",
        ]
        builder = SparkSession.builder
        for name, value in {**conf, DRIVER_OPTIONS: shlex.join(options)}.items():
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
            _stop_jvm(spark)
            if not worked:
                partial.unlink(missing_ok=True)  # an archive of a failed workload is never used
        if not partial.is_file():
            raise ArchiveNotMadeError(f"the JVM wrote no archive at {partial}")
        for old in folder.glob("spark-driver-*.jsa"):
            old.unlink()
        partial.rename(target)
    took = time.monotonic() - started
    print(f"jvm_archive: made {target.name} ({target.stat().st_size >> 20} MiB) in {took:.0f} s")  # noqa: T201
    return target


def _stop_jvm(spark) -> None:
    """Stops the session and its JVM, which writes the archive as it exits."""
    from pyspark import SparkContext

    # pyspark has no public way to stop its JVM (spark.stop() leaves it running for the next
    # session): this shuts down the gateway pyspark keeps, and makes pyspark forget it.
    gateway = SparkContext._gateway  # noqa: SLF001
    process = gateway.proc
    try:
        spark.stop()
        gateway.shutdown()
    finally:
        SparkContext._gateway = SparkContext._jvm = None  # noqa: SLF001
        process.stdin.close()  # the JVM exits on its standard input's end
        try:
            process.wait(timeout=600)
        except subprocess.TimeoutExpired:
            process.kill()
            raise


INSTALL_LOG = Path(".local/install/jvm-archive.log")


def main() -> int:
    """scripts/install.sh's step: the archive of SparkResource's default session. Says what it
    does and how long it took; the session's own output (Spark's warnings) goes to
    `INSTALL_LOG`, not to install's."""
    from resources.spark import SparkResource

    resource = SparkResource()
    conf, folder = resource.spark_config(), Path(resource.jvm_archive_dir)
    target = archive_path(conf, folder)
    if target is not None and target.is_file():
        return 0
    INSTALL_LOG.parent.mkdir(parents=True, exist_ok=True)
    print(  # noqa: T201
        "install: the Spark driver's class-data archive (about a minute; Spark's output in "
        f"{INSTALL_LOG})",
        flush=True,
    )
    started = time.monotonic()
    try:
        with _output_to(INSTALL_LOG):
            made = make(folder, conf)
    except ArchiveNotMadeError as exc:
        sys.stderr.write(f"jvm_archive: {exc} (Spark's output: {INSTALL_LOG})\n")
        return 1
    size = made.stat().st_size / 2**20
    print(f"install:   {made.name} ({size:.0f} MiB) in {time.monotonic() - started:.0f} s")  # noqa: T201
    return 0


@contextlib.contextmanager
def _output_to(log: Path) -> Iterator[None]:
    """Sends this process's stdout and stderr, and so its children's (the JVM's), to `log`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with log.open("ab") as file:
        os.dup2(file.fileno(), 1)
        os.dup2(file.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, old in zip((1, 2), saved, strict=True):
                os.dup2(old, fd)
                os.close(old)
