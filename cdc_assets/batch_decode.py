"""A batch of Kafka records → the decoded Arrow batch, mostly a column at a time.

`RecordDecoder.decode` reads one record exactly (the CDC rules are in `cdc_assets.decode`). Done
record by record, its checks cost several times the parse. So a batch is read in two passes:

- The fast pass parses each value once (msgspec, into the envelope fields the decoder uses),
  takes the records whose shape is the common one (an insert, update, snapshot read or delete
  in the table's config or a schema seen before, its key present, no header to follow), and
  converts their values a column at a time (`column_encodings`, else value by value with the
  exact converters). A record that anything about is unusual for (a value that doesn't convert,
  a key naming another row, a truncate, a tombstone, JSON the fast parser refuses) is left out.
- The exact pass runs `RecordDecoder.decode` on the records left out: every error and its
  reason comes from it.

Both passes produce the same rows for a record (tests/cdc_assets/test_batch_decode.py checks
the whole batch against the exact pass alone), and the batch's tally and source shape add up
what both saw.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import pyarrow as pa

from cdc_assets import decode as d
from cdc_assets import encodings as enc
from cdc_assets.column_encodings import column_converter
from cdc_assets.tally import KeyRange, Tally

if TYPE_CHECKING:
    from cdc_assets.decode import RecordDecoder, _RowPlan

_MISSING = msgspec.UNSET  # a column the record's row lacks
_APPLIED_OPS = ("c", "u", "r")
# The JSON kind of a parsed value by its Python type (`encodings.json_kind`).
_KIND_OF = {
    type(None): "null",
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
}
_PARSE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError)


@dataclass
class _Input:
    """The batch's Kafka columns as Python lists."""

    batch: pa.RecordBatch
    keys: list
    values: list
    partitions: list
    offsets: list
    headers: list

    @classmethod
    def of(cls, batch: pa.RecordBatch) -> _Input:
        count = batch.num_rows
        names = batch.schema.names
        # The one header the decoder reads, whichever way the slice was read: every header (a
        # slice read in the driver, `read.read_slice_locally`) or its value alone (Spark's read,
        # `d.decoder_input`). So other headers send no record to the exact pass.
        if "headers" in names:
            old_keys = [d.old_key_value(h) for h in batch.column("headers").to_pylist()]
        elif d.OLD_KEY_COLUMN in names:
            old_keys = batch.column(d.OLD_KEY_COLUMN).to_pylist()
        else:
            old_keys = [None] * count
        headers = [
            None if old is None else [{"key": d.OLD_KEY_HEADER, "value": old}] for old in old_keys
        ]
        return cls(
            batch,
            batch.column("key").to_pylist(),
            batch.column("value").to_pylist(),
            batch.column("partition").to_pylist(),
            batch.column("offset").to_pylist(),
            headers,
        )


@dataclass
class _Seen:
    """What the batch's records told of the source's columns (`SourceShape`), gathered."""

    shape: d.SourceShape = field(default_factory=d.SourceShape)
    json_kinds: dict[str, set[str]] = field(default_factory=dict)
    # (column, partition) → (offset, kind) of the newest non-null value.
    json_newest: dict[tuple[str, int], tuple[int, str]] = field(default_factory=dict)

    def kind(self, name: str, kind: str, partition: int, offset: int) -> None:
        self.json_kinds.setdefault(name, set()).add(kind)
        if kind != "null":
            newest = self.json_newest.get((name, partition))
            if newest is None or offset > newest[0]:
                self.json_newest[(name, partition)] = (offset, kind)


@dataclass
class _Part:
    """Decoded rows of some of the batch's records: their row numbers, ascending, and one
    array per output column (the schema's, SHAPE and TALLY excepted)."""

    rows: list[int]
    arrays: list[pa.Array]


def decode_batch(
    decoder: RecordDecoder, batch: pa.RecordBatch, *, fast: bool = True
) -> pa.RecordBatch:
    """`RecordDecoder.decode_batch`: see the module docstring. `fast=False`: the exact pass
    alone, for every record."""
    with _no_cycle_collection():
        return _decode_batch(decoder, batch, fast=fast)


@contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """A batch builds a few objects per value and keeps them until its arrays are made, none
    of them in a reference cycle: Python's cycle collector, run every few hundred allocations,
    would scan them again and again (a third of the batch's time, measured)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _decode_batch(decoder: RecordDecoder, batch: pa.RecordBatch, *, fast: bool) -> pa.RecordBatch:
    plan = decoder.plan
    schema = d.arrow_schema(plan)
    records = _Input.of(batch)
    count = batch.num_rows
    tally = Tally(records=count)
    key_range = KeyRange(decoder._ranged_keys)
    seen = _Seen()
    if fast:
        parts, left_out = _FastPass(decoder, records, schema).run(tally, key_range, seen)
    else:
        parts, left_out = [], list(range(count))
    if left_out:
        parts.append(_exact_part(decoder, records, left_out, schema, tally, key_range, seen))
    decoder._add_json_kinds(seen.shape, seen.json_kinds, seen.json_newest)
    shapes, tallies = [None] * count, [None] * count
    if count and (seen.shape.schemas or seen.shape.fields):
        shapes[0] = seen.shape.to_json()
    if count:
        tally.low, tally.high = key_range.encoded()
        tallies[0] = tally.to_json()
    columns = _assemble(parts, count, schema)
    columns += [pa.array(shapes, pa.string()), pa.array(tallies, pa.string())]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _assemble(parts: list[_Part], count: int, schema: pa.Schema) -> list[pa.Array]:
    """The parts' rows in the batch's order."""
    width = len(schema) - 2
    parts = [p for p in parts if p.rows]
    if not parts:
        return [pa.array([], schema.field(n).type) for n in range(width)]
    if len(parts) == 1:
        return parts[0].arrays
    rows = np.concatenate([np.asarray(p.rows, dtype=np.int64) for p in parts])
    order = pa.array(np.argsort(rows, kind="stable"))
    return [pa.concat_arrays([p.arrays[n] for p in parts]).take(order) for n in range(width)]


# --- the fast pass -----------------------------------------------------------------------------


@dataclass
class _Group:
    """Records of one kind (changes or deletes) read by one row plan."""

    row_plan: _RowPlan
    delete: bool
    rows: list[int] = field(default_factory=list)
    cells: list[list] = field(default_factory=list)  # per record, the plan columns' raw values
    ops: list[str] = field(default_factory=list)
    sequences: list[list] = field(default_factory=list)
    source_ts: list = field(default_factory=list)
    # Records whose `after` holds columns the plan doesn't: their row.
    extra: dict[int, dict] = field(default_factory=dict)
    # Records whose `after` lacks columns that did not exist when they were written (they take
    # the column's default, `decode.absent_at_the_time`): which.
    absent: dict[int, list[int]] = field(default_factory=dict)


class _FastPass:
    def __init__(self, decoder: RecordDecoder, records: _Input, schema: pa.Schema) -> None:
        self.decoder, self.records, self.schema = decoder, records, schema
        self.plan = decoder.plan
        self.names = decoder._names
        self.width = len(self.names)
        self.envelopes = _envelope_decoders(self.plan)
        self.any_json = msgspec.json.Decoder()

    def run(self, tally: Tally, key_range: KeyRange, seen: _Seen) -> tuple[list[_Part], list[int]]:
        groups, left_out = self._group()
        parts = []
        for group in groups.values():
            part = self._convert(group, left_out, tally, key_range, seen)
            if part is not None:
                parts.append(part)
        return parts, sorted(left_out)

    # -- pass 1: parse and sort the records --

    def _group(self) -> tuple[dict[tuple[int, bool], _Group], list[int]]:
        decoder, plan, records = self.decoder, self.plan, self.records
        by_schema, configured = decoder._by_schema, decoder._configured
        typed, untyped = self.envelopes
        decode_typed, decode_untyped, any_json = typed.decode, untyped.decode, self.any_json.decode
        names, width, pk_index = self.names, self.width, decoder._pk_index
        row_cells = attrgetter(*[f"c{n}" for n in range(width)]) if width > 1 else None
        sequence = _sequence_reader(plan)
        missing = list(repeat(_MISSING, width))
        max_bytes, toasted = plan.max_record_bytes, bool(plan.toasted)
        headers = records.headers
        groups: dict[tuple[int, bool], _Group] = {}
        left_out: list[int] = []
        skip = left_out.append
        for i, value in enumerate(records.values):
            if value is None or len(value) > max_bytes:
                skip(i)
                continue
            if value.startswith(d._SCHEMA_PREFIX):
                prefix = d._schema_prefix(value)
                row_plan = by_schema.get(prefix) if prefix is not None else None
                if row_plan is None:
                    row_plan = self._row_plan(value)
                    if row_plan is None:
                        skip(i)
                        continue
                start = len(d._SCHEMA_PREFIX) + len(prefix) + len(d._PAYLOAD_SEPARATOR)
                payload = value[start:-1]
            else:
                row_plan, payload = configured, value
            extra = None
            try:
                envelope = decode_typed(payload)
            except msgspec.ValidationError:
                # `after` holds a column the plan doesn't know (or is no object): as a dict.
                try:
                    envelope = decode_untyped(payload)
                except _PARSE_ERRORS:
                    skip(i)
                    continue
                extra = envelope.after
                if type(extra) is not dict:
                    skip(i)
                    continue
            except _PARSE_ERRORS:
                skip(i)
                continue
            op = envelope.op
            delete = op == "d"
            gone = None
            if delete:
                try:
                    row = any_json(envelope.before)
                except _PARSE_ERRORS:
                    skip(i)
                    continue
                if type(row) is not dict:
                    row = {}
                cells = list(map(row.get, names))
                if any(cells[k] is None for k in pk_index):
                    skip(i)  # the key from the Kafka key: the exact pass
                    continue
                extra = None
            elif op in _APPLIED_OPS:
                after = envelope.after
                if after is None or (toasted and headers[i]):
                    skip(i)
                    continue
                if extra is not None:
                    cells = list(map(extra.get, names, missing))
                elif row_cells is None:
                    cells = [after.c0]
                else:
                    cells = list(row_cells(after))
                if any(cells[k] is None or cells[k] is _MISSING for k in pk_index):
                    skip(i)
                    continue
                if _MISSING in cells:
                    gone = [n for n, cell in enumerate(cells) if cell is _MISSING]
                    if not row_plan.may_lack.issuperset(gone):
                        skip(i)
                        continue
                    for n in gone:
                        cells[n] = None
            else:
                skip(i)
                continue
            try:
                parts = sequence(envelope)
            except d._Bad:
                skip(i)
                continue
            group = groups.get((id(row_plan), delete))
            if group is None:
                group = groups[(id(row_plan), delete)] = _Group(row_plan, delete)
            if extra is not None:
                group.extra[len(group.rows)] = extra
            if gone:
                group.absent[len(group.rows)] = gone
            group.rows.append(i)
            group.cells.append(cells)
            group.ops.append(op)
            group.sequences.append(parts)
            group.source_ts.append(_source_micros(envelope.source))
        return groups, left_out

    # -- pass 2: convert a group a column at a time --

    def _convert(
        self,
        group: _Group,
        left_out: list[int],
        tally: Tally,
        key_range: KeyRange,
        seen: _Seen,
    ) -> _Part | None:
        plan, decoder, row_plan = self.plan, self.decoder, group.row_plan
        size = len(group.rows)
        raw_columns = [list(column) for column in zip(*group.cells, strict=True)]
        bad: set[int] = set()
        columns: list[list | pa.Array] = []
        has: dict[int, list[bool]] = {}
        toasted = {decoder._index[c]: t for t, c in enumerate(plan.toasted)}
        for n, raw in enumerate(raw_columns):
            encoding = row_plan.encodings[n]
            declared = plan.columns[n][1]
            converter = row_plan.converters[n]
            fast = None
            if not isinstance(converter, enc.Mismatch):
                rule = column_converter(declared, encoding)
                fast = rule(raw) if rule is not None else None
            if fast is not None:
                columns.append(fast)
                if n in toasted:
                    has[n] = [not group.delete] * size
                continue
            values, flags = _one_by_one(raw, converter, encoding, group.delete, bad, n in toasted)
            columns.append(values)
            if n in toasted:
                has[n] = flags
        key_columns = [_as_list(columns[k]) for k in decoder._pk_index]
        if group.delete:  # a key value that didn't convert is taken from the Kafka key
            for values in key_columns:
                bad.update(j for j, value in enumerate(values) if value is None)
        self._check_keys(group, key_columns, bad)
        if bad:
            left_out.extend(group.rows[j] for j in sorted(bad))
            keep = [j for j in range(size) if j not in bad]
            if not keep:
                return None
            group = _subset(group, keep)
            columns = [_take(c, keep) for c in columns]
            raw_columns = [[c[j] for j in keep] for c in raw_columns]
            key_columns = [[c[j] for j in keep] for c in key_columns]
            has = {n: [f[j] for j in keep] for n, f in has.items()}
            size = len(keep)
        self._count(group, key_columns, tally, key_range)
        if not group.delete:
            self._note_shape(group, raw_columns, seen)
        if group.absent and plan.defaults:
            columns = _with_defaults(columns, group.absent, plan)
        return self._part(group, columns, has)

    def _check_keys(self, group: _Group, key_columns: list[list], bad: set[int]) -> None:
        """The Kafka key must name the row's primary key (`RecordDecoder._check_kafka_key`)."""
        decoder, keys = self.decoder, self.records.keys
        configured = decoder._configured
        named: dict[int, tuple[_RowPlan, list[tuple[int, dict]]]] = {}
        for j, i in enumerate(group.rows):
            key = keys[i]
            if key is None:
                continue
            key_plan = configured
            try:
                if key.startswith(d._SCHEMA_PREFIX):
                    key_plan = self._key_plan(key)
                    if key_plan is None:
                        bad.add(j)
                        continue
                    start = len(d._SCHEMA_PREFIX) + len(d._schema_prefix(key))
                    document = self.any_json.decode(key[start + len(d._PAYLOAD_SEPARATOR) : -1])
                else:
                    document = self.any_json.decode(key)
                    if d._is_wrapped(document):
                        bad.add(j)
                        continue
            except _PARSE_ERRORS:
                bad.add(j)
                continue
            if type(document) is dict:
                named.setdefault(id(key_plan), (key_plan, []))[1].append((j, document))
        # Each primary key column the keys name, converted a column at a time where it can be.
        for key_plan, items in named.values():
            for k, (pk, n) in enumerate(zip(self.plan.primary_key, decoder._pk_index, strict=True)):
                converter = key_plan.converters[n]
                if isinstance(converter, enc.Mismatch):
                    continue  # a key value that doesn't convert names nothing
                raw = [document.get(pk) for _, document in items]
                rule = column_converter(self.plan.columns[n][1], key_plan.encodings[n])
                converted = rule(raw) if rule is not None else None
                if converted is None:
                    converted = [_or_none(converter, value) for value in raw]
                row_values = key_columns[k]
                for (j, _), in_key in zip(items, _as_list(converted), strict=True):
                    if in_key is not None and in_key != row_values[j]:
                        bad.add(j)

    def _key_plan(self, key: bytes) -> _RowPlan | None:
        """The plan of a wrapped key's schema, learnt from the first key that has it."""
        decoder = self.decoder
        prefix = d._schema_prefix(key)
        if prefix is None:
            return None
        plan = decoder._by_key_schema.get(prefix)
        if plan is None:
            try:
                document = self.any_json.decode(key)
            except _PARSE_ERRORS:
                return None
            if d._is_wrapped(document):
                decoder._key_plan(key, document["schema"])
            plan = decoder._by_key_schema.get(prefix)
        return plan

    def _row_plan(self, value: bytes) -> _RowPlan | None:
        """The plan of a wrapped value's schema, learnt from the first record that has it."""
        decoder = self.decoder
        prefix = d._schema_prefix(value)
        if prefix is None:
            return None
        plan = decoder._by_schema.get(prefix)
        if plan is None:
            try:
                decoder._parse(value)
            except d._Bad:
                return None
            plan = decoder._by_schema.get(prefix)
        return plan

    def _count(
        self, group: _Group, key_columns: list[list], tally: Tally, key_range: KeyRange
    ) -> None:
        size = len(group.rows)
        tally.changes += size
        if group.delete:
            tally.deletes += size
        stamps = [ts for ts in group.source_ts if ts is not None]
        if stamps:
            newest = max(stamps)
            if tally.newest_source_us is None or newest > tally.newest_source_us:
                tally.newest_source_us = newest
        ranged = {name for name, _ in key_range.columns}
        for pk, values in zip(self.plan.primary_key, key_columns, strict=True):
            if pk in ranged and values:
                key_range.add({pk: min(values)})
                key_range.add({pk: max(values)})

    def _note_shape(self, group: _Group, raw_columns: list[list], seen: _Seen) -> None:
        """What the group's change records told of the source's columns, as the exact pass
        notes it record by record (`RecordDecoder._change_row`)."""
        row_plan = group.row_plan
        if row_plan.shape.schemas == {True}:
            seen.shape.merge(row_plan.shape)
            return
        partitions, offsets = self.records.partitions, self.records.offsets
        rows = group.rows
        every = set(map(partitions.__getitem__, rows))
        absent = {n for gone in group.absent.values() for n in gone}
        for n, raw in enumerate(raw_columns):
            name = self.names[n]
            where = None  # the group's record of each value (None: one value per record)
            if n in absent:  # a column the record lacks is no value, not a null
                where = [j for j in range(len(raw)) if n not in group.absent.get(j, ())]
                raw = [raw[j] for j in where]
                if not raw:
                    continue
            kinds = seen.json_kinds.setdefault(name, set())
            kinds.update(_KIND_OF.get(kind, "object") for kind in set(map(type, raw)))
            found: set[int] = set()
            for k in range(len(raw) - 1, -1, -1):
                value = raw[k]
                if value is None:
                    continue
                i = rows[k if where is None else where[k]]
                if partitions[i] in found:
                    continue
                found.add(partitions[i])
                seen.kind(name, _KIND_OF.get(type(value), "object"), partitions[i], offsets[i])
                if found == every:
                    break
        for j, row in group.extra.items():
            i = rows[j]
            for name, value in row.items():
                if name not in self.decoder._index:
                    seen.kind(name, enc.json_kind(value), partitions[i], offsets[i])

    def _part(self, group: _Group, columns: list, has: dict[int, list[bool]]) -> _Part:
        plan, schema, batch = self.plan, self.schema, self.records.batch
        rows = pa.array(group.rows, pa.int64())
        size = len(group.rows)
        keep_raw = plan.keep_raw
        key = batch.column("key").take(rows) if keep_raw else pa.nulls(size, pa.binary())
        value = batch.column("value").take(rows) if keep_raw else pa.nulls(size, pa.binary())
        partition = batch.column("partition").take(rows).cast(pa.int32())
        offset = batch.column("offset").take(rows).cast(pa.int64())
        sequence_type = schema.field(d.SEQUENCE).type
        parts = list(zip(*group.sequences, strict=True)) if group.sequences else []
        sequence = pa.StructArray.from_arrays(
            [
                *[
                    pa.array(list(values), sequence_type.field(n).type)
                    for n, values in enumerate(parts)
                ],
                partition,
                offset,
            ],
            fields=list(sequence_type),
        )
        data = []
        for (name, _), values in zip(plan.columns, columns, strict=True):
            arrow_type = schema.field(name).type
            if isinstance(values, pa.Array):
                data.append(values if values.type == arrow_type else values.cast(arrow_type))
            else:
                data.append(pa.array(values, arrow_type))
        toasted_flags = [
            pa.array(has.get(decoder_index, [False] * size), pa.bool_())
            for decoder_index in (self.decoder._index[c] for c in plan.toasted)
        ]
        arrays = [
            key,
            value,
            batch.column("topic").take(rows).cast(pa.string()),
            *data,
            pa.array(group.ops, pa.string()),
            sequence,
            pa.array(group.source_ts, pa.timestamp("us", tz="UTC")),
            partition,
            offset,
            batch.column("timestamp").take(rows).cast(pa.timestamp("us", tz="UTC")),
            pa.array([plan.hour_key] * size, pa.string()),
            pa.array([group.delete] * size, pa.bool_()),
            pa.nulls(size, pa.string()),
            pa.array([False] * size, pa.bool_()),
            *toasted_flags,
            *([pa.nulls(size, schema.field(d.MOVED_FROM).type)] if plan.toasted else []),
        ]
        return _Part(group.rows, arrays)


def _with_defaults(
    columns: list[list | pa.Array], absent: dict[int, list[int]], plan: d.DecodePlan
) -> list[list | pa.Array]:
    """The group's columns with each absent cell holding its column's default (as
    `RecordDecoder._change_row` gives it): the change was written before the column existed."""
    columns = list(columns)
    for j, gone in absent.items():
        for n in gone:
            default = plan.default(n)
            if default is None:
                continue
            if isinstance(columns[n], pa.Array):
                columns[n] = columns[n].to_pylist()
            columns[n][j] = default
    return columns


def _one_by_one(
    raw: list,
    converter: Any,
    encoding: enc.Encoding,
    delete: bool,
    bad: set[int],
    toasted: bool,
) -> tuple[list, list[bool]]:
    """A column value by value, as `RecordDecoder._change_row` (or `_delete_row`) reads it:
    a value that fails marks its record bad (a delete's becomes null)."""
    values: list = []
    flags: list[bool] = []
    mismatch = isinstance(converter, enc.Mismatch)
    for j, cell in enumerate(raw):
        if cell is None:
            values.append(None)
            flags.append(not delete)
            continue
        if d._is_unavailable(cell, encoding):
            values.append(None)
            flags.append(False)
            if not delete and not toasted:
                bad.add(j)
            continue
        if mismatch:
            values.append(None)
            flags.append(False)
            if not delete:
                bad.add(j)
            continue
        try:
            values.append(converter(cell))
            flags.append(not delete)
        except enc.DecodeError:
            values.append(None)
            flags.append(False)
            if not delete:
                bad.add(j)
    return values, flags


def _or_none(converter: Any, value: Any) -> Any:
    """A key value converted, or None where there is none or it doesn't convert."""
    if value is None:
        return None
    try:
        return converter(value)
    except enc.DecodeError:
        return None


def _as_list(column: list | pa.Array) -> list:
    return column.to_pylist() if isinstance(column, pa.Array) else column


def _take(column: list | pa.Array, keep: list[int]) -> list | pa.Array:
    if isinstance(column, pa.Array):
        return column.take(pa.array(keep, pa.int64()))
    return [column[j] for j in keep]


def _subset(group: _Group, keep: list[int]) -> _Group:
    position = {j: k for k, j in enumerate(keep)}
    return _Group(
        group.row_plan,
        group.delete,
        [group.rows[j] for j in keep],
        [group.cells[j] for j in keep],
        [group.ops[j] for j in keep],
        [group.sequences[j] for j in keep],
        [group.source_ts[j] for j in keep],
        {position[j]: row for j, row in group.extra.items() if j in position},
        {position[j]: gone for j, gone in group.absent.items() if j in position},
    )


def _sequence_reader(plan: d.DecodePlan):
    """The sequence parts of a parsed envelope, as `decode._sequence_part` reads them (it
    raises `_Bad` the same way); `source.<field>` paths read without building a dict."""
    readers = []
    for path, kind in plan.sequence:
        root, *rest = path.split(".")
        attribute = _field_name(root)
        if root == "source" and len(rest) == 1 and kind == "bigint":
            readers.append(_source_bigint(rest[0], path))
        else:
            readers.append(_any_part(attribute, root, path, kind))

    def read(envelope: Any) -> list:
        return [reader(envelope) for reader in readers]

    return read


def _source_bigint(name: str, path: str):
    def read(envelope: Any) -> int:
        source = envelope.source
        value = source.get(name) if type(source) is dict else None
        if type(value) is int and -(2**63) <= value < 2**63:
            return value
        return d._sequence_part({}, path, "bigint")  # raises: missing or not a bigint

    return read


def _any_part(attribute: str, root: str, path: str, kind: str):
    def read(envelope: Any) -> int | str:
        return d._sequence_part({root: getattr(envelope, attribute)}, path, kind)

    return read


def _source_micros(source: Any) -> int | None:
    """`decode._source_micros` of an envelope's `source`."""
    millis = source.get("ts_ms") if type(source) is dict else None
    if type(millis) is not int or not -62_135_596_800_000 <= millis <= 253_402_300_799_999:
        return None
    return millis * 1000


def _field_name(root: str) -> str:
    """The envelope struct's attribute for a top-level field (renamed when no identifier)."""
    if root in _ENVELOPE_FIELDS or (root.isidentifier() and not root.startswith("seq_")):
        return root
    return f"seq_{root.encode().hex()}"


_ENVELOPE_FIELDS = ("op", "after", "before", "source")


def _envelope_decoders(plan: d.DecodePlan) -> tuple[msgspec.json.Decoder, msgspec.json.Decoder]:
    """Parsers of an envelope into the fields the decoder reads; the rest of the JSON is
    checked but not built (`before` only for a delete). The first reads `after` as a struct of
    the plan's columns (absent ones UNSET, another column refused), the second as a dict."""
    names = [name for name, _ in plan.columns]
    row = msgspec.defstruct(
        "Row",
        [(f"c{n}", Any, msgspec.UNSET) for n in range(len(names))],
        rename={f"c{n}": name for n, name in enumerate(names)},
        forbid_unknown_fields=True,
    )
    decoders = []
    for after in (row | None, Any):
        fields: list[tuple] = [
            ("op", Any, None),
            ("after", after, None),
            ("before", msgspec.Raw, msgspec.Raw(b"null")),
            ("source", Any, None),
        ]
        rename = {}
        for path, _ in plan.sequence:
            root = path.split(".")[0]
            if any(f[0] == _field_name(root) for f in fields):
                continue
            fields.append((_field_name(root), Any, None))
            rename[_field_name(root)] = root
        envelope = msgspec.defstruct("Envelope", fields, rename=rename or None)
        decoders.append(msgspec.json.Decoder(envelope))
    return decoders[0], decoders[1]


# --- the exact pass ----------------------------------------------------------------------------


def _exact_part(
    decoder: RecordDecoder,
    records: _Input,
    rows: Sequence[int],
    schema: pa.Schema,
    tally: Tally,
    key_range: KeyRange,
    seen: _Seen,
) -> _Part:
    """The records `rows` decoded one by one (`RecordDecoder.decode`)."""
    plan = decoder.plan
    width = len(decoder._names)
    keys, raw = records.keys, records.values
    partitions, offsets, headers = records.partitions, records.offsets, records.headers
    columns: list[list] = [[] for _ in range(width)]
    out_keys, out_values, ops, sequences, source_ts, errors = [], [], [], [], [], []
    has_columns: list[list] = [[] for _ in plan.toasted]
    moved: list = []
    no_values, no_flags = [None] * width, [False] * len(plan.toasted)
    parts = [path.replace(".", "_") for path, _ in plan.sequence]
    for i in rows:
        value, values, meta, error = raw[i], no_values, {}, None
        decoder.seen = None
        if value is not None:
            try:
                values, meta = decoder.decode(keys[i], value, headers[i])
            except d._Bad as exc:
                error, values, meta = str(exc), no_values, {}
        decoder._count(tally, key_range, value, values, meta, error, partitions[i], offsets[i])
        for n in range(width):
            columns[n].append(values[n])
        ops.append(meta.get("op"))
        sequence = meta.get("sequence")
        if sequence is None:
            sequences.append(None)
        else:
            entry = dict(zip(parts, sequence, strict=True))
            entry["kafka_partition"], entry["kafka_offset"] = partitions[i], offsets[i]
            sequences.append(entry)
        source_ts.append(meta.get("source_ts"))
        errors.append(error)
        for n, flag in enumerate(meta.get("has") or no_flags):
            has_columns[n].append(flag)
        moved.append(meta.get("moved_from"))
        keep = error is not None or plan.keep_raw
        out_keys.append(keys[i] if keep else None)
        out_values.append(value if keep else None)
        if isinstance(decoder.seen, d.SourceShape):
            seen.shape.merge(decoder.seen)
        elif decoder.seen:
            for name, kind in decoder.seen.items():
                seen.kind(name, kind, partitions[i], offsets[i])
    batch = records.batch
    taken = pa.array(list(rows), pa.int64())
    arrays = [
        pa.array(out_keys, pa.binary()),
        pa.array(out_values, pa.binary()),
        batch.column("topic").take(taken).cast(pa.string()),
        *[
            pa.array(values, schema.field(name).type)
            for (name, _), values in zip(plan.columns, columns, strict=True)
        ],
        pa.array(ops, pa.string()),
        pa.array(sequences, schema.field(d.SEQUENCE).type),
        pa.array(source_ts, pa.timestamp("us", tz="UTC")),
        batch.column("partition").take(taken).cast(pa.int32()),
        batch.column("offset").take(taken).cast(pa.int64()),
        batch.column("timestamp").take(taken).cast(pa.timestamp("us", tz="UTC")),
        pa.array([plan.hour_key] * len(rows), pa.string()),
        pa.array([op == "d" for op in ops], pa.bool_()),
        pa.array(errors, pa.string()),
        batch.column("value").take(taken).is_null(),
        *[pa.array(flags, pa.bool_()) for flags in has_columns],
        *([pa.array(moved, schema.field(d.MOVED_FROM).type)] if plan.toasted else []),
    ]
    return _Part(list(rows), arrays)
