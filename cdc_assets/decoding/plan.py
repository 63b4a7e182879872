"""What the decoder needs of a table (`DecodePlan`), and how one schema's rows are read (`RowPlan`).

`DecodePlan.of` turns a table's config into the picklable plan Spark's workers get: the columns
(declared, then added undeclared), their configured encodings and defaults, the key, the
sequence and the toasted columns. A `RowPlan` is the converters of one Connect schema (or of
the config, for records without one), built once per schema text by `RowPlans` and shared by
both decode passes. The decoded batch's Arrow and Spark schemas are stated here too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import date
from decimal import Decimal
from functools import cached_property
from typing import Any

import pyarrow as pa
from pyspark.sql import types as T

from cdc_assets.columns import (
    DELETED,
    ERROR,
    HOUR,
    KAFKA_OFFSET,
    KAFKA_PARTITION,
    KAFKA_TIMESTAMP,
    MOVED_FROM,
    OP,
    SEQUENCE,
    SHAPE,
    SOURCE_TS,
    TALLY,
    TOMBSTONE,
    has_value,
)
from cdc_assets.config import TableSpec, default_json
from cdc_assets.decoding import values as enc
from cdc_assets.decoding.cells import convert
from cdc_assets.decoding.envelope import BadRecord, row_schema, schema_text
from cdc_assets.decoding.shape import SourceShape
from cdc_assets.decoding.types import arrow_type, spark_data_type

# A decoder remembers this many schema texts (values' and keys' apart); more are read anew.
_MAX_SCHEMAS = 256


@dataclass(frozen=True)
class DecodePlan:
    """A table's columns and settings as the decoder uses them (picklable, for Spark workers).

    `columns` holds the declared columns, then those the mirror gained undeclared (`added`),
    each with its encoding when the envelope has no schema.
    """

    table: str
    columns: tuple[tuple[str, str], ...]
    configured: tuple[enc.Encoding, ...]
    added: frozenset[str]
    primary_key: tuple[str, ...]
    sequence: tuple[tuple[str, str], ...]
    toasted: tuple[str, ...]
    max_record_bytes: int
    hour_key: str
    # Keep every record's raw bytes, not only the errors': hard expectations may send a change
    # that decoded fine to the error table.
    keep_raw: bool = False
    # Per column, the value a change written before the column existed gives it (the table's
    # `defaults`, typed); empty: null for every column.
    defaults: tuple[Any, ...] = ()

    @classmethod
    def of(
        cls,
        spec: TableSpec,
        *,
        hour_key: str,
        added_columns: Mapping[str, str] | None = None,
        defaults: Mapping[str, Any] | None = None,
    ) -> DecodePlan:
        """`defaults`: column → its default, typed (`config.typed_default`); the table's
        declared ones when None."""
        added = dict(added_columns or {})
        columns = (*spec.columns.items(), *added.items())
        configured = tuple(
            enc.configured_encoding(
                declared,
                spec.encodings.get(name),
                decimal_handling=spec.decimal_handling,
                binary_handling=spec.binary_handling,
            )
            for name, declared in columns
        )
        return cls(
            table=spec.name,
            columns=tuple(columns),
            configured=configured,
            added=frozenset(added),
            primary_key=tuple(spec.primary_key),
            sequence=tuple((part.field, part.type) for part in spec.sequence),
            toasted=tuple(spec.toasted_columns),
            max_record_bytes=spec.max_record_bytes,
            hour_key=hour_key,
            keep_raw=any(e.hard for e in spec.expectations),
            defaults=_defaults_by_column(
                spec.column_defaults() if defaults is None else defaults, columns
            ),
        )

    def default(self, n: int) -> Any:
        """Column `n`'s value in a change written before the column existed."""
        return self.defaults[n] if self.defaults else None

    @property
    def declared(self) -> dict[str, str]:
        return dict(self.columns)

    # The plan's layout, derived once per decoder (not pickled into Spark's tasks twice).
    @cached_property
    def names(self) -> list[str]:
        return [name for name, _ in self.columns]

    @cached_property
    def index(self) -> dict[str, int]:
        """Column → its position among `columns`."""
        return {name: n for n, name in enumerate(self.names)}

    @cached_property
    def pk_index(self) -> list[int]:
        return [self.index[k] for k in self.primary_key]

    @cached_property
    def ranged_keys(self) -> list[tuple[str, str]]:
        """The primary key's (column, declared type): the key range's candidates (`KeyRange`)."""
        declared = self.declared
        return [(k, declared[k]) for k in self.primary_key]

    @cached_property
    def toasted_index(self) -> dict[int, int]:
        """Column position → its position among `toasted`."""
        return {self.index[c]: t for t, c in enumerate(self.toasted)}

    def sequence_type(self) -> T.StructType:
        parts = [
            T.StructField(
                path.replace(".", "_"), T.StringType() if kind == "string" else T.LongType()
            )
            for path, kind in self.sequence
        ]
        return T.StructType(
            [
                *parts,
                T.StructField("kafka_partition", T.IntegerType()),
                T.StructField("kafka_offset", T.LongType()),
            ]
        )

    def key_type(self) -> T.StructType:
        declared = self.declared
        return T.StructType(
            [T.StructField(k, spark_data_type(declared[k])) for k in self.primary_key]
        )

    def spark_schema(self) -> T.StructType:
        """The decoded frame's schema (see `decode`)."""
        fields = [
            T.StructField("key", T.BinaryType()),
            T.StructField("value", T.BinaryType()),
            T.StructField("topic", T.StringType()),
            *[T.StructField(name, spark_data_type(declared)) for name, declared in self.columns],
            T.StructField(OP, T.StringType()),
            T.StructField(SEQUENCE, self.sequence_type()),
            T.StructField(SOURCE_TS, T.TimestampType()),
            T.StructField(KAFKA_PARTITION, T.IntegerType()),
            T.StructField(KAFKA_OFFSET, T.LongType()),
            T.StructField(KAFKA_TIMESTAMP, T.TimestampType()),
            T.StructField(HOUR, T.StringType()),
            T.StructField(DELETED, T.BooleanType()),
            T.StructField(ERROR, T.StringType()),
            T.StructField(TOMBSTONE, T.BooleanType()),
            *[T.StructField(has_value(c), T.BooleanType()) for c in self.toasted],
            *([T.StructField(MOVED_FROM, self.key_type())] if self.toasted else []),
            T.StructField(SHAPE, T.StringType()),
            T.StructField(TALLY, T.StringType()),
        ]
        return T.StructType(fields)


def _defaults_by_column(
    typed: Mapping[str, Any], columns: tuple[tuple[str, str], ...]
) -> tuple[Any, ...]:
    """`DecodePlan.defaults`: each plan column's default, in the plan's order; () when none."""
    return tuple(typed.get(name) for name, _ in columns) if typed else ()


def schema_default(
    name: str,
    field_schema: Mapping[str, Any],
    encoding: enc.Encoding,
    column: tuple[str, enc.Converter | enc.Mismatch] | None,
) -> str | None:
    """The default a Connect field schema declares (Debezium copies the source column's
    `DEFAULT` there, in the field's own encoding), as JSON of the column's value (a date or
    timestamp as ISO text): read by the column's converter (`column`: its declared type and
    converter), or for an undeclared column by its suggested type's. None when there is none,
    it is not a plain value (binary, arrays, time) or does not convert, or it is a timestamp at
    the epoch: Debezium's MySQL connector writes `DEFAULT CURRENT_TIMESTAMP` so, a value the
    rows from before the column never hold."""
    raw = field_schema.get("default")
    if raw is None:
        return None
    if column is None:
        declared = enc.suggested_type(encoding)
        if declared is None:
            return None
        converter = enc.converter(name, declared, encoding, from_schema=True)
    else:
        declared, converter = column
    if declared in ("time", "binary"):
        return None
    try:
        value = enc.calendar_value(declared, convert(converter, raw))
    except BadRecord:
        return None
    if declared == "timestamp" and value == enc.EPOCH:
        return None
    if not isinstance(value, str | int | float | bool | Decimal | date):
        return None
    return default_json(value)


def absent_at_the_time(
    plan: DecodePlan, row_schema: Mapping[str, Any] | None, in_schema: Iterable[bool]
) -> frozenset[int]:
    """The plan columns a change may lack because the source table did not have them yet.

    With a Connect schema, the record's own schema says which columns the row had when it was
    written: a column it does not name was added later (`ALTER TABLE ... ADD COLUMN`). Without
    one, the JSON converter still writes every column the row has (a null as null), so a column
    missing from `after` is one the table did not have. Such a change gives the column its
    default (`DecodePlan.defaults`, null when none): a declared column never turns the history
    before it into errors. A column the mirror gained undeclared (`added`) may always be absent.
    """
    if row_schema is None:
        return frozenset(range(len(plan.columns)))
    return frozenset(
        n
        for n, ((name, _), known) in enumerate(zip(plan.columns, in_schema, strict=True))
        if not known or name in plan.added
    )


@dataclass(frozen=True)
class RowPlan:
    """How one schema's (or the config's) row is decoded: a converter per plan column."""

    converters: tuple[enc.Converter | enc.Mismatch, ...]
    encodings: tuple[enc.Encoding, ...]
    shape: SourceShape
    # Columns a row of this plan may lack: the source table did not have them when the change
    # was written (`absent_at_the_time`).
    may_lack: frozenset[int] = frozenset()


def build_row_plan(plan: DecodePlan, row_schema: Mapping[str, Any] | None) -> RowPlan:
    """How rows under `row_schema` (a Connect struct schema; None: the table's config) are
    decoded, and what the schema tells of the source's columns."""
    fields = {}
    if row_schema is not None:
        fields = {f.get("field"): f for f in row_schema.get("fields") or () if isinstance(f, dict)}
    converters, encodings, in_schema = [], [], []
    shape = SourceShape(schemas={row_schema is not None})
    for (name, declared), configured in zip(plan.columns, plan.configured, strict=True):
        if row_schema is None:
            encoding, known = configured, True
        else:
            known = name in fields
            encoding = enc.from_connect_schema(fields[name]) if known else configured
        made = enc.converter(name, declared, encoding, from_schema=row_schema is not None)
        converters.append(made)
        encodings.append(encoding)
        in_schema.append(known)
        if isinstance(made, enc.Mismatch) and known and name not in plan.added:
            shape.mismatches.setdefault(name, set()).add(made.reason)
        if fields and not known:  # a schema naming no column at all tells nothing
            shape.absent.add(name)
    if row_schema is not None:
        for name, field_schema in fields.items():
            encoding = enc.from_connect_schema(field_schema)
            shape.fields[name] = {encoding.descriptor()}
            if name not in plan.index:
                shape.types[name] = {enc.suggested_type(encoding) or ""}
            n = plan.index.get(name)
            default = schema_default(
                name,
                field_schema,
                encoding,
                (plan.columns[n][1], converters[n]) if n is not None else None,
            )
            if default is not None:
                shape.defaults[name] = {default}
    return RowPlan(
        tuple(converters),
        tuple(encodings),
        shape,
        may_lack=absent_at_the_time(plan, row_schema, in_schema),
    )


class RowPlans:
    """A decoder's row plans: the config's (records without a schema), and one per Connect
    schema text, values' and keys' apart, learnt from the first record that carries it."""

    def __init__(self, plan: DecodePlan) -> None:
        self.plan = plan
        self.configured = build_row_plan(plan, None)
        self._values: dict[bytes, RowPlan] = {}
        self._keys: dict[bytes, RowPlan] = {}

    def known_value(self, prefix: bytes | None) -> RowPlan | None:
        """The plan of a value whose schema text (`envelope.schema_prefix`) was seen before."""
        return self._values.get(prefix) if prefix is not None else None

    def known_key(self, prefix: bytes | None) -> RowPlan | None:
        return self._keys.get(prefix) if prefix is not None else None

    def learn_value(self, value: bytes, schema: Any) -> RowPlan:
        """The plan of a wrapped value's envelope `schema` (its `after`, else `before`, row)."""
        found = row_schema(schema)
        made = build_row_plan(self.plan, found if found is not None else {})
        self._remember(self._values, value, made)
        return made

    def learn_key(self, key: bytes, schema: Any) -> RowPlan:
        """The plan of a wrapped Kafka key's `schema` (a struct of the key columns)."""
        made = build_row_plan(self.plan, schema if isinstance(schema, dict) else {})
        self._remember(self._keys, key, made)
        return made

    @staticmethod
    def _remember(plans: dict[bytes, RowPlan], raw: bytes, made: RowPlan) -> None:
        exact = schema_text(raw)
        if exact is not None and len(plans) < _MAX_SCHEMAS:
            plans[exact] = made


def arrow_schema(plan: DecodePlan) -> pa.Schema:
    declared = plan.declared
    sequence = pa.struct(
        [
            pa.field(path.replace(".", "_"), pa.string() if kind == "string" else pa.int64())
            for path, kind in plan.sequence
        ]
        + [pa.field("kafka_partition", pa.int32()), pa.field("kafka_offset", pa.int64())]
    )
    key = pa.struct([pa.field(k, arrow_type(declared[k])) for k in plan.primary_key])
    return pa.schema(
        [
            pa.field("key", pa.binary()),
            pa.field("value", pa.binary()),
            pa.field("topic", pa.string()),
            *[pa.field(name, arrow_type(d)) for name, d in plan.columns],
            pa.field(OP, pa.string()),
            pa.field(SEQUENCE, sequence),
            pa.field(SOURCE_TS, pa.timestamp("us", tz="UTC")),
            pa.field(KAFKA_PARTITION, pa.int32()),
            pa.field(KAFKA_OFFSET, pa.int64()),
            pa.field(KAFKA_TIMESTAMP, pa.timestamp("us", tz="UTC")),
            pa.field(HOUR, pa.string()),
            pa.field(DELETED, pa.bool_()),
            pa.field(ERROR, pa.string()),
            pa.field(TOMBSTONE, pa.bool_()),
            *[pa.field(has_value(c), pa.bool_()) for c in plan.toasted],
            *([pa.field(MOVED_FROM, key)] if plan.toasted else []),
            pa.field(SHAPE, pa.string()),
            pa.field(TALLY, pa.string()),
        ]
    )
