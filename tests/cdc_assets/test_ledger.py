"""The ledger read from Delta's log files (no Spark job) equals Spark's DESCRIBE HISTORY, on a
local folder and on S3, and never serves a cached commit of a table made again at its path."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest
from delta.tables import DeltaTable
from pyspark.sql import SparkSession

from cdc_assets.commits import commit_metadata, spark_hour_history
from cdc_assets.ledger import DeltaLog


def _run(n: int) -> dict:
    return {"hour": f"2026-11-02-0{n}:00", "slice": {"partitions": {"0": {"start": n, "end": n}}}}


def _write_commits(spark: SparkSession, path: str) -> None:
    """A pipeline MERGE, a ledger-only commit, a commit of no run, and a second MERGE."""
    spark.range(5).toDF("id").write.format("delta").save(path)
    table = DeltaTable.forPath(spark, path)
    quoted = path.replace("`", "``")
    with commit_metadata(spark, _run(1)):
        (
            table.alias("t")
            .merge(spark.range(3, 8).toDF("id").alias("s"), "t.id = s.id")
            .whenNotMatchedInsertAll()
            .execute()
        )
    with commit_metadata(spark, _run(2)):
        spark.sql(f"ALTER TABLE delta.`{quoted}` SET TBLPROPERTIES ('cdc.ledger' = 'x')")
    spark.sql(f"OPTIMIZE delta.`{quoted}`")
    with commit_metadata(spark, _run(3)):
        (
            table.alias("t")
            .merge(spark.range(7, 12).toDF("id").alias("s"), "t.id = s.id")
            .whenNotMatchedInsertAll()
            .execute()
        )


def _spark_commits(spark: SparkSession, path: str) -> dict[int, tuple]:
    rows = DeltaTable.forPath(spark, path).history().collect()
    return {r["version"]: (r["operation"], dict(r["operationMetrics"] or {})) for r in rows}


def _agrees_with_spark(spark: SparkSession, log: DeltaLog, path: str) -> None:
    assert log.hour_history() == spark_hour_history(spark, path)
    assert {c.version: (c.operation, c.metrics) for c in log.commits()} == _spark_commits(
        spark, path
    )
    merge = log.run_commit(_run(3), "MERGE")
    assert merge is not None and merge.version == log.latest_version()
    assert merge.metrics["numSourceRows"] == "5" and merge.metrics["numTargetRowsInserted"] == "4"
    assert log.run_commit(_run(2), "SET TBLPROPERTIES").version == 2
    assert log.run_commit(_run(9), "MERGE") is None
    # The size the MERGE's choice of deletion vectors reads: Delta's own, from its snapshot.
    size = DeltaTable.forPath(spark, path).detail().first()["sizeInBytes"]
    assert log.size_bytes() == size > 0


def test_the_ledger_equals_delta_history_and_a_remade_table_is_read_again(
    spark: SparkSession, tmp_path: Path
) -> None:
    path = str(tmp_path / "mirror")
    log = DeltaLog(path)
    assert log.hour_history() == (None, []) and not log.exists()
    _write_commits(spark, path)
    _agrees_with_spark(spark, log, path)

    # The table dropped and made again at the same path: its commits are new files.
    shutil.rmtree(path)
    spark.range(2).toDF("id").write.format("delta").save(path)
    with commit_metadata(spark, _run(5)):
        spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('cdc.ledger' = 'x')")
    fresh = DeltaLog(path)
    assert fresh.hour_history() == spark_hour_history(spark, path)
    # relist=False: the size as of this instance's last listing, a later commit not seen.
    listed = fresh.size_bytes(relist=False)
    spark.range(5).toDF("id").write.format("delta").mode("append").save(path)
    assert fresh.size_bytes(relist=False) == listed < fresh.size_bytes()
    # A version without its checksum file (a writer that writes none): the size is not known.
    version = fresh.latest_version()
    Path(path, "_delta_log", f"{version:020d}.crc").unlink()
    assert fresh.size_bytes() is None
    assert [c["hour"] for c in fresh.hour_history()[1]] == ["2026-11-02-05:00"]


@pytest.mark.usefixtures("spark")
def test_the_ledger_reads_a_table_on_s3(spark: SparkSession, s3) -> None:
    prefix = f"ledger{uuid.uuid4().hex[:8]}"
    lake = s3.reader(prefix, spark)
    path = lake.table_path("mirror")
    _write_commits(spark, path)
    _agrees_with_spark(spark, DeltaLog(path, s3_client=lake.s3_client()), path)
