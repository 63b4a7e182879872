"""Debezium envelopes → typed change rows; anything that can't be applied → an error reason.

The CDC rules, stated once:

- A record's value is a Debezium envelope, with or without the Kafka Connect `schema`/`payload`
  wrapper. `op` is `c` (insert), `r` (snapshot read), `u` (update) or `d` (delete).
- c/r/u carry the row in `after`, which must hold every declared column (JSON null is a value;
  an absent column is a schema change). A delete needs only its primary key and sequence: the
  key comes from `before`, or from the Kafka key when `before` lacks it (Postgres' default
  replica identity); its other `before` values are kept where they convert, null otherwise.
- A null value is a Kafka tombstone (log compaction's marker after a delete): counted, skipped.
- Changes of one key are ordered by the table's sequence (default `source.lsn`), then Kafka
  partition and offset. Offsets alone can't order changes: a topic's partition count may change.
- A record is an error, kept with its raw bytes and the reason, when: its value is not JSON,
  it is larger than the table's `max_record_bytes`, `op` is missing or unknown, the primary key
  or a sequence field is missing, the Kafka key names another primary key than the row, a change
  lacks a declared column, or a value does not convert to the declared type. Reasons never
  quote record values. Errors never stop the run (I7).
- A truncate (`op` `t`) needs only its sequence; `hour_run` applies it or stops the run, as the
  table's `on_truncate` says. It is never silently dropped.
- Debezium encodings: decimals as strings (decimal.handling.mode=string) or numbers; timestamps
  as epoch numbers in the column's unit (`timestamp` and `timestamp(us)`: MicroTimestamp,
  `timestamp(ms)`: Timestamp, `timestamp(ns)`: NanoTimestamp) or ISO-8601 strings
  (ZonedTimestamp); dates as epoch days or ISO-8601 strings. `source.ts_ms` outside years
  1–9999 is treated as unknown rather than failing the run.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from cdc_assets.config import TableSpec, spark_type

OPS = ("c", "r", "u", "d", "t")
TRUNCATE = "t"

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
ROW = "_cdc_row"  # the change's row as a variant (`after`, or `before` for a delete)
# Debezium's stand-in for a TOASTed value the change doesn't carry (it did not change).
UNAVAILABLE = "__debezium_unavailable_value"


def has_value(column: str) -> str:
    """Decoded flag: the change carries a value of toasted column `column`."""
    return f"_cdc_has__{column}"


def value_sequence(column: str) -> str:
    """Mirror column: the sequence of the change that gave toasted `column` its value."""
    return f"_cdc_seq__{column}"


def parse_object_fields(text: str | None) -> dict[str, str]:
    """Field → kind of a `schema_of_variant` OBJECT<...> string (top level only)."""
    if not text or not text.startswith("OBJECT<") or not text.endswith(">"):
        return {}
    body, fields, depth, quoted, item = text[len("OBJECT<") : -1], {}, 0, False, ""
    for char in body + ",":
        if char == "`":
            quoted = not quoted
        elif not quoted and char in "<(":
            depth += 1
        elif not quoted and char in ">)":
            depth -= 1
        if char == "," and depth == 0 and not quoted:
            name, kind = _split_field(item.strip())
            if name:
                fields[name] = kind
            item = ""
        else:
            item += char
    return fields


def _split_field(item: str) -> tuple[str, str]:
    """'name: KIND' or '`odd name`: KIND' (a backquote inside is doubled) → (name, KIND)."""
    if item.startswith("`"):
        close = 1
        while (close := item.index("`", close)) + 1 < len(item) and item[close + 1] == "`":
            close += 2
        return item[1:close].replace("``", "`"), item[close + 1 :].removeprefix(":").strip()
    name, _, kind = item.partition(":")
    return name.strip(), kind.strip()


def source_kinds(decoded: DataFrame) -> dict[str, str]:
    """Column → JSON kind of the rows an hour's changes carried (inserts, updates, snapshots).

    One `schema_of_variant_agg` over those rows; where a column's kind varied it says only
    VARIANT, and the distinct kinds are looked up (a second job), joined by '|'.
    """
    rows = decoded.where(~F.col(TOMBSTONE) & F.col(OP).isin("c", "u", "r"))
    fields = parse_object_fields(rows.agg(F.schema_of_variant_agg(F.col(ROW))).first()[0])
    mixed = [column for column, kind in fields.items() if kind == "VARIANT"]
    if mixed:
        kinds = rows.agg(
            *[
                F.array_sort(
                    F.collect_set(F.schema_of_variant(_get(F.col(ROW), _field(c), "variant")))
                ).alias(f"k{n}")
                for n, c in enumerate(mixed)
            ]
        ).first()
        for n, column in enumerate(mixed):
            fields[column] = "|".join(k for k in kinds[f"k{n}"] if k != "VOID") or "VOID"
    return fields


def _get(variant: Column, path: str, type_name: str) -> Column:
    return F.try_variant_get(variant, path, type_name)


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


def _accepted(declared: str) -> str:
    return _ACCEPTED_KINDS.get(spark_type(declared), _DECIMAL_KINDS)


def kind_fits(declared: str, kind: str) -> bool:
    """Whether a JSON kind (as `schema_of_variant` names it) converts to the declared type.

    VOID is JSON null, which every column accepts. A kind that varied within the hour is given
    as its kinds joined by '|' (see `source_kinds`); each of them must fit.
    """
    accepted = _accepted(declared)
    return all(
        part == "VOID" or re.fullmatch(f"({accepted})", part) is not None
        for part in kind.split("|")
    )


_ADDABLE = re.compile(r"(?!_cdc_)[A-Za-z_][A-Za-z0-9_]*", re.IGNORECASE)
# The raw record's columns on a decoded row (kept for the error table).
_RESERVED = {"key", "value", "topic"}


def added_column_types(kinds: Mapping[str, str], known: Iterable[str]) -> dict[str, str]:
    """Types for source columns that appeared undeclared, from their JSON kinds in the hour.

    Whole numbers become bigint, other numbers double, booleans boolean, strings string; a
    column whose kinds varied becomes string (and its other values errors). A column that was
    only ever null waits for a value; objects and arrays wait for a declaration.
    """
    known = {name.lower() for name in known}
    types = {}
    for column, kind in kinds.items():
        if column.lower() in known | _RESERVED or not _ADDABLE.fullmatch(column):
            continue
        parts = {k for k in kind.split("|") if k != "VOID"}
        if not parts or any(k.startswith(("OBJECT", "ARRAY")) for k in parts):
            continue  # nothing to go by yet, or nested data: declare it (schema_drift names it)
        if all(re.fullmatch(f"({_INTEGRAL})", k) for k in parts):
            types[column] = "bigint"
        elif all(re.fullmatch(f"({_NUMERIC})", k) for k in parts):
            types[column] = "double"
        elif parts == {"BOOLEAN"}:
            types[column] = "boolean"
        else:
            types[column] = "string"
    return types


# Microseconds per unit of an epoch timestamp, by the declared column type.
_MICROS_PER_UNIT = {"timestamp": 1, "timestamp(us)": 1, "timestamp(ms)": 1000}
# Epoch values beyond year 9999 are garbage, not timestamps; the bound also keeps the unit
# conversion from overflowing.
_MAX_EPOCH_MICROS = 253_402_300_799_999_999


def _epoch_micros(value: Column, micros_per_unit: int | None) -> Column:
    """Epoch micros from an epoch number in the column's unit (None: nanoseconds)."""
    if micros_per_unit is None:
        micros = F.floor(value / 1000).cast("bigint")
    else:
        bound = _MAX_EPOCH_MICROS // micros_per_unit
        micros = F.when(value.between(-bound, bound), value * micros_per_unit)
    return F.when(micros.between(-_MAX_EPOCH_MICROS, _MAX_EPOCH_MICROS), micros)


def _typed(raw: Column, declared: str) -> Column:
    """Converts one variant value to the declared type; null when it doesn't convert."""
    kinds = _accepted(declared)
    is_string = F.schema_of_variant(raw) == "STRING"
    if declared.startswith("timestamp"):
        unit = _MICROS_PER_UNIT.get(declared)  # None for timestamp(ns)
        value = F.when(is_string, _get(raw, "$", "timestamp")).otherwise(
            F.timestamp_micros(_epoch_micros(_get(raw, "$", "bigint"), unit))
        )
    elif declared == "date":
        value = F.when(is_string, _get(raw, "$", "date")).otherwise(
            F.date_from_unix_date(_get(raw, "$", "int"))
        )
    else:
        value = _get(raw, "$", declared)
    return F.when(F.schema_of_variant(raw).rlike(f"^({kinds})$"), value)


def _unwrap(document: Column) -> Column:
    """The payload of a Kafka Connect schema/payload wrapper, or the document itself."""
    payload = _get(document, "$.payload", "variant")
    return F.when(payload.isNotNull() & _present(document, "$.schema"), payload).otherwise(document)


def decode(
    records: DataFrame,
    spec: TableSpec,
    *,
    hour_key: str,
    added_columns: Mapping[str, str] | None = None,
) -> DataFrame:
    """Decodes the Kafka records of one slice.

    Returns one row per record: the source columns, the `_cdc_*` metadata columns, and
    `_cdc_error` (null when the change can be applied) and `_cdc_is_tombstone`. The raw
    `key`/`value` bytes and Kafka coordinates stay on the row for the error table.

    `added_columns` (name → type) are source columns the mirror gained without a declaration
    (`added_column_types`): a change may lack one (null), but a value must convert to its type.
    """
    added = dict(added_columns or {})
    # An oversized value is not parsed: it goes to the error table as it is.
    small = F.octet_length(F.col("value")) <= spec.max_record_bytes
    parsed = F.try_parse_json(F.when(small, F.col("value")).cast("string"))
    envelope = _unwrap(parsed)
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
        _unwrap(F.try_parse_json(F.col("key").cast("string"))).alias("_key"),
    )

    env, data, key = F.col("_envelope"), F.col("_row"), F.col("_key")
    is_delete = F.col(OP) == "d"
    # A truncate names no row: it needs only its sequence (hour_run applies or refuses it).
    has_row = F.col(OP) != TRUNCATE
    values = {}
    for column, declared in spec.columns.items():
        value = _typed(_get(data, _field(column), "variant"), declared)
        if column in spec.primary_key:
            # A delete's before-image may lack the key (or be null); the Kafka key holds it.
            from_key = _typed(_get(key, _field(column), "variant"), declared)
            value = F.when(is_delete, F.coalesce(value, from_key)).otherwise(value)
        values[column] = value.cast(spark_type(declared))
    sequence_parts = [
        _get(env, f"$.{part.field}", part.type).alias(part.struct_name) for part in spec.sequence
    ]

    reasons = [
        (
            F.octet_length(F.col("value")) > spec.max_record_bytes,
            F.lit(f"value is larger than max_record_bytes ({spec.max_record_bytes})"),
        ),
        (F.col("_parsed").isNull(), F.lit("value is not valid JSON")),
        (F.col(OP).isNull(), F.lit("envelope has no 'op' field")),
        (~F.col(OP).isin(*OPS), F.lit("unknown op")),
        (
            has_row & ~is_delete & (data.isNull() | F.is_variant_null(data)),
            F.lit("change without 'after' row"),
        ),
    ]
    for part in spec.sequence:
        reasons.append(
            (
                _get(env, f"$.{part.field}", part.type).isNull(),
                F.lit(f"sequence field '{part.field}' is missing or not a {part.type}"),
            )
        )
    for column in spec.primary_key:
        reasons.append(
            (
                has_row & values[column].isNull(),
                F.lit(f"primary key column '{column}' is missing or invalid"),
            )
        )
    for column in spec.primary_key:
        # Debezium keys the record by the row's primary key; a key naming another row means
        # the record was routed or rewritten wrongly, and applying it could hit either row.
        in_key = _typed(_get(key, _field(column), "variant"), spec.columns[column])
        reasons.append(
            (
                has_row & in_key.isNotNull() & (in_key != values[column]),
                F.lit(f"the Kafka key's '{column}' differs from the row's primary key"),
            )
        )
    # Columns the mirror gained: a change may lack one, but a value must convert.
    for column, declared in added.items():
        values[column] = _typed(_get(data, _field(column), "variant"), declared).cast(
            spark_type(declared)
        )
        reasons.append(
            (
                has_row & ~is_delete & _present(data, _field(column)) & values[column].isNull(),
                F.lit(f"column '{column}' does not convert to {declared}"),
            )
        )
    # A toasted column's placeholder means "unchanged": no value, and no error.
    placeholder, available = {}, {}
    for column in spec.columns:
        raw = _get(data, _field(column), "variant")
        placeholder[column] = F.coalesce(
            (F.schema_of_variant(raw) == "STRING") & (_get(raw, "$", "string") == UNAVAILABLE),
            F.lit(False),
        )
    for column in spec.toasted_columns:
        values[column] = F.when(~placeholder[column], values[column])
        available[column] = has_row & ~is_delete & ~placeholder[column]
    # A delete needs only its key and sequence; a change must carry every declared column.
    for column, declared in spec.columns.items():
        raw = _get(data, _field(column), "variant")
        changes_row = has_row & ~is_delete
        reasons.append(
            (changes_row & raw.isNull(), F.lit(f"column '{column}' is missing from 'after'"))
        )
        if column not in spec.toasted_columns:
            reasons.append(
                (
                    changes_row & placeholder[column],
                    F.lit(
                        f"column '{column}' holds Debezium's unavailable-value placeholder; "
                        "list it under toasted_columns"
                    ),
                )
            )
        reasons.append(
            (
                changes_row
                & ~placeholder[column]
                & _present(data, _field(column))
                & values[column].isNull(),
                F.lit(f"column '{column}' does not convert to {declared}"),
            )
        )

    error = F.lit(None).cast("string")
    for condition, reason in reversed(reasons):
        error = F.when(condition, reason).otherwise(error)
    is_tombstone = F.col("value").isNull()
    source_ts = _epoch_micros(_get(env, "$.source.ts_ms", "bigint"), 1000)

    return frame.select(
        "key",
        "value",
        "topic",
        *[values[column].alias(column) for column in [*spec.columns, *added]],
        F.col(OP),
        data.alias(ROW),
        F.struct(
            *sequence_parts,
            F.col(KAFKA_PARTITION).alias("kafka_partition"),
            F.col(KAFKA_OFFSET).alias("kafka_offset"),
        ).alias(SEQUENCE),
        F.timestamp_micros(source_ts).alias(SOURCE_TS),
        F.col(KAFKA_PARTITION),
        F.col(KAFKA_OFFSET),
        F.col("_cdc_kafka_timestamp"),
        F.lit(hour_key).alias(HOUR),
        (F.col(OP) == "d").alias(DELETED),
        F.when(is_tombstone, F.lit(None)).otherwise(error).alias(ERROR),
        is_tombstone.alias(TOMBSTONE),
        *[available[c].alias(has_value(c)) for c in spec.toasted_columns],
    )
