"""Debezium envelopes → typed change rows; anything that can't be applied → an error reason.

The CDC rules, stated once:

- A record's value is a Debezium envelope, with or without the Kafka Connect `schema`/`payload`
  wrapper. `op` is `c` (insert), `r` (snapshot read), `u` (update) or `d` (delete). The row is
  `after` for c/r/u and `before` for d; the primary key is read from that row.
- A null value is a Kafka tombstone (log compaction's marker after a delete): counted, skipped.
- Changes of one key are ordered by the table's sequence (default `source.lsn`), then Kafka
  partition and offset. Offsets alone can't order changes: a topic's partition count may change.
- A record is an error, kept with its raw bytes and the reason, when: its value is not JSON,
  `op` is missing or unknown (`t`, truncate, included: it is never silently dropped), a
  primary-key column or sequence field is missing, or a column's value does not convert to
  the declared type. Errors never stop the run (I7).
- Debezium encodings: decimals as strings (decimal.handling.mode=string) or numbers,
  timestamps as epoch microseconds (MicroTimestamp) or ISO-8601 strings, dates as epoch days
  or ISO-8601 strings.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from cdc_assets.config import TableSpec

OPS = ("c", "r", "u", "d")

# Metadata columns of the mirror (besides the source columns).
OP, SEQUENCE, SOURCE_TS, KAFKA_PARTITION, KAFKA_OFFSET = (
    "_cdc_op",
    "_cdc_sequence",
    "_cdc_source_ts",
    "_cdc_kafka_partition",
    "_cdc_kafka_offset",
)
HOUR, INGESTED_AT, DELETED = "_cdc_hour", "_cdc_ingested_at", "_cdc_deleted"
ERROR = "_cdc_error"
TOMBSTONE = "_cdc_is_tombstone"


def _get(variant: Column, path: str, spark_type: str) -> Column:
    return F.try_variant_get(variant, path, spark_type)


def _field(name: str) -> str:
    return f"$['{name}']"


def _present(variant: Column, path: str) -> Column:
    value = _get(variant, path, "variant")
    return value.isNotNull() & ~F.is_variant_null(value)


# JSON kinds each declared type accepts (names as `schema_of_variant` reports them). Strict on
# purpose: "yes" is not a boolean and "42" is not a bigint, even though Spark's casts allow it.
_INTEGRAL = r"BIGINT|INT|SMALLINT|TINYINT|DECIMAL\(\d+,0\)"
_NUMERIC = _INTEGRAL + r"|DOUBLE|FLOAT|DECIMAL\(\d+,\d+\)"
_ACCEPTED_KINDS = {
    "bigint": _INTEGRAL,
    "int": _INTEGRAL,
    "double": _NUMERIC,
    "float": _NUMERIC,
    "boolean": "BOOLEAN",
    "string": "STRING",
    "timestamp": _INTEGRAL + "|STRING",
    "date": _INTEGRAL + "|STRING",
}
_DECIMAL_KINDS = _NUMERIC + "|STRING"


def _typed(raw: Column, spark_type: str) -> Column:
    """Converts one variant value to the declared type; null when it doesn't convert."""
    kinds = _ACCEPTED_KINDS.get(spark_type, _DECIMAL_KINDS)
    if spark_type == "timestamp":
        value = F.coalesce(
            F.timestamp_micros(_get(raw, "$", "bigint")), _get(raw, "$", "timestamp")
        )
    elif spark_type == "date":
        value = F.coalesce(F.date_from_unix_date(_get(raw, "$", "int")), _get(raw, "$", "date"))
    else:
        value = _get(raw, "$", spark_type)
    return F.when(F.schema_of_variant(raw).rlike(f"^({kinds})$"), value)


def decode(records: DataFrame, spec: TableSpec, *, hour_key: str) -> DataFrame:
    """Decodes the Kafka records of one slice.

    Returns one row per record: the source columns, the `_cdc_*` metadata columns, and
    `_cdc_error` (null when the change can be applied) and `_cdc_is_tombstone`. The raw
    `key`/`value` bytes and Kafka coordinates stay on the row for the error table.
    """
    text = F.col("value").cast("string")
    parsed = F.try_parse_json(text)
    wrapped = _get(parsed, "$.payload", "variant")
    envelope = F.when(wrapped.isNotNull() & _present(parsed, "$.schema"), wrapped).otherwise(
        parsed
    )
    op = _get(envelope, "$.op", "string")
    row = F.when(op == "d", _get(envelope, "$.before", "variant")).otherwise(
        _get(envelope, "$.after", "variant")
    )

    frame = records.select(
        "key",
        "value",
        "topic",
        F.col("partition").alias(KAFKA_PARTITION),
        F.col("offset").alias(KAFKA_OFFSET),
        F.col("timestamp").alias("_cdc_kafka_timestamp"),
        parsed.alias("_parsed"),
        envelope.alias("_envelope"),
        op.alias(OP),
        row.alias("_row"),
    )

    env, data = F.col("_envelope"), F.col("_row")
    values = {
        column: _typed(_get(data, _field(column), "variant"), spark_type).cast(spark_type)
        for column, spark_type in spec.columns.items()
    }
    sequence_parts = [
        _get(env, f"$.{part.field}", part.type).alias(part.struct_name) for part in spec.sequence
    ]

    reasons = [
        (F.col("_parsed").isNull(), F.lit("value is not valid JSON")),
        (F.col(OP).isNull(), F.lit("envelope has no 'op' field")),
        (
            ~F.col(OP).isin(*OPS),
            F.concat(F.lit("unknown or unsupported op '"), F.col(OP), F.lit("'")),
        ),
        (
            data.isNull() | F.is_variant_null(data),
            F.when(F.col(OP) == "d", F.lit("delete without 'before' row")).otherwise(
                F.lit("change without 'after' row")
            ),
        ),
    ]
    for part in spec.sequence:
        reasons.append(
            (
                _get(env, f"$.{part.field}", part.type).isNull(),
                F.lit(f"sequence field '{part.field}' is missing or not a {part.type}"),
            )
        )
    for key in spec.primary_key:
        reasons.append(
            (~_present(data, _field(key)), F.lit(f"primary key column '{key}' is missing"))
        )
    for column, spark_type in spec.columns.items():
        reasons.append(
            (
                _present(data, _field(column)) & values[column].isNull(),
                F.lit(f"column '{column}' does not convert to {spark_type}"),
            )
        )

    error = F.lit(None).cast("string")
    for condition, reason in reversed(reasons):
        error = F.when(condition, reason).otherwise(error)
    is_tombstone = F.col("value").isNull()

    return frame.select(
        "key",
        "value",
        "topic",
        *[values[column].alias(column) for column in spec.columns],
        F.col(OP),
        F.struct(
            *sequence_parts,
            F.col(KAFKA_PARTITION).alias("kafka_partition"),
            F.col(KAFKA_OFFSET).alias("kafka_offset"),
        ).alias(SEQUENCE),
        F.timestamp_millis(_get(env, "$.source.ts_ms", "bigint")).alias(SOURCE_TS),
        F.col(KAFKA_PARTITION),
        F.col(KAFKA_OFFSET),
        F.col("_cdc_kafka_timestamp"),
        F.lit(hour_key).alias(HOUR),
        (F.col(OP) == "d").alias(DELETED),
        F.when(is_tombstone, F.lit(None)).otherwise(error).alias(ERROR),
        is_tombstone.alias(TOMBSTONE),
    )
