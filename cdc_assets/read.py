"""Reads exactly one hour's slice from Kafka: as a Spark batch, or, for a small slice, in the
driver (no Spark job: an hour of a few hundred changes costs milliseconds to read)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import pyarrow as pa
from kafka import KafkaConsumer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T

from cdc_assets.slicing import HourSlice, PartitionSlice

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
    max_records_per_task: int = 100_000,
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


class SliceReadError(RuntimeError):
    """A slice could not be read whole from Kafka."""


_HEADERS = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
_LOCAL_COLUMNS = ("key", "value", "partition", "offset", "timestamp", "headers")


def read_slice_locally(
    consumer: KafkaConsumer, hour_slice: HourSlice, *, timeout_s: float = 120
) -> pa.RecordBatch:
    """The records of a small `hour_slice`, read committed by `consumer` in this process: the
    same columns `read_slice` gives Spark, without a Spark job.

    Offsets a committed read skips (transaction markers, aborted records) are simply absent, as
    in Spark's read. Offsets retention deleted while the slice was read fail it, as Spark's
    `failOnDataLoss` does.
    """
    parts = {
        TopicPartition(hour_slice.topic, p.partition): p
        for p in hour_slice.partitions
        if p.size > 0
    }
    if not parts:
        return _record_batch(hour_slice.topic, {name: [] for name in _LOCAL_COLUMNS})
    consumer.assign(list(parts))
    for tp, part in parts.items():
        consumer.seek(tp, part.start)
    columns = _poll_slice(consumer, hour_slice.topic, parts, timeout_s=timeout_s)
    _fail_on_deleted_offsets(consumer, hour_slice.topic, parts)
    return _record_batch(hour_slice.topic, columns)


def _poll_slice(
    consumer: KafkaConsumer,
    topic: str,
    parts: dict[TopicPartition, PartitionSlice],
    *,
    timeout_s: float,
) -> dict[str, list]:
    """Each partition's records below its slice's end, a list per column (`_LOCAL_COLUMNS`),
    pausing the partitions that reached it; fails when they take longer than `timeout_s`."""
    columns: dict[str, list] = {name: [] for name in _LOCAL_COLUMNS}
    remaining = set(parts)
    deadline = time.monotonic() + timeout_s
    while remaining:
        for tp, records in consumer.poll(timeout_ms=500).items():
            end = parts[tp].end
            for r in records:
                if r.offset >= end:
                    break
                _append_record(columns, r)
        for tp in list(remaining):
            if consumer.position(tp) >= parts[tp].end:
                remaining.discard(tp)
                consumer.pause(tp)
        if remaining and time.monotonic() > deadline:
            late = ", ".join(f"{tp.partition}" for tp in sorted(remaining))
            raise SliceReadError(
                f"topic '{topic}': partitions {late} did not deliver their "
                f"slice within {timeout_s:g} s; check the brokers and run the hour again"
            )
    return columns


def _append_record(columns: dict[str, list], r: ConsumerRecord) -> None:
    """One record's values, appended a column each (the topic is the slice's)."""
    columns["key"].append(r.key)
    columns["value"].append(r.value)
    columns["partition"].append(r.partition)
    columns["offset"].append(r.offset)
    columns["timestamp"].append(r.timestamp)
    columns["headers"].append([{"key": k, "value": v} for k, v in r.headers] if r.headers else None)


def _fail_on_deleted_offsets(
    consumer: KafkaConsumer, topic: str, parts: dict[TopicPartition, PartitionSlice]
) -> None:
    """Fails when retention deleted offsets of the slice while it was read."""
    starts = consumer.beginning_offsets(list(parts))
    lost = [(tp.partition, p.start, starts[tp]) for tp, p in parts.items() if starts[tp] > p.start]
    if lost:
        described = "; ".join(f"partition {p}: [{s}, {e})" for p, s, e in lost)
        raise SliceReadError(
            f"topic '{topic}': Kafka deleted offsets of the slice while it was "
            f"read ({described}); run the hour again to see what retention left"
        )


def _record_batch(topic: str, columns: dict[str, list]) -> pa.RecordBatch:
    """The columns read, as the Arrow batch of `read_slice`'s columns."""
    count = len(columns["offset"])
    return pa.RecordBatch.from_arrays(
        [
            pa.array(columns["key"], pa.binary()),
            pa.array(columns["value"], pa.binary()),
            pa.array([topic] * count, pa.string()),
            pa.array(columns["partition"], pa.int32()),
            pa.array(columns["offset"], pa.int64()),
            pa.array(columns["timestamp"], pa.timestamp("ms", tz="UTC")),
            pa.array(columns["headers"], _HEADERS),
        ],
        names=["key", "value", "topic", "partition", "offset", "timestamp", "headers"],
    )


@dataclass(frozen=True)
class OffsetCensus:
    """What Kafka holds in a slice's offsets, counted apart from the run's reader.

    `committed`: the records a read_committed consumer returns; `uncommitted`: those a
    read_uncommitted one returns. Kafka's consumers return every record but control batches,
    so span - uncommitted offsets are transaction markers (or records compaction removed), and
    uncommitted - committed records belong to aborted transactions. The run's reader must have
    read exactly `committed` records: fewer lost some between Kafka and the decoder.
    """

    committed: int
    uncommitted: int


def count_slice_records(
    consumer: KafkaConsumer, hour_slice: HourSlice, *, timeout_s: float = 120
) -> int:
    """The records `consumer` (read committed or not) returns inside the slice's offsets.

    Deliberately simpler than `read_slice_locally`: it keeps nothing, and counts by offset."""
    bounds = {
        TopicPartition(hour_slice.topic, p.partition): (p.start, p.end)
        for p in hour_slice.partitions
        if p.size > 0
    }
    if not bounds:
        return 0
    consumer.assign(list(bounds))
    for tp, (start, _) in bounds.items():
        consumer.seek(tp, start)
    count, deadline = 0, time.monotonic() + timeout_s
    remaining = set(bounds)
    while remaining:
        for tp, records in consumer.poll(timeout_ms=500).items():
            start, end = bounds[tp]
            count += sum(1 for r in records if start <= r.offset < end)
        for tp in list(remaining):
            if consumer.position(tp) >= bounds[tp][1]:
                remaining.discard(tp)
                consumer.pause(tp)
        if remaining and time.monotonic() > deadline:
            raise SliceReadError(
                f"topic '{hour_slice.topic}': counting the slice's records took over "
                f"{timeout_s:g} s; check the brokers and run the hour again"
            )
    # A seek below the log start lands elsewhere (auto_offset_reset): no count then.
    starts = consumer.beginning_offsets(list(bounds))
    gone = sorted(tp.partition for tp, (start, _) in bounds.items() if starts[tp] > start)
    if gone:
        raise SliceReadError(
            f"topic '{hour_slice.topic}': partitions {gone} lost offsets of the slice to "
            "retention while they were counted"
        )
    return count
