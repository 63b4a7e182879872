"""The ledger read from Delta's log files (no Spark job) equals what Spark reports: DESCRIBE
HISTORY, the table's schema and properties (through checkpoints and log cleanup) and one commit's
change data feed, on a local folder and on S3; it never serves a cached commit of a table made
again at its path."""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest
from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import StructType

from cdc_assets.commits import change_feed, commit_metadata, spark_hour_history
from cdc_assets.ledger import DeltaLog, _file_location
from cdc_assets.merge import MERGE_PERSISTENT_DVS
from resources.spark import session_settings


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
    assert log.change_rows(1, ["id"]) is None  # no change data feed on this table


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


FEED, DELETION_VECTORS = "delta.enableChangeDataFeed", "delta.enableDeletionVectors"


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


def _merge(
    spark: SparkSession, path: str, source: DataFrame, *, delete: str | None, evolve: bool = False
) -> None:
    """A MERGE of `source` by id: matched rows deleted where `delete` holds, else updated from
    the source; new ids inserted."""
    merge = DeltaTable.forPath(spark, path).alias("t").merge(source.alias("s"), "t.id = s.id")
    if evolve:
        merge = merge.withSchemaEvolution()
    if delete is not None:
        merge = merge.whenMatchedDelete(delete).whenMatchedUpdateAll()
    merge.whenNotMatchedInsertAll().execute()


def _changes_agree(
    spark: SparkSession, log: DeltaLog, path: str, version: int, columns: Sequence[str]
) -> int:
    """The commit's change rows read from its files are Spark's change data feed of the commit;
    returns how many."""
    mine = log.change_rows(version, columns)
    theirs = change_feed(spark, path, version).select(*columns, "_change_type").toArrow()
    assert mine is not None and mine.column_names == theirs.column_names
    order = [(name, "ascending") for name in mine.column_names]
    assert mine.sort_by(order).to_pylist() == theirs.sort_by(order).to_pylist()
    return mine.num_rows


def _copied_to_s3(s3, path: str) -> DeltaLog:
    """The log of a copy of the local table at `path` on the S3 fixture (no Spark)."""
    lake = s3.lake(f"ledger{uuid.uuid4().hex[:8]}", resolved=True)
    client, root = lake.s3_client(), lake.table_path("mirror")
    bucket, prefix = root.split("://", 1)[1].split("/", 1)
    for file in Path(path).rglob("*"):
        if file.is_file() and not file.name.startswith("."):
            key = f"{prefix}/{file.relative_to(path).as_posix()}"
            client.upload_file(str(file), bucket, key)
    return DeltaLog(root, s3_client=client)


@pytest.mark.integration
def test_metadata_and_change_rows_equal_sparks_through_checkpoints_and_cleanup(
    spark: SparkSession, s3, tmp_path: Path
) -> None:
    """A table with the change data feed and deletion vectors, checkpointed every 2 commits: the
    metadata read from commits, from checkpoints (classic and multi-part) and from a checkpoint
    alone once older commits are cleaned up; each commit's change rows; the same from S3."""
    path = str(tmp_path / "mirror")
    quoted = path.replace("`", "``")
    columns = ["id", "name", "at", "extra"]
    log = DeltaLog(path)
    assert log.table_metadata() is None and log.change_rows(0, ["id"]) is None
    spark.sql(
        f"CREATE TABLE delta.`{quoted}` (id BIGINT NOT NULL COMMENT 'the key', name STRING, "
        f"at TIMESTAMP) USING delta TBLPROPERTIES ('{FEED}' = 'true', "
        f"'{DELETION_VECTORS}' = 'true', 'delta.checkpointInterval' = '2')"
    )
    _metadata_agrees(spark, log, path)  # version 0, from its commit

    # One file of 20 rows, its change rows the file's rows (an insert writes no change files).
    spark.sql(
        f"INSERT INTO delta.`{quoted}` SELECT id, concat('n', id), "
        "timestamp'2026-11-02 01:00:00' + make_interval(0, 0, 0, 0, 0, id) FROM range(0, 20, 1, 1)"
    )
    assert _changes_agree(spark, log, path, 1, columns[:3]) == 20

    # A MERGE that updates, deletes and inserts, and adds a column: change files, and deletion
    # vectors on the file it touched; the metadata from the checkpoint at version 2 alone.
    source = spark.sql(
        "SELECT id, concat('m', id) AS name, timestamp'2026-11-02 02:00:00' AS at, "
        "id * 10 AS extra FROM range(15, 25)"
    )
    # Delta's default: a MERGE writes deletion vectors (a run sets its own per MERGE and keeps
    # it on the session, `merge.persistent_deletion_vectors`).
    with session_settings(spark, {MERGE_PERSISTENT_DVS: "true"}):
        _merge(spark, path, source, delete="s.id % 3 = 0", evolve=True)
    merged = log.commit(2)
    assert merged.cdc_files and any(f.deletion_vector for f in merged.added_files)
    assert [f["name"] for f in log.table_metadata().schema["fields"]] == columns
    _metadata_agrees(spark, log, path)
    # 3 updated (pre and post images), 2 deleted, 5 inserted.
    assert _changes_agree(spark, log, path, 2, columns) == 3 * 2 + 2 + 5

    # New properties: metaData from the commit, the protocol from the checkpoint before it.
    spark.sql(f"ALTER TABLE delta.`{quoted}` SET TBLPROPERTIES ('cdc.history.tracking' = 'on')")
    assert log.commit(3).metadata_action and not log.commit(3).protocol_action
    _metadata_agrees(spark, log, path)
    assert _changes_agree(spark, log, path, 3, columns) == 0

    # An insert-only MERGE writes no change files: its rows are its added files'. Its
    # checkpoint (version 4) is written in parts.
    spark.conf.set("spark.databricks.delta.checkpoint.partSize", "2")
    try:
        _merge(spark, path, source.selectExpr("id + 100 AS id", "name", "at", "extra"), delete=None)
    finally:
        spark.conf.unset("spark.databricks.delta.checkpoint.partSize")
    assert not log.commit(4).cdc_files and log.commit(4).metadata_action is None
    assert _changes_agree(spark, log, path, 4, columns) == 10
    folder = Path(path, "_delta_log")
    assert len(list(folder.glob("00000000000000000004.checkpoint.*.*.parquet"))) > 1

    # The same files on S3 read the same, through the S3 client.
    on_s3 = _copied_to_s3(s3, path)
    assert on_s3.table_metadata() == log.table_metadata()
    for version in range(5):
        assert on_s3.change_rows(version, columns).equals(log.change_rows(version, columns))

    # Log cleanup: the commits before the checkpoint gone, the newest metaData (version 3) is
    # only in the checkpoint, read by a process that never saw the commits.
    for old in folder.glob("0000000000000000000[0-3].*"):
        old.unlink()
    cleaned = DeltaLog(path)
    assert cleaned.versions() == [4]
    _metadata_agrees(spark, cleaned, path)
    assert cleaned.table_metadata().configuration["cdc.history.tracking"] == "on"
    assert _changes_agree(spark, cleaned, path, 4, columns) == 10

    # The feed turned off: that commit's change rows are not recorded, for Spark either.
    spark.sql(f"ALTER TABLE delta.`{quoted}` SET TBLPROPERTIES ('{FEED}' = 'false')")
    _metadata_agrees(spark, cleaned, path)
    assert cleaned.change_rows(5, columns) is None
    with pytest.raises(Exception, match="DELTA_MISSING_CHANGE_DATA"):
        change_feed(spark, path, 5).collect()
    with pytest.raises(ValueError, match="no column"):
        cleaned.change_rows(4, ["id", "nope"])


@pytest.mark.integration
def test_change_rows_of_a_partitioned_table_without_deletion_vectors(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A MERGE into a partitioned table without deletion vectors: its change files sit in
    partition folders whose names the log URL-encodes; a partition column is not read here."""
    path = str(tmp_path / "mirror")
    quoted = path.replace("`", "``")
    spark.sql(
        f"CREATE TABLE delta.`{quoted}` (id BIGINT, name STRING, part STRING) USING delta "
        f"PARTITIONED BY (part) TBLPROPERTIES ('{FEED}' = 'true', '{DELETION_VECTORS}' = 'false')"
    )
    spark.sql(
        f"INSERT INTO delta.`{quoted}` SELECT id, concat('n', id), "
        "if(id % 2 = 0, 'a:b %', 'c d') FROM range(10)"
    )
    log = DeltaLog(path)
    assert _changes_agree(spark, log, path, 1, ["id", "name"]) == 10
    source = spark.sql(
        "SELECT id, concat('m', id) AS name, if(id % 2 = 0, 'a:b %', 'c d') AS part "
        "FROM range(6, 14)"
    )
    _merge(spark, path, source, delete="s.id = 7")
    assert any("%25" in f.path for f in log.commit(2).cdc_files)
    assert _changes_agree(spark, log, path, 2, ["id", "name"]) == 3 * 2 + 1 + 4
    assert log.change_rows(2, ["id", "part"]) is None
    assert log.table_metadata().partition_columns == ("part",)
    _metadata_agrees(spark, log, path)


@pytest.mark.integration
def test_a_v2_checkpoint_is_left_to_spark(spark: SparkSession, tmp_path: Path) -> None:
    """Delta's v2 checkpoints (UUID-named, with sidecars) are not read here: once the metadata is
    only behind one, the ledger says None and the caller asks Spark."""
    path = str(tmp_path / "mirror")
    quoted = path.replace("`", "``")
    spark.sql(
        f"CREATE TABLE delta.`{quoted}` (id BIGINT) USING delta TBLPROPERTIES "
        "('delta.checkpointPolicy' = 'v2', 'delta.checkpointInterval' = '2')"
    )
    spark.sql(f"INSERT INTO delta.`{quoted}` VALUES (1)")
    log = DeltaLog(path)
    _metadata_agrees(spark, log, path)
    spark.sql(f"INSERT INTO delta.`{quoted}` VALUES (2)")
    assert list(Path(path, "_delta_log").glob("00000000000000000002.checkpoint.*-*.json"))
    assert log.table_metadata() is None and log.exists()


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


def test_file_paths_in_the_log_are_uris() -> None:
    assert _file_location("/lake/t", "p=a%253Ab/part-0.parquet") == (
        None,
        "/lake/t/p=a%3Ab/part-0.parquet",
    )
    assert _file_location("/lake/t", "file:/other/x%20y.parquet") == (None, "/other/x y.parquet")
    assert _file_location("s3a://bucket/lake/t", "c%20d/f.parquet") == (
        "bucket",
        "lake/t/c d/f.parquet",
    )
    assert _file_location("s3a://bucket/t", "s3://b2/k/f.parquet") == ("b2", "k/f.parquet")
    assert _file_location("s3a://bucket/t", "file:/x.parquet") is None
    assert _file_location("/lake/t", "abfss://c@a.dfs.core.windows.net/f.parquet") is None
