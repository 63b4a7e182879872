"""A table's error table: the records the mirror could not take, with their bytes and reason.

`<table>__errors` holds each bad record once, keyed by its Kafka coordinates (an insert-only
MERGE), so a rerun after a crash adds nothing twice; it is written before the mirror's commit.
A table with sensitive columns has its rows' key and value sealed (`cdc_assets.sealing`).
"""

from __future__ import annotations

from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets.columns import ERROR, KAFKA_OFFSET, KAFKA_PARTITION
from cdc_assets.commits import delta_log, retry_on_conflict, stored_table
from cdc_assets.config import TableSpec
from cdc_assets.sealing import check_error_table, error_table_schema

ERROR_TABLE_SCHEMA = T.StructType(
    [
        T.StructField("topic", T.StringType(), False),
        T.StructField("partition", T.IntegerType(), False),
        T.StructField("offset", T.LongType(), False),
        T.StructField("kafka_timestamp", T.TimestampType(), True),
        T.StructField("key", T.BinaryType(), True),
        T.StructField("value", T.BinaryType(), True),
        T.StructField("reason", T.StringType(), False),
        T.StructField("hour", T.StringType(), False),
        T.StructField("ingested_at", T.TimestampType(), False),
    ]
)


def write_errors(
    spark: SparkSession,
    spec: TableSpec,
    path: str,
    errors: DataFrame,
    *,
    hour_key: str,
    ingested_at,
    s3_client=None,
) -> None:
    """Adds bad records to `spec`'s error table once each, keyed by their Kafka coordinates:
    one MERGE (the table is created first when its log shows none; `s3_client` reads an S3
    lake's log).

    A table with sensitive columns has its `key` and `value` sealed (`cdc_assets.sealing`);
    rows are never added to an error table sealed otherwise (`check_error_table`)."""
    sealed = bool(spec.sensitive)
    retry_on_conflict(
        lambda: _write_errors_once(
            spark,
            spec,
            path,
            errors,
            hour_key=hour_key,
            ingested_at=ingested_at,
            sealed=sealed,
            s3_client=s3_client,
        ),
        table=spec.error_table_name,
        path=path,
    )


def _write_errors_once(
    spark: SparkSession,
    spec: TableSpec,
    path: str,
    errors: DataFrame,
    *,
    hour_key: str,
    ingested_at,
    sealed: bool,
    s3_client,
) -> None:
    rows = errors.select(
        F.col("topic"),
        F.col(KAFKA_PARTITION).alias("partition"),
        F.col(KAFKA_OFFSET).alias("offset"),
        F.col("_cdc_kafka_timestamp").alias("kafka_timestamp"),
        F.col("key"),
        F.col("value"),
        F.col(ERROR).alias("reason"),
        F.lit(hour_key).alias("hour"),
        F.lit(ingested_at).cast("timestamp").alias("ingested_at"),
    )
    schema = error_table_schema(ERROR_TABLE_SCHEMA, sealed=sealed)
    stored = stored_table(spark, path, delta_log(path, s3_client)).schema
    if stored is None:
        DeltaTable.createIfNotExists(spark).location(path).addColumns(schema).execute()
    check_error_table(stored or schema, table=spec.name, path=path, sealed=sealed)
    (
        DeltaTable.forPath(spark, path)
        .alias("t")
        .merge(
            rows.alias("s"),
            "t.topic = s.topic AND t.partition = s.partition AND t.offset = s.offset",
        )
        .whenNotMatchedInsertAll()
        .execute()
    )
