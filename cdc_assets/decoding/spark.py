"""The decoder in Spark: a slice's Kafka records → the decoded frame, in Spark's Python workers
(`decode`) or, for a small slice read in the driver, here into an Arrow table
(`decode_locally`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets.config import TableSpec
from cdc_assets.decoding.batch import decode_batch
from cdc_assets.decoding.envelope import OLD_KEY_HEADER
from cdc_assets.decoding.exact import RecordDecoder
from cdc_assets.decoding.parts import OLD_KEY_COLUMN
from cdc_assets.decoding.plan import DecodePlan


def decode(
    records: DataFrame,
    spec: TableSpec,
    *,
    hour_key: str,
    added_columns: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> DataFrame:
    """Decodes the Kafka records of one slice in Spark's Python workers.

    Returns one row per record: the source columns, the `_cdc_*` metadata columns, `_cdc_error`
    (null when the change can be applied) and `_cdc_is_tombstone`. The raw `key`/`value` bytes
    are kept on error rows only (every row's when hard expectations may hold a change back),
    for the error table. `SHAPE` is set on the first row of each
    batch (see `SourceShape`).

    `added_columns` (name → type) are source columns the mirror gained without a declaration
    (`shape.added_column_types`): a change may lack one (its default), but a value must convert to
    its type.
    `defaults`: what a change written before a column existed gives it (`DecodePlan.of`).
    """
    plan = DecodePlan.of(spec, hour_key=hour_key, added_columns=added_columns, defaults=defaults)

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        decoder = RecordDecoder(plan)
        for batch in batches:
            yield decode_batch(decoder, batch)

    return records.select(*decoder_input(records, plan)).mapInArrow(run, plan.spark_schema())


_KAFKA_COLUMNS = ("key", "value", "topic", "partition", "offset", "timestamp")


def decoder_input(records: DataFrame, plan: DecodePlan) -> list[Column]:
    """What the Python workers get of Spark's Kafka rows: every column but the headers, and, for
    a table with toasted columns, the value of the first `__debezium.oldkey` header that has
    one (`OLD_KEY_COLUMN`, binary, null when there is none: the header
    `envelope.old_key_value` picks). The headers array stays in the JVM: Spark's Arrow
    conversion of an array column costs about what reading the records from Kafka does, even
    when every array is empty (docs/benchmark.md, "Where ours spends its time")."""
    present = [F.col(c) for c in _KAFKA_COLUMNS if c in records.columns]
    if plan.toasted and "headers" in records.columns:
        old_key = F.try_element_at(
            F.filter(
                "headers",
                lambda h: (h["key"] == F.lit(OLD_KEY_HEADER)) & h["value"].isNotNull(),
            ),
            F.lit(1),
        )["value"]
        present.append(old_key.alias(OLD_KEY_COLUMN))
    return present


def decode_locally(
    records: pa.RecordBatch,
    spec: TableSpec,
    *,
    hour_key: str,
    added_columns: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> tuple[pa.Table, T.StructType]:
    """`decode` of a small slice read in the driver (`read.read_slice_locally`): the same
    decoder, run here, its rows kept here as an Arrow table (no Spark job), with the Spark
    schema of the frame `decode` would give."""
    plan = DecodePlan.of(spec, hour_key=hour_key, added_columns=added_columns, defaults=defaults)
    decoded = decode_batch(RecordDecoder(plan), records)
    return pa.Table.from_batches([decoded]), plan.spark_schema()
