"""The exact pass: one record at a time, every rule checked, every error's reason named.

`RecordDecoder.decode` reads one Debezium record (the rules are in the package docstring); the
fast pass (`fast.py`) leaves it every record that is anything but common, and `exact_part`
decodes those into rows of the batch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pyarrow as pa

from cdc_assets.columns import MOVED_FROM, SEQUENCE, TRUNCATE
from cdc_assets.decoding import values as enc
from cdc_assets.decoding.cells import change_value, convert, delete_value, header_value
from cdc_assets.decoding.envelope import (
    OLD_KEY_HEADER,
    OPS,
    BadRecord,
    is_wrapped,
    old_key_value,
    payload_of,
    schema_prefix,
    sequence_part,
    source_micros,
)
from cdc_assets.decoding.parts import BatchInput, Part, Seen
from cdc_assets.decoding.plan import DecodePlan, RowPlan, RowPlans
from cdc_assets.decoding.shape import SourceShape
from cdc_assets.decoding.tally import KeyRange, Tally


class RecordDecoder:
    """Decodes Kafka records of one table (see the module docstring); one per Spark task."""

    def __init__(self, plan: DecodePlan) -> None:
        self.plan = plan
        self.plans = RowPlans(plan)
        declared = plan.declared
        self._ranged_key_index = [
            (plan.index[k], (k, declared[k])) for k, _ in KeyRange(plan.ranged_keys).columns
        ]
        # What the last record's row told of the source's columns (`SourceShape`, or column →
        # JSON kind without a schema); None for records that carry no row.
        self.seen: SourceShape | dict[str, str] | None = None

    def parse(self, value: bytes) -> tuple[RowPlan, Any]:
        """The row plan and the envelope of a record's value; raises `BadRecord`."""
        # A schema seen before: parse only the payload (the schema is most of the bytes).
        prefix = schema_prefix(value)
        plan = self.plans.known_value(prefix)
        if plan is not None:
            try:
                return plan, json.loads(payload_of(value, prefix))
            except ValueError:
                pass  # the whole value decides below, and names the problem
        try:
            document = json.loads(value)
        except (ValueError, UnicodeDecodeError):
            raise BadRecord("value is not valid JSON") from None
        if not is_wrapped(document):
            return self.plans.configured, document
        return self.plans.learn_value(value, document["schema"]), document["payload"]

    # -- records --

    def decode(
        self, key: bytes | None, value: bytes | None, headers: list | None
    ) -> tuple[list[Any], dict[str, Any]]:
        """One record → (column values, metadata); raises `BadRecord` with the reason."""
        plan = self.plan
        if len(value) > plan.max_record_bytes:
            raise BadRecord(f"value is larger than max_record_bytes ({plan.max_record_bytes})")
        row_plan, envelope = self.parse(value)
        if not isinstance(envelope, dict):
            raise BadRecord("value is not a JSON object (a Debezium envelope)")
        op = envelope.get("op")
        if op is None:
            raise BadRecord("envelope has no 'op' field")
        if op not in OPS:
            raise BadRecord("unknown op")
        meta: dict[str, Any] = {"op": op, "moved_from": None}
        meta["sequence"] = [sequence_part(envelope, path, kind) for path, kind in plan.sequence]
        meta["source_ts"] = source_micros(envelope.get("source"))
        values: list[Any] = [None] * len(plan.columns)
        has: list[bool] = [False] * len(plan.toasted)
        meta["has"] = has
        if op == TRUNCATE:
            return values, meta
        if op == "d":
            self._delete_row(row_plan, envelope.get("before"), key, values)
        else:
            self._change_row(row_plan, envelope.get("after"), values, has)
        self._check_kafka_key(key, values)
        if op != "d" and plan.toasted and headers:
            meta["moved_from"] = self._moved_from(headers)
        return values, meta

    def _change_row(self, row_plan: RowPlan, row: Any, values: list, has: list) -> None:
        plan = self.plan
        if not isinstance(row, dict):
            raise BadRecord("change without 'after' row")
        # What the source sent, noted before any value fails: schema drift counts error rows too.
        if row_plan.shape.schemas == {True}:
            self.seen = row_plan.shape
        else:
            self.seen = {name: enc.json_kind(v) for name, v in row.items()}
        for pk in plan.primary_key:
            if row.get(pk) is None:
                raise BadRecord(f"primary key column '{pk}' is missing or invalid")
        toasted = plan.toasted_index
        for n, (name, _) in enumerate(plan.columns):
            if name not in row:
                if n not in row_plan.may_lack:
                    raise BadRecord(
                        f"column '{name}' is missing from 'after' although the record's own "
                        "schema declares it: the record was changed after the connector wrote "
                        "it (a transform that drops fields); keep every field the schema names"
                    )
                # Written before the source table had the column: its default, and a value.
                value, carried = plan.default(n), True
            else:
                value, carried = change_value(
                    name,
                    row[name],
                    row_plan.converters[n],
                    row_plan.encodings[n],
                    toasted=n in toasted,
                )
            values[n] = value
            if n in toasted:
                has[toasted[n]] = carried

    def _delete_row(self, row_plan: RowPlan, before: Any, key: bytes | None, values: list) -> None:
        plan = self.plan
        before = before if isinstance(before, dict) else {}
        for n, (name, _) in enumerate(plan.columns):
            values[n] = delete_value(
                before.get(name), row_plan.converters[n], row_plan.encodings[n]
            )
        missing = [
            pk for pk, n in zip(plan.primary_key, plan.pk_index, strict=True) if values[n] is None
        ]
        if missing:
            from_key = self._key_values(key)
            for pk in missing:
                n = plan.index[pk]
                values[n] = from_key.get(pk)
                if values[n] is None:
                    raise BadRecord(f"primary key column '{pk}' is missing or invalid")

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
        key_plan = self.plans.configured
        if is_wrapped(document):
            key_plan = self._key_plan(key, document["schema"])
            document = document["payload"]
        if not isinstance(document, dict):
            return {}
        found = {}
        for pk, n in zip(self.plan.primary_key, self.plan.pk_index, strict=True):
            raw = document.get(pk)
            if raw is None:
                continue
            try:
                found[pk] = convert(key_plan.converters[n], raw)
            except BadRecord:
                continue
        return found

    def _key_plan(self, key: bytes, schema: Any) -> RowPlan:
        return self.plans.known_key(schema_prefix(key)) or self.plans.learn_key(key, schema)

    def _check_kafka_key(self, key: bytes | None, values: list) -> None:
        # Debezium keys the record by the row's primary key; a key naming another row means the
        # record was routed or rewritten wrongly, and applying it could hit either row.
        for pk, in_key in self._key_values(key).items():
            if in_key != values[self.plan.index[pk]]:
                raise BadRecord(f"the Kafka key's '{pk}' differs from the row's primary key")

    def _moved_from(self, headers: list) -> dict[str, Any] | None:
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
            found[pk] = header_value(document.get(pk), declared[pk])
        if len(found) != len(plan.primary_key) or None in found.values():
            raise BadRecord(
                f"the '{OLD_KEY_HEADER}' header of a primary-key update does not name the old "
                f"key's {', '.join(plan.primary_key)} in Kafka Connect's default header format "
                "(keep the worker's header.converter at its default, SimpleHeaderConverter)"
            )
        return found

    def count(
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
        """Adds one record to its batch's tally (see `tally.py`)."""
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


def exact_part(
    decoder: RecordDecoder,
    records: BatchInput,
    rows: Sequence[int],
    schema: pa.Schema,
    tally: Tally,
    key_range: KeyRange,
    seen: Seen,
) -> Part:
    """The records `rows` decoded one by one (`RecordDecoder.decode`)."""
    out = _ExactRows.of(decoder.plan)
    for i in rows:
        key, value, partition, offset = (
            records.keys[i],
            records.values[i],
            records.partitions[i],
            records.offsets[i],
        )
        values, meta, error = out.no_values, {}, None
        decoder.seen = None
        if value is not None:
            try:
                values, meta = decoder.decode(key, value, records.headers[i])
            except BadRecord as exc:
                error = str(exc)
        decoder.count(tally, key_range, value, values, meta, error, partition, offset)
        out.add(key, value, values, meta, error, partition, offset)
        if isinstance(decoder.seen, SourceShape):
            seen.shape.merge(decoder.seen)
        elif decoder.seen:
            for name, kind in decoder.seen.items():
                seen.kind(name, kind, partition, offset)
    return Part(list(rows), out.arrays(records.batch, rows, schema))


@dataclass
class _ExactRows:
    """The exact pass's rows, a list per output column, filled record by record."""

    plan: DecodePlan
    no_values: list
    columns: list[list]
    has: list[list]
    sequence_parts: list[str]
    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)
    ops: list = field(default_factory=list)
    sequences: list = field(default_factory=list)
    source_ts: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    moved: list = field(default_factory=list)

    @classmethod
    def of(cls, plan: DecodePlan) -> _ExactRows:
        return cls(
            plan,
            no_values=[None] * len(plan.columns),
            columns=[[] for _ in plan.columns],
            has=[[] for _ in plan.toasted],
            sequence_parts=[path.replace(".", "_") for path, _ in plan.sequence],
        )

    def add(
        self, key, value, values: list, meta: dict, error: str | None, partition, offset
    ) -> None:
        """One record's row: its values, metadata and error; its raw bytes when kept."""
        for column, decoded in zip(self.columns, values, strict=True):
            column.append(decoded)
        self.ops.append(meta.get("op"))
        sequence = meta.get("sequence")
        if sequence is not None:
            sequence = dict(zip(self.sequence_parts, sequence, strict=True))
            sequence["kafka_partition"], sequence["kafka_offset"] = partition, offset
        self.sequences.append(sequence)
        self.source_ts.append(meta.get("source_ts"))
        self.errors.append(error)
        for column, flag in zip(self.has, meta.get("has") or [False] * len(self.has), strict=True):
            column.append(flag)
        self.moved.append(meta.get("moved_from"))
        keep = error is not None or self.plan.keep_raw
        self.keys.append(key if keep else None)
        self.values.append(value if keep else None)

    def arrays(self, batch: pa.RecordBatch, rows: Sequence[int], schema: pa.Schema) -> list:
        """The rows as the output schema's arrays (SHAPE and TALLY excepted)."""
        plan = self.plan
        taken = pa.array(list(rows), pa.int64())
        utc = pa.timestamp("us", tz="UTC")
        return [
            pa.array(self.keys, pa.binary()),
            pa.array(self.values, pa.binary()),
            batch.column("topic").take(taken).cast(pa.string()),
            *[
                pa.array(values, schema.field(name).type)
                for (name, _), values in zip(plan.columns, self.columns, strict=True)
            ],
            pa.array(self.ops, pa.string()),
            pa.array(self.sequences, schema.field(SEQUENCE).type),
            pa.array(self.source_ts, utc),
            batch.column("partition").take(taken).cast(pa.int32()),
            batch.column("offset").take(taken).cast(pa.int64()),
            batch.column("timestamp").take(taken).cast(utc),
            pa.array([plan.hour_key] * len(rows), pa.string()),
            pa.array([op == "d" for op in self.ops], pa.bool_()),
            pa.array(self.errors, pa.string()),
            batch.column("value").take(taken).is_null(),
            *[pa.array(flags, pa.bool_()) for flags in self.has],
            *([pa.array(self.moved, schema.field(MOVED_FROM).type)] if plan.toasted else []),
        ]
