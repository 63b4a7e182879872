"""The benchmark's starting tables and result checks, each a Spark process of its own.

`python -m benchmarks.tables build JOB.json`: builds the starting table of N rows directly with
Spark (ids 2, 4, ..., 2N, sorted into files of narrow id ranges, as an OPTIMIZE ZORDER BY id
leaves a mirror), three times: plain (for floor/naive/delta-rs), as the project's mirror (its
`_cdc_*` columns and table properties, from the project's own schema functions), and as that
mirror's history (`history: true`: each row one current version, for ours-history).

`python -m benchmarks.tables check JOB.json`: compares each variant's result with the
reference: the starting rows, minus the keys the events changed, plus those keys' newest state
as `benchmarks/workload.py` replayed it in plain Python (a Parquet file the parent wrote). It
compares the row count and an order-free checksum of every row (sum of xxhash64), and the
changed keys row for row.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from benchmarks.workload import COLUMNS, PRIMARY_KEY, START_COLUMNS, TABLE
from cdc_assets.columns import (
    DELETED,
    HOUR,
    INGESTED_AT,
    KAFKA_OFFSET,
    KAFKA_PARTITION,
    OP,
    SEQUENCE,
    SOURCE_TS,
)
from cdc_assets.commits import MIRROR_NEWEST, commit_metadata
from cdc_assets.config import TableSpec
from cdc_assets.decoding.spark import decode
from cdc_assets.merge import ensure_mirror_table
from cdc_assets.read import KAFKA_SCHEMA
from cdc_assets.rule import mirror_columns
from resources.spark import SparkResource

ROWS_PER_FILE = 250_000
# The source time of every starting row: older than every event's.
START_SOURCE_TS = datetime(2025, 1, 1, tzinfo=UTC)


def bench_spec(start_hour: str) -> TableSpec:
    return TableSpec.model_validate(
        {
            "name": TABLE,
            "topic": f"bench.{TABLE}",
            "primary_key": [PRIMARY_KEY],
            "columns": COLUMNS,
            # The events carry decimals as text (the connector's decimal.handling.mode=string).
            "decimal_handling": "string",
            "start_hour": start_hour,
        }
    )


def session() -> SparkSession:
    return SparkResource(
        driver_memory="4g",
        extra_conf={"spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS"},
    ).session


def start_rows(spark: SparkSession, rows: int) -> DataFrame:
    ids = spark.range(1, rows + 1, numPartitions=max(1, rows // ROWS_PER_FILE)).select(
        (F.col("id") * 2).alias(PRIMARY_KEY)
    )
    typed = [F.expr(START_COLUMNS[c]).cast(t).alias(c) for c, t in COLUMNS.items() if c != "id"]
    return ids.select(F.col(PRIMARY_KEY), *typed).sortWithinPartitions(PRIMARY_KEY)


def build(job: dict) -> None:
    spark = session()
    rows = job["rows"]
    plain = start_rows(spark, rows)
    plain.write.format("delta").save(job["plain"])
    spec = bench_spec(job["start_hour"])
    # The mirror's columns in the project's own order and types (as `decode` makes them); a
    # starting row is a live row whose sequence (its id) is older than every event's.
    empty = spark.createDataFrame([], KAFKA_SCHEMA)
    types = {f.name: f.dataType for f in decode(empty, spec, hour_key=job["start_hour"]).schema}
    metadata = {
        OP: F.lit("r"),
        SEQUENCE: F.struct(F.col(PRIMARY_KEY), F.lit(0), F.lit(-1)).cast(types[SEQUENCE]),
        SOURCE_TS: F.lit(START_SOURCE_TS).cast("timestamp"),
        KAFKA_PARTITION: F.lit(0),
        KAFKA_OFFSET: F.lit(-1).cast("bigint"),
        HOUR: F.lit("snapshot"),
        INGESTED_AT: F.lit(datetime(2025, 1, 1, tzinfo=UTC)).cast("timestamp"),
        DELETED: F.lit(False),
    }
    mirror = spark.read.format("delta").load(job["plain"])
    mirror = mirror.select(
        *[
            metadata[c].cast(types.get(c, "timestamp")).alias(c) if c in metadata else F.col(c)
            for c in mirror_columns(spec)
        ]
    )
    ensure_mirror_table(spark, job["mirror"], mirror.limit(0), spec)
    files = max(1, rows // ROWS_PER_FILE)  # the same files as the plain table's
    mirror = mirror.repartitionByRange(files, PRIMARY_KEY).sortWithinPartitions(PRIMARY_KEY)
    # As a run leaves a mirror: its commit records the newest source time the mirror holds,
    # which the next run reads instead of scanning the table for it. The slice is no hour's
    # and names no partition, so it takes no part in slicing the benchmark's hours.
    record = {
        "hour": "start",
        "slice": {"topic": "bench.start", "partitions": {}, "closed": True},
        "pipeline": "cdc-lake",
        MIRROR_NEWEST: int(START_SOURCE_TS.timestamp() * 1000),
    }
    with commit_metadata(spark, record):
        mirror.write.format("delta").mode("append").save(job["mirror"])
    if job.get("history"):
        _build_history(spark, spec, job["mirror"], job["history"])
    spark.stop()


def _build_history(spark: SparkSession, spec: TableSpec, mirror: str, path: str) -> None:
    """The starting mirror's history: each row its key's one version, current, open-ended."""
    from pyspark.sql import types as T

    from cdc_assets.history import (
        CURRENT,
        END_SEQUENCE,
        VALID_FROM,
        VALID_TO,
        create_history_table,
        version_columns,
    )

    rows = spark.read.format("delta").load(mirror)
    sequence = rows.schema[SEQUENCE].dataType
    extra = {
        END_SEQUENCE: F.lit(None).cast(sequence),
        VALID_FROM: F.col(SOURCE_TS),
        VALID_TO: F.lit(None).cast(T.TimestampType()),
        CURRENT: F.lit(True),
    }
    columns = version_columns(spec, list(COLUMNS))
    versions = rows.select(*[extra[c].alias(c) if c in extra else F.col(c) for c in columns])
    create_history_table(spark, path, versions.schema, spec)
    versions.write.format("delta").mode("append").save(path)


def _checksum(frame: DataFrame) -> tuple[int, int]:
    row = frame.select(F.xxhash64(*[F.col(c) for c in COLUMNS]).cast("decimal(38,0)").alias("h"))
    totals = row.agg(F.count("*").alias("n"), F.sum("h").alias("h")).first()
    return int(totals["n"]), int(totals["h"] or 0)


def check(job: dict) -> None:
    spark = session()
    reference = spark.read.parquet(job["reference"])  # key → newest row, `deleted` flag
    changed = reference.select(PRIMARY_KEY)
    live = reference.where(~F.col("deleted")).select(*COLUMNS)
    start = spark.read.format("delta").load(job["plain"])
    expected = start.join(F.broadcast(changed), PRIMARY_KEY, "left_anti").unionByName(live)
    want = _checksum(expected)
    verdicts = {}
    for variant, (kind, path) in job["tables"].items():
        if kind == "parquet":  # the floor: every event appended, nothing merged
            rows = spark.read.parquet(path).count()
            ok = rows == job["events"]
            verdicts[variant] = {"ok": ok, "detail": f"{rows} rows appended of {job['events']}"}
            continue
        table = spark.read.format("delta").load(path)
        if kind == "mirror":
            table = table.where(~F.col(DELETED))
        table = table.select(*COLUMNS)
        got = _checksum(table)
        touched = table.join(F.broadcast(changed), PRIMARY_KEY, "left_semi")
        wrong = touched.exceptAll(live).count() + live.exceptAll(touched).count()
        ok = got == want and wrong == 0
        detail = f"rows {got[0]} (reference {want[0]}), changed keys differing: {wrong}"
        if got[1] != want[1]:
            detail += ", checksum differs"
        verdicts[variant] = {"ok": ok, "detail": detail}
    Path(job["result"]).write_text(json.dumps(verdicts))
    spark.stop()


if __name__ == "__main__":
    command, path = sys.argv[1], sys.argv[2]
    {"build": build, "check": check}[command](json.loads(Path(path).read_text()))
