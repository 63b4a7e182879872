"""What a slice's records add up to, counted by the decoder in the same pass that decodes them.

Each Arrow batch the decoder writes carries one `Tally` (JSON, on its first row); the run
combines them with one small collect that also fills the decoded batch's cache. So the hour's
totals, error reasons, truncates, newest source time and the primary key's range (the MERGE's
pruning predicate) cost no Spark job of their own.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

# Key column types whose decoded Python values (ints, strings, ISO dates, timestamps as epoch
# microseconds, Decimals) order exactly as Spark orders the column (strings: UTF-8 byte order is
# code point order). Others (floats with NaN, binary...) get no range, so no pruning.
_RANGED = ("int", "bigint", "string", "date", "timestamp")


def ranged(declared: str) -> bool:
    return declared in _RANGED or declared.startswith("decimal(")


@dataclass
class Tally:
    """Counts over some records of a slice (see the module docstring).

    `changes` are the applicable ones: no error, not a tombstone, not a truncate. `low`/`high`
    hold each ranged primary key column's extremes among them (JSON-safe, see `encode_key`).
    """

    records: int = 0
    tombstones: int = 0
    errors: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    truncates: int = 0
    # The newest truncate's sequence parts (kafka partition and offset included), and the first
    # truncate's [partition, offset].
    truncate_sequence: list | None = None
    first_truncate: list | None = None
    newest_source_us: int | None = None
    changes: int = 0
    deletes: int = 0
    moves: int = 0
    low: dict[str, Any] = field(default_factory=dict)
    high: dict[str, Any] = field(default_factory=dict)

    def add(self, other: Tally) -> Tally:
        self.records += other.records
        self.tombstones += other.tombstones
        self.errors += other.errors
        for reason, n in other.reasons.items():
            self.reasons[reason] = self.reasons.get(reason, 0) + n
        self.truncates += other.truncates
        if other.truncate_sequence is not None and (
            self.truncate_sequence is None or other.truncate_sequence > self.truncate_sequence
        ):
            self.truncate_sequence = list(other.truncate_sequence)
        if other.first_truncate is not None and (
            self.first_truncate is None or other.first_truncate < self.first_truncate
        ):
            self.first_truncate = list(other.first_truncate)
        if other.newest_source_us is not None and (
            self.newest_source_us is None or other.newest_source_us > self.newest_source_us
        ):
            self.newest_source_us = other.newest_source_us
        self.changes += other.changes
        self.deletes += other.deletes
        self.moves += other.moves
        for column, value in other.low.items():
            mine = self.low.get(column)
            self.low[column] = value if mine is None else min(mine, value, key=_order)
        for column, value in other.high.items():
            mine = self.high.get(column)
            self.high[column] = value if mine is None else max(mine, value, key=_order)
        return self

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Tally:
        return cls(**json.loads(text))

    @classmethod
    def combine(cls, texts: Iterable[str | None]) -> Tally:
        total = cls()
        for text in texts:
            if text:
                total.add(cls.from_json(text))
        return total


class KeyRange:
    """Collects one batch's extremes of the ranged primary key columns, as Python values."""

    def __init__(self, columns: Sequence[tuple[str, str]]) -> None:
        self.columns = [(name, declared) for name, declared in columns if ranged(declared)]
        self.low: dict[str, Any] = {}
        self.high: dict[str, Any] = {}

    def add(self, values: dict[str, Any]) -> None:
        for name, _ in self.columns:
            value = values.get(name)
            if value is None:
                continue
            if name not in self.low or value < self.low[name]:
                self.low[name] = value
            if name not in self.high or value > self.high[name]:
                self.high[name] = value

    def encoded(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return (
            {k: encode_key(v) for k, v in self.low.items()},
            {k: encode_key(v) for k, v in self.high.items()},
        )


def encode_key(value: Any) -> Any:
    """A decoded key value as JSON keeps it (`decode_key` gives it back exactly)."""
    if isinstance(value, Decimal):
        return {"decimal": str(value)}
    return value


def decode_key(value: Any) -> Any:
    if isinstance(value, dict):
        return Decimal(value["decimal"])
    return value


def key_value(declared: str, encoded: Any) -> Any:
    """A tally's key extreme as the Python value of the column's Spark type (for a literal)."""
    value = decode_key(encoded)
    if declared == "timestamp":
        return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=value)
    if declared == "date":
        return date.fromisoformat(value)
    return value


def _order(value: Any) -> Any:
    return decode_key(value)
