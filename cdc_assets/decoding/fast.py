"""The fast pass: a batch's common records read a column at a time.

It parses each value once (msgspec, into the envelope fields the decoder uses), takes the
records whose shape is the common one (an insert, update, snapshot read or delete in the
table's config or a schema seen before, its key present, no header to follow), and converts
their values a column at a time (`column_values`), else value by value by the exact pass's own
rule (`cells`). A record anything about is unusual for (a value that doesn't convert, a key
naming another row, a truncate, a tombstone, JSON the fast parser refuses) is left out, for the
exact pass (`exact.py`), which names every error's reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import msgspec
import pyarrow as pa

from cdc_assets.columns import MOVED_FROM, SEQUENCE
from cdc_assets.decoding import values as enc
from cdc_assets.decoding.cells import change_value, delete_value
from cdc_assets.decoding.column_values import column_converter
from cdc_assets.decoding.envelope import (
    APPLIED_OPS,
    SCHEMA_PREFIX,
    BadRecord,
    is_wrapped,
    payload_of,
    schema_prefix,
    sequence_part,
    source_micros,
)
from cdc_assets.decoding.exact import RecordDecoder
from cdc_assets.decoding.parts import BatchInput, Part, Seen
from cdc_assets.decoding.plan import DecodePlan, RowPlan
from cdc_assets.decoding.tally import KeyRange, Tally

_MISSING = msgspec.UNSET  # a column the record's row lacks
# The JSON kind of a parsed value by its Python type (`values.json_kind`).
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
class _Group:
    """Records of one kind (changes or deletes) read by one row plan."""

    row_plan: RowPlan
    delete: bool
    rows: list[int] = field(default_factory=list)
    cells: list[list] = field(default_factory=list)  # per record, the plan columns' raw values
    ops: list[str] = field(default_factory=list)
    sequences: list[list] = field(default_factory=list)
    source_ts: list = field(default_factory=list)
    # Records whose `after` holds columns the plan doesn't: their row.
    extra: dict[int, dict] = field(default_factory=dict)
    # Records whose `after` lacks columns that did not exist when they were written (they take
    # the column's default, `plan.absent_at_the_time`): which.
    absent: dict[int, list[int]] = field(default_factory=dict)


class FastPass:
    """The fast pass over a batch (see the package docstring): the records of the common shape,
    grouped by row plan and kind, converted a column at a time; the others left out."""

    def __init__(self, decoder: RecordDecoder, records: BatchInput, schema: pa.Schema) -> None:
        self.decoder, self.records, self.schema = decoder, records, schema
        self.plan = decoder.plan
        self.names = decoder.plan.names
        self.width = len(self.names)
        typed, untyped = _envelope_decoders(self.plan)
        self.any_json = msgspec.json.Decoder()
        # A typed `after` struct's cells, in plan order (`_envelope_decoders`).
        self.row_cells = (
            attrgetter(*[f"c{n}" for n in range(self.width)]) if self.width > 1 else None
        )
        self.missing = [_MISSING] * self.width
        # Read once per record: bound here.
        self.decode_typed, self.decode_untyped = typed.decode, untyped.decode
        self.plans, self.pk_index = decoder.plans, self.plan.pk_index
        self.max_bytes, self.toasted = self.plan.max_record_bytes, bool(self.plan.toasted)

    def run(self, tally: Tally, key_range: KeyRange, seen: Seen) -> tuple[list[Part], list[int]]:
        groups, left_out = self._group()
        parts = []
        for group in groups.values():
            part = self._convert(group, left_out, tally, key_range, seen)
            if part is not None:
                parts.append(part)
        return parts, sorted(left_out)

    # -- pass 1: parse and sort the records --

    def _group(self) -> tuple[dict[tuple[int, bool], _Group], list[int]]:
        """The records of the common shape, grouped by row plan and kind; the others left out."""
        sequence = _sequence_reader(self.plan)
        parse, cells_of = self._parse, self._cells
        groups: dict[tuple[int, bool], _Group] = {}
        left_out: list[int] = []
        for i, value in enumerate(self.records.values):
            parsed = parse(value)
            read = cells_of(i, *parsed) if parsed is not None else None
            if read is None:
                left_out.append(i)
                continue
            row_plan, envelope, delete, cells, extra, gone = read
            try:
                parts = sequence(envelope)
            except BadRecord:
                left_out.append(i)
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
            group.ops.append(envelope.op)
            group.sequences.append(parts)
            group.source_ts.append(source_micros(envelope.source))
        return groups, left_out

    def _parse(self, value: bytes | None) -> tuple[RowPlan, Any, dict | None] | None:
        """A record's row plan, its envelope parsed into the fields the decoder reads, and its
        `after` as a dict when that holds a column the plan doesn't; None: not the fast pass's."""
        if value is None or len(value) > self.max_bytes:
            return None
        plans = self.plans
        if value.startswith(SCHEMA_PREFIX):
            prefix = schema_prefix(value)
            row_plan = plans.known_value(prefix) or self._row_plan(value)
            if row_plan is None:
                return None
            payload = payload_of(value, prefix)
        else:
            row_plan, payload = plans.configured, value
        try:
            return row_plan, self.decode_typed(payload), None
        except msgspec.ValidationError:
            pass  # `after` holds a column the plan doesn't know (or is no object): as a dict
        except _PARSE_ERRORS:
            return None
        try:
            envelope = self.decode_untyped(payload)
        except _PARSE_ERRORS:
            return None
        extra = envelope.after
        return (row_plan, envelope, extra) if type(extra) is dict else None

    def _cells(self, i: int, row_plan: RowPlan, envelope: Any, extra: dict | None) -> tuple | None:
        """(row plan, envelope, delete, the plan columns' raw values, extra, the columns the
        change lacks) of a delete or change the fast pass takes; None for any other record."""
        op, pk_index = envelope.op, self.pk_index
        if op == "d":
            try:
                row = self.any_json.decode(envelope.before)
            except _PARSE_ERRORS:
                return None
            cells = list(map(row.get, self.names)) if type(row) is dict else [None] * self.width
            if any(cells[k] is None for k in pk_index):
                return None  # the key from the Kafka key: the exact pass
            return row_plan, envelope, True, cells, None, None
        after = envelope.after
        if op not in APPLIED_OPS or after is None or (self.toasted and self.records.headers[i]):
            return None
        if extra is not None:
            cells = list(map(extra.get, self.names, self.missing))
        elif self.row_cells is None:
            cells = [after.c0]
        else:
            cells = list(self.row_cells(after))
        if any(cells[k] is None or cells[k] is _MISSING for k in pk_index):
            return None
        gone = None
        if _MISSING in cells:
            gone = [n for n, cell in enumerate(cells) if cell is _MISSING]
            if not row_plan.may_lack.issuperset(gone):
                return None
            for n in gone:
                cells[n] = None
        return row_plan, envelope, False, cells, extra, gone

    # -- pass 2: convert a group a column at a time --

    def _convert(
        self,
        group: _Group,
        left_out: list[int],
        tally: Tally,
        key_range: KeyRange,
        seen: Seen,
    ) -> Part | None:
        plan, row_plan = self.plan, group.row_plan
        size = len(group.rows)
        raw_columns = [list(column) for column in zip(*group.cells, strict=True)]
        bad: set[int] = set()
        columns: list[list | pa.Array] = []
        has: dict[int, list[bool]] = {}
        toasted = plan.toasted_index
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
            values, flags = _one_by_one(
                self.names[n], raw, converter, encoding, group.delete, bad, n in toasted
            )
            columns.append(values)
            if n in toasted:
                has[n] = flags
        key_columns = [_as_list(columns[k]) for k in plan.pk_index]
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
        """The Kafka key must name the row's primary key, as the exact pass checks it."""
        plan, keys = self.plan, self.records.keys
        configured = self.plans.configured
        named: dict[int, tuple[RowPlan, list[tuple[int, dict]]]] = {}
        for j, i in enumerate(group.rows):
            key = keys[i]
            if key is None:
                continue
            key_plan = configured
            try:
                if key.startswith(SCHEMA_PREFIX):
                    key_plan = self._key_plan(key)
                    if key_plan is None:
                        bad.add(j)
                        continue
                    document = self.any_json.decode(payload_of(key, schema_prefix(key)))
                else:
                    document = self.any_json.decode(key)
                    if is_wrapped(document):
                        bad.add(j)
                        continue
            except _PARSE_ERRORS:
                bad.add(j)
                continue
            if type(document) is dict:
                named.setdefault(id(key_plan), (key_plan, []))[1].append((j, document))
        # Each primary key column the keys name, converted a column at a time where it can be.
        for key_plan, items in named.values():
            for k, (pk, n) in enumerate(zip(plan.primary_key, plan.pk_index, strict=True)):
                converter = key_plan.converters[n]
                if isinstance(converter, enc.Mismatch):
                    continue  # a key value that doesn't convert names nothing
                raw = [document.get(pk) for _, document in items]
                rule = column_converter(plan.columns[n][1], key_plan.encodings[n])
                converted = rule(raw) if rule is not None else None
                if converted is None:
                    converted = [_or_none(converter, value) for value in raw]
                row_values = key_columns[k]
                for (j, _), in_key in zip(items, _as_list(converted), strict=True):
                    if in_key is not None and in_key != row_values[j]:
                        bad.add(j)

    def _key_plan(self, key: bytes) -> RowPlan | None:
        """The plan of a wrapped key's schema, learnt from the first key that has it."""
        plans = self.plans
        prefix = schema_prefix(key)
        if prefix is None:
            return None
        plan = plans.known_key(prefix)
        if plan is None:
            try:
                document = self.any_json.decode(key)
            except _PARSE_ERRORS:
                return None
            if is_wrapped(document):
                plans.learn_key(key, document["schema"])
            plan = plans.known_key(prefix)
        return plan

    def _row_plan(self, value: bytes) -> RowPlan | None:
        """The plan of a wrapped value's schema, learnt from the first record that has it."""
        prefix = schema_prefix(value)
        if prefix is None:
            return None
        plan = self.plans.known_value(prefix)
        if plan is None:
            try:
                self.decoder.parse(value)
            except BadRecord:
                return None
            plan = self.plans.known_value(prefix)
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

    def _note_shape(self, group: _Group, raw_columns: list[list], seen: Seen) -> None:
        """What the group's change records told of the source's columns, as the exact pass
        notes it record by record."""
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
                if name not in self.plan.index:
                    seen.kind(name, enc.json_kind(value), partitions[i], offsets[i])

    def _part(self, group: _Group, columns: list, has: dict[int, list[bool]]) -> Part:
        plan, schema, batch = self.plan, self.schema, self.records.batch
        rows = pa.array(group.rows, pa.int64())
        size = len(group.rows)
        keep_raw = plan.keep_raw
        key = batch.column("key").take(rows) if keep_raw else pa.nulls(size, pa.binary())
        value = batch.column("value").take(rows) if keep_raw else pa.nulls(size, pa.binary())
        partition = batch.column("partition").take(rows).cast(pa.int32())
        offset = batch.column("offset").take(rows).cast(pa.int64())
        sequence_type = schema.field(SEQUENCE).type
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
            for decoder_index in (plan.index[c] for c in plan.toasted)
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
            *([pa.nulls(size, schema.field(MOVED_FROM).type)] if plan.toasted else []),
        ]
        return Part(group.rows, arrays)


def _with_defaults(
    columns: list[list | pa.Array], absent: dict[int, list[int]], plan: DecodePlan
) -> list[list | pa.Array]:
    """The group's columns with each absent cell holding its column's default (as the exact pass
    gives it): the change was written before the column existed."""
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
    name: str,
    raw: list,
    converter: Any,
    encoding: enc.Encoding,
    delete: bool,
    bad: set[int],
    toasted: bool,
) -> tuple[list, list[bool]]:
    """A column value by value, by the rule the exact pass applies (`cells`): a change's value
    that fails marks its record bad; a delete's becomes null."""
    values: list = []
    flags: list[bool] = []
    for j, cell in enumerate(raw):
        if delete:
            values.append(delete_value(cell, converter, encoding))
            flags.append(False)
            continue
        try:
            value, carried = change_value(name, cell, converter, encoding, toasted=toasted)
        except BadRecord:
            value, carried = None, False
            bad.add(j)
        values.append(value)
        flags.append(carried)
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


def _sequence_reader(plan: DecodePlan):
    """The sequence parts of a parsed envelope, as `envelope.sequence_part` reads them (it
    raises `BadRecord` the same way); `source.<field>` paths read without building a dict."""
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
        return sequence_part({}, path, "bigint")  # raises: missing or not a bigint

    return read


def _any_part(attribute: str, root: str, path: str, kind: str):
    def read(envelope: Any) -> int | str:
        return sequence_part({root: getattr(envelope, attribute)}, path, kind)

    return read


def _field_name(root: str) -> str:
    """The envelope struct's attribute for a top-level field (renamed when no identifier)."""
    if root in _ENVELOPE_FIELDS or (root.isidentifier() and not root.startswith("seq_")):
        return root
    return f"seq_{root.encode().hex()}"


_ENVELOPE_FIELDS = ("op", "after", "before", "source")


def _envelope_decoders(plan: DecodePlan) -> tuple[msgspec.json.Decoder, msgspec.json.Decoder]:
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
