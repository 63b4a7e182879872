"""What an hour's records told of the source's columns: `SourceShape`, gathered per batch.

The encodings each column arrived in, the declared columns whose encoding no longer fits their
type (schema drift), the types undeclared columns would take (`added_column_types`), the
defaults the connector's schemas declare and the columns some change was written without
(`lacked_columns`). Recorded per run; read by the run (new columns, defaults) and the schema_drift
check.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cdc_assets.decoding import values as enc

if TYPE_CHECKING:
    from cdc_assets.decoding.plan import DecodePlan


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
    # The table's columns (declared or added) that some change's Connect schema did not name: the
    # source table gained them after that change was written (`ALTER TABLE ... ADD COLUMN`), or
    # no longer has them.
    absent: set[str] = field(default_factory=set)

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
        self.absent |= other.absent
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
                "absent": sorted(self.absent),
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
            absent=set(raw.get("absent", ())),
        )

    @classmethod
    def combine(cls, texts: Iterable[str | None]) -> SourceShape:
        shape = cls()
        for text in texts:
            if text:
                shape.merge(cls.from_json(text))
        return shape


def lacked_columns(
    shape: SourceShape | None, seen_before: Iterable[str], recorded: Iterable[str]
) -> list[str]:
    """The source columns that some change the mirror's runs read was written without, as a run
    records them for the next (`recorded`: the earlier runs' list).

    A column joins when a change of the hour lacked it (`SourceShape.absent`), or when the
    hour's rows carry it and the earlier runs' rows (`seen_before`, the source columns they saw)
    did not: those changes were written before the source table had it. A column the table had
    since it was created is in every change, and never joins.
    """
    joined = set(recorded)
    if shape is not None:
        joined |= shape.absent
        seen_before = set(seen_before)
        if seen_before:  # nothing to compare with before the first run that saw a row
            joined |= set(shape.fields) - seen_before
    return sorted(joined)


def added_column_types(shape: SourceShape, known: Iterable[str]) -> dict[str, str]:
    """Types for source columns that appeared undeclared, from what the hour's records said.

    With a schema: the type its encoding calls for (`values.suggested_type`). Without:
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


def add_json_kinds(
    plan: DecodePlan,
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
        if name not in plan.index:
            types = {_JSON_TYPES.get(k, f"{k} (declare it)") for k in kinds if k != "null"}
            shape.types.setdefault(name, set()).update(types)
        elif name not in plan.added:
            configured = plan.configured[plan.index[name]]
            fits = enc.json_kinds_of(configured)
            wrong = {k for k in kinds if k != "null" and k not in fits}
            declared = plan.columns[plan.index[name]][1]
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
