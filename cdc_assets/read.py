"""Reads exactly one hour's slice from Kafka as a Spark batch."""

from __future__ import annotations

import json

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T

from cdc_assets.slicing import HourSlice

KAFKA_SCHEMA = T.StructType(
    [
        T.StructField("key", T.BinaryType()),
        T.StructField("value", T.BinaryType()),
        T.StructField("topic", T.StringType()),
        T.StructField("partition", T.IntegerType()),
        T.StructField("offset", T.LongType()),
        T.StructField("timestamp", T.TimestampType()),
        T.StructField("timestampType", T.IntegerType()),
        T.StructField(
            "headers",
            T.ArrayType(
                T.StructType(
                    [T.StructField("key", T.StringType()), T.StructField("value", T.BinaryType())]
                )
            ),
        ),
    ]
)


def read_slice(
    spark: SparkSession,
    kafka_options: dict[str, str],
    hour_slice: HourSlice,
    *,
    max_records_per_task: int = 200_000,
) -> DataFrame:
    """The records of `hour_slice`, read committed, failing if any offset in it is gone.

    Large partition ranges are split across tasks by Spark's own `maxRecordsPerPartition`.
    """
    parts = [p for p in hour_slice.partitions if p.size > 0]
    if not parts:
        return spark.createDataFrame([], KAFKA_SCHEMA)
    topic = hour_slice.topic
    return (
        spark.read.format("kafka")
        .options(**kafka_options)
        .option("assign", json.dumps({topic: [p.partition for p in parts]}))
        .option("startingOffsets", json.dumps({topic: {str(p.partition): p.start for p in parts}}))
        .option("endingOffsets", json.dumps({topic: {str(p.partition): p.end for p in parts}}))
        .option("failOnDataLoss", "true")
        # Debezium names a moved row's old key in a header (__debezium.oldkey).
        .option("includeHeaders", "true")
        .option("maxRecordsPerPartition", str(max_records_per_task))
        .load()
    )
