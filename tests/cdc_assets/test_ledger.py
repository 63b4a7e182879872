"""The ledger read from Delta's log files (no Spark job) equals what Spark reports: DESCRIBE
HISTORY and the table's schema and properties, on a local folder and on S3; it never serves a
cached commit of a table made again at its path."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest
from delta.tables import DeltaTable
from pyspark.sql import SparkSession
from pyspark.sql.types import StructType

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
    _metadata_agrees(spark, log, path)


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


def _metadata_agrees(spark: SparkSession, log: DeltaLog, path: str) -> None:
    """The log's metadata is the table's as Spark reads it: its schema with the fields'
    metadata, and its properties as SHOW TBLPROPERTIES lists them."""
    table = log.table_metadata()
    assert table is not None and table.version == log.latest_version()
    assert StructType.fromJson(table.schema) == DeltaTable.forPath(spark, path).toDF().schema
    quoted = path.replace("`", "``")
    rows = spark.sql(f"SHOW TBLPROPERTIES delta.`{quoted}`").collect()
    assert table.properties() == {r["key"]: r["value"] for r in rows}
    assert table.properties().items() >= table.configuration.items()


def _commit_file(folder: Path, version: int, *actions: dict) -> None:
    lines = [{"commitInfo": {"operation": "WRITE"}}, *actions]
    text = "\n".join(json.dumps(a) for a in lines)
    (folder / f"{version:020d}.json").write_text(text + "\n")


def test_metadata_not_replayed_here_is_none(tmp_path: Path) -> None:
    """A v2 checkpoint, a gap in the commits, a catalog-managed table: None, for Spark to read;
    a multi-part checkpoint with a part missing is no checkpoint."""
    folder = tmp_path / "t" / "_delta_log"
    folder.mkdir(parents=True)
    schema = {"type": "struct", "fields": []}
    meta = {"id": "x", "schemaString": json.dumps(schema), "configuration": {"k": "v"}}
    protocol = {"minReaderVersion": 1, "minWriterVersion": 2}
    _commit_file(folder, 0, {"metaData": meta}, {"protocol": protocol})
    _commit_file(folder, 1)
    log = DeltaLog(str(tmp_path / "t"))
    table = log.table_metadata()
    assert (table.version, table.configuration, table.schema) == (1, {"k": "v"}, schema)
    assert table.properties() == {
        "k": "v",
        "delta.minReaderVersion": "1",
        "delta.minWriterVersion": "2",
    }

    # Part 2 of 2 missing: not a checkpoint, the commits are read.
    (folder / "00000000000000000001.checkpoint.0000000001.0000000002.parquet").write_text("")
    assert log.table_metadata() == table
    # A v2 checkpoint at version 1 and the commits before it cleaned up: not read here.
    (folder / f"00000000000000000001.checkpoint.{uuid.uuid4()}.json").write_text("{}")
    (folder / "00000000000000000000.json").unlink()
    assert log.table_metadata() is None
    # ... unless the commits after it hold what is needed.
    _commit_file(folder, 2, {"metaData": meta}, {"protocol": protocol})
    assert log.table_metadata().version == 2
    # A gap in the commits.
    _commit_file(folder, 4)
    assert log.table_metadata() is None
    # A catalog-managed table: its newest commits need not be in the folder.
    managed = {**protocol, "minReaderVersion": 3, "minWriterVersion": 7}
    managed |= {"readerFeatures": ["catalogManaged"], "writerFeatures": ["catalogManaged"]}
    _commit_file(folder, 3, {"protocol": managed})
    assert log.table_metadata() is None
