"""Debezium records → typed change rows; anything that can't be applied → an error reason.

What a record is, stated once (what the mirror then does with the changes is the CDC rule,
`cdc_assets/rule.py`):

- A record's value is a Debezium envelope, with or without the Kafka Connect `schema`/`payload`
  wrapper. `op` is `c` (insert), `r` (snapshot read), `u` (update), `d` (delete) or `t`
  (truncate). Each column value is read in the encoding the record's own Connect schema names,
  or, without a schema, the table's config (`cdc_assets/encodings.py` states that rule).
- c/r/u carry the row in `after`. A column it lacks did not exist at the source when the change
  was written (the record's own Connect schema does not name it; without a schema, the JSON
  converter writes every column the row has): the change gives it the column's declared
  `default`, null when none (`absent_at_the_time`). A delete needs only its primary key and
  sequence: the key comes from `before`, or from the Kafka key when `before` lacks it
  (Postgres' default replica identity); its other `before` values are kept where they convert,
  null otherwise.
- A null value is a Kafka tombstone (log compaction's marker after a delete): counted, skipped.
- Each change carries its sequence (the table's `sequence` fields, then Kafka partition and
  offset), by which the CDC rule orders changes of one key (`cdc_assets/rule.py`: newest per
  key, newer wins, deletes). A `binlog` sequence field (MySQL's `source.file`) is read as the
  file's number, not its name.
- A record is an error, kept with its raw bytes and the reason, when: its value is not JSON,
  it is larger than the table's `max_record_bytes`, `op` is missing or unknown, the primary key
  or a sequence field is missing, the Kafka key names another primary key than the row, a change
  lacks a column its own schema names, or a value is not in its column's encoding or does not
  fit the declared type exactly. Reasons never quote record values. Errors never stop the run (I7).
- A truncate (`op` `t`) needs only its sequence; `hour_run` applies it or stops the run, as the
  table's `on_truncate` says. It is never silently dropped.
- Debezium's `__debezium_unavailable_value` (a TOASTed value the change does not carry because
  it did not change) is "no value" in a column listed under `toasted_columns`, an error in any
  other. A primary-key update moves the row: Debezium deletes the old key and creates the new
  one, naming the old key in the create's `__debezium.oldkey` header; the create is tagged
  with it (`MOVED_FROM`) so the MERGE can carry the unchanged TOASTed values over.

The decoder is plain Python over Arrow batches (`RecordDecoder`): Spark runs it in its Python
workers (`decode`), and it is tested as a pure function on records a real connector wrote.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import date
from decimal import Decimal
from typing import Any

import pyarrow as pa
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets import encodings as enc
from cdc_assets.config import TableSpec, default_json
from cdc_assets.tally import KeyRange, Tally

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
KAFKA_TIMESTAMP = "_cdc_kafka_timestamp"
# The old primary key of a change that moved its row (a primary-key update), from Debezium's
# `__debezium.oldkey` header; null for other changes.
MOVED_FROM = "_cdc_moved_from"
# What the hour's records told of the source's columns: one JSON summary per Arrow batch.
SHAPE = "_cdc_shape"
# What the batch's records add up to (`cdc_assets.tally.Tally`): JSON on each batch's first row.
TALLY = "_cdc_tally"
# Debezium's stand-in for a TOASTed value the change doesn't carry (it did not change).
UNAVAILABLE = "__debezium_unavailable_value"
OLD_KEY_HEADER = "__debezium.oldkey"
# Spark's read sends the decoder that header's value alone, in this column (`decoder_input`).
OLD_KEY_COLUMN = "_cdc_old_key"
_UNAVAILABLE_BASE64 = base64.b64encode(UNAVAILABLE.encode()).decode()
_UNAVAILABLE_HEX = binascii.hexlify(UNAVAILABLE.encode()).decode()
_SCHEMA_PREFIX = b'{"schema":'
_PAYLOAD_SEPARATOR = b',"payload":'


def has_value(column: str) -> str:
    """Decoded flag: the change carries a value of toasted column `column`."""
    return f"_cdc_has__{column}"


def value_sequence(column: str) -> str:
    """Mirror column: the sequence of the change that gave toasted `column` its value."""
    return f"_cdc_seq__{column}"


# --- the plan: what the decoder needs of a table -----------------------------------------------


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


# --- what the records told of the source's columns ----------------------------------------------


@dataclass
class SourceShape:
    """The columns the source sent in `after`, over an hour's inserts, updates and snapshots.

    `fields`: column → the encodings seen (`Encoding.descriptor()` with a schema, `json:<kind>`
    without); `mismatches`: declared column → why its encoding doesn't fit its declared type;
    `types`: undeclared column → the declared type that would hold it; `schemas`: whether the
    records carried a Connect schema (True, False, or both).

    Without a schema, a record's JSON kind is all there is: `json_mismatches` holds the columns
    some value arrived in a kind the config doesn't read, and `json_newest` the kind of each
    column's newest value per partition ([offset, mismatch reason or None]). One malformed
    record among good ones is an error row, not drift; a column whose newest value in some
    partition arrived in a kind the config doesn't read is drift: the source now sends it so
    (`drifted`).
    """

    fields: dict[str, set[str]] = field(default_factory=dict)
    mismatches: dict[str, set[str]] = field(default_factory=dict)
    types: dict[str, set[str]] = field(default_factory=dict)
    schemas: set[bool] = field(default_factory=set)
    json_mismatches: dict[str, set[str]] = field(default_factory=dict)
    json_newest: dict[str, dict[str, list]] = field(default_factory=dict)
    # Column → the default its Connect schema declares (Debezium's copy of the source column's
    # DEFAULT), as JSON of the column's value (`schema_default`).
    defaults: dict[str, set[str]] = field(default_factory=dict)

    def merge(self, other: SourceShape) -> SourceShape:
        for mine, theirs in (
            (self.fields, other.fields),
            (self.mismatches, other.mismatches),
            (self.types, other.types),
            (self.json_mismatches, other.json_mismatches),
            (self.defaults, other.defaults),
        ):
            for name, values in theirs.items():
                mine.setdefault(name, set()).update(values)
        self.schemas |= other.schemas
        for name, by_partition in other.json_newest.items():
            mine = self.json_newest.setdefault(name, {})
            for partition, entry in by_partition.items():
                if partition not in mine or entry[0] > mine[partition][0]:
                    mine[partition] = list(entry)
        return self

    def drifted(self) -> dict[str, set[str]]:
        """Declared columns whose encoding changed: a schema says so, or a schema-less column's
        newest value in some partition arrived in a kind the config doesn't read."""
        out = {name: set(reasons) for name, reasons in self.mismatches.items()}
        for name, by_partition in self.json_newest.items():
            newest = {reason for _, reason in by_partition.values() if reason is not None}
            if newest:
                out.setdefault(name, set()).update(newest)
        return out

    def source_defaults(self) -> dict[str, Any]:
        """The columns whose schema declared one default over the hour, with it (a column
        whose default changed within the hour is left out: which one its rows hold is unsure)."""
        return {
            name: json.loads(next(iter(texts)))
            for name, texts in self.defaults.items()
            if len(texts) == 1
        }

    def to_json(self) -> str:
        return json.dumps(
            {
                "defaults": {k: sorted(v) for k, v in self.defaults.items()},
                "fields": {k: sorted(v) for k, v in self.fields.items()},
                "mismatches": {k: sorted(v) for k, v in self.mismatches.items()},
                "types": {k: sorted(v) for k, v in self.types.items()},
                "schemas": sorted(self.schemas),
                "json_mismatches": {k: sorted(v) for k, v in self.json_mismatches.items()},
                "json_newest": self.json_newest,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> SourceShape:
        raw = json.loads(text)
        return cls(
            fields={k: set(v) for k, v in raw["fields"].items()},
            mismatches={k: set(v) for k, v in raw["mismatches"].items()},
            types={k: set(v) for k, v in raw["types"].items()},
            schemas=set(raw["schemas"]),
            json_mismatches={k: set(v) for k, v in raw.get("json_mismatches", {}).items()},
            json_newest=raw.get("json_newest", {}),
            defaults={k: set(v) for k, v in raw.get("defaults", {}).items()},
        )

    @classmethod
    def combine(cls, texts: Iterable[str | None]) -> SourceShape:
        shape = cls()
        for text in texts:
            if text:
                shape.merge(cls.from_json(text))
        return shape


def added_column_types(shape: SourceShape, known: Iterable[str]) -> dict[str, str]:
    """Types for source columns that appeared undeclared, from what the hour's records said.

    With a schema: the type its encoding calls for (`encodings.suggested_type`). Without:
    whole numbers bigint, other numbers double, booleans boolean, strings string (as sent). A
    column whose types varied becomes string, its other values errors. A column that was only
    ever null waits for a value; objects, arrays and schema types with no single declared type
    wait for a declaration (schema_drift names them).
    """
    known = {name.lower() for name in known}
    types = {}
    for column, suggested in shape.types.items():
        if column.lower() in known | _RESERVED or not _addable(column):
            continue
        kinds = {k for k in suggested if k}
        if not kinds or any(" " in k for k in kinds):
            continue
        if len(kinds) == 1:
            types[column] = next(iter(kinds))
        elif kinds <= {"bigint", "double"}:
            types[column] = "double"
        elif all(not k.startswith("array<") for k in kinds):
            types[column] = "string"
    return types


_RESERVED = {"key", "value", "topic"}


def _addable(name: str) -> bool:
    return _ADDABLE.fullmatch(name) is not None


_ADDABLE = re.compile(r"(?!_cdc_)[A-Za-z_][A-Za-z0-9_]*", re.IGNORECASE)
_JSON_TYPES = {"integer": "bigint", "number": "double", "boolean": "boolean", "string": "string"}


# --- one record --------------------------------------------------------------------------------


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
        value = enc.calendar_value(declared, _convert(converter, raw))
    except _Bad:
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


class _Bad(Exception):
    """The record can't be applied; the message is its reason."""


@dataclass(frozen=True)
class _RowPlan:
    """How one schema's (or the config's) row is decoded: a converter per plan column."""

    converters: tuple[enc.Converter | enc.Mismatch, ...]
    encodings: tuple[enc.Encoding, ...]
    in_schema: tuple[bool, ...]  # the schema declares the column (always True without schema)
    shape: SourceShape
    key_converters: tuple[enc.Converter | enc.Mismatch, ...]
    # Columns a row of this plan may lack: the source table did not have them when the change
    # was written (`absent_at_the_time`).
    may_lack: frozenset[int] = frozenset()


class RecordDecoder:
    """Decodes Kafka records of one table (see the module docstring); one per Spark task."""

    def __init__(self, plan: DecodePlan) -> None:
        self.plan = plan
        self._names = [name for name, _ in plan.columns]
        self._index = {name: n for n, name in enumerate(self._names)}
        self._pk_index = [self._index[k] for k in plan.primary_key]
        declared = plan.declared
        self._ranged_keys = [(k, declared[k]) for k in plan.primary_key]
        self._ranged_key_index = [
            (self._index[k], (k, declared[k])) for k, _ in KeyRange(self._ranged_keys).columns
        ]
        self._toasted_index = [self._index[c] for c in plan.toasted]
        self._configured = self._row_plan(None)
        # Plans by the exact text of a record's (or key's) Connect schema.
        self._by_schema: dict[bytes, _RowPlan] = {}
        self._by_key_schema: dict[bytes, _RowPlan] = {}
        # What the last record's row told of the source's columns (`SourceShape`, or column →
        # JSON kind without a schema); None for records that carry no row.
        self.seen: SourceShape | dict[str, str] | None = None

    # -- plans --

    def _row_plan(self, row_schema: Mapping[str, Any] | None) -> _RowPlan:
        plan = self.plan
        fields = {}
        if row_schema is not None:
            fields = {
                f.get("field"): f for f in row_schema.get("fields") or () if isinstance(f, dict)
            }
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
        if row_schema is not None:
            for name, field_schema in fields.items():
                encoding = enc.from_connect_schema(field_schema)
                shape.fields[name] = {encoding.descriptor()}
                if name not in self._index:
                    shape.types[name] = {enc.suggested_type(encoding) or ""}
                n = self._index.get(name)
                default = schema_default(
                    name,
                    field_schema,
                    encoding,
                    (plan.columns[n][1], converters[n]) if n is not None else None,
                )
                if default is not None:
                    shape.defaults[name] = {default}
        return _RowPlan(
            tuple(converters),
            tuple(encodings),
            tuple(in_schema),
            shape,
            key_converters=tuple(converters[i] for i in self._pk_index),
            may_lack=absent_at_the_time(plan, row_schema, in_schema),
        )

    def _parse(self, value: bytes) -> tuple[_RowPlan, Any]:
        """The row plan and the envelope of a record's value."""
        # A schema seen before: parse only the payload (the schema is most of the bytes).
        prefix = _schema_prefix(value)
        plan = self._by_schema.get(prefix) if prefix is not None else None
        if plan is not None:
            try:
                return plan, json.loads(
                    value[len(_SCHEMA_PREFIX) + len(prefix) + len(_PAYLOAD_SEPARATOR) : -1]
                )
            except ValueError:
                pass  # the whole value decides below, and names the problem
        try:
            document = json.loads(value)
        except (ValueError, UnicodeDecodeError):
            raise _Bad("value is not valid JSON") from None
        if not _is_wrapped(document):
            return self._configured, document
        row_schema = _row_schema(document["schema"])
        plan = self._row_plan(row_schema if row_schema is not None else {})
        exact = _schema_text(value)
        if exact is not None and len(self._by_schema) < 256:
            self._by_schema[exact] = plan
        return plan, document["payload"]

    # -- records --

    def decode(
        self, key: bytes | None, value: bytes | None, headers: list | None
    ) -> tuple[list[Any], dict[str, Any]]:
        """One record → (column values, metadata); raises `_Bad` with the reason."""
        plan = self.plan
        if len(value) > plan.max_record_bytes:
            raise _Bad(f"value is larger than max_record_bytes ({plan.max_record_bytes})")
        row_plan, envelope = self._parse(value)
        if not isinstance(envelope, dict):
            raise _Bad("value is not a JSON object (a Debezium envelope)")
        op = envelope.get("op")
        if op is None:
            raise _Bad("envelope has no 'op' field")
        if op not in OPS:
            raise _Bad("unknown op")
        meta: dict[str, Any] = {"op": op, "moved_from": None}
        meta["sequence"] = [_sequence_part(envelope, path, kind) for path, kind in plan.sequence]
        meta["source_ts"] = _source_micros(envelope)
        values: list[Any] = [None] * len(self._names)
        has: list[bool] = [False] * len(plan.toasted)
        meta["has"] = has
        if op == TRUNCATE:
            return values, meta
        if op == "d":
            self._delete_row(row_plan, envelope.get("before"), key, values)
        else:
            self._change_row(row_plan, envelope.get("after"), values, has)
        self._check_kafka_key(row_plan, key, values)
        if op != "d" and plan.toasted and headers:
            meta["moved_from"] = self._moved_from(row_plan, headers)
        return values, meta

    def _change_row(self, row_plan: _RowPlan, row: Any, values: list, has: list) -> None:
        plan = self.plan
        if not isinstance(row, dict):
            raise _Bad("change without 'after' row")
        # What the source sent, noted before any value fails: schema drift counts error rows too.
        if row_plan.shape.schemas == {True}:
            self.seen = row_plan.shape
        else:
            self.seen = {name: enc.json_kind(v) for name, v in row.items()}
        for pk in plan.primary_key:
            if row.get(pk) is None:
                raise _Bad(f"primary key column '{pk}' is missing or invalid")
        toasted = set(self._toasted_index)
        for n, (name, _) in enumerate(plan.columns):
            if name not in row:
                if n not in row_plan.may_lack:
                    raise _Bad(
                        f"column '{name}' is missing from 'after' although the record's own "
                        "schema declares it: the record was changed after the connector wrote "
                        "it (a transform that drops fields); keep every field the schema names"
                    )
                # Written before the source table had the column: its default, and a value.
                values[n] = plan.default(n)
                if n in toasted:
                    has[plan.toasted.index(name)] = True
                continue
            raw = row[name]
            if raw is None:
                if n in toasted:
                    has[plan.toasted.index(name)] = True
                continue
            if _is_unavailable(raw, row_plan.encodings[n]):
                if n not in toasted:
                    raise _Bad(
                        f"column '{name}' holds Debezium's unavailable-value placeholder; "
                        "list it under toasted_columns"
                    )
                continue
            if n in toasted:
                has[plan.toasted.index(name)] = True
            values[n] = _convert(row_plan.converters[n], raw)

    def _delete_row(self, row_plan: _RowPlan, before: Any, key: bytes | None, values: list) -> None:
        plan = self.plan
        before = before if isinstance(before, dict) else {}
        for n, (name, _) in enumerate(plan.columns):
            raw = before.get(name)
            if raw is None or _is_unavailable(raw, row_plan.encodings[n]):
                continue
            try:
                values[n] = _convert(row_plan.converters[n], raw)
            except _Bad:
                values[n] = None  # a delete needs only its key
        missing = [
            pk for pk, n in zip(plan.primary_key, self._pk_index, strict=True) if values[n] is None
        ]
        if missing:
            from_key = self._key_values(key)
            for pk in missing:
                n = self._index[pk]
                values[n] = from_key.get(pk)
                if values[n] is None:
                    raise _Bad(f"primary key column '{pk}' is missing or invalid")

    def _key_values(self, key: bytes | None) -> dict[str, Any]:
        """The primary key values a JSON Kafka key names (converted), {} when it names none.

        A wrapped key is read in its own schema's encodings (a precise numeric key is base64).
        """
        if key is None:
            return {}
        try:
            document = json.loads(key)
        except (ValueError, UnicodeDecodeError):
            return {}
        key_plan = self._configured
        if _is_wrapped(document):
            key_plan = self._key_plan(key, document["schema"])
            document = document["payload"]
        if not isinstance(document, dict):
            return {}
        found = {}
        for pk, n in zip(self.plan.primary_key, self._pk_index, strict=True):
            raw = document.get(pk)
            if raw is None:
                continue
            try:
                found[pk] = _convert(key_plan.converters[n], raw)
            except _Bad:
                continue
        return found

    def _key_plan(self, key: bytes, schema: Any) -> _RowPlan:
        cached = _schema_prefix(key)
        plan = self._by_key_schema.get(cached) if cached is not None else None
        if plan is None:
            plan = self._row_plan(schema if isinstance(schema, dict) else {})
            exact = _schema_text(key)
            if exact is not None and len(self._by_key_schema) < 256:
                self._by_key_schema[exact] = plan
        return plan

    def _check_kafka_key(self, row_plan: _RowPlan, key: bytes | None, values: list) -> None:
        # Debezium keys the record by the row's primary key; a key naming another row means the
        # record was routed or rewritten wrongly, and applying it could hit either row.
        for pk, in_key in self._key_values(key).items():
            if in_key != values[self._index[pk]]:
                raise _Bad(f"the Kafka key's '{pk}' differs from the row's primary key")

    def _moved_from(self, row_plan: _RowPlan, headers: list) -> dict[str, Any] | None:
        raw = old_key_value(headers)
        return None if raw is None else self._header_key(raw)

    def _header_key(self, raw: bytes) -> dict[str, Any]:
        """The old key in Kafka Connect's default header format (SimpleHeaderConverter).

        A key struct is written `{"id":1,"code":"a"}`: JSON for numbers, strings (only
        backslashes and quotes escaped) and bytes (base64); decimals as plain numbers. Dates and
        times are written unquoted, which no reader can take back exactly: refused.
        """
        plan, found = self.plan, {}
        declared = plan.declared
        try:
            document = json.loads(raw.decode("utf-8"), parse_float=Decimal, strict=False)
        except (ValueError, UnicodeDecodeError):
            document = None
        for pk in plan.primary_key if isinstance(document, dict) else ():
            found[pk] = _header_value(document.get(pk), declared[pk])
        if len(found) != len(plan.primary_key) or None in found.values():
            raise _Bad(
                f"the '{OLD_KEY_HEADER}' header of a primary-key update does not name the old "
                f"key's {', '.join(plan.primary_key)} in Kafka Connect's default header format "
                "(keep the worker's header.converter at its default, SimpleHeaderConverter)"
            )
        return found

    # -- batches --

    def decode_batch(self, batch: pa.RecordBatch, *, fast: bool = True) -> pa.RecordBatch:
        """Decodes a batch of Kafka rows (key, value, topic, partition, offset, timestamp and,
        optionally, the headers or the old key's header, `decoder_input`) into the frame
        `DecodePlan.spark_schema` describes.

        Most records are read a column at a time (`cdc_assets.batch_decode`); `fast=False`
        reads every one with `decode` alone, which gives the same batch, slower."""
        from cdc_assets.batch_decode import decode_batch

        return decode_batch(self, batch, fast=fast)

    def _count(
        self,
        tally: Tally,
        key_range: KeyRange,
        value: bytes | None,
        values: list,
        meta: dict,
        error: str | None,
        partition: int,
        offset: int,
    ) -> None:
        """Adds one record to its batch's tally (see `cdc_assets.tally`)."""
        if value is None:
            tally.tombstones += 1
            return
        if error is not None:
            tally.errors += 1
            tally.reasons[error] = tally.reasons.get(error, 0) + 1
            return
        source_us = meta.get("source_ts")
        if source_us is not None and (
            tally.newest_source_us is None or source_us > tally.newest_source_us
        ):
            tally.newest_source_us = source_us
        op = meta["op"]
        if op == TRUNCATE:
            tally.truncates += 1
            sequence = [*meta["sequence"], partition, offset]
            if tally.truncate_sequence is None or sequence > tally.truncate_sequence:
                tally.truncate_sequence = sequence
            if tally.first_truncate is None or [partition, offset] < tally.first_truncate:
                tally.first_truncate = [partition, offset]
            return
        tally.changes += 1
        tally.deletes += op == "d"
        tally.moves += meta.get("moved_from") is not None
        key_range.add({name: values[n] for n, (name, _) in self._ranged_key_index})

    def _add_json_kinds(
        self,
        shape: SourceShape,
        json_kinds: dict[str, set[str]],
        json_newest: dict[tuple[str, int], tuple[int, str]],
    ) -> None:
        """Schema-less records: what their JSON kinds say of each column."""
        if not json_kinds:
            return
        shape.schemas.add(False)
        for name, kinds in json_kinds.items():
            shape.fields.setdefault(name, set()).update(f"json:{k}" for k in kinds)
            if name not in self._index:
                types = {_JSON_TYPES.get(k, f"{k} (declare it)") for k in kinds if k != "null"}
                shape.types.setdefault(name, set()).update(types)
            elif name not in self.plan.added:
                configured = self.plan.configured[self._index[name]]
                fits = _json_kind_of(configured)
                wrong = {k for k in kinds if k != "null" and k not in fits}
                declared = self.plan.columns[self._index[name]][1]
                if wrong:
                    shape.json_mismatches.setdefault(name, set()).add(
                        _kind_mismatch(name, declared, wrong, configured)
                    )
                for (column, partition), (offset, kind) in json_newest.items():
                    if column == name:
                        shape.json_newest.setdefault(name, {})[str(partition)] = [
                            offset,
                            None
                            if kind in fits
                            else _kind_mismatch(name, declared, {kind}, configured),
                        ]


def _kind_mismatch(name: str, declared: str, found: set[str], configured: enc.Encoding) -> str:
    return (
        f"column '{name}' ({declared}) arrives as JSON {'/'.join(sorted(found))}, but the "
        f"table's config reads it as {configured.describe()}"
    )


def _header_value(value: Any, declared: str) -> Any:
    """One key column as SimpleHeaderConverter wrote it, exactly, or None."""
    family = "decimal" if enc.decimal_shape(declared) else declared
    if family in ("bigint", "int") and type(value) is int:
        return value
    if family == "string" and type(value) is str:
        return value
    if family == "decimal" and type(value) in (int, Decimal):
        precision, scale = enc.decimal_shape(declared)
        exact = Decimal(value).quantize(Decimal(1).scaleb(-scale))
        return exact if exact == value and abs(exact) < Decimal(f"1e{precision - scale}") else None
    if family == "binary" and type(value) is str:
        try:
            return base64.b64decode(value, validate=True)
        except binascii.Error:
            return None
    return None


def _json_kind_of(encoding: enc.Encoding) -> set[str]:
    """The JSON kinds a configured encoding's values arrive as."""
    if encoding.type == "array":
        return {"array"}
    if encoding.type == "struct":
        return {"object"}
    if encoding.type in ("int8", "int16", "int32", "int64"):
        return {"integer"}
    if encoding.type in ("float32", "float64"):
        return {"number", "integer"}
    if encoding.type == "boolean":
        return {"boolean"}
    return {"string"}


def _row_schema(schema: Any) -> Mapping[str, Any] | None:
    """The struct schema of the envelope's `after` (else `before`) row."""
    if not isinstance(schema, dict):
        return None
    rows = {
        f.get("field"): f
        for f in schema.get("fields") or ()
        if isinstance(f, dict) and f.get("field") in ("before", "after")
    }
    return rows.get("after") or rows.get("before")


def _is_wrapped(document: Any) -> bool:
    """Whether a parsed record is Kafka Connect's JSON {"schema": ..., "payload": ...}."""
    return (
        isinstance(document, dict)
        and len(document) == 2
        and "schema" in document
        and "payload" in document
    )


def _schema_prefix(value: bytes) -> bytes | None:
    """The bytes of a wrapped record up to its first ',"payload":' (unverified).

    Only looked up among exact schema texts (`_schema_text`): a complete JSON object can't be
    a proper prefix of another one starting at the same brace, so a hit is the record's schema.
    """
    if not (value.startswith(_SCHEMA_PREFIX) and value.endswith(b"}")):
        return None
    cut = value.find(_PAYLOAD_SEPARATOR, len(_SCHEMA_PREFIX))
    return value[len(_SCHEMA_PREFIX) : cut] if cut > 0 else None


def _schema_text(value: bytes) -> bytes | None:
    """The raw bytes of a wrapped record's schema, when they can be told exactly."""
    if not value.startswith(_SCHEMA_PREFIX):
        return None
    try:
        text = value.decode("utf-8")
        _, end = json.JSONDecoder().raw_decode(text, len(_SCHEMA_PREFIX))
    except (ValueError, UnicodeDecodeError):
        return None
    if not text.startswith(_PAYLOAD_SEPARATOR.decode(), end):
        return None
    return text[len(_SCHEMA_PREFIX) : end].encode("utf-8")


def _is_unavailable(raw: Any, encoding: enc.Encoding) -> bool:
    """Whether `raw` is Debezium's placeholder, as the column's encoding renders it."""
    if encoding.type == "bytes" or encoding.name == enc.BASE64_TEXT:
        return raw == _UNAVAILABLE_BASE64 or raw == UNAVAILABLE
    if encoding.name == enc.HEX_TEXT:
        return raw == _UNAVAILABLE_HEX or raw == UNAVAILABLE
    if encoding.type == "array":
        return type(raw) is list and len(raw) == 1 and raw[0] == UNAVAILABLE
    return raw == UNAVAILABLE


def _convert(converter: enc.Converter | enc.Mismatch, raw: Any) -> Any:
    if isinstance(converter, enc.Mismatch):
        raise _Bad(converter.reason)
    try:
        return converter(raw)
    except enc.DecodeError as exc:
        raise _Bad(str(exc)) from None


def _sequence_part(envelope: dict, path: str, kind: str) -> int | str:
    node: Any = envelope
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if kind == "bigint" and type(node) is int and -(2**63) <= node < 2**63:
        return node
    if kind == "string" and type(node) is str:
        return node
    if kind == "binlog" and type(node) is str:
        number = node.rpartition(".")[2]
        if number.isdigit() and number.isascii() and len(number) < 19:
            return int(number)
    expected = {"bigint": "a bigint", "string": "a string", "binlog": "a binlog file name"}[kind]
    raise _Bad(f"sequence field '{path}' is missing or not {expected}")


def _source_micros(envelope: dict) -> int | None:
    """`source.ts_ms` in microseconds; None when absent or outside years 1–9999."""
    source = envelope.get("source")
    millis = source.get("ts_ms") if isinstance(source, dict) else None
    if type(millis) is not int or not -62_135_596_800_000 <= millis <= 253_402_300_799_999:
        return None
    return millis * 1000


# --- Arrow and Spark ----------------------------------------------------------------------------


def spark_data_type(declared: str) -> T.DataType:
    """The Spark type a declared column is stored as (`encodings.spark_type`)."""
    item = enc.array_item(declared)
    if item is not None:
        return T.ArrayType(spark_data_type(item))
    shape = enc.decimal_shape(declared)
    if shape is not None:
        return T.DecimalType(*shape)
    return {
        "string": T.StringType(),
        "time": T.StringType(),
        "boolean": T.BooleanType(),
        "int": T.IntegerType(),
        "bigint": T.LongType(),
        "double": T.DoubleType(),
        "float": T.FloatType(),
        "timestamp": T.TimestampType(),
        "date": T.DateType(),
        "binary": T.BinaryType(),
    }[declared]


def arrow_type(declared: str) -> pa.DataType:
    item = enc.array_item(declared)
    if item is not None:
        return pa.list_(arrow_type(item))
    shape = enc.decimal_shape(declared)
    if shape is not None:
        return pa.decimal128(*shape)
    return {
        "string": pa.string(),
        "time": pa.string(),
        "boolean": pa.bool_(),
        "int": pa.int32(),
        "bigint": pa.int64(),
        "double": pa.float64(),
        "float": pa.float32(),
        "timestamp": pa.timestamp("us", tz="UTC"),
        "date": pa.date32(),
        "binary": pa.binary(),
    }[declared]


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
    (`added_column_types`): a change may lack one (its default), but a value must convert to
    its type.
    `defaults`: what a change written before a column existed gives it (`DecodePlan.of`).
    """
    plan = DecodePlan.of(spec, hour_key=hour_key, added_columns=added_columns, defaults=defaults)

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        decoder = RecordDecoder(plan)
        for batch in batches:
            yield decoder.decode_batch(batch)

    return records.select(*decoder_input(records, plan)).mapInArrow(run, plan.spark_schema())


_KAFKA_COLUMNS = ("key", "value", "topic", "partition", "offset", "timestamp")


def old_key_value(headers: list | None) -> bytes | None:
    """The value of a record's first `__debezium.oldkey` header that has one: the one header
    the decoder reads. `decoder_input` picks the same one in Spark (tests/cdc_assets/
    test_decoder_input.py holds the two to the same rows)."""
    for header in headers or ():
        if header.get("key") == OLD_KEY_HEADER and header.get("value") is not None:
            return header["value"]
    return None


def decoder_input(records: DataFrame, plan: DecodePlan) -> list[Column]:
    """What the Python workers get of Spark's Kafka rows: every column but the headers, and, for
    a table with toasted columns, the value of the first `__debezium.oldkey` header that has
    one (`OLD_KEY_COLUMN`, binary, null when there is none: the header `old_key_value` picks).
    The headers array stays in the JVM: Spark's Arrow conversion of an array column costs about
    what reading the records from Kafka does, even when every array is empty
    (docs/benchmark.md, "Where ours spends its time")."""
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
    spark: SparkSession,
    records: pa.RecordBatch,
    spec: TableSpec,
    *,
    hour_key: str,
    added_columns: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> DataFrame:
    """`decode` of a small slice read in the driver (`read.read_slice_locally`): the same
    decoder, run here; the frame is a local relation, so reading it costs no Kafka job."""
    plan = DecodePlan.of(spec, hour_key=hour_key, added_columns=added_columns, defaults=defaults)
    decoded = RecordDecoder(plan).decode_batch(records)
    return spark.createDataFrame(pa.Table.from_batches([decoded]), schema=plan.spark_schema())
